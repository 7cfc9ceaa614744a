"""A Llama-style decoder (`model.name: llama`): rotary positions, grouped-query attention,
a SwiGLU MLP and RMSNorm, written as a flat sequence of layers (embedding, blocks, head) as
the GPT is, so that pipelines, sharding, tensor parallelism and the layer-by-layer build take
it as they take the GPT. Its maths and parameter layout are Hugging Face's LlamaForCausalLM
(rotate-half rotary embedding, an untied head): `baton export --hf` writes its weights under
transformers' names, renamed, never permuted (`hf_name`, `hf_config`). Its options make it
the other models of that kind, to the same logits: Llama 3.1's and 3.2's (`rope_factor`:
their scaled rotary embedding), Qwen2's and 2.5's (`qkv_bias`, `norm_eps`), Qwen3's
(`qk_norm`: each head's query and key normed; `head_dim`: heads of another width than
width / heads), Mistral's (`sliding_window`: each position attends to that many, itself
and those before it);
`from_config` reads their save_pretrained folders' configurations (`FOLDERS`).

q, k, v, gate and up are separate layers, as transformers' are: each is a column layer under
tensor parallelism (a worker holds its query heads, its share of the key-value heads and of
the MLP's hidden units), o and down row layers. The block brings each normed input into the
split region once (`tp_enter`, `tp_entered`) for the layers that take it: two all-reduces a
block backward (under sequence parallelism two all-gathers forward), as the GPT's fused qkv
and fc take, not one for each layer."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from baton.models.documents import Documents, attention
from baton.models.layers import Layers
from baton.parallel.context import ways
from baton.parallel.tensor import Whole

NORM_EPS = 1e-5  # RMSNorm's epsilon when model.options.norm_eps is not given (rms_norm_eps)
ROPE_THETA = 10_000  # the rotary embedding's base when model.options.rope_theta is not given
# the options that change the model's maths and no shape (what a save_pretrained folder's
# config.json must agree with: checkpoint/export.py's settings_problem), and their defaults:
# Llama 3.1's rotary scaling's ("llama3") where the job sets rope_factor
MATHS = {"rope_theta": ROPE_THETA, "norm_eps": NORM_EPS, "qkv_bias": False, "qk_norm": False,
         "rope_factor": None, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
         "rope_original_seq_len": 8192, "experts_per_token": 2, "norm_topk": True}


def default_hidden(width: int) -> int:
    """The MLP's hidden units when `model.options.hidden` is not given: Llama's 8/3 of the
    width (the same parameters as a GELU MLP of 4 x width), up to a multiple of 8."""
    return -(-8 * width // 3 // 8) * 8


class Embedding(nn.Module):
    # tensor parallelism: each worker holds its share of the vocabulary's rows; under
    # sequence parallelism the blocks and the head run on its output's parts of the sequence
    tp_plan = {"tok": "vocab"}
    tp_sequence_after = True

    def __init__(self, vocab_size: int, width: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        return self.tok(tokens)

    def decode(self, tokens: torch.Tensor, cache: dict, start: int) -> torch.Tensor:
        return self(tokens)  # (positions enter in the blocks' attention)


@dataclass(frozen=True)
class Rope:
    """The rotary embedding: its base, and Llama 3.1's scaling of its frequencies (`factor`;
    None: none), transformers' default and "llama3" rotary embeddings."""
    theta: float = ROPE_THETA
    factor: Optional[float] = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_seq_len: int = 8192

    def inv_freq(self, head_width: int, device) -> torch.Tensor:
        """The frequency of each pair of a head's dimensions, (head_width / 2,), in float32:
        theta^(-2i/d); scaled, those of wavelengths beyond original_seq_len / low_freq_factor
        divided by factor, those under original_seq_len / high_freq_factor kept, and those
        between interpolated (transformers' _compute_llama3_parameters)."""
        f = 1.0 / self.theta ** (torch.arange(0, head_width, 2, device=device,
                                              dtype=torch.float32) / head_width)
        if self.factor is None:
            return f
        wavelength = 2 * math.pi / f
        scaled = torch.where(wavelength > self.original_seq_len / self.low_freq_factor, f / self.factor, f)
        smooth = ((self.original_seq_len / wavelength - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        between = ((wavelength >= self.original_seq_len / self.high_freq_factor)
                   & (wavelength <= self.original_seq_len / self.low_freq_factor))
        return torch.where(between, (1 - smooth) * scaled / self.factor + smooth * scaled, scaled)


def rotary(positions: torch.Tensor, head_width: int, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, (T, head_width) for positions (T,), (B, T,
    head_width) for each row's (B, T): each pair's frequency
    (`Rope.inv_freq`) repeated over both halves of a head, as transformers' are."""
    angles = positions.float()[..., None] * rope.inv_freq(head_width, positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, d) turned by its positions' angles (the rotate-half form)."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + turned * sin.to(x.dtype)


class Block(nn.Module):
    # tensor parallelism (parallel/tensor.py): each worker holds its query heads, its share
    # of the key-value heads (kv_heads must divide by tp) and of the MLP's hidden units, and
    # the matching shares of o and down; attention dropout draws from its own stream
    tp_plan = {"q": "column", "k": "column", "v": "column", "o": "row",
               "gate": "column", "up": "column", "down": "row"}
    tp_entered = ("q", "k", "v", "gate", "up")  # (their inputs enter through tp_enter, once)
    # whole on every worker, used on its own heads: each worker's gradient is its heads' part
    tp_partial = ("q_norm", "k_norm")
    tp_random = tp_sequence_random = contextlib.nullcontext
    tp_enter = Whole()  # (under tp: parallel/tensor.py's Enter)

    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int, rope: Rope,
                 dropout: float, norm_eps: float = NORM_EPS, qkv_bias: bool = False,
                 head_dim: Optional[int] = None, qk_norm: bool = False, window: Optional[int] = None):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.window = window  # (Mistral's sliding window: each query sees that many keys)
        self.head_width = hd = head_dim or width // heads
        self.rope = rope
        self.dropout = dropout
        self.attn_norm = nn.RMSNorm(width, eps=norm_eps)
        self.q = nn.Linear(width, heads * hd, bias=qkv_bias)
        self.k = nn.Linear(width, kv_heads * hd, bias=qkv_bias)
        self.v = nn.Linear(width, kv_heads * hd, bias=qkv_bias)
        if qk_norm:  # (Qwen3's: each head's query and key normed over its width)
            self.q_norm, self.k_norm = nn.RMSNorm(hd, eps=norm_eps), nn.RMSNorm(hd, eps=norm_eps)
        self.o = nn.Linear(heads * hd, width, bias=False)
        self.mlp_norm = nn.RMSNorm(width, eps=norm_eps)
        self.add_mlp(width, hidden)
        self.docs: Optional[Documents] = None  # data.document_mask: each token sees its document

    def attend_within(self, docs: Optional[Documents]) -> None:
        self.docs = docs

    def add_mlp(self, width: int, hidden: int) -> None:
        add_swiglu(self, width, hidden)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:  # (h: the normed input, as x is held)
        return swiglu(self, self.tp_enter(h))

    def tp_problem(self, tp: int) -> str | None:
        if self.kv_heads % tp:
            return f"its key-value heads (model.options.kv_heads = {self.kv_heads}) do not split over tp = {tp}"
        return None

    def cp_problem(self, cp: int, tp: int = 1) -> str | None:
        """Why its heads do not split over cp workers (each holding a tp-th of them)."""
        if self.kv_heads % (cp * tp):
            return (f"its key-value heads (model.options.kv_heads = {self.kv_heads}) do not split "
                    f"over {ways(cp, tp)}")
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return self.decode(x, None, 0)

    def decode(self, x: torch.Tensor, cache: dict | None, start: int) -> torch.Tensor:
        """The block on positions start.. of a sequence whose earlier positions' keys and
        values (turned) `cache` holds (`baton sample`), which it extends; training passes none."""
        h = self.tp_enter(self.attn_norm(x))
        # this worker's heads (all, or its share under tp), over the whole sequence (x may be
        # its part of it: sequence parallelism, whose tp_enter gathers it)
        q, k, v = self.q(h), self.k(h), self.v(h)
        B, T = q.shape[:2]
        q, k, v = (t.view(B, T, -1, self.head_width) for t in (q, k, v))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        docs = self.docs if cache is None else None
        if docs is None:
            cos, sin = rotary(torch.arange(start, start + T, device=x.device), self.head_width, self.rope)
        else:  # each row's positions, counted in each document: (B, 1, T, d) over the heads
            cos, sin = (t.unsqueeze(1) for t in rotary(docs.positions, self.head_width, self.rope))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            if start:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        with self.tp_random():
            y = attention(q, k, v, docs, start, self.dropout if self.training else 0.0,
                          gqa=q.shape[1] != k.shape[1], window=self.window)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.mlp_norm(x))


def add_swiglu(module: nn.Module, width: int, hidden: int) -> None:
    """A SwiGLU MLP's layers on `module`: gate, up (width -> hidden) and down."""
    module.gate = nn.Linear(width, hidden, bias=False)
    module.up = nn.Linear(width, hidden, bias=False)
    module.down = nn.Linear(hidden, width, bias=False)


def swiglu(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return module.down(F.silu(module.gate(h)) * module.up(h))


class Expert(nn.Module):
    """One of a mixture's SwiGLU MLPs (Mixtral's w1, w3 and w2; Qwen3-MoE's gate_proj,
    up_proj and down_proj). Under tensor parallelism each worker holds its share of its
    hidden units, as of a block's MLP; its block enters its input and sums the experts'
    partial products, weighted, once (`MoEBlock.mlp`)."""
    tp_plan = {"gate": "column", "up": "column", "down": "row"}
    tp_entered, tp_left = ("gate", "up"), ("down",)

    def __init__(self, width: int, hidden: int):
        super().__init__()
        add_swiglu(self, width, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return swiglu(self, h)


@dataclass(frozen=True)
class Mixture:
    """A block's MLP as a mixture of experts: `experts` MLPs, of which a router picks
    `per_token` for each token (the highest of its softmax), whose outputs it sums weighted
    by their probabilities, renormalised to sum to 1 where `norm_topk` (Mixtral's always,
    Qwen3-MoE's where its norm_topk_prob says so); `shared` hidden units (0: none) of an
    expert every token goes to besides, its output weighed by a gate of its own (Qwen2-MoE's
    shared_expert and shared_expert_gate: a sigmoid of one product of the token)."""
    experts: int
    per_token: int = 2
    norm_topk: bool = True
    shared: int = 0
    # the load-balancing loss's coefficient (0: none) and the blocks it is averaged over
    aux: float = 0.0
    layers: int = 1
    z: float = 0.0  # the router z-loss's coefficient (0: none), averaged over the blocks too

    @property
    def terms(self) -> dict[str, float]:
        """The losses on its routing it adds, by the name their means are logged under
        (train_...), with their coefficients."""
        return {name: c for name, c in (("router_aux_loss", self.aux), ("router_z_loss", self.z)) if c}


class _Balance(torch.autograd.Function):
    """The activations unchanged forward; backward, the load-balancing loss's gradient joins
    theirs: `weight` x d(aux) (Megatron-LM's way: the loss need not travel with the output)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


class MoEBlock(Block):
    """A block whose MLP is a mixture of experts (`Mixture`): Mixtral's and Qwen3-MoE's.
    Every expert runs every step, on the tokens routed to it (none, some or all), so that
    each parameter has a gradient (zero where no token chose it), as DDP and ZeRO reduce
    them; the tokens are grouped by expert once (one sort, one count read to the host a
    block) and each expert's product is one matrix product.

    Under tensor parallelism each worker holds its share of every expert's hidden units (and
    of the shared expert's), and the router whole: it routes the tokens it holds (its part
    of the sequence under sequence parallelism), then runs its share of each expert on the
    whole sequence's pairs (the choices gathered), and one collective sums the weighted
    partial outputs (`Enter.leave`), as a block's MLP's down layer would. The router's
    output weights enter the split region as the activations do, their gradient (each
    worker's from its share of the experts) summed there, apart from the input's: the
    router's input gradient is whole on every worker (or its part's) and is not summed
    again with the experts'."""
    tp_plan = {name: style for name, style in Block.tp_plan.items() if name in ("q", "k", "v", "o")}
    tp_entered = ("q", "k", "v")

    def __init__(self, *block, mixture: Mixture, **options):
        self.mixture = mixture  # (a plain value: set before nn.Module's own, which add_mlp needs)
        super().__init__(*block, **options)
        # what `balance` weighs this block's losses on its routing by, and the rows it counts
        # (None: the mean over the rows of each forward, every row counted)
        self.balances = bool(mixture.terms)  # (a loss on its routing: models.routed)
        self.load: Optional[torch.Tensor] = None  # each expert's choices in the last training forward
        self.aux_weight: Optional[float] = None
        self.aux_rows: Optional[torch.Tensor] = None
        # each loss (Mixture.terms) summed over the rows of the last training forward
        self.losses: dict[str, torch.Tensor] = {}
        self.ep = None  # expert parallelism: this rank holds some of the experts

    def split_experts(self, ep) -> None:
        """Keep the experts this rank holds under expert parallelism (parallel/experts.py's
        `ExpertParallel`); the others become placeholders without parameters, so that the
        kept ones keep their whole model's names."""
        self.ep = ep
        first, per = ep.first(self.mixture.experts), self.mixture.experts // ep.size
        for e in range(self.mixture.experts):
            if not first <= e < first + per:
                self.experts[e] = nn.Module()

    def balance(self, rows: torch.Tensor, weight: float) -> None:
        """Before a training forward: `rows` (B,) marks the rows that count (a padding row
        does not), and `weight` is what a loss summed over them is multiplied by in the
        backward that follows (as the task's loss sum is: the engine's scale)."""
        self.aux_rows, self.aux_weight = rows, weight

    def add_mlp(self, width: int, hidden: int) -> None:
        self.router = nn.Linear(width, self.mixture.experts, bias=False)
        self.experts = nn.ModuleList(Expert(width, hidden) for _ in range(self.mixture.experts))
        if self.mixture.shared:  # (Qwen2-MoE's: one more expert, for every token, gated)
            self.shared = Expert(width, self.mixture.shared)
            self.shared_gate = nn.Linear(width, 1, bias=False)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        k, tp = self.mixture.per_token, self.tp_enter
        logits = self.router(h).float()  # (B, T, E): the tokens this worker holds
        probs = F.softmax(logits, dim=-1)
        weights, picked = torch.topk(probs, k, dim=-1)  # (B, T, k): in float32, as transformers'
        if self.mixture.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        gate = torch.sigmoid(self.shared_gate(h)) if self.mixture.shared else None
        # into the split region (under tp; else as they are): the whole sequence's tokens,
        # choices and weights
        h, picked, weights = tp(h), tp.indices(picked), tp(weights)
        flat = h.reshape(-1, h.shape[-1])
        chosen = picked.flatten()
        order = torch.argsort(chosen, stable=True)  # the (token, choice) pairs, by expert
        load = torch.bincount(chosen, minlength=self.mixture.experts)
        counts = load.tolist()
        tokens = order // k
        if self.ep is not None:  # (each pair to its expert's holder and back)
            outs = self.ep.run(flat[tokens], load, counts, self.experts)
        else:
            outs = torch.cat([expert(part) for expert, part in zip(self.experts, flat[tokens].split(counts))])
        outs = outs * weights.flatten()[order, None]
        # each token's k outputs summed in the experts' order, as transformers' loop sums them
        out = torch.zeros_like(flat).index_add_(0, tokens, outs.to(flat.dtype))
        if self.mixture.shared:  # (added after the routed experts' sum, as transformers adds it)
            out = out + tp(gate).reshape(-1, 1) * self.shared(flat)
        out = tp.leave(out.view_as(h))
        if self.training and torch.is_grad_enabled():
            if self.aux_rows is not None:  # the choices of the rows that count (a padding
                # row's not), on the device: train_expert_load_max
                counted = self.aux_rows.to(h.device, torch.int64).repeat_interleave(chosen.numel() // h.shape[0])
                load = torch.zeros_like(load).index_add_(0, chosen, counted)
            self.load = load
            if self.balances:
                out = self._balanced(out, logits, probs, picked.flatten(1))
        return out

    @torch.compiler.disable  # (its weight changes every step: no graph to guard on it)
    def _balanced(self, out: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor,
                  chosen: torch.Tensor) -> torch.Tensor:
        """`out` carrying the gradient of the losses on its routing (`Mixture.terms`), each
        over each row (a sequence), so that a row's loss is its own whatever rows it is
        batched with (any layout trains as one process):
        - the load-balancing loss: experts x the sum over experts of the share of the row's
          tokens' choices that went to the expert (each of its experts_per_token choices a
          token counted: no gradient) times the expert's mean probability over its tokens
          (transformers' load_balancing_loss_func, per sequence as DeepSeek-V3's
          sequence-wise loss). experts_per_token when balanced, more as the load gathers;
        - the router z-loss: the mean over the row's tokens of the square of the log of the
          sum of exp(each expert's logit) (ST-MoE's), which keeps the router's logits small.
        Each summed over the rows that count, times its coefficient over the blocks (the
        loss is their mean). `chosen`: the choices of the whole sequence this worker's part
        of (B, T x tp x k under sequence parallelism), the rest its part's."""
        B, T, E = probs.shape
        # context and sequence parallelism: this worker's part of each row's tokens. Each loss
        # is linear in what is averaged over the row's tokens (the probabilities, the squared
        # log-sums) once the shares of the choices are known: the shares are the whole row's
        # (its workers' choices summed: no gradient), and each worker adds its own tokens'
        # terms, which the row's workers' sums add up to the row's loss (and its gradient:
        # the router's, summed over the tp workers as sequence parallelism's whole parameters')
        split, tp = self.docs.split if self.docs is not None else None, self.tp_enter
        whole = T * (split.size if split is not None else 1) * (tp.size if tp.sequence else 1)

        def mean(x: torch.Tensor) -> torch.Tensor:  # over the row's tokens (B, T, ...) -> (B, ...)
            return x.mean(dim=1) if whole == T else x.sum(dim=1) / whole
        per_row = {}
        if self.mixture.aux:
            counts = torch.zeros(B, E, device=probs.device).scatter_add_(
                1, chosen, torch.ones_like(chosen, dtype=torch.float32))
            if split is not None:
                torch.distributed.all_reduce(counts, group=split.group)
            shares = counts / whole
            per_row["router_aux_loss"] = E * (shares * mean(probs)).sum(dim=1)  # (B,)
        if self.mixture.z:
            per_row["router_z_loss"] = mean(torch.logsumexp(logits, dim=-1).square())
        rows = self.aux_rows if self.aux_rows is not None else torch.ones(B, dtype=torch.bool)
        rows = rows.to(probs.device, probs.dtype)
        sums = {name: (v * rows).sum() for name, v in per_row.items()}
        self.losses = {name: v.detach() for name, v in sums.items()}
        if tp.sequence:  # (each tp worker logs its replica's: the parts summed)
            for v in self.losses.values():
                torch.distributed.all_reduce(v, group=tp.group)
        loss = sum(self.mixture.terms[name] * v for name, v in sums.items())
        weight = self.aux_weight if self.aux_weight is not None else 1.0 / B
        return _Balance.apply(out, loss, weight / self.mixture.layers)


class Head(nn.Module):
    # tensor parallelism: each worker computes the logits of its share of the vocabulary
    tp_plan = {"lm": "gather"}

    def __init__(self, width: int, vocab_size: int, norm_eps: float = NORM_EPS):
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=norm_eps)
        self.lm = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V)
        return self.lm(self.norm(x))

    def decode(self, x: torch.Tensor, cache: dict, start: int) -> torch.Tensor:
        return self(x)


def llama_layers(*, layers: int, width: int, heads: int, seq_len: int, vocab_size: int,
                 dropout: float = 0.0, kv_heads: Optional[int] = None, hidden: Optional[int] = None,
                 rope_theta: float = ROPE_THETA, norm_eps: float = NORM_EPS, qkv_bias: bool = False,
                 rope_factor: Optional[float] = None, rope_low_freq_factor: float = 1.0,
                 rope_high_freq_factor: float = 4.0, rope_original_seq_len: int = 8192,
                 head_dim: Optional[int] = None, qk_norm: bool = False, experts: int = 0,
                 experts_per_token: int = 2, norm_topk: bool = True,
                 router_aux_loss: float = 0.0, router_z_loss: float = 0.0, shared_expert: int = 0,
                 sliding_window: Optional[int] = None) -> Layers:
    """`experts`: each block's MLP a mixture of that many experts, each of `hidden` hidden
    units, `experts_per_token` of them for each token (`Mixture`; 0: a plain MLP), its
    load-balancing loss weighted by `router_aux_loss` and the router's z-loss by
    `router_z_loss` (0: none), with a gated expert of
    `shared_expert` hidden units that every token goes to (0: none). `sliding_window`: each
    position attends to that many positions at and before it (Mistral's; None: all before it)."""
    kv_heads = kv_heads or heads
    hidden = hidden or default_hidden(width)
    rope = Rope(float(rope_theta), rope_factor and float(rope_factor), float(rope_low_freq_factor),
                float(rope_high_freq_factor), rope_original_seq_len)

    def init(name: str, p: torch.Tensor) -> None:
        if p.dim() >= 2:  # (the norms keep their ones)
            # as the GPT: residual projections scaled down by depth
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("o.weight", "down.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        elif name.endswith(".bias"):
            nn.init.zeros_(p)

    block = (functools.partial(MoEBlock, mixture=Mixture(experts, experts_per_token, norm_topk, shared_expert,
                                                              float(router_aux_loss), layers,
                                                              float(router_z_loss)))
             if experts else Block)
    return Layers([lambda: Embedding(vocab_size, width),
                   *[lambda: block(width, heads, kv_heads, hidden, rope, dropout, norm_eps, qkv_bias,
                                   head_dim, qk_norm, sliding_window)] * layers,
                   lambda: Head(width, vocab_size, norm_eps)], init)


def flops_per_token(layers: int, width: int, heads: int, seq_len: int, vocab_size: int,
                    kv_heads: int | None = None, hidden: int | None = None,
                    head_dim: int | None = None, experts: int = 0, experts_per_token: int = 2,
                    shared_expert: int = 0, **_) -> float:
    """6 x the matmul weights + 12 x layers x the query heads' width x seq_len (attention's
    scores and values, forward and backward: grouped key-value heads change neither), as
    flops.py counts the GPT. A mixture of experts counts the weights a token meets: its
    router's and those of the experts it is routed to (experts_per_token MLPs), not all,
    and a shared expert's and its gate's."""
    hd = head_dim or width // heads
    kv = (kv_heads or heads) * hd
    mlp = 3 * width * (hidden or default_hidden(width))
    if experts:
        mlp = experts_per_token * mlp + width * experts + (3 * width * shared_expert + width if shared_expert else 0)
    block = 2 * width * heads * hd + 2 * width * kv + mlp
    return 6.0 * (layers * block + width * vocab_size) + 12.0 * layers * heads * hd * seq_len


# baton's layer names -> transformers' (LlamaForCausalLM), in a block
_BLOCK = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
          "v": "self_attn.v_proj", "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
          "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


# a mixture's router and experts' layers (baton's "router", "experts.E.gate", ...), in
# MixtralForCausalLM and in Qwen's (Qwen3MoeForCausalLM, whose queries and keys are normed,
# and Qwen2MoeForCausalLM, whose q, k and v have biases: `_qwen_mixture`)
_MIXTURE = {False: ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
            True: ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})}


