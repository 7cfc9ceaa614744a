"""Cutting a sequence of layers into contiguous pipeline stages.

`balanced` splits a list of per-layer costs (parameter counts, or measured seconds) into
`parts` contiguous runs, minimising the most expensive run: the slowest stage sets the pace of
the whole pipeline.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence


def balanced(costs: Sequence[float], parts: int) -> list[int]:
    """Layer counts per stage (each >= 1) minimising the largest stage cost. Exact dynamic
    programme, O(parts * n^2): n is a layer count, never large."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the least possible largest stage cost for the first i layers in k stages
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):  # the last stage holds layers j .. i-1
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = cost, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) layer indices of each stage."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def plan_stages(spec, measure: Callable[[], list[float]]) -> Optional[list[int]]:
    """Layers per pipeline stage (pp x chunks of them) from the spec's parallel.partition:
    an explicit list, balanced parameter counts, or balanced times that `measure()` returns
    (per layer, measured on a worker). None without a pipeline."""
    from baton.models import layer_params

    p = spec.parallel
    if p.pp == 1:
        return None
    if isinstance(p.partition, list):
        return list(p.partition)
    costs = measure() if p.partition == "time" else layer_params(spec.model)
    return balanced(costs, p.pp * spec.chunks)
