"""Build megatron-core's ``GPTModel`` for an HF config and forward the planner's packed rows.

Where it fits: the megatron backend's actor builds its model here, loads the
weights converted by ``convert.hf_to_megatron`` with ``load_megatron_state``, and
forwards each micro-batch with ``packed_logits``, whose ``[1, L, V]`` logits go
through the same ``vime.data.micro_batch.response_log_probs`` and ``vime.algo`` loss
as the fsdp2 backend.

Packed rows (see ``vime.data.micro_batch``): on the CPU there is no
TransformerEngine, and megatron-core's local attention (``DotProductAttention``)
has no THD packing, so the row is forwarded as one sequence under a
block-diagonal causal mask, and RoPE follows the row's ``position_ids`` (restarting
at 0 per sample) instead of megatron's 0..L-1 -- exactly what HF computes for each
sample alone. The GPU path -- the same row through TransformerEngine's THD
``PackedSeqParams``, where RoPE restarts per sample from ``cu_seqlens`` -- is not
built yet; ``PackedRowGPTModel`` leaves RoPE alone when ``PackedSeqParams`` are given.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from vime import device as vime_device
from vime.backends.megatron.convert import gpt_extra
from vime.backends.megatron.shims import apply_cpu_shims
from vime.data.micro_batch import PackedBatch


def init_model_parallel(
    *, tp: int = 1, pp: int = 1, seed: int = 1234, backend: str | None = None
) -> None:
    """Join (or start) the default process group, then megatron's TP/PP/DP groups and seeds.

    The launcher sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a lone process with
    none of them is rank 0 of 1. ``backend`` defaults to what the fsdp2 backend uses
    (``vime.device``: NCCL beside gloo on GPU, with this rank's GPU made current; gloo
    on CPU).

    Seeding goes through ``model_parallel_cuda_manual_seed`` because attention enters
    megatron's named RNG states (dropout) on every forward; on CPU the shims keep them
    on the CPU generator.
    """
    apply_cpu_shims()
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        if backend is None:
            backend = vime_device.process_group_backend(vime_device.local_device())
        dist.init_process_group(backend=backend)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if have != (tp, pp):
        raise RuntimeError(f"megatron parallel state is already (TP, PP) = {have}, not {(tp, pp)}")
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Undo ``init_model_parallel`` (megatron's groups, then the default group)."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class PackedRowGPTModel(GPTModel):
    """``GPTModel`` whose rotary embedding follows ``position_ids``.

    megatron-core's ``GPTModel`` ignores ``position_ids`` under RoPE and rotates
    token p of the row by angle p. Attention scores depend only on position
    differences, so inside one sample that is the same function, but not the same
    floats: HF (and the rollout engine) rotate every sample from 0, and at long rows
    the large angles lose precision. Indexing the rotary table by ``position_ids``
    makes the CPU packed path compute what HF computes.

    ``hf_vocab_size`` is the HF vocabulary; the model's own (padded) vocabulary is
    larger, and logits beyond ``hf_vocab_size`` are padding.
    """

    def __init__(self, *args: Any, hf_vocab_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hf_vocab_size = hf_vocab_size

    def _preprocess(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        decoder_input: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[Any, ...]:
        out = super()._preprocess(
            input_ids,
            position_ids,
            decoder_input=decoder_input,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        rotary = out[1]
        # THD packing (TransformerEngine) and inference restart positions themselves.
        if rotary is None or position_ids is None or packed_seq_params is not None:
            return out
        if inference_context is not None:
            return out
        # rotary: [S, 1, 1, D] for positions 0..S-1 -> [S, B, 1, D] at each token's position.
        rotary = rotary[:, 0][position_ids.transpose(0, 1)]
        return (out[0], rotary, *out[2:])


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built the way megatron-core builds a norm, and sequence-parallel ready.

    megatron-core's ``WrappedTorchNorm`` (its norm without TransformerEngine or
    Apex) is the same math but refuses sequence parallelism. Under it each TP rank
    normalizes a slice of the sequence, so the weight's gradient is partial per
    rank; marking it ``sequence_parallel`` (as megatron-core's fused norms do) lets
    the actor sum it over the TP group.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        # In the model's dtype, as megatron-core's norms: bf16 weights under bf16 training.
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _with_norm(spec: Any, norm: type) -> Any:
    """``spec`` with every ``WrappedTorchNorm`` replaced by ``norm`` (a copy; specs nest)."""
    if spec is WrappedTorchNorm:
        return norm
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = {f.name: _with_norm(getattr(spec, f.name), norm) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **fields)
    return spec


def local_block_spec(tcfg: Any) -> TransformerBlockSubmodules:
    """megatron-core's local (no TransformerEngine) GPT layers, with ``RMSNorm`` norms,
    as a whole-block spec so the block's final norm is ``RMSNorm`` too. A block spec
    lists this pipeline stage's layers only (all of them without pipelining)."""
    layer = get_gpt_layer_local_spec(qk_layernorm=tcfg.qk_layernorm, normalization="RMSNorm")
    layer = _with_norm(layer, RMSNorm)
    count = get_num_layers_to_build(tcfg)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=RMSNorm)


