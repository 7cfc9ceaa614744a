"""Ring attention (`parallel.cp_attention: ring`; Liu et al. 2023, torchtitan's context
parallelism): each of a row's cp workers keeps its own part of the positions' queries, and
the parts' keys and values pass around the workers, one part at a time. A worker attends
with its queries to the part it holds, merges the result into what it has by each row's
log-sum-exp (flash attention's online softmax), and passes the part on: after cp - 1 passes
it has attended to every position, having held at most two parts' keys and values at once
(the one it computes with, the one arriving). No heads are divided, and neither a whole
row's keys and values nor its mask is ever held.

The backward passes the keys and values around again, each part with its gradient so far:
each worker recomputes its queries' scores against the part it holds from the log-sum-exp
kept by the forward (no scores are kept), computes its queries' share of the part's
gradient while the gradient so far is on its way from the last worker, adds the two and
passes the sum on; a cp-th pass brings each part's gradient home.

A worker's part is two pieces of the row (`SequenceSplit.pieces`: pieces i and 2 x cp - 1 - i,
the zigzag order), so that under a causal mask every worker's queries see as many keys as
every other's, and each part is computed as blocks, a piece of queries against a piece of
keys (`Blocks`, made by `models.documents.blocks_of`): a block none of whose queries sees a
key costs nothing. One worker without context parallelism runs as a ring of one
(`models.documents.Alone`: its row in pieces of 256, nothing passed) where documents or a
window leave blocks out.

A part's attention runs through torch's fused CPU kernel on a CPU (`FlashCPU`: no scores
held) and through plain matrix products in float32 elsewhere (`Products`: a run of queries'
scores at a time, at most 256 MiB of them; a GPU's fused kernels are not used in this
version). The running output and log-sum-exp are float32 whatever the inputs' type."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

# a masked score: finite, so that a row that sees nothing of a part has a finite log-sum-exp
# there, which a part it does see outweighs to exactly 0 (every query sees at least itself)
MASKED = -1e30

# which of a block's queries see which of its keys: (B or 1, 1, queries, keys) bool, True
# where seen; CAUSAL: query i sees keys 0..i (a square on the causal mask's diagonal, which a
# fused kernel computes without a mask); ALL: every query sees every key
CAUSAL, ALL = "causal", "all"
Mask = Union[torch.Tensor, str]
# the blocks of a part that the worker's queries see: (part index) -> [(which of the worker's
# queries, which of the part's keys, which see which)], the blocks none sees left out
Blocks = Callable[[int], list[tuple[slice, slice, Mask]]]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split, blocks: Blocks,
                   scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T x scale, masked by `blocks`) v over the whole row: q (B, heads, t, d),
    k and v (B, kv heads, t, d) this worker's part (`split.rank`) of a row of `split.size`
    parts; query head h uses key-value head h // (heads / kv heads), as
    `scaled_dot_product_attention(enable_gqa=True)` does."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _ring(q, k, v, split, blocks, scale, KERNELS.get(q.device.type) or Products())


@torch.compiler.disable  # (point-to-point sends: a compiled block breaks its graph here)
def _ring(q, k, v, split, blocks, scale, kernels):
    return _Ring.apply(q, k, v, split, blocks, scale, kernels)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, split, blocks, scale, kernels):
        kv = torch.stack([k, v])  # (2, B, kv heads, t, d): what passes around
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)  # (B, heads, t)
        for step in range(split.size):
            part = (split.rank - step) % split.size
            arriving = split.pass_on(kv) if step < split.size - 1 else None
            keys, values = kv.unbind(0)
            for qs, ks, mask in blocks(part):
                y, lse_part = kernels.forward(q[:, :, qs], keys[:, :, ks], values[:, :, ks],
                                              mask, scale)
                seen = torch.logaddexp(lse[:, :, qs], lse_part)
                out[:, :, qs] = (out[:, :, qs] * torch.exp(lse[:, :, qs] - seen)[..., None]
                                 + y.float() * torch.exp(lse_part - seen)[..., None])
                lse[:, :, qs] = seen
            if arriving is not None:
                kv = arriving()
        y = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.split, ctx.blocks, ctx.scale, ctx.kernels = split, blocks, scale, kernels
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse = ctx.saved_tensors
        split = ctx.split
        dy = dy.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        travelling = None  # the gradient so far of the part held, on its way from the last worker
        for step in range(split.size):
            part = (split.rank - step) % split.size
            arriving = split.pass_on(kv) if step < split.size - 1 else None
            keys, values = kv.unbind(0)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # (this worker's share)
            for qs, ks, mask in ctx.blocks(part):
                dq_block, dk, dv = ctx.kernels.backward(
                    dy[:, :, qs], q[:, :, qs], keys[:, :, ks], values[:, :, ks], y[:, :, qs],
                    lse[:, :, qs].contiguous(), mask, ctx.scale)
                dq[:, :, qs] += dq_block
                dkv[0, :, :, ks] += dk
                dkv[1, :, :, ks] += dv
            if travelling is not None:  # (waited for only now: it came while this part computed)
                dkv += travelling()
            travelling = split.pass_on(dkv)  # (on with its part: the cp-th pass brings it home)
            if arriving is not None:
                kv = arriving()
        dk, dv = travelling().to(k.dtype).unbind(0)
        return dq.to(q.dtype), dk, dv, None, None, None, None


def _bias(mask: Mask, dtype) -> dict:
    """A fused kernel's arguments for `mask`: causal, none, or a bias of 0 where seen."""
    if isinstance(mask, str):
        return {"is_causal": True} if mask == CAUSAL else {}
    return {"attn_mask": torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            .masked_fill(~mask, MASKED)}


