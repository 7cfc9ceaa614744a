"""Successive halving for `baton sweep --halving ETA` (Jamieson and Talwalkar, 2016; Li et
al., 2018): every trial trains to a first rung of steps, the best 1/ETA of them on to ETA
times as far, and so on until the few left train to train.steps; the others stop there
("cut"). A trial stops at a rung as `baton run --until` does, on a checkpoint, its
learning-rate schedule still train.steps's, so one that goes on trains exactly as if it had
never stopped. The rungs: `rungs`. Synchronous (`halve`: each rung's trials all judged
together), or asynchronous (`--async`, ASHA: Li et al., 2020; `promote`): no rung waits for
its slowest trial, a trial going on as soon as it stands among the best 1/ETA of those judged
at its rung so far. In several brackets (`--brackets B`: Hyperband, Li et al., 2018): the
trials dealt out among B halvings, the first judging from the first rung, each next one a
rung later, the last of all B = rungs + 1 training its trials to the end unjudged: a hedge
against rungs that judge too early (`deal`). A halving begins its trials from a supply: those
listed before it begins (`Dealt`: a grid's, a random search's), or those a TPE search suggests
as each begins, from the rungs judged so far (`search.Suggestions`: BOHB)."""

from __future__ import annotations

import math
import random
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


def bracket_sizes(n: int, eta: int, count: int, s_max: int) -> list[int]:
    """How many of `n` trials each of `count` brackets takes, in Hyperband's proportions: the
    bracket judging at s rungs ceil((s_max + 1) / (s + 1) * eta^s), s from s_max down (so
    that each bracket trains about as many steps as the others), at least one each, the
    shares rounded by their largest remainders."""
    weights = [math.ceil((s_max + 1) / (s + 1) * eta ** s) for s in range(s_max, s_max - count, -1)]
    shares = [n * w / sum(weights) for w in weights]
    sizes = [max(1, int(x)) for x in shares]
    by_remainder = sorted(range(count), key=lambda i: int(shares[i]) - shares[i])
    for i in by_remainder[:max(0, n - sum(sizes))]:
        sizes[i] += 1
    while sum(sizes) > n:  # the ones raised to 1 taken back from the largest
        sizes[sizes.index(max(sizes))] -= 1
    return sizes


def brackets_of(n: int, steps: int, eta: int, first: Optional[int],
                count: int = 1) -> list[tuple[int, list[int]]]:
    """How many of `n` trials each bracket of a halving takes and the steps it judges them
    at, train.steps last. One bracket: every trial, at `rungs`. `count` (Hyperband): bracket i
    judges from the i-th of those rungs on (the last of rungs + 1 brackets trains its trials
    to the end), in `bracket_sizes`'s numbers."""
    ends = rungs(n, steps, eta, first)
    if count == 1:
        return [(n, ends)]
    return [(size, ends[i:]) for i, size in enumerate(bracket_sizes(n, eta, count, len(ends) - 1))]


def deal(trials: list[Trial], eta: int, first: Optional[int], count: int = 1,
         seed: int = 0) -> list[tuple[list[Trial], list[int]]]:
    """The brackets of a halving of listed trials (`brackets_of`): each one's trials (in the
    sweep's order) and the steps it judges them at, its trials drawn at random (seeded: a
    sweep run again deals them alike)."""
    plan = brackets_of(len(trials), trials[0].spec.train.steps, eta, first, count)
    if count == 1:
        return [(list(trials), plan[0][1])]
    order = list(range(len(trials)))
    random.Random(seed).shuffle(order)
    out, at = [], 0
    for i, (size, ends) in enumerate(plan):
        out.append(([trials[j] for j in sorted(order[at:at + size])], ends))
        at += size
        for t in out[-1][0]:
            t.bracket = i + 1
    return out


class Dealt:
    """A bracket's trials, listed before it begins (a grid's or a random search's): what a
    halving begins, one after another (`fresh`: `search.Suggestions` is the other kind)."""

    def __init__(self, trials: list[Trial]):
        self.listed, self.n, self.begun = list(trials), len(trials), 0
        self.spec = trials[0].spec

    @property
    def left(self) -> bool:
        return self.begun < self.n

    def peek(self) -> Optional[Trial]:
        return self.listed[self.begun] if self.left else None

    def take(self) -> tuple[Trial, str]:
        self.begun += 1
        return self.listed[self.begun - 1], ""

    def ended(self) -> None:
        pass


def dealt(trials: list[Trial], eta: int, first: Optional[int], count: int = 1,
          seed: int = 0) -> list[tuple[Dealt, list[int]]]:
    """The brackets of a halving of listed trials (`deal`), for `halve` and `promote`."""
    return [(Dealt(group), ends) for group, ends in deal(trials, eta, first, count, seed)]


