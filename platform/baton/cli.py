"""The `baton` command. Thin: parse, call the API, print. A failure is one line and a
non-zero exit code; `BATON_DEBUG=1` shows the traceback."""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from typing import Optional


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
    sw.add_argument("--concurrent", type=int, default=1, metavar="N",
                    help="train up to N trials at once, where the cluster holds their workers "
                         "together (default 1)")
    sw.add_argument("--halving", type=int, metavar="ETA",
                    help="successive halving: every trial a short way, the best 1/ETA of them "
                         "ETA times as far, and so on to train.steps; the others are cut (3 is usual)")
    sw.add_argument("--first-rung", type=int, metavar="STEP",
                    help="with --halving, the step the trials are first judged at (default: "
                         "train.steps / ETA^k, for as many rungs as the trials allow)")
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
                     help="the built-in gpt as Hugging Face's GPT-2 (GPT2LMHeadModel: its names "
                          "and a config.json), for transformers and what reads its folders")
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

    _remote_parsers(sub)

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
    prep.add_argument("--tokenizer", help="text: module:function, texts -> token id lists "
                                          "(default: bytes, end of document 0)")
    prep.add_argument("--eod-token", type=int, help="text: your tokenizer's end-of-document id")
    prep.add_argument("--address", help="text: a Ray cluster to run on (default: an embedded one)")
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
                            args.eod_token)
    finally:
        shutdown_ray()
    print(f"wrote {info['samples']:,} samples of {args.seq_len + 1} tokens from "
          f"{info['documents']:,} documents in {info['files']} files ({info['tokens']:,} tokens, "
          f"vocabulary {info['vocab_size']}) to {args.out}")
    return 0


def _remote_parsers(sub) -> None:
    def cluster_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", help="the head's dashboard, e.g. http://HEAD:8265 (default: "
                       "$RAY_API_SERVER_ADDRESS, then $RAY_ADDRESS)")
        p.add_argument("--token-file", help="Ray's auth token (default: $RAY_AUTH_TOKEN, "
                       "$RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)")

    sm = sub.add_parser("submit", help="run a job on a remote Ray cluster (Ray's job API)")
    sm.add_argument("job", help="the job's YAML file, inside the folder to upload")
    cluster_args(sm)
    sm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a spec value (passed on to baton run)")
    sm.add_argument("--until", type=int, metavar="STEP",
                    help="stop at this step with a checkpoint (baton run --until); submit again to go on")
    sm.add_argument("--id", help="submission id (default: baton-JOBNAME-RANDOM)")
    sm.add_argument("--root", help="the folder to upload (default: the current one)")
    sm.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                    help="leave out files matching a .gitignore pattern (repeatable)")
    sm.add_argument("--include", action="append", default=[], metavar="PATTERN",
                    help="send credentials files matching this .gitignore pattern, which are "
                    "left out otherwise (.env, *.pem, *.key, id_rsa*, .netrc, .aws/, ...)")
    sm.add_argument("--max-upload-mb", type=float, default=100.0,
                    help="refuse a larger upload (default 100)")
    sm.add_argument("--storage", help="a folder every node mounts: the job's relative data, "
                    "checkpoint and MLflow paths live there, so a resubmission resumes")
    sm.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for the job (repeatable)")
    sm.add_argument("--no-wait", action="store_true", help="submit and return")
    sm.add_argument("--dry-run", action="store_true", help="show what would be sent; send nothing")

    sc = sub.add_parser("scale", help="set the largest world of a running elastic job (it gives "
                        "workers back, or grows, at its next check)")
    sc.add_argument("job", help="the job's YAML file")
    sc.add_argument("--max-dp", type=int, metavar="N",
                    help="at most N data-parallel replicas (0: suspend the job until --clear)")
    sc.add_argument("--clear", action="store_true", help="back to the job's own elastic.max_dp")
    sc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a spec value, as the run was given (repeatable)")

    for name, text in (("status", "a job's state: a local job's (its YAML file or name), else "
                                  "a submitted one's"),
                       ("logs", "a submitted job's output"), ("stop", "stop a submitted job")):
        p = sub.add_parser(name, help=text)
        p.add_argument("id", help="the submission id" + (
            ", or a job's YAML file or name (its status.json beside its checkpoints)"
            if name == "status" else ""))
        cluster_args(p)
        if name == "status":
            p.add_argument("--checkpoint-path", help="where a job named by its name keeps its "
                           "checkpoints (default: checkpoints, under $BATON_STORAGE if set)")
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true", help="stream until the job ends")
    cluster_args(sub.add_parser("list", help="the cluster's jobs"))

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


