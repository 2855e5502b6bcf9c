"""One training rank under the fsdp2 backend: the HF model as it is, no ``fully_shard``.

Where it fits: ``FSDP2Backend.setup`` loads the model here when it trains alone
(``uses_plain_model``), else through ``model.load_sharded_model``. One rank has
nothing to shard and no gradient to reduce, yet FSDP2 would still run its hooks,
copy every group in and out and send each optimizer op through DTensor dispatch;
here parameters, gradients and AdamW state are ordinary tensors. In fp32 that is
FSDP2's math at one rank, bit for bit. A lower ``--fsdp-param-dtype`` is kept by
``cast_for_compute``: the weights of each group FSDP2 would form are cast for
that group's forward, as ``MixedPrecisionPolicy`` casts them, and their gradients
flow back into the fp32 master weights. ``--fsdp-cpu-offload`` is FSDP2's, so it
keeps the sharded path even at one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from vime.backends.fsdp2.model import group_modules, load_full_model


def uses_plain_model(world: int, cpu_offload: bool) -> bool:
    """Whether the model trains unsharded: one rank, and no host offload asked for."""
    return world == 1 and not cpu_offload


def load_plain_model(
    hf_checkpoint: str,
    *,
    device: torch.device,
    attn_implementation: str,
    param_dtype: torch.dtype,
    block_classes: str | None,
    adapt: Callable[[torch.nn.Module], None] | None = None,
    config: Any = None,
) -> torch.nn.Module:
    """The checkpoint's model in fp32 master weights on ``device``, computing in
    ``param_dtype`` (arguments as ``load_sharded_model``'s)."""
    model = load_full_model(hf_checkpoint, config, attn_implementation, adapt)
    model.train()  # as the sharded path's from_config builds it; from_pretrained evals
    # The groups FSDP2 would form; a misspelt --fsdp-block-classes fails here as there.
    groups = group_modules(model, block_classes)
    model.to(device)
    if param_dtype != torch.float32:
        cast_for_compute(groups, param_dtype)
    return model


def cast_for_compute(groups: Sequence[torch.nn.Module], dtype: torch.dtype) -> None:
    """Run each of ``groups`` (innermost first, the root last) in ``dtype``: for its
    forward, the floating parameters it holds (those no inner group does) and its
    floating inputs are cast, as FSDP2's ``MixedPrecisionPolicy`` casts a group's.

    The casts are differentiable copies, so gradients reach the fp32 parameters (in
    fp32, as FSDP2 reduces them by default). A tied weight is cast once per group, its
    uses share the copy. A recomputed block (gradient checkpointing) casts again.
    """
    claimed: set[int] = set()
    for group in groups:
        slots = [
            (owner, name)
            for owner in group.modules()
            for name, param in owner._parameters.items()
            if param is not None and param.is_floating_point() and id(param) not in claimed
        ]
        claimed |= {id(owner._parameters[name]) for owner, name in slots}
        _GroupCast(slots, dtype).attach(group)


class _GroupCast:
    """One group's cast: swapped into its modules before its forward, undone after."""

    def __init__(self, slots: list[tuple[torch.nn.Module, str]], dtype: torch.dtype) -> None:
        self.slots, self.dtype = slots, dtype
        self.swapped: list[list[tuple[torch.nn.Module, str, torch.Tensor]]] = []

    def attach(self, group: torch.nn.Module) -> None:
        group.register_forward_pre_hook(self.before, with_kwargs=True)
        # always_call: a forward that raises (checkpoint's early stop of a recomputation
        # does) still gets its parameters back.
        group.register_forward_hook(self.after, always_call=True)

    def before(self, _group: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        copies: dict[int, torch.Tensor] = {}
        swapped = []
        for owner, name in self.slots:
            param = owner._parameters[name]
            if param.dtype == self.dtype:
                continue  # LoRA's frozen base, stored in the compute dtype already
            if id(param) not in copies:
                copies[id(param)] = param.to(self.dtype)
            # A plain tensor in ``_parameters``, as torch.func.functional_call swaps one in.
            owner._parameters[name] = copies[id(param)]
            swapped.append((owner, name, param))
        self.swapped.append(swapped)
        return _cast_floating(args, self.dtype), _cast_floating(kwargs, self.dtype)

    def after(self, _group: torch.nn.Module, _args: Any, _output: Any) -> None:
        for owner, name, param in self.swapped.pop():
            owner._parameters[name] = param


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor in it (through tuples, lists and dicts) cast."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if type(value) in (tuple, list):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if type(value) is dict:
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value
