"""The hf engine's KV cache and attention: buffers reserved for the whole decode, and
grouped-query attention inside torch's CPU kernel.

Where it fits: ``vime.rollout.engines.hf.HFEngine`` prefills a batch's distinct prompts
once, then copies their cache to the rows sampling from them (``expand_cache``) into
``ReservedLayer`` buffers each decode step writes its column into in place; on the
CPU it switches a model on transformers' ``sdpa`` to ``_sdpa_gqa`` (``use_gqa_sdpa``;
same numbers, no copy of every KV head per step).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values live in buffers sized for the
    whole generation: a decode step writes its column in place, where ``DynamicLayer``
    concatenates (copying the whole cache every step). ``keys`` / ``values`` are views of
    the filled part, so everything that reads a ``DynamicLayer`` reads this one."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        shape = (*keys.shape[:2], capacity, keys.shape[-1])
        self._keys, self._values = keys.new_empty(shape), values.new_empty(shape)
        self._length = 0
        self.update(keys, values)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            raise RuntimeError(f"KV cache reserved for {self._keys.shape[-2]} positions, not {end}")
        self._keys[:, :, self._length : end] = key_states
        self._values[:, :, self._length : end] = value_states
        self._length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys = self._keys.index_select(0, indices)
        self._values = self._values.index_select(0, indices)
        self.keys, self.values = (
            self._keys[:, :, : self._length],
            self._values[:, :, : self._length],
        )


_GQA_SDPA = "vime_sdpa_gqa"


def _sdpa_gqa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, except that on the CPU grouped-query attention
    under a mask runs in the kernel (``enable_gqa``). transformers copies every KV head to
    its query heads (``repeat_kv``) whenever there is a mask, as its fast GPU kernels need;
    torch's CPU kernel does not, and the copy is a whole cache a layer a step."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (
        query.device.type == "cpu"
        and attention_mask is not None
        and getattr(module, "num_key_value_groups", 1) > 1
        and not kwargs.get("output_attentions")
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
    ):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
        is_causal=is_causal, **kwargs,
    )  # fmt: skip


def use_gqa_sdpa(model: torch.nn.Module) -> None:
    """Switch a CPU model on transformers' ``sdpa`` to :func:`_sdpa_gqa` (same masks)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(_GQA_SDPA, _sdpa_gqa)
    AttentionMaskInterface.register(_GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(_GQA_SDPA)


def expand_cache(cache: Any, to_row: torch.Tensor, capacity: int) -> None:
    """Copy each prompt's cache rows to the rows sampling from it; full-attention layers
    move into buffers reserved for ``capacity`` positions (others keep their own kind)."""
    layers = getattr(cache, "layers", None)
    if layers is None or getattr(cache, "offloading", False):
        cache.batch_select_indices(to_row)
        return
    for k, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            keys, values = layer.keys.index_select(0, to_row), layer.values.index_select(0, to_row)
            layers[k] = ReservedLayer(keys, values, capacity)
        else:
            layer.batch_select_indices(to_row)
