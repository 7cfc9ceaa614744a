"""How long the start, a recovery or a rescale took, phase by phase, up to the first step the
world completes after it (RunResult.start, the run's events, MLflow's `<kind>_<phase>_s`)."""

from __future__ import annotations

import time


class Phases:
    def __init__(self, kind: str):
        self.kind = kind
        self.fields: dict = {}  # what the event says besides its times
        self.mark = time.monotonic()
        self.phases_s: dict[str, float] = {}

    def lap(self, name: str) -> None:
        """Phase `name` ends now; it began where the one before ended."""
        now = time.monotonic()
        self.phases_s[name] = self.phases_s.get(name, 0.0) + now - self.mark
        self.mark = now

    def finish(self, compile_s: tuple[float, float]) -> dict:
        """The first step is done: the event, with each phase and the total. `compile_s`: the
        slowest worker's train.compile seconds [in its setup, in its first step], made a phase
        of its own out of those it happened in."""
        self.lap("first_step")
        phases = dict(self.phases_s)
        in_setup, in_steps = compile_s
        if in_setup or in_steps:
            formed = "form" if "form" in phases else "group_init"
            phases[formed] = max(0.0, phases[formed] - in_setup)
            phases["first_step"] = max(0.0, phases["first_step"] - in_steps)
            phases["compile"] = in_setup + in_steps
        return {"kind": self.kind, **self.fields,
                "phases_s": {k: round(v, 3) for k, v in phases.items()},
                "total_s": round(sum(phases.values()), 3)}
