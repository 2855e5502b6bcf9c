"""Build megatron-core's ``GPTModel`` for an HF config and forward the planner's packed rows.

Where it fits: the megatron backend builds its model here, loads the weights converted
by ``convert.hf_to_megatron`` (``load_megatron_state``) and forwards each micro-batch
with ``stage_forward``; its logits meet the fsdp2 backend's log-prob and loss code
(under TP a vocabulary shard each, reduced by ``vocab_parallel``).

Packed rows go in megatron-core's THD format (``packed_rows.py``: their
``PackedSeqParams``, the local layers' attention, shared prompts). The older form --
one sequence under a block-diagonal causal mask (``block_causal_mask``), RoPE
following ``position_ids`` -- is what tests check THD against.

Layers (``--megatron-transformer-impl``, ``build_gpt_model``): ``local`` (the default,
the only one on the CPU), megatron-core's local spec whose ``PackedDotProductAttention``
attends per run through ``vime.backends.varlen_attention``; ``transformer_engine``
(CUDA), TE's fused norm + linear layers, whose parameter names differ
(``fuses_norms``, ``convert.param_map(fused_norms=True)``) and checkpoint keys do not.
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
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from vime import device as vime_device
from vime.backends.megatron import rope
from vime.backends.megatron.convert import gpt_extra
from vime.backends.megatron.flags import TRANSFORMER_IMPLS, transformer_engine_missing
from vime.backends.megatron.packed_rows import (
    PackedDotProductAttention,
    block_causal_mask,
    packed_seq_params,
)
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
    device = vime_device.local_device()  # this rank's GPU current before megatron seeds it
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        if backend is None:
            backend = vime_device.process_group_backend(device)
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


def rng_tracker_states() -> dict[str, torch.Tensor]:
    """Copies of megatron's named RNG streams (attention dropout draws from them).

    ``init_model_parallel`` reseeds them from the seed, so a resumed run that did not
    restore them would replay the first dropout masks instead of the next ones.
    """
    states = tensor_parallel.get_cuda_rng_tracker().get_states()
    return {
        name: state.get_state() if isinstance(state, torch.Generator) else state.clone()
        for name, state in states.items()
    }


def set_rng_tracker_states(states: dict[str, torch.Tensor]) -> None:
    """Restore streams captured by ``rng_tracker_states`` into the live tracker."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    live = tracker.get_states()
    if set(live) != set(states):
        raise RuntimeError(f"megatron RNG streams {sorted(states)} saved, {sorted(live)} live")
    for name, state in states.items():
        if isinstance(live[name], torch.Generator):  # CUDA-graph-safe tracker
            live[name].set_state(state)
        else:
            live[name] = state.clone()
    tracker.set_states(live)


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

    ``padding_idx`` is the row HF's embedding keeps out of the lookup's gradient
    (``nn.Embedding(..., padding_idx=pad_token_id)``); megatron-core's embedding has no
    such row, so ``_hold_padding_row`` detaches the looked-up vectors of that id. It
    matters whenever a sampled response holds the pad id: HF initialises the row to
    zero, and the first RMSNorm's backward at a zero vector is scaled by 1/sqrt(eps).
    A tied head still trains the row, in both backends.
    """

    def __init__(
        self, *args: Any, hf_vocab_size: int, padding_idx: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.hf_vocab_size = hf_vocab_size
        self.padding_idx = padding_idx
        if self.pre_process and padding_idx is not None:
            self.embedding.word_embeddings.register_forward_hook(self._hold_padding_row)

    def _hold_padding_row(
        self, module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor
    ) -> torch.Tensor:
        """The lookup's output with the pad id's vectors cut from the graph."""
        held = inputs[0] == self.padding_idx  # [B, S]
        if module.reduce_scatter_embeddings:
            # Sequence parallel: output is this TP rank's slice [S/TP, B, H].
            rows = output.shape[0]
            start = parallel_state.get_tensor_model_parallel_rank() * rows
            held = held.transpose(0, 1)[start : start + rows]
        return torch.where(held[..., None], output.detach(), output)

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
        if rotary is None or position_ids is None or inference_context is not None:
            return out  # inference positions itself
        thd = packed_seq_params is not None
        if thd and (self.config.apply_rope_fusion or self.config.context_parallel_size > 1):
            return out  # TE's fused THD RoPE restarts per run from cu_seqlens on the device
        # [S, 1, 1, D] for positions 0..S-1 -> [S, B, 1, D] at each token's position; on a
        # THD row marked so the unfused RoPE takes it whole (rope.py: no cu_seqlens read).
        rotary = rotary[:, 0][position_ids.transpose(0, 1)]
        rotary = rope.per_token(rotary) if thd else rotary
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
        # In the model's dtype, as megatron-core's norms: bf16 weights under bf16 training;
        # and where megatron-core puts its own layers (the GPU, unless it initialises on
        # the host).
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _with_module(spec: Any, old: type, new: type) -> Any:
    """``spec`` with every ``old`` module class replaced by ``new`` (a copy; specs nest)."""
    if spec is old:
        return new
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = {
            f.name: _with_module(getattr(spec, f.name), old, new) for f in dataclasses.fields(spec)
        }
        return dataclasses.replace(spec, **fields)
    return spec


def local_block_spec(tcfg: Any) -> TransformerBlockSubmodules:
    """megatron-core's local (no TransformerEngine) GPT layers, with ``RMSNorm`` norms and
    ``PackedDotProductAttention``, as a whole-block spec so the block's final norm is
    ``RMSNorm`` too. A block spec lists this pipeline stage's layers only (all of them
    without pipelining)."""
    layer = get_gpt_layer_local_spec(qk_layernorm=tcfg.qk_layernorm, normalization="RMSNorm")
    layer = _with_module(layer, WrappedTorchNorm, RMSNorm)
    layer = _with_module(layer, DotProductAttention, PackedDotProductAttention)
    count = get_num_layers_to_build(tcfg)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=RMSNorm)


def te_block_spec(tcfg: Any) -> TransformerBlockSubmodules:
    """TransformerEngine's GPT layers for the architecture ``local_block_spec`` builds, as
    a whole-block spec whose final norm is TE's too.

    megatron-core's TE spec fuses each layer's pre-attention and pre-MLP norm into the
    linear after it (``TELayerNormColumnParallelLinear``: ``linear_qkv.layer_norm_weight``,
    ``mlp.linear_fc1.layer_norm_weight``) and leaves the QK norms separate; TE's norms
    are RMSNorm because ``tcfg.normalization`` says so. Its core attention,
    ``TEDotProductAttention``, takes the packed rows' ``PackedSeqParams`` (THD).

    Raises ``RuntimeError`` naming what is missing where TE cannot run (no CUDA, no
    ``transformer_engine``, or one megatron-core could not import).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    missing = transformer_engine_missing()
    if missing is None and not gpt_layer_specs.HAVE_TE:
        missing = "a transformer_engine that megatron-core can import (its import failed)"
    if missing:
        raise RuntimeError(
            f"TransformerEngine layers need {missing}; build the local layers instead "
            "(--megatron-transformer-impl local)"
        )
    from megatron.core.extensions.transformer_engine import TENorm

    layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
        num_experts=None,  # dense layers: check_architecture refuses MoE models
        qk_layernorm=tcfg.qk_layernorm,
        # TE's operation-fuser MLP names its parameters mlp.0 / mlp.1 / ..., which
        # conversion does not speak; the plain TE MLP keeps linear_fc1 / linear_fc2.
        use_te_op_fuser=False,
        # megatron-core's own SwiGLU (gated silu), as in the local layers.
        use_te_activation_func=False,
    )
    count = get_num_layers_to_build(tcfg)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=TENorm)


