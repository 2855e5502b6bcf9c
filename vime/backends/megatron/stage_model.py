"""This rank's part of the model: its pipeline stage's ``GPTModel``, loaded with its
tensor-parallel shard of the HF checkpoint.

Where it fits: ``MegatronBackend.setup`` calls ``load_stage_model`` once the process
groups and the rank's pipeline stage exist. The model is megatron-core's, built by
``model.build_gpt_model`` from the ``TransformerConfig`` that
``convert.transformer_config_from_hf`` makes of the HF config and the megatron
settings (``flags.MegatronSettings``), and filled through ``convert.hf_to_megatron``
from only the checkpoint tensors its stage holds.
"""

from __future__ import annotations

from typing import Any

import torch

from vime.backends.base import TrainSettings
from vime.backends.dropout import model_config
from vime.backends.megatron import convert, pipeline
from vime.backends.megatron import model as mmodel
from vime.weights.hf_files import LazyHFState


def load_stage_model(
    settings: TrainSettings,
    hf_config: Any,
    stage: pipeline.Stage,
    *,
    tp_rank: int,
    param_dtype: torch.dtype,
    device: torch.device,
) -> tuple[mmodel.PackedRowGPTModel, dict[str, tuple[int, ...]]]:
    """``stage``'s ``GPTModel`` on ``device`` with this rank's TP shard of the HF checkpoint
    loaded, and the shape of every tensor the checkpoint holds (by HF name)."""
    own = settings.backend  # flags.MegatronSettings
    tp, pp = int(own.tp), int(own.pp)
    pipelined = pp > 1
    tcfg, _ = convert.transformer_config_from_hf(
        # Dropout off in every RL forward unless --keep-dropout (vime.backends.dropout).
        model_config(hf_config, settings.keep_dropout),
        tp=tp,
        params_dtype=param_dtype,
        sequence_parallel=bool(own.sequence_parallel),
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=stage.first_stage_layers,
        num_layers_in_last_pipeline_stage=stage.last_stage_layers,
        # Packed rows differ in length; vime's loss carries its own normalizers.
        variable_seq_lengths=pipelined,
        # Keeps megatron's schedule and DDP wrapper from rescaling vime's loss.
        calculate_per_token_loss=pipelined or bool(own.distributed_optimizer),
        # Dense models have no MoE, but megatron-core refuses variable_seq_lengths
        # beside its default (allgather) token dispatcher.
        **({"moe_token_dispatcher_type": "alltoall"} if pipelined else {}),
        **mmodel.recompute_fields(own.recompute_granularity),
        **mmodel.kernel_fields(own.transformer_impl),
    )
    model = mmodel.build_gpt_model(
        hf_config,
        tcfg,
        pre_process=stage.is_first,
        post_process=stage.is_last,
        transformer_impl=own.transformer_impl,
    )
    # megatron-core builds its layers on the GPU, but leaves modules it did not make
    # where they were made; the whole model goes to this rank's device.
    model.to(device)
    # Every rank reads, one tensor at a time, only what its stage holds, and keeps its
    # TP shard: host memory is this rank's share, not a whole checkpoint per rank.
    hf_state = LazyHFState(settings.hf_checkpoint)
    hf_shapes = {name: hf_state.shape(name) for name in hf_state}
    local_keys = [k for k in model.state_dict() if not k.endswith("_extra_state")]
    full = convert.hf_to_megatron(
        hf_state,
        hf_config,
        tp_rank,
        tp,
        fused_norms=mmodel.fuses_norms(own.transformer_impl),
        only={stage.global_name(k) for k in local_keys},
    )
    mmodel.load_megatron_state(model, {k: full[stage.global_name(k)] for k in local_keys})
    model.train()
    return model, hf_shapes
