"""Where the data is read: `data.read: spread` against `driver`, on a simulated cluster
(`ray.cluster_utils.Cluster`: a head with no CPUs, where this driver runs, and three one-CPU
nodes, as in tests/faults).

A generated corpus (random byte tokens, 129-token rows, uncompressed, row groups of 1 MiB as
`baton data prepare` writes them) goes through baton's data feed, `--blocks` shuffle blocks of
`--block-row-groups` row groups, with one consumer actor on each of the three nodes taking a
third of each global batch the way a worker does (`baton.data.rows.UnitRows`: it fetches the
row groups of its rows from the object store). Measured for each way, in alternating rounds:

- where Ray Data read the row groups: each one's node as soon as the feed has it (a thread
  looks every 20 ms), while it has one copy ("copied": a consumer fetched it first);
- the CPU seconds of Ray's worker processes other than the consumers (Ray Data's read
  workers), by node, over the pass;
- the pass's time (every block, the consumers fetching as they go).
All three after a first block, while which Ray Data's read workers start (the first block of
a run is read in the driver's process either way); the pass is `--blocks` blocks after it.
- then the node holding the most of the held read-ahead's row groups (spread) is removed, and
  the two remaining consumers fetch that whole block: Ray rebuilds what the node took along.
  With `driver` nothing is lost (the same removal, the same fetch), the reference.

    python benchmarks/read_spread.py                  # 2 rounds of 8 blocks: 84 s on 2 cores
    python benchmarks/read_spread.py --rounds 3 --blocks 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import psutil
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton import ray_settings  # noqa: E402
from baton.data.feed import Batch, DataFeed, token_columns  # noqa: E402
from baton.data.manifest import Manifest  # noqa: E402
from baton.data.order import Cursor, EpochOrder  # noqa: E402
from results_io import write_result  # noqa: E402

SEQ_LEN, ROW_GROUP_MIB = 128, 1
WIDTH = SEQ_LEN + 1
ROWS = ROW_GROUP_MIB * 2**20 // WIDTH  # per row group


def write_corpus(folder: Path, row_groups: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_file = 8
    for k in range(0, row_groups, per_file):
        n = min(per_file, row_groups - k) * ROWS
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 256, n * WIDTH, dtype=np.uint8)), WIDTH)
        table = pa.table({"sample_id": pa.array(np.arange(k * ROWS, k * ROWS + n)), "tokens": tokens})
        pq.write_table(table, folder / f"part-{k // per_file:04d}.parquet", compression="none",
                       row_group_size=ROWS)


@ray.remote(num_cpus=0)
class Consumer:
    """A worker's data side: the row groups of its share of each batch, fetched as a worker
    fetches them."""

    def __init__(self, shapes):
        from baton.data.rows import UnitRows

        self.rows = UnitRows(shapes)

    def pid(self) -> int:
        import os

        return os.getpid()

    def take(self, batch, positions) -> int:
        self.rows.use(batch)
        ids, columns = self.rows.gather(positions)
        return len(ids)

    def fetch_all(self, batch) -> float:
        """Every row group the batch names: the whole next block."""
        t = time.perf_counter()
        self.rows.use(batch)
        self.rows._fetch(list(batch.units))
        return time.perf_counter() - t


def _read_cpu_by_node(cluster, skip_pids: set[int]) -> dict[str, float]:
    """CPU seconds of each node's Ray worker processes (`ray::` titles) other than `skip_pids`."""
    out = {}
    for node in cluster.list_all_nodes():
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        total = 0.0
        for p in raylet.children():
            try:
                if p.pid in skip_pids or not " ".join(p.cmdline()).startswith("ray::"):
                    continue
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
        out["head" if node.head else node.node_id] = total
    return out


