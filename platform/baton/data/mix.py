"""Corpora mixed by weight (`data.mix`): several Parquet datasets trained on as one stream, each
sample drawn from a source in proportion to its weight, whatever the sources' sizes (a small
source is repeated, epoch after epoch, a large one is not finished as often).

Which source each sample of the stream comes from is fixed by the weights alone (stride
scheduling): the i-th sample of source k is due at time (i + 1/2) / w_k, and the stream takes
samples in the order of those times (ties by source index). After n samples every source has
given w_k n of them, within one; and the choice for sample n depends only on how many each
source has given before it, so a batch split at any size, a resume and a resize continue the
same stream. The weights change at the steps `data.mix_phases` names (an annealing phase on
other proportions), or on a resume (`--rebase-data`): each source goes on from its place, and
the schedule starts again from there (counting from the samples each had given then, `since`),
so the new weights hold from that step on rather than making up for the old ones. A weight of
0 in a phase takes none of that source's samples meanwhile. Each source keeps its own epoch order and cursor (`order.py`: every sample of a
source once per epoch of that source) and its own feed (`feed.py`), unchanged; a batch merges
their batches into one position space, sources one after another (source k's positions and
row groups offset by the sizes of the sources before it), so the workers read it as they read
one corpus.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional, Sequence

import numpy as np

from baton.data.feed import Batch, DataFeed
from baton.data.manifest import Manifest
from baton.data.order import Cursor, EpochOrder, rebased


def due(taken: Sequence[int], weights: np.ndarray, count: int) -> np.ndarray:
    """The source of each of the next `count` samples, after source k has given `taken[k]`
    (a source of weight 0 none)."""
    k = len(weights)
    i = np.asarray(taken, dtype=np.float64)[:, None] + np.arange(count, dtype=np.float64)[None, :]
    w = weights[:, None]
    times = np.divide(i + 0.5, w, out=np.full(i.shape, np.inf), where=w > 0)
    sources = np.broadcast_to(np.arange(k)[:, None], times.shape)
    order = np.lexsort((sources.ravel(), times.ravel()))[:count]
    return sources.ravel()[order]


class MixCursor:
    """Where the stream stands: each source's cursor in its own epochs, the samples each had
    given when the current weights took effect (`since`), and which weights those are
    (`phase`: 0 data.mix's own, k data.mix_phases[k - 1]'s). Its state holds them, the
    samples taken in all (`consumed`) and the fewest epochs any source has finished (`epoch`,
    the run's epoch metric: every sample of every source seen that many times)."""

    def __init__(self, sizes: Sequence[int]):
        self.sizes = list(sizes)  # samples of each source's order (an epoch), for `taken`
        self.sources = [Cursor() for _ in sizes]
        self.since: list[int] = [0] * len(sizes)
        self.phase = 0

    @property
    def epoch(self) -> int:
        return min(c.epoch for c in self.sources)

    def taken(self) -> list[int]:
        return [c.epoch * n + c.consumed for c, n in zip(self.sources, self.sizes)]

    def scheduled(self) -> list[int]:
        """What the schedule counts: each source's samples under the current weights."""
        return [t - s for t, s in zip(self.taken(), self.since)]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": sum(self.taken()),
                "sources": [c.state_dict() for c in self.sources], "since": list(self.since),
                **({"phase": self.phase} if self.phase else {})}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("sources", ())) != len(self.sources):
            raise ValueError(f"a cursor of {len(state.get('sources', ()))} sources for a mix of "
                             f"{len(self.sources)}")
        for cursor, s in zip(self.sources, state["sources"]):
            cursor.load_state_dict(s)
        self.since = [int(n) for n in state.get("since", [0] * len(self.sources))]
        self.phase = int(state.get("phase", 0))


