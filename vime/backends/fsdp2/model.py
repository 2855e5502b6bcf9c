"""Build an HF causal LM sharded with ``fully_shard``: process group, mesh, load, wrap.

Where it fits: ``FSDP2Backend.setup`` calls ``init_distributed``, ``build_mesh``
and ``load_sharded_model``; everything about how parameters are placed lives
here (and, at world size 1, in ``plain.py``, which loads the model unsharded),
so the actor only trains.

Loading keeps one full host copy per job, not one per rank: every rank builds
the model on the meta device and shards it; rank 0 alone reads the checkpoint
and broadcasts the full state into everyone's shards. Non-persistent buffers
(rotary frequencies) are not in a state dict, so they are broadcast too.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
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
    """``auto``: ``varlen_sdpa``, attention per sample of the packed row
    (``vime.backends.varlen_attention``: one varlen flash kernel a layer on a GPU in 16
    bits, sdpa buckets elsewhere; it also reads rows whose samples share their prompt),
    which this call registers with transformers -- unless ``hf_config`` has
    sliding-window layers, which it does not handle: those get transformers'
    ``flash_attention_2`` on a GPU with flash-attn and 16-bit compute, else ``sdpa``
    (the same math over the whole row under a block mask)."""
    if name == "auto":
        half = param_dtype in (torch.bfloat16, torch.float16)
        sliding = "sliding_attention" in (getattr(hf_config, "layer_types", None) or ())
        if not sliding:
            name = varlen_attention.HF_NAME
        else:
            name = "flash_attention_2" if half and vime_device.has_flash_attn() else "sdpa"
    if name == varlen_attention.HF_NAME:
        varlen_attention.register_hf()
    return name


def find_block_classes(model: torch.nn.Module, names: str | None) -> tuple[type, ...]:
    """The classes ``fully_shard`` wraps one by one: ``names`` (comma-separated class names,
    from ``--fsdp-block-classes``), else the model's ``_no_split_modules``.

    Every explicitly named class must exist in the model: a misspelt name next to a valid
    one would otherwise silently leave that class unwrapped.
    """
    present = {type(m).__name__: type(m) for m in model.modules()}
    declared = sorted(n for n in getattr(model, "_no_split_modules", None) or [] if n in present)
    if names:
        wanted = {n.strip() for n in names.split(",") if n.strip()}
        missing = sorted(wanted - present.keys())
        if missing:
            has = ", ".join(declared) if declared else "none declared in _no_split_modules"
            raise ValueError(
                f"--fsdp-block-classes names {', '.join(missing)}, not a module class of this "
                f"model (its decoder blocks: {has})"
            )
    else:
        wanted = set(declared)
    if not wanted:
        raise ValueError(
            "no decoder block class found to shard (the model declares none in "
            "_no_split_modules); name them with --fsdp-block-classes"
        )
    return tuple(present[n] for n in sorted(wanted))


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
    """``fully_shard`` every decoder block (innermost first), then a root group for what is
    left.

    The root group claims the embeddings, final norm and lm_head: left out,
    they would stay replicated plain tensors whose gradients nobody reduces.
    Gradients are summed over ranks (divide factor 1) because each micro-batch
    loss is already divided by the step's global normalizers.

    ``reshard_after_forward`` applies to every block but the last (and the blocks inside
    it): backward starts there, and ends in the root, so resharded after forward their
    weights would be freed only to be all-gathered again at once. Those stay gathered
    until their backward (or ``FSDP2Backend.release_gathered`` after a forward alone).
    """
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if cpu_offload:
        # Pinned host memory needs an accelerator. On a CPU-only run the shards already
        # live in host memory, so the policy changes nothing but runs the same code path.
        pin = vime_device.is_cuda(mesh.device_type)
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
    blocks = group_modules(model, block_classes)[:-1]
    first_in_backward = set(blocks[-1].modules())
    for block in blocks:
        reshard = reshard_after_forward and block not in first_in_backward
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    check_every_parameter_sharded(model, mesh.size())
    for module in [*blocks, model]:
        module.set_gradient_divide_factor(1.0)
        # Plain SUM collectives: gloo has no PREMUL_SUM, and factor 1 leaves nothing to scale.
        module.set_force_sum_reduction_for_comms(True)


def group_modules(model: torch.nn.Module, block_classes: str | None) -> list[torch.nn.Module]:
    """The modules that each hold one group of weights, innermost first: every decoder block
    (``find_block_classes``), then the root, which holds what no block does.

    Descendants before ancestors (``modules()`` is pre-order): each group claims the
    parameters no inner group holds yet, so nested block classes (a decoder layer and its
    MLP) become nested groups. Parent first, ``fully_shard`` would take the MLP's weights
    and the MLP's own group would then try to shard DTensors again. Siblings keep model
    order.
    """
    classes = find_block_classes(model, block_classes)
    return [m for m in _post_order(model) if isinstance(m, classes)] + [model]


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


def materialize_device(device: torch.device, cpu_offload: bool) -> torch.device:
    """Where the meta-built shards get their storage: the host under ``--fsdp-cpu-offload``
    (FSDP2's CPU offload refuses parameters anywhere else), else the rank's device."""
    return torch.device("cpu") if cpu_offload else device


def _buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Move every buffer (not the parameters) to ``device``: CPU offload keeps only the
    shards on the host; the forward still runs on the device and needs the rotary tables
    there."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def load_sharded_model(
    hf_checkpoint: str,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    attn_implementation: str,
    shard_kwargs: dict[str, Any],
    adapt: Callable[[torch.nn.Module], None] | None = None,
    config: Any = None,
) -> torch.nn.Module:
    """The checkpoint's model in fp32 master weights, sharded over ``mesh``.

    ``config`` is the HF config to build it from (default: the checkpoint's own; the
    actor passes ``vime.backends.dropout.model_config`` of it).

    ``adapt`` changes the model before it is sharded (LoRA adds its adapters): it runs
    on rank 0's loaded copy, whose values every rank receives, and on each rank's meta
    copy, which must come out with the same parameters.

    The returned model's ``config`` says float32 (``from_config`` records the dtype it
    built in); the checkpoint's own dtype is in ``AutoConfig.from_pretrained``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if config is None:
        config = AutoConfig.from_pretrained(hf_checkpoint)
    rank = dist.get_rank()
    full_state, full_buffers = {}, {}
    if rank == 0:
        full_state, full_buffers = _full_state(hf_checkpoint, config, attn_implementation, adapt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation
        )
        if adapt is not None:
            adapt(model)
    shard_model(model, mesh, **shard_kwargs)
    home = materialize_device(device, bool(shard_kwargs.get("cpu_offload")))
    model.to_empty(device=home)
    if home != device:
        _buffers_to(model, device)
    # Host tensors: the broadcast moves one tensor at a time to the process group's device,
    # so rank 0 never holds a second full copy of the model there.
    set_model_state_dict(
        model,
        full_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if rank == 0:
                buf.copy_(full_buffers[name])
            dist.broadcast(buf, src=0)
    return model


def _full_state(
    hf_checkpoint: str,
    config: Any,
    attn_implementation: str,
    adapt: Callable[[torch.nn.Module], None] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Rank 0's whole model, loaded in fp32 and adapted: its state and its buffers."""
    full = load_full_model(hf_checkpoint, config, attn_implementation, adapt)
    return full.state_dict(), dict(full.named_buffers())


def load_full_model(
    hf_checkpoint: str,
    config: Any,
    attn_implementation: str,
    adapt: Callable[[torch.nn.Module], None] | None,
) -> torch.nn.Module:
    """The checkpoint's whole model on the host, in fp32 and adapted (``load_sharded_model``
    says what ``config`` and ``adapt`` are)."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(
        hf_checkpoint,
        config=copy.deepcopy(config),
        dtype=torch.float32,
        attn_implementation=attn_implementation,
    )
    if adapt is not None:
        adapt(full)
    return full


def _post_order(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module`` and its descendants, each after all of its children."""
    for child in module.children():
        yield from _post_order(child)
    yield module