def _qwen_mixture(o: dict) -> bool:
    """Whether a mixture of experts (the model's options `o`) is one of Qwen's, not Mixtral's."""
    return bool(o.get("qk_norm") or o.get("qkv_bias") or o.get("shared_expert"))


def hf_name(name: str, model) -> tuple[str, bool]:
    """One of the model's parameter names as transformers' model of it (`hf_config`) names
    it (`model`: the job's ModelSpec), never transposed: its layers are nn.Linear, as baton's."""
    index, *layer, kind = name.split(".")
    index, layer = int(index), ".".join(layer)
    if index == 0:
        return f"model.embed_tokens.{kind}", False
    if index == model.layers + 1:
        return ("lm_head.weight" if layer == "lm" else f"model.norm.{kind}"), False
    if layer == "router" or layer.startswith(("experts.", "shared")):
        mlp, projections = _MIXTURE[_qwen_mixture(model.options)]
        if layer == "router":
            return f"model.layers.{index - 1}.{mlp}.gate.{kind}", False
        if layer == "shared_gate":  # (Qwen2-MoE's shared expert and its gate)
            return f"model.layers.{index - 1}.mlp.shared_expert_gate.{kind}", False
        if layer.startswith("shared."):
            return f"model.layers.{index - 1}.mlp.shared_expert.{projections[layer[7:]]}.{kind}", False
        _, expert, projection = layer.split(".")
        return f"model.layers.{index - 1}.{mlp}.experts.{expert}.{projections[projection]}.{kind}", False
    return f"model.layers.{index - 1}.{_BLOCK[layer]}.{kind}", False


