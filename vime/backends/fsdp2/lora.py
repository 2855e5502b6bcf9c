"""LoRA on the fsdp2 backend: peft's adapters injected into the HF model, and their names.

Where it fits: with ``--lora-rank R`` ``FSDP2Backend`` calls ``inject`` on the model
before it is sharded (on rank 0's loaded copy and on every rank's meta copy, so
the broadcast carries rank 0's seeded adapter init). peft's layers stay inside
the HF model (no ``PeftModel`` wrapper): decoder blocks, ``fully_shard`` and the
forward are unchanged; the base weights are frozen, the adapters are the only
trainable parameters. ``adapters_disabled`` turns the model back into its base,
which is the KL reference. ``wire_name`` maps a parameter to the HF / wire name
(``vime.weights.lora``, which also writes the PEFT folder of an export).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vime.errors import ConfigError
from vime.weights.lora import LoraSettings, peft_config

_ADAPTER = "default"  # peft's name of the one adapter
_SAVED, _ORIGINAL = "modules_to_save", "original_module"  # peft's ModulesToSaveWrapper


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what targets can name)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _is_linear(m) and name}
    )


def _is_linear(module: torch.nn.Module) -> bool:
    return type(module) is torch.nn.Linear


def inject(model: torch.nn.Module, settings: LoraSettings, seed: int) -> bool:
    """Give every target linear layer of ``model`` an adapter (A seeded from ``seed``,
    B zero, so the model starts as its base) and freeze everything else; return whether
    a saved module's weight is tied to another's (``peft_config``'s ``tied``).

    A target that names no linear layer of the model raises ``ConfigError`` listing
    the names that would.
    """
    from peft import inject_adapter_in_model

    linear = linear_module_names(model)
    missing = [t for t in settings.target_modules if t not in linear]
    if missing:
        raise ConfigError(
            f"--lora-target-modules {','.join(missing)} names no linear layer of this model; "
            f"its linear layers are: {', '.join(linear)}"
        )
    tied = _saved_modules_tied(model, settings.modules_to_save)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(settings, tied=tied), model)
    for name, param in model.named_parameters():
        param.requires_grad_(trains(name))
    return tied


def _saved_modules_tied(model: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """Whether a module ``names`` match (peft's match: the name's end) shares a weight
    with another module (a tied head's embedding). A name that matches nothing raises
    ``ConfigError`` listing the modules that have weights."""
    modules = dict(model.named_modules())
    owners: dict[int, set[str]] = {}
    for module_name, module in modules.items():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(module_name)
    tied = False
    for target in names:
        matched = [n for n in modules if n == target or n.endswith(f".{target}")]
        if not matched:
            leaves = {n.rsplit(".", 1)[-1] for n, m in modules.items() if _owns_weights(m)}
            raise ConfigError(
                f"--lora-modules-to-save {target} names no module of this model; its modules "
                f"with weights are: {', '.join(sorted(leaves))}"
            )
        params = (p for n in matched for p in modules[n].parameters())
        tied = tied or any(len(owners[id(p)]) > 1 for p in params)
    return tied


def _owns_weights(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def store_base(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Keep the frozen base weights in ``dtype`` (the compute dtype: bf16 on a GPU).

    FSDP2 casts every weight to its compute dtype for each forward, so a base that never
    changes, rounded once here, computes bit for bit as an fp32 base would, at half the
    memory; the adapters stay fp32 master weights. FSDP2 asks one dtype only of the
    parameters that train. A merged export reads the base back from the checkpoint
    (``FSDP2Backend.weight_buckets``): written from this copy, it would be rounded.
    """
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(dtype)


def is_adapter(param_name: str) -> bool:
    """Whether a parameter of an injected model is a LoRA A or B."""
    return f".lora_A.{_ADAPTER}." in param_name or f".lora_B.{_ADAPTER}." in param_name


def is_saved_copy(param_name: str) -> bool:
    """Whether it is the trained copy of a ``--lora-modules-to-save`` module."""
    return f".{_SAVED}.{_ADAPTER}." in param_name


def is_original(param_name: str) -> bool:
    """Whether it is the frozen original of a ``--lora-modules-to-save`` module (the
    reference's; the engines serve the trained copy under the same HF name)."""
    return f".{_ORIGINAL}." in param_name


def trains(param_name: str) -> bool:
    """Whether a parameter of an injected model trains: adapters and saved copies."""
    return is_adapter(param_name) or is_saved_copy(param_name)


def wire_name(param_name: str) -> str:
    """A parameter's HF name on the wire: the base weight under its checkpoint name, an
    adapter as ``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight``, a saved module's
    original and trained copy both under the module's own name."""
    name = param_name.replace(".base_layer.", ".").replace(f".{_ORIGINAL}.", ".")
    name = name.replace(f".{_SAVED}.{_ADAPTER}.", ".")
    return name.replace(f".lora_A.{_ADAPTER}.", ".lora_A.").replace(
        f".lora_B.{_ADAPTER}.", ".lora_B."
    )


def adapter_layers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """peft's adapted layers of ``model``, and its wrappers of saved modules."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    kinds = (BaseTunerLayer, ModulesToSaveWrapper)
    return (m for m in model.modules() if isinstance(m, kinds))


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """``model`` computes as its base inside the block (the adapters are skipped, not
    zeroed: no weight changes, so leaving the block restores it exactly)."""
    layers = list(adapter_layers(model))
    adapters = [p for n, p in model.named_parameters() if trains(n)]
    for layer in layers:
        layer.enable_adapters(False)
    # peft also freezes them; FSDP2 reads which parameters train at the first forward
    # (a run's first is the reference's) and would then reduce no adapter gradient in fp32.
    for param in adapters:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def set_dropout(model: torch.nn.Module, training: bool) -> None:
    """Adapter dropout on (the update's forward) or off (log-prob passes)."""
    for layer in adapter_layers(model):
        for dropout in getattr(layer, "lora_dropout", {}).values():
            dropout.train(training)
