"""The backend registry: names -> flag functions and actor classes, by import path.

Proves that every registered backend's flag adder and validator resolve, that
its flags carry no name another backend also declares (so a misplaced flag is
attributable), that each backend's settings are frozen and are what the training
ranks' settings hold, that the choices of --train-backend are exactly the
registry's, and that unknown names and malformed paths fail with a clear message.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from vime.backends import registry
from vime.config import build_parser, parse_args
from vime.config.train_settings import train_settings


def _flags_of(name: str) -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    registry.flag_adder(name)(parser)
    return {opt for action in parser._actions for opt in action.option_strings}


def test_both_backends_registered_with_fsdp2_default() -> None:
    assert registry.backend_names() == ("fsdp2", "megatron")
    assert registry.DEFAULT_BACKEND == "fsdp2"


@pytest.mark.parametrize("name", registry.backend_names())
def test_flag_functions_resolve(name: str) -> None:
    flags = _flags_of(name)
    assert flags, f"{name} declares no flags"
    assert callable(registry.validator(name))
    # Backend flags must not shadow a common flag.
    common = {opt for a in build_parser(None)._actions for opt in a.option_strings}
    assert not flags & common


@pytest.mark.parametrize("name", registry.backend_names())
def test_backend_settings_are_frozen_and_reach_the_ranks(name: str) -> None:
    args = parse_args(["--train-backend", name, "--prompt-data", "builtin:reverse"])
    settings = registry.settings_maker(name)(args)
    assert dataclasses.is_dataclass(settings) and settings.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.param_dtype = "float32"
    assert train_settings(args).backend == settings


def test_backend_flag_sets_are_disjoint() -> None:
    assert not _flags_of("fsdp2") & _flags_of("megatron")


def test_megatron_flags_are_prefixed() -> None:
    assert all(flag.startswith("--megatron-") for flag in _flags_of("megatron"))


def test_train_backend_choices_come_from_registry() -> None:
    action = next(a for a in build_parser(None)._actions if a.dest == "train_backend")
    assert tuple(action.choices) == registry.backend_names()


def test_unknown_backend_lists_choices() -> None:
    with pytest.raises(registry.UnknownBackendError, match="choose from: fsdp2, megatron"):
        registry.get_backend("jax")


def test_resolve_rejects_malformed_path() -> None:
    with pytest.raises(ValueError, match="module:attribute"):
        registry.resolve("vime.backends.registry")
    assert registry.resolve("vime.backends.registry:get_backend") is registry.get_backend
