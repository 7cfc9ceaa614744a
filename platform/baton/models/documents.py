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
    # (B, 1, T, T) bool where given: True where a query position may see a key position;
    # None: causal, or, where `doc` is given, made from it when read (`mask`) or a block at
    # a time (`seen`)
    given: Optional[torch.Tensor]
    positions: torch.Tensor  # (B, T) int64: each token's position within its document
    # context parallelism (parallel/context.py): the positions are this worker's part of the
    # row's (B, T / cp), and attention exchanges its inputs and output over the cp workers;
    # or one worker's whole row computed a block at a time (`Alone`)
    split: Optional["SequenceSplit"] = None
    doc: Optional[torch.Tensor] = None  # (B, T) int64: which document of its row each token is in
    # whether every row holds one document (or the end of one and nothing after it), where
    # known without a read from a device (found from tokens on the host); None: not known
    single: Optional[bool] = None
    # what every layer's attention of this micro-batch shares: its blocks (blocks_of), the
    # mask once made
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def mask(self) -> Optional[torch.Tensor]:
        """(B, 1, T, T) bool over the whole rows: True where a query sees a key (causal,
        within its document); None: causal alone. Made from `doc` when first read (a layer of
        your own may read it; the built-in attention on a CPU never does)."""
        if self.given is not None or self.doc is None or self.split is not None:
            return self.given
        if "mask" not in self.memo:
            at = torch.arange(self.doc.shape[1], device=self.doc.device)
            same = self.doc[:, :, None] == self.doc[:, None, :]
            self.memo["mask"] = (same & (at[:, None] >= at[None, :])).unsqueeze(1)
        return self.memo["mask"]

    def part(self, split: "SequenceSplit") -> "Documents":
        """These documents as `split`'s worker sees them: its part of the positions, and the
        whole rows' documents (its rows of the mask made from them where attention needs
        them, or the whole mask where it runs over the whole row: `whole`)."""
        return Documents(None, split.part(self.positions), split, self.doc, self.single)

    def whole(self) -> "Documents":
        """These documents over the whole rows, where a worker's attention runs over them (a
        cp-th of the heads): the same for every layer of the micro-batch."""
        if "whole" not in self.memo:
            self.memo["whole"] = Documents(None, self.positions, doc=self.doc, single=self.single)
        return self.memo["whole"]

    def causal_alone(self) -> bool:
        """Whether these documents ask for nothing but causality: no mask given, and every
        row one document where that is known (`single`; not known, the mask is taken)."""
        return self.given is None and (self.doc is None or bool(self.single))

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
              ) -> Documents:
    """The documents of rows of tokens (B, T), each ending at an `eod` (the row's first ends
    at its first, or is cut by the row's start: a document longer than a row goes on in the
    next). The mask over the whole rows is made only if read (`Documents.mask`)."""
    # (found on the host where the tokens are there: no read from a device, no graph break)
    single = not bool((tokens[:, :-1] == eod).any()) if tokens.device.type == "cpu" else None
    tokens = tokens.to(device) if device is not None else tokens
    T = tokens.shape[1]
    at = torch.arange(T, device=tokens.device)
    # a document starts at a row's first token and after each end-of-document token
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eod
    doc = starts.long().cumsum(1)  # (B, T): which document of its row each token is in
    first = torch.where(starts, at, 0).cummax(1).values  # where each token's document starts
    return Documents(None, at - first, doc=doc, single=single)


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
    (`ring`: parallel/ring.py). On a CPU, where documents or a window leave out more than
    causality does, a whole row's attention (one worker's, or the exchange's or gathering's)
    runs a block at a time (`Alone`: a ring of one)."""
    split = docs.split if docs is not None else None
    if split is None and _in_blocks(q, k, docs, start, dropout, window):
        T = q.shape[2]
        docs = docs or Documents(None, torch.arange(T, device=q.device)[None])
        split = Alone(BLOCK)
        return _blocks(q, k, v, split, blocks_of(docs, T, window, split))
    if split is not None and split.attention == "ring":
        if dropout:
            raise ValueError("ring attention takes no attention dropout (model.dropout: 0)")
        return _blocks(q, k, v, split, blocks_of(docs, q.shape[2] * split.size, window))
    if split is not None and split.attention == "all_gather":
        # this worker's queries over every position's keys and values: its rows of the mask
        # (of the documents', or causal), its positions counted from its part's first
        t, first = q.shape[2], split.rank * q.shape[2]
        k, v = split.gathered(k, v)
        if q.device.type == "cpu" and not dropout:  # (a block at a time, as one worker's)
            alone = Alone(BLOCK, (first, t))
            return _blocks(q, k, v, alone, blocks_of(docs, k.shape[2], window, alone))
        mask = docs.seen(first, t, 0, k.shape[2], window)
        return attention(q, k, v, Documents(mask, docs.positions), first, dropout, gqa, None)
    if split is not None:
        q, k, v = split.whole_sequence(q, k, v)
        return split.own_part(attention(q, k, v, docs.whole(), start, dropout, gqa, window))
    mask = docs.mask if docs is not None and not docs.causal_alone() else None
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


# the length of a piece of the row when one worker computes attention a block at a time
# (`Alone`): measured on 2 cores against the whole mask (benchmarks/attention_blocks.py)
BLOCK = 256


@dataclass(frozen=True)
class Alone:
    """One worker's whole row, cut into pieces of `piece` positions and computed as a ring
    of one (parallel/ring.py): a block, a piece of queries against a piece of keys, none of
    whose queries sees a key (a later piece, another document, outside the window) costs
    nothing, and no mask over the whole row is ever made. `queries`: (first, length) of the
    row's positions whose queries the worker holds, where not all of them (its part, keys
    and values gathered: parallel.cp_attention all_gather)."""
    piece: int
    queries: Optional[tuple[int, int]] = None
    size, rank, attention = 1, 0, "blocks"

    def pieces(self, T: int, rank: int | None = None) -> list[tuple[int, int]]:
        """The pieces of the worker's queries (`rank` None), or of every key (`rank` 0: those
        of its queries' positions cut as its queries are, so that blocks of one piece of the
        row are its diagonal's)."""
        first, n = self.queries or (0, T)
        cut = lambda a, b: [(at, min(self.piece, b - at)) for at in range(a, b, self.piece)]  # noqa: E731
        return cut(first, first + n) if rank is None else cut(0, first) + cut(first, first + n) + cut(first + n, T)

    @staticmethod
    def pass_on(t: torch.Tensor):
        return lambda: t  # (around a ring of one: home at once)