def describe(brackets: list[tuple], eta: int, asynchronous: bool = False) -> list[str]:
    """What a halving will do, a line a bracket (`baton sweep --list`)."""
    how = "as they are judged" if asynchronous else "each time"
    lines = []
    for i, (fresh, ends) in enumerate(brackets, 1):
        judged = (f"judged at step{'s' * (len(ends) > 2)} {', '.join(map(str, ends[:-1]))}; the "
                  f"best 1/{eta} go on {how}, the last to step {ends[-1]}") if len(ends) > 1 \
            else f"each to step {ends[-1]}, unjudged"
        which = (f" ({', '.join(t.name for t in fresh.listed)})" if fresh.listed is not None else
                 f", suggested as {'each' if asynchronous else 'the bracket'} begins")
        if len(brackets) == 1:
            lines.append(("asynchronous " if asynchronous else "") + "halving: " + (
                "" if fresh.listed is not None else f"{fresh.n} trials{which}, ") + judged)
        else:
            lines.append(f"bracket {i} of {len(brackets)}: {fresh.n} trial{'s' * (fresh.n > 1)}"
                         f"{which}, {judged}")
    return lines


def check_halving(trials: list[Trial], eta: Optional[int], first: Optional[int], where: str,
                  asynchronous: bool = False, brackets: int = 1, suggested: bool = False) -> None:
    """Refuse, in one line, a halving that cannot judge these trials (or its options given
    without `--halving ETA`; `suggested`: by a TPE search, which a synchronous halving of one
    bracket cannot inform)."""
    if eta is None:
        for given, flag, what in ((first, "--first-rung", "is where --halving first judges the trials"),
                                  (asynchronous, "--async", "promotes the trials of a --halving as "
                                                            "soon as they stand among the best"),
                                  (brackets != 1, "--brackets", "deals the trials of a --halving "
                                                                "out among several halvings")):
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
    most = len(rungs(len(trials), trials[0].spec.train.steps, eta, first))
    if not 1 <= brackets <= min(most, len(trials)):
        raise SpecError(f"{where}: --brackets {brackets}: give 1 to {min(most, len(trials))} (these "
                        f"{len(trials)} trials are judged at {most - 1} rung{'s' * (most != 2)} at "
                        f"most, so {most} brackets at most, the last training its trials to the "
                        "end, and a bracket takes at least one trial)")
    if suggested and not asynchronous and brackets == 1:
        raise SpecError(f"{where}: --search tpe with a synchronous --halving of one bracket would "
                        "suggest every trial before any result (all at random): add --async (each "
                        "suggested as it begins) or --brackets 2 or more (each bracket's from the "
                        "brackets before)")


def _at(t: Trial, ends: list[int], k: int) -> None:
    """`t` trains to (or is judged at) rung `k` of `ends`."""
    t.rung, t.reached = k, ends[k]


def halve(brackets: list[tuple], eta: int, each: Callable[[list[Trial], Optional[int]], None],
          log: Callable[[str], None]) -> None:
    """Successive halving of the trials of each bracket (`dealt`, `search.brackets`: its
    fresh trials and the steps it judges them at), a bracket after another; each bracket's
    trials taken as it begins (a TPE search suggests them from the brackets before)."""
    for i, (fresh, ends) in enumerate(brackets, 1):
        group, how = [], ""
        while fresh.peek() is not None:
            t, how = fresh.take()
            group.append(t)
        if not group:  # (a search that ran out of trials to suggest)
            log(f"bracket {i} of {len(brackets)}: no trial left to suggest")
            continue
        if len(brackets) > 1 or how:
            log((f"bracket {i} of {len(brackets)}: " if len(brackets) > 1 else "")
                + f"{len(group)} trial{'s' * (len(group) > 1)}{how}")
        _halve(group, eta, ends, each, log)


