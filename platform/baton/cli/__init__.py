"""The `baton` command. Thin: parse, call the API, print. A failure is one line and a
non-zero exit code; `BATON_DEBUG=1` shows the traceback."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
from typing import Optional

from baton.cli import cluster, validate


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton", description="Elastic PyTorch training on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train a job (an embedded local Ray unless --address)")
    run.add_argument("job", help="the job's YAML file")
    run.add_argument("--address", help="join a running Ray cluster (e.g. auto, ray://HOST:10001)")
    run.add_argument("--resume", action="store_true",
                     help="require a checkpoint to resume from (resuming is automatic anyway)")
    run.add_argument("--rebase-data", action="store_true",
                     help="resume on a changed corpus, from the start of the next epoch")
    run.add_argument("--until", type=int, metavar="STEP",
                     help="stop at this step with a checkpoint; run again to go on (the "
                          "schedule stays train.steps's)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a spec value, e.g. --set train.steps=20 (repeatable)")
    run.add_argument("--quiet", action="store_true", help="no progress line")

    sw = sub.add_parser("sweep", help="train a job for every combination of a grid of settings, "
                        "a trial after another, and rank the trials")
    sw.add_argument("job", help="the job's YAML file")
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=[VALUES]",
                    help="a key and its values as a YAML list, e.g. --grid 'train.lr=[1e-3, 3e-3]' "
                         "(repeatable: every combination is a trial); with --trials, also a "
                         "range: loguniform(LOW, HIGH), uniform(LOW, HIGH), randint(LOW, HIGH)")
    sw.add_argument("--trials", type=int, metavar="N",
                    help="a random search: N trials, each drawing every --grid key's value")
    sw.add_argument("--seed", type=int, default=0, help="the random search's draws (default 0)")
    sw.add_argument("--search", choices=["random", "tpe"], default="random",
                    help="with --trials: random draws (the default), or tpe: each trial suggested "
                         "from the results so far (Optuna's TPE; pip install 'baton[search]'); "
                         "with --halving (--async, or --brackets 2 or more), BOHB: from the rungs "
                         "judged so far too")
    sw.add_argument("--concurrent", type=_count_or_auto, default=1, metavar="N",
                    help="train up to N trials at once, where the cluster holds their workers "
                         "together (default 1; auto: as many as it holds)")
    sw.add_argument("--halving", type=int, metavar="ETA",
                    help="successive halving: every trial a short way, the best 1/ETA of them "
                         "ETA times as far, and so on to train.steps; the others are cut (3 is usual)")
    sw.add_argument("--first-rung", type=int, metavar="STEP",
                    help="with --halving, the step the trials are first judged at (default: "
                         "train.steps / ETA^k, for as many rungs as the trials allow)")
    sw.add_argument("--async", action="store_true", dest="asynchronous",
                    help="with --halving, asynchronous halving (ASHA): a trial goes on as soon as "
                         "it stands among the best 1/ETA of those judged at its rung so far, and "
                         "no rung waits for its slowest trial (for --concurrent sweeps)")
    sw.add_argument("--brackets", type=int, default=1, metavar="B",
                    help="with --halving, Hyperband: the trials dealt out (by --seed) among B "
                         "halvings, each judging from a rung later than the one before, the "
                         "last of rungs + 1 training its trials to the end (default 1)")
    sw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a spec value for every trial (repeatable)")
    sw.add_argument("--address", help="join a running Ray cluster (e.g. auto, ray://HOST:10001)")
    sw.add_argument("--quiet", action="store_true", help="no progress line")
    sw.add_argument("--list", action="store_true",
                    help="list the trials (each job checked) and where each is (running, paused, "
                         "finished: a concurrent sweep watched from another shell), and train nothing")

    ev = sub.add_parser("eval", help="evaluate a job's checkpoint on its held-out data "
                        "(eval.fraction or eval.path), without training")
    ev.add_argument("job", help="the job's YAML file")
    _which_checkpoint(ev)
    ev.add_argument("--address", help="join a running Ray cluster (e.g. auto, ray://HOST:10001)")
    ev.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a spec value, e.g. --set eval.path=test-set (repeatable)")

    init = sub.add_parser("init", help="print a commented job file to start from")
    init.add_argument("task", choices=["language_model", "classification"])

    val = sub.add_parser("validate", help="check a job file without running anything")
    val.add_argument("job")
    val.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    rep = sub.add_parser("report", help="a run's pictures: loss, throughput, world size with "
                         "failures and rescales, a pipeline step's swimlane (PNG and HTML)")
    rep.add_argument("run", help="an MLflow run id, or a job name (its newest run)")
    rep.add_argument("--tracking-uri", help="the MLflow store (default: $MLFLOW_TRACKING_URI, "
                     "else mlflow.db here or under $BATON_STORAGE)")
    rep.add_argument("--out", help="folder to write report.png and report.html to "
                     "(default: report-JOB)")
    rep.add_argument("--step", type=int, help="the traced pipeline step to draw")

    exp = sub.add_parser("export", help="write a job's trained model as safetensors files "
                         "(Hugging Face's layout), from its newest verified checkpoint")
    exp.add_argument("job", help="the job's YAML file (where its checkpoints are)")
    exp.add_argument("--out", required=True,
                     help="folder to create: a local path or a URI (s3://bucket/models/x)")
    _which_checkpoint(exp)
    exp.add_argument("--max-file-mb", type=int, default=5000,
                     help="split into files of at most this many MB (default 5000, as "
                          "Hugging Face's save_pretrained)")
    exp.add_argument("--hf", action="store_true",
                     help="the built-in gpt as Hugging Face's GPT-2 (GPT2LMHeadModel), llama as its "
                          "Llama (LlamaForCausalLM; Qwen2ForCausalLM or Qwen3ForCausalLM where "
                          "its options are theirs): their names and a config.json, for "
                          "transformers and what reads its folders")
    exp.add_argument("--adapters", action="store_true",
                     help="model.lora's adapters alone, as PEFT's adapter folder "
                          "(adapter_model.safetensors, adapter_config.json), for the model the job "
                          "started from")
    exp.add_argument("--ema", action="store_true",
                     help="the moving average of the weights that train.ema kept, in place of "
                          "the weights")
    exp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    frk = sub.add_parser("fork", help="start a new job from another job's checkpoint (weights, "
                         "optimizer state, data cursor) with its own training settings")
    frk.add_argument("job", help="the new job's YAML file")
    frk.add_argument("--from", required=True, dest="source", metavar="JOB.yaml",
                     help="the job whose checkpoint it starts from")
    _which_checkpoint(frk)
    frk.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a key of the new job's file")

    smp = sub.add_parser("sample", help="text from an exported language model (baton export)")
    smp.add_argument("folder", help="the folder baton export wrote (a local path or a URI)")
    smp.add_argument("--prompt", required=True, help="the text to go on from")
    smp.add_argument("--tokens", type=int, default=200, help="how many tokens to write (default 200)")
    smp.add_argument("--temperature", type=float, default=0.8,
                     help="below 1: safer choices; 0: always the likeliest (default 0.8)")
    smp.add_argument("--top-k", type=int, default=200, help="draw from the k likeliest (default 200)")
    smp.add_argument("--seed", type=int, default=0)

    cluster.add_parsers(sub)
    _more_parsers(sub)

    data = sub.add_parser("data", help="data preparation")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="write built-in data, or tokenise text, into Parquet")
    prep.add_argument("corpus", choices=["stdlib", "text", "digits"],
                      help="stdlib: the Python standard library's sources; text: your documents "
                           "(--input); digits: scikit-learn's bundled digits (a classification "
                           "table: pixels, label)")
    prep.add_argument("--out", required=True, help="folder to create")
    prep.add_argument("--seq-len", type=int, default=128,
                      help="tokens of context per sample (rows hold seq_len + 1 tokens)")
    prep.add_argument("--input", help="text: a Parquet or JSON Lines file, or a folder of them")
    prep.add_argument("--column", default="text", help="text: the column or field holding documents")
    prep.add_argument("--prompt-column",
                      help="text: the column or field holding each document's prompt: each row "
                           "then has a loss_mask column, 1 on the responses (--column), for "
                           "data.loss_mask_column")
    prep.add_argument("--one-per-row", action="store_true",
                      help="text: each document (and its prompt) at the start of a row of its own, "
                           "padded, the padding left out by a loss_mask column, not packed")
    prep.add_argument("--tokenizer", help="text: module:function, texts -> token id lists "
                                          "(default: bytes, end of document 0)")
    prep.add_argument("--eod-token", type=int, help="text: your tokenizer's end-of-document id")
    prep.add_argument("--address", help="text: a Ray cluster to run on (default: an embedded one)")
    chk = data_sub.add_parser("check", help="read every row group of a job's data as a run would "
                              "and list those whose rows it would refuse")
    chk.add_argument("job", help="the job's YAML file")
    chk.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    chk.add_argument("--address", help="a Ray cluster to read on (default: an embedded one)")
    return p


def _prepare_text(args) -> int:
    import logging

    import ray

    from baton.api import join_cluster, probe_cluster, shutdown_ray, start_local_ray
    from baton.data.text import prepare_text

    if not args.input:
        print("baton: error: data prepare text needs --input", file=sys.stderr)
        return 2
    if os.path.exists(args.out):
        print(f"baton: error: {args.out} already exists; choose a new --out", file=sys.stderr)
        return 2
    if args.address:
        probe_cluster(args.address)
        join_cluster(args.address)
    else:
        start_local_ray()
    ray.data.DataContext.get_current().enable_progress_bars = False
    # a file that cannot be read is one line (prepare_text's error): not Ray Data's ERROR
    # lines about its task and where its stack trace went, printed before it
    logging.getLogger("ray.data").setLevel(logging.CRITICAL)
    try:
        info = prepare_text(args.input, args.out, args.seq_len, args.column, args.tokenizer,
                            args.eod_token, prompt_column=args.prompt_column,
                            one_per_row=args.one_per_row)
    finally:
        shutdown_ray()
    print(f"wrote {info['samples']:,} samples of {args.seq_len + 1} tokens from "
          f"{info['documents']:,} documents in {info['files']} files ({info['tokens']:,} tokens, "
          f"vocabulary {info['vocab_size']}) to {args.out}")
    if args.one_per_row:
        print(f"  a document a row, padded; {info['cut']:,} longer than a row cut to it")
    if args.prompt_column or args.one_per_row:
        print(f"  {info['targets']:,} of the tokens are targets ("
              + ("the responses'" if args.prompt_column else "the documents', not the padding")
              + "): train on them alone with data.loss_mask_column: loss_mask")
    if not args.one_per_row and info["documents"] > info["samples"]:  # (short documents)
        print(f"  {info['documents'] / info['samples']:.1f} documents a row, each attending to those "
              "before it in its row unless data.document_mask: true keeps them apart")
    return 0


def _more_parsers(sub) -> None:
    sc = sub.add_parser("scale", help="set the largest world of a running elastic job (it gives "
                        "workers back, or grows, at its next check)")
    sc.add_argument("job", help="the job's YAML file")
    sc.add_argument("--max-dp", type=int, metavar="N",
                    help="at most N data-parallel replicas (0: suspend the job until --clear)")
    sc.add_argument("--clear", action="store_true", help="back to the job's own elastic.max_dp")
    sc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a spec value, as the run was given (repeatable)")

    q = sub.add_parser("quota", help="set, clear or list the quotas of a running cluster: the "
                       "CPUs and GPUs the jobs naming one (resources.quota) may hold together")
    q.add_argument("name", nargs="?", help="the quota (none: list them all, with their use)")
    q.add_argument("--cpus", type=float, help="the CPUs its jobs' workers may hold together")
    q.add_argument("--gpus", type=float, help="the GPUs its jobs' workers may hold together")
    q.add_argument("--clear", action="store_true", help="remove the quota (its jobs are bound by none)")
    q.add_argument("--address", help="the cluster (default: $RAY_ADDRESS, else the one on this "
                   "machine)")

    from baton.k8s import MLFLOW_SERVICE

    k = sub.add_parser("k8s", help="print a KubeRay RayJob (or RayCluster) for a job")
    k.add_argument("job", help="the job's YAML file, relative to the project folder")
    k.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    k.add_argument("--kind", default="RayJob", choices=["RayJob", "RayCluster"])
    k.add_argument("--name", help="the object's name (default: the job's name)")
    k.add_argument("--namespace")
    k.add_argument("--image", help="an image with baton and the project (k8s/Dockerfile)")
    k.add_argument("--pvc", default="baton-shared",
                   help="ReadWriteMany claim for data, checkpoints and MLflow ('' for none)")
    k.add_argument("--checkpoint-uri", help="checkpoints to object storage, e.g. s3://bucket/baton")
    k.add_argument("--s3-secret", help="Secret holding AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    k.add_argument("--token-secret", default="baton-ray-token",
                   help="Secret holding Ray's auth_token (key auth_token)")
    k.add_argument("--no-auth", action="store_true",
                   help="no token authentication: anyone who reaches the dashboard runs code")
    k.add_argument("--gcs-redis", help="external Redis host:port: the cluster survives losing its head")
    k.add_argument("--redis-secret", help="Secret holding that Redis's password (key: password)")
    k.add_argument("--mlflow-uri", default=MLFLOW_SERVICE,
                   help=f"MLflow tracking server (default: k8s/mlflow.yaml's, {MLFLOW_SERVICE}); "
                        "'sqlite' for a database file on the claim (one job at a time)")
    k.add_argument("--worker-memory", help="memory per worker pod (default 16Gi GPU, 4Gi CPU)")
    k.add_argument("--min-workers", type=int, help="fewest worker pods (default: min_dp x pp x tp)")
    k.add_argument("--max-workers", type=int, help="most worker pods (default: max_dp x pp x tp)")
    k.add_argument("--backoff-limit", type=int, default=2,
                   help="whole-job retries, each resuming from the latest checkpoint")
    k.add_argument("-o", "--output", help="write to this file instead of printing")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.argv = argv
    # A `module:function` model builder in the working directory imports here as it does on
    # Ray's local workers, which get the driver's working directory on their path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from baton.errors import BatonError
    from baton.storage import redact

    try:
        return _dispatch(args)
    except BatonError as e:
        if os.environ.get("BATON_DEBUG"):
            raise
        print(f"baton: error: {redact(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from baton.interrupts import received

        signum = received(e)
        print(f"baton: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum


def console() -> int:
    """The `baton` command: `main`, then an exit that skips Python's last garbage collection.
    At exit the interpreter collects every object the process made (torch's, Ray's and
    MLflow's modules among them): 2.8 s after a `baton run` on the 2-core machine, once the
    run was over and printed. Frozen (`gc.freeze`), they go with the process instead: 0.44 s
    (medians, `benchmarks/start.py`, docs/benchmarks.md).
    Nothing is lost: by then baton has closed its files and ended the MLflow run and Ray,
    and the interpreter still flushes stdout and stderr and runs the atexit handlers. Only
    here, never in `main`, which tests and programs call in a process that goes on."""
    code = main()
    gc.freeze()
    return code


def _count_or_auto(text: str) -> int | str:
    """--concurrent's value: a whole number, or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, or auto") from None


def _which_checkpoint(parser: argparse.ArgumentParser) -> None:
    """`--step N` or `--best` (args.step: N, "best", or None for the newest that verifies)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the checkpoint (default: the newest that verifies)")
    which.add_argument("--best", action="store_const", const="best", dest="step",
                       help="the checkpoint the job's checkpoint.best kept: the best held-out "
                            "evaluation")


def _grid(job: str, items: list[str]) -> dict:
    """--grid KEY=[V1, V2] items as {key: values}: each value a YAML list, or a range to draw
    from (a string `sweeps.plan` reads: loguniform(1e-4, 1e-2))."""
    import yaml

    from baton.errors import SpecError

    axes = {}
    for item in items:
        key, sep, text = item.partition("=")
        try:
            values = yaml.safe_load(text) if sep else None
        except yaml.YAMLError as e:
            raise SpecError(f"{job}: --grid {item!r}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not key or not (isinstance(values, str) or isinstance(values, list) and values):
            raise SpecError(f"{job}: --grid {item!r}: give KEY=[VALUES], a YAML list, e.g. "
                            "--grid 'train.lr=[1e-3, 3e-3]', or with --trials a range, e.g. "
                            "--grid 'train.lr=loguniform(1e-4, 1e-2)'")
        if key in axes:
            raise SpecError(f"{job}: --grid {key}: given twice; put every value in one list")
        axes[key] = values
    return axes


def _dispatch(args: argparse.Namespace) -> int:
    commands = {"init": _init, "validate": validate.validate, "data": _data, "run": _run, "eval": _eval,
                "sweep": _sweep, "sample": _sample, "scale": _scale, "quota": _quota, "report": _report,
                "export": _export, "fork": _fork, "k8s": _k8s, **cluster.COMMANDS}
    return commands[args.command](args)


def _quota(args: argparse.Namespace) -> int:
    """Set, clear or list a running cluster's quotas."""
    from baton import api
    from baton.errors import SpecError
    from baton.spec_checks import QUOTA_NAME

    bounds = (args.cpus, args.gpus)
    if args.name is None and (args.clear or bounds != (None, None)):
        raise SpecError("baton quota: name the quota to set or clear")
    if args.name is not None and not QUOTA_NAME.fullmatch(args.name):
        raise SpecError(f"baton quota: {args.name!r}: a quota's name is 1 to 64 letters, digits, _ . -")
    if args.clear and bounds != (None, None):
        raise SpecError("baton quota: give --cpus/--gpus, or --clear, not both")
    if any(b is not None and not (0 <= b < float("inf")) for b in bounds):
        raise SpecError("baton quota: --cpus and --gpus must be 0 or more")
    if args.name is not None and not args.clear and bounds == (None, None):
        raise SpecError(f"baton quota {args.name}: give --cpus N and/or --gpus N (or --clear)")
    address = args.address or api.cluster_address_from_env() or "auto"
    found = api.quotas(address, set_to=(args.name, *bounds) if bounds != (None, None) else None,
                       clear=args.name if args.clear else None)
    for name, q in found.items():
        bound = ", ".join(f"{q[k]:g} {k}" for k in ("CPU", "GPU") if q[k] is not None)
        held = ", ".join(f"{q['held'][k]:g} {k}" for k in ("CPU", "GPU") if q[k] is not None)
        jobs = ", ".join(f"{job} ({state})" for job, state in q["jobs"])
        print(f"{name}: {bound}; held {held}" + (f"; jobs: {jobs}" if jobs else ""))
    if not found:
        print("no quotas set" + (f" (cleared {args.name})" if args.clear else ""))
    return 0


def _init(args: argparse.Namespace) -> int:
    """A template job file for a task, on stdout."""
    from importlib.resources import files

    sys.stdout.write((files("baton") / "templates" / f"{args.task}.yaml").read_text())
    return 0


def _data(args: argparse.Namespace) -> int:
    """Write built-in data, or tokenise text, into Parquet shards; or check a job's data."""
    from baton.data.corpus import prepare_stdlib

    if args.data_command == "check":
        return _check_data(args)
    if args.seq_len < 1:
        print("baton: error: --seq-len must be at least 1", file=sys.stderr)
        return 2
    if args.corpus == "text":
        return _prepare_text(args)
    try:
        if args.corpus == "digits":
            from baton.data.digits import prepare_digits

            info = prepare_digits(args.out)
            print(f"wrote {info['samples']:,} images of {info['features']} pixels "
                  f"({info['classes']} classes, {info['row_groups']} row groups) to {args.out}")
            return 0
        info = prepare_stdlib(args.out, args.seq_len)
    except FileExistsError:
        print(f"baton: error: {args.out} already exists; choose a new --out", file=sys.stderr)
        return 2
    print(f"wrote {info['samples']:,} samples of {args.seq_len + 1} tokens from "
          f"{info['files']} files ({info['tokens']:,} bytes, Python {info['python']}) to {args.out}")
    return 0


def _check_data(args: argparse.Namespace) -> int:
    """Every row group of a job's data read and checked: 0 when all are good, 1 when any is
    not (each a line), 2 for a job or data its footers refuse."""
    from baton import api

    got = api.check_data(args.job, args.set, args.address,
                         on_bad=lambda line: print(f"bad: {line}", flush=True))
    print(f"{args.job}: {got['row_groups']:,} row groups ({got['samples']:,} samples, "
          f"{got['bytes'] / 2**20:,.1f} MiB) read in {got['s']:.1f} s: "
          + (f"{got['bad']:,} with rows a run would refuse" if got["bad"] else "every row good"))
    return 1 if got["bad"] else 0


def _run(args: argparse.Namespace) -> int:
    """Train a job (an embedded local Ray unless --address)."""
    from baton import api

    from baton.spec import load_spec

    spec = load_spec(args.job, args.set)
    result = api.run(spec, source=args.job, address=args.address,
                     resume=True if args.resume else None, rebase_data=args.rebase_data,
                     show_progress=not args.quiet, until=args.until)
    from baton.storage import redact

    ended = ("paused" if result.state == "paused" else "finished") + f" at step {result.step}"
    ended += (" (stopped early)" if result.stopped_early else
              f" of {spec.train.steps}" if result.state == "paused" else "")
    print(f"{result.job}: {ended}, loss {result.loss:.4f}, "
          f"{result.tokens_per_s:,.0f} {'tokens' if spec.task == 'language_model' else 'samples'}/s; "
          + "".join(f"{k} {v:.4g}; " for k, v in result.eval.items() if k != "eval_samples")
          + f"checkpoint {redact(result.checkpoint)}; MLflow run {result.run_id}")
    if result.best is not None:
        print(f"  best by {spec.checkpoint.best}: step {result.best[0]} ({result.best[1]:.4g}), "
              "kept; export it with baton export --best")
    if result.state == "paused":
        print(f"  to go on from step {result.step}: baton run {args.job}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    """One held-out pass over a checkpoint, logged to a new MLflow run."""
    from baton import api

    from baton.spec import load_spec

    spec = load_spec(args.job, args.set)
    result = api.evaluate(spec, source=args.job, step=args.step, address=args.address)
    e = result.eval
    print(f"{result.job}: step {result.step} on {e['eval_samples']:,} held-out samples: "
          + ", ".join(f"{k} {v:.4g}" for k, v in e.items() if k != "eval_samples")
          + f"; MLflow run {result.run_id}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    """Trials over a grid or random draws, ranked (or listed with --list)."""
    from baton import api, halving, sweeps

    axes = _grid(args.job, args.grid)
    if args.list and args.search == "tpe":
        from baton import search

        lowest = sweeps.ranked_by(sweeps.maker(args.job, args.set)({}).spec)[1]
        if args.halving is not None:  # (which trials depends on the results as they come)
            model = search.Model(args.job, axes, args.set, args.trials, args.seed, lowest, print)
            halving.check_halving([model.base] * model.n, args.halving, args.first_rung, args.job,
                                  args.asynchronous, args.brackets, suggested=True)
            for line in halving.describe(search.brackets(model, args.halving, args.first_rung,
                                                         args.brackets), args.halving, args.asynchronous):
                print(line)
            return 0
        shown = search.replay(args.job, axes, args.set, args.trials, args.seed, lowest)
        for t in shown:
            where = sweeps.progress(t.spec)
            print(f"{t.name}: {sweeps.values_of(t)}" + (f"; {where}" if where else ""))
        print(f"{len(shown)} of {args.trials} trials suggested so far (a run a trial at a time "
              "suggests the next from these results)")
        return 0
    if args.list:
        trials = sweeps.plan(args.job, axes, args.set, args.trials, args.seed)
        for t in trials:
            where = sweeps.progress(t.spec)
            print(f"{t.name}: " + ", ".join(f"{k}={v}" for k, v in t.values.items())
                  + (f"; {where}" if where else ""))
        halving.check_halving(trials, args.halving, args.first_rung, args.job, args.asynchronous,
                              args.brackets)
        if args.halving is not None:
            for line in halving.describe(halving.dealt(trials, args.halving, args.first_rung,
                                                       args.brackets, args.seed), args.halving,
                                         args.asynchronous):
                print(line)
        return 0
    trials = api.sweep(args.job, axes, args.set, trials=args.trials, seed=args.seed,
                       halving=args.halving, first_rung=args.first_rung, concurrent=args.concurrent,
                       asynchronous=args.asynchronous, brackets=args.brackets, search=args.search,
                       address=args.address, show_progress=not args.quiet)
    metric, lowest = sweeps.ranked_by(trials[0].spec)
    print(f"{args.job}: {len(trials)} trials, best first by {metric} "
          f"({'lowest' if lowest else 'highest'}{', its best checkpoint' if trials[0].spec.checkpoint.best else ''}"
          + ("; those that trained furthest first" if args.halving else "") + "):")
    for line in sweeps.table(trials, metric):
        print(line)
    return 1 if all(t.state == "failed" for t in trials) else 0


def _sample(args: argparse.Namespace) -> int:
    """Text from an exported language model."""
    from baton.sample import sample

    for flag, value, least in (("--tokens", args.tokens, 1), ("--top-k", args.top_k, 1),
                               ("--temperature", args.temperature, 0)):
        if value < least:
            print(f"baton: error: {flag} must be at least {least}", file=sys.stderr)
            return 2
    print(sample(args.folder, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
    return 0


def _scale(args: argparse.Namespace) -> int:
    from baton.coordinator import ceiling
    from baton.errors import SpecError
    from baton.spec import load_spec

    spec = load_spec(args.job, args.set)
    if (args.max_dp is None) == (not args.clear):
        raise SpecError(f"{args.job}: give --max-dp N, or --clear")
    ceiling.ask(spec, args.max_dp, args.job)
    if args.max_dp:
        now = f"at most {args.max_dp} replica{'s' * (args.max_dp > 1)}"
    elif args.max_dp == 0:
        now = "suspended (every worker let go; --clear goes on)"
    elif spec.dp_range[0] < spec.dp_range[1]:
        now = f"back to elastic.max_dp ({spec.dp_range[1]})"
    else:
        now = "no longer suspended"
    print(f"{spec.name}: {now}, from its next check (within elastic.rescale_check_s, "
          f"{spec.elastic.rescale_check_s:g} s)")
    return 0


def _report(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    from baton.errors import BatonError
    from baton.tracking import report
    from baton.tracking.mlflow_tracker import HTTP_DEFAULTS, default_uri

    for key, value in HTTP_DEFAULTS.items():  # no download bars; a server away fails in 10 s
        os.environ.setdefault(key, value)
    uri = args.tracking_uri or default_uri()
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):]):
        raise BatonError(f"no MLflow store at {uri}; set --tracking-uri or $MLFLOW_TRACKING_URI")
    client = MlflowClient(tracking_uri=uri)
    run = report.find_run(client, args.run)
    out = args.out or f"report-{run.info.run_name or run.info.run_id}"
    rep = report.build_any(client, run, out, args.step)
    if rep.sweep:  # a line a trial
        print(f"wrote {rep.png} and {rep.html}: {len(rep.points)} trials of sweep run {rep.run_id}")
        return 0
    print(f"wrote {rep.png} and {rep.html}: {rep.points['loss']} steps of MLflow run {rep.run_id}"
          + (f", pipeline step {rep.swimlane_step}" if rep.swimlane_step else ""))
    return 0


def _export(args: argparse.Namespace) -> int:
    from baton.checkpoint.export import FORM_OF, export
    from baton.spec import load_spec

    if args.max_file_mb < 1:
        print("baton: error: --max-file-mb must be at least 1", file=sys.stderr)
        return 2
    spec = load_spec(args.job, args.set)
    about = export(spec, args.out, args.step, args.max_file_mb * 10**6, hf=args.hf, ema=args.ema,
                   adapters=args.adapters)
    files = about["files"]
    if args.adapters:
        a = about["adapters"]
        print(f"exported step {about['step']} of {about['job']}: its adapters"
              + (" (their average)" if args.ema else "")
              + f" (LoRA rank {a['rank']}, alpha {a['alpha']:g}, on {a['layers']} layers): "
              f"{about['parameters']:,} parameters ({about['bytes'] / 2**20:,.2f} MiB) to {args.out}")
        base = spec.model.init_from or "the model it started from"
        print(f'  load them: peft.PeftModel.from_pretrained(model, "{args.out}"), model: {base}'
              + (" (exported --hf)" if about["names"] in FORM_OF else ""))
        return 0
    print(f"exported step {about['step']} of {about['job']}"
          + (" (the average of its weights)" if args.ema else "")
          + f": {about['parameters']:,} parameters "
          f"({about['bytes'] / 2**20:,.1f} MiB) to {args.out} ("
          + (files[0] if len(files) == 1 else f"{len(files)} files") + ")")
    print(f'  load it: baton.load_model("{args.out}")'
          + (f', or transformers\' from_pretrained("{args.out}")'
             if about["names"] != "baton" else ""))
    return 0


def _fork(args: argparse.Namespace) -> int:
    from baton.checkpoint.fork import fork
    from baton.spec import load_spec
    from baton.storage import redact

    spec, source = load_spec(args.job, args.set), load_spec(args.source)
    meta = fork(spec, source, args.step, log=lambda line: print(line, file=sys.stderr))
    print(f"{spec.name} starts at step {meta['step']} of {source.name} (its weights, optimizer "
          f"state and data cursor), in {redact(spec.checkpoint_dir)}; train it: baton run {args.job}")
    return 0


def _k8s(args: argparse.Namespace) -> int:
    from baton import k8s
    from baton.spec import load_spec

    spec = load_spec(args.job, args.set)
    if args.backoff_limit < 0:
        print(f"baton: error: --backoff-limit {args.backoff_limit} is invalid; give 0 or more "
              "(whole-job retries)", file=sys.stderr)
        return 2
    if not args.no_auth and not args.token_secret.strip():
        print("baton: error: --token-secret is empty: name the Secret holding Ray's token (key "
              "auth_token), or pass --no-auth to render a cluster without authentication",
              file=sys.stderr)
        return 2
    opts = k8s.K8sOptions(
        kind=args.kind, name=args.name, namespace=args.namespace,
        image=args.image or k8s.K8sOptions.image, pvc=args.pvc or None,
        checkpoint_uri=args.checkpoint_uri, s3_secret=args.s3_secret,
        token_secret=None if args.no_auth else args.token_secret, redis_address=args.gcs_redis,
        redis_secret=args.redis_secret, mlflow_uri=None if args.mlflow_uri == "sqlite" else args.mlflow_uri,
        worker_memory=args.worker_memory, min_workers=args.min_workers,
        max_workers=args.max_workers, backoff_limit=args.backoff_limit)
    import shlex

    text = (f"# Rendered by: baton {shlex.join(args.argv)}\n"
            + k8s.to_yaml(k8s.render(spec, os.path.relpath(args.job), args.set, opts)))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0

