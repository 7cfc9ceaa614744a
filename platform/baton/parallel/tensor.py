"""Tensor parallelism (`parallel.tp`): each layer of a replica split over tp workers, as in
Megatron-LM. A block's first linear of each pair is split by output features (column
parallel: each worker computes its share of the attention heads, or of the MLP's hidden
units), the second by input features (row parallel: each worker multiplies its share, and
one all-reduce sums the shares). Two all-reduces a block forward, two backward. The token
embedding and the head are split by vocabulary (each worker holds its share of the rows: a
lookup summed by one all-reduce, logits gathered whole for the loss); the norms and the
position embedding are whole on every worker. Activations of the split layers, their
parameters, gradients and optimizer state are each 1/tp per worker.

A module says how its layers split with a class attribute, `tp_plan`: {child name:
"column" | "row" | ("column", parts) | "vocab" | "gather"}. `parts` is for a fused projection
(the GPT's `qkv` holds q, k and v one after the other): each of its parts is split, so that
every worker holds its heads' q, k and v. "vocab" splits an nn.Embedding's rows, "gather" is
"column" with the outputs gathered whole (a head). Column layers that take one input (the
llama's separate q, k and v) are named in `tp_entered`, and the module's forward passes
their input through its `tp_enter` (the identity, whole) before them: one collective for
them all (`Enter`). Row layers whose partial products the module's user sums itself are named
in `tp_left` (a mixture's experts: their block weighs them first, then sums them once with
its `tp_enter`'s `leave`). A layer it holds whole and uses on its share alone (the llama's query
and key norms, on its heads) is named in `tp_partial`: each worker's gradient of it is its
share's part, summed over the tp workers before the step. The module's forward must take its widths from its layers' outputs (the
GPT's block counts its heads from q's width), so that the same code runs whole or split. Sequence parallelism (`sequence_region`) also splits what runs
between the split layers along the sequence.

The split is this module's own rather than torch's DTensor plans
(`parallelize_module`): those split a fused projection in one piece (a worker would get all
of q and half of k), and keeping the fused layer keeps its one matrix multiply and its
parameter names. Parameters keep their names, and a checkpoint holds whole tensors: each
worker writes the pieces of them it holds, in parallel, through DCP (`Shares.pieces`), with
nothing gathered on one worker, and reads the pieces it needs of any checkpoint (any tp, any
sharding, whole or sharded).

Under sharding (`parallel.shard: grads | full`), FSDP2 shards each worker's share across the
workers of its dp group that hold the same share (2D parallelism, as torchtitan composes
FSDP with tensor parallelism): a worker holds 1/(tp x dp_shard) of each split layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import weakref
from typing import Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from baton.training import local

Plan = dict[str, Union[str, tuple[str, int]]]  # child -> style (STYLES), or (style, parts)


# The autograd functions below keep their tp group for the backward by a weak reference: a
# step that failed half-way leaves its forward's graph referenced past `Worker.leave` (from
# where was not found: clearing the failed call's frames did not free it), a strong
# reference there kept the old world's group alive, its connections open, and a peer that
# began a collective with this worker afterwards waited out the whole collective timeout
# (gloo fails an operation at once only where the peer has freed the group). Measured with
# dp 2 x pp 2 x tp 2, a worker killed: the stop phase 60.4 s (parallel.timeout_s 60) before,
# 0.44 s after. The layers hold the group for as long as the world trains.


class _ToSplit(torch.autograd.Function):
    """Into a column-parallel layer: the input as it is; its gradient summed over the tp
    workers (each computed it from its own share of the outputs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = weakref.ref(group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group())
        return grad, None


class _FromSplit(torch.autograd.Function):
    """Out of a row-parallel layer: the tp workers' partial products summed; the gradient
    goes back to each as it is (the sum's gradient is the same for every term)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _all_gather(x: torch.Tensor, group, size: int, dim: int) -> torch.Tensor:
    """Every tp worker's part along `dim`, whole, in rank order."""
    pieces = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def _seq_reduce_scatter(x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
    """The tp workers' tensors summed, and this worker's part of the sequence of the sum. On
    gloo as an all-reduce of which each keeps its part (as comm.fsdp_reduce_scatter), on NCCL
    its own reduce-scatter (half the bytes)."""
    if dist.get_backend(group) == "nccl":
        parts = torch.stack(x.chunk(size, dim=1))  # (size, B, T/size, ...), contiguous
        out = torch.empty_like(parts[0])
        dist.reduce_scatter_tensor(out, parts, group=group)
        return out
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x.chunk(size, dim=1)[rank].contiguous()


class _SplitSequence(torch.autograd.Function):
    """Into the sequence-parallel region: this worker's part of a whole activation's sequence
    (every tp worker holds the whole); the gradient is gathered whole."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.size = weakref.ref(group), size
        return x.chunk(size, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group(), ctx.size, 1), None, None, None


class _GatherSequence(torch.autograd.Function):
    """Into a column-parallel layer under sequence parallelism: the whole sequence from every
    worker's part; the gradient (each worker's, from its own share of the outputs) summed
    and split along the sequence again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = weakref.ref(group), rank, size
        return _all_gather(x, group, size, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_reduce_scatter(grad, ctx.group(), ctx.rank, ctx.size), None, None, None


class _ScatterSequence(torch.autograd.Function):
    """Out of a row-parallel layer under sequence parallelism: the partial products summed,
    this worker keeping its part of the sequence; the gradient gathered whole."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.size = weakref.ref(group), size
        return _seq_reduce_scatter(x, group, rank, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group(), ctx.size, 1), None, None, None


@dataclass(frozen=True)
class Split:
    """How one parameter is split over the tp workers: along `dim`, each of its `parts`
    (consecutive, equal) split into tp consecutive pieces, worker r holding piece r of each."""

    dim: int
    parts: int = 1

    def take(self, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Worker `rank`'s piece of a whole tensor."""
        pieces = [part.chunk(size, self.dim)[rank] for part in whole.chunk(self.parts, self.dim)]
        return torch.cat(pieces, self.dim).contiguous()

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every worker's piece, in rank order."""
        per_rank = [piece.chunk(self.parts, self.dim) for piece in pieces]
        return torch.cat([chunks[k] for k in range(self.parts) for chunks in per_rank], self.dim)

    def whole_shape(self, shape: torch.Size, size: int) -> list[int]:
        out = list(shape)
        out[self.dim] *= size
        return out

    def pieces(self, box: torch.Tensor, offsets: list[int], share: int, rank: int,
               size: int) -> list[tuple[list[int], torch.Tensor]]:
        """Where `box` (the part of worker `rank`'s share at `offsets` in that share, whose
        length along `dim` is `share`: all of it, or an FSDP shard of it) lies in the whole
        tensor: (offsets in the whole, view of `box`) for each run of it that is contiguous
        there (one a part of a fused projection)."""
        per_part = share // self.parts  # of each part, this worker's run
        start, end = offsets[self.dim], offsets[self.dim] + box.shape[self.dim]
        out = []
        for k in range(start // per_part if per_part else 0, self.parts):
            lo, hi = max(start, k * per_part), min(end, (k + 1) * per_part)
            if lo >= hi:
                break
            where = list(offsets)
            where[self.dim] = k * per_part * size + rank * per_part + lo - k * per_part
            out.append((where, box.narrow(self.dim, lo - start, hi - lo)))
        return out


class _Share(nn.Module):
    """This worker's share of a layer: its piece of the weight (`Split`), and of the bias
    when the bias is split with it (`names`); a bias that is not is kept whole. Each style
    says which layer it splits (`layer`), along which dimension of the weight (`dim`), and
    which of the layer's sizes that is (`features`, named `across` in messages).

    A layer with `model.lora`'s adapter (models/lora.py: A of (rank, in), B of (out, rank))
    keeps it, split with the weight where it shares the weight's split dimension: a column
    layer's B by outputs (its q, k and v parts each, as the weight's), a row layer's A by
    inputs. The other factor is whole on every worker, and each worker's gradient of it is
    the part its share of the layer gives (`partial`: summed over the tp workers before the
    step, as sequence parallelism's whole parameters are)."""

    layer: type = nn.Linear
    dim, features, across, names = 0, "out_features", "output features", ("weight", "bias")

    def __init__(self, whole: nn.Module, split: Split, rank: int, size: int, group,
                 sequence: bool = False):
        from baton.models import lora

        super().__init__()
        self.group, self.rank, self.size, self.sequence = group, rank, size, sequence
        # (a frozen parameter, model.frozen's, stays frozen)
        self.weight = nn.Parameter(split.take(whole.weight.detach(), rank, size),
                                   requires_grad=whole.weight.requires_grad)
        bias = getattr(whole, "bias", None)
        self.bias = None if bias is None else nn.Parameter(
            split.take(bias.detach(), rank, size) if "bias" in self.names else bias.detach().clone(),
            requires_grad=bias.requires_grad)
        self.split_names = [n for n in self.names if getattr(self, n, None) is not None]
        self.partial: list[str] = []  # whole parameters whose gradients are partial sums
        self.adapted = hasattr(whole, lora.A)
        if self.adapted:
            cut = lora.B if split.dim == 0 else lora.A  # the factor that has the split dim
            for part in (lora.A, lora.B):
                t = getattr(whole, part)
                self.register_parameter(part, nn.Parameter(
                    split.take(t.detach(), rank, size) if part == cut else t.detach().clone(),
                    requires_grad=t.requires_grad))
                (self.split_names if part == cut else self.partial).append(part)
            self.lora_scale, self.lora_dropout = whole.lora_scale, whole.lora_dropout

    # the stream the adapter's dropout draws from: the process's, which a replica's tp
    # workers share (a column layer's input is whole: the same mask on each); a row layer's
    # input is the worker's own share, whose mask `Shares` has drawn from the worker's own
    # stream (OwnRandom), as its heads' attention dropout is
    tp_random = contextlib.nullcontext

    def adapter(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y, plus what this worker's share of the adapter adds for input x."""
        from baton.models.lora import delta

        if not self.adapted:
            return y
        with self.tp_random():
            return y + delta(self, x, y.dtype)


class Whole:
    """A planned module's `tp_enter` without tensor parallelism (`Enter`'s calls, each the
    identity)."""

    sequence, size = False, 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def indices(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        return y


class Enter(Whole):
    """Into the split region: a column layer's input as it is, its gradient summed over the tp
    workers; under sequence parallelism, the whole sequence gathered from every worker's part,
    its gradient summed and split again. A planned module whose column layers take one input
    (the llama's q, k and v, its gate and up: `tp_entered`) enters it once, by calling its
    `tp_enter` with it, which is one of these under tp: one collective where each layer
    would have had its own. A module whose row layers' partial products it sums itself
    (`tp_left`: a mixture's experts, weighted first) takes them out with `leave`."""

    def __init__(self, group, rank: int, size: int, sequence: bool):
        self.group, self.rank, self.size, self.sequence = group, rank, size, sequence

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence:
            return _GatherSequence.apply(x, self.group, self.rank, self.size)
        return _ToSplit.apply(x, self.group)

    def indices(self, t: torch.Tensor) -> torch.Tensor:
        """Integers of this worker's positions (B, T, ...) for the whole sequence (no gradient):
        every worker's parts gathered under sequence parallelism, else as they are."""
        return _all_gather(t, self.group, self.size, 1) if self.sequence else t

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """Out of the split region, as a row layer's output: the partial products summed
        (this worker keeping its part of the sequence under sequence parallelism)."""
        if self.sequence:
            return _ScatterSequence.apply(y, self.group, self.rank, self.size)
        return _FromSplit.apply(y, self.group)


class ColumnParallel(_Share):
    """This worker's share of a linear layer's outputs: y_r = x W_r^T + b_r. `entered`: its
    module has brought its input into the split region already (`Enter`)."""

    entered = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.entered:
            x = Enter(self.group, self.rank, self.size, self.sequence)(x)
        return self.adapter(x, F.linear(x, self.weight, self.bias))


class RowParallel(_Share):
    """A linear layer over this worker's share of the inputs: y = sum_r x_r W_r^T, + b. The
    bias is whole on every worker and added once, after the sum. `left`: its module's user
    sums the workers' partial products (`tp_left`; it has no bias), which it returns."""

    dim, features, across, names = 1, "in_features", "input features", ("weight",)
    left = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.adapter(x, F.linear(x, self.weight))
        if self.left:
            return y
        y = (_ScatterSequence.apply(y, self.group, self.rank, self.size) if self.sequence
             else _FromSplit.apply(y, self.group))
        return y + self.bias if self.bias is not None else y


class _Gather(torch.autograd.Function):
    """This worker's share of the last dimension to the whole (every worker's, in rank
    order); the gradient back to each is its own share of the whole's (every worker
    computes the same loss from the same whole)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, x.shape[-1]
        return _all_gather(x, group, size, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None, None, None


@dataclass(frozen=True)
class VocabSplit:
    """What logits split by vocabulary carry (as `tensor.vocab_split`) for a loss that takes
    them so (`vocab_cross_entropy_sum`): whose share they are."""

    group: object
    rank: int
    size: int


class GatheredColumn(ColumnParallel):
    """A column-parallel layer whose outputs are gathered whole (a language model's head:
    each worker holds the rows of its share of the vocabulary, and every worker gets every
    logit, for the loss as it is computed without tensor parallelism). With `keep_split`
    (a task whose loss takes logits split by vocabulary: `Shares(split_logits=True)`) they
    stay split, each worker holding batch x seq x vocab/tp of them, marked `vocab_split`."""

    keep_split = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if not self.keep_split:
            return _Gather.apply(y, self.group, self.rank, self.size)
        y.vocab_split = VocabSplit(self.group, self.rank, self.size)
        return y


class _VocabCrossEntropy(torch.autograd.Function):
    """Megatron-LM's vocabulary-parallel cross entropy: each worker holds its share of the
    vocabulary's logits; the maximum, the sum of exponentials and the target's logit are
    all-reduced, so the whole logits are never in one place. Returns each row's loss (0
    where the target is `ignore`), the same on every worker."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, split: VocabSplit,
                ignore: int) -> torch.Tensor:
        ctx.dtype = logits.dtype
        logits = logits.float()
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=split.group)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=split.group)
        first, width = split.rank * logits.shape[-1], logits.shape[-1]
        mine = (targets >= first) & (targets < first + width)
        at = torch.where(mine, targets - first, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, at).squeeze(-1) * mine
        dist.all_reduce(target_logit, group=split.group)
        kept = targets != ignore
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), at, mine, kept)
        return (total.log() - target_logit) * kept

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, at, mine, kept = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, at, -mine.unsqueeze(-1).to(out.dtype))
        return (out * (grad * kept).unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, ignore: int) -> torch.Tensor:
    """The summed cross entropy of logits split by vocabulary (`vocab_split`), as
    F.cross_entropy(reduction="sum", ignore_index=ignore) of the whole logits."""
    rows = _VocabCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), logits.vocab_split,
                                    ignore)
    return rows.sum()


