"""A Llama-style decoder (`model.name: llama`): rotary positions, grouped-query attention,
a SwiGLU MLP and RMSNorm, written as a flat sequence of layers (embedding, blocks, head) as
the GPT is, so that pipelines, sharding, tensor parallelism and the layer-by-layer build take
it as they take the GPT. Its maths and parameter layout are Hugging Face's LlamaForCausalLM
(rotate-half rotary embedding, no biases, an untied head): `baton export --hf` writes its
weights under transformers' names, renamed, never permuted (`hf_name`, `hf_config`).

q, k, v, gate and up are separate layers, as transformers' are: each is a column layer under
tensor parallelism (a worker holds its query heads, its share of the key-value heads and of
the MLP's hidden units), o and down row layers. That costs collectives a fused layer would
share: each column layer sums its input's gradient on its own (five all-reduces a block
backward where the GPT's fused qkv and fc take two), and under sequence parallelism each
gathers its input (five all-gathers a block forward where the GPT takes two)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from baton.models.layers import Layers

NORM_EPS = 1e-5  # RMSNorm's epsilon (written into the export's config as rms_norm_eps)
ROPE_THETA = 10_000  # the rotary embedding's base when model.options.rope_theta is not given


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


def rotary(positions: torch.Tensor, head_width: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, (T, head_width): transformers' default rotary
    embedding (frequencies theta^(-2i/d), each repeated over both halves of a head)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_width, 2, device=positions.device,
                                            dtype=torch.float32) / head_width)
    angles = torch.outer(positions.float(), inv_freq)
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
    tp_random = tp_sequence_random = contextlib.nullcontext

    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int, theta: float,
                 dropout: float):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.head_width = width // heads
        self.theta = theta
        self.dropout = dropout
        self.attn_norm = nn.RMSNorm(width, eps=NORM_EPS)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, kv_heads * self.head_width, bias=False)
        self.v = nn.Linear(width, kv_heads * self.head_width, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.mlp_norm = nn.RMSNorm(width, eps=NORM_EPS)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def tp_problem(self, tp: int) -> str | None:
        if self.kv_heads % tp:
            return f"its key-value heads (model.options.kv_heads = {self.kv_heads}) do not split over tp = {tp}"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return self.decode(x, None, 0)

    def decode(self, x: torch.Tensor, cache: dict | None, start: int) -> torch.Tensor:
        """The block on positions start.. of a sequence whose earlier positions' keys and
        values (turned) `cache` holds (`baton sample`), which it extends; training passes none."""
        h = self.attn_norm(x)
        # this worker's heads (all, or its share under tp), over the whole sequence (x may be
        # its part of it: sequence parallelism, whose column layers gather it)
        q, k, v = self.q(h), self.k(h), self.v(h)
        B, T = q.shape[:2]
        q = q.view(B, T, -1, self.head_width).transpose(1, 2)
        k, v = (t.view(B, T, -1, self.head_width).transpose(1, 2) for t in (k, v))
        cos, sin = rotary(torch.arange(start, start + T, device=x.device), self.head_width, self.theta)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            if start:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        with self.tp_random():
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=start == 0, enable_gqa=q.shape[1] != k.shape[1],
                dropout_p=self.dropout if self.training else 0.0)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Head(nn.Module):
    # tensor parallelism: each worker computes the logits of its share of the vocabulary
    tp_plan = {"lm": "gather"}

    def __init__(self, width: int, vocab_size: int):
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=NORM_EPS)
        self.lm = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V)
        return self.lm(self.norm(x))

    def decode(self, x: torch.Tensor, cache: dict, start: int) -> torch.Tensor:
        return self(x)


def llama_layers(*, layers: int, width: int, heads: int, seq_len: int, vocab_size: int,
                 dropout: float = 0.0, kv_heads: int | None = None, hidden: int | None = None,
                 rope_theta: int = ROPE_THETA) -> Layers:
    kv_heads = kv_heads or heads
    hidden = hidden or default_hidden(width)

    def init(name: str, p: torch.Tensor) -> None:
        if p.dim() >= 2:  # (the norms keep their ones)
            # as the GPT: residual projections scaled down by depth
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("o.weight", "down.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    return Layers([lambda: Embedding(vocab_size, width),
                   *[lambda: Block(width, heads, kv_heads, hidden, float(rope_theta), dropout)] * layers,
                   lambda: Head(width, vocab_size)], init)


def flops_per_token(layers: int, width: int, heads: int, seq_len: int, vocab_size: int,
                    kv_heads: int | None = None, hidden: int | None = None, **_) -> float:
    """6 x the matmul weights + 12 x layers x width x seq_len (attention's scores and values,
    forward and backward: grouped key-value heads change neither), as flops.py counts the GPT."""
    kv = (kv_heads or heads) * (width // heads)
    block = 2 * width * width + 2 * width * kv + 3 * width * (hidden or default_hidden(width))
    return 6.0 * (layers * block + width * vocab_size) + 12.0 * layers * width * seq_len


# baton's layer names -> transformers' (LlamaForCausalLM), in a block
_BLOCK = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
          "v": "self_attn.v_proj", "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def hf_name(name: str, layers: int) -> tuple[str, bool]:
    """One of the model's parameter names as LlamaForCausalLM names it (never transposed:
    its layers are nn.Linear, as baton's)."""
    index, layer, kind = name.split(".")
    index = int(index)
    if index == 0:
        return f"model.embed_tokens.{kind}", False
    if index == layers + 1:
        return ("lm_head.weight" if layer == "lm" else f"model.norm.{kind}"), False
    return f"model.layers.{index - 1}.{_BLOCK[layer]}.{kind}", False


