"""Loss spikes (`train.rewind_on_spike`): the coordinator's collaborator that judges each
step's loss against the level of the steps before it. A spike sends the run back to its
newest checkpoint with the data taken on from the batch after the spike's, so the batches
from the checkpoint to the spike are never trained: the remedy PaLM's authors used by hand
(Chowdhery et al., 2022: restart about 100 steps before the spike and skip the batches
around it; a spike came from a batch meeting a particular state of the model, and did not
come back with the next batches). The coordinator does the rewind (`Coordinator._rewind`);
this says what a spike is and how many a run may have."""

from __future__ import annotations

import math
import statistics
from typing import Optional

from baton.errors import WorkerError
from baton.spec import SpikeRewind


class Spike(Exception):
    """Step `event["step"]`'s loss spiked; `cursor` is the data's place after its batch."""

    def __init__(self, event: dict, cursor: dict):
        super().__init__(f"the loss spiked at step {event['step']}")
        self.event, self.cursor = event, cursor


class Spikes:
    def __init__(self, rule: SpikeRewind):
        self.rule = rule
        self.losses: list[tuple[int, float]] = []  # (step, loss): the window's steps
        self.rewinds: list[int] = []  # the steps that spiked, this run

    def judge(self, step: int, loss: float) -> Optional[dict]:
        """The spike at step `step` (1-based) as an event, or None (its loss then joins the
        window). A loss that is not a number is one at once; a finite one once the window is
        full, above `factor` times its median (where that median is above 0: a task's loss
        that can be negative has no such level)."""
        window = [x for _, x in self.losses]
        level = statistics.median(window) if len(window) == self.rule.window else None
        if not math.isfinite(loss) or (level is not None and level > 0
                                       and loss > self.rule.factor * level):
            return {"step": step, "loss": loss if math.isfinite(loss) else str(loss),
                    "median": level, "window": len(window)}
        self.losses = self.losses[1 - self.rule.window:] + [(step, loss)]
        return None

    def rewinding(self, event: dict) -> None:
        """A rewind for spike `event` begins: counted, or the run fails past `most`."""
        if len(self.rewinds) >= self.rule.most:
            raise WorkerError(
                f"the loss spiked at step {event['step']}: {describe(event, self.rule)}; "
                f"{len(self.rewinds) + 1} spikes in this run (at steps "
                f"{', '.join(map(str, self.rewinds + [event['step']]))}), more than "
                f"train.rewind_on_spike.most ({self.rule.most}) rewinds; lower train.lr, or "
                "look for bad rows in the batches before them (the last checkpoint is kept)")
        self.rewinds.append(event["step"])

    def state_dict(self) -> dict:
        """The window, for a checkpoint: a run resumed from it judges its first steps."""
        return {"losses": [[s, x] for s, x in self.losses]}

    def load_state_dict(self, state: Optional[dict], step: int) -> None:
        """The run is at step `step`, from a checkpoint whose window is `state` (None: one
        written without the rule, or the start): the window's losses up to that step."""
        losses = [(int(s), float(x)) for s, x in state["losses"]] if state else self.losses
        self.losses = [(s, x) for s, x in losses if s <= step]


def describe(event: dict, rule: SpikeRewind) -> str:
    """`the loss 812.4, 152.6x the median 5.323 of the 3 steps before`, or `the loss nan`."""
    loss, level = event["loss"], event["median"]
    if isinstance(loss, str) or not level:
        return f"the loss {loss}"
    return (f"the loss {loss:.4g}, {loss / level:.1f}x the median {level:.4g} of the "
            f"{event['window']} steps before (train.rewind_on_spike.factor: {rule.factor:g})")