class VocabParallel(_Share):
    """This worker's rows of an embedding (its share of the vocabulary, as Megatron-LM's
    VocabParallelEmbedding): it looks up the tokens that fall in its rows, zeros for the
    rest, and one all-reduce sums the workers' lookups into every token's row (its output is
    whole: under sequence parallelism `sequence_region` splits it after)."""

    layer = nn.Embedding
    features, across, names = "num_embeddings", "rows (its vocabulary)", ("weight",)
    hint = ("; make the vocabulary a multiple of that (the built-in gpt: model.vocab_size; rows "
            "past the data's largest token id are never looked up)")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        first = self.rank * self.weight.shape[0]
        mine = (tokens >= first) & (tokens < first + self.weight.shape[0])
        rows = F.embedding(torch.where(mine, tokens - first, 0), self.weight)
        return _FromSplit.apply(rows * mine.unsqueeze(-1), self.group)


STYLES = {"column": ColumnParallel, "row": RowParallel, "gather": GatheredColumn,
          "vocab": VocabParallel}


def _styles(plan: Plan) -> dict[str, tuple[str, int]]:
    return {name: (style, 1) if isinstance(style, str) else tuple(style)
            for name, style in plan.items()}


def plan_problem(model: nn.Module, name: str, tp: int) -> Optional[str]:
    """Why `model` (built, possibly on the meta device) cannot be split tp ways (None: it can)."""
    planned = [(path, m) for path, m in model.named_modules() if getattr(m, "tp_plan", None)]
    if not planned:
        return (f"model {name!r} has no tensor-parallel plan (a `tp_plan` on its blocks: "
                "docs/parallelism.md); the built-in gpt has one")
    for path, module in planned:
        for child, (style, parts) in _styles(module.tp_plan).items():
            layer, cls = getattr(module, child, None), STYLES.get(style)
            if cls is None:
                return (f"{name}'s {path} plans {child} as {style!r}, which is none of "
                        f"{', '.join(STYLES)}")
            if not isinstance(layer, cls.layer):
                return (f"{name}'s {path}.{child} is not an nn.{cls.layer.__name__}: its "
                        f"tp_plan cannot split it {style}")
            length = getattr(layer, cls.features)
            if length % (parts * tp):
                return (f"{name}'s {path}.{child} has {length} {cls.across}, which do not "
                        f"split into {parts} x {tp} equal pieces{getattr(cls, 'hint', '')}")
        styles = _styles(module.tp_plan)
        stray = next((c for c in getattr(module, "tp_entered", ()) if styles.get(c, ("",))[0] != "column"), None)
        if stray is not None:
            return (f"{name}'s {path} names {stray} in tp_entered, which its tp_plan does not "
                    "split column")
        stray = next((c for c in getattr(module, "tp_left", ())
                      if styles.get(c, ("",))[0] != "row" or getattr(module, c).bias is not None), None)
        if stray is not None:
            return (f"{name}'s {path} names {stray} in tp_left, which its tp_plan does not split "
                    "row or which has a bias (its partial products are summed by its user)")
        problem = getattr(module, "tp_problem", lambda tp: None)(tp)
        if problem:
            return f"{name}'s layer {path}: {problem}"
    return None


