"""Loss aggregation: per-token values ``[B, T]`` -> one scalar.

Where it fits: the last step of every loss. The trainer calls it once per
micro-batch with the *step's* global normalizers (``num_tokens``, ``num_seqs``
from the planner) and the run's constant ``norm_len``, so summing the
micro-batch losses over micro-batches and data-parallel ranks gives exactly the
loss of the whole optimizer step, whatever the micro-batch geometry or DP size.
"""

from __future__ import annotations

from typing import Literal

import torch

AggregationMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: float | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` ``[B, T]`` under a 0/1 ``mask`` to a scalar.

    With v the values, m the mask and nᵢ = Σₜ mᵢₜ the tokens of sequence i:

    - ``token-mean``:              Σ v·m / num_tokens          (num_tokens defaults to Σ m)
    - ``seq-mean-token-mean``:     Σᵢ (Σₜ vᵢₜ·mᵢₜ / nᵢ) / num_seqs
    - ``seq-mean-token-sum``:      Σᵢ Σₜ vᵢₜ·mᵢₜ / num_seqs
    - ``seq-mean-token-sum-norm``: Σ v·m / (num_seqs · norm_len)  (Dr. GRPO)

    Dr. GRPO's ``norm_len`` is a constant of the run, the generation budget (the
    trainer passes ``--loss-agg-norm-len``, by default ``--rollout-max-response-len``),
    so the loss scale does not move with each batch's longest response. ``num_seqs``
    defaults to the number of sequences with nᵢ > 0 and ``norm_len`` to T. Empty
    sequences contribute nothing; an all-empty batch gives 0 (with a gradient path,
    so a backward over it is still valid). Values where m = 0 are never read, so
    NaN/inf there changes neither the loss nor the gradient.
    """
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"values and mask must both be [B, T]; got {tuple(values.shape)} and "
            f"{tuple(mask.shape)}"
        )
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose from {AGGREGATION_MODES}")
    # where, not values · mask: a custom loss (--custom-loss-function-path) may leave
    # NaN/inf where the mask is 0 (say 0/0 on an empty sequence), and NaN · 0 is NaN.
    masked = torch.where(mask.bool(), values, values.new_zeros(()))
    mask = mask.to(values.dtype)
    tokens_per_seq = mask.sum(dim=1)
    if num_seqs is None:
        num_seqs = float((tokens_per_seq > 0).sum().item())
    if mode == "token-mean":
        denom = float(mask.sum().item()) if num_tokens is None else float(num_tokens)
        return masked.sum() / max(denom, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / tokens_per_seq.clamp(min=1.0)
        return per_seq.sum() / max(float(num_seqs), 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(float(num_seqs), 1.0)
    length = float(values.shape[1]) if norm_len is None else float(norm_len)
    return masked.sum() / max(float(num_seqs) * length, 1.0)