# Which block spec each --megatron-transformer-impl builds.
BLOCK_SPECS = {"local": local_block_spec, "transformer_engine": te_block_spec}


def recompute_fields(granularity: str) -> dict[str, Any]:
    """``TransformerConfig`` fields of ``--megatron-recompute-granularity``.

    ``selective`` recomputes core attention (megatron-core's default module: the
    ``L x L`` scores are the large, cheap activations); ``full`` recomputes every
    transformer layer from its input, one layer per checkpointed unit.
    """
    if granularity == "selective":
        return {"recompute_granularity": "selective"}
    if granularity == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    return {}


def kernel_fields(transformer_impl: str) -> dict[str, Any]:
    """``TransformerConfig`` fields of the fused kernels ``transformer_impl`` brings.

    TE's layers: TE's fused RoPE, taking a THD row whole through its ``cu_seqlens``. The
    local layers keep the unfused RoPE, fed per-token angles (``rope.py``)."""
    fuses_norms(transformer_impl)  # an unknown impl fails here
    if transformer_impl == "transformer_engine":
        return {"apply_rope_fusion": True}
    return {}


def fuses_norms(transformer_impl: str) -> bool:
    """Whether ``transformer_impl``'s layers hold the pre-attention and pre-MLP norms inside
    the following linear (TE) instead of as modules of their own (local): the
    ``fused_norms`` that ``convert.param_map`` / ``hf_to_megatron`` need for its model."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(
            f"unknown transformer impl {transformer_impl!r}; choose from "
            f"{', '.join(TRANSFORMER_IMPLS)}"
        )
    return transformer_impl == "transformer_engine"


def build_gpt_model(
    hf_config: Any,
    tcfg: Any,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    layer_spec: ModuleSpec | TransformerBlockSubmodules | None = None,
    transformer_impl: str = "local",
) -> PackedRowGPTModel:
    """A randomly initialised ``GPTModel`` of ``hf_config``'s architecture on this rank.

    ``tcfg`` comes from ``convert.transformer_config_from_hf``; megatron's parallel
    state must be initialised with the same tensor-parallel size. ``layer_spec``
    defaults to the block spec of ``transformer_impl``: ``local_block_spec``
    (megatron-core's layers that run without TransformerEngine, QK-layernorm as
    ``tcfg`` says, ``RMSNorm`` norms) or ``te_block_spec`` (the same architecture in
    TE's layers, GPU only).
    """
    apply_cpu_shims()
    extra = gpt_extra(hf_config, tp=tcfg.tensor_model_parallel_size)
    if layer_spec is None:
        fuses_norms(transformer_impl)  # an unknown impl fails here, before any building
        if tcfg.normalization != "RMSNorm":
            raise ValueError(f"only RMSNorm models are supported, not {tcfg.normalization}")
        layer_spec = BLOCK_SPECS[transformer_impl](tcfg)
    return PackedRowGPTModel(
        tcfg,
        layer_spec,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        hf_vocab_size=extra.vocab_size,
        padding_idx=extra.padding_idx,
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


def stage_forward(model: PackedRowGPTModel, packed: PackedBatch) -> torch.Tensor:
    """This pipeline stage's output for a packed row: vocab-parallel logits ``[1, L, V/TP]``
    on the last stage, hidden states ``[L, 1, H]`` (``L/TP`` under sequence parallel)
    elsewhere. Stages after the first read their input from ``set_input_tensor``."""
    if packed.shares_prompts and model.config.apply_rope_fusion:
        # TE's fused RoPE restarts every run of cu_seqlens at position 0.
        raise ValueError("a row with shared prompts needs the unfused, per-token RoPE")
    return model(
        packed.input_ids,
        packed.position_ids,
        None,
        packed_seq_params=packed_seq_params(packed),
    )


def block_mask_forward(model: PackedRowGPTModel, packed: PackedBatch) -> torch.Tensor:
    """``stage_forward`` the older way: the row as one sequence under ``block_causal_mask``
    (``L x L`` booleans: fine for CPU-sized rows), megatron-core's dense attention."""
    return model(packed.input_ids, packed.position_ids, block_causal_mask(packed.position_ids))


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