def split_layers(model: nn.Module, rank: int, size: int, group, fill=None,
                 sequence: bool = False) -> dict[str, Split]:
    """Replace every planned layer of `model` by this worker's share of it; returns how each
    parameter that is split is split, by its name in the model. `fill`: for a model on the
    meta device (models/layers.py), gives its layers (its children, in order) their values;
    each is filled just before its planned layers are split, so the host holds this worker's
    shares and one layer whole, never the whole model. `sequence`: sequence parallelism
    (`sequence_region`)."""
    splits: dict[str, Split] = {}
    layers, filled = list(model.named_children()), 0

    def fill_to(name: str) -> None:  # every layer up to the one `name` lies in
        nonlocal filled
        last = next((i for i, (top, _) in enumerate(layers)
                     if name == top or name.startswith(top + ".")), len(layers) - 1)
        while filled <= last:
            fill([layers[filled][1]])
            filled += 1

    for path, module in list(model.named_modules()):
        entered = getattr(module, "tp_entered", ())
        if entered:  # (its forward brings their input in once: Enter)
            module.tp_enter = Enter(group, rank, size, sequence)
        for child, (style, parts) in _styles(getattr(module, "tp_plan", None) or {}).items():
            prefix = f"{path}.{child}" if path else child
            if fill is not None:
                fill_to(prefix)
            split = Split(STYLES[style].dim, parts)
            share = STYLES[style](getattr(module, child), split, rank, size, group, sequence)
            share.entered = child in entered
            share.left = child in getattr(module, "tp_left", ())
            setattr(module, child, share)
            splits.update({f"{prefix}.{p}": split for p in share.split_names})
    if fill is not None:
        fill_to(layers[-1][0] if layers else "")
    return splits