def one_round(data: Path, way: str, args) -> dict:
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "include_dashboard": False,
                                      "_system_config": dict(ray_settings.SYSTEM_CONFIG)})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    name = {n.node_id: f"node {i + 1}" for i, n in enumerate(nodes)}
    name[cluster.head_node.node_id] = "head"
    try:
        manifest = Manifest.build(str(data))
        block = args.block_row_groups * ROWS
        order = EpochOrder(manifest.unit_rows, 0, block)
        columns = token_columns("tokens", "sample_id", WIDTH, 256)
        feed = DataFeed(manifest, order, columns, spread=way == "spread")
        consumers = [Consumer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
                     .remote(columns.shapes()) for n in nodes]
        pids = set(ray.get([c.pid.remote() for c in consumers]))
        cursor, batch_size = Cursor(), 3 * args.rows_per_consumer
        steps = args.blocks * block // batch_size
        where, seen, stop = Counter(), set(), threading.Event()

        def watch():  # each row group's node as soon as Ray Data hands it over: its one copy
            while not stop.wait(0.02):
                for read in list(feed.reads) + ([feed.next_epoch] if feed.next_epoch else []):
                    if read._here:
                        continue
                    new = [(id(read), i) for i in list(read.refs) if (id(read), i) not in seen]
                    refs = [r for key in new for r in read.refs[key[1]]]
                    seen.update(new)
                    for loc in ray.experimental.get_object_locations(refs).values():
                        nodes_of = loc["node_ids"]
                        where[name.get(nodes_of[0], "?") if len(nodes_of) == 1 else "copied"] += 1

        def take(n: int) -> None:
            for _ in range(n):
                batch = feed.next_batch(cursor, batch_size)
                parts = np.array_split(batch.positions, 3)
                assert sum(ray.get([c.take.remote(batch, p) for c, p in zip(consumers, parts)])) == batch_size

        take(block // batch_size)  # the first block: Ray Data's read workers start meanwhile
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        cpu0 = _read_cpu_by_node(cluster, pids)
        t0 = time.perf_counter()
        take(steps)
        pass_s = time.perf_counter() - t0
        cpu1 = _read_cpu_by_node(cluster, pids)
        stop.set()
        watcher.join()
        cpu = {name.get(k, k) if k != "head" else "head": round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1}
        # the loss: the read-ahead that is held now, and the node holding most of it
        for read in feed.reads:
            read._thread.join()
        ahead = feed.reads[-1]
        refs = [r for rs in ahead.refs.values() for r in rs]
        held = Counter(loc["node_ids"][0] for loc in ray.experimental.get_object_locations(refs).values()
                       if loc["node_ids"])
        victim = max(nodes, key=lambda n: held[n.node_id])
        lost = held[victim.node_id]
        survivors = [c for c, n in zip(consumers, nodes) if n is not victim]
        cluster.remove_node(victim)
        perm = order.unit_order(cursor.epoch)[0]
        units = {int(perm[i]): (manifest.units[int(perm[i])].offset, ahead.refs[i]) for i in ahead.refs}
        whole = Batch(np.zeros(0, dtype=np.int64), units, frozenset(units))
        t = time.perf_counter()
        fetch = ray.get([c.fetch_all.remote(whole) for c in survivors])
        after_loss_s = time.perf_counter() - t
        feed.close()
        return {"way": way, "pass_s": round(pass_s, 2), "steps": steps,
                "mib_per_s": round(args.blocks * args.block_row_groups * ROW_GROUP_MIB / pass_s, 1),
                "row_groups_by_node": dict(where), "read_cpu_s_by_node": cpu,
                "removed_node_held": lost, "next_block_row_groups": len(refs),
                "fetch_after_loss_s": round(after_loss_s, 2),
                "fetch_by_consumer_s": [round(f, 2) for f in fetch]}
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block-row-groups", type=int, default=12)
    ap.add_argument("--rows-per-consumer", type=int, default=1024)
    ap.add_argument("--out", default=str(HERE / "results" / "read_spread_cpu.json"))
    args = ap.parse_args()
    runs = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_corpus(data, (args.blocks + 2) * args.block_row_groups)
        for r in range(args.rounds):
            for way in (("spread", "driver") if r % 2 == 0 else ("driver", "spread")):
                out = one_round(data, way, args)
                runs[way].append(out)
                print(f"round {r + 1} {way}: pass {out['pass_s']} s ({out['mib_per_s']} MiB/s); "
                      f"row groups read by node {out['row_groups_by_node']}; read CPU-s "
                      f"by node {out['read_cpu_s_by_node']}; removed a node holding {out['removed_node_held']} "
                      f"of {out['next_block_row_groups']}: next block fetched in {out['fetch_after_loss_s']} s",
                      flush=True)
    print("\n| data.read | pass, s (median) | MiB/s | row groups read on the head | "
          "read CPU-s on the head / on the nodes | next block after a node's loss, s (median) |")
    print("|---|---:|---:|---:|---|---:|")
    table = {}
    for way, outs in runs.items():
        head_share = sum(o["row_groups_by_node"].get("head", 0) for o in outs)
        total = sum(sum(o["row_groups_by_node"].values()) for o in outs)
        head_cpu = statistics.median(o["read_cpu_s_by_node"].get("head", 0.0) for o in outs)
        node_cpu = statistics.median(sum(v for k, v in o["read_cpu_s_by_node"].items() if k != "head")
                                     for o in outs)
        row = {"pass_s": statistics.median(o["pass_s"] for o in outs),
               "mib_per_s": statistics.median(o["mib_per_s"] for o in outs),
               "head_share": round(head_share / max(1, total), 3), "head_read_cpu_s": round(head_cpu, 2),
               "nodes_read_cpu_s": round(node_cpu, 2),
               "fetch_after_loss_s": statistics.median(o["fetch_after_loss_s"] for o in outs)}
        table[way] = row
        print(f"| {way} | {row['pass_s']:.2f} | {row['mib_per_s']:.1f} | {head_share} of {total} | "
              f"{row['head_read_cpu_s']:.2f} / {row['nodes_read_cpu_s']:.2f} | {row['fetch_after_loss_s']:.2f} |")
    write_result(args.out, {"table": table, "runs": dict(runs), "args": vars(args)})


if __name__ == "__main__":
    main()
