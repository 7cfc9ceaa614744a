"""Ring attention's kernel on a GPU (parallel/ring.py's `Products`, what a ring computes
each part with off a CPU): one block of queries against keys, forward and backward from
the log-sum-exp, against `scaled_dot_product_attention` on the same device. One GPU; the
ring itself (NCCL's sends) is `test_nccl.py`'s context-parallel test, which needs two."""

from __future__ import annotations

import pytest
import torch

from baton.parallel.ring import CAUSAL, Products

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _apart(device: str, kernels: Products, causal: bool) -> list[float]:
    """The largest difference of the output, q's, k's and v's gradients (4 query heads on 2
    key-value heads, 64 positions, documents kept apart or causal alone)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, 16, generator=g).to(device).requires_grad_()
    k, v = (torch.randn(2, 2, 64, 16, generator=g).to(device).requires_grad_() for _ in range(2))
    dy = torch.randn(2, 4, 64, 16, generator=g).to(device)
    doc = (torch.rand(2, 64, generator=g) < 0.1).long().cumsum(1).to(device)
    mask = torch.ones(64, 64, dtype=torch.bool, device=device).tril()
    if not causal:
        mask = (mask & (doc[:, :, None] == doc[:, None, :])).unsqueeze(1)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    want.backward(dy)
    seen = CAUSAL if causal else mask
    with torch.no_grad():
        y, lse = kernels.forward(q, k, v, seen, 16 ** -0.5)
        grads = kernels.backward(dy, q, k, v, y.to(q.dtype), lse, seen, 16 ** -0.5)
    return [(a.float() - b.float()).abs().max().item()
            for a, b in [(y, want)] + list(zip(grads, (q.grad, k.grad, v.grad)))]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "documents"])
def test_the_ring_kernel_computes_attention_on_a_gpu(causal):
    """A block at once and a run of 8 query rows at a time. The bound is the CPU's: on a
    CPU the same function gives at most 1.3e-6 (values of about 1-3), and CUDA's float32
    products (TF32 off, torch's default for matmul) are not yet measured."""
    for kernels in (Products(), Products(scores_bytes=8 * 4 * 2 * 4 * 64)):
        apart = _apart("cuda", kernels, causal)
        print(f"ring kernel on {torch.cuda.get_device_name()}: {apart}")
        assert max(apart) < 1e-5, apart
