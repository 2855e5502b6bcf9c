"""Shared optimizer pieces: the no-decay rule, the sample-counted LR schedule, the step.

Proves that biases and 1-D weights are never decayed while every matrix is,
that the schedule hits its documented values (warmup ramp, linear and cosine
end points, floor at min_lr) and depends on samples, not steps, and that the
step chokepoint clips to the given norm, skips a non-finite update without
touching the weights, and always leaves the gradients cleared -- also those of
parameters another rank's optimizer updates. And that AdamW's kernels follow the
parameters' device: fused on CUDA, multi-tensor ops on the CPU (``adamw_kernel``).
"""

from __future__ import annotations

import math

import pytest
import torch

from vime.backends.optim import (
    AdamWSettings,
    LRSchedule,
    adamw,
    adamw_kernel,
    decays,
    optimizer_step,
    param_groups,
)


def test_no_decay_rule() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(4)))
    frozen = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
    model.register_parameter("frozen", frozen)
    by_name = {n: decays(n, p) for n, p in model.named_parameters()}
    assert by_name == {
        "0.weight": True,
        "0.bias": False,
        "1.weight": False,
        "1.bias": False,
        "scale": False,
        "frozen": True,
    }
    groups = param_groups(model.named_parameters(), weight_decay=0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in groups] == [1, 4]  # frozen is left out


def test_adamw_kernel_follows_the_device() -> None:
    assert adamw_kernel("cuda") == {"fused": True}
    assert adamw_kernel(torch.device("cuda", 1)) == {"fused": True}
    assert adamw_kernel("cpu") == adamw_kernel(None) == {"foreach": True}
    model = torch.nn.Linear(4, 4)
    settings = AdamWSettings(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
    group = adamw(model.named_parameters(), settings).param_groups[0]
    assert group["foreach"] is True and not group["fused"]


def test_schedule_values() -> None:
    warm = LRSchedule(
        lr=1.0, min_lr=0.0, decay_style="constant", warmup_samples=100, total_samples=1000
    )
    assert warm(0) == 0.0 and warm(25) == 0.25 and warm(100) == 1.0 and warm(999) == 1.0
    lin = LRSchedule(lr=1.0, min_lr=0.1, decay_style="linear", warmup_samples=0, total_samples=1000)
    assert lin(0) == 1.0 and lin(1000) == pytest.approx(0.1) and lin(5000) == pytest.approx(0.1)
    assert lin(500) == pytest.approx(0.55)
    cos = LRSchedule(
        lr=1.0, min_lr=0.0, decay_style="cosine", warmup_samples=100, total_samples=1100
    )
    assert cos(600) == pytest.approx(0.5) and cos(1100) == pytest.approx(0.0, abs=1e-12)
    assert cos(350) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))


def test_schedule_counts_samples_not_steps() -> None:
    """Warmup (64 samples) then cosine to 0.1 over 256 samples, read as the actors read it:
    at the samples consumed after each step. Steps of 32 and of 64 samples get the
    documented value at every point they reach, so the same sample count gets the same
    rate whatever the batch; the k-th steps of the two runs get different rates (a schedule
    counted in steps would give them the same). The actors' wiring is tested in
    test_fsdp2_actor.py (test_lr_follows_the_samples_consumed)."""
    sched = LRSchedule(
        lr=1.0, min_lr=0.1, decay_style="cosine", warmup_samples=64, total_samples=256
    )

    def documented(s: int) -> float:
        if s <= 64:
            return s / 64
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 64) / 192))

    for batch in (32, 64):
        for step in range(1, 256 // batch + 1):
            s = step * batch
            assert sched(s) == pytest.approx(documented(s), rel=1e-12, abs=1e-12), (batch, s)
    assert [sched(32 * k) for k in (1, 2, 5, 8)] == pytest.approx([0.5, 1.0, 0.55, 0.1])
    assert [sched(64 * k) for k in (1, 2)] != pytest.approx([sched(32 * k) for k in (1, 2)])


def _model_with_grads(scale: float) -> torch.nn.Linear:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, scale)
    return model


def test_step_clips_to_the_norm() -> None:
    model = _model_with_grads(1.0)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert float(norm) == pytest.approx(math.sqrt(8))
    opt = torch.optim.SGD(params, lr=0.0)
    result = optimizer_step(opt, params, norm, clip_grad=0.5, lr=1.0)
    assert not result.skipped and result.lr == 1.0
    for p, b in zip(params, before, strict=True):
        # SGD moved each weight by lr * grad * (0.5 / sqrt(8)).
        assert torch.allclose(b - p.detach(), torch.full_like(b, 0.5 / math.sqrt(8)), atol=1e-6)
        assert p.grad is None


def test_non_finite_norm_skips_and_clears() -> None:
    model = _model_with_grads(float("nan"))
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1.0)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    result = optimizer_step(opt, params, norm, clip_grad=1.0, lr=1.0)
    assert result.skipped and math.isnan(result.grad_norm)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    assert all(p.grad is None for p in params)
    assert not opt.state  # AdamW never stepped: no moments polluted by NaN


def test_step_of_a_partial_optimizer_clears_every_gradient() -> None:
    """Optimizer state sharded over ranks: this rank's AdamW holds only some parameters,
    but the step clips and clears the gradients of all of them."""
    model = _model_with_grads(1.0)
    weight, bias = model.parameters()
    before = bias.detach().clone()
    opt = torch.optim.SGD([weight], lr=0.0)
    norm = torch.nn.utils.get_total_norm([weight.grad, bias.grad])
    optimizer_step(opt, [weight, bias], norm, clip_grad=1.0, lr=1.0)
    assert weight.grad is None and bias.grad is None
    assert torch.equal(bias.detach(), before)  # not this rank's to update
