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
kept by the forward (no scores are kept), adds its queries' share of the part's gradient,
and passes both on; a cp-th pass brings each part's gradient home. Parts that none of a
worker's queries can see (later ones, under a causal mask) cost no computation.

Scores, probabilities and the running output are float32 whatever the inputs' type; each
part's are computed by plain matrix products (no fused kernel), so a part's scores are
`heads x (T / cp)^2` numbers at once."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

# a masked score: finite, so that a row that sees nothing of a part has a finite log-sum-exp
# there, which a part it does see outweighs to exactly 0 (every query sees at least itself)
MASKED = torch.finfo(torch.float32).min

# which of the worker's queries see which of a part's keys: (part index) -> (B or 1, 1, t,
# t) bool, True where seen; None: none of them sees any (the part is skipped)
Rows = Callable[[int], Optional[torch.Tensor]]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split, rows: Rows,
                   scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T x scale, masked by `rows`) v over the whole row: q (B, heads, t, d),
    k and v (B, kv heads, t, d) this worker's part (`split.rank`) of a row of `split.size`
    parts; query head h uses key-value head h // (heads / kv heads), as
    `scaled_dot_product_attention(enable_gqa=True)` does."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _ring(q, k, v, split, rows, scale)


@torch.compiler.disable  # (point-to-point sends: a compiled block breaks its graph here)
def _ring(q, k, v, split, rows, scale):
    return _Ring.apply(q, k, v, split, rows, scale)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, split, rows, scale):
        B, H, t, d = q.shape
        kv = torch.stack([k, v])  # (2, B, kv heads, t, d): what passes around
        qg = _grouped(q, k.shape[1]).float()
        out = qg.new_zeros(qg.shape)
        lse = qg.new_full(qg.shape[:-1], float("-inf"))
        for step in range(split.size):
            part = (split.rank - step) % split.size
            arriving = split.pass_on(kv) if step < split.size - 1 else None
            mask = rows(part)
            if mask is not None:
                p, lse_part = _probabilities(qg, kv[0], mask, scale, None)
                seen = torch.logaddexp(lse, lse_part)
                out = (out * torch.exp(lse - seen)[..., None]
                       + (p @ kv[1].float()) * torch.exp(lse_part - seen)[..., None])
                lse = seen
            if arriving is not None:
                kv = arriving()
        y = out.to(q.dtype).reshape(B, H, t, d)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.split, ctx.rows, ctx.scale = split, rows, scale
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse = ctx.saved_tensors
        split, rows, scale = ctx.split, ctx.rows, ctx.scale
        qg = _grouped(q, k.shape[1]).float()
        dyg = _grouped(dy, k.shape[1]).float()
        delta = (dyg * _grouped(y, k.shape[1]).float()).sum(-1, keepdim=True)  # (rowsum of dP x P: softmax's backward)
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # (the part's, so far)
        for step in range(split.size):
            part = (split.rank - step) % split.size
            arriving = split.pass_on(kv) if step < split.size - 1 else None
            mask = rows(part)
            if mask is not None:
                kp, vp = kv[0].float(), kv[1].float()
                p, _ = _probabilities(qg, kp, mask, scale, lse)
                dkv[1] += p.transpose(-1, -2) @ dyg
                ds = p * (dyg @ vp.transpose(-1, -2) - delta)
                dq += (ds @ kp) * scale
                dkv[0] += (ds.transpose(-1, -2) @ qg) * scale
            dkv = split.pass_on(dkv)()  # (on with its part: the cp-th pass brings it home)
            if arriving is not None:
                kv = arriving()
        dk, dv = dkv.to(k.dtype).unbind(0)
        return dq.to(q.dtype).reshape(q.shape), dk, dv, None, None, None


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, heads, t, d) -> (B, kv heads, heads / kv heads x t, d): the query heads that share
    a key-value head as one block of rows against it."""
    B, H, t, d = x.shape
    return x.reshape(B, kv_heads, H // kv_heads * t, d)


def _probabilities(qg, k, mask, scale, lse):
    """Softmax probabilities of the grouped queries over one part's keys, masked, and the
    rows' log-sum-exp: the part's own (forward), or the whole row's given (backward)."""
    s = (qg @ k.float().transpose(-1, -2)) * scale  # (B, kv heads, groups x t, t)
    B, kvh, rows, n = s.shape
    seen = mask.unsqueeze(2).expand(mask.shape[0], 1, rows // mask.shape[-2], *mask.shape[-2:])
    s = s.masked_fill(~seen.reshape(mask.shape[0], 1, rows, n), MASKED)
    lse = s.logsumexp(-1) if lse is None else lse
    return torch.exp(s - lse[..., None]), lse
