"""A model built one layer at a time, with the numbers of the whole model's build.

A built-in model is a recipe (`Layers`): its layers' constructors, in order, and an optional
rule that sets each parameter once every layer exists (the GPT's GPT-2 initialisation), drawing
from the same random stream. `Layers.build` makes the whole model, as every worker used to: a
worker that holds a part of it (a ZeRO-2/3 shard, a pipeline stage) needed host memory for
the whole fp32 model at start. `LayerByLayer` holds the model on the meta device (shapes only)
and gives layers their values when asked (`fill`), in order, one layer in memory at a time
beyond those kept: the constructors of every layer are run once to advance the random stream
(each dropped at once), and a layer asked for is made again from the stream's state before
its constructor, then set by the rule, whose draws for the layers not asked for go to a
scratch tensor. The numbers are those of `build`, bit for bit (tests/unit/test_layers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn


@dataclass
class Layers:
    makers: list[Callable[[], nn.Module]]  # each layer's constructor, in the model's order
    init: Optional[Callable[[str, torch.Tensor], None]] = None  # (name in the whole model, parameter)

    def build(self) -> nn.Sequential:
        """The whole model, from the random stream as it is now."""
        model = nn.Sequential(*[make() for make in self.makers])
        if self.init is not None:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    self.init(name, p)
        return model


class LayerByLayer:
    """`layers`' model on the meta device (`module`); `fill(modules)` gives those of its layers
    their values, as `layers.build()` after `torch.manual_seed(seed)` would. Layers must be
    asked for in the model's order: the stream only goes forward (a layer passed over without
    being asked for cannot be filled later). Layers without parameters, which no one asks for
    first (FSDP's units and pipeline stages are the layers that hold parameters), are filled
    with the first later layer asked for."""

    def __init__(self, layers: Layers, seed: int, weights=None,
                 adapt: Optional[Callable[[nn.Module, str], None]] = None):
        self.layers = layers
        self.weights = weights  # model.init_from's export: each filled layer's values read from it
        # what is added to a layer once it has its values (model.lora's adapters), given the
        # layer and the prefix of its names in the whole model; the meta model has it too
        self.adapt = adapt or (lambda module, prefix: None)
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            self.module = nn.Sequential(*[make() for make in layers.makers])
        self.adapt(self.module, "")
        self._position = {id(m): i for i, m in enumerate(self.module)}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._rng = torch.get_rng_state()  # the stream, kept apart from the process's own
        self._made = 0  # layers whose constructors have run (and drawn)
        self._set = 0  # layers the rule has set (or drawn for)
        self._before: list[torch.Tensor] = []  # the stream's state before each constructor ran
        self.filled: set[int] = set()

    def fill(self, modules: Iterable[nn.Module]) -> None:
        asked = {self._position[id(m)] for m in modules}
        # (a user's layer with none before its embedding, helpers.slow_llama's sleep: once
        # passed over by ZeRO-3's first unit, "layer 0 was passed over")
        bare = {i for i in range(max(asked, default=0))
                if not any(True for _ in self.module[i].parameters())}
        for i in sorted((asked | bare) - self.filled):
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(self._rng)
                layer = self._make(i) if self.layers.init is None else self._make_and_set(i)
                self._rng = torch.get_rng_state()
            if self.weights is not None:
                self.weights.load_into(layer, f"{i}.")
            self.adapt(layer, f"{i}.")
            _take(self.module[i], layer)
            self.filled.add(i)

    def _make(self, i: int) -> nn.Module:
        """Layer i, its constructor's draws its only ones (no rule)."""
        if i < self._made:
            raise ValueError(f"layer {i} was passed over: layers are filled in order")
        while self._made < i:
            self.layers.makers[self._made]()  # drawn and dropped
            self._made += 1
        self._made += 1
        return self.layers.makers[i]()

    def _make_and_set(self, i: int) -> nn.Module:
        """Layer i as `build` leaves it: made from the stream as its constructor found it, then
        set by the rule, whose draws follow every constructor's."""
        if i < self._set:
            raise ValueError(f"layer {i} was passed over: layers are filled in order")
        while self._made < len(self.layers.makers):
            self._before.append(torch.get_rng_state())
            self.layers.makers[self._made]()  # drawn and dropped: one layer in memory at a time
            self._made += 1
        with torch.no_grad():
            while self._set < i:  # the rule's draws for layers no one asked for, into scratch
                for name, p in self.module[self._set].named_parameters():
                    self.layers.init(f"{self._set}.{name}", torch.empty_like(p, device="cpu"))
                self._set += 1
            stream = torch.get_rng_state()
            torch.set_rng_state(self._before[i])
            layer = self.layers.makers[i]()
            torch.set_rng_state(stream)
            for name, p in layer.named_parameters():
                self.layers.init(f"{i}.{name}", p)
        self._set += 1
        return layer


def _take(into: nn.Module, made: nn.Module) -> None:
    """`made`'s parameters and buffers in place of `into`'s (the same layer on the meta device,
    perhaps wrapped in place since: compiled, activation-checkpointed)."""
    dsts, srcs = list(into.named_modules()), list(made.named_modules())
    if [name for name, _ in dsts] != [name for name, _ in srcs]:
        raise ValueError(f"{type(made).__name__}: its constructor made another structure than on meta")
    for (_, dst), (_, src) in zip(dsts, srcs):
        for name, p in src.named_parameters(recurse=False):
            setattr(dst, name, p)
        for name, b in src.named_buffers(recurse=False):
            setattr(dst, name, b)