def sequence_start(model: nn.Module) -> Optional[str]:
    """The name of the module marked `tp_sequence_after` in `model` (None: there is none)."""
    return next((path for path, m in model.named_modules()
                 if getattr(m, "tp_sequence_after", False)), None)


def sequence_region(model: nn.Module, rank: int, size: int, group,
                    stage_after: Optional[int] = None) -> list[str]:
    """Sequence parallelism (Megatron-LM's): the output of the module marked
    `tp_sequence_after` (the GPT's embedding) is split along the sequence over the tp workers,
    and everything after it runs on this worker's part (norms, dropout, residual adds: their
    activations 1/tp each), its column layers gathering the whole sequence and its row
    layers scattering it (`sequence=True`: the same bytes as the all-reduces they replace).
    Returns the names of the whole parameters used there: each worker's gradient of one is
    the part from its positions, summed over the tp workers before the step.

    `stage_after`: `model` is a pipeline stage, its layers keyed by their index in the whole
    model, whose layer of this index is the marked one: the stage's layers after it run on
    parts of the sequence (what the stage before sends is a part already), and the stage that
    holds it splits its output."""
    def split(_, __, out: torch.Tensor) -> torch.Tensor:
        if out.shape[1] % size:
            raise ValueError(f"sequence parallelism splits the sequence over tp = {size} "
                             f"workers, and this batch's has {out.shape[1]} positions")
        return _SplitSequence.apply(out, group, rank, size)

    if stage_after is not None:
        after = set()
        for key, layer in model.named_children():
            if int(key) == stage_after:
                layer.register_forward_hook(split)
            elif int(key) > stage_after:
                after.add(key)
        return [name for name, _ in model.named_parameters() if name.split(".", 1)[0] in after]
    first = sequence_start(model)
    if first is None:
        raise ValueError("parallel.sequence_parallel needs a module marked tp_sequence_after "
                         "(the built-in gpt's embedding)")
    dict(model.named_modules())[first].register_forward_hook(split)
    paths = [path for path, _ in model.named_modules()]
    after = {p for p in paths[paths.index(first) + 1:] if not p.startswith(first + ".")}
    return [name for name, _ in model.named_parameters() if name.rsplit(".", 1)[0] in after]


