"""Model FLOPs per token and device peaks, for model FLOPs utilisation (MFU).

Training FLOPs per token = 6 x (matmul parameters) + 12 x layers x width x seq_len (attention
scores and values, forward and backward), as in the PaLM paper's appendix B. Embedding lookups
are not matmuls and are left out (the Llama-style model's count: models/llama.py). The MLP
model and a user's model count 6 x the weights of their nn.Linear layers (a user's attention,
if any, is not counted: MFU is then a lower bound). A frozen weight (`model.frozen`,
`model.lora`) counts 4 (its forward and its input's gradient, not its own), and each
adapter's parameters 6.
"""

from __future__ import annotations

from typing import Optional

# Dense peak TFLOPS by device-name fragment and precision (vendor data sheets, SXM parts).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp32": 66.9},
    "H100": {"bf16": 989.4, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp32": 19.5},
}


def gpt_flops_per_token(layers: int, width: int, seq_len: int, vocab_size: int) -> float:
    block = 12 * width * width  # qkv 3w^2 + proj w^2 + mlp 8w^2
    matmul_params = layers * block + width * vocab_size
    return 6.0 * matmul_params + 12.0 * layers * width * seq_len


def mlp_flops_per_token(layers: int, width: int, context: int, vocab_size: int,
                        embed_dim: int = 16) -> float:
    return 6.0 * (context * embed_dim * width + (layers - 1) * width * width + width * vocab_size)


def model_flops_per_token(spec) -> Optional[float]:
    """Training FLOPs per token of the job's model (`ModelSpec`); None (no MFU) for a user's
    builder that does not build on the meta device: one that works on the workers' devices
    may not there, and the run must not fail for a metric (it ended in the builder's
    traceback before the workers started)."""
    from baton.models import _on_meta

    model = None
    if spec.name == "gpt":
        flops = gpt_flops_per_token(spec.layers, spec.width, spec.seq_len, spec.vocab_size)
    elif spec.name == "llama":
        from baton.models.llama import flops_per_token

        flops = flops_per_token(spec.layers, spec.width, spec.heads, spec.seq_len,
                                spec.vocab_size, **spec.options)
    elif spec.name == "mlp":
        flops = mlp_flops_per_token(spec.layers, spec.width, spec.context, spec.vocab_size,
                                    **spec.options)
    else:
        import torch

        try:
            model = _on_meta(spec)
        except Exception:  # noqa: BLE001 - the workers build it for real, and say what failed
            return None
        flops = 6.0 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if spec.partly_frozen:  # frozen weights get no gradient; adapters train
        from baton.models import frozen

        model = model if model is not None else _on_meta(spec)
        flops += frozen.flops_change(model, spec)
        if spec.lora is not None:
            from baton.models import lora

            flops += lora.flops(model, spec)
    return flops


def peak_flops(device_name: str, precision: str) -> Optional[float]:
    """Peak FLOP/s of a known accelerator, or None."""
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in device_name:
            return peaks[precision] * 1e12
    return None


def job_peak_flops(device_names: list[str], precision: str,
                   cpu_peak_tflops: Optional[float]) -> Optional[float]:
    """The workers' summed peak FLOP/s, or None when one of them has no known peak (a CPU
    without tracking.cpu_peak_tflops, an accelerator not in PEAK_TFLOPS)."""
    total = 0.0
    for name in device_names:
        peak = (cpu_peak_tflops * 1e12 if cpu_peak_tflops else None) if name == "cpu" \
            else peak_flops(name, precision)
        if peak is None:
            return None
        total += peak
    return total or None
