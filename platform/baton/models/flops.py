"""Model FLOPs per token and device peaks, for model FLOPs utilisation (MFU).

Training FLOPs per token = 6 x (matmul parameters) + 12 x layers x width x seq_len (attention
scores and values, forward and backward), as in the PaLM paper's appendix B. Embedding lookups
are not matmuls and are left out.
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


def peak_flops(device_name: str, precision: str) -> Optional[float]:
    """Peak FLOP/s of a known accelerator, or None."""
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in device_name:
            return peaks[precision] * 1e12
    return None
