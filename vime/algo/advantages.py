"""Group-relative advantage estimators: per-sample rewards ``[N]`` -> advantages ``[N]``.

Where it fits: the RolloutManager calls :func:`compute_advantages` once per
rollout step, after scoring, on the rewards of all ``N = prompts × n`` samples.
The ``n`` samples of one prompt are contiguous (rows ``[g·n, (g+1)·n)`` form
group ``g``). The result is one scalar per sample; the loss broadcasts it over
the sample's response tokens.

A custom estimator given with ``--custom-advantage-function-path`` must have
this same signature.
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus_baseline",
)


def compute_advantages(
    rewards: torch.Tensor,
    n_samples_per_prompt: int,
    estimator: str = "grpo",
    eps: float = 1e-6,
    *,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages of ``N`` samples in contiguous groups of ``n = n_samples_per_prompt``.

    With rᵢ the reward of sample i, ḡ its group's mean and σ_g the group's
    Bessel-corrected standard deviation (Σ (r − ḡ)² / (n − 1)):

    - ``grpo``:    Aᵢ = (rᵢ − ḡ) / (σ_g + eps)
    - ``dr_grpo``: Aᵢ = rᵢ − ḡ                       (Dr. GRPO: no std division)
    - ``rloo``:    Aᵢ = rᵢ − (1/(n−1)) Σ_{j≠i} rⱼ  =  n/(n−1) · (rᵢ − ḡ)
    - ``reinforce_plus_plus_baseline``: xᵢ = rᵢ − ḡ, then whitened over the
      whole batch: Aᵢ = (xᵢ − x̄) / (σ_x + eps), σ_x Bessel-corrected over N.

    Exact zeros, never NaN: a group whose rewards are all equal (including a
    group of one) carries no learning signal, so every estimator gives exactly
    0 there rather than a rounding residue or 0/0. Likewise the whitening of
    ``reinforce_plus_plus_baseline`` gives 0 when all xᵢ are equal or N = 1.

    ``valid`` (``[N]`` bool, optional) leaves samples out, e.g. those whose reward
    failed: each such sample gets exactly 0, and every other sample gets what it
    would get if its group held only the valid samples (n becomes the group's
    valid count n_g in σ_g and in rloo's factor; the whitening of
    ``reinforce_plus_plus_baseline`` runs over the valid samples only). A group
    with fewer than two valid samples carries no signal: zeros.

    Computed in float64; returned in the dtype of ``rewards`` (the default
    float dtype if ``rewards`` is an integer or bool tensor).
    """
    _check_arguments(rewards, n_samples_per_prompt, estimator, valid)
    n = n_samples_per_prompt
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    if valid is not None and not bool(valid.all()):
        return _without_invalid(rewards, n, estimator, eps, valid.bool()).to(out_dtype)
    groups = rewards.detach().to(torch.float64).view(-1, n)
    if estimator == "reinforce_plus_plus_baseline":
        centered = _group_advantages(groups, "dr_grpo", eps).flatten()
        return _whiten(centered, eps).to(out_dtype)
    return _group_advantages(groups, estimator, eps).flatten().to(out_dtype)


def _check_arguments(
    rewards: torch.Tensor, n: int, estimator: str, valid: torch.Tensor | None
) -> None:
    """ValueError unless ``compute_advantages`` can take these: a known estimator, 1-D
    rewards of whole groups of ``n``, and ``valid`` (if given) of the rewards' shape."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; choose from {ADVANTAGE_ESTIMATORS}"
        )
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N]; got shape {tuple(rewards.shape)}")
    num = rewards.shape[0]
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"n_samples_per_prompt must be a positive int; got {n!r}")
    if num % n != 0:
        raise ValueError(
            f"n_samples_per_prompt={n} does not divide the number of rewards N={num}; "
            "rewards must hold whole groups of contiguous samples per prompt"
        )
    if valid is not None and valid.shape != rewards.shape:
        raise ValueError(
            f"valid must have the shape of rewards {tuple(rewards.shape)}; got {tuple(valid.shape)}"
        )


def _group_advantages(groups: torch.Tensor, estimator: str, eps: float) -> torch.Tensor:
    """``grpo``, ``dr_grpo`` or ``rloo`` advantages of float64 ``groups`` ``[G, n]``, one
    group a row: (r − ḡ) / (σ_g + eps), r − ḡ, or n/(n−1) · (r − ḡ); exact zeros in a
    group whose rewards are all equal."""
    n = groups.shape[1]
    # A group with max == min gets exact zeros below; the rounding of a float
    # mean (e.g. 3·0.1 / 3 != 0.1) would otherwise leave ±1e-17 residues that
    # grpo's division by (0 + eps) blows up to ±1e-11.
    flat = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        # n == 1 is always `flat`; unbiased std of one value is NaN, so use
        # correction only when n > 1.
        std = groups.std(dim=1, keepdim=True, correction=1 if n > 1 else 0)
        adv = centered / (std + eps)
    elif estimator == "dr_grpo":
        adv = centered
    else:  # rloo
        adv = centered * (n / (n - 1)) if n > 1 else centered
    return torch.where(flat, torch.zeros_like(adv), adv)


def _whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x − x̄) / (σ_x + eps) over all of 1-D ``x``, σ_x Bessel-corrected; exact zeros
    when all xᵢ are equal or there is only one (``reinforce_plus_plus_baseline``)."""
    if x.numel() > 1 and bool(x.amax() != x.amin()):
        return (x - x.mean()) / (x.std(correction=1) + eps)
    return torch.zeros_like(x)


def _without_invalid(
    rewards: torch.Tensor, n: int, estimator: str, eps: float, valid: torch.Tensor
) -> torch.Tensor:
    """``compute_advantages`` with the samples ``~valid`` taken out of their groups.

    Each group's valid samples go through the unmasked estimator as a group of
    their own, so their advantages are bit for bit those of that smaller group;
    ``reinforce_plus_plus_baseline`` centres per group the same way (its
    ``dr_grpo`` step) and whitens over the valid samples of the whole batch.
    """
    values = rewards.detach().to(torch.float64).view(-1, n)
    keep = valid.view(-1, n)
    out = torch.zeros_like(values)
    per_group = "dr_grpo" if estimator == "reinforce_plus_plus_baseline" else estimator
    for g in range(values.shape[0]):
        if int(keep[g].sum()) >= 2:
            kept = values[g][keep[g]]
            out[g, keep[g]] = compute_advantages(kept, kept.numel(), per_group, eps)
    out = out.flatten()
    if estimator == "reinforce_plus_plus_baseline":
        out[valid] = _whiten(out[valid], eps)
    return out
