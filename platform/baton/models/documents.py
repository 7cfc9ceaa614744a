"""Documents packed into a row, each attending to itself alone (`data.document_mask`).

`baton data prepare` packs documents end to end into rows, each ending in the
end-of-document token; without a mask a document's tokens attend to the documents before
them in the row. With one, each token attends only to the tokens of its own document at or
before it, and its position counts from its document's start, so a document computes what
it would at the start of a row of its own (Megatron-LM's `reset_attention_mask` and
`reset_position_ids`; torchtitan's block-causal mask). The end-of-document token belongs to
the document it ends.

The engines make a row's `Documents` from its tokens and hand it to every layer that takes
one (`attending`: a layer with an `attend_within(documents)` method: the built-in models'
blocks and the GPT's embedding, or a layer of your own) before each forward, and before a
pipeline stage's backward of that micro-batch too, whose activation checkpointing recomputes
the forward then, after other micro-batches' forwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from baton.parallel.context import SequenceSplit


@dataclass(frozen=True)
class Documents:
    # (B, 1, T, T) bool: True where a query position may see a key position; None: causal
    # (or, where `doc` is given, made from it a part at a time: `seen`)
    mask: Optional[torch.Tensor]
    positions: torch.Tensor  # (B, T) int64: each token's position within its document
    # context parallelism (parallel/context.py): the positions are this worker's part of the
    # row's (B, T / cp), and attention exchanges its inputs and output over the cp workers
    split: Optional["SequenceSplit"] = None
    doc: Optional[torch.Tensor] = None  # (B, T) int64: which document of its row each token is in
    # what every layer's attention of this micro-batch shares: a ring's blocks (ring_blocks)
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def part(self, split: "SequenceSplit") -> "Documents":
        """These documents as `split`'s worker sees them: its part of the positions; the mask
        over the whole row where attention runs over it (a cp-th of the heads a worker), else
        the rows' documents, its rows of the mask made from them where attention needs them."""
        mask = self.mask if split.exchanges_heads else None
        return Documents(mask, split.part(self.positions), split, self.doc)

    def seen(self, first: int, t: int, keys: int, n: int, window: Optional[int] = None,
             ) -> Optional[torch.Tensor]:
        """Which of the queries at positions [first, first + t) of a row see which of the
        keys at [keys, keys + n): (B or 1, 1, t, n) bool, causal, within each document, within
        the window; None where none sees any."""
        if keys > first + t - 1 or (window is not None and keys + n - 1 <= first - window):
            return None
        device = self.positions.device
        at = torch.arange(first, first + t, device=device)[:, None]
        seen = torch.arange(keys, keys + n, device=device)[None, :]
        mask = seen <= at
        if window is not None:
            mask = mask & (seen > at - window)
        if self.doc is not None:
            mine, theirs = self.doc[:, first:first + t], self.doc[:, keys:keys + n]
            mask = mask & (mine[:, :, None] == theirs[:, None, :])
        return mask.expand(self.doc.shape[0] if self.doc is not None else 1, t, n).unsqueeze(1)


def sequence_part(split: "SequenceSplit", rows: int, T: int, device) -> Documents:
    """One long document a row (no data.document_mask), as `split`'s worker sees it."""
    at = torch.arange(T, device=device).expand(rows, T)
    return Documents(None, split.part(at), split)