class FlashCPU:
    """Each part through torch's fused CPU attention (the kernel `scaled_dot_product_attention`
    runs on a CPU), which returns the log-sum-exp and whose backward takes the whole row's
    output and log-sum-exp: no part's scores are held. It takes fewer key-value heads than
    query heads as they are (grouped-query attention), and gives their gradients so."""

    @staticmethod
    def forward(q, k, v, mask, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, scale=scale, **_bias(mask, q.dtype))

    @staticmethod
    def backward(dy, q, k, v, y, lse, mask, scale):
        causal = _bias(mask, q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy, q, k, v, y, lse, 0.0, causal.pop("is_causal", False), scale=scale, **causal)


class Products:
    """Each part by plain matrix products in float32 (any device), each key-value head
    repeated for the query heads that use it, a run of queries at a time: the scores held at
    once are at most `scores_bytes` (the rows of one query at least), whatever the part's
    length."""

    def __init__(self, scores_bytes: int = 256 * 2**20):
        self.scores_bytes = scores_bytes

    def _runs(self, q, k):
        """The runs of query rows (start, stop) whose scores fit the bound together."""
        B, H, t, _ = q.shape
        n = max(1, self.scores_bytes // (4 * B * H * k.shape[-2]))
        return [(i, min(i + n, t)) for i in range(0, t, n)]

    @staticmethod
    def _probabilities(q, k, mask, scale, lse, rows):
        i, j = rows
        s = q[:, :, i:j].float() @ k.float().transpose(-1, -2) * scale
        if isinstance(mask, str) and mask == CAUSAL:
            at = torch.arange(i, j, device=q.device)[:, None]
            mask = at >= torch.arange(k.shape[-2], device=q.device)[None, :]
        elif not isinstance(mask, str):
            mask = mask[:, :, i:j]
        if not isinstance(mask, str):
            s = s.masked_fill(~mask, MASKED)
        lse = s.logsumexp(-1) if lse is None else lse[:, :, i:j]
        return torch.exp(s - lse[..., None]), lse

    def forward(self, q, k, v, mask, scale):
        k, v = (_widened(t, q.shape[1]) for t in (k, v))
        out, lse = [], []
        for rows in self._runs(q, k):
            p, lse_rows = self._probabilities(q, k, mask, scale, None, rows)
            out.append(p @ v.float())
            lse.append(lse_rows)
        return torch.cat(out, 2), torch.cat(lse, 2)

    def backward(self, dy, q, k, v, y, lse, mask, scale):
        kv_heads = k.shape[1]
        k, v = (_widened(t, q.shape[1]) for t in (k, v))
        dq, dk, dv = [], torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)
        for i, j in self._runs(q, k):
            p, _ = self._probabilities(q, k, mask, scale, lse, (i, j))
            g = dy[:, :, i:j].float()
            ds = p * (g @ v.float().transpose(-1, -2)
                      - (g * y[:, :, i:j].float()).sum(-1, keepdim=True))
            dq.append(ds @ k.float() * scale)
            dk += ds.transpose(-1, -2) @ q[:, :, i:j].float() * scale
            dv += p.transpose(-1, -2) @ g
        return torch.cat(dq, 2), _narrowed(dk, kv_heads), _narrowed(dv, kv_heads)


def _widened(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values, each key-value head repeated for the query heads that use it."""
    return t.repeat_interleave(heads // t.shape[1], 1) if t.shape[1] != heads else t


def _narrowed(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A widened key's or value's gradient summed back onto its key-value head."""
    B, H, t, d = grad.shape
    return grad.reshape(B, kv_heads, H // kv_heads, t, d).sum(2)


KERNELS = {"cpu": FlashCPU()}
