"""Successive halving for `baton sweep --halving ETA` (Jamieson and Talwalkar, 2016; Li et
al., 2018): every trial trains to a first rung of steps, the best 1/ETA of them on to ETA
times as far, and so on until the few left train to train.steps; the others stop there
("cut"). A trial stops at a rung as `baton run --until` does, on a checkpoint, its
learning-rate schedule still train.steps's, so one that goes on trains exactly as if it had
never stopped. The rungs: `rungs`. Synchronous (`halve`: each rung's trials all judged
together), or asynchronous (`--async`, ASHA: Li et al., 2020; `promote`): no rung waits for
its slowest trial, a trial going on as soon as it stands among the best 1/ETA of those judged
at its rung so far."""

from __future__ import annotations

from typing import Callable, Optional

from baton.errors import SpecError
from baton.sweeps import Trial, rank, ranked_by, values_of


def rungs(trials: int, steps: int, eta: int, first: Optional[int] = None) -> list[int]:
    """The steps successive halving judges `trials` trials at, train.steps last: `first`
    (default: train.steps / ETA^k, k as many rungs as leave at least one trial at the end),
    then ETA times as far each time, while that is short of train.steps."""
    k = 0
    while eta ** (k + 1) <= trials:
        k += 1
    first = first or max(1, round(steps / eta ** k))
    out = []
    while first < steps and len(out) < k:
        out.append(first)
        first *= eta
    return out + [steps]


def check_halving(trials: list[Trial], eta: Optional[int], first: Optional[int], where: str,
                  asynchronous: bool = False) -> None:
    """Refuse, in one line, a halving that cannot judge these trials (or its options given
    without `--halving ETA`)."""
    if eta is None:
        for given, flag, what in ((first, "--first-rung", "is where --halving first judges the trials"),
                                  (asynchronous, "--async", "promotes the trials of a --halving as "
                                                            "soon as they stand among the best")):
            if given:
                raise SpecError(f"{where}: {flag} {what}: give --halving too")
        return
    if eta < 2:
        raise SpecError(f"{where}: --halving {eta}: give 2 or more (the best 1/ETA of the trials "
                        "go on at each rung; 3 is usual)")
    if len(trials) < eta:
        raise SpecError(f"{where}: --halving {eta} keeps the best 1/{eta} of the trials at each "
                        f"rung: give at least {eta} trials (there are {len(trials)})")
    steps = {t.spec.train.steps for t in trials}
    if len(steps) > 1:
        raise SpecError(f"{where}: --halving judges every trial at the same steps: train.steps "
                        "cannot differ between trials")
    if first is not None and not 1 <= first < steps.pop():
        raise SpecError(f"{where}: --first-rung {first}: give a step from 1 to below train.steps "
                        f"({trials[0].spec.train.steps})")