class Mixture:
    """The corpora of `data.mix` as the coordinator sees one corpus: their manifests and
    weights, a digest that pins every source and its weight, and a summary."""

    def __init__(self, paths: Sequence[str], manifests: Sequence[Manifest], weights: Sequence[float],
                 names: Optional[Sequence[str]] = None,
                 phases: Sequence[tuple[int, Sequence[float]]] = ()):
        self.paths, self.manifests = list(paths), list(manifests)
        self.names = list(names or (str(k) for k in range(len(paths))))  # its eval metrics' suffix
        # each source's training row groups (None: all): eval.fraction holds some out
        self.train_uids: list[Optional[np.ndarray]] = [None] * len(manifests)
        self.weights = _shares(weights)
        # data.mix_phases: (after_step, its weights as shares), the weights from step after_step + 1 on
        self.phases = [(int(after), _shares(w)) for after, w in phases]
        sizes = [m.num_samples for m in self.manifests]
        self.bases = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)  # positions
        counts = [len(m.units) for m in self.manifests]
        self.unit_bases = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.num_samples = int(sum(sizes))
        self.root = ", ".join(self.paths)  # for messages

    @property
    def train_samples(self) -> int:
        return sum(int(m.unit_rows[u].sum()) if u is not None else m.num_samples
                   for m, u in zip(self.manifests, self.train_uids))

    def to_json(self) -> dict:
        return {"mix": [{"weight": float(w), **m.to_json()} for w, m in zip(self.weights, self.manifests)]}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def bytes(self) -> int:
        return sum(m.bytes for m in self.manifests)

    def summary(self) -> dict:
        return {"files": sum(len(m.files) for m in self.manifests),
                "row_groups": sum(len(m.units) for m in self.manifests),
                "samples": self.num_samples, "bytes": self.bytes, "digest": self.digest(),
                "sources": [{"weight": round(float(w), 6), **m.summary()}
                            for w, m in zip(self.weights, self.manifests)],
                **({"phases": self._phases_json()} if self.phases else {})}

    def weights_in(self, phase: int) -> np.ndarray:
        """The shares of phase `phase` (0: data.mix's own weights)."""
        return self.phases[phase - 1][1] if phase else self.weights

    def phase_at(self, step: int) -> int:
        """The phase the batch after `step` steps is drawn in."""
        return sum(after <= step for after, _ in self.phases)

    def _begun(self, phases: list, step: int) -> list:
        """The phases of `phases` (summary's form) that had begun by step `step`."""
        return [p for p in phases if p["after_step"] < step]

    def trained(self, meta: dict) -> bool:
        """Whether checkpoint `meta` was trained on this mix: these sources at these weights,
        and the same phases so far (those after its step may be added or changed freely)."""
        data = meta.get("data", {})
        return (data.get("digest") == self.digest()
                and self._begun(data.get("phases", []), meta["step"])
                == self._begun(self._phases_json(), meta["step"]))

    def same_rows(self, meta: dict) -> bool:
        """A mix goes on source by source where it can (`MixedFeed.rebased`)."""
        return False

    def _phases_json(self) -> list[dict]:
        return [{"after_step": after, "weights": [round(float(w), 6) for w in shares]}
                for after, shares in self.phases]

    def changed_since(self, meta: dict) -> str:
        """Which sources differ from those checkpoint `meta` was trained on, in one line."""
        old = meta.get("data", {}).get("sources")
        if old is None:
            return "the checkpoint was not trained on a mix"
        if len(old) != len(self.manifests):
            return f"{len(old)} sources then, {len(self.manifests)} now"
        changed = [f"data.mix[{k}] ({self.paths[k]})" for k, (o, m) in enumerate(zip(old, self.manifests))
                   if o.get("digest") != m.digest()]
        if changed:
            return ", ".join(changed) + " changed"
        then = ", ".join(f"{o.get('weight', 0):.3g}" for o in old)
        now = ", ".join(f"{w:.3g}" for w in self.weights)
        if then != now or meta.get("data", {}).get("digest") != self.digest():
            return f"the weights changed ({then} -> {now})"
        step = meta["step"]
        begun = [self._begun(p, step) for p in (meta.get("data", {}).get("phases", []), self._phases_json())]
        return (f"data.mix_phases changed before step {step} (after steps "
                + " | ".join(", ".join(str(p["after_step"]) for p in b) or "none" for b in begun)
                + "): only phases after the checkpoint's step may change")

    def orders(self, seed: int, shuffle_block: int) -> list[EpochOrder]:
        """Each source's epoch order over its training row groups, by a seed of its own (drawn
        from the job's)."""
        return [EpochOrder(m.unit_rows, int(np.random.SeedSequence([seed, 0x313C, k]).generate_state(1)[0]),
                           shuffle_block, uids)
                for k, (m, uids) in enumerate(zip(self.manifests, self.train_uids))]