def hf_config(model) -> dict:
    """The model as LlamaConfig's configuration (`model`: the job's ModelSpec)."""
    o = model.options
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": model.vocab_size, "hidden_size": model.width,
            "intermediate_size": o.get("hidden") or default_hidden(model.width),
            "num_hidden_layers": model.layers, "num_attention_heads": model.heads,
            "num_key_value_heads": o.get("kv_heads") or model.heads,
            "head_dim": model.width // model.heads, "max_position_embeddings": model.seq_len,
            "rms_norm_eps": NORM_EPS, "rope_theta": float(o.get("rope_theta", ROPE_THETA)),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "attention_dropout": model.dropout, "tie_word_embeddings": False,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def from_config(config: dict) -> dict:
    """What a LlamaForCausalLM configuration (a `save_pretrained` folder's config.json) makes
    of the folder for the built-in model: `model`, the job's model section (as a dict) whose
    weights the folder's are, and `tied`, the parameters it holds under another's name (a
    head tied to the token embedding, which the built-in model unties: both start from the
    embedding, and train apart). ValueError naming what the built-in model does not compute
    the same way."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    width, heads = config["hidden_size"], config["num_attention_heads"]
    for ok, why in (
            (config.get("hidden_act", "silu") == "silu", f"its hidden_act is {config.get('hidden_act')!r}, not 'silu'"),
            (not config.get("attention_bias") and not config.get("mlp_bias"), "its layers have biases"),
            (kind == "default", f"its rotary embedding is {kind!r} (only the default one is built in)"),
            (config.get("rms_norm_eps", 1e-6) == NORM_EPS,
             f"its rms_norm_eps is {config.get('rms_norm_eps', 1e-6)}, and the built-in llama's {NORM_EPS}"),
            (config.get("head_dim") in (None, width // heads),
             f"its head_dim {config.get('head_dim')} is not hidden_size / num_attention_heads")):
        if not ok:
            raise ValueError(f"the built-in llama does not compute this model: {why}")
    theta = rope.get("rope_theta", config.get("rope_theta", ROPE_THETA))
    layers = config["num_hidden_layers"]
    model = {"name": "llama", "layers": layers, "width": width, "heads": heads,
             "seq_len": config.get("max_position_embeddings", 2048), "vocab_size": config["vocab_size"],
             "options": {"kv_heads": config.get("num_key_value_heads") or heads,
                         "hidden": config["intermediate_size"], "rope_theta": int(theta)}}
    tied = config.get("tie_word_embeddings", False)  # (LlamaConfig's default)
    return {"model": model, "tied": {f"{layers + 1}.lm.weight": "0.tok.weight"} if tied else {}}
