"""An MLP language model (Bengio et al. 2003): each position sees the embeddings of its last
`context` tokens, concatenated, through a stack of hidden layers. A sequence of layers, like
the GPT, so it can be cut into pipeline stages."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ContextEmbedding(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int, context: int):
        super().__init__()
        self.context = context
        self.emb = nn.Embedding(vocab_size, embed_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, context*E)
        e = self.emb(tokens)  # (B, T, E)
        e = F.pad(e, (0, 0, self.context - 1, 0))  # zeros before the first token: causal
        windows = e.unfold(1, self.context, 1)  # (B, T, E, context)
        return windows.transpose(2, 3).flatten(2)


class Dense(nn.Module):
    def __init__(self, d_in: int, d_out: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():  # integer features (pixel values, counts)
            x = x.to(self.fc.weight.dtype)
        return F.dropout(F.gelu(self.fc(x)), self.dropout, self.training)


def build_mlp(*, layers: int, width: int, context: int, vocab_size: int,
              embed_dim: int = 16) -> nn.Sequential:
    return nn.Sequential(
        ContextEmbedding(vocab_size, embed_dim, context),
        Dense(context * embed_dim, width),
        *[Dense(width, width) for _ in range(layers - 1)],
        nn.Linear(width, vocab_size),
    )


def build_classifier(*, layers: int, width: int, inputs: int, classes: int,
                     dropout: float = 0.0) -> nn.Sequential:
    """Features (B, inputs) to class logits (B, classes) through `layers` hidden layers."""
    return nn.Sequential(
        Dense(inputs, width, dropout),
        *[Dense(width, width, dropout) for _ in range(layers - 1)],
        nn.Linear(width, classes),
    )
