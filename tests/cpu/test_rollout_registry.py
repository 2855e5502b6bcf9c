"""The rollout side's seams: engine names -> specs, transport names -> classes.

Proves that ``--rollout-engine`` accepts exactly ``auto`` and the registered engines,
that an unknown engine name fails with one line naming the choices, that every part
an engine spec names resolves (builder, import check and fix, flag functions) and its
flags land in the parser, and that ``EngineActor`` builds through the registry (an
in-process hf engine on a tiny checkpoint). On the transport side: ``--weight-sync``
accepts exactly ``auto`` and the registered transports (``vime.ray.transport_names``
lists the same, each with its description), each name resolves to its class, an
unknown one fails in one line naming the choices, and each transport takes its own
small frozen settings from the run's flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
from tiny_models import save_tiny, tiny_qwen3_config

from vime.backends.registry import resolve
from vime.config import build_parser, parse_args
from vime.config.rollout_flags import WEIGHT_SYNC_TRANSPORTS
from vime.config.settings import sync_settings
from vime.errors import ConfigError
from vime.ray import transport_names, transports
from vime.rollout.engines import registry


def _choices(dest: str) -> tuple[str, ...]:
    action = next(a for a in build_parser(None)._actions if a.dest == dest)
    return tuple(action.choices)


def test_rollout_engine_choices_are_auto_and_the_registry() -> None:
    assert registry.engine_names() == ("vllm", "hf")
    assert _choices("rollout_engine") == ("auto", *registry.engine_names())
    assert parse_args([]).rollout_engine == "auto"
    for name in registry.engine_names():
        assert registry.get_engine(name).name == name


def test_unknown_engine_fails_in_one_line_naming_the_choices() -> None:
    with pytest.raises(registry.UnknownEngineError) as refused:
        registry.get_engine("sglang")
    assert str(refused.value) == "unknown rollout engine 'sglang'; choose from: vllm, hf"
    with pytest.raises(registry.UnknownEngineError, match=r"choose from: vllm, hf$"):
        registry.build_engine("sglang", "/nowhere", registry.EngineOptions())


@pytest.mark.parametrize("name", registry.engine_names())
def test_every_part_of_an_engine_spec_resolves(name: str) -> None:
    spec = registry.get_engine(name)
    parts = [spec.builder, spec.import_check, spec.import_fix, spec.add_flags, spec.validate]
    for path in filter(None, parts):
        assert callable(resolve(path)), path
    if spec.add_flags:
        scratch = argparse.ArgumentParser(add_help=False)
        resolve(spec.add_flags)(scratch)
        common = {opt for a in build_parser(None)._actions for opt in a.option_strings}
        own = {opt for a in scratch._actions for opt in a.option_strings}
        assert own and own <= common  # every engine's flags parse, whichever is chosen


def test_tensor_parallel_engines_and_auto_fall_back_to_one_that_needs_no_import() -> None:
    assert registry.tensor_parallel_names() == "vllm"
    assert registry.FALLBACK_ENGINE in registry.AUTO_ORDER
    assert registry.get_engine(registry.FALLBACK_ENGINE).import_check is None
    assert registry.import_error(registry.FALLBACK_ENGINE) is None
    with pytest.raises(
        RuntimeError, match=r"^auto: no rollout engine imports here: no vllm; no hf$"
    ):
        registry.resolve_engine("auto", importable=lambda name: f"no {name}")
    assert registry.resolve_engine("auto", importable=lambda name: None) == (
        "vllm",
        "auto: vllm is importable",
    )
    missing = {"vllm": "vllm is not installed"}
    assert registry.resolve_engine("auto", importable=missing.get) == (
        "hf",
        "auto: vllm is not installed",
    )


def test_auto_that_may_choose_an_engine_without_in_flight_updates_refuses_max_staleness(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--max-staleness`` with ``auto`` is judged while parsing, on every engine auto may
    choose: the embedded model's engine only, without ``--hf-checkpoint``."""
    vllm = dataclasses.replace(registry.get_engine("vllm"), in_flight_updates=False)
    monkeypatch.setitem(registry.ENGINES, "vllm", vllm)
    assert registry.auto_choices(tiny_model=True) == (registry.FALLBACK_ENGINE,)
    assert parse_args(["--max-staleness", "1"]).max_staleness == 1
    refusal = (
        r"^--max-staleness 1 needs an engine that takes new weights while it generates, "
        r"and auto may choose vllm; use --rollout-engine hf, or --max-staleness 0$"
    )
    with pytest.raises(ConfigError, match=refusal):
        parse_args(["--hf-checkpoint", str(tmp_path), "--max-staleness", "1"])


def test_engine_actor_builds_through_the_registry(tmp_path: Path) -> None:
    from vime.ray.engines import EngineActor
    from vime.rollout.engines.hf import HFEngine

    checkpoint = save_tiny(str(tmp_path / "model"), tiny_qwen3_config(vocab_size=48), seed=1)
    actor = EngineActor("hf", checkpoint, registry.EngineOptions(num_threads=1))
    assert isinstance(actor.engine, HFEngine)
    assert actor.choice() == ("hf", "--rollout-engine hf")
    assert actor.weight_version() == 0
    with pytest.raises(registry.UnknownEngineError, match=r"choose from: vllm, hf$"):
        EngineActor("sglang", checkpoint, registry.EngineOptions())


def test_weight_sync_choices_are_auto_and_the_transports() -> None:
    assert _choices("weight_sync") == WEIGHT_SYNC_TRANSPORTS
    assert ("auto", *transports.TRANSPORTS) == WEIGHT_SYNC_TRANSPORTS
    # The light list of names (vime.ray.transport_names) is the classes', in their order.
    assert transport_names.transport_names() == tuple(transports.TRANSPORTS)
    assert all(transport_names.DESCRIPTIONS.values())


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("object-store", transports.ObjectStoreTransport),
        ("broadcast", transports.BroadcastTransport),
        ("cuda-ipc", transports.CudaIpcTransport),
        ("disk", transports.DiskTransport),
    ],
)
def test_each_transport_name_resolves_to_its_class(name: str, cls: type) -> None:
    assert transports.transport_class(name) is cls
    assert cls.name == name


def test_unknown_transport_fails_in_one_line_naming_the_choices() -> None:
    with pytest.raises(transports.UnknownTransportError) as refused:
        transports.transport_class("nfs")
    assert str(refused.value) == (
        "unknown weight transport 'nfs'; choose from: object-store, broadcast, cuda-ipc, disk"
    )


def test_a_transport_takes_its_own_frozen_settings(tmp_path: Path) -> None:
    args = sync_settings(
        parse_args(["--update-weight-buffer-size", "4096", "--output-dir", str(tmp_path)])
    )
    expected = {
        "object-store": transports.BucketSettings(4096),
        "broadcast": transports.BroadcastSettings(4096, "gloo"),
        "cuda-ipc": transports.BucketSettings(4096),
        "disk": transports.DiskSettings(str(tmp_path / "weight_sync")),
    }
    for name, settings in expected.items():
        got = transports.transport_class(name).settings_from(args, False)
        assert got == settings and dataclasses.is_dataclass(got)
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.__setattr__(dataclasses.fields(got)[0].name, None)
    broadcast = transports.BroadcastTransport.settings_from(args, True)
    assert broadcast.backend == "nccl"
    made = transports.make_transport(args, False, "group", "engines")
    assert type(made) is transports.ObjectStoreTransport  # auto on the CPU
    assert (made.settings, made.train_group, made.engines) == (
        expected["object-store"],
        "group",
        "engines",
    )
