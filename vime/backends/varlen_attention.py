"""Causal attention over a packed row, computed per sample instead of over the row.

Where it fits: the training backends forward padding-free rows of many samples
(``vime.data.micro_batch``). Attention over the whole row under a dense
block-diagonal mask costs ``L²`` per row although only ``Σ nᵢ²`` of it is ever
unmasked -- for the embedded default (rows of 1024 tokens, samples of ~20) that is
~50x wasted work and most of a training step.

``packed_causal_attention`` on the CPU (and wherever no varlen kernel applies,
below) gathers the samples of a row into a padded batch and runs
``scaled_dot_product_attention(is_causal=True)`` on it. Samples are grouped by
length (power-of-two buckets), so padding at most doubles a sample's length and a
few long samples do not blow up many short ones. No mask is needed: under causal
attention a sample's real tokens never see the padding after them, and the padded
positions' outputs are dropped (so their gradient is exactly zero).

On a GPU one kernel call per layer does it all: ``choose_kernel`` picks, from the
device, the installed kernels (``vime.device.attention_kernels``) and the dtype, torch's
own varlen attention (``torch.nn.attention.varlen``), else flash-attn's
``flash_attn_varlen_func`` -- both 16-bit, CUDA only -- else the sdpa buckets above,
which stay the CPU's path. The varlen kernels take the row's queries as they are
(``cu_seqlens_q`` = the runs) and keys gathered per run: a run that continues a shared
prompt gets the prompt's keys then its own (``cu_seqlens_k``), and the kernels' causal
mask, aligned to the bottom right when a run has more keys than queries, lets its
token i see the prompt and its own tokens up to i -- exactly what the buckets compute.

``register_hf`` exposes it to transformers as ``attn_implementation="varlen_sdpa"``,
and no mask function: transformers then builds no mask and, unlike for a registered
one, does not scan ``position_ids`` for packing on the device (an ``.all()`` the host
waits for, every forward). The boundaries come from the row's
``position_ids`` by transformers' own rule (a sample starts wherever the position
does not follow its predecessor), so it is a drop-in for ``sdpa`` on packed rows.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from vime import device as vime_device
from vime.device import to_device
from vime.sync_budget import host_only

HF_NAME = "varlen_sdpa"


@dataclass(frozen=True)
class VarlenRuns:
    """A row as varlen kernels take it: the runs' query bounds ``cu_q`` (int32), their
    key bounds ``cu_k`` over the keys ``kv_index`` gathers (None: the row's own keys, no
    run continuing a shared prompt), and the longest run of each (host ints)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    kv_index: torch.Tensor | None


@dataclass(frozen=True)
class RowLayout:
    """Where the runs of one packed row of ``length`` tokens sit: run k holds tokens
    ``starts[k]`` on (``lengths[k]`` of them) and attends first to the ``prefix[k]``
    tokens from ``prefix_starts[k]`` (a shared prompt; 0 for a whole sample). These are
    host tensors; what a kernel reads is built from them on first use, on ``device``.

    ``buckets`` (the sdpa path): each is ``(index, keep)``: ``index`` ``[n, M]`` gathers
    n runs (each padded to the bucket's longest, M) from the row; ``keep`` lists the
    positions, among the ``n*M``, of the tokens whose output each run supplies (its
    own, not a shared prefix's). ``order`` ``[length]`` takes the buckets' kept tokens
    back to row order. ``varlen`` (the varlen kernels): ``VarlenRuns``.
    """

    length: int
    starts: torch.Tensor
    lengths: torch.Tensor
    prefix: torch.Tensor
    prefix_starts: torch.Tensor
    device: torch.device

    @property
    def buckets(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        return self._bucket_plan[0]

    @property
    def order(self) -> torch.Tensor:
        return self._bucket_plan[1]

    @cached_property
    def _bucket_plan(self) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], torch.Tensor]:
        with host_only():  # host tensors, copied without a wait by to_device
            return _buckets(self.starts, self.lengths, self.prefix, self.prefix_starts, self.device)

    @cached_property
    def varlen(self) -> VarlenRuns:
        with host_only():
            return _varlen_runs(
                self.starts, self.lengths, self.prefix, self.prefix_starts, self.device
            )


