"""Backend registry: ``--train-backend`` name -> ``TrainBackend`` class and flag functions.

Where it fits: the only module that names a backend. The CLI asks it for the
choices of ``--train-backend`` and for the selected backend's flags;
``policy_actor.make_actor`` asks it for the backend's ``TrainBackend`` class
(``interface.py``) to put in a training rank, so a new backend is a package and one
``BackendSpec`` line here. Everything is given by import path and resolved on
demand, so ``vime-train --help`` imports no backend (and no torch).

A backend's flag module (``add_flags`` / ``validate`` / ``settings``) must stay
light: argparse only, no torch, no backend library. ``validate(args)`` checks the
backend's own flags against the rest of the configuration, raises ``ConfigError``
with a one-line message, and returns the data-parallel size the backend will run
with. ``settings(args)`` turns the validated flags into the backend's own frozen
settings, which ``vime.config.train_settings`` puts in the ranks' ``TrainSettings``
(``backend``): the backend itself reads no flag.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackendSpec:
    """One training backend, every part of it named by ``module:attribute``."""

    name: str
    summary: str
    backend: str  # a vime.backends.interface.TrainBackend class
    add_flags: str
    validate: str
    settings: str  # (args) -> the backend's own frozen settings
    # Trains LoRA adapters (--lora-rank); a backend without them is refused at start-up.
    lora: bool = False


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(
            name="fsdp2",
            summary="HF transformers causal LM sharded with torch fully_shard",
            backend="vime.backends.fsdp2.backend:FSDP2Backend",
            add_flags="vime.backends.fsdp2.flags:add_flags",
            validate="vime.backends.fsdp2.flags:validate",
            settings="vime.backends.fsdp2.flags:settings",
            lora=True,
        ),
        BackendSpec(
            name="megatron",
            summary="megatron-core GPTModel (tensor/pipeline parallel)",
            backend="vime.backends.megatron.backend:MegatronBackend",
            add_flags="vime.backends.megatron.flags:add_flags",
            validate="vime.backends.megatron.flags:validate",
            settings="vime.backends.megatron.flags:settings",
        ),
    )
}

DEFAULT_BACKEND = "fsdp2"


class UnknownBackendError(ValueError):
    """``--train-backend`` names no registered backend."""


def backend_names() -> tuple[str, ...]:
    """The registered backend names, in registration order."""
    return tuple(BACKENDS)


def get_backend(name: str) -> BackendSpec:
    """The spec registered under ``name``; the error lists the choices."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown --train-backend {name!r}; choose from: {', '.join(BACKENDS)}"
        ) from None


def resolve(path: str) -> Any:
    """Import ``module:attribute`` and return the attribute."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected 'module:attribute', got {path!r}")
    return getattr(importlib.import_module(module_name), attr)


def flag_adder(name: str) -> Callable[[Any], None]:
    """The function that adds backend ``name``'s own flags to an argparse parser."""
    return resolve(get_backend(name).add_flags)


def validator(name: str) -> Callable[[Any], int]:
    """The function that validates backend ``name``'s flags and returns the DP size."""
    return resolve(get_backend(name).validate)


def settings_maker(name: str) -> Callable[[Any], Any]:
    """The function that turns the flags into backend ``name``'s own frozen settings."""
    return resolve(get_backend(name).settings)


def backend_class(name: str) -> type:
    """The ``TrainBackend`` class of backend ``name`` (imports the backend). Not typed as
    one: importing that interface would close an import circle (its ``TrainSettings``
    holds ``LoraSettings``, whose defaults are ``vime.config.lora_flags``', which
    imports this registry)."""
    return resolve(get_backend(name).backend)
