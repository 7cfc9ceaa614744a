"""An MLP language model (Bengio et al. 2003): each position sees the embeddings of its last
`context` tokens, concatenated, through a stack of hidden layers. A sequence of layers, like
the GPT, so it can be cut into pipeline stages."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.models.layers import Layers


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


def mlp_layers(*, layers: int, width: int, context: int, vocab_size: int,
               embed_dim: int = 16) -> Layers:
    return Layers([lambda: ContextEmbedding(vocab_size, embed_dim, context),
                   lambda: Dense(context * embed_dim, width),
                   *[lambda: Dense(width, width)] * (layers - 1),
                   lambda: nn.Linear(width, vocab_size)])


def classifier_layers(*, layers: int, width: int, inputs: int, classes: int,
                      dropout: float = 0.0) -> Layers:
    """Features (B, inputs) to class logits (B, classes) through `layers` hidden layers."""
    return Layers([lambda: Dense(inputs, width, dropout),
                   *[lambda: Dense(width, width, dropout)] * (layers - 1),
                   lambda: nn.Linear(width, classes)])