def row_layout(seq_lengths: list[int], device: torch.device | str = "cpu") -> RowLayout:
    """The layout of a row holding samples of ``seq_lengths`` tokens, in order."""
    if not seq_lengths or min(seq_lengths) < 1:
        raise ValueError(f"a packed row needs samples of >= 1 token, got lengths {seq_lengths}")
    lengths = torch.tensor(seq_lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    zeros = torch.zeros_like(lengths)
    return RowLayout(int(lengths.sum()), starts, lengths, zeros, starts, torch.device(device))


def _buckets(
    starts: torch.Tensor,
    lengths: torch.Tensor,
    prefix: torch.Tensor,
    prefix_starts: torch.Tensor,
    device: torch.device,
) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], torch.Tensor]:
    """``RowLayout``'s ``buckets`` and ``order``: runs grouped by power-of-two length (their
    prefix included), each run supplying the output of its own tokens only."""
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
    return tuple(buckets), to_device(order, device)


def _varlen_runs(
    starts: torch.Tensor,
    lengths: torch.Tensor,
    prefix: torch.Tensor,
    prefix_starts: torch.Tensor,
    device: torch.device,
) -> VarlenRuns:
    """``RowLayout.varlen``: the runs lie end to end in the row, so their queries are the
    row itself; run k's keys are its prefix, then its own tokens."""
    total = prefix + lengths
    cu_q = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32)
    cu_q[1:] = torch.cumsum(lengths, 0)
    cu_k = torch.zeros_like(cu_q)
    cu_k[1:] = torch.cumsum(total, 0)
    kv_index = None
    if bool((prefix > 0).any()):
        run = torch.repeat_interleave(torch.arange(lengths.shape[0]), total)
        step = torch.arange(int(total.sum())) - cu_k[:-1].long()[run]
        s = prefix[run]
        kv_index = to_device(
            torch.where(step < s, prefix_starts[run] + step, starts[run] + step - s), device
        )
    return VarlenRuns(
        to_device(cu_q, device),
        to_device(cu_k, device),
        int(lengths.max()),
        int(total.max()),
        kv_index,
    )


# The kernels ``choose_kernel`` picks from (``vime.device.attention_kernels`` names the
# installed ones by the first two).
TORCH_VARLEN = "torch_varlen"
FLASH_ATTN = "flash_attn"
SDPA_BUCKETS = "sdpa_buckets"
_HALF = (torch.bfloat16, torch.float16)


def choose_kernel(
    device_type: str, installed: frozenset[str], dtype: torch.dtype, dropout: bool = False
) -> str:
    """The attention kernel of a packed row on ``device_type`` in ``dtype``, from the
    ``installed`` varlen kernels: torch's or flash-attn's (flash-attention kernels: CUDA
    and 16-bit only; torch's has no dropout), else the sdpa buckets (any device, dtype)."""
    if device_type != "cuda" or dtype not in _HALF:
        return SDPA_BUCKETS
    if TORCH_VARLEN in installed and not dropout:
        return TORCH_VARLEN
    return FLASH_ATTN if FLASH_ATTN in installed else SDPA_BUCKETS


_ANNOUNCED: set[tuple[str, str, torch.dtype]] = set()


def _announce(kernel: str, device_type: str, dtype: torch.dtype) -> None:
    """One line per process (and kernel, device type, dtype) naming the kernel picked."""
    key = (kernel, device_type, dtype)
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        print(f"vime: packed-row attention kernel {kernel} ({device_type}, {dtype})", flush=True)


def kernels_used() -> list[str]:
    """The kernels this process's packed attention has run (for reports, e.g. benches)."""
    return sorted({kernel for kernel, _, _ in _ANNOUNCED})


