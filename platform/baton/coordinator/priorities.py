"""Priorities between jobs on one Ray cluster (`resources.priority`).

A job the cluster has too little room for takes room from running jobs of lower priority:
each of them keeps to a ceiling on its replicas while the job that asked runs, and shrinks to
it at its next check as `baton scale` makes it (a checkpoint of the step it reached, the world
re-formed smaller from it, the rest of its workers let go: nothing is trained twice or lost),
never below its elastic.min_dp; once that job ends, it grows back. Where that is not enough for
the asking job's smallest world (its min_dp), whole jobs are suspended (a ceiling of 0): a
checkpoint of the step reached, every worker let go, and the job starts again from that
checkpoint once the job that asked has ended and there is room. Lowest priority gives first,
and among equals the job that started last.

A job whose smallest world does not fit because other jobs of the list hold the room (even
after what jobs of lower priority give) waits in line: the highest priority first, then the
job that came first (a suspended job from its suspension). A job starts when the room no one
ahead of it has spoken for fits its smallest world, taking what it can use less the smallest
worlds of the jobs behind it that fit beside its own (`left_behind`); running jobs grow only
into room the line leaves (`spoken_for`), so that growth never starves a job in line.

Room that the jobs ahead in line cannot use yet (free, but too little for each of their
smallest worlds, even with what they could claim) is lent to a job behind them whose smallest
world it fits, once it has stayed so for BACKFILL_AFTER_S (`backfills`): that job starts out of
turn, and its entry names the jobs it borrowed from. The moment one of them could start with
the room lent back, it claims it as a job of higher priority claims room (`plan`: the
borrower shrinks toward its min_dp, or is suspended from a checkpoint of the step it reached,
nothing lost), and the claim lapses once that job's world has formed: the borrower is in line
again, or grows back where there is room.

Every job is listed in the cluster's key-value store (Ray's GCS, namespace `baton`):
`job/<key>` holds its priority, world, what a worker takes, since when it waits in line and
the workers it is starting; `claim/<theirs>/<mine>` is a claim, the most replicas job
`theirs` may keep while job `mine` runs. A job reads the claims on it where it reads its
`baton scale` ceiling and keeps to the lowest of them all. A run that
ends withdraws its entry and claims; one whose driver died (Ray marks its driver's job dead)
is dropped by whoever reads it next. The store lives as long as the cluster: nothing outlives
it, and a job resumed on another cluster starts free of claims.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

import ray

from baton.spec import JobSpec

if TYPE_CHECKING:
    from baton.coordinator.placement import Placement

NAMESPACE = "baton"
LOCK_S = 10.0  # the longest a claimant holds the list's lock (it reads and writes a few keys)
# How long room must stay lendable before a job behind in line starts on it: a job that ends
# frees its workers' room one at a time, and the job first in line takes it at its next look
# (every second); lent in between, it would be claimed back at once (a start and a suspension
# for nothing)
BACKFILL_AFTER_S = 3.0


@dataclass(frozen=True)
class Entry:
    """A running job, as the cluster's list holds it."""

    key: str
    name: str
    priority: int
    dp: int  # its world now
    min_dp: int
    per_replica: int  # workers a replica takes
    cpus: float  # one worker's
    gpus: float
    started_at: float
    driver: str  # the Ray job id of its driver (dead: the entry and its claims are stale)
    waiting_since: float = 0.0  # in line for room since then (time.time()); 0: not in line
    held: bool = False  # suspended by `baton scale --max-dp 0`: out of line until --clear
    starting: int = 0  # workers started from the line and not in a world yet: room taken
    borrows: tuple = ()  # started out of turn: the keys of the jobs then ahead of it in line
    borrowed_at: float = 0.0  # ...and when (time.time()): what they owe it ends if they leave the line
    quota: str = ""  # the quota it counts against (resources.quota); "": none
    over_quota: bool = False  # waits for its quota, not for room: out of the line meanwhile

    @property
    def need(self) -> int:
        """Workers its smallest world takes."""
        return self.min_dp * self.per_replica