def build_gpt_model(
    hf_config: Any,
    tcfg: Any,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    layer_spec: ModuleSpec | TransformerBlockSubmodules | None = None,
) -> PackedRowGPTModel:
    """A randomly initialised ``GPTModel`` of ``hf_config``'s architecture on this rank.

    ``tcfg`` comes from ``convert.transformer_config_from_hf``; megatron's parallel
    state must be initialised with the same tensor-parallel size. ``layer_spec``
    defaults to ``local_block_spec`` (megatron-core's layers that run without
    TransformerEngine, QK-layernorm as ``tcfg`` says, ``RMSNorm`` norms).
    """
    apply_cpu_shims()
    extra = gpt_extra(hf_config, tp=tcfg.tensor_model_parallel_size)
    if layer_spec is None:
        if tcfg.normalization != "RMSNorm":
            raise ValueError(f"only RMSNorm models are supported, not {tcfg.normalization}")
        layer_spec = local_block_spec(tcfg)
    return PackedRowGPTModel(
        tcfg,
        layer_spec,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        hf_vocab_size=extra.vocab_size,
        **extra.gpt_model_kwargs(),
    )


def load_megatron_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a converted state dict (``convert.hf_to_megatron``) into ``model``.

    Strict about weights; megatron-core's ``_extra_state`` entries (TransformerEngine
    FP8 metadata, empty here) are the only keys a converted state may omit.
    """
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"megatron state does not match the model: missing {missing[:8]}, "
            f"unexpected {result.unexpected_keys[:8]}"
        )


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, L, L]`` attention mask (True = masked) of a packed row.

    A new sample starts wherever ``position_ids`` restarts at 0; each token sees
    the tokens of its own sample up to itself. The padding run at the end of a row
    is a sample of its own, so it affects nothing else.
    """
    length = position_ids.shape[-1]
    segment = torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)  # [B, L]
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ~(same & causal).unsqueeze(1)


def stage_forward(model: PackedRowGPTModel, packed: PackedBatch) -> torch.Tensor:
    """This pipeline stage's output for a packed row: vocab-parallel logits ``[1, L, V/TP]``
    on the last stage, hidden states ``[L, 1, H]`` (``L/TP`` under sequence parallel)
    elsewhere. Stages after the first read their input from ``set_input_tensor``.

    The mask is ``L x L`` booleans per row: fine for CPU-sized rows, not for long GPU rows.
    """
    mask = block_causal_mask(packed.position_ids)
    return model(packed.input_ids, packed.position_ids, mask)


def full_vocab_logits(model: PackedRowGPTModel, logits: torch.Tensor) -> torch.Tensor:
    """The last stage's vocab-parallel logits over the HF vocabulary (padding dropped).

    With tensor parallelism every rank gets the full vocabulary (gathered; the backward
    splits the gradient back).
    """
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., : model.hf_vocab_size]


def packed_logits(model: PackedRowGPTModel, packed: PackedBatch) -> torch.Tensor:
    """Logits ``[1, L, V]`` over a packed row, V the HF vocabulary, of a whole model
    (``pre_process`` and ``post_process``: no pipeline)."""
    return full_vocab_logits(model, stage_forward(model, packed))