# Not traced by torch.compile (--compile-decoder): the layout is Python data that changes
# with every row, so the attention is one opaque call between compiled graphs.
@torch.compiler.disable
def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: RowLayout,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each sample of a packed row, by ``choose_kernel``'s kernel.

    ``query`` is ``[H, L, D]``, ``key``/``value`` ``[Hkv, L, D]`` (grouped-query
    attention when Hkv divides H); returns ``[L, H, D]``, the layout the output
    projection reads.
    """
    length = query.shape[1]
    if key.shape[1] != length or layout.length != length:
        raise ValueError(
            f"packed attention needs queries, keys and layout of one length, got "
            f"{length}, {key.shape[1]} and {layout.length}"
        )
    kernel = choose_kernel(
        query.device.type, vime_device.attention_kernels(), query.dtype, dropout_p > 0
    )
    _announce(kernel, query.device.type, query.dtype)
    if kernel == SDPA_BUCKETS:
        return _bucket_attention(query, key, value, layout, scale, dropout_p)
    rows = varlen_rows(query, key, value, layout)
    return _VARLEN_KERNELS[kernel](rows, layout.varlen, scale, dropout_p)


def varlen_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: RowLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[H, L, D]`` queries, keys and values as the varlen kernels take them: ``[L, H, D]``,
    keys and values gathered per run (``layout.varlen.kv_index``) where prompts are shared."""
    q, k, v = (t.transpose(0, 1) for t in (query, key, value))
    index = layout.varlen.kv_index
    if index is not None:
        k, v = k.index_select(0, index), v.index_select(0, index)
    return q, k, v


@functools.cache
def _parameters(function: Callable[..., Any]) -> frozenset[str]:
    """``function``'s parameter names (read once: the signature differs across torch)."""
    return frozenset(inspect.signature(function).parameters)


def _torch_varlen(
    qkv: tuple[torch.Tensor, ...], runs: VarlenRuns, scale: float | None, dropout_p: float
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` over ``[L, H, D]`` rows (no dropout)."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = qkv
    gqa = k.shape[1] != q.shape[1]
    extra: dict[str, Any] = {"scale": scale}
    params = _parameters(varlen_attn)
    # torch 2.10 spelt causal is_causal; later ones window_size (-1, 0).
    extra.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    if gqa and "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, runs.cu_q, runs.cu_k, runs.max_q, runs.max_k, **extra)


def _flash_attn(
    qkv: tuple[torch.Tensor, ...], runs: VarlenRuns, scale: float | None, dropout_p: float
) -> torch.Tensor:
    """flash-attn's ``flash_attn_varlen_func`` over ``[L, H, D]`` rows (its causal mask
    is aligned to the bottom right since flash-attn 2.1)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        *qkv, runs.cu_q, runs.cu_k, runs.max_q, runs.max_k,
        dropout_p=dropout_p, softmax_scale=scale, causal=True,
    )  # fmt: skip


_VARLEN_KERNELS = {TORCH_VARLEN: _torch_varlen, FLASH_ATTN: _flash_attn}


def _bucket_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: RowLayout,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """The sdpa path: each bucket's runs gathered into a padded batch (module docstring)."""
    heads, _, dim = query.shape
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
    return RowLayout(
        int(lengths.sum()), starts, lengths, prefix, starts[roots], torch.device(target)
    )


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
        attached = attached_layout(boundaries)
        if attached is not None:
            return attached
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


def attached_layout(boundaries: torch.Tensor) -> RowLayout | None:
    """The layout ``attach_layout`` gave ``boundaries`` while it still holds, else None."""
    attached = getattr(boundaries, _ATTACHED, None)
    return attached[1] if attached is not None and attached[0] == boundaries._version else None


def run_cu_seqlens(layout: RowLayout) -> torch.Tensor:
    """int32 host ``cu_seqlens`` over ``layout``'s runs, a run that continues a shared
    prompt bounded without it: the THD bounds of a row whose attention reads the layout."""
    bounds = torch.full((layout.starts.shape[0] + 1,), layout.length, dtype=torch.int32)
    bounds[:-1] = layout.starts
    return bounds


def layout_of_cu_seqlens(cu_seqlens: torch.Tensor) -> RowLayout:
    """The (cached) layout of a row whose runs end at ``cu_seqlens[1:]`` (``[0, n₀, ...]``)."""
    return _CACHE.get(cu_seqlens, lambda cu: row_layout(torch.diff(cu).tolist(), cu.device))


# The layout lookup (a tensor attribute, its version) is Python, too: see above.
@torch.compiler.disable
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