def _fit(me: Entry, cpus: float, gpus: float) -> int:
    """How many of `me`'s workers `cpus` and `gpus` hold."""
    n = math.floor((cpus + 1e-9) / me.cpus)
    return min(n, math.floor((gpus + 1e-9) / me.gpus)) if me.gpus else n


def job_key(spec: JobSpec) -> str:
    """One job's key: its checkpoint folder's (one run of a job at a time holds its lease)."""
    return hashlib.sha256(spec.checkpoint_dir.encode()).hexdigest()[:16]


def lends(me: Entry, o: Entry) -> bool:
    """Whether `o` runs on room lent by `me`: it started out of turn while `me` waited ahead
    of it in line, and `me` has waited since."""
    return 0 < me.waiting_since <= o.borrowed_at and me.key in o.borrows


def plan(me: Entry, short: int, others: list[Entry], claims: dict[str, dict[str, int]],
         need: int = 0) -> tuple[dict[str, int], int]:
    """The claims `me` should hold for `short` more of its workers to fit, and how many of
    them the room those claims free fits (at most `short`): jobs shrink toward their min_dp
    for `short`; where that leaves fewer than `need` (what `me`'s smallest world lacks), whole
    jobs are suspended (a claim of 0) until `need` fits. `claims`: the live claims, job key
    -> claimant's key -> the most replicas it may keep, `me`'s included. Room a claim frees
    is pooled over the cluster (CPUs and GPUs counted, not which node they are on); a claim
    not yet kept to (the job still larger) counts as room coming; a job another claim holds
    lower gives from there. A job that runs on room `me` lent it (`lends`) gives first,
    whatever its priority."""

    def keeps(o: Entry) -> int:  # what `o` is held to by the claims of others
        return min([o.dp, *(v for k, v in claims.get(o.key, {}).items() if k != me.key)])

    givers = sorted((o for o in others if o.key != me.key and (
        lends(me, o) or o.priority < me.priority and (o.gpus or not me.gpus))),
        key=lambda o: (not lends(me, o), o.priority, -o.started_at))
    mine: dict[str, int] = {}
    cpus = gpus = 0.0
    for o in givers:  # room already coming
        held = claims.get(o.key, {}).get(me.key)
        if held is not None:
            mine[o.key] = held
            coming = max(0, keeps(o) - held) * o.per_replica
            cpus, gpus = cpus + coming * o.cpus, gpus + coming * o.gpus
    for o in givers:
        at = mine.get(o.key, keeps(o))
        while at > o.min_dp and _fit(me, cpus, gpus) < short:
            at -= 1
            cpus, gpus = cpus + o.per_replica * o.cpus, gpus + o.per_replica * o.gpus
        if at < keeps(o) or o.key in mine:
            mine[o.key] = at
    for o in givers:  # not enough for the smallest world: suspend whole jobs
        at = mine.get(o.key, keeps(o))
        if _fit(me, cpus, gpus) >= need:
            break
        if at > 0:
            mine[o.key] = 0
            cpus, gpus = cpus + at * o.per_replica * o.cpus, gpus + at * o.per_replica * o.gpus
    return mine, min(short, _fit(me, cpus, gpus))


def line(entries: list[Entry], claims: dict[str, dict[str, int]]) -> list[Entry]:
    """The jobs waiting for room, in the order they get it: the highest priority first, and
    among equals the one that has waited longest (a suspended job from its suspension). A job
    a ceiling of 0 holds (`baton scale --max-dp 0`, or a live claim), or one waiting for its
    quota (`quota_left`), is out of it meanwhile, its place kept."""
    return sorted((e for e in entries if e.waiting_since and not e.held and not e.over_quota
                   and 0 not in claims.get(e.key, {}).values()),
                  key=lambda e: (-e.priority, e.waiting_since))


