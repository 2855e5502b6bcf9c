"""Memory-bounded, numerically stable entropy of categorical distributions given by logits.

Where it fits: the entropy bonus / entropy metric of the policy loss. It runs on
the gathered response logits ``[N_response, V]`` (see
``vime.data.micro_batch.response_log_probs``), where V is a full vocabulary
(~150k), so a naive ``softmax`` + ``log_softmax`` over all rows at once would
hold several ``[N, V]`` float32 copies beyond the logits themselves.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy H = −Σⱼ pⱼ log pⱼ of softmax(logits) over the last dim; shape ``logits.shape[:-1]``.

    Computed per row as, with m = maxⱼ zⱼ and sⱼ = zⱼ − m (so exp never overflows,
    even for logits offset by 1e4),

        H = log Σⱼ exp(sⱼ) − Σⱼ exp(sⱼ)·sⱼ / Σⱼ exp(sⱼ)

    and its gradient ∂H/∂zⱼ = −pⱼ (log pⱼ + H). Rows are processed ``chunk_size``
    at a time in forward, and backward *recomputes* p per chunk from the saved
    logits and two per-row values (m, log Σ exp s), so memory beyond the input
    and its gradient is a couple of ``[chunk_size, V]`` temporaries, never
    ``[N, V]``. Low-precision logits (bf16/fp16) are upcast per chunk and the
    entropy is returned in float32; float64 stays float64. ``-inf`` logits
    (masked vocabulary entries) contribute zero; a row of only ``-inf`` has entropy 0
    and gradient 0. First-order differentiable only.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"logits need a non-empty last (vocabulary) dim; got {tuple(logits.shape)}"
        )
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedEntropy.apply(flat, chunk_size).view(logits.shape[:-1])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _shifted_chunk(chunk: torch.Tensor, row_max: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``chunk − row_max`` in a fresh ``dtype`` buffer, with −inf clamped so 0·s stays 0."""
    shifted = chunk.to(dtype, copy=True).sub_(row_max.unsqueeze(-1))
    return shifted.clamp_(min=torch.finfo(dtype).min)


def _entropy_chunk(
    chunk: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, log Σⱼ exp(sⱼ), H)`` per row of one ``[c, V]`` chunk (see ``entropy_from_logits``)."""
    # An all -inf row (every entry masked) has max -inf and -inf - -inf is NaN: a finite
    # max leaves every s at finfo.min, so its weights are 0.
    row_max = chunk.amax(dim=-1).to(dtype).clamp_(min=torch.finfo(dtype).min)
    shifted = _shifted_chunk(chunk, row_max, dtype)
    weights = shifted.exp()
    # Any other row's max has weight exp(0) = 1, so this changes only an all -inf row:
    # log 1 - 0 / 1 makes its entropy 0 (and, in backward, its p and gradient 0).
    norm = weights.sum(dim=-1).clamp_(min=1.0)
    # Σ exp(s)·s as a batched dot product: no third [chunk, V] buffer.
    weighted = torch.bmm(weights.unsqueeze(1), shifted.unsqueeze(2)).view(-1)
    log_norm = norm.log()
    return row_max, log_norm, log_norm - weighted / norm


def entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """Entropy per row of ``[c, V]`` logits, no autograd: the forward of
    ``entropy_from_logits`` for one chunk, for callers that hold one chunk at a time
    (``vime.algo.head_log_probs``)."""
    return _entropy_chunk(logits, _compute_dtype(logits.dtype))[2]


class _ChunkedEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
        dtype = _compute_dtype(logits.dtype)
        rows = logits.shape[0]
        entropy = torch.empty(rows, dtype=dtype, device=logits.device)
        row_max = torch.empty(rows, dtype=dtype, device=logits.device)
        log_norm = torch.empty(rows, dtype=dtype, device=logits.device)
        for start in range(0, rows, chunk_size):
            sl = slice(start, start + chunk_size)
            row_max[sl], log_norm[sl], entropy[sl] = _entropy_chunk(logits[sl], dtype)
        ctx.save_for_backward(logits, row_max, log_norm, entropy)
        ctx.chunk_size = chunk_size
        return entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_entropy: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, row_max, log_norm, entropy = ctx.saved_tensors
        dtype = row_max.dtype
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            log_p = _shifted_chunk(logits[sl], row_max[sl], dtype).sub_(log_norm[sl].unsqueeze(-1))
            p = log_p.exp()
            # ∂H/∂z = −p (log p + H), times the incoming gradient; all in place on log_p.
            log_p.add_(entropy[sl].unsqueeze(-1)).mul_(p).mul_(-grad_entropy[sl].unsqueeze(-1))
            grad[sl] = log_p
            del log_p, p
        return grad, None
