"""Activation checkpointing (`train.activation_checkpointing`): a checkpointed block keeps only
its input in the forward and recomputes what its backward needs, trading one more forward of
the block for its activations' memory. The same gradients (recomputation runs the same
operations; dropout's random state is replayed).

Blocks are the model's repeated units (the `blocks` FSDP wraps, of a type that occurs more
than once: a GPT's transformer blocks, an MLP's hidden layers, a transformers model's layer
list), chosen on the whole model, so a pipeline stage checkpoints its share of them. torch's
composable `checkpoint` keeps parameter names (checkpoints load unchanged) and composes with
DDP and FSDP2 (applied before either wraps the model)."""

from __future__ import annotations

from collections import Counter

from torch import nn

from baton.models import blocks


def checkpointed_blocks(model: nn.Module, setting) -> list[nn.Module]:
    """The blocks `setting` (none | blocks | Every(n)) checkpoints."""
    if setting == "none":
        return []
    found = blocks(model)
    kinds = Counter(type(b) for b in found)
    repeated = [b for b in found if kinds[type(b)] > 1]
    every = 1 if setting == "blocks" else setting.every
    return repeated[every - 1::every]


def checkpoint_activations(model: nn.Module, setting) -> int:
    """Checkpoint `model`'s blocks as `setting` says; returns how many."""
    from torch.distributed._composable import checkpoint

    chosen = checkpointed_blocks(model, setting)
    for block in chosen:
        checkpoint(block)
    return len(chosen)