def around(me: Entry, entries: list[Entry], claims: dict[str, dict[str, int]]) -> tuple[list[Entry], list[Entry]]:
    """The jobs ahead of `me` in line and those behind it (all of it ahead, for a job not in
    it)."""
    waiting = line(entries, claims)
    keys = [e.key for e in waiting]
    at = keys.index(me.key) if me.key in keys else len(waiting)
    return waiting[:at], waiting[at + 1:]


def ahead_of(me: Entry, entries: list[Entry], claims: dict[str, dict[str, int]]) -> list[Entry]:
    """The jobs ahead of `me` in line (all of it, for a job not in it)."""
    return around(me, entries, claims)[0]


def spoken_for(me: Entry, entries: list[Entry], claims: dict[str, dict[str, int]],
               line_too: bool = True) -> int:
    """Workers of `me`'s size that room spoken for takes from what is free now: the smallest
    worlds of the jobs ahead of `me` in line (all of the line, for a job not in it; none
    without `line_too`), and the workers of jobs that have left it and are starting. Counted
    over the cluster's CPUs and GPUs, not node by node (as `plan` counts)."""
    ahead = ahead_of(me, entries, claims) if line_too else []
    cpus, gpus = _starting(me, entries)
    return _as_workers(me, cpus + sum(e.need * e.cpus for e in ahead), gpus + sum(e.need * e.gpus for e in ahead))


def _as_workers(me: Entry, cpus: float, gpus: float) -> int:
    """How many of `me`'s workers `cpus` and `gpus` take up (rounded up)."""
    n = math.ceil(cpus / me.cpus - 1e-9)
    return max(n, math.ceil(gpus / me.gpus - 1e-9)) if me.gpus else n


def left_behind(me: Entry, room: int, entries: list[Entry], claims: dict[str, dict[str, int]]) -> int:
    """Workers of `me`'s size that `me`, starting on `room`, leaves to the jobs behind it in
    line whose smallest worlds fit beside its own (in line order, each that fits): they start
    beside it rather than wait for it to end, and it grows into what is left later, as a
    running job grows only into room the line leaves."""
    spare, left = room - me.need, 0
    for e in around(me, entries, claims)[1]:
        n = _as_workers(me, e.need * e.cpus, e.need * e.gpus)
        if left + n <= spare:
            left += n
    return left


def _starting(me: Entry, entries: list[Entry]) -> tuple[float, float]:
    """The CPUs and GPUs of the workers the other jobs are starting."""
    return (sum(e.starting * e.cpus for e in entries if e.key != me.key),
            sum(e.starting * e.gpus for e in entries if e.key != me.key))


def could_start(a: Entry, cpus: float, gpus: float, entries: list[Entry],
                claims: dict[str, dict[str, int]]) -> bool:
    """Whether job `a` could start its smallest world on `cpus` and `gpus` free, with what it
    could claim (`plan`: room lent, and jobs of lower priority)."""
    free = _fit(a, cpus, gpus)
    return free >= a.need or plan(a, a.need - free, entries, claims, a.need - free)[1] >= a.need - free


def backfills(me: Entry, room: int, cpus: float, gpus: float, entries: list[Entry],
              claims: dict[str, dict[str, int]]) -> list[Entry]:
    """The jobs ahead of `me` in line that lend it room, where `me` starts out of turn on
    `room` workers' worth (free room, less what jobs are starting), the cluster having `cpus`
    and `gpus` free: those jobs wait, and none of them could start on what is free (less
    what is starting), even with what it could claim. Empty: `me` does not."""
    ahead = ahead_of(me, entries, claims)
    if not ahead or room < me.need:
        return []
    taken = _starting(me, entries)
    cpus, gpus = cpus - taken[0], gpus - taken[1]
    return [] if any(could_start(a, cpus, gpus, entries, claims) for a in ahead) else ahead


def held_by_others(me: Entry, entries: list[Entry]) -> int:
    """Workers of `me`'s size that the other jobs of the list hold (running, or starting):
    room that comes free as they end."""
    others = [e for e in entries if e.key != me.key]
    return _fit(me, sum((e.dp * e.per_replica + e.starting) * e.cpus for e in others),
                sum((e.dp * e.per_replica + e.starting) * e.gpus for e in others))


