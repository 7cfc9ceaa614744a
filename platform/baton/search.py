"""`baton sweep --trials N --search tpe`: trials suggested one at a time from the results so
far, instead of drawn all at once; with `--halving` too, BOHB's mix of the two.

Optuna's Tree-structured Parzen Estimator (Bergstra et al., 2011; Optuna's `TPESampler`,
multivariate: the axes modelled together): after a few random trials (`startup`), each next
trial's values are drawn where a model of the good trials' values is dense and the bad
trials' is not. The axes are the random search's
(a range: `loguniform`, `uniform`, `randint`; a list: one of its values), the result each
trial is judged by is the sweep's metric (`sweeps.ranked_by`), and a trial that failed tells
the model nothing (it is left out, as Optuna does with a failed trial). With `--concurrent`,
the trials still running count as if they had scored the worst so far (Optuna's "constant
liar"), so that those started together do not crowd one place.

Under successive halving (`--halving`, `halving.py`) a trial judged at a rung and not (yet)
gone on tells the model its metric at that rung's step (an Optuna trial "pruned" there), and
TPE's good trials are those that trained furthest, then the best at that step: BOHB's model
(Falkner et al., 2018) in the form Optuna gives it (TPE with a Hyperband pruner). Each fresh
trial of an asynchronous halving is suggested as it begins; a synchronous halving's, as its
bracket begins (`Suggestions`).

The model is built again for each suggestion from what every trial has shown by then
(`Model.study`), and seeded by the sweep's seed and the number of trials handed out, so a
sweep a trial at a time suggests the same trials for the same results: run again, each
trial done is not trained again and tells its result, and the sweep goes on where it stopped
(`replay` lists them, for `baton sweep --list`). Trials run side by side end in an order the
model sees, so such a sweep run again may suggest others.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

from baton.errors import SpecError
from baton.sweeps import Draw, Trial, done, maker, metric_of, parsed_axes, values_of

ASKS = 100  # suggestions already trained in a row before the space is taken as exhausted


def _optuna():
    try:
        import optuna
    except ImportError:
        raise SpecError("--search tpe needs Optuna: pip install 'baton[search]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def startup(n: int) -> int:
    """The random trials before the model is used: a third of the sweep, 3 to 10 (Optuna's
    default is 10: a short sweep would be all random)."""
    return min(10, max(3, n // 3))


class Model:
    """The TPE model of a sweep's `n` trials: `peek()` the next trial it suggests (once fewer
    than `n` were handed out), `take()` it (with how it was suggested), `ended()` when a
    result came in (the suggestion peeked is made again with it)."""

    def __init__(self, job, axes: dict, overrides: list[str], n: Optional[int], seed: int,
                 lowest: bool, log: Callable[[str], None]):
        _optuna()
        where = job if isinstance(job, str) else "<spec>"
        if n is None:
            raise SpecError(f"{where}: --search tpe suggests --trials N trials: give --trials")
        self.axes, self.n, self.seed, self.lowest, self.log = parsed_axes(where, axes, n), n, seed, lowest, log
        self.make = maker(job, overrides)
        self.base = self.make({})  # the job itself: its metric, its world
        self.trials: list[Trial] = []  # handed out, in order
        self.next: Optional[tuple[Trial, str]] = None
        self.exhausted = False

    @property
    def left(self) -> bool:
        return len(self.trials) < self.n and not self.exhausted

    def peek(self) -> Optional[Trial]:
        if self.next is None and self.left:
            self.next = self._suggest()
        return self.next[0] if self.next else None

    def take(self) -> tuple[Trial, str]:
        """The trial peeked, handed out, and how it was suggested ("at random", "from 6
        results")."""
        self.peek()
        (t, how), self.next = self.next, None
        self.trials.append(t)
        return t, how

    def ended(self) -> None:
        self.next = None

    def study(self):
        """An in-memory Optuna study of what each trial handed out has shown (`_observed`)."""
        optuna = _optuna()
        with warnings.catch_warnings():  # (multivariate is "experimental" in Optuna's words)
            warnings.simplefilter("ignore")
            sampler = optuna.samplers.TPESampler(seed=(self.seed * 1_000_003 + len(self.trials)) % 2**32,
                                                 n_startup_trials=startup(self.n), multivariate=True,
                                                 constant_liar=True)
        study = optuna.create_study(direction="minimize" if self.lowest else "maximize",
                                    sampler=sampler)
        for t in self.trials:
            study.add_trial(self._observed(t))
        return study

    def _observed(self, t: Trial):
        """`t` as an Optuna trial: complete with its metric where it trained every step (or
        ended: stopped early); pruned at its step where it was judged at a rung; running
        while it trains to its first result; failed where it failed or stopped without a
        metric."""
        optuna = _optuna()
        state = optuna.trial.TrialState
        params = {key: _param(t.values[key], axis) for key, axis in self.axes.items()}
        dists = {key: _distribution(axis) for key, axis in self.axes.items()}
        if t.metric is None and t.state == "pending":  # (handed out, no result yet)
            return optuna.trial.create_trial(params=params, distributions=dists, state=state.RUNNING)
        if t.metric is None or t.state == "failed":
            return optuna.trial.create_trial(params=params, distributions=dists, state=state.FAIL)
        if t.ended or t.step >= t.spec.train.steps:
            return optuna.trial.create_trial(params=params, distributions=dists, value=t.metric)
        return optuna.trial.create_trial(params=params, distributions=dists, state=state.PRUNED,
                                         intermediate_values={t.step: t.metric})

    def _suggest(self) -> Optional[tuple[Trial, str]]:
        """The next trial not handed out yet. A suggestion of one that was (its values, once
        rounded as a draw rounds them) is told that one's result and the model asked again;
        ASKS such in a row end the search."""
        optuna = _optuna()
        study = self.study()
        told = sum(x.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
                   for x in study.trials)
        how = "at random" if told < startup(self.n) else f"from {told} results"
        for _ in range(ASKS):
            asked = study.ask()
            t = self.make({key: _value(asked, key, axis) for key, axis in self.axes.items()})
            known = next((x for x in self.trials if x.name == t.name), None)
            if known is None:
                return t, how
            seen = self._observed(known)
            if seen.state.is_finished():  # (one still running stays so: a liar)
                study.tell(asked, seen.value, state=seen.state)
        self.exhausted = True
        self.log(f"the search suggested only trials already run, {ASKS} times in a row: it "
                 f"ends at {len(self.trials)} trials")
        return None


class Suggested:
    """The trials of a TPE search each trained to its end, for `sweeps.drive`."""

    def __init__(self, model: Model):
        self.model = model

    @property
    def trials(self) -> list[Trial]:
        return self.model.trials

    def peek(self) -> Optional[tuple[Trial, None]]:
        t = self.model.peek()
        return (t, None) if t is not None else None

    def take(self) -> tuple[Trial, None]:
        t, how = self.model.take()
        self.model.log(f"trial {len(self.trials)} of {self.model.n}: {t.name} ({values_of(t)}), "
                       f"suggested {how}")
        return t, None

    def ended(self, t: Trial) -> None:
        self.model.ended()


class Suggestions:
    """A bracket's share of a TPE search (`n` of the model's trials, `halving.py`'s `fresh`),
    each suggested as it begins, from every bracket's results so far."""

    def __init__(self, model: Model, n: int, bracket: int = 0):
        self.model, self.n, self.bracket, self.begun = model, n, bracket, 0
        self.spec = model.base.spec
        self.listed = None  # (no trial is known before it begins)

    @property
    def left(self) -> bool:
        """Whether it has a trial to begin: its share not all begun, and the model suggests one
        (kept until taken or a result comes in, so asking again costs nothing)."""
        return self.begun < self.n and self.model.peek() is not None

    def peek(self) -> Optional[Trial]:
        return self.model.peek() if self.left else None

    def take(self) -> tuple[Trial, str]:
        t, how = self.model.take()
        t.bracket, self.begun = self.bracket, self.begun + 1
        return t, f", suggested {how}"

    def ended(self) -> None:
        self.model.ended()


def brackets(model: Model, eta: int, first: Optional[int], count: int) -> list[tuple[Suggestions, list[int]]]:
    """A TPE search's brackets of a halving (`halving.brackets_of`), each its share of the
    trials, suggested as they begin, and the steps it judges them at."""
    from baton.halving import brackets_of

    plan = brackets_of(model.n, model.base.spec.train.steps, eta, first, count)
    return [(Suggestions(model, size, i if count > 1 else 0), ends) for i, (size, ends) in enumerate(plan, 1)]


def _distribution(axis: list | Draw):
    """The Optuna distribution of an axis, as `_value` asks for it."""
    dists = _optuna().distributions
    if isinstance(axis, list):
        return dists.CategoricalDistribution(list(range(len(axis))))
    if axis.kind == "randint":
        return dists.IntDistribution(int(axis.low), int(axis.high))
    return dists.FloatDistribution(axis.low, axis.high, log=axis.kind == "loguniform")


def _param(value, axis: list | Draw):
    """A trial's value of an axis, as Optuna holds it (`_distribution`)."""
    if isinstance(axis, list):
        return axis.index(value)
    if axis.kind == "randint":
        return int(value)
    return min(max(float(value), axis.low), axis.high)  # (rounded to 3 digits, it can leave the range)


def _value(asked, key: str, axis: list | Draw):
    """One axis's value of an Optuna trial: a range's (a float rounded to 3 significant
    digits, as `Draw.sample` rounds), or one of a list's values (by its index, so that any
    YAML value can be one)."""
    if isinstance(axis, list):
        return axis[asked.suggest_categorical(key, list(range(len(axis))))]
    if axis.kind == "randint":
        return asked.suggest_int(key, int(axis.low), int(axis.high))
    x = asked.suggest_float(key, axis.low, axis.high, log=axis.kind == "loguniform")
    return float(f"{x:.3g}")


def replay(job, axes: dict, overrides: list[str], n: Optional[int], seed: int,
           lowest: bool) -> list[Trial]:
    """The trials a sweep run a trial at a time would suggest, as far as their results are
    known (each done one's from its checkpoint), and the first whose result is not (for
    `baton sweep --list`)."""
    search = Suggested(Model(job, axes, overrides, n, seed, lowest, lambda line: None))
    while search.peek() is not None:
        t, _ = search.model.take()
        meta = done(t.spec)
        if meta is None:
            break
        t.state, t.step = "done before", meta["step"]
        t.metric = metric_of(t.spec, meta)
        search.ended(t)
    return search.trials
