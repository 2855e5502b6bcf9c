"""The training objective of one micro-batch, shared by every backend.

Where it fits: a backend forwards a packed row, turns logits into per-sample
``[B, T]`` log-probs (``vime.data.micro_batch.response_log_probs``) and calls
``micro_batch_loss``; everything after the logits is here, so the fsdp2 and
megatron backends compute the same number from the same log-probs.

Per token, with m the loss mask:

    ℓ = policy_loss(logp, old_logp, A) + kl_coef · kl(logp, ref_logp) − entropy_coef · H

and the micro-batch loss is ``aggregate_loss(ℓ, m, mode, **step normalizers)``.
Because the normalizers are the optimizer step's global counts, summing these
losses over micro-batches and data-parallel ranks gives the step's loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vime.algo.aggregation import aggregate_loss
from vime.algo.losses import kl_penalty, policy_loss
from vime.algo.metrics import MetricAccumulator


@dataclass(frozen=True)
class LossConfig:
    """The loss settings of a run (read from the parsed flags by ``from_args``)."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    level: str = "token"
    use_tis: bool = False
    tis_clip: float = 2.0
    use_kl: bool = False
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    agg_mode: str = "token-mean"
    policy_loss_fn: Callable[..., Any] = field(default=policy_loss, compare=False)

    @classmethod
    def from_args(cls, args: Any, policy_loss_fn: Callable[..., Any] = policy_loss) -> LossConfig:
        return cls(
            eps_clip=args.eps_clip,
            eps_clip_high=args.eps_clip_high,
            eps_clip_c=args.eps_clip_c,
            level=args.policy_loss_level,
            use_tis=args.use_tis,
            tis_clip=args.tis_clip,
            use_kl=args.use_kl_loss,
            kl_coef=args.kl_loss_coef,
            kl_type=args.kl_loss_type or "low_var_kl",
            entropy_coef=args.entropy_coef,
            agg_mode=args.loss_agg_mode,
            policy_loss_fn=policy_loss_fn,
        )


@dataclass(frozen=True)
class Normalizers:
    """The optimizer step's global loss normalizers (from ``vime.data.packing.StepPlan``)."""

    num_tokens: int
    num_samples: int
    max_response_len: int


def micro_batch_loss(
    logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    norm: Normalizers,
    config: LossConfig,
    *,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MetricAccumulator]:
    """Loss of one micro-batch (to backpropagate as is) and its token-weighted metrics.

    ``old_logp`` None means π_old = π (one update per rollout): the ratio is
    then exactly 1. ``entropy`` is needed when ``config.entropy_coef`` > 0
    (with grad) and is reported whenever given. Every metric name is added on
    every call, so all ranks reduce the same layout.
    """
    old = logp.detach() if old_logp is None else old_logp
    tis = config.use_tis and rollout_logp is not None
    per_token, stats = config.policy_loss_fn(
        logp,
        old,
        advantages,
        mask,
        eps_clip=config.eps_clip,
        eps_clip_high=config.eps_clip_high,
        eps_clip_c=config.eps_clip_c,
        level=config.level,
        rollout_logp=rollout_logp if tis else None,
        tis_clip=config.tis_clip if tis else None,
    )
    metrics = MetricAccumulator()
    metrics.add_tokens("pg_loss", per_token.detach(), mask)
    total = per_token
    if config.use_kl:
        if ref_logp is None:
            raise ValueError("KL loss is on but no reference log-probs were given")
        kl = kl_penalty(logp, ref_logp, config.kl_type, mask=mask)
        total = total + config.kl_coef * kl
        metrics.add_tokens("kl_loss", kl.detach(), mask)
    else:  # logged as 0 so every run's metrics have the same columns
        metrics.add_tokens("kl_loss", torch.zeros_like(logp), mask)
    if config.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        total = total - config.entropy_coef * entropy
    if entropy is not None:
        metrics.add_tokens("entropy", entropy.detach(), mask)
    for name in ("clipfrac", "ppo_kl"):
        metrics.add_tokens(name, stats[name], mask)
    if rollout_logp is not None:
        diff = (logp.detach() - rollout_logp).abs()
        metrics.add_tokens("train_rollout_logprob_abs_diff", diff, mask)
    loss = aggregate_loss(
        total,
        mask,
        config.agg_mode,
        num_tokens=norm.num_tokens,
        num_seqs=norm.num_samples,
        max_len=norm.max_response_len,
    )
    return loss, metrics
