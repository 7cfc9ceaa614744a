"""Many more mutants of every job file through `baton validate` than CI runs: the fuzz test
(tests/unit/test_spec_fuzz.py) at `--examples` mutants per file, seeded as in CI. Prints a
table (mutants, accepted, slowest validation per job file) and writes JSON. Any traceback, a
message of more than one line, a file written or a validation over a second fails the test,
and this script with it.

    python benchmarks/spec_fuzz.py --examples 3000     # 21,000 mutants: about 2.5 minutes
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=3000, help="mutants per job file")
    ap.add_argument("--out", default=str(HERE / "results" / "spec_fuzz.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                          str(HERE.parent / "tests/unit/test_spec_fuzz.py"), "-k", "mutant"],
                         env=dict(os.environ, BATON_FUZZ_EXAMPLES=str(args.examples)),
                         capture_output=True, text=True)
    took = time.perf_counter() - t0
    rows = [{"job": m[1], "mutants": int(m[2]), "accepted": int(m[3]), "slowest_s": float(m[4])}
            for m in re.finditer(r"fuzz (\S+): (\d+) mutants, (\d+) accepted, slowest ([\d.]+) s", run.stdout)]
    print(f"{'job file':<22} {'mutants':>8} {'accepted':>9} {'slowest s':>10}")
    for r in rows:
        print(f"{r['job']:<22} {r['mutants']:>8} {r['accepted']:>9} {r['slowest_s']:>10.3f}")
    passed = run.returncode == 0
    print(f"\n{sum(r['mutants'] for r in rows)} mutants in {took:.0f} s: "
          + ("no traceback, no hang, nothing written, each under a second" if passed else "FAILED"))
    if not passed:
        print(run.stdout[-5000:])
    sys.path.insert(0, str(HERE))
    from results_io import write_result

    write_result(args.out, {"benchmark": "spec_fuzz", "examples_per_file": args.examples,
                            "passed": passed, "seconds": round(took, 1), "rows": rows,
                            "machine": {"cpus": os.cpu_count()}})
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