class MixedFeed:
    """The batches of a mix: each source's own feed asked for its share of each batch."""

    def __init__(self, mixture: Mixture, feeds: Sequence[DataFeed]):
        self.mixture, self.feeds = mixture, list(feeds)

    def cursor(self) -> MixCursor:
        return MixCursor([f.order.num_samples for f in self.feeds])

    def rebased(self, meta: dict) -> dict:
        """The cursor to go on from after checkpoint `meta`, trained on other data (`--rebase-data`):
        a source whose files are those of the checkpoint's source at its place (or hold the same
        row groups: fixed in place) goes on from where it was, another from the start of its next epoch (`order.rebased`), every source
        so from a checkpoint of one corpus or of another number of sources; and the schedule
        starts again from there under the new weights."""
        state = meta["cursor"]
        old = meta.get("data", {}).get("sources")
        sources = state.get("sources")
        if old is None or sources is None or len(sources) != len(self.feeds):
            sources = [rebased(state)] * len(self.feeds)
        else:
            sources = [s if m.same_rows({"data": o}) or o.get("digest") == m.digest() else rebased(s)
                       for s, o, m in zip(sources, old, self.mixture.manifests)]
        cursor = self.cursor()
        cursor.load_state_dict({"sources": sources})
        cursor.since, cursor.phase = cursor.taken(), self.mixture.phase_at(meta["step"])
        return cursor.state_dict()

    def enter(self, cursor: MixCursor, step: int) -> Optional[dict]:
        """Draw the batch after `step` steps in its phase: where that is a new one, the
        schedule starts again there under its weights, and the event says so (the step it
        takes effect at, the phase, each source's share)."""
        phase = self.mixture.phase_at(step)
        if phase == cursor.phase:
            return None
        cursor.phase, cursor.since = phase, cursor.taken()
        shares = self.mixture.weights_in(phase)
        return {"step": step + 1, "phase": phase,
                "weights": {name: round(float(w), 6) for name, w in zip(self.mixture.names, shares)}}

    def prime(self, cursor: MixCursor, global_batch: int) -> None:
        sources = due(cursor.scheduled(), self.mixture.weights_in(cursor.phase), global_batch)
        for k, feed in enumerate(self.feeds):
            c = cursor.sources[k]
            count = min(int((sources == k).sum()), feed.order.num_samples - c.consumed)
            if count:
                feed.prime(c, count)

    def next_batch(self, cursor: MixCursor, global_batch: int) -> Batch:
        sources = due(cursor.scheduled(), self.mixture.weights_in(cursor.phase), global_batch)
        positions = np.empty(global_batch, dtype=np.int64)
        units: dict = {}
        window: set = set()
        for k, feed in enumerate(self.feeds):
            want, got, have = int((sources == k).sum()), [], 0
            while have < want:  # across the source's epoch end
                got.append(feed.next_batch(cursor.sources[k], want - have))
                have += len(got[-1])
            if not got:
                continue
            base, unit_base = int(self.mixture.bases[k]), int(self.mixture.unit_bases[k])
            positions[sources == k] = np.concatenate([b.positions for b in got]) + base
            for b in got:
                units.update({uid + unit_base: (offset + base, refs)
                              for uid, (offset, refs) in b.units.items()})
            window |= {uid + unit_base for uid in got[-1].window}
        return Batch(positions, units, frozenset(window))

    @property
    def rows_read(self) -> int:
        return sum(f.rows_read for f in self.feeds)

    def take_skipped(self) -> list[dict]:
        """Each source's units left out for bad rows (`DataFeed.take_skipped`), by source."""
        return [{**event, "source": self.mixture.names[k]}
                for k, feed in enumerate(self.feeds) for event in feed.take_skipped()]

    def close(self, wait: bool = True) -> None:
        for feed in self.feeds:
            feed.close(wait)


def _shares(weights: Sequence[float]) -> np.ndarray:
    total = float(sum(weights))
    return np.array([w / total for w in weights], dtype=np.float64)


def mixed_feed(mixture: Mixture, columns, seed: int, shuffle_block: int, spread: bool,
               skip_bad: int = 0) -> MixedFeed:
    return MixedFeed(mixture, [DataFeed(m, order, columns, spread, skip_bad) for m, order in
                               zip(mixture.manifests, mixture.orders(seed, shuffle_block))])