def documents(tokens: torch.Tensor, eod: int, device: Optional[torch.device] = None,
              whole: bool = True) -> Documents:
    """The documents of rows of tokens (B, T), each ending at an `eod` (the row's first ends
    at its first, or is cut by the row's start: a document longer than a row goes on in the
    next). `whole`: with the mask over the whole rows (else made a part at a time, `seen`)."""
    tokens = tokens.to(device) if device is not None else tokens
    T = tokens.shape[1]
    at = torch.arange(T, device=tokens.device)
    # a document starts at a row's first token and after each end-of-document token
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eod
    doc = starts.long().cumsum(1)  # (B, T): which document of its row each token is in
    first = torch.where(starts, at, 0).cummax(1).values  # where each token's document starts
    if not whole:
        return Documents(None, at - first, doc=doc)
    causal = at[:, None] >= at[None, :]
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    return Documents(mask.unsqueeze(1), at - first, doc=doc)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents | None,
              start: int, dropout: float, gqa: bool = False,
              window: Optional[int] = None) -> torch.Tensor:
    """Causal attention (B, heads, T, d), within each document where `docs` says where they
    are (data.document_mask); from position `start` on, of a sequence k and v hold from 0;
    each query to the `window` keys at and before it alone where a window is given
    (Mistral's sliding window: transformers' `kv_idx > q_idx - sliding_window`). Under
    context parallelism (`docs.split`) q, k and v are this worker's part of the sequence, all
    heads: attention runs over the whole sequence of a cp-th of them, and the output comes back
    as the part; or, where the split gathers (parallel.cp_attention: all_gather), its queries
    attend over every position's keys and values, gathered; or they pass around a ring
    (`ring`: parallel/ring.py)."""
    split = docs.split if docs is not None else None
    if split is not None and split.attention == "ring":
        from baton.parallel.ring import ring_attention

        if dropout:
            raise ValueError("ring attention takes no attention dropout (model.dropout: 0)")
        return ring_attention(q, k, v, split, ring_blocks(docs, q.shape[2] * split.size, window))
    if split is not None and split.attention == "all_gather":
        # this worker's queries over every position's keys and values: its rows of the mask
        # (of the documents', or causal), its positions counted from its part's first
        t, first = q.shape[2], split.rank * q.shape[2]
        k, v = split.gathered(k, v)
        mask = docs.seen(first, t, 0, k.shape[2], window)
        return attention(q, k, v, Documents(mask, docs.positions), first, dropout, gqa, None)
    if split is not None:
        q, k, v = split.whole_sequence(q, k, v)
        return split.own_part(attention(q, k, v, Documents(docs.mask, docs.positions), start,
                                        dropout, gqa, window))
    mask = docs.mask if docs is not None else None
    if window is not None and start + q.shape[2] > window:  # (a window the sequence passes)
        at = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
        seen = torch.arange(k.shape[2], device=q.device)[None, :]
        band = (seen <= at) & (seen > at - window)  # (T, keys)
        mask = band if mask is None else mask & band
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=start == 0, dropout_p=dropout,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                          enable_gqa=gqa)


def ring_blocks(docs: Documents, T: int, window: Optional[int] = None):
    """Which of each part's keys a ring worker's queries see (parallel/ring.py's `Blocks`):
    under a causal mask alone, in the zigzag order, one block a part (its own part causal,
    an earlier worker's early piece seen by all its queries, a later worker's part by its
    late piece's: torch's own ring attention's load balancing); else a block for each of
    its pieces of the row and the part's, left out where none of its queries sees any of its
    keys (under the document mask too: documents apart), computed without a mask where each
    sees all or the block is its documents' causal square, else with its rows of the
    document mask and window. Which block is which is found once for all the micro-batch's
    layers, forward and backward (one read to the host); a mask is made when used."""
    from baton.parallel.ring import ALL, CAUSAL

    split = docs.split
    mine = split.pieces(T)
    if docs.doc is None and window is None and len(mine) == 2:  # (zigzag, causal alone)
        t = mine[0][1]
        both, first, second = slice(0, 2 * t), slice(0, t), slice(t, 2 * t)
        return lambda part: ([(both, both, CAUSAL)] if part == split.rank  # (its pieces in order)
                             else [(both, first, ALL)] if part < split.rank  # (the early piece)
                             else [(second, both, ALL)])  # (seen by its late piece alone)

    def sorted_out() -> list[list]:
        """Each part's blocks: (queries, keys, ALL, CAUSAL or the block's place in the row)."""
        found, checks = [[] for _ in range(split.size)], []
        for part in range(split.size):
            at = 0
            for first, t in mine:
                keys_at = 0
                for keys, n in split.pieces(T, part):
                    seen = docs.seen(first, t, keys, n, window)
                    if seen is not None:
                        causal = torch.ones(t, n, dtype=torch.bool, device=seen.device).tril()
                        checks.append(torch.stack([seen.any(), seen.all(), (seen == causal).all()
                                                   & ((keys, n) == (first, t))]))
                        found[part].append((slice(at, at + t), slice(keys_at, keys_at + n),
                                            (first, t, keys, n)))
                    keys_at += n
                at += t
        flags = iter(torch.stack(checks).tolist() if checks else [])  # (in found's order)
        kept = [[] for _ in range(split.size)]
        for part, blocks in enumerate(found):
            for qs, ks, place in blocks:
                some, every, causal = next(flags)
                if some:
                    kept[part].append((qs, ks, ALL if every else CAUSAL if causal else place))
        return kept

    def blocks(part: int) -> list:
        key = ("ring", T, window)
        if key not in docs.memo:
            docs.memo[key] = sorted_out()
        return [(qs, ks, seen if isinstance(seen, str) else docs.seen(*seen, window))
                for qs, ks, seen in docs.memo[key][part]]
    return blocks


def attending(model: nn.Module) -> list[nn.Module]:
    """The layers of `model` that take a row's documents before each forward
    (`layer.attend_within(documents)`)."""
    return [m for m in model.modules() if callable(getattr(m, "attend_within", None))]


def attend_within(layers: list[nn.Module], docs: Optional[Documents]) -> None:
    for layer in layers:
        layer.attend_within(docs)
