"""Optimizer pieces both backends share: weight-decay grouping, the LR schedule, the step.

Where it fits: a backend builds its AdamW with ``adamw`` (``param_groups``); the
actor (``policy_actor.py``) keeps one ``LRSchedule`` and funnels every update through
``optimizer_step`` — the single chokepoint clip -> step -> schedule. Only the
gradient-norm computation differs between backends (DTensor shards vs tensor-parallel
shards), so it is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vime.device import is_cuda


def decays(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: biases and 1-D tensors (norm weights, scales) get no weight decay.

    Decaying a norm's gain pulls it toward 0 and shrinks the layer's output,
    and a bias carries no capacity worth regularising; every matrix decays,
    embeddings and the output head included.
    """
    return not (name.endswith(".bias") or param.ndim <= 1)


def param_groups(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict]:
    """Two AdamW groups, decayed and not, of the trainable parameters (empty ones dropped)."""
    decay, no_decay = [], []
    for name, param in named_params:
        if param.requires_grad:
            (decay if decays(name, param) else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


@dataclass(frozen=True)
class AdamWSettings:
    """The AdamW flags: ``--lr``, ``--weight-decay``, ``--adam-beta1/2``, ``--adam-eps``."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float


def adamw_kernel(device: torch.device | str | None) -> dict[str, bool]:
    """How torch's AdamW runs over parameters on ``device``: one fused kernel per chunk of
    tensors on CUDA (the whole update in one pass over each weight), multi-tensor ops
    elsewhere. On the CPU torch would pick the per-tensor loop, a dozen ops a parameter,
    each through DTensor dispatch under fsdp2: multi-tensor ops are ~5x faster there.
    """
    return {"fused": True} if is_cuda(device) else {"foreach": True}


def adamw(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], settings: AdamWSettings
) -> torch.optim.AdamW:
    """AdamW over ``named_params`` in Megatron's decay groups, its kernels chosen by the
    parameters' device (``adamw_kernel``)."""
    groups = param_groups(named_params, settings.weight_decay)
    first = next((g["params"][0] for g in groups), None)
    return torch.optim.AdamW(
        groups,
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        **adamw_kernel(None if first is None else first.device),
    )


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the number of training samples consumed.

    Counting samples (as Megatron does) rather than steps keeps the schedule's
    meaning when the batch size changes. With s the samples consumed *including*
    the current step's batch (so the first step of a warmup does not run at lr 0):

    - warmup, s <= warmup_samples:  lr · s / warmup_samples
    - constant:                      lr
    - linear:  min_lr + (lr − min_lr) · (1 − f)
    - cosine:  min_lr + (lr − min_lr) · ½ (1 + cos(π f))
      with f = clamp((s − warmup_samples) / (total_samples − warmup_samples), 0, 1).

    No field has a default: the flags' are the only ones
    (``vime.config.train_settings.lr_schedule``).
    """

    lr: float
    min_lr: float
    decay_style: str
    warmup_samples: int
    total_samples: int

    def __post_init__(self) -> None:
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr decay style {self.decay_style!r}")

    def __call__(self, samples: int) -> float:
        if self.warmup_samples > 0 and samples <= self.warmup_samples:
            return self.lr * samples / self.warmup_samples
        if self.decay_style == "constant":
            return self.lr
        span = max(self.total_samples - self.warmup_samples, 1)
        frac = min(max((samples - self.warmup_samples) / span, 0.0), 1.0)
        if self.decay_style == "linear":
            scale = 1.0 - frac
        else:
            scale = 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_lr + (self.lr - self.min_lr) * scale


@dataclass
class StepResult:
    grad_norm: float
    lr: float
    skipped: bool


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    grad_norm: torch.Tensor,
    *,
    clip_grad: float,
    lr: float,
) -> StepResult:
    """The one place an update happens: (skip | clip -> step), then zero the gradients.

    ``grad_norm`` is the global (all-rank) L2 norm of the gradients of
    ``params``, computed by the backend, which knows how its parameters are
    sharded. A non-finite norm skips the update entirely — stepping would scale
    every weight by garbage and poison the next rollout — and the gradients
    are zeroed either way so nothing leaks into the next step. ``lr`` (from the
    caller's ``LRSchedule``) is set on every group before the step. ``optimizer``
    may update only some of ``params`` (optimizer state sharded over ranks); the
    gradients of all of ``params`` are clipped and cleared.
    """
    norm = float(grad_norm)
    skipped = not math.isfinite(norm)
    if not skipped:
        if clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip_grad, grad_norm, foreach=True)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    for param in params:
        param.grad = None
    return StepResult(grad_norm=norm, lr=lr, skipped=skipped)
