"""Rollout correction: importance weights for the train–inference mismatch.

Where it fits: the engine samples from π_rollout, which differs from the
trainer's π_old even on-policy (other kernels, other precision, vLLM against HF).
``vime.algo.objective.micro_batch_loss`` multiplies the policy-gradient term of
every response token by the weight :func:`correction_weights` returns
(``--use-tis``; the family verl, TRL, OpenRLHF and slime offer as TIS, IcePop and
masked or sequence-level importance sampling). The KL and entropy terms are not
weighted. The weights are detached: they scale the gradient, never receive one.
With ``--max-staleness`` >= 1 the same weight is decoupled PPO's behaviour
correction π_prox / π_behav, on by default there (``vime.config.algo_flags``).

With m the loss mask, nᵢ = Σₜ mᵢₜ and δ = old_logp − rollout_logp:

    token level:      ρᵢₜ = exp(δᵢₜ)
    sequence level:   ρᵢₜ = ρᵢ = exp(Σₜ mᵢₜ δᵢₜ)        (product of the token ratios)
    geometric level:  ρᵢₜ = ρᵢ = exp(Σₜ mᵢₜ δᵢₜ / nᵢ)   (their geometric mean)
    truncate:         w = min(ρ, high)
    mask:             w = ρ · 1[low ≤ ρ ≤ high]          (low defaults to 1 / high)

The level names are verl's, slime's and TRL's: their "sequence" is the product, so a
configuration ported from them means the same here. Every exponent is clamped to
±``MAX_LOG_RATIO`` first (a long sequence's sum must not overflow), which changes no
weight of truncate or mask mode unless a bound lies outside [e^-20, e^20].

A masked token (or every token of a masked sequence) leaves the loss with weight
0; the step's normalizers stay the planner's counts, as in TRL's and IcePop's
masking, so the gradient of a step still does not depend on its micro-batching.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vime.algo.losses import MAX_LOG_RATIO

CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
CORRECTION_MODES: tuple[str, ...] = ("truncate", "mask")


@dataclass(frozen=True)
class RolloutCorrection:
    """The correction of a run (``--use-tis`` and its bounds; the flags' defaults,
    ``vime.config.algo_flags``, are the only ones). ``low`` None: 1 / ``high``."""

    level: str
    mode: str
    high: float
    low: float | None

    def __post_init__(self) -> None:
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(f"unknown correction level {self.level!r}; use {CORRECTION_LEVELS}")
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"unknown correction mode {self.mode!r}; use {CORRECTION_MODES}")
        if not self.high > 0:
            raise ValueError(f"the upper bound must be > 0; got {self.high}")
        if self.low is not None:
            if self.mode != "mask":
                raise ValueError("a lower bound applies only to mask mode (truncate clips above)")
            if not 0 <= self.low < self.high:
                raise ValueError(f"need 0 <= low < high; got low={self.low}, high={self.high}")

    @property
    def lower(self) -> float:
        """The mask's lower bound: ``low``, or 1 / ``high``."""
        return 1.0 / self.high if self.low is None else self.low


def correction_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    correction: RolloutCorrection,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token weight w ``[B, T]`` of the module docstring, detached, 0 where m = 0.

    Returns ``(w, stats)``; stats are ``[B, T]``, 0 at masked positions: ``ratio`` (ρ)
    and ``truncated`` (1 where ρ > high, truncate mode) or ``masked`` (1 where ρ is
    outside [low, high], mask mode).
    """
    if not old_logp.shape == rollout_logp.shape == mask.shape or old_logp.dim() != 2:
        raise ValueError(
            "old_logp, rollout_logp and mask must all be [B, T]; got "
            f"{tuple(old_logp.shape)}, {tuple(rollout_logp.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
    # where, not ·m: a NaN or inf at a padded position must not reach a sequence's sum.
    delta = torch.where(valid, old_logp.detach() - rollout_logp.detach().to(old_logp.dtype), zero)
    if correction.level != "token":
        total = delta.sum(dim=1, keepdim=True)
        if correction.level == "geometric":
            total = total / valid.sum(dim=1, keepdim=True).clamp(min=1).to(delta.dtype)
        delta = total.expand_as(delta)
    ratio = torch.exp(delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if correction.mode == "truncate":
        weight = ratio.clamp(max=correction.high)
        flag = ("truncated", ratio > correction.high)
    else:
        outside = (ratio < correction.lower) | (ratio > correction.high)
        weight = torch.where(outside, zero, ratio)
        flag = ("masked", outside)
    stats = {"ratio": ratio, flag[0]: flag[1].to(ratio.dtype)}
    return torch.where(valid, weight, zero), {
        k: torch.where(valid, v, zero) for k, v in stats.items()
    }