def hf_config(model) -> dict:
    """The model as transformers' configuration (`model`: the job's ModelSpec): LlamaConfig's,
    Qwen2Config's where q, k and v have biases (LlamaConfig's attention_bias gives o one
    too; Qwen2's layers are otherwise Llama's, under the same names), Qwen3Config's where
    queries and keys are normed; a mixture of experts MixtralConfig's, Qwen3MoeConfig's
    where queries and keys are normed, or Qwen2MoeConfig's where it has a shared expert.
    A sliding window makes a Llama MistralConfig's, and is each other's own (every layer's:
    Qwen's max_window_layers 0). ValueError for a model that is none of them."""
    o = {**MATHS, **model.options}
    window = o.get("sliding_window")
    qwen = {"use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0}
    if o["qkv_bias"] and o["qk_norm"]:
        raise ValueError("no transformers model has both biases on q, k and v alone and "
                         "normed queries and keys (Qwen2's and Qwen3's)")
    config = {"vocab_size": model.vocab_size, "hidden_size": model.width,
              "intermediate_size": o.get("hidden") or default_hidden(model.width),
              "num_hidden_layers": model.layers, "num_attention_heads": model.heads,
              "num_key_value_heads": o.get("kv_heads") or model.heads,
              "head_dim": o.get("head_dim") or model.width // model.heads,
              "max_position_embeddings": model.seq_len,
              "rms_norm_eps": o["norm_eps"], "rope_theta": float(o["rope_theta"]),
              "hidden_act": "silu", "attention_dropout": model.dropout, "tie_word_embeddings": False,
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if o["rope_factor"] is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": float(o["rope_factor"]),
            "low_freq_factor": float(o["rope_low_freq_factor"]),
            "high_freq_factor": float(o["rope_high_freq_factor"]),
            "original_max_position_embeddings": o["rope_original_seq_len"]}
        config["max_position_embeddings"] = max(model.seq_len, round(o["rope_original_seq_len"] * o["rope_factor"]))
    if o.get("experts"):
        made = _mixture_config(o, config)
        return {**made, **(qwen if made["model_type"] != "mixtral" else {"sliding_window": window})}
    if o["qkv_bias"]:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **config, **qwen}
    if o["qk_norm"]:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **config, **qwen,
                "attention_bias": False}
    if window is not None:  # (Mistral's layers are Llama's, under the same names)
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **config,
                "sliding_window": window}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config,
            "attention_bias": False, "mlp_bias": False}


