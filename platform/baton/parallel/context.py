"""Context parallelism (`parallel.cp`): each row's sequence split over cp workers, for rows
longer than one worker's activations hold.

The cp workers of a replica read the same rows; each embeds, runs every layer but attention
on, and computes the loss of its own contiguous part of each row's positions (a cp-th of
them). Attention needs every position: before it, an all-to-all turns each worker's queries,
keys and values of its part of the sequence, all heads, into the whole sequence of a cp-th of
the heads; attention runs there (causal, a document mask, a sliding window: whatever the
model's attention does over a whole sequence); a second all-to-all turns the output back
(DeepSpeed-Ulysses, Jacobs et al. 2023). Two other forms need no heads to divide
(`parallel.cp_attention`): `all_gather` gathers every position's keys and values to each
worker (Llama 3's), `ring` passes them around the workers a part at a time (parallel/ring.py).
Both all-to-alls are differentiable (torch's functional collective, its backward the
all-to-all the other way), so the backward needs nothing more. The parameters stay whole on
every worker: their gradients, each worker's of its part of the positions, are summed over
the whole world by DDP. Each worker's activations outside attention are a cp-th of the
row's; attention's are the whole sequence's for a cp-th of the heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def ways(cp: int, tp: int = 1) -> str:
    """How many ways a block's heads split, in a refusal: over the cp workers, each of which
    holds a tp-th of them under tensor parallelism."""
    return f"tp x cp = {tp} x {cp}" if tp > 1 else f"cp = {cp}"


@dataclass(frozen=True)
class SequenceSplit:
    """This worker's part of each row: positions [rank x part, (rank + 1) x part) of a
    sequence of size x part (on a ring two pieces of half that: `pieces`), exchanged over
    `group` (the replica's cp workers). `attention`
    (parallel.cp_attention): how attention sees the whole row: `all_to_all` exchanges heads
    (`whole_sequence`, `own_part`), `all_gather` gathers every position's keys and values
    (`gathered`), `ring` passes them around (`pass_on`)."""
    group: Any
    rank: int
    size: int
    attention: str = "all_to_all"

    def part(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This worker's part of `t` along `dim` (the sequence's): its pieces, in order."""
        pieces = self.pieces(t.shape[dim])
        if len(pieces) == 1:
            return t.narrow(dim, *pieces[0])
        return torch.cat([t.narrow(dim, *piece) for piece in pieces], dim)

    def pieces(self, T: int, rank: int | None = None) -> list[tuple[int, int]]:
        """(start, length) of each piece of a worker's part (this one's, or `rank`'s) of a
        row of T positions: one contiguous piece; on a ring two, pieces `rank` and
        `2 x cp - 1 - rank` of 2 x cp (the zigzag order: under a causal mask every worker's
        queries then see as many keys as every other's, and a ring's step waits for none)."""
        rank = self.rank if rank is None else rank
        if self.attention != "ring":
            n = T // self.size
            return [(rank * n, n)]
        n = T // (2 * self.size)
        return [(rank * n, n), ((2 * self.size - 1 - rank) * n, n)]

    def whole_sequence(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Each of `xs` (B, heads, T / cp, d): every head of this worker's part of the
        sequence -> (B, heads / cp, T, d): this worker's heads over the whole sequence. One
        exchange for all of them (a block's queries, keys and values)."""
        B, _, t, d = xs[0].shape
        heads = [x.shape[1] // self.size for x in xs]
        send = torch.cat([x.reshape(B, self.size, h, t, d) for x, h in zip(xs, heads)], 2)
        got = self._exchange(send.transpose(0, 1).contiguous())  # (whose part, B, heads, t, d)
        whole = got.permute(1, 2, 0, 3, 4).reshape(B, sum(heads), self.size * t, d)
        return list(whole.split(heads, 1))

    def own_part(self, y: torch.Tensor) -> torch.Tensor:
        """`whole_sequence` undone: (B, heads / cp, T, d) -> (B, heads, T / cp, d)."""
        B, h, T, d = y.shape
        t = T // self.size
        send = y.reshape(B, h, self.size, t, d).permute(2, 0, 1, 3, 4).contiguous()
        got = self._exchange(send)  # (cp: whose heads, B, h, t, d)
        return got.transpose(0, 1).reshape(B, h * self.size, t, d)

    def gathered(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, kv heads, T / cp, d) of this worker's part -> of every
        position (B, kv heads, T, d): one all-gather for both (its backward a reduce-scatter:
        each worker gets its positions' gradients summed over the workers that attended to
        them)."""
        from torch.distributed._functional_collectives import all_gather_single_autograd

        both = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()  # (t, 2, B, heads, d)
        whole = all_gather_single_autograd(both, 0, self.group)  # (workers' parts in order)
        # (a copy: torch's collective returns an awaitable wrapper, which autograd would keep
        # for the backward as it is, unreadable to a saved-tensors hook)
        return tuple(whole.permute(1, 2, 3, 0, 4).contiguous().unbind(0))

    def pass_on(self, t: torch.Tensor):
        """Send `t` to the next worker of the ring and receive the previous one's in its
        place: returns a function that waits for both and gives what was received."""
        import torch.distributed as dist

        got = torch.empty_like(t)
        peer = lambda r: dist.get_global_rank(self.group, r % self.size)  # noqa: E731
        sent = dist.batch_isend_irecv([  # (one group of both: NCCL's sends wait for receives)
            dist.P2POp(dist.isend, t.contiguous(), peer(self.rank + 1), self.group),
            dist.P2POp(dist.irecv, got, peer(self.rank - 1), self.group)])

        def arrived() -> torch.Tensor:
            for request in sent:
                request.wait()
            return got
        return arrived

    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        # (differentiable: its backward is the all-to-all the other way)
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        one = [1] * self.size  # (split sizes along dim 0: a row to and from each rank)
        out = all_to_all_single_autograd(send.reshape(self.size, -1), one, one, self.group)
        return out.reshape(send.shape)