def waits_in_line(room: int, need: int, free: int, held: int, suspended: bool, autoscaled: bool) -> bool:
    """Whether a job whose smallest world takes `need` workers waits in line instead of
    starting, with `room` workers' worth for it now (free, less what those ahead of it spoke
    for, plus what jobs of lower priority give), `free` on the cluster and `held` by the other
    jobs of the list. A suspended job waits for its room however long (its checkpoint is
    safe). Any other waits only for room those jobs hold (they will end), and not where an
    autoscaler can add nodes: there it starts, and its workers waiting for room ask for them."""
    if room >= need:
        return False
    return suspended or (not autoscaled and free + held >= need)


class Priorities:
    """A coordinator's part in the cluster's list: its own entry, its claims on others, and
    the claims on it. Without Ray (the unit tests' fake group) it does nothing."""

    def __init__(self, spec: JobSpec):
        self.spec, self.key = spec, job_key(spec)
        self.priority = spec.resources.priority
        self.on = ray.is_initialized()
        self.driver = ray.get_runtime_context().get_job_id() if self.on else ""
        self.started_at = time.time()
        self.claimed: dict[str, int] = {}  # my claims: job key -> its ceiling
        self.names: dict[str, str] = {}  # job key -> name, of those I claimed from
        self.holding: list[dict] = []  # the claims on me, as last read (`ceiling`)
        self.waiting_since = 0.0  # in line for room since then (0: not in line)
        self.held = False  # suspended by `baton scale --max-dp 0`: out of line
        self.starting = 0  # workers started from the line, until the world forms
        self.dp = 0  # the world, as listed
        self.ahead: list[str] = []  # the jobs ahead of it in line, as `spoken_for` last read
        self.holders: list[str] = []  # ...and the jobs that hold room (running, starting)
        self.borrows: list[str] = []  # started out of turn: the keys of the jobs it borrowed from
        self.borrowed_at = 0.0  # ...when (time.time())
        self.lenders: list[str] = []  # ...their names, while they wait (`ceiling` reads it)
        self.lendable_since = 0.0  # room it could borrow, seen at each look since (monotonic)
        self.lent: set[str] = set()  # the keys of jobs it claimed lent room back from
        # its workers found no room in parallel.timeout_s although an autoscaler runs (at its
        # maximum): it waits in line as on a cluster that cannot grow
        self.waited_for_nodes = False
        self.quota = spec.resources.quota or ""  # the quota it counts against
        self.over_quota = False  # waits for its quota (out of the line, its place kept)
        self.quota_room: Optional[dict] = None  # ...that quota, as `turn` last read it
        self.quota_held_by: list[str] = []  # ...and the jobs holding it

    def listed(self, dp: int) -> None:
        """Put this job in the list (again), at `dp` replicas (a world: out of the line, and
        the claims on room it had lent lapse)."""
        if dp:
            self.waiting_since, self.held, self.starting, self.over_quota = 0.0, False, 0, False
        self.dp = dp
        if self.on:
            _put(f"job/{self.key}", asdict(self._entry()))
        if dp:  # a world: the claims on room it had lent lapse
            for key in self.lent if self.on else ():
                _delete(f"claim/{key}/{self.key}")
                self.claimed.pop(key, None)
                self.names.pop(key, None)
            self.lent = set()

    def waits(self, held: bool = False) -> None:
        """In line for room (from now, unless it is already), or (`held`: `baton scale
        --max-dp 0` holds it suspended; a claim's hold is read from the claims) out of it, its
        place kept for when the hold lifts."""
        self.waiting_since = self.waiting_since or time.time()
        self.held, self.starting = held, 0
        self.borrows, self.lenders, self.borrowed_at = [], [], 0.0  # it holds no room now
        self.listed(0)

    def _starts(self, workers: int, lenders: list[Entry] = ()) -> None:
        """Out of line: `workers` start, and their room counts as taken until they form a
        world (`listed`), which Ray's free resources say only once their processes hold it;
        out of turn on room `lenders` lent (`backfills`), which they may claim back."""
        self.waiting_since, self.held, self.starting = 0.0, False, workers
        self.borrows, self.lenders = [e.key for e in lenders], [e.name for e in lenders]
        self.borrowed_at = time.time() if lenders else 0.0
        self.lendable_since = 0.0
        self.listed(self.dp)

    def turn(self, placement: "Placement", suspended: bool = False) -> int:
        """The workers this job starts with now, counted as taken in the list until they form
        a world; 0: it waits in line (`waits_in_line`). Decided under the list's lock, so that
        two jobs never count the same free room as theirs."""
        with _one_claimant() if self.on else contextlib.nullcontext():
            self.waits()
            if self._over_quota(placement.scale.min_workers):
                return 0
            room = placement.room()  # claims from jobs of lower priority, under the same lock
            free, lenders = placement.group.free_workers(), []
            if waits_in_line(room, placement.scale.min_workers, free, self.held_by_others(),
                             suspended, self.autoscaled and not self.waited_for_nodes):
                room, lenders = self._lendable(placement, free)
                if not lenders:
                    return 0
            if self.on:  # room for the smallest worlds of jobs behind it that fit beside it
                room -= left_behind(self._entry(), room, *read_list())
            workers = placement.first_workers(room)
            self._starts(workers, lenders)
            return workers

    def _over_quota(self, need: int) -> bool:
        """Whether the quota it counts against leaves too little for its smallest world
        (`need` workers) beside the other jobs counting against it: then it waits, out of the
        line (its place kept), until they hold less or the quota is raised."""
        if not (self.on and self.quota):
            return False
        from baton.coordinator import quotas

        entries, _ = read_list()
        bounds = quotas.read_quotas()
        left = quotas.quota_left(self._entry(), entries, bounds)
        self.quota_room, self.quota_held_by = bounds.get(self.quota), quotas.quota_holders(self._entry(), entries)
        over = left is not None and left < need
        if over != self.over_quota:
            self.over_quota = over
            self.listed(self.dp)
        return over

    def allowance(self) -> Optional[int]:
        """Workers of this job's size its quota leaves it, its own included (`quota_left`);
        None: no quota."""
        from baton.coordinator import quotas

        if not (self.on and self.quota):
            return None
        return quotas.quota_left(self._entry(), read_list()[0], quotas.read_quotas())

    def claiming(self):
        """The list's lock, where a quota bounds this job: a growth decided under it and its
        workers reserved (`reserve`) before another job of the quota decides."""
        return _one_claimant() if self.on and self.quota else contextlib.nullcontext()

    def reserve(self, workers: int) -> None:
        """A growth's `workers` are starting: counted against its quota (as `starting`) until
        its world re-forms (`listed`), or 0 where the growth is given up. Only for a job with
        a quota (the line counts the workers of jobs starting from it, not of growths)."""
        if self.on and self.quota:
            self.starting = workers
            _put(f"job/{self.key}", asdict(self._entry()))

    def _lendable(self, placement: "Placement", free: int) -> tuple[int, list[Entry]]:
        """The room this job, waiting in line, may start on out of turn (up to its max_dp),
        and the jobs ahead of it that lend it (`backfills`), once it has been so at every
        look for BACKFILL_AFTER_S; (0, []) until then."""
        if not self.on:
            return 0, []
        others, claims = read_list()
        me = self._entry()
        room = min(placement.most_now(), free - spoken_for(me, others, claims, line_too=False))
        cpus, gpus = placement.group.free_room()
        lenders = backfills(me, room, cpus, gpus, others, claims)
        now = time.monotonic()
        if not lenders:
            self.lendable_since = 0.0
            return 0, []
        self.lendable_since = self.lendable_since or now
        return (room, lenders) if now - self.lendable_since >= BACKFILL_AFTER_S else (0, [])

    @functools.cached_property
    def autoscaled(self) -> bool:
        """Whether an autoscaler can add nodes to the cluster (asked once a run)."""
        from baton.workers.capacity import autoscaler_present

        return self.on and autoscaler_present()

    def spoken_for(self) -> int:
        """Workers of this job's size that the free room owes others (`spoken_for`)."""
        if not self.on:
            return 0
        others, claims = read_list()
        self.ahead = [e.name for e in ahead_of(self._entry(), others, claims)]
        self.holders = [e.name for e in others if e.key != self.key and (e.dp or e.starting)]
        return spoken_for(self._entry(), others, claims)

    def held_by_others(self) -> int:
        """Workers of this job's size the other jobs of the list hold (`held_by_others`)."""
        return held_by_others(self._entry(), read_list()[0]) if self.on else 0

    def _entry(self) -> Entry:
        r = self.spec.resources
        return Entry(self.key, self.spec.name, self.priority, self.dp, self.spec.dp_range[0],
                     self.spec.per_replica, r.cpus_per_worker, r.gpus_per_worker,
                     self.started_at, self.driver, self.waiting_since, self.held, self.starting,
                     tuple(self.borrows), self.borrowed_at, self.quota, self.over_quota)

    def ask(self, short: int, need: int = 0) -> tuple[int, dict[str, int]]:
        """Claim room for `short` more workers from jobs of lower priority (and, in line, room
        it lent), suspending whole jobs where the room for `need` (this job's smallest world)
        takes it (`plan`); nothing where what they can give does not reach `need` (they would
        give it for nothing). Returns how many of them the room claimed fits (coming or free
        already), and the claims made or lowered now (job name -> its ceiling, 0: suspended)."""
        short = max(short, need)
        if not self.on or short <= 0 or (self.priority <= 0 and not self.waiting_since):
            return 0, {}
        changed = {}
        with _one_claimant():
            others, claims = read_list()
            me = self._entry()
            mine, coming = plan(me, short, others, claims, need)
            if coming < need:
                return 0, {}
            names = {o.key: o.name for o in others}
            # room lent to a job of equal priority is claimed until this one's world forms; a
            # job of lower priority keeps to a claim while this one runs, lent or not
            self.lent |= {o.key for o in others if o.key in mine and lends(me, o)
                          and o.priority >= me.priority}
            for key, at in mine.items():
                if self.claimed.get(key) != at:
                    _put(f"claim/{key}/{self.key}", {"max_dp": at, "by": self.spec.name,
                                                     "priority": self.priority, "driver": self.driver})
                    changed[names[key]] = at
        self.claimed, self.names = mine, {k: names[k] for k in mine}
        return coming, changed

    def ceiling(self) -> Optional[int]:
        """The lowest ceiling a live claim on this job sets (None: none; 0: suspend), dropping
        the claims of drivers that are gone; `holding` says whose they are, `lenders` which of
        the jobs that lent it room still wait."""
        if not self.on:
            return None
        from ray.experimental.internal_kv import _internal_kv_get

        live, held = _live_drivers(), []
        for key in _keys(f"claim/{self.key}/"):
            raw = _internal_kv_get(key, namespace=NAMESPACE)
            try:
                claim = json.loads(raw)
                at, driver = int(claim["max_dp"]), str(claim["driver"])
            except (TypeError, ValueError, KeyError):
                claim, at, driver = {}, 0, ""
            if driver not in live or at < 0:
                _delete(key)
                continue
            held.append({"by": str(claim.get("by")), "priority": claim.get("priority"), "max_dp": at})
        self.holding = sorted(held, key=lambda c: c["max_dp"])
        if self.lenders:  # those that lent it room and still wait (`baton status` names them)
            self.lenders = [e.name for e in read_list()[0] if lends(e, self._entry())]
        return self.holding[0]["max_dp"] if held else None

    def status(self, working: bool, in_line: bool) -> dict:
        """What `baton status` shows of the job's place among the others: the room it claimed
        from jobs of lower priority, the jobs whose room it started on (`working`: while it
        has workers), and (`in_line`: queued or suspended) what it waits for: its quota's
        room, or its turn in line."""
        return {**({"room_from": {self.names[k]: at for k, at in self.claimed.items()}}
                   if self.claimed else {}),
                **({"lent_by": self.lenders} if self.lenders and working else {}),
                **({"quota_wait": {"quota": self.quota, "room": self.quota_room,
                                   "held_by": self.quota_held_by}} if self.over_quota else
                   {"in_line": {"since": round(self.waiting_since, 3), "ahead": self.ahead,
                                "room_held_by": self.holders}} if in_line else {})}

    def withdraw(self) -> None:
        """The run is ending: its claims go (those jobs may grow back, and a job suspended
        for it is in line again) while its entry still holds its room: freed before, that room
        would go to whoever looked first, not to the job its claim held out of the line."""
        if not self.on or not ray.is_initialized():
            return
        for key in _keys("claim/"):  # those on jobs that have ended since too
            if key.endswith(f"/{self.key}"):
                _delete(key)
        self.claimed = {}

    def close(self) -> None:
        """The run has ended and its workers are gone: out of the list, its claims withdrawn."""
        self.withdraw()
        if self.on and ray.is_initialized():
            _delete(f"job/{self.key}")

