"""The backend contract: backends are composed into one actor, never subclass it.

Proves that every registered backend is a ``TrainBackend`` and no actor, that none
defines a private method the actor or the interface also has (nothing to override),
that ``PolicyTrainActor`` has no subclasses, and that the interface is all public.
Then a test double (``double_backend.py``: a plain HF model in one process) that
implements only the interface is registered as a real backend is and passes the
shared actor tests: a training step, log-probs and the reference swap, sleep/wake,
a save/load round trip, and the weight buckets and HF export.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from actor_harness import VOCAB, actor_args, make_schedule
from tiny_models import save_tiny, tiny_qwen3_config

from vime.backends import policy_actor, registry
from vime.backends.base import TrainActor
from vime.backends.interface import TrainBackend
from vime.backends.policy_actor import PolicyTrainActor
from vime.config.train_settings import train_settings

DOUBLE = registry.BackendSpec(
    name="double",
    summary="test double: a plain HF model in one process",
    backend="double_backend:DoubleBackend",
    add_flags="double_backend:add_flags",
    validate="double_backend:validate",
    settings="double_backend:settings",
)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_abc")


def _backend_classes() -> list[type]:
    return [registry.backend_class(name) for name in registry.backend_names()]


@pytest.fixture
def with_double(monkeypatch) -> None:
    monkeypatch.setitem(registry.BACKENDS, "double", DOUBLE)


def test_backends_are_composed_not_subclassed(with_double) -> None:
    for cls in _backend_classes():
        assert issubclass(cls, TrainBackend), cls
        assert not issubclass(cls, TrainActor), f"{cls.__name__} subclasses an actor"
        shared = set(dir(PolicyTrainActor)) | set(dir(TrainBackend))
        own = {name for klass in cls.__mro__[:-1] for name in vars(klass)} - set(vars(TrainBackend))
        overridden = sorted(name for name in own if _private(name) and name in shared)
        assert not overridden, f"{cls.__name__} overrides private {overridden}"
    assert PolicyTrainActor.__subclasses__() == []


def test_interface_is_public() -> None:
    assert not [name for name in vars(TrainBackend) if _private(name)]


# ----- the shared actor tests, on the test double --------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3"), tiny_qwen3_config(VOCAB), seed=3)


@pytest.fixture(scope="module", autouse=True)
def one_process_group() -> Any:
    yield
    import torch.distributed as dist

    if dist.is_initialized():  # the double's setup made it
        dist.destroy_process_group()


def _actor(hf: str, *extra: str) -> tuple[PolicyTrainActor, Any, int]:
    args = actor_args(hf, 1, *extra, backend="double")
    actor = policy_actor.make_actor("double")
    return actor, args, actor.init(train_settings(args))


def _weights(actor: PolicyTrainActor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in actor.weight_buckets(1 << 20) for n, t in bucket}


def test_double_trains_a_step(with_double, hf_dir) -> None:
    actor, args, start = _actor(hf_dir)
    assert start == 0 and isinstance(actor.backend, TrainBackend)
    before = _weights(actor)
    metrics = actor.train(make_schedule(args, 0, 1))
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    assert metrics["train/skipped_steps"] == 0.0
    assert actor.optimizer_steps == 2  # 8 samples, global batch 4
    after = _weights(actor)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_double_log_probs_and_reference(with_double, hf_dir) -> None:
    actor, args, _ = _actor(hf_dir)
    sched = make_schedule(args, 0, 1)
    first = actor.compute_log_probs(sched, "actor")
    assert sorted(first) == list(range(8))
    assert all(torch.equal(first[i], r) for i, r in actor.compute_log_probs(sched, "ref").items())
    actor.train(sched)
    moved = actor.compute_log_probs(sched, "actor")
    ref = actor.compute_log_probs(sched, "ref")  # the initial weights, swapped in and out
    assert all(torch.equal(first[i], ref[i]) for i in first)
    assert any(not torch.equal(first[i], moved[i]) for i in first)
    assert all(torch.equal(moved[i], t) for i, t in actor.compute_log_probs(sched, "actor").items())


def test_double_sleeps_and_wakes(with_double, hf_dir) -> None:
    actor, args, _ = _actor(hf_dir)
    actor.train(make_schedule(args, 0, 1))
    before = _weights(actor)
    actor._parks_on = lambda device: True  # what sleep does to CUDA tensors, on host ones
    actor.sleep()
    assert all(t.untyped_storage().nbytes() == 0 for t in actor.backend.local_tensors())
    with pytest.raises(RuntimeError, match="asleep; call wake_up"):
        actor.compute_log_probs(make_schedule(args, 1, 1), "actor")
    actor.wake_up()
    assert all(torch.equal(t, before[n]) for n, t in _weights(actor).items())
    assert math.isfinite(actor.train(make_schedule(args, 1, 1))["train/loss"])


def test_double_save_load_round_trip(with_double, hf_dir, tmp_path: Path) -> None:
    save = str(tmp_path / "ckpt")
    actor, args, _ = _actor(hf_dir, "--save", save)
    actor.train(make_schedule(args, 0, 1))
    actor.save(0)
    resumed, _, start = _actor(hf_dir, "--load", save)
    assert start == 1
    assert resumed.optimizer_steps == actor.optimizer_steps == 2
    weights = _weights(actor)
    assert all(torch.equal(t, weights[n]) for n, t in _weights(resumed).items())
    going, back = actor.train(make_schedule(args, 1, 1)), resumed.train(make_schedule(args, 1, 1))
    assert going == back
    weights = _weights(actor)
    assert all(torch.equal(t, weights[n]) for n, t in _weights(resumed).items())


def test_double_weight_buckets_and_export(with_double, hf_dir, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    actor, _, _ = _actor(hf_dir)
    weights = _weights(actor)
    saved = load_file(str(Path(hf_dir) / "model.safetensors"))
    assert set(saved) <= set(weights)
    assert all(torch.equal(weights[n], t) for n, t in saved.items())
    out = tmp_path / "export"
    actor.export_hf(str(out))
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[n], t) for n, t in saved.items())
