"""A decoder-only GPT, written as a flat sequence of layers (embedding, blocks, head) so a
pipeline partitioner can cut it anywhere between layers. No weight tying, for the same reason."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from baton.models.documents import Documents, attention
from baton.models.layers import Layers
from baton.parallel.context import ways


class Embedding(nn.Module):
    # tensor parallelism: each worker holds its share of the vocabulary's rows; under
    # sequence parallelism the blocks and the head run on its output's parts of the sequence
    tp_plan = {"tok": "vocab"}
    tp_sequence_after = True

    def __init__(self, vocab_size: int, width: int, seq_len: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)
        self.docs: Documents | None = None  # data.document_mask: positions count in each document

    def attend_within(self, docs: Documents | None) -> None:
        self.docs = docs

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        return self.decode(tokens, None, 0)

    def decode(self, tokens: torch.Tensor, cache: dict | None, start: int) -> torch.Tensor:
        """Positions start.. (`baton sample`: its cache holds none of this layer's), or in
        training each token's in its document where the job keeps them apart."""
        positions = (self.docs.positions if self.docs is not None and cache is None else
                     torch.arange(start, start + tokens.shape[1], device=tokens.device))
        return self.drop(self.tok(tokens) + self.pos(positions))


class Block(nn.Module):
    # tensor parallelism (parallel/tensor.py): each worker holds its heads' q, k and v and
    # their share of the output projection, and a share of the MLP's hidden units; the
    # dropout on its heads draws from its own stream (tp_random), and under sequence
    # parallelism so does the dropout on its part of the sequence (tp_sequence_random)
    tp_plan = {"qkv": ("column", 3), "proj": "row", "fc": "column", "out": "row"}
    tp_random = tp_sequence_random = contextlib.nullcontext

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.head_width = width // heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)
        self.docs: Documents | None = None  # data.document_mask: each token sees its document

    def attend_within(self, docs: Documents | None) -> None:
        self.docs = docs

    def tp_problem(self, tp: int) -> str | None:
        return None if self.heads % tp == 0 else f"{self.heads} heads do not split over tp = {tp}"

    def cp_problem(self, cp: int, tp: int = 1) -> str | None:
        """Why its heads do not split over cp workers (each holding a tp-th of them)."""
        return (None if self.heads % (cp * tp) == 0
                else f"its {self.heads} heads do not split over {ways(cp, tp)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return self.decode(x, None, 0)

    def decode(self, x: torch.Tensor, cache: dict | None, start: int) -> torch.Tensor:
        """The block on positions start.. of a sequence whose earlier positions' keys and
        values `cache` holds (`baton sample`), which it extends; training passes none. After
        the first call, one position at a time."""
        # the heads this worker holds: all of them, or its share under tensor parallelism;
        # the whole sequence (x may be this worker's part of it: sequence parallelism)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=2)
        B, T = q.shape[:2]
        heads = q.shape[-1] // self.head_width
        q, k, v = (t.view(B, T, heads, self.head_width).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            if start:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        with self.tp_random():  # (a position after the first call sees every cached one)
            y = attention(q, k, v, self.docs if cache is None else None, start,
                          self.dropout if self.training else 0.0)
        h = self.proj(y.transpose(1, 2).reshape(B, T, heads * self.head_width))
        with self.tp_sequence_random():
            x = x + self.drop(h)
        h = self.out(F.gelu(self.fc(self.ln2(x))))
        with self.tp_sequence_random():
            return x + self.drop(h)


class Head(nn.Module):
    # tensor parallelism: each worker computes the logits of its share of the vocabulary,
    # gathered whole for the loss
    tp_plan = {"lm": "gather"}

    def __init__(self, width: int, vocab_size: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.lm = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V)
        return self.lm(self.ln(x))

    def decode(self, x: torch.Tensor, cache: dict, start: int) -> torch.Tensor:
        return self(x)


def gpt_layers(*, layers: int, width: int, heads: int, seq_len: int, vocab_size: int,
               dropout: float = 0.0) -> Layers:
    def init(name: str, p: torch.Tensor) -> None:
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            # GPT-2: residual projections scaled down by depth so the stream's variance stays put
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    return Layers([lambda: Embedding(vocab_size, width, seq_len, dropout),
                   *[lambda: Block(width, heads, dropout)] * layers,
                   lambda: Head(width, vocab_size)], init)


def build_gpt(**kwargs) -> nn.Sequential:
    return gpt_layers(**kwargs).build()
