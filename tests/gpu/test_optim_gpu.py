"""AdamW over CUDA parameters runs torch's fused kernel.

Proves: ``vime.backends.optim.adamw`` builds a fused AdamW for parameters on a CUDA
device (one kernel per chunk of tensors instead of a dozen multi-tensor ops), and its
steps match the multi-tensor AdamW the CPU runs, decay groups included, to float
rounding. Skipped without CUDA (``conftest.py``).
"""

from __future__ import annotations

import copy

import torch

from vime.backends.optim import AdamWSettings, adamw, param_groups

SETTINGS = AdamWSettings(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)


def test_adamw_on_cuda_is_fused() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).cuda()
    reference = copy.deepcopy(model)
    fused = adamw(model.named_parameters(), SETTINGS)
    assert all(g["fused"] and not g["foreach"] for g in fused.param_groups)
    multi = torch.optim.AdamW(
        param_groups(reference.named_parameters(), SETTINGS.weight_decay),
        lr=SETTINGS.lr,
        betas=SETTINGS.betas,
        eps=SETTINGS.eps,
        foreach=True,
    )
    x = torch.randn(8, 16, device="cuda")
    for _ in range(3):
        for net, opt in ((model, fused), (reference, multi)):
            net(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