@contextlib.contextmanager
def counted(names: tuple[str, ...] = ("all_reduce", "all_gather")) -> Iterator[dict]:
    """How many times each of these torch.distributed collectives is called in this process
    while inside ({name: calls}, filled as they come): what a pass of a split model costs
    (the tests and `benchmarks/llama.py --tp` count tp's collectives with it)."""
    calls = dict.fromkeys(names, 0)
    originals = {name: getattr(dist, name) for name in names}

    def counting(name: str):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call
    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class OwnRandom:
    """A random stream of this tp worker's own, beside the process's, which a replica's tp
    workers share (the activations they hold whole must draw the same dropout masks): for
    the draws each makes for what only it holds, its heads' attention dropout and, under
    sequence parallelism, the dropout on its part of the sequence. Megatron-LM's RNG
    tracker: `fork()` runs a block of code on this stream, on the device the worker computes
    on, and gives the process its own stream back after."""

    def __init__(self, seed: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        outer = self._get()
        if self.cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        self.state = self._get()
        self._set(outer)

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.cuda else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        outer = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(outer)


class Shares:
    """This worker's share of a model split over the tp workers of its replica (its stage's,
    in a pipeline): how each split parameter is split, and the group of those workers."""

    def __init__(self, model: nn.Module, rank: int, size: int, group, fill=None,
                 sequence: bool = False, split_logits: bool = False,
                 stage_after: Optional[int] = None, random: Optional[OwnRandom] = None):
        self.rank, self.size, self.group, self.random = rank, size, group, random
        self.splits = split_layers(model, rank, size, group, fill, sequence)
        if random is not None:  # a planned module's own draws (the GPT's block: tp_random)
            for module in model.modules():
                if isinstance(module, RowParallel):  # its adapter's dropout (_Share.tp_random)
                    module.tp_random = random.fork
                elif getattr(module, "tp_plan", None):
                    module.tp_random = random.fork
                    if sequence:
                        module.tp_sequence_random = random.fork
        for layer in model.modules():  # the task's loss takes logits split by vocabulary
            if isinstance(layer, GatheredColumn):
                layer.keep_split = split_logits
        # the whole parameters whose gradients are partial sums: under sequence parallelism,
        # those used on a worker's part of the sequence; the whole factor of an adapter
        self.partial = ([n for n in sequence_region(model, rank, size, group, stage_after)
                         if n not in self.splits] if sequence else [])
        self.partial += [n for path, m in model.named_modules() if isinstance(m, _Share)
                         for n in (f"{path}.{p}" for p in m.partial) if n not in self.partial]
        # a planned module's whole layers that each worker uses on its share alone
        # (`tp_partial`: the llama's per-head query and key norms, on its heads)
        self.partial += [n for path, m in model.named_modules()
                         for child in getattr(m, "tp_partial", ()) if hasattr(m, child)
                         for n in (f"{path}.{child}.{p}" for p, _ in getattr(m, child).named_parameters())
                         if n not in self.partial]

    def _split(self, name: str, t) -> bool:
        """Whether `t`, a parameter's or its optimizer state's, is split (Adam's step is not)."""
        return name in self.splits and torch.is_tensor(t) and t.dim() > 0

    def _each(self, fn, model_state: dict, optim_state: dict) -> tuple[dict, dict]:
        """`fn(name, tensor)` on each split tensor of the parameters and the optimizer state."""
        model = {n: fn(n, t) if self._split(n, t) else t for n, t in model_state.items()}
        state = {n: {k: fn(n, v) if self._split(n, v) else v for k, v in s.items()}
                 for n, s in optim_state["state"].items()}
        return model, {**optim_state, "state": state}

    def take(self, model_state: dict, optim_state: dict) -> tuple[dict, dict]:
        """This worker's pieces of whole state (what `gather` made, or a checkpoint's)."""
        return self._each(lambda n, t: self.splits[n].take(t, self.rank, self.size),
                          model_state, optim_state)

    def pieces(self, state: dict) -> dict:
        """`state` ({"model": {name: tensor}, "optim": {name: {key: tensor}}}: this worker's,
        plain or FSDP's DTensors) as DCP is to save or load it: each split tensor as the
        pieces of the whole it holds (`checkpoint.sharded.Pieces`, views of its tensors)."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        from baton.checkpoint.sharded import Pieces

        def pieces(name: str, t: torch.Tensor):
            if isinstance(t, DTensor):  # an FSDP shard of this worker's share
                _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                                   t.placements)
                box = t.to_local()
            else:
                offsets, box = [0] * t.dim(), t
            split = self.splits[name]
            return Pieces(split.whole_shape(t.shape, self.size),
                          split.pieces(box, list(offsets), t.shape[split.dim], self.rank, self.size))

        model = {n: pieces(n, t) if self._split(n, t) else t for n, t in state["model"].items()}
        out = {**state, "model": model}
        if "optim" in state:
            out["optim"] = {n: {k: pieces(n, v) if self._split(n, v) else v for k, v in s.items()}
                            for n, s in state["optim"].items()}
        return out

    def sum_partial_grads(self, module: nn.Module) -> None:
        """The gradients of the whole parameters of which each worker computes a part
        (`partial`), summed over the tp workers (one all-reduce)."""
        if not self.partial:  # (without sequence parallelism or adapters: nothing, every step)
            return
        partial = set(self.partial)
        grads = [local(q.grad) for n, q in module.named_parameters()
                 if n in partial and q.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        for g, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(summed)

    def grad_sq(self, module: nn.Module, device: torch.device, leave: set[int] = frozenset()) -> torch.Tensor:
        """The squared norm of the gradient of the part of the model `module` holds: the split
        parameters' squares summed over the tp workers, the whole ones (the same on each)
        counted once (a collective). Sharded, it is this worker's shards' part of that.
        `leave`: the ids of parameters left out (counted apart by the caller)."""
        split = torch.zeros((), dtype=torch.float32, device=device)
        whole = torch.zeros((), dtype=torch.float32, device=device)
        for name, q in module.named_parameters():
            if q.grad is not None and id(q) not in leave:
                sq = torch.linalg.vector_norm(local(q.grad).float()) ** 2
                if name in self.splits:
                    split += sq
                else:
                    whole += sq
        dist.all_reduce(split, group=self.group)
        return split + whole
