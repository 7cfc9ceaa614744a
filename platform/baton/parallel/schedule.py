"""Pipeline schedules as plain data, and a simulator that checks and times them.

A schedule is, for each pipeline rank, the ordered list of forward and backward actions that
rank runs in one optimizer step. With `v` model chunks per rank (interleaved 1F1B), chunk `c`
of rank `r` is global stage `c * p + r`, so activations go round the ranks `v` times.

Nothing here touches torch or Ray: the runtime (`baton.parallel.pipeline`) executes these
lists, tests check them with `simulate`, and the benchmark compares measured idle time with
what `simulate` and the textbook formulas predict.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" (forward) or "B" (backward)
    mb: int  # micro-batch
    chunk: int = 0  # which of this rank's model chunks

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, p: int) -> int:
    return chunk * p + rank


def owner_of(stage: int, p: int) -> tuple[int, int]:
    """(rank, chunk) that holds global stage `stage`."""
    return stage % p, stage // p


def build(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Actions per rank for `p` ranks, `m` micro-batches and `v` chunks per rank."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1, got p={p} m={m} v={v}")
    if schedule != "interleaved-1f1b" and v != 1:
        raise ValueError(f"{schedule} runs one chunk per rank, got v={v}")
    if schedule == "gpipe":  # all forwards, then all backwards: m micro-batches' activations live
        return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
                for _ in range(p)]
    return [_one_f_one_b(p, m, v, rank) for rank in range(p)]


def _one_f_one_b(p: int, m: int, v: int, rank: int) -> list[Action]:
    """1F1B (v = 1) and its interleaved form (Narayanan et al. 2021, as in Megatron-LM).

    Micro-batches go in rounds; within a round, every chunk's forward runs for the whole round
    before the next chunk's (backwards run the chunks in reverse). After a warm-up of
    forwards, each forward is followed by one backward, which frees activations as fast as
    they are made. Rounds hold g >= p micro-batches and all have the same size (g divides m;
    g = m when nothing else does): with a short last round, interleaving deadlocks (p=4, m=5,
    v=3 does). The unit tests simulate every p <= 8, m <= 64, v <= 4."""
    rounds = max(d for d in range(1, max(1, m // p) + 1) if m % d == 0)
    g = m // rounds
    groups = [range(i * g, (i + 1) * g) for i in range(rounds)]
    fwd = [(mb, c) for r in groups for c in range(v) for mb in r]
    bwd = [(mb, c) for r in groups for c in reversed(range(v)) for mb in r]
    total = m * v
    warmup = (p - rank - 1) if v == 1 else (p - rank - 1) * 2 + (v - 1) * g
    warmup = min(warmup, total)
    out = [Action("F", *fwd[i]) for i in range(warmup)]
    for f in range(warmup, total):
        out.append(Action("F", *fwd[f]))
        out.append(Action("B", *bwd[f - warmup]))
    out += [Action("B", *bwd[b]) for b in range(total - warmup, total)]
    return out


# -- dependencies, simulation ------------------------------------------------------------------


def needs(action: Action, rank: int, p: int, v: int) -> list[tuple[str, int, int]]:
    """The results this action waits for, as (kind, micro-batch, global stage)."""
    s = stage_of(rank, action.chunk, p)
    last = p * v - 1
    if action.kind == "F":
        return [("F", action.mb, s - 1)] if s > 0 else []
    return [("F", action.mb, s)] + ([("B", action.mb, s + 1)] if s < last else [])


@dataclass
class Simulation:
    start: list[list[float]]  # per rank, per action
    end: list[list[float]]
    makespan: float
    bubble: float  # idle time over total time, all ranks together
    peak_live: list[int]  # per rank: most micro-batch activations alive at once (all chunks)


def simulate(actions: list[list[Action]], p: int, v: int = 1, fwd_s: float = 1.0,
             bwd_s: float = 2.0, comm_s: float = 0.0) -> Simulation:
    """Run the schedule on an idealised machine (every stage costs the same, transfers take
    `comm_s`); raises ValueError if it deadlocks."""
    done: dict[tuple[str, int, int], float] = {}
    nxt = [0] * p
    free = [0.0] * p
    start = [[0.0] * len(a) for a in actions]
    end = [[0.0] * len(a) for a in actions]
    remaining = sum(map(len, actions))
    while remaining:
        progressed = False
        for r in range(p):
            while nxt[r] < len(actions[r]):
                a = actions[r][nxt[r]]
                deps = needs(a, r, p, v)
                if any(d not in done for d in deps):
                    break
                ready = max([free[r]] + [done[d] + (comm_s if d[2] != stage_of(r, a.chunk, p) else 0)
                                         for d in deps])
                cost = fwd_s if a.kind == "F" else bwd_s
                start[r][nxt[r]], end[r][nxt[r]] = ready, ready + cost
                free[r] = ready + cost
                done[(a.kind, a.mb, stage_of(r, a.chunk, p))] = free[r]
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: actions[r][nxt[r]] for r in range(p) if nxt[r] < len(actions[r])}
            raise ValueError(f"schedule deadlocks: ranks wait at {stuck}")
    makespan = max(max(e) for e in end if e)
    busy = sum(e - s for rs, re_ in zip(start, end) for s, e in zip(rs, re_))
    return Simulation(start, end, makespan, 1 - busy / (p * makespan),
                      [peak_live(a) for a in actions])


def peak_live(actions: list[Action]) -> int:
    """Most (micro-batch, chunk) activations held at once: made by F, freed by B."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def order_problem(actions: list[list[Action]], p: int, v: int) -> str | None:
    """None when every rank receives from each peer in the order that peer sends, else what
    differs. gloo matches messages by tag, so order does not matter there; NCCL has no tags
    and matches by order, so a GPU pipeline needs this (interleaved 1F1B with m not a multiple
    of p can break it)."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    last = p * v - 1
    for r, acts in enumerate(actions):
        for a in acts:
            s = stage_of(r, a.chunk, p)
            # what this action receives before it runs, and sends after
            if a.kind == "F" and s > 0:
                received.setdefault((owner_of(s - 1, p)[0], r), []).append(("F", a.mb, s - 1))
            if a.kind == "F" and s < last:
                sent.setdefault((r, owner_of(s + 1, p)[0]), []).append(("F", a.mb, s))
            if a.kind == "B" and s < last:
                received.setdefault((owner_of(s + 1, p)[0], r), []).append(("B", a.mb, s + 1))
            if a.kind == "B" and s > 0:
                sent.setdefault((r, owner_of(s - 1, p)[0]), []).append(("B", a.mb, s))
    for pair in set(sent) | set(received):
        if sent.get(pair) != received.get(pair):
            return f"rank {pair[0]} sends to rank {pair[1]} in another order than it receives"
    return None


def textbook_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction from the papers: (p-1)/(m+p-1) for GPipe and 1F1B; interleaving divides
    the idle time by v: (p-1)/(v*m + p-1). Exact for equal stages and m a multiple of p."""
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)
