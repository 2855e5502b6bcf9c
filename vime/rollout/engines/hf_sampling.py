"""The hf engine's draws: counter-based uniforms and the top-k / top-p filter.

Where it fits: ``vime.rollout.engines.hf.HFEngine`` draws token t of sample j of the
batch's prompt i by inverting the CDF of the filtered distribution (``filter_logits``)
at a uniform that is a hash of (seed, i, j, t) and nothing else (``row_keys``,
``uniforms``), so a completion's tokens do not depend on its batch. Pure torch.
"""

from __future__ import annotations

from typing import Any

import torch

# Counter-based uniforms: murmur3's 32-bit block and finaliser, on int64 tensors whose
# values stay in [0, 2**32): products are taken in 16-bit halves (none reaches 2**49) and
# shifts stay below 2**63, so int64 never overflows. The same functions work on Python ints.
_M32 = 0xFFFFFFFF
_LANES = (0x9E3779B9, 0x7F4A7C15)  # the two hashes' seeds


def _mul32(x: Any, c: int) -> Any:
    """``(x * c) mod 2**32`` for ``x`` in [0, 2**32) and a 32-bit constant ``c``."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _rotl32(x: Any, r: int) -> Any:
    return ((x << r) & _M32) | (x >> (32 - r))


def _absorb(h: Any, k: Any) -> Any:
    """One murmur3_32 block: the 32-bit word ``k`` into the state ``h``."""
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    return (_mul32(_rotl32(h ^ k, 13), 5) + 0xE6546B64) & _M32


def _fmix32(h: Any) -> Any:
    """murmur3's finaliser: every input bit reaches every output bit."""
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def row_keys(seed: int, prompt_index: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """``[R, 2]`` int64: two 32-bit hashes of (``seed``, prompt index, sample index) per row.

    The two hashes (murmur3 blocks under two seeds, the words in opposite orders) make a
    64-bit key, so two rows of a run share their uniforms with probability ~2**-64.
    """
    seed %= 2**64
    words = [seed & _M32, seed >> 32]
    p = prompt_index.to(torch.int64)
    rows = [p & _M32, p >> 32, sample_index.to(torch.int64) & _M32]
    a, b = _LANES
    for w in words:
        a = _absorb(a, w)
    for w in rows:
        a = _absorb(a, w)
    for w in reversed(rows):
        b = _absorb(b, w)
    for w in reversed(words):
        b = _absorb(b, w)
    return torch.stack([a, b], dim=-1)


def uniforms(keys: torch.Tensor, first_step: int, steps: int) -> torch.Tensor:
    """``[R, steps]`` float64 uniforms in [0, 1) with 53 random bits: entry ``[r, t]`` is
    a hash of row ``r``'s key and the decode step ``first_step + t``, nothing else."""
    step = torch.arange(first_step, first_step + steps, device=keys.device).unsqueeze(0)
    x = _fmix32(_absorb(keys[:, :1], step))
    y = _fmix32(_absorb(keys[:, 1:], step))
    hi = _fmix32(_absorb(x, y))
    lo = _fmix32(_absorb(y, hi))
    return ((hi << 21) | (lo >> 11)).double() * 2.0**-53


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside top-k, then outside the top-p nucleus, to -inf (``[B, V]`` float).

    Top-p keeps the smallest set of most likely tokens whose mass reaches
    ``top_p`` after top-k (the order vLLM applies them); the best token always stays.
    """
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = mass_before >= top_p
        drop[:, 0] = False
        scaled = scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scaled