def _blocks(q, k, v, split, blocks) -> torch.Tensor:
    # (imported when first used: parallel/ring.py imports torch's compiler, seconds a start)
    from baton.parallel.ring import ring_attention

    return ring_attention(q, k, v, split, blocks)


def _in_blocks(q, k, docs: Optional[Documents], start: int, dropout: float,
               window: Optional[int]) -> bool:
    """Whether one worker's attention runs a block at a time: on a CPU (torch's fused CPU
    kernel returns what merging blocks needs; a GPU's kernels are not used for blocks in
    this version), for a whole row (not decoding), without dropout, where a mask would
    leave something out beyond causality (documents apart, or a window the row passes)."""
    if q.device.type != "cpu" or start or dropout or k.shape[2] != q.shape[2]:
        return False
    if docs is not None and docs.given is not None:  # (a mask of its own: taken whole)
        return False
    return (window is not None and q.shape[2] > window) or (docs is not None and not docs.causal_alone())


def blocks_of(docs: Documents, T: int, window: Optional[int] = None, split=None):
    """Which of each part's keys a worker's queries see (parallel/ring.py's `Blocks`), the
    worker's of `split` (`docs.split` unless given): on a ring under a causal mask alone, in
    the zigzag order, one block a part (its own part causal, an earlier worker's early piece
    seen by all its queries, a later worker's part by its late piece's: torch's own ring
    attention's load balancing); else a block for each of its pieces of the row and the
    part's, left out where none of its queries sees any of its keys (under the document mask
    too: documents apart), computed without a mask where each sees all or the block is its
    documents' causal square, else with its rows of the document mask and window. Which
    block is which is found once for all the micro-batch's layers, forward and backward
    (one read to the host, none without documents); a mask is made when used."""
    from baton.parallel.ring import ALL, CAUSAL

    split = split or docs.split
    mine = split.pieces(T)
    if split.attention == "ring" and docs.doc is None and window is None:  # (zigzag, causal)
        t = mine[0][1]
        both, first, second = slice(0, 2 * t), slice(0, t), slice(t, 2 * t)
        return lambda part: ([(both, both, CAUSAL)] if part == split.rank  # (its pieces in order)
                             else [(both, first, ALL)] if part < split.rank  # (the early piece)
                             else [(second, both, ALL)])  # (seen by its late piece alone)

    def sorted_out() -> list[list]:
        """Each part's blocks: (queries, keys, ALL, CAUSAL or the block's place in the row)."""
        found = []  # (part, queries, keys, (first, t, keys' first, n))
        for part in range(split.size):
            at = 0
            for first, t in mine:
                keys_at = 0
                for keys, n in split.pieces(T, part):
                    found.append((part, slice(at, at + t), slice(keys_at, keys_at + n),
                                  (first, t, keys, n)))
                    keys_at += n
                at += t
        kept = [[] for _ in range(split.size)]
        for (part, qs, ks, place), kind in zip(found, _kinds(docs.doc, [f[3] for f in found],
                                                             window)):
            if kind is not None:
                kept[part].append((qs, ks, place if kind == MASK else kind))
        return kept

    def blocks(part: int) -> list:
        key = ("blocks", T, window, split.size, *mine[0])
        if key not in docs.memo:
            docs.memo[key] = sorted_out()
        return [(qs, ks, seen if isinstance(seen, str) else docs.seen(*seen, window))
                for qs, ks, seen in docs.memo[key][part]]
    return blocks


