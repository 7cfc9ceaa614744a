"""The `baton` command. Thin: parse, call the API, print. A failure is one line and a
non-zero exit code; `BATON_DEBUG=1` shows the traceback."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton", description="Elastic PyTorch training on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train a job (an embedded local Ray unless --address)")
    run.add_argument("job", help="the job's YAML file")
    run.add_argument("--address", help="join a running Ray cluster (e.g. auto, ray://HOST:10001)")
    run.add_argument("--resume", action="store_true",
                     help="require a checkpoint to resume from (resuming is automatic anyway)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a spec value, e.g. --set train.steps=20 (repeatable)")
    run.add_argument("--quiet", action="store_true", help="no progress line")

    val = sub.add_parser("validate", help="check a job file without running anything")
    val.add_argument("job")
    val.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    data = sub.add_parser("data", help="data preparation")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="prepare a built-in corpus as Parquet shards")
    prep.add_argument("corpus", choices=["stdlib"], help="the Python standard library's sources")
    prep.add_argument("--out", required=True, help="folder to create")
    prep.add_argument("--seq-len", type=int, default=128,
                      help="tokens of context per sample (rows hold seq_len + 1 tokens)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    # A `module:function` model builder in the working directory imports here as it does on
    # Ray's local workers, which get the driver's working directory on their path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from baton.errors import BatonError

    try:
        return _dispatch(args)
    except BatonError as e:
        if os.environ.get("BATON_DEBUG"):
            raise
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args else signal.SIGINT  # api.run raises SIGTERM this way
        print(f"baton: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum


def _dispatch(args: argparse.Namespace) -> int:
    from baton import api

    if args.command == "validate":
        spec = api.validate(args.job, args.set)
        d = spec.parallel
        print(f"{args.job}: ok ({spec.name}: {spec.model.name}, dp={d.dp} pp={d.pp}, "
              f"{spec.train.steps} steps of {spec.train.global_batch} samples)")
        if d.pp > 1:
            print(f"  pipeline: {d.schedule}, {spec.microbatches} micro-batches of "
                  f"{spec.micro_batch} per replica, {spec.chunks} chunk(s) per rank, layers per "
                  f"stage {api.stage_plan(spec)}")
        lo, hi = spec.dp_range
        e = spec.elastic
        if lo < hi or e.max_failures:
            print(f"  elastic: dp {spec.valid_dps()} ({spec.batch_policy}), recovers from up to "
                  f"{e.max_failures} failures, looks for room every {e.rescale_check_s:g} s, a "
                  f"worker silent for {e.hang_timeout_s:g} s is dead")
        return 0
    if args.command == "data":
        from baton.data.corpus import prepare_stdlib

        if args.seq_len < 1:
            print("baton: error: --seq-len must be at least 1", file=sys.stderr)
            return 2
        try:
            info = prepare_stdlib(args.out, args.seq_len)
        except FileExistsError:
            print(f"baton: error: {args.out} already exists; choose a new --out", file=sys.stderr)
            return 2
        print(f"wrote {info['samples']:,} samples of {args.seq_len + 1} tokens from "
              f"{info['files']} files ({info['tokens']:,} bytes, Python {info['python']}) to {args.out}")
        return 0
    if args.command == "run":
        from baton.spec import load_spec

        spec = load_spec(args.job, args.set)
        result = api.run(spec, source=args.job, address=args.address,
                         resume=True if args.resume else None, show_progress=not args.quiet)
        print(f"{result.job}: finished at step {result.step}, loss {result.loss:.4f}, "
              f"{result.tokens_per_s:,.0f} tokens/s; checkpoint {result.checkpoint}; "
              f"MLflow run {result.run_id}")
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