def halve(trials: list[Trial], eta: int, first: Optional[int],
          each: Callable[[list[Trial], Optional[int]], None], log: Callable[[str], None]) -> None:
    """Successive halving: every trial to the first rung, the best 1/`eta` of those judged
    there (at least one) on to the next, ..., the last rung's to train.steps; the others are
    "cut" where they stopped. A trial that trained past a rung before (a sweep run again) is
    kept without being judged there; one that ended (stopped early, failed) holds its place
    in the ranking but trains no further. `each(trials, until)` trains a rung's trials
    (`train_each`)."""
    metric, lowest = ranked_by(trials[0].spec)
    steps = trials[0].spec.train.steps
    ends = rungs(len(trials), steps, eta, first)
    alive = list(trials)
    for k, end in enumerate(ends):
        log(f"rung {k + 1} of {len(ends)}: {len(alive)} trial{'s' * (len(alive) > 1)} to step {end}")
        for t in alive:
            t.rung = k
        each([t for t in alive if not t.ended], end if end < steps else None)
        if end == steps:
            return
        ahead = [t for t in alive if t.step > end]  # trained past this rung before
        judged = rank([t for t in alive if t not in ahead], metric, lowest)
        places = max(0, max(1, len(alive) // eta) - len(ahead))  # those ahead hold theirs
        kept = ahead + [t for t in judged[:places] if t.metric is not None]
        for place, t in enumerate(judged, 1):
            if t not in kept and t.state == "paused":
                t.state = "cut"
                log(f"  {t.name}: cut at step {t.step}: " + (
                    f"{metric} {t.metric:.4g}, {place} of {len(judged)}" if t.metric is not None
                    else f"no {metric} to judge it by"))
        alive = kept


class Promotions:
    """Asynchronous successive halving (ASHA: Li et al., 2020): whenever there is room, a
    trial among the best 1/ETA of those judged so far at its rung (the highest rung first)
    goes on to the next rung, else the next trial not begun trains to the first; no rung
    waits for its slowest trial. What `drive` trains; `cut()` marks the rest at the end.

    A trial is judged at a rung by its metric there, kept with it (it changes as the trial
    trains on). One that ended (stopped early) and stands among the best goes on without
    training; one that trained past a rung before (a sweep run again) is judged at the
    furthest rung it reached and holds a place at those below it."""

    def __init__(self, trials: list[Trial], eta: int, ends: list[int], log: Callable[[str], None]):
        self.fresh, self.n = list(enumerate(trials, 1)), len(trials)
        self.eta, self.ends, self.log = eta, ends, log
        self.metric, self.lowest = ranked_by(trials[0].spec)
        self.judged: list[list[tuple[Trial, Optional[float]]]] = [[] for _ in ends]
        self.promoted: list[set] = [set() for _ in ends]  # the trials gone on from each rung

    def _until(self, rung: int) -> Optional[int]:
        return None if rung == len(self.ends) - 1 else self.ends[rung]

    def _order(self, rung: int) -> list[tuple[Trial, Optional[float]]]:
        """Those judged at `rung` so far, best first, those with no metric last."""
        return sorted(self.judged[rung], key=lambda p: (p[1] is None, 0.0 if p[1] is None else
                                                        p[1] if self.lowest else -p[1]))

    def _best(self, rung: int) -> list[tuple[Trial, float]]:
        """The best 1/ETA of those judged at `rung` so far (a place each), with their metrics."""
        return [p for p in self._order(rung) if p[1] is not None][:len(self.judged[rung]) // self.eta]

    def _next(self) -> Optional[tuple[Trial, int, int]]:
        """A trial to go on (the trial, the rung it goes on from, its place there), from the
        highest rung that has one; trials that ended go on at once, without training."""
        for k in reversed(range(len(self.ends) - 1)):
            for place, (t, _) in enumerate(self._best(k), 1):
                if t in self.promoted[k]:
                    continue
                if not t.ended:
                    return t, k, place
                self._judge(t, k + 1, t.metric)  # stopped early: holds its place further on
                self.promoted[k].add(t)
                return self._next()
        return None

    def _judge(self, t: Trial, rung: int, metric: Optional[float]) -> None:
        self.judged[rung].append((t, metric))
        t.rung = rung

    def peek(self) -> Optional[tuple[Trial, Optional[int]]]:
        found = self._next()
        if found is not None:
            return found[0], self._until(found[1] + 1)
        return (self.fresh[0][1], self._until(0)) if self.fresh else None

    def take(self) -> tuple[Trial, Optional[int]]:
        found = self._next()
        if found is None:
            k, t = self.fresh.pop(0)
            t.rung = 0
            self.log(f"trial {k} of {self.n}: {t.name} ({values_of(t)}) to step {self.ends[0]}")
            return t, self._until(0)
        t, k, place = found
        self.promoted[k].add(t)
        t.rung = k + 1
        self.log(f"  {t.name} goes on to step {self.ends[k + 1]} (rung {k + 2} of {len(self.ends)}): "
                 f"{self.metric} {dict(self.judged[k])[t]:.4g} at step {self.ends[k]}, {place} of "
                 f"{len(self.judged[k])} judged there so far")
        return t, self._until(k + 1)

    def ended(self, t: Trial) -> None:
        """Judge `t` at the furthest rung its step reached (where it was sent, or beyond)."""
        k = t.rung
        while k + 1 < len(self.ends) and self.ends[k + 1] <= t.step:
            self._judge(t, k, t.metric)  # trained past it before: holds a place there
            self.promoted[k].add(t)
            k += 1
        self._judge(t, k, None if t.state == "failed" else t.metric)

    def cut(self) -> None:
        """Mark the trials left paused at a rung as cut, each with its place there."""
        for k, pairs in enumerate(self.judged):
            for place, (t, m) in enumerate(self._order(k), 1):
                if t.rung == k and t.state == "paused":
                    t.state = "cut"
                    self.log(f"  {t.name}: cut at step {t.step}: " + (
                        f"{self.metric} {m:.4g}, {place} of {len(pairs)}" if m is not None
                        else f"no {self.metric} to judge it by"))


def promote(trials: list[Trial], eta: int, first: Optional[int],
            drive_: Callable[["Promotions"], None], log: Callable[[str], None]) -> None:
    """Asynchronous successive halving (`Promotions`) of `trials` at the rungs `rungs` gives;
    `drive_(lineup)` trains what it hands out (`drive`)."""
    ends = rungs(len(trials), trials[0].spec.train.steps, eta, first)
    lineup = Promotions(trials, eta, ends, log)
    drive_(lineup)
    lineup.cut()