MASK = "mask"  # (a block whose queries see some of its keys, not as ALL or CAUSAL says)


def _kinds(doc: Optional[torch.Tensor], places: list[tuple[int, int, int, int]],
           window: Optional[int]) -> list[Optional[str]]:
    """What each block (queries at [first, first + t) of a row, keys at [keys, keys + n);
    the pieces of a row never overlap unless they are one) is: None where no query sees a
    key in any row, ALL where each sees each in every row, CAUSAL where it is the causal
    square in every row, else MASK. A row's documents are runs of positions in order, so
    the keys before a block's queries share a document with one of them only if the last
    key's is the first query's, and all of them only if the first key's is the last
    query's; the window is judged by the nearest and the farthest pair. One read to the host
    for all the blocks (none without documents)."""
    from baton.parallel.ring import ALL, CAUSAL

    far = (lambda gap: False) if window is None else (lambda gap: gap >= window)
    kinds, ends = [], []
    for first, t, keys, n in places:
        diagonal = (first, t) == (keys, n)
        if keys > first + t - 1 or (not diagonal and far(first - (keys + n - 1))):
            kinds.append(None)  # (later keys, or every key outside every query's window)
            continue
        kinds.append((diagonal, t == 1 or (not diagonal and not far(first + t - 1 - keys)),
                      not far(t - 1)))
        ends.append([first, first + t - 1, keys, keys + n - 1])
    if doc is not None and ends:
        f_q, l_q, f_k, l_k = doc[:, torch.tensor(ends, device=doc.device)].unbind(-1)  # (B, blocks)
        same = torch.stack([(l_k == f_q).any(0), (f_k == l_q).all(0), (f_q == l_q).all(0)])
        flags = iter(same.t().tolist())
    else:
        flags = iter(lambda: (True, True, True), None)  # (one document a row)
    out = []
    for kind in kinds:
        if kind is None:
            out.append(None)
            continue
        (diagonal, every, causal), (some_doc, every_doc, one_doc) = kind, next(flags)
        if diagonal:  # (each query sees itself: some always)
            out.append(ALL if every and one_doc else CAUSAL if causal and one_doc else MASK)
        else:
            out.append(None if not some_doc else ALL if every and every_doc else MASK)
    return out


def attending(model: nn.Module) -> list[nn.Module]:
    """The layers of `model` that take a row's documents before each forward
    (`layer.attend_within(documents)`)."""
    return [m for m in model.modules() if callable(getattr(m, "attend_within", None))]


def attend_within(layers: list[nn.Module], docs: Optional[Documents]) -> None:
    for layer in layers:
        layer.attend_within(docs)
