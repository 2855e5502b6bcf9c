"""Per-token log-probs (and entropy) straight from hidden states and the LM head weight.

Where it fits: the log-prob tail of a training forward. A backend hands the final
hidden states of the positions whose log-prob the loss reads (the response
positions of a packed row, gathered by
``vime.data.micro_batch.response_log_probs_from_hidden``) and the LM head weight
to ``head_log_probs``; the ``[tokens, vocab]`` logits (Qwen: 152k columns) are
never materialised whole, neither in forward nor in backward. For row i with
hidden hᵢ, head W (``[V, h]``, the embedding itself when tied) and temperature τ:

    zᵢ = (W hᵢ) / τ                     logits, upcast to float32 before dividing
    lseᵢ = log Σⱼ exp(zᵢⱼ)
    log pᵢ[yᵢ] = zᵢ[yᵢ] − lseᵢ           (yᵢ the target token)
    Hᵢ = lseᵢ − Σⱼ pᵢⱼ zᵢⱼ               (entropy, only when asked)

Rows go ``chunk_size`` at a time: forward keeps per row only lse (and H), and
backward recomputes each chunk's logits, so at most a few ``[chunk, V]`` float32
buffers exist at once. With g = ∂ℓ/∂log p and e = ∂ℓ/∂H,

    ∂ℓ/∂zᵢⱼ = gᵢ (1[j = yᵢ] − pᵢⱼ) − eᵢ pᵢⱼ (log pᵢⱼ + Hᵢ)
    ∂ℓ/∂hᵢ = Σⱼ (∂ℓ/∂zᵢⱼ / τ) Wⱼ          ∂ℓ/∂W = Σᵢ (∂ℓ/∂zᵢ / τ) ⊗ hᵢ

The logits' gradient is cast to the logits' dtype before the two matmuls, as
autograd does through ``.float()``; ∂ℓ/∂W sums over chunks in float32 at least.
The same math as ``micro_batch.full_vocab_token_stats`` on the gathered logits,
up to the summation order of the weight gradient.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from vime.algo.entropy import entropy_rows

# Float32 logits a chunk may hold: 2²⁶ elements = 256 MiB (Qwen's 152k vocabulary: 441 rows).
CHUNK_ELEMENTS = 1 << 26


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk so that one ``[rows, vocab]`` float32 buffer is ``CHUNK_ELEMENTS``."""
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def head_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log p[target] [n], entropy [n] or None)`` of softmax((weight @ hidden) / temperature).

    ``hidden`` is ``[n, h]``, ``weight`` ``[V, h]``, ``targets`` ``[n]`` ids < V. Results are
    float32 (float64 for float64 inputs). Differentiable w.r.t. ``hidden`` and ``weight``
    (first order); see the module docstring for the math and the memory bound.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [n, h] and weight [V, h] expected; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} for {hidden.shape[0]} rows")
    rows = chunk_size if chunk_size is not None else default_chunk_rows(weight.shape[0])
    if rows < 1:
        raise ValueError(f"chunk_size must be >= 1, got {rows}")
    logp, entropy = _HeadLogProbs.apply(hidden, weight, targets, temperature, rows, with_entropy)
    return logp, entropy if with_entropy else None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's tempered logits ``[c, V]``, float32 at least (as the unfused path)."""
    logits = hidden @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits / temperature if temperature != 1.0 else logits


class _HeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, rows, with_entropy):
        dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        for start in range(0, n, rows):
            sl = slice(start, start + rows)
            z = _logits(hidden[sl], weight, temperature)
            lse[sl] = torch.logsumexp(z, dim=-1)
            logp[sl] = z.gather(-1, targets[sl].unsqueeze(-1)).squeeze(-1) - lse[sl]
            if with_entropy:
                entropy[sl] = entropy_rows(z)
            del z
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_weight else None
        if grad_logp is None and grad_entropy is None:
            return grad_hidden, _cast(grad_weight, weight), None, None, None, None
        for start in range(0, hidden.shape[0], ctx.rows):
            sl = slice(start, start + ctx.rows)
            grad_z = _logits_grad(
                _logits(hidden[sl], weight, ctx.temperature),
                lse[sl],
                targets[sl],
                None if grad_logp is None else grad_logp[sl],
                None if grad_entropy is None else (grad_entropy[sl], entropy[sl]),
            )
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            grad_z = grad_z.to(hidden.dtype)
            if need_hidden:
                grad_hidden[sl] = grad_z @ weight
            if need_weight:
                grad_weight.addmm_(grad_z.t().to(acc), hidden[sl].to(acc))
            del grad_z
        return grad_hidden, _cast(grad_weight, weight), None, None, None, None


def _logits_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """∂ℓ/∂z of one chunk, in place on z's buffer (see the module docstring)."""
    # Clamped as in vime.algo.entropy: a -inf logit's p·log p is 0 and not 0·(-inf),
    # and an all -inf row (lse -inf) gets p = 0, not NaN, and so no entropy gradient.
    low = torch.finfo(z.dtype).min
    log_p = z.sub_(lse.clamp(min=low).unsqueeze(-1)).clamp_(min=low)
    p = log_p.exp()
    if grad_entropy is None:
        grad = p.mul_(-grad_logp.unsqueeze(-1))
    else:
        g_h, h = grad_entropy
        # −e p (log p + H), in place on log_p.
        grad = log_p.add_(h.unsqueeze(-1)).mul_(p).mul_(-g_h.unsqueeze(-1))
        if grad_logp is not None:
            grad.sub_(p.mul_(grad_logp.unsqueeze(-1)))
    if grad_logp is not None:
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1).to(grad.dtype))
    return grad


def _cast(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if grad is None else grad.to(like.dtype)