def read_list() -> tuple[list[Entry], dict[str, dict[str, int]]]:
    """The live jobs of the list and the claims on them (those of dead drivers dropped)."""
    from ray.experimental.internal_kv import _internal_kv_get

    live, entries, claims = _live_drivers(), [], {}
    for key in _keys("job/"):
        try:
            entry = Entry(**json.loads(_internal_kv_get(key, namespace=NAMESPACE)))
        except (TypeError, ValueError):
            entry = None
        if entry is None or entry.driver not in live:
            _delete(key)
            continue
        entries.append(entry)
    for key in _keys("claim/"):
        _, on, by = key.split("/")
        try:
            claim = json.loads(_internal_kv_get(key, namespace=NAMESPACE))
            if claim["driver"] in live:
                claims.setdefault(on, {})[by] = int(claim["max_dp"])
                continue
        except (TypeError, ValueError, KeyError):
            pass
        _delete(key)
    return entries, claims


_holding = threading.local()  # how deep this thread is in `_one_claimant`


@contextlib.contextmanager
def _one_claimant():
    """One job at a time reads the list and writes its claims: two at once could each count
    the same replica of a third as theirs. The lock is a key put only where there is none,
    holding its taker's time; one older than LOCK_S (its taker died holding it) is taken over.
    A thread that holds it already goes on (a start's decision asks for room inside it)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

    if getattr(_holding, "depth", 0):
        _holding.depth += 1
        try:
            yield
        finally:
            _holding.depth -= 1
        return
    token = json.dumps({"at": time.time(), "id": uuid.uuid4().hex})
    while _internal_kv_put("lock", token, overwrite=False, namespace=NAMESPACE):  # True: taken
        try:
            at = float(json.loads(_internal_kv_get("lock", namespace=NAMESPACE))["at"])
        except (TypeError, ValueError, KeyError):
            continue  # let go meanwhile
        if time.time() - at > LOCK_S:
            _delete("lock")
        time.sleep(0.02)
    _holding.depth = 1
    try:
        yield
    finally:
        _holding.depth = 0
        if _internal_kv_get("lock", namespace=NAMESPACE) == token.encode():
            _delete("lock")


def _live_drivers() -> set[str]:
    from ray._private import state

    return {job["JobID"] for job in state.jobs() if not job["IsDead"]}


def _keys(prefix: str) -> list[str]:
    from ray.experimental.internal_kv import _internal_kv_list

    return [k.decode() for k in _internal_kv_list(prefix, namespace=NAMESPACE)]


def _put(key: str, value: dict) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, json.dumps(value), namespace=NAMESPACE)


def _delete(key: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key, namespace=NAMESPACE)