def _sharding_line(spec) -> str:
    """The layout of a sharded job and the state each worker holds, next to DDP's."""
    from baton.models import layer_params
    from baton.parallel.partition import bounds, plan_stages
    from baton.parallel.schedule import stage_of
    from baton.parallel.sharding import NAMES, estimate_bytes

    d, shards = spec.parallel, spec.dp_shard
    counts = layer_params(spec.model)
    n = sum(counts)
    if d.pp > 1:  # the pipeline rank with the most parameters (partition: time, estimated so)
        spans = bounds(plan_stages(spec, lambda: counts))
        n = max(sum(sum(counts[slice(*spans[stage_of(r, c, d.pp)])]) for c in range(spec.chunks))
                for r in range(d.pp))
    mine, ddp = estimate_bytes(n, d.shard, shards), estimate_bytes(n, "none", 1)
    groups = d.dp // shards
    layout = (f"{groups} replica groups of {shards} (hybrid)" if groups > 1 else f"{shards} workers")
    if d.pp > 1:
        layout += f" in each of {d.pp} pipeline stages (the largest stage's share)"
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    return (f"sharding: {d.shard} ({NAMES[d.shard]}) over {layout}; per worker: "
            + ", ".join(f"{k} {mib(v)}" for k, v in mine.items())
            + f" = {mib(sum(mine.values()))} (DDP: {mib(sum(ddp.values()))})")