def _halve(trials: list[Trial], eta: int, ends: list[int],
           each: Callable[[list[Trial], Optional[int]], None], log: Callable[[str], None]) -> None:
    """Successive halving: every trial to the first rung, the best 1/`eta` of those judged
    there (at least one) on to the next, ..., the last rung's to train.steps; the others are
    "cut" where they stopped. A trial that trained past a rung before (a sweep run again) is
    kept without being judged there; one that ended (stopped early, failed) holds its place
    in the ranking but trains no further. `each(trials, until)` trains a rung's trials
    (`train_each`)."""
    metric, lowest = ranked_by(trials[0].spec)
    steps = trials[0].spec.train.steps
    alive = list(trials)
    for k, end in enumerate(ends):
        log(f"rung {k + 1} of {len(ends)}: {len(alive)} trial{'s' * (len(alive) > 1)} to step {end}")
        for t in alive:
            _at(t, ends, k)
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

    def __init__(self, fresh, eta: int, ends: list[int], log: Callable[[str], None], label: str = ""):
        self.fresh = fresh  # the trials it begins (`Dealt`, `search.Suggestions`)
        self.eta, self.ends, self.log, self.label = eta, ends, log, label  # label: its bracket
        self.metric, self.lowest = ranked_by(fresh.spec)
        self.judged: list[list[tuple[Trial, Optional[float]]]] = [[] for _ in ends]
        self.promoted: list[set] = [set() for _ in ends]  # the trials gone on from each rung
        self.running = 0  # handed out, not ended yet

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
                if t not in self.promoted[k]:
                    return self._go_on(t, k, place)
        return None if self.fresh.left or self.running else self._last_one()

    def _last_one(self) -> Optional[tuple[Trial, int, int]]:
        """With nothing left to begin or running and no trial at the last rung, the best of
        the highest rung reached goes on: of too few trials (a bracket's), the best 1/ETA is
        none, and synchronous halving keeps one too."""
        k = max((k for k, pairs in enumerate(self.judged) if pairs), default=len(self.ends) - 1)
        if k == len(self.ends) - 1:
            return None
        for place, (t, m) in enumerate(self._order(k), 1):
            if m is None:
                return None
            if t not in self.promoted[k]:
                return self._go_on(t, k, place)
        return None

    def _go_on(self, t: Trial, k: int, place: int) -> Optional[tuple[Trial, int, int]]:
        """`t` goes on from rung `k`: handed out, or, ended (stopped early), judged at the next
        rung without training, holding its place there (and the next one is looked for)."""
        if not t.ended:
            return t, k, place
        self._judge(t, k + 1, t.metric)
        self.promoted[k].add(t)
        return self._next()

    def _judge(self, t: Trial, rung: int, metric: Optional[float]) -> None:
        self.judged[rung].append((t, metric))
        _at(t, self.ends, rung)

    def peek(self) -> Optional[tuple[Trial, Optional[int]]]:
        found = self._next()
        if found is not None:
            return found[0], self._until(found[1] + 1)
        t = self.fresh.peek()
        return (t, self._until(0)) if t is not None else None

    def take(self) -> tuple[Trial, Optional[int]]:
        found = self._next()
        self.running += 1
        if found is None:
            t, how = self.fresh.take()
            _at(t, self.ends, 0)
            self.log(f"{self.label}trial {self.fresh.begun} of {self.fresh.n}: {t.name} "
                     f"({values_of(t)}) to step {self.ends[0]}{how}")
            return t, self._until(0)
        t, k, place = found
        self.promoted[k].add(t)
        _at(t, self.ends, k + 1)
        self.log(f"  {t.name} goes on to step {self.ends[k + 1]} (rung {k + 2} of {len(self.ends)}): "
                 f"{self.metric} {dict(self.judged[k])[t]:.4g} at step {self.ends[k]}, {place} of "
                 f"{len(self.judged[k])} judged there so far")
        return t, self._until(k + 1)

    def ended(self, t: Trial) -> None:
        """Judge `t` at the furthest rung its step reached (where it was sent, or beyond)."""
        self.running -= 1
        self.fresh.ended()
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


class Brackets:
    """Asynchronous halving in several brackets (`--brackets` with `--async`): one lineup
    over each bracket's `Promotions`, for `drive`. A trial going on, from whichever bracket,
    comes before a new one; a new one comes from the bracket that has begun the smallest part
    of its trials (the first on a tie), so that the brackets begin side by side."""

    def __init__(self, lineups: list[Promotions]):
        self.lineups = lineups
        self.of: dict[Trial, Promotions] = {}  # a trial handed out -> its bracket's lineup

    def _pick(self) -> Optional[Promotions]:
        for lineup in self.lineups:
            if lineup._next() is not None:
                return lineup
        fresh = [lineup for lineup in self.lineups if lineup.fresh.left]
        return min(fresh, key=lambda lu: lu.fresh.begun / lu.fresh.n) if fresh else None

    def peek(self) -> Optional[tuple[Trial, Optional[int]]]:
        lineup = self._pick()
        return lineup.peek() if lineup else None

    def take(self) -> tuple[Trial, Optional[int]]:
        lineup = self._pick()
        t, until = lineup.take()
        self.of[t] = lineup
        return t, until

    def ended(self, t: Trial) -> None:
        self.of[t].ended(t)


def promote(brackets: list[tuple], eta: int, drive_: Callable, log: Callable[[str], None]) -> None:
    """Asynchronous successive halving (`Promotions`) of each bracket's trials at its rungs
    (`dealt`, `search.brackets`), the brackets side by side (`Brackets`); `drive_(lineup)`
    trains what it hands out (`drive`)."""
    lineups = [Promotions(fresh, eta, ends, log, f"bracket {i}, " if len(brackets) > 1 else "")
               for i, (fresh, ends) in enumerate(brackets, 1)]
    drive_(lineups[0] if len(lineups) == 1 else Brackets(lineups))
    for lineup in lineups:
        lineup.cut()