def _mixture_config(o: dict, config: dict) -> dict:
    """A mixture of experts as MixtralConfig's, Qwen3MoeConfig's where queries and keys
    are normed, or Qwen2MoeConfig's where it has a shared expert (`hf_config`: `config`, the
    rest of it)."""
    shared = o.get("shared_expert", 0)
    if o["qkv_bias"] and not shared:
        raise ValueError("no transformers model has a mixture of experts without a shared expert "
                         "and biases on q, k and v alone (Qwen2-MoE's has one: model.options.shared_expert)")
    if o["qk_norm"] and shared:
        raise ValueError("no transformers model has a mixture of experts with a shared expert and "
                         "normed queries and keys (Qwen2-MoE's and Qwen3-MoE's)")
    # (transformers' load-balancing loss is over the whole batch, baton's over each sequence)
    routing = {"num_experts_per_tok": o["experts_per_token"], "output_router_logits": False,
               "router_aux_loss_coef": float(o.get("router_aux_loss", 0.0))}
    qwen = {**routing, "num_experts": o["experts"], "moe_intermediate_size": config["intermediate_size"],
            "norm_topk_prob": o["norm_topk"], "decoder_sparse_step": 1, "mlp_only_layers": []}
    if shared:  # (Qwen2-MoE's biases on q, k and v are its config's qkv_bias, true by default)
        return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **config, **qwen,
                "shared_expert_intermediate_size": shared, "qkv_bias": o["qkv_bias"]}
    if o["qk_norm"]:
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **config, **qwen,
                "attention_bias": False}
    if not o["norm_topk"]:
        raise ValueError("Mixtral renormalises each token's experts' weights (norm_topk: true); a "
                         "mixture that does not is Qwen3-MoE's, whose queries and keys are normed (qk_norm), "
                         "or Qwen2-MoE's, which has a shared expert (shared_expert)")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **config, **routing,
            "num_local_experts": o["experts"], "router_jitter_noise": 0.0}


