"""Activation checkpointing: the same gradients as without it, fewer bytes kept for the
backward, parameter names unchanged."""

from __future__ import annotations

import pytest
import torch

from baton.models import build_model, loss_sum
from baton.parallel.activations import checkpoint_activations, checkpointed_blocks
from baton.spec import spec_from_dict

MODELS = {"gpt": {"name": "gpt", "layers": 4, "width": 32, "heads": 2, "seq_len": 16, "dropout": 0.1},
          "mlp": {"name": "mlp", "layers": 4, "width": 32, "context": 4, "seq_len": 16, "dropout": 0.1}}


def _grads_and_saved(spec, setting):
    model = build_model(spec.model, 0)
    names = list(model.state_dict())
    checkpoint_activations(model, setting)
    assert list(model.state_dict()) == names  # checkpoints load unchanged
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(5)  # dropout: the recomputation replays this stream
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_sum(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("setting", ["blocks", {"every": 2}])
def test_checkpointed_blocks_give_the_same_gradients_and_keep_less(name, setting):
    spec = spec_from_dict({"name": "t", "model": MODELS[name],
                           "train": {"activation_checkpointing": setting}})
    want, kept = _grads_and_saved(spec, "none")
    got, less = _grads_and_saved(spec, spec.train.activation_checkpointing)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)  # measured: equal
    assert less < kept, (less, kept)


def test_the_repeated_blocks_are_chosen():
    spec = spec_from_dict({"name": "t", "model": MODELS["gpt"],
                           "train": {"activation_checkpointing": {"every": 2}}})
    model = build_model(spec.model, 0)  # embedding, 4 blocks, head
    assert [type(b).__name__ for b in checkpointed_blocks(model, "blocks")] == ["Block"] * 4
    assert checkpointed_blocks(model, spec.train.activation_checkpointing) == [model[2], model[4]]
    assert checkpointed_blocks(model, "none") == []
