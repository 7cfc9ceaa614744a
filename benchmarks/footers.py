"""What reading the footers' column facts (`data/footers.py`: the schema, nulls, least and
greatest values and values a row of each column, for the checks before a run starts) adds to
listing a corpus, side by side in one process: a corpus of `--files` Parquet files of
`--groups` row groups each (token rows of 129 ids and a sample id, the quick-start's
columns), listed by `Manifest.build` (footers read on 16 threads, facts included), and the
facts taken alone from the same footers already in memory (`footer_facts`), alternating
which goes first each round. Also the checks themselves (`check_footers`) over the whole
manifest.

    python benchmarks/footers.py --files 200 --groups 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent / ".." / "platform"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_result  # noqa: E402

SEQ = 128
ROWS = 16  # rows a row group: small groups, so that the footers are most of the work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--groups", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/footers_cpu.json")
    args = ap.parse_args()

    from baton.data.feed import token_columns
    from baton.data.footers import check_footers, footer_facts
    from baton.data.manifest import Manifest

    root = Path(tempfile.mkdtemp(prefix="baton-footers-"))
    rng = np.random.default_rng(0)
    rows = args.groups * ROWS
    for f in range(args.files):
        tokens = rng.integers(0, 256, (rows, SEQ + 1), dtype=np.int64)
        column = pa.ListArray.from_arrays(np.arange(0, rows * (SEQ + 1) + 1, SEQ + 1, dtype=np.int32),
                                          pa.array(tokens.reshape(-1)))
        pq.write_table(pa.table({"tokens": column, "sample_id": np.arange(f * rows, (f + 1) * rows)}),
                       root / f"part-{f:05d}.parquet", row_group_size=ROWS)
    metas = [pq.read_metadata(p) for p in sorted(root.glob("*.parquet"))]
    columns = token_columns("tokens", "sample_id", SEQ + 1, 256)

    def listing() -> float:
        t0 = time.perf_counter()
        Manifest.build(str(root))
        return time.perf_counter() - t0

    def facts() -> float:
        t0 = time.perf_counter()
        for meta in metas:
            footer_facts(meta)
        return time.perf_counter() - t0

    manifest = Manifest.build(str(root))
    schema = metas[0].schema.to_arrow_schema()

    def checks() -> float:
        t0 = time.perf_counter()
        check_footers(manifest, columns, schema, "bench", str(root))
        return time.perf_counter() - t0

    ways = {"Manifest.build (facts included)": listing, "footer_facts alone": facts,
            "check_footers": checks}
    runs: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            runs[way].append(ways[way]())
    groups = args.files * args.groups
    print(f"\n{args.files} files x {args.groups} row groups = {groups:,} row groups, 2 columns\n")
    print("| what | s (median of rounds) | us a row group |")
    print("|---|---:|---:|")
    table = {}
    for way, times in runs.items():
        s = statistics.median(times)
        table[way] = {"s": s, "us_per_row_group": s / groups * 1e6, "rounds_s": times}
        print(f"| {way} | {s:.3f} | {s / groups * 1e6:.1f} |")
    share = table["footer_facts alone"]["s"] / table["Manifest.build (facts included)"]["s"]
    print(f"\nthe facts' share of listing: {share:.1%}")
    write_result(args.out, {"files": args.files, "groups_per_file": args.groups,
                            "rows_per_group": ROWS, "table": table, "facts_share_of_listing": share})


if __name__ == "__main__":
    main()
