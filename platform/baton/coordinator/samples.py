"""The coordinator's data side: where the run stands in its data, the batches it hands the
workers, and which worker trained which samples."""

from __future__ import annotations

from typing import Callable, Optional

from baton.data.feed import Batch, DataFeed, UnitsSent
from baton.data.manifest import Manifest


class Samples:
    """The cursor (where the next batch starts in the epochs' order) and the cursor after the
    last completed step, which a checkpoint of that step records; the batches the feed reads
    at the cursor, naming without sending the units the current world's workers hold; and the
    ledger, (step, rank, sample ids) of every completed step when the run records samples.
    The cursor runs ahead of the completed steps by the steps queued on the workers."""

    def __init__(self, feed: DataFeed, manifest: Manifest,
                 on_phase: Callable[[dict], None] = lambda event: None,
                 on_skip: Callable[[dict], None] = lambda event: None):
        self.feed, self.manifest = feed, manifest  # a DataFeed, or a MixedFeed (data/mix.py)
        self.cursor = feed.cursor()
        self.done = self.cursor.state_dict()
        self.sent = UnitsSent()
        self.ledger: list = []
        self.on_phase = on_phase  # a mix's new phase, as its first batch is drawn
        self.on_skip = on_skip  # a unit left out for its bad rows (data.skip_bad_row_groups)

    def seek(self, meta: Optional[dict]) -> None:
        """Go back (or on) to a checkpoint's place, `meta`, or to the start with None. A
        checkpoint of another corpus (the run was started with --rebase-data,
        api.check_corpus) goes on from the start of the next epoch, or where it was if the
        files hold the same row groups (bad rows fixed in place)."""
        if meta is None:
            state, step = self.feed.cursor().state_dict(), 0
        else:
            same = self.manifest.trained(meta) or self.manifest.same_rows(meta)
            state = meta["cursor"] if same else self.feed.rebased(meta)
            step = meta["step"]
        self.cursor.load_state_dict(state)
        self.done = self.cursor.state_dict()
        self.ledger = [entry for entry in self.ledger if entry[0] < step]

    def skip(self, cursor: dict) -> None:
        """Go on from `cursor`, ahead of where a rewind left the run: the batches between are
        not trained (train.rewind_on_spike)."""
        self.cursor.load_state_dict(cursor)
        self.done = self.cursor.state_dict()

    def prime(self, global_batch: int, step: int) -> None:
        """Read the first batch's units (after `step` steps) now: bad rows are refused before
        anything is written."""
        self._enter(step)
        self.feed.prime(self.cursor, global_batch)

    def next_batch(self, global_batch: int, step: int) -> tuple[Batch, dict]:
        """The global batch after `step` steps (in the mix's phase there), and the cursor
        after it."""
        self._enter(step)
        batch = self.sent.strip(self.feed.next_batch(self.cursor, global_batch))
        for event in self.feed.take_skipped():
            self.on_skip({"step": step + 1, **event})
        return batch, self.cursor.state_dict()

    def _enter(self, step: int) -> None:
        event = self.feed.enter(self.cursor, step)
        if event:
            self.on_phase(event)

    def completed(self, cursor: dict, entries: list) -> None:
        """A step is done: `cursor` is where it left the data, `entries` each rank's ledger."""
        self.done = cursor
        for rank, taken in enumerate(entries):
            self.ledger += [(step, rank, ids) for step, ids in taken]

    def new_world(self) -> None:
        """The workers of a new world hold no units yet."""
        self.sent = UnitsSent()

    def close(self) -> None:
        self.feed.close()
