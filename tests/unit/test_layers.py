"""A model built layer by layer (models/layers.py): the numbers of the whole model's build,
bit for bit, with one layer in memory at a time beyond those kept."""

import gc
import weakref

import pytest
import torch
from torch import nn

from baton.models import MODELS, blocks, build_lazily, build_model, layer_count, options_problem
from baton.models.layers import Layers, LayerByLayer
from baton.parallel.activations import checkpoint_activations
from baton.spec import spec_from_dict

SPECS = {
    "gpt": {"name": "gpt", "layers": 4, "width": 32, "heads": 2, "seq_len": 16, "dropout": 0.1},
    "llama": {"name": "llama", "layers": 3, "width": 32, "heads": 4, "seq_len": 16,
              "dropout": 0.1, "options": {"kv_heads": 2}},
    "mlp": {"name": "mlp", "layers": 3, "width": 32, "context": 4},
    "classifier": {"name": "classifier", "layers": 3, "width": 16, "options": {"inputs": 8, "classes": 3}},
}


def model_spec(name):
    return spec_from_dict({"name": "layers", "model": SPECS[name],
                           "data": {"source": "parquet", "path": "/nonexistent"},
                           "train": {"steps": 1, "global_batch": 4}}).model


def same(a: nn.Module, b: nn.Module, only=None):
    sa, sb = a.state_dict(), b.state_dict()
    names = [n for n in sa if only is None or n.split(".")[0] in only]
    assert names
    for n in names:
        assert not sa[n].is_meta, n
        assert torch.equal(sa[n], sb[n]), n  # bit for bit: the same draws in the same order


@pytest.mark.parametrize("name", list(SPECS))
def test_every_layer_filled_in_order_equals_the_whole_build(name):
    spec = model_spec(name)
    whole = build_model(spec, seed=5)
    module, fill = build_lazily(spec, seed=5)
    assert all(p.is_meta for p in module.parameters())
    for layer in module:  # one at a time, as FSDP's units ask for them
        fill([layer])
    same(module, whole)


@pytest.mark.parametrize("name", list(SPECS))
def test_a_stage_fills_its_layers_only(name):
    spec = model_spec(name)
    whole = build_model(spec, seed=3)
    module, fill = build_lazily(spec, seed=3)
    n = len(module)
    kept = list(range(n // 2, n))  # the last stage of two
    fill([module[i] for i in kept])
    same(module, whole, only={str(i) for i in kept})
    assert all(p.is_meta for i in range(n // 2) for p in module[i].parameters())


def test_the_process_random_stream_is_left_alone():
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    module, fill = build_lazily(model_spec("gpt"), seed=0)
    fill(list(module)[:2])
    fill(list(module)[2:])
    assert torch.equal(torch.rand(3), expected)


def test_a_layer_wrapped_in_place_on_meta_gets_its_values():
    """Activation checkpointing (and compiling) wrap the blocks in place before the values
    come: the values land in the wrapped layers."""
    spec = model_spec("gpt")
    whole = build_model(spec, seed=1)
    module, fill = build_lazily(spec, seed=1)
    assert checkpoint_activations(module, "blocks") == 4
    fill(blocks(module))
    same(module, whole)
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(module.eval()(x), whole.eval()(x))  # eval: no dropout draws


def test_layers_are_filled_in_order_only():
    module, fill = build_lazily(model_spec("gpt"), seed=0)
    fill([module[3]])
    with pytest.raises(ValueError, match="filled in order"):
        fill([module[1]])


@pytest.mark.parametrize("rule", [None, lambda name, p: nn.init.normal_(p)], ids=["constructors", "rule"])
def test_layers_without_parameters_are_filled_with_the_next_one_asked_for(rule):
    """FSDP's units are the layers that hold parameters, filled first, then the rest: a
    parameterless layer before them (a user's sleep or reshape ahead of the embedding) is
    filled with the first later layer asked for, not refused as passed over."""
    layers = Layers([nn.ReLU, lambda: nn.Linear(4, 4), nn.ReLU, lambda: nn.Linear(4, 4)], rule)
    torch.manual_seed(2)
    whole = layers.build()
    lazy = LayerByLayer(layers, seed=2)
    for unit in blocks(lazy.module):  # (the two Linears)
        lazy.fill([unit])
    lazy.fill(lazy.module.children())  # the root: what no unit holds
    same(lazy.module, whole)
    assert lazy.filled == {0, 1, 2, 3}


class Counted:
    """Layer constructors that count how many of the layers they made in memory (not on the
    meta device) are alive at once."""

    def __init__(self, layers: Layers):
        self.alive: list = []
        self.most = 0
        self.layers = Layers([self._counting(make) for make in layers.makers], layers.init)

    def _counting(self, make):
        def counted():
            gc.collect()
            self.alive = [r for r in self.alive if r() is not None]
            layer = make()
            if not next(layer.parameters()).is_meta:  # the structure on meta holds no memory
                self.alive.append(weakref.ref(layer))
            self.most = max(self.most, len(self.alive))
            return layer
        return counted


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_one_layer_at_a_time_beyond_those_kept(name):
    spec = model_spec(name)
    counted = Counted(MODELS[name](spec))
    lazy = LayerByLayer(counted.layers, seed=0)
    lazy.fill([lazy.module[-1]])  # the last layer: every constructor before it runs, and drops
    # each layer made is dropped before the next is made: one in memory at a time, however
    # many layers the model has (a whole build holds them all: 6 and 5 here)
    assert counted.most == 1
    whole = build_model(spec, seed=0)
    assert torch.equal(lazy.module[-1].weight if name == "mlp" else lazy.module[-1].lm.weight,
                       whole[-1].weight if name == "mlp" else whole[-1].lm.weight)


def test_a_builder_of_the_users_that_returns_a_recipe_is_built_layer_by_layer():
    """`package.module:function` may return `Layers` instead of a module: built whole where a
    module is needed, layer by layer where a worker keeps a part, checked on meta as any."""
    spec = spec_from_dict({"name": "layers", "model": {**SPECS["gpt"], "name": "helpers:gpt_recipe",
                                                       "dropout": 0.0},
                           "data": {"source": "parquet", "path": "/nonexistent"},
                           "train": {"steps": 1, "global_batch": 4}}).model
    builtin = build_model(model_spec("gpt"), seed=2)  # the same recipe, by its built-in name
    whole = build_model(spec, seed=2)
    assert isinstance(whole, nn.Sequential)
    same(whole, builtin)
    module, fill = build_lazily(spec, seed=2)
    assert all(p.is_meta for p in module.parameters())
    fill(module)
    same(module, whole)
    assert options_problem(spec, on_meta=True) is None and layer_count(spec) == 6


def test_profiling_for_the_stages_takes_one_layer_at_a_time():
    """parallel.partition: time profiles each layer on one worker: filled, timed and let go in
    turn, so the whole model is never in memory there either."""
    from baton.parallel.profile import layer_times

    spec = spec_from_dict({"name": "layers", "model": SPECS["gpt"],
                           "data": {"source": "parquet", "path": "/nonexistent"},
                           "train": {"steps": 1, "global_batch": 4, "micro_batch": 2}})
    model, fill = build_lazily(spec.model, seed=0)
    filled = []
    times = layer_times(model, torch.randint(0, 256, (2, 16)), torch.device("cpu"), repeats=1,
                        fill=lambda layers: (filled.append(sum(not p.is_meta for p in model.parameters())),
                                             fill(layers)))
    assert len(times) == len(model) and all(t > 0 for t in times)
    assert filled == [0] * len(model)  # no other layer held when the next is filled
    assert all(p.is_meta for p in model.parameters())