def _tensor_line(spec) -> str:
    """What each tensor-parallel worker holds of the model (and of that, under sharding, its
    shard), next to a whole replica."""
    from baton.models import _on_meta
    from baton.parallel.sharding import NAMES, estimate_bytes
    from baton.parallel.tensor import split_layers

    d = spec.parallel
    whole = sum(q.numel() for q in _on_meta(spec.model).parameters())
    model = _on_meta(spec.model)
    splits = split_layers(model, 0, d.tp, None)
    mine = sum(q.numel() for q in model.parameters())
    held = sum(estimate_bytes(mine, d.shard, spec.dp_shard).values())
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731 (fp32 parameters, gradients, AdamW's two moments)
    sharded = (f", {d.shard} ({NAMES[d.shard]}) over the {spec.dp_shard} workers holding each share"
               if d.shard != "none" else "")
    return (f"tensor parallel: {len({n.rsplit('.', 1)[0] for n in splits})} layers split "
            f"over {d.tp} workers{sharded}; per worker {mine:,} of the {whole:,} "
            f"parameters: {mib(held)} of parameters, gradients and optimizer state (whole: {mib(whole * 16)})")


def _which_checkpoint(parser: argparse.ArgumentParser) -> None:
    """`--step N` or `--best` (args.step: N, "best", or None for the newest that verifies)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the checkpoint (default: the newest that verifies)")
    which.add_argument("--best", action="store_const", const="best", dest="step",
                       help="the checkpoint the job's checkpoint.best kept: the best held-out "
                            "evaluation")


def _data_lines(m: dict, shuffle_block: int, mixed: list[str]) -> list[str]:
    """`baton validate`'s lines about the training corpus, or each source of a mix."""
    def shape(m: dict) -> str:
        blocks = -(-m["samples"] // shuffle_block)
        return (f"{m['samples']:,} samples in {m['row_groups']} row groups of {m['files']} files "
                f"({m['bytes'] / 2**20:,.1f} MiB), manifest {m['digest']}; "
                + ("a full permutation each epoch" if blocks == 1 else
                   f"shuffled in {blocks} blocks of {shuffle_block:,} samples"))
    if not mixed:
        return [f"  data: {shape(m)}"]
    return [f"  data: a mix of {len(mixed)} sources, manifest {m['digest']}"] + [
        f"    {s['weight']:.1%} of the samples from {path}: {shape(s)}"
        for path, s in zip(mixed, m["sources"])]


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
    from baton import api

    if args.command == "init":
        from importlib.resources import files

        sys.stdout.write((files("baton") / "templates" / f"{args.task}.yaml").read_text())
        return 0
    if args.command == "validate":
        spec, data = api.validate(args.job, args.set)
        d = spec.parallel
        task = f"{spec.task}, " if spec.task != "language_model" else ""
        print(f"{args.job}: ok ({spec.name}: {task}{spec.model.name}, dp={d.dp} pp={d.pp}"
              f"{f' tp={d.tp}' if d.tp > 1 else ''}, "
              f"{spec.train.steps} steps of {spec.train.global_batch} samples)")
        if data is not None:
            m = data.manifest.summary()
            for line in _data_lines(m, spec.data.shuffle_block, [s.path for s in spec.data.mix]):
                print(line)
            if spec.task != "language_model":
                print("  columns: " + ", ".join(
                    f"{f.name} <- {'+'.join(f.sources)} ({f.dtype}{list(f.shape) if f.shape else ''})"
                    for f in data.columns.fields))
            if data.eval_sets:
                e = spec.eval
                held = sum(len(s.uids) for s in data.eval_sets) if e.fraction else 0
                print(f"  eval: {data.eval_samples:,} held-out samples "
                      + (f"({held} of {m['row_groups']} row groups"
                         f"{', some of each source' if spec.data.mix else ''}, eval.seed {e.seed})"
                         if e.fraction else f"from {e.path}")
                      + (f", every {e.every_steps} steps and" if e.every_steps else "") + " at the end"
                      + (f"; the best checkpoint by {spec.checkpoint.best} "
                         f"({'lowest' if spec.checkpoint.best_lowest else 'highest'}) kept"
                         if spec.checkpoint.best else "")
                      + (f"; stops after {e.patience} evaluation{'s' * (e.patience > 1)} without "
                         f"an improvement" + (f" larger than {e.min_delta:g}" if e.min_delta else "")
                         if e.patience else ""))
        from baton.checkpoint.export import is_export, read_about
        from baton.storage import redact

        if spec.model.init_from and is_export(spec.model.init_from):
            about = read_about(spec.model.init_from)
            print(f"  starts from {redact(spec.model.init_from)}: step {about.get('step')} of "
                  f"{about.get('job')} ({about.get('parameters', 0):,} parameters)")
            if spec.model.init_fresh:
                print(f"  fresh (its own initialization): {api.fresh_names(spec)}")
            if spec.model.init_grow:
                print(f"  grown (the export's rows first): {api.grown_names(spec)}")
        if d.pp > 1:
            print(f"  pipeline: {d.schedule}, {spec.microbatches} micro-batches of "
                  f"{spec.micro_batch} per replica, {spec.chunks} chunk(s) per rank, layers per "
                  f"stage {api.stage_plan(spec)}")
        if d.shard != "none" and d.tp == 1:
            print(f"  {_sharding_line(spec)}")
        if d.tp > 1:
            print(f"  {_tensor_line(spec)}")
        lo, hi = spec.dp_range
        e = spec.elastic
        if lo < hi or e.max_failures:
            print(f"  elastic: dp {spec.valid_dps()} ({spec.batch_policy}), recovers from up to "
                  f"{e.max_failures} failures, looks for room every {e.rescale_check_s:g} s, a "
                  f"worker silent for {e.hang_timeout_s:g} s is dead"
                  + ("; after a loss it goes on with the survivors" if e.recovery == "continue" else ""))
        return 0
    if args.command == "data":
        from baton.data.corpus import prepare_stdlib

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
    if args.command in ("submit", "status", "logs", "stop", "list"):
        return REMOTE[args.command](args)
    if args.command == "k8s":
        return _k8s(args)
    if args.command == "report":
        return _report(args)
    if args.command == "export":
        return _export(args)
    if args.command == "fork":
        return _fork(args)
    if args.command == "sample":
        from baton.sample import sample

        for flag, value, least in (("--tokens", args.tokens, 1), ("--top-k", args.top_k, 1),
                                   ("--temperature", args.temperature, 0)):
            if value < least:
                print(f"baton: error: {flag} must be at least {least}", file=sys.stderr)
                return 2
        print(sample(args.folder, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
        return 0
    if args.command == "sweep":
        from baton import sweeps

        axes = _grid(args.job, args.grid)
        if args.list:
            trials = sweeps.plan(args.job, axes, args.set, args.trials, args.seed)
            for t in trials:
                where = sweeps.progress(t.spec)
                print(f"{t.name}: " + ", ".join(f"{k}={v}" for k, v in t.values.items())
                      + (f"; {where}" if where else ""))
            if args.halving is not None:
                sweeps.check_halving(trials, args.halving, args.first_rung, args.job)
                ends = sweeps.rungs(len(trials), trials[0].spec.train.steps, args.halving, args.first_rung)
                print("halving: judged at steps " + ", ".join(map(str, ends[:-1])) + "; the best "
                      f"1/{args.halving} go on each time, the last to step {ends[-1]}")
            return 0
        trials = api.sweep(args.job, axes, args.set, trials=args.trials, seed=args.seed,
                           halving=args.halving, first_rung=args.first_rung, concurrent=args.concurrent,
                           address=args.address, show_progress=not args.quiet)
        metric, lowest = sweeps.ranked_by(trials[0].spec)
        print(f"{args.job}: {len(trials)} trials, best first by {metric} "
              f"({'lowest' if lowest else 'highest'}{', its best checkpoint' if trials[0].spec.checkpoint.best else ''}"
              + ("; those that trained furthest first" if args.halving else "") + "):")
        for line in sweeps.table(trials, metric):
            print(line)
        return 1 if all(t.state == "failed" for t in trials) else 0
    if args.command == "eval":
        from baton.spec import load_spec

        spec = load_spec(args.job, args.set)
        result = api.evaluate(spec, source=args.job, step=args.step, address=args.address)
        e = result.eval
        print(f"{result.job}: step {result.step} on {e['eval_samples']:,} held-out samples: "
              + ", ".join(f"{k} {v:.4g}" for k, v in e.items() if k != "eval_samples")
              + f"; MLflow run {result.run_id}")
        return 0
    if args.command == "scale":
        return _scale(args)
    if args.command == "run":
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
    raise AssertionError(args.command)


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
    rep = report.build(client, run, out, args.step)
    print(f"wrote {rep.png} and {rep.html}: {rep.points['loss']} steps of MLflow run {rep.run_id}"
          + (f", pipeline step {rep.swimlane_step}" if rep.swimlane_step else ""))
    return 0


def _cluster(args: argparse.Namespace):
    from baton.submit import Cluster

    cluster = Cluster(args.address, args.token_file)
    if cluster.warning:
        print(f"baton: warning: {cluster.warning}", file=sys.stderr)
    return cluster


def _submit(args: argparse.Namespace) -> int:
    from baton import submit
    from baton.spec import load_spec
    from baton.storage import redact

    spec = load_spec(args.job, args.set)  # a bad job file is refused before anything is sent
    env = dict(_key_value(item, "--env") for item in args.env)
    sub = submit.prepare(spec, args.job, args.set, root=args.root, excludes=tuple(args.exclude),
                         includes=tuple(args.include), max_upload_mb=args.max_upload_mb,
                         storage=args.storage, env=env, submission_id=args.id, until=args.until)
    try:
        for warning in sub.warnings:
            print(f"baton: note: {warning}", file=sys.stderr)
        pkg = sub.package
        print(f"package: {len(pkg.files)} files, {pkg.size_bytes / 2**20:.2f} MiB from {pkg.root}")
        if args.dry_run:
            print("\n".join(f"  {rel}" for rel in pkg.files))
            print(f"entrypoint: {redact(sub.entrypoint)}")
            print(f"runtime_env: {redact(json.dumps(sub.runtime_env))}")
            return 0
        cluster = _cluster(args)
        job_id = submit.submit(cluster, sub, spec, args.job)
    finally:
        sub.discard()  # the zip is uploaded (or was never to be)
    print(f"submitted {job_id} to {cluster.address}: {redact(sub.entrypoint)}")
    if args.no_wait:
        print(f"follow it with: baton logs {job_id} --follow")
        return 0
    return _follow(cluster, job_id)


def _follow(cluster, job_id: str) -> int:
    try:
        for chunk in cluster.follow(job_id):
            print(chunk, end="", flush=True)
    except KeyboardInterrupt:
        print(f"\nbaton: stopped following; {job_id} goes on (baton stop {job_id} stops it)",
              file=sys.stderr)
        return 130
    status = cluster.status(job_id)
    print(f"{job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def _export(args: argparse.Namespace) -> int:
    from baton.checkpoint.export import export
    from baton.spec import load_spec

    if args.max_file_mb < 1:
        print("baton: error: --max-file-mb must be at least 1", file=sys.stderr)
        return 2
    spec = load_spec(args.job, args.set)
    about = export(spec, args.out, args.step, args.max_file_mb * 10**6, hf=args.hf)
    files = about["files"]
    print(f"exported step {about['step']} of {about['job']}: {about['parameters']:,} parameters "
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


def _status(args: argparse.Namespace) -> int:
    from baton import status
    from baton.errors import BatonError, ClusterError
    from baton.submit import resolve_address

    found = status.local(args.id, args.checkpoint_path)
    if found is not None:
        print("\n".join(status.describe(found)))
        return 0
    if status.is_job_file(args.id):  # a local job, not one to look for on a cluster
        raise BatonError(f"{args.id}: no status in {status.local_root(args.id)}: the job has "
                         "not started there yet")
    try:
        resolve_address(args.address)
    except ClusterError as e:
        raise ClusterError(f"no local job {args.id!r} (no status.json under "
                           f"{args.checkpoint_path or 'checkpoints'}/), and {e}") from None
    cluster = _cluster(args)
    info = cluster.info(args.id)
    print(f"{args.id}: {info.status.value}")
    if info.message:
        print(f"  {info.message.strip().splitlines()[-1]}")
    print(f"  entrypoint: {info.entrypoint}")
    if info.start_time:
        print(f"  started {_when(info.start_time)}, {_duration(info)}")
    coordinator = status.from_logs(cluster.logs(args.id))
    if coordinator is not None:
        print("  coordinator, as of its last status line:")
        print("\n".join("    " + line for line in status.describe(coordinator)))
    return 0


def _logs(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    if args.follow:
        return _follow(cluster, args.id)
    print(cluster.logs(args.id), end="")
    return 0


def _stop(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    stopped = cluster.stop(args.id)
    print(f"{args.id}: {'stopping' if stopped else 'not running (' + cluster.status(args.id) + ')'}")
    return 0


def _list(args: argparse.Namespace) -> int:
    jobs = sorted(_cluster(args).list(), key=lambda j: j.start_time or 0)
    rows = [("ID", "STATUS", "JOB", "STARTED", "DURATION")]
    for j in jobs:
        meta = j.metadata or {}
        rows.append((j.submission_id or j.job_id or "-", j.status.value,
                     meta.get("baton.job", j.entrypoint[:40]),
                     _when(j.start_time) if j.start_time else "-", _duration(j)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
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


REMOTE = {"submit": _submit, "status": _status, "logs": _logs, "stop": _stop, "list": _list}


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))


def _duration(job) -> str:
    if not job.start_time:
        return "-"
    end = job.end_time or time.time() * 1000
    return f"{(end - job.start_time) / 1000:.0f} s"


def _key_value(item: str, flag: str) -> tuple[str, str]:
    from baton.errors import BatonError

    key, sep, value = item.partition("=")
    if not sep or not key:
        raise BatonError(f"{flag} {item!r} must look like KEY=VALUE")
    return key, value


if __name__ == "__main__":
    sys.exit(console())
