"""RoPE on packed (THD) rows without reading ``cu_seqlens`` back from the device.

Where it fits: ``model.PackedRowGPTModel._preprocess`` gives megatron-core's attention
one rotary row per token (at the token's position in its own sample) and marks it
``PER_TOKEN``; importing this module wraps megatron-core's ``apply_rotary_pos_emb`` (as
``megatron.core.transformer.attention`` calls it) so that such angles rotate the row
at once instead of per run. Only the unfused path is concerned: TE's fused THD RoPE
(``--megatron-transformer-impl transformer_engine``) takes ``cu_seqlens`` on the device
and gets megatron-core's own table.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention as mattention

PER_TOKEN = "_vime_per_token"  # a tensor attribute: rotary angles hold one row a token


def per_token(freqs: torch.Tensor) -> torch.Tensor:
    """``freqs`` (one rotary row a token of a THD row) marked for ``_per_token_rope``."""
    setattr(freqs, PER_TOKEN, True)
    return freqs


def _per_token_rope(original: Any) -> Any:
    """megatron-core's ``apply_rotary_pos_emb``, taking per-token angles (one row of
    ``freqs`` a token, made by ``PackedRowGPTModel._preprocess``) without the THD split.

    The THD path computes ``cat(freqs[:nᵢ] per run)`` from ``cu_seqlens.tolist()``, a
    read of the device in every attention layer; per-token angles are those same rows,
    so rotating the row at once gives the same floats."""

    def apply(
        t: torch.Tensor,
        freqs: torch.Tensor,
        config: Any,
        cu_seqlens: torch.Tensor | None = None,
        mscale: float = 1.0,
        cp_group: Any = None,
    ) -> torch.Tensor:
        if cu_seqlens is None or not getattr(freqs, PER_TOKEN, False):
            return original(
                t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group
            )
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            freqs,
            rotary_interleaved=config.rotary_interleaved,
            multi_latent_attention=config.multi_latent_attention,
            mscale=mscale,
        ).squeeze(1)

    apply._vime_per_token_rope = True  # type: ignore[attr-defined]
    return apply


def install() -> None:
    """Route megatron-core's attention through ``_per_token_rope`` (once per process)."""
    if not getattr(mattention.apply_rotary_pos_emb, "_vime_per_token_rope", False):
        mattention.apply_rotary_pos_emb = _per_token_rope(mattention.apply_rotary_pos_emb)


install()
