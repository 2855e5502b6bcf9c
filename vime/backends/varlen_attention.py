"""Causal attention over a packed row, computed per sample instead of over the row.

Where it fits: the training backends forward padding-free rows of many samples
(``vime.data.micro_batch``). flash-attention's varlen kernel handles such rows on
GPU; without it (the CPU, or a GPU without flash-attn) attention used to run over
the whole row under a dense block-diagonal mask, which costs ``L²`` per row although
only ``Σ nᵢ²`` of it is ever unmasked -- for the embedded default (rows of 1024
tokens, samples of ~20) that is ~50x wasted work and most of a training step.

``packed_causal_attention`` gathers the samples of a row into a padded batch and
runs ``scaled_dot_product_attention(is_causal=True)`` on it. Samples are grouped by
length (power-of-two buckets), so padding at most doubles a sample's length and a
few long samples do not blow up many short ones. No mask is needed: under causal
attention a sample's real tokens never see the padding after them, and the padded
positions' outputs are dropped (so their gradient is exactly zero).

``register_hf`` exposes it to transformers as ``attn_implementation="varlen_sdpa"``,
and no mask function: transformers then builds no mask and, unlike for a registered
one, does not scan ``position_ids`` for packing on the device (an ``.all()`` the host
waits for, every forward). The boundaries come from the row's
``position_ids`` by transformers' own rule (a sample starts wherever the position
does not follow its predecessor), so it is a drop-in for ``sdpa`` on packed rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vime.device import to_device

HF_NAME = "varlen_sdpa"


@dataclass(frozen=True)
class RowLayout:
    """Where the samples of one packed row of ``length`` tokens sit, grouped for attention.

    Each bucket is ``(index, keep)``: ``index`` ``[n, M]`` gathers n samples (each
    padded to the bucket's longest, M) from the row; ``keep`` lists the positions,
    among the ``n*M``, of the tokens whose output each sample supplies (its own,
    not a shared prefix's). ``order`` ``[length]`` takes the buckets' kept tokens
    back to row order.
    """

    length: int
    buckets: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    order: torch.Tensor


def row_layout(seq_lengths: list[int], device: torch.device | str = "cpu") -> RowLayout:
    """The layout of a row holding samples of ``seq_lengths`` tokens, in order."""
    if not seq_lengths or min(seq_lengths) < 1:
        raise ValueError(f"a packed row needs samples of >= 1 token, got lengths {seq_lengths}")
    lengths = torch.tensor(seq_lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return _runs_layout(starts, lengths, torch.zeros_like(lengths), starts, device)


def _runs_layout(
    starts: torch.Tensor,
    lengths: torch.Tensor,
    prefix: torch.Tensor,
    prefix_starts: torch.Tensor,
    device: torch.device | str,
) -> RowLayout:
    """Run k (tokens ``starts[k]`` on, ``lengths[k]`` of them) attends to the ``prefix[k]``
    tokens from ``prefix_starts[k]`` (a shared prompt; 0 for a whole sample), then to
    itself causally; it supplies the output of its own tokens only."""
    total = prefix + lengths
    keys = [int(n - 1).bit_length() for n in total.tolist()]
    groups: dict[int, list[int]] = {}
    for k, key in enumerate(keys):
        groups.setdefault(key, []).append(k)
    buckets, positions = [], []
    for key in sorted(groups):
        members = torch.tensor(groups[key])
        s, a, b = prefix[members, None], starts[members, None], prefix_starts[members, None]
        width = int(total[members].max())
        steps = torch.arange(width)
        index = torch.where(steps < s, b + steps, a + steps - s)
        real = steps < (s + lengths[members, None])
        # Padded slots read the sample's own first token: any in-row index would do.
        index = torch.where(real, index, index[:, :1])
        owned = (real & (steps >= s)).flatten().nonzero().flatten()
        buckets.append((to_device(index, device), to_device(owned, device)))
        positions.append(index.flatten()[owned])
    order = torch.argsort(torch.cat(positions))
    return RowLayout(int(lengths.sum()), tuple(buckets), to_device(order, device))


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: RowLayout,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each sample of a packed row.

    ``query`` is ``[H, L, D]``, ``key``/``value`` ``[Hkv, L, D]`` (grouped-query
    attention when Hkv divides H); returns ``[L, H, D]``, the layout the output
    projection reads.
    """
    heads, length, dim = query.shape
    if key.shape[1] != length or layout.length != length:
        raise ValueError(
            f"packed attention needs queries, keys and layout of one length, got "
            f"{length}, {key.shape[1]} and {layout.length}"
        )
    gqa = key.shape[0] != heads
    parts = []
    for index, keep in layout.buckets:
        n, width = index.shape

        def gather(t: torch.Tensor, index: torch.Tensor = index) -> torch.Tensor:
            # index_select, not t[:, index]: its backward is an index_add, several times
            # cheaper on the CPU than the accumulating index_put of advanced indexing.
            picked = t.index_select(1, index.flatten())
            return picked.view(t.shape[0], *index.shape, dim).transpose(0, 1)

        out = F.scaled_dot_product_attention(
            gather(query),
            gather(key),
            gather(value),
            dropout_p=dropout_p,
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        parts.append(out.transpose(1, 2).reshape(n * width, heads, dim).index_select(0, keep))
    return torch.cat(parts).index_select(0, layout.order)


def layout_of_positions(
    position_ids: torch.Tensor, device: torch.device | str | None = None
) -> RowLayout:
    """The layout of a ``[1, L]`` row from its positions, by transformers' packed rule
    (a sample starts where the position does not follow the previous one) extended to
    shared prompts (``vime.data.micro_batch``): a run that starts at position s > 0
    continues the latest run that started at 0, whose first s tokens it attends to.
    The layout's tensors go to ``device`` (``position_ids``'s by default): from host
    positions, a packer builds a device row's layout without reading the device."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(
            f"{HF_NAME} attention takes one packed row ([1, L] position_ids), got "
            f"{tuple(position_ids.shape)}; use --attn-implementation sdpa for padded batches"
        )
    row = position_ids[0].cpu()
    begins = torch.ones_like(row, dtype=torch.bool)
    begins[1:] = row[1:] != row[:-1] + 1
    starts = torch.nonzero(begins).flatten()
    lengths = torch.diff(torch.cat([starts, starts.new_tensor([row.shape[0]])]))
    prefix = row[starts]
    run = torch.arange(starts.shape[0])
    roots = torch.cummax(torch.where(prefix == 0, run, -1), 0).values
    # No run at 0 before it: a sample of its own, as transformers reads it.
    prefix = torch.where(roots < 0, 0, prefix)
    roots = roots.clamp(min=0)
    if bool((prefix > lengths[roots]).any()):
        raise ValueError(
            f"{HF_NAME}: a run of the packed row starts at a position past the end of the "
            "run it continues; a shared prompt comes first, at positions 0.."
        )
    target = position_ids.device if device is None else device
    return _runs_layout(starts, lengths, prefix, starts[roots], target)


# The attribute of a row's boundary tensor that holds the layout a packer attached.
_ATTACHED = "_vime_row_layout"


class _LayoutCache:
    """The last row's layout. Every layer of one forward gets the same boundary tensor
    (``position_ids`` in transformers, ``cu_seqlens`` in megatron-core), so the layout is
    built once per forward, not once per layer; a new tensor, or an in-place change
    to this one, builds it again. A layout a packer attached to the tensor
    (``attach_layout``) is used as it is."""

    def __init__(self) -> None:
        self._key: tuple[torch.Tensor, int] | None = None
        self._layout: RowLayout | None = None

    def get(
        self, boundaries: torch.Tensor, layout_of: Callable[[torch.Tensor], RowLayout]
    ) -> RowLayout:
        attached = getattr(boundaries, _ATTACHED, None)
        if attached is not None and attached[0] == boundaries._version:
            return attached[1]
        key = self._key
        if key is None or key[0] is not boundaries or key[1] != boundaries._version:
            self._layout = layout_of(boundaries)
            self._key = (boundaries, boundaries._version)
        assert self._layout is not None
        return self._layout


_CACHE = _LayoutCache()


def attach_layout(boundaries: torch.Tensor, layout: RowLayout) -> None:
    """Hand the attention the layout of the row ``boundaries`` (its ``position_ids`` or
    ``cu_seqlens`` tensor, as the model will pass it), computed by the packer from the
    host copy, so the forward reads nothing back from the device. It holds while the
    tensor is unchanged; it goes with the tensor, so several rows may be packed ahead."""
    setattr(boundaries, _ATTACHED, (boundaries._version, layout))


def layout_of_cu_seqlens(cu_seqlens: torch.Tensor) -> RowLayout:
    """The (cached) layout of a row whose runs end at ``cu_seqlens[1:]`` (``[0, n₀, ...]``)."""
    return _CACHE.get(cu_seqlens, lambda cu: row_layout(torch.diff(cu).tolist(), cu.device))


def _hf_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[1, H, L, D]`` in, ``[1, L, H, D]`` out."""
    if position_ids is None:
        raise ValueError(f"{HF_NAME} attention needs the row's position_ids in the forward")
    if sliding_window is not None:
        raise ValueError(
            f"{HF_NAME} attention has no sliding window; use --attn-implementation sdpa"
        )
    layout = _CACHE.get(position_ids, layout_of_positions)
    out = packed_causal_attention(query[0], key[0], value[0], layout, scaling, dropout)
    return out.unsqueeze(0), None


def register_hf() -> str:
    """Make ``attn_implementation="varlen_sdpa"`` available to transformers; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_NAME, _hf_attention)
    return HF_NAME
