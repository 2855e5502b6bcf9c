"""The varlen flash kernels of ``vime.backends.varlen_attention`` on a CUDA device.

Proves: each installed varlen kernel (torch's ``varlen_attn``, flash-attn's
``flash_attn_varlen_func``) computes, in bf16, what the sdpa buckets compute in fp32 on the
same values -- outputs and query/key/value gradients, on random packed rows with shared
prompts (runs whose keys start with another run's prompt) and grouped-query heads -- so
their causal mask is aligned to the bottom right as the gathered keys need; and that a
bf16 CUDA row dispatches to a varlen kernel where one is installed. Skipped without CUDA
(``conftest.py``); a kernel that is not installed is skipped by name.
"""

from __future__ import annotations

import pytest
import torch

from vime import device as vime_device
from vime.backends import varlen_attention as va

pytestmark = pytest.mark.gpu

# bf16 inputs and outputs (8 significant bits) against fp32 buckets: attention outputs are
# averages of values ~N(0, 1), so a few bf16 steps (2**-7 each near 1) bound the gap;
# a shared prefix sums its key and value gradients over every run reading it.
ATOL = 3e-2


def _shared_positions() -> torch.Tensor:
    """A row of prompts shared by several responses, the packer's layout, then padding."""
    positions: list[int] = []
    for prompt, responses in ((37, [20, 3, 64]), (5, [200]), (90, [1, 17, 33, 2]), (1, [1, 1])):
        positions += range(prompt + responses[0])
        for r in responses[1:]:
            positions += range(prompt, prompt + r)
    return torch.tensor([[*positions, *range(7)]])


@pytest.mark.parametrize("kernel", [va.TORCH_VARLEN, va.FLASH_ATTN])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_varlen_kernel_equals_the_buckets(kernel: str, kv_heads: int) -> None:
    if kernel not in vime_device.attention_kernels():
        pytest.skip(f"{kernel} is not installed")
    gen = torch.Generator().manual_seed(kv_heads)
    positions = _shared_positions()
    layout = va.layout_of_positions(positions, "cuda")
    total, heads, dim = positions.shape[1], 8, 128
    base = [torch.randn(h, total, dim, generator=gen) for h in (heads, kv_heads, kv_heads)]
    probe = torch.randn(total, heads, dim, generator=gen).cuda()

    def run(dtype: torch.dtype, attend) -> tuple[torch.Tensor, ...]:
        q, k, v = (t.cuda().to(dtype).requires_grad_() for t in base)
        out = attend(q, k, v)
        grads = torch.autograd.grad((probe.to(dtype) * out).sum(), (q, k, v))
        return (out.float(), *(g.float() for g in grads))

    def varlen(q, k, v):
        rows = va.varlen_rows(q, k, v, layout)
        return va._VARLEN_KERNELS[kernel](rows, layout.varlen, 0.1, 0.0)

    def buckets(q, k, v):
        return va._bucket_attention(q, k, v, layout, 0.1, 0.0)

    got, want = run(torch.bfloat16, varlen), run(torch.float32, buckets)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert w.abs().max() > 0, name
        # Gradients sum over many positions: the bound scales with their size.
        scale = max(1.0, float(w.abs().max()))
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL * scale, msg=name)


def test_bf16_cuda_rows_dispatch_to_a_varlen_kernel() -> None:
    installed = vime_device.attention_kernels()
    kernel = va.choose_kernel("cuda", installed, torch.bfloat16)
    if not installed:
        assert kernel == va.SDPA_BUCKETS
        pytest.skip("no varlen kernel installed")
    q = torch.randn(4, 10, 64, device="cuda", dtype=torch.bfloat16)
    out = va.packed_causal_attention(q, q, q, va.row_layout([3, 7], "cuda"))
    assert out.shape == (10, 4, 64) and kernel in va.kernels_used()
