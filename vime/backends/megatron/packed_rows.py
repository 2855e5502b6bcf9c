"""Packed rows in megatron-core's THD form: their ``PackedSeqParams``, the local layers'
core attention over them, and the device copy of a planned row.

Where it fits: ``model.py`` builds the model and forwards rows (``stage_forward``)
with the ``PackedSeqParams`` made here; the backend's packer turns each planned
micro-batch into a device row with ``device_row``. ``cu_seqlens`` cover every
position run of the row, so RoPE restarts per run (per-token angles, ``rope.py``)
and attention stays within it.

Shared prompts (``vime.data.micro_batch``): under the local layers a group's prompt
sits once in the row and its other responses follow as runs whose positions
continue it. ``cu_seqlens`` then bound those runs, and the attention reads what each
run attends to (its prompt, then itself) from the layout ``device_row`` attaches to
them (``vime.backends.varlen_attention``); RoPE follows ``position_ids`` per token,
so the continuing runs rotate at their real positions. TransformerEngine's layers
read ``cu_seqlens`` alone (its attention and fused RoPE restart every run at 0), so
they take unshared rows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from vime.backends import varlen_attention
from vime.data.micro_batch import PackedBatch
from vime.sync_budget import host_only


class PackedDotProductAttention(DotProductAttention):
    """megatron-core's local core attention, plus packed (THD) rows.

    With ``PackedSeqParams`` queries, keys and values arrive as ``[t, heads, dim]``
    (RoPE already restarted per run by megatron-core) and attention runs within each
    run: ``Σ nᵢ²`` work instead of the ``L²`` of a block-diagonal mask. Without them
    it is megatron-core's own dense path.
    """

    def __init__(self, config: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, layer_number, *args, **kwargs)
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError("packed attention supports neither windows nor softmax offsets")
        # DotProductAttention splits its scale with the softmax under query-key scaling.
        scaling = self.layer_number if config.apply_query_key_layer_scaling else 1
        self.packed_scale = self.softmax_scale * scaling

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        if attention_bias is not None:
            raise ValueError("packed attention takes no attention bias")
        return self._packed(query, key, value, packed_seq_params)

    # Not traced by torch.compile (--compile-decoder): the row's layout is Python data that
    # changes with every row (vime.backends.varlen_attention).
    @torch.compiler.disable
    def _packed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        packed_seq_params: PackedSeqParams,
    ) -> torch.Tensor:
        layout = varlen_attention.layout_of_cu_seqlens(packed_seq_params.cu_seqlens_q)
        dropout = self.config.attention_dropout if self.training else 0.0

        def attend() -> torch.Tensor:
            q, k, v = (t.transpose(0, 1) for t in (query, key, value))
            return varlen_attention.packed_causal_attention(
                q, k, v, layout, scale=self.packed_scale, dropout_p=dropout
            )

        if dropout and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():  # as DotProductAttention
                out = attend()
        else:
            out = attend()
        return out.reshape(out.shape[0], self.hidden_size_per_partition)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, L, L]`` attention mask (True = masked) of a packed row.

    A new sample starts wherever ``position_ids`` restarts at 0; each token sees
    the tokens of its own sample up to itself. The padding run at the end of a row
    is a sample of its own, so it affects nothing else. Unshared rows only.
    """
    length = position_ids.shape[-1]
    segment = torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)  # [B, L]
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ~(same & causal).unsqueeze(1)


def packed_seq_params(packed: PackedBatch) -> PackedSeqParams:
    """The THD description of a packed row: one run per sample (with shared prompts, per
    response that continues one, too), plus the padding run.

    What TransformerEngine's THD attention needs, too: int32 ``cu_seqlens`` on the row's
    device and the longest run as ``max_seqlen``. No ``cu_seqlens_*_padded``: the runs
    cover the whole row (the padding is a run of its own), so to TE no token is padding
    and the padded offsets are these. A row with shared prompts needs its layout
    attached to these very ``cu_seqlens`` (``device_row``): they alone would cut each
    continuing response off its prompt.
    """
    # int32: TE's kernels read the offsets as int32 (run_cu_seqlens already is).
    cu_seqlens = packed.run_cu_seqlens().to(packed.input_ids.device, torch.int32)
    if packed.shares_prompts and varlen_attention.attached_layout(cu_seqlens) is None:
        raise ValueError(
            "a row with shared prompts reaches megatron's attention through device_row "
            "(its layout attached); pack it with share_prompts=False otherwise"
        )
    # The longest whole sample, not run: megatron-core sizes its rotary table by it, and
    # a response that continues a shared prompt sits at positions up to its sample's end.
    longest = packed.max_run_length
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def device_row(host: PackedBatch, device: torch.device, local_attention: bool) -> PackedBatch:
    """The host row ``host`` on ``device``; for the local layers' attention
    (``local_attention``), with the row's layout attached to its ``cu_seqlens``, built
    from the host positions so the forward reads nothing back from the device.

    A row with shared prompts gets ``cu_seqlens`` over its runs (each continuing
    response a run of its own), the layout saying which prompt each continues.
    TransformerEngine's attention reads no layout: its rows are unshared.
    """
    if not local_attention:
        if host.shares_prompts:
            raise ValueError("TransformerEngine's layers take rows packed with share_prompts=False")
        return host.to(device)
    with host_only():
        layout = varlen_attention.layout_of_positions(host.position_ids, device)
        if host.shares_prompts:  # copied with the row's other tensors below
            host = replace(host, attention_cu_seqlens=varlen_attention.run_cu_seqlens(layout))
    packed = host.to(device)
    varlen_attention.attach_layout(packed.run_cu_seqlens(), layout)
    return packed