# the save_pretrained folders whose models the built-in llama computes: config.json's
# model_type -> (the options its type implies, the config's defaults where a key is left out)
FOLDERS = {"llama": ({}, {"rms_norm_eps": 1e-6}),
           "mistral": ({}, {"rms_norm_eps": 1e-6, "sliding_window": 4096}),
           "qwen2": ({"qkv_bias": True}, {"rms_norm_eps": 1e-6, "use_sliding_window": False}),
           "qwen3": ({"qk_norm": True}, {"rms_norm_eps": 1e-6, "use_sliding_window": False, "head_dim": 128}),
           "mixtral": ({"norm_topk": True}, {"rms_norm_eps": 1e-5, "sliding_window": None, "rope_theta": 1e6,
                                            "num_local_experts": 8, "num_experts_per_tok": 2}),
           "qwen3_moe": ({"qk_norm": True}, {"rms_norm_eps": 1e-6, "use_sliding_window": False,
                                             "num_local_experts": 128, "num_experts_per_tok": 8,
                                             "moe_intermediate_size": 768, "norm_topk_prob": False,
                                             "decoder_sparse_step": 1, "mlp_only_layers": []}),
           # (its q, k and v have biases unless its qkv_bias says not: `_mixture_options`)
           "qwen2_moe": ({}, {"rms_norm_eps": 1e-6, "use_sliding_window": False, "num_experts": 60,
                              "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                              "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                              "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True})}


def from_config(config: dict) -> dict:
    """What a LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    MixtralForCausalLM or Qwen3MoeForCausalLM configuration (a `save_pretrained` folder's config.json: `FOLDERS`) makes of the folder for the built-in
    model: `model`, the job's model section (as a dict) whose weights the folder's are;
    `tied`, the parameters it holds under another's name (a head tied to the token embedding,
    which the built-in model unties: both start from the embedding, and train apart);
    `window`, the sliding window its attention keeps to (None: none), which the job's
    `model.options.sliding_window` must be where its sequence passes it; `window_layers`,
    where only some of its layers keep to it (Qwen's max_window_layers, explicit
    layer_types): the first that does (the built-in llama slides in every layer or in none).
    ValueError naming what the built-in model does not compute the same way."""
    implied, defaults = FOLDERS[config.get("model_type")]
    config = {**defaults, **config}
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    width, heads = config["hidden_size"], config["num_attention_heads"]
    eps = config["rms_norm_eps"]
    for ok, why in (
            (config.get("hidden_act", "silu") == "silu", f"its hidden_act is {config.get('hidden_act')!r}, not 'silu'"),
            (not config.get("attention_bias"), "its attention's layers have biases (o_proj's too)"),
            (not config.get("mlp_bias"), "its MLP's layers have biases"),
            (kind in ("default", "llama3"),
             f"its rotary embedding is {kind!r} (the default one and Llama 3.1's 'llama3' are built in)"),
            (isinstance(eps, (int, float)) and 1e-12 <= eps <= 0.1, f"its rms_norm_eps {eps!r} is not in [1e-12, 0.1]")):
        if not ok:
            raise ValueError(f"the built-in llama does not compute this model: {why}")
    theta = rope.get("rope_theta", config.get("rope_theta", ROPE_THETA))
    layers = config["num_hidden_layers"]
    options = {"kv_heads": config.get("num_key_value_heads") or heads, "hidden": config["intermediate_size"],
               "rope_theta": theta, "norm_eps": eps, "qkv_bias": False, "qk_norm": False, **implied}
    if (config.get("head_dim") or width // heads) != width // heads:
        options["head_dim"] = config["head_dim"]
    if config.get("model_type") in ("mixtral", "qwen3_moe", "qwen2_moe"):
        options.update(_mixture_options(config))
    if kind == "llama3":
        options.update(rope_factor=rope["factor"], rope_low_freq_factor=rope["low_freq_factor"],
                       rope_high_freq_factor=rope["high_freq_factor"],
                       rope_original_seq_len=rope["original_max_position_embeddings"])
    model = {"name": "llama", "layers": layers, "width": width, "heads": heads,
             "seq_len": config.get("max_position_embeddings", 2048), "vocab_size": config["vocab_size"],
             "options": options}
    tied = config.get("tie_word_embeddings", False)  # (the three configs' default)
    return {"model": model, "tied": {f"{layers + 1}.lm.weight": "0.tok.weight"} if tied else {},
            **_window(config, layers)}


def _window(config: dict, layers: int) -> dict:
    """The sliding window of a configuration's attention (`from_config`): Mistral's and
    Mixtral's wherever they have one; Qwen's where use_sliding_window says so, in the layers
    from max_window_layers on (transformers' rule), or those its layer_types name."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if not types:
        qwen = "use_sliding_window" in FOLDERS[config["model_type"]][1]
        first = config.get("max_window_layers", 28) if qwen else 0
        on = window is not None and (not qwen or config.get("use_sliding_window"))
        types = ["sliding_attention" if on and i >= first else "full_attention" for i in range(layers)]
    sliding = [i for i, kind in enumerate(types[:layers]) if kind == "sliding_attention"]
    if not sliding or not window:
        return {"window": None}
    return {"window": window, **({"window_layers": sliding[0]} if len(sliding) < layers else {})}


def _mixture_options(config: dict) -> dict:
    """A Mixtral's, Qwen3-MoE's or Qwen2-MoE's configuration's mixture, as the built-in
    llama's options (`from_config`): Qwen's where every layer's MLP is one (no dense layers
    between), Qwen2-MoE's with its shared expert."""
    moe = config["model_type"] in ("qwen3_moe", "qwen2_moe")
    if moe and (config["decoder_sparse_step"] != 1 or config["mlp_only_layers"]):
        raise ValueError("the built-in llama does not compute this model: some of its layers' MLPs "
                         f"are dense (decoder_sparse_step {config['decoder_sparse_step']}, mlp_only_layers "
                         f"{config['mlp_only_layers']}), and it builds a mixture in every block or in none")
    options = {"experts": config.get("num_experts") or config["num_local_experts"],
               "experts_per_token": config["num_experts_per_tok"]}
    if moe:
        options.update(hidden=config["moe_intermediate_size"], norm_topk=bool(config["norm_topk_prob"]))
    if config["model_type"] == "qwen2_moe":
        if not config["shared_expert_intermediate_size"]:
            raise ValueError("the built-in llama does not compute this model: its shared expert has "
                             "no hidden units (shared_expert_intermediate_size 0)")
        options.update(shared_expert=config["shared_expert_intermediate_size"], qkv_bias=bool(config["qkv_bias"]))
    return options
