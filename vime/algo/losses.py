"""Per-token policy-gradient loss (PPO clip, dual clip, GSPO) and KL penalties.

Where it fits: a backend's micro-batch step gathers, for each response token,
the trainer log-prob ``logp`` (with grad), the old-policy log-prob
``old_logp``, optionally the reference ``ref_logp``, plus the 0/1 response ``mask``, all
``[B, T]``. It calls
:func:`policy_loss` (and :func:`kl_penalty` when KL is on), adds the terms per
token, and reduces them with :func:`vime.algo.aggregation.aggregate_loss`
using the optimizer step's global normalizers. Nothing here aggregates, so
the same code serves every aggregation mode and every micro-batch geometry.
The rollout correction (TIS and its relatives) is a weight on this loss:
``vime.algo.correction``.

A custom loss given with ``--custom-loss-function-path`` must have the same
signature as :func:`policy_loss`.
"""

from __future__ import annotations

import torch

KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
POLICY_LOSS_LEVELS: tuple[str, ...] = ("token", "sequence")

# Log-ratios are clamped to ±MAX_LOG_RATIO before exp so a ratio can never
# overflow to inf (inf·0 in a backward gives NaN). e^20 ≈ 4.9e8: any token
# that far off-policy is already clipped or dominates the step anyway.
MAX_LOG_RATIO = 20.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss per token, ``[B, T]``, not aggregated.

    Inputs are ``[B, T]`` with a 0/1 ``mask``; ``advantages`` A is ``[B]``
    (broadcast over the sequence) or ``[B, T]``. With m the mask,
    ε_lo = ``eps_clip``, ε_hi = ``eps_clip_high`` (default ε_lo), and
    clip(r) = min(max(r, 1 − ε_lo), 1 + ε_hi):

    - ratio, ``level="token"`` (PPO):  rₜ = exp(logpₜ − old_logpₜ)
    - ratio, ``level="sequence"`` (GSPO, see :func:`_sequence_ratio`), nᵢ = Σₜ mᵢₜ:
      rᵢₜ = sg(sᵢ) · exp(logpᵢₜ − sg(logpᵢₜ)),  sᵢ = exp(Σₜ mᵢₜ (logpᵢₜ − old_logpᵢₜ) / nᵢ)
    - loss per token (both levels):  ℓ = max(−A·r, −A·clip(r))
    - dual clip (only with ``eps_clip_c`` = c > 1), for A < 0:  ℓ = min(ℓ, −A·c)

    Masked positions (m = 0) give ℓ = 0 and zero gradient even when the
    log-probs or advantages there are NaN/inf. Log-ratios are clamped to
    ±20 before exp, so ratios stay finite.

    Returns ``(loss [B, T], metrics)`` where metrics are detached ``[B, T]``
    tensors, zero at masked positions:

    - ``clipfrac``: 1 where the clipped branch is strictly larger, −A·clip(r) > −A·r
    - ``ppo_kl``: old_logp − logp (GSPO: −log sᵢ, broadcast over the sequence)
    - ``ratio``: r (GSPO: sᵢ)
    - ``dual_clipfrac`` (dual clip only): 1 where A < 0 and max(−A·r, −A·clip(r)) > −A·c

    On the first update of a rollout (logp == old_logp) r is exactly 1,
    ppo_kl exactly 0 and clipfrac 0, at both levels.
    """
    advantages, eps_high = _checked_inputs(
        logp, old_logp, advantages, mask, eps_clip, eps_clip_high, eps_clip_c, level
    )
    valid = mask.bool()
    logp = _masked(logp, valid)
    log_ratio = logp - _masked(old_logp.detach(), valid)
    adv = _masked(advantages.detach(), valid)
    if level == "token":
        ratio, ppo_kl = _token_ratio(log_ratio)
    else:
        ratio, ppo_kl = _sequence_ratio(logp, log_ratio, valid)

    loss, clipfrac = _clipped_loss(adv, ratio, eps_clip, eps_high)
    metrics = {"clipfrac": clipfrac.to(logp.dtype), "ppo_kl": ppo_kl, "ratio": ratio.detach()}
    if eps_clip_c is not None:
        loss, dual = _dual_clipped_loss(loss, adv, eps_clip_c)
        metrics["dual_clipfrac"] = dual.to(logp.dtype)
    # The loss is already 0 at masked positions (A was zeroed there, so every
    # branch is 0); metrics such as ratio are not, hence the mask.
    return loss, {k: _masked(v.detach(), valid) for k, v in metrics.items()}


def _checked_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None,
    eps_clip_c: float | None,
    level: str,
) -> tuple[torch.Tensor, float]:
    """``policy_loss``'s arguments checked: the advantages broadcast to ``[B, T]`` and
    ε_hi (``eps_clip_high``, or ``eps_clip`` when None); ValueError on any misfit."""
    if logp.dim() != 2 or logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            "logp, old_logp and mask must all be [B, T]; got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        advantages = advantages.unsqueeze(1).expand_as(logp)
    elif advantages.shape != logp.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] matching logp {tuple(logp.shape)}; "
            f"got {tuple(advantages.shape)}"
        )
    if level not in POLICY_LOSS_LEVELS:
        raise ValueError(f"unknown policy loss level {level!r}; choose from {POLICY_LOSS_LEVELS}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if not 0.0 < eps_clip < 1.0 or eps_high <= 0.0:
        raise ValueError(
            f"need 0 < eps_clip < 1 and eps_clip_high > 0; got eps_clip={eps_clip}, "
            f"eps_clip_high={eps_clip_high}"
        )
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(f"dual-clip eps_clip_c must be > 1; got {eps_clip_c}")
    return advantages, eps_high


def _masked(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x`` where ``valid``, else 0 (in x's dtype).

    torch.where, not x · mask, so NaN/inf at padded positions leaks neither into
    the value nor into the gradient.
    """
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _token_ratio(log_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token ratio rₜ = exp(logpₜ − old_logpₜ) and ppo_kl = −log rₜ (detached),
    from the log-ratio ``logp − old_logp``."""
    ppo_kl = -log_ratio.detach()
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)), ppo_kl


def _sequence_ratio(
    logp: torch.Tensor, log_ratio: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO's ratio rᵢₜ = sg(sᵢ) · exp(logpᵢₜ − sg(logpᵢₜ)) and ppo_kl = −log sᵢ, both ``[B, T]``.

    With nᵢ = Σₜ mᵢₜ, sᵢ = exp( Σₜ mᵢₜ (logpᵢₜ − old_logpᵢₜ) / nᵢ ) (``log_ratio`` is 0
    at masked positions). The value of rᵢₜ is sᵢ and ∂rᵢₜ/∂logpᵢₜ = sᵢ, so under the
    ``seq-mean-token-mean`` aggregation the loss and its gradient are exactly
    those of GSPO's sequence objective  Lᵢ = max(−Aᵢ sᵢ, −Aᵢ clip(sᵢ)):
    ∂Lᵢ/∂logpᵢₜ = −Aᵢ sᵢ / nᵢ when unclipped. (Under ``seq-mean-token-sum``
    each sequence would count nᵢ times.)
    """
    n_tok = valid.sum(dim=1, keepdim=True).clamp(min=1).to(logp.dtype)
    seq_log_ratio = (log_ratio.sum(dim=1, keepdim=True) / n_tok).detach()
    ppo_kl = (-seq_log_ratio).expand_as(logp)
    # logp − sg(logp) is exactly 0 in value, so ratio == sᵢ bit for bit,
    # while its gradient w.r.t. logpₜ is sᵢ.
    seq_log_ratio = seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(seq_log_ratio + logp - logp.detach()), ppo_kl


def _clipped_loss(
    adv: torch.Tensor, ratio: torch.Tensor, eps_lo: float, eps_hi: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ = max(−A·r, −A·clip(r)) per token, and where the clipped branch is strictly
    larger (bool, the clip fraction's numerator)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_lo, 1.0 + eps_hi)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _dual_clipped_loss(
    loss: torch.Tensor, adv: torch.Tensor, eps_c: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual clip: ℓ = min(ℓ, −A·c) where A < 0, and where that cap applies (bool)."""
    cap = -adv * eps_c
    dual = (adv < 0) & (loss > cap)
    return torch.where(dual, cap, loss), dual


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str,
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference, elementwise.

    With δ = logp − ref_logp (samples drawn from the policy):

    - ``k1``:         δ
    - ``k2``:         ½ δ²
    - ``k3``:         exp(−δ) + δ − 1        ( = exp(ref − logp) − (ref − logp) − 1 )
    - ``low_var_kl``: clamp(k3, −10, 10)     (δ is first clamped to ±20, which
      changes no value: k3 already exceeds 10 there)

    Gradients flow into ``logp`` (and ``ref_logp`` if it requires grad). Not
    aggregated; add it to the policy loss per token and reduce with
    ``aggregate_loss``. With ``mask`` given, masked positions are exactly 0 and
    get zero gradient even if the log-probs there are NaN/inf.
    """
    if kind not in KL_TYPES:
        raise ValueError(f"unknown KL type {kind!r}; choose from {KL_TYPES}")
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp and ref_logp shapes differ: {tuple(logp.shape)} vs {tuple(ref_logp.shape)}"
        )
    if mask is not None:
        valid = mask.bool()
        logp = torch.where(valid, logp, torch.zeros_like(logp))
        ref_logp = torch.where(valid, ref_logp, torch.zeros_like(ref_logp))
    delta = logp - ref_logp
    if kind == "k1":
        kl = delta
    elif kind == "k2":
        kl = 0.5 * delta.square()
    elif kind == "k3":
        kl = torch.exp(-delta) + delta - 1.0
    else:
        delta = delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl = (torch.exp(-delta) + delta - 1.0).clamp(-10.0, 10.0)
    if mask is not None:
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return kl
