"""Build an HF causal LM sharded with ``fully_shard``: process group, mesh, load, wrap.

Where it fits: ``FSDP2Actor.init`` calls ``init_distributed``, ``build_mesh``
and ``load_sharded_model``; everything about how parameters are placed lives
here, so the actor only trains.

Loading keeps one full host copy per job, not one per rank: every rank builds
the model on the meta device and shards it; rank 0 alone reads the checkpoint
and broadcasts the full state into everyone's shards. Non-persistent buffers
(rotary frequencies) are not in a state dict, so they are broadcast too.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from vime import device as vime_device
from vime.backends import varlen_attention


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or start) the default process group: NCCL on GPU, gloo on CPU.

    The launcher (Ray train group, torchrun, or a test) sets RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT; a lone process with none of them is rank 0 of 1.
    """
    device = vime_device.local_device()
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend=vime_device.process_group_backend(device))
    return dist.get_rank(), dist.get_world_size(), device


def build_mesh(mode: str, world: int, shard_size: int | None, device: torch.device) -> DeviceMesh:
    """1-D mesh for ``full``; (replicas, shard) for ``hybrid``; (world, 1) for ``no_shard``."""
    if mode == "full":
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    shard = shard_size if mode == "hybrid" else 1
    assert shard is not None and world % shard == 0, (mode, world, shard)
    return init_device_mesh(
        device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard")
    )


def resolve_attn_implementation(
    name: str, device: torch.device, param_dtype: torch.dtype, hf_config: Any = None
) -> str:
    """``auto``: flash-attention (varlen over packed rows) on GPU when installed and the
    compute dtype is 16-bit, which is all it supports; otherwise ``varlen_sdpa``, torch's
    attention per sample of the packed row (``vime.backends.varlen_attention``), which
    this call registers with transformers -- unless ``hf_config`` has sliding-window
    layers, which only ``sdpa`` (the same math over the whole row under a block mask)
    also handles."""
    if name == "auto":
        half = param_dtype in (torch.bfloat16, torch.float16)
        sliding = "sliding_attention" in (getattr(hf_config, "layer_types", None) or ())
        if half and vime_device.has_flash_attn():
            name = "flash_attention_2"
        else:
            name = "sdpa" if sliding else varlen_attention.HF_NAME
    if name == varlen_attention.HF_NAME:
        varlen_attention.register_hf()
    return name


def find_block_classes(model: torch.nn.Module, names: str | None) -> tuple[type, ...]:
    wanted = set(names.split(",")) if names else set(getattr(model, "_no_split_modules", []) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in wanted}
    if not classes:
        raise ValueError(
            f"no decoder block class found to shard (looked for {sorted(wanted) or 'nothing'}); "
            "name them with --fsdp-block-classes"
        )
    return tuple(classes)


def shard_model(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    block_classes: str | None,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool,
) -> None:
    """``fully_shard`` every decoder block, then a root group for what is left.

    The root group claims the embeddings, final norm and lm_head: left out,
    they would stay replicated plain tensors whose gradients nobody reduces.
    Gradients are summed over ranks (divide factor 1) because each micro-batch
    loss is already divided by the step's global normalizers.
    """
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "reshard_after_forward": reshard_after_forward,
    }
    if cpu_offload:
        # Pinned host memory needs an accelerator. On a CPU-only run the shards already
        # live in host memory, so the policy changes nothing but runs the same code path.
        pin = vime_device.is_cuda(mesh.device_type)
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
    classes = find_block_classes(model, block_classes)
    blocks = [m for m in model.modules() if isinstance(m, classes)]
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    for module in [*blocks, model]:
        module.set_gradient_divide_factor(1.0)
        # Plain SUM collectives: gloo has no PREMUL_SUM, and factor 1 leaves nothing to scale.
        module.set_force_sum_reduction_for_comms(True)
    check_every_parameter_sharded(model, mesh.size())


def check_every_parameter_sharded(model: torch.nn.Module, world: int) -> None:
    """Fail fast when a trainable parameter sits outside every ``fully_shard`` group."""
    if world == 1:
        return
    for name, param in model.named_parameters():
        if param.requires_grad and not isinstance(param, DTensor):
            raise RuntimeError(
                f"parameter {name} is outside every fully_shard group: its gradient would "
                "never be reduced across ranks"
            )


def load_sharded_model(
    hf_checkpoint: str,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    attn_implementation: str,
    shard_kwargs: dict[str, Any],
) -> torch.nn.Module:
    """The checkpoint's model in fp32 master weights, sharded over ``mesh``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_checkpoint)
    rank = dist.get_rank()
    full_state, full_buffers = {}, {}
    if rank == 0:
        full = AutoModelForCausalLM.from_pretrained(
            hf_checkpoint, dtype=torch.float32, attn_implementation=attn_implementation
        )
        full_state = full.state_dict()
        full_buffers = dict(full.named_buffers())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    shard_model(model, mesh, **shard_kwargs)
    model.to_empty(device=device)
    set_model_state_dict(
        model,
        {k: v.to(device) for k, v in full_state.items()},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if rank == 0:
                buf.copy_(full_buffers[name])
            dist.broadcast(buf, src=0)
    return model
