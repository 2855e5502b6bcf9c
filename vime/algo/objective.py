"""The training objective of one micro-batch, shared by every backend.

Where it fits: a backend forwards a packed row, turns logits into per-sample
``[B, T]`` log-probs (``vime.data.micro_batch.response_log_probs``) and calls
``micro_batch_loss``; everything after the logits is here, so the fsdp2 and
megatron backends compute the same number from the same log-probs.

Per token, with m the loss mask:

    ℓ = w · policy_loss(logp, old_logp, A) + kl_coef · kl(logp, ref_logp) − entropy_coef · H

with w the rollout correction's weight (``vime.algo.correction``; 1 when off),
a constant (no gradient flows through it). With GSPO (``--policy-loss-level
sequence``) and token-level weights wₜ each token keeps its own: the gradient with
respect to logpₜ is wₜ · ∂Lᵢ/∂logpₜ, Lᵢ the sequence's uncorrected loss, not the
gradient of Lᵢ · mean(w) (every token weighted by mean(w)), though the two losses
have the same value; ``--tis-level sequence`` or ``geometric`` gives a sequence one
weight, and then they agree. The micro-batch loss is ``aggregate_loss(ℓ, m, mode, **step
normalizers)`` (plus Dr. GRPO's constant ``norm_len``). Because the normalizers are the
optimizer step's global counts, summing these losses over micro-batches and
data-parallel ranks gives the step's loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vime.algo.aggregation import aggregate_loss
from vime.algo.correction import RolloutCorrection, correction_weights
from vime.algo.custom import load_function
from vime.algo.losses import kl_penalty, policy_loss
from vime.algo.metrics import MetricAccumulator


@dataclass(frozen=True)
class LossConfig:
    """The loss settings of a run, built once from the parsed flags by
    ``vime.config.train_settings.loss_settings``.

    ``correction`` is the rollout correction (``--use-tis``; None: off); ``norm_len``
    the constant length of ``seq-mean-token-sum-norm`` (Dr. GRPO). ``policy_loss_path``
    is the ``--custom-loss-function-path`` that ``policy_loss_fn`` was loaded from: a
    copy pickled to another process (a training rank) imports it there again by that
    spec, as a function of a module loaded from a file pickles by a name no other
    process could import. No field has a default: the flags' are the only ones
    (``vime.config.algo_flags``).
    """

    eps_clip: float
    eps_clip_high: float | None
    eps_clip_c: float | None
    level: str
    correction: RolloutCorrection | None
    use_kl: bool
    kl_coef: float
    kl_type: str
    entropy_coef: float
    agg_mode: str
    norm_len: int | None
    policy_loss_fn: Callable[..., Any] = field(compare=False)
    policy_loss_path: str | None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.policy_loss_path is not None:
            del state["policy_loss_fn"]  # imported again by its spec (__setstate__)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "policy_loss_fn" not in state:
            loaded = load_function(state["policy_loss_path"], expected=policy_loss)
            state = {**state, "policy_loss_fn": loaded}
        self.__dict__.update(state)


@dataclass(frozen=True)
class Normalizers:
    """The optimizer step's global loss normalizers (from ``vime.data.packing.StepPlan``)."""

    num_tokens: int
    num_samples: int


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

    ``old_logp`` None means π_old = π, this forward's own log-probs detached: the
    proximal policy of decoupled PPO is the trainer's weights before the update, and
    with one update per rollout those are the weights of this forward, however old the
    samples (the engine's log-probs, their behaviour policy, enter only through
    ``config.correction``). The ratio is then exactly 1. ``rollout_logp`` (the
    engine's) is required when ``config.correction`` is set. ``entropy`` is needed when
    ``config.entropy_coef`` > 0 (with grad) and is reported whenever given. Every metric
    name is added on every call, so all ranks reduce the same layout.
    """
    old = logp.detach() if old_logp is None else old_logp
    per_token, stats = config.policy_loss_fn(
        logp,
        old,
        advantages,
        mask,
        eps_clip=config.eps_clip,
        eps_clip_high=config.eps_clip_high,
        eps_clip_c=config.eps_clip_c,
        level=config.level,
    )
    metrics = MetricAccumulator()
    if config.correction is not None:
        weight = _correction_weight(old, rollout_logp, mask, config.correction, metrics)
        per_token = per_token * weight
    metrics.add_tokens("pg_loss", per_token.detach(), mask)
    total = _with_penalties(per_token, logp, mask, config, metrics, ref_logp, entropy)
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
        norm_len=config.norm_len,
    )
    return loss, metrics


def _correction_weight(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    mask: torch.Tensor,
    correction: RolloutCorrection,
    metrics: MetricAccumulator,
) -> torch.Tensor:
    """The rollout correction's per-token weight w (``vime.algo.correction``), its
    statistics added to ``metrics``: mean w, mean and max ratio, truncated/masked share."""
    if rollout_logp is None:
        raise ValueError(
            "--use-tis needs the rollout engine's log-probs, and this batch carries none"
        )
    weight, stats = correction_weights(old_logp, rollout_logp, mask, correction)
    metrics.add_tokens("tis_weight_mean", weight, mask)
    metrics.add_tokens("tis_ratio_mean", stats["ratio"], mask)
    metrics.add_max("tis_ratio_max", stats["ratio"], mask)
    flag = "truncated" if correction.mode == "truncate" else "masked"
    metrics.add_tokens(f"tis_{flag}_frac", stats[flag], mask)
    return weight


def _with_penalties(
    per_token: torch.Tensor,
    logp: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    metrics: MetricAccumulator,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> torch.Tensor:
    """ℓ = pg + kl_coef · kl(logp, ref_logp) − entropy_coef · H, each term only when on.

    Adds ``kl_loss`` to ``metrics`` (0 when KL is off) and ``entropy`` when given.
    """
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
    return total
