"""`baton sweep --trials N --search tpe`: trials suggested one at a time from the results so
far, instead of drawn all at once.

Optuna's Tree-structured Parzen Estimator (Bergstra et al., 2011; Optuna's `TPESampler`,
multivariate: the axes modelled together): after a few random trials (`startup`), each next
trial's values are drawn where a model of the good trials' values is dense and the bad
trials' is not. The axes are the random search's
(a range: `loguniform`, `uniform`, `randint`; a list: one of its values), the result each
trial is judged by is the sweep's metric (`sweeps.ranked_by`), and a trial that failed tells
the model nothing (it is left out, as Optuna does with a failed trial). With `--concurrent`,
the trials still running count as if they had scored the worst so far (Optuna's "constant
liar"), so that those started together do not crowd one place.

The sampler is seeded, so a sweep a trial at a time suggests the same trials for the same
results: run again, each trial done is not trained again and tells its result, and the sweep
goes on where it stopped (`replay` lists them, for `baton sweep --list`). Trials run side by
side end in an order the model sees, so such a sweep run again may suggest others.
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


class Suggested:
    """The trials of a TPE search, for `sweeps.drive`: `peek()` asks the model for the next
    trial (once fewer than `n` were handed out), `take()` hands it out, `ended(t)` tells the
    model its result."""

    def __init__(self, job, axes: dict, overrides: list[str], n: Optional[int], seed: int, lowest: bool,
                 log: Callable[[str], None]):
        optuna = _optuna()
        where = job if isinstance(job, str) else "<spec>"
        if n is None:
            raise SpecError(f"{where}: --search tpe suggests --trials N trials: give --trials")
        self.axes, self.n, self.log = parsed_axes(where, axes, n), n, log
        self.make = maker(job, overrides)
        with warnings.catch_warnings():  # (multivariate is "experimental" in Optuna's words)
            warnings.simplefilter("ignore")
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup(n),
                                                 multivariate=True, constant_liar=True)
        self.study = optuna.create_study(direction="minimize" if lowest else "maximize",
                                         sampler=sampler)
        self.trials: list[Trial] = []  # handed out, in order
        self.asked: dict[str, list] = {}  # a trial's name -> its Optuna trials not yet told
        self.next: Optional[Trial] = None
        self.exhausted = False

    def peek(self) -> Optional[tuple[Trial, None]]:
        if self.next is None and len(self.trials) < self.n and not self.exhausted:
            self.next = self._suggest()
        return (self.next, None) if self.next is not None else None

    def take(self) -> tuple[Trial, None]:
        t, self.next = self.next, None
        self.trials.append(t)
        told = sum(1 for x in self.study.trials if x.state.is_finished())
        how = "at random" if len(self.trials) <= startup(self.n) else f"from {told} results"
        self.log(f"trial {len(self.trials)} of {self.n}: {t.name} ({values_of(t)}), suggested {how}")
        return t, None

    def ended(self, t: Trial) -> None:
        for asked in self.asked.pop(t.name, []):
            self._tell(asked, t)

    def _suggest(self) -> Optional[Trial]:
        """The next trial not handed out yet. A suggestion of one that was (its values, once
        rounded as a draw rounds them) is told that one's result (or waits for it) and the
        model asked again; ASKS such in a row end the search."""
        for _ in range(ASKS):
            asked = self.study.ask()
            t = self.make({key: _value(asked, key, axis) for key, axis in self.axes.items()})
            known = next((x for x in self.trials if x.name == t.name), None)
            if known is None:
                self.asked[t.name] = [asked]
                return t
            if known.name in self.asked:  # still training: told when it ends
                self.asked[known.name].append(asked)
            else:
                self._tell(asked, known)
        self.exhausted = True
        self.log(f"the search suggested only trials already run, {ASKS} times in a row: it "
                 f"ends at {len(self.trials)} trials")
        return None

    def _tell(self, asked, t: Trial) -> None:
        optuna = _optuna()
        if t.metric is None or t.state == "failed":
            self.study.tell(asked, state=optuna.trial.TrialState.FAIL)
        else:
            self.study.tell(asked, t.metric)


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
    search = Suggested(job, axes, overrides, n, seed, lowest, lambda line: None)
    while search.peek() is not None:
        t, _ = search.take()
        meta = done(t.spec)
        if meta is None:
            break
        t.state, t.step = "done before", meta["step"]
        t.metric = metric_of(t.spec, meta)
        search.ended(t)
    return search.trials
