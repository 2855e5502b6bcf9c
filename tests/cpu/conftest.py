"""Fixtures shared by the CPU test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType

import pytest

# Every Ray node a test starts (in this process or in a vime-train it runs) binds to
# loopback: on Linux Ray swaps 127.0.0.1 for the machine's outward address and its
# servers listen on all interfaces, unless this (read when ray is first imported) is 0.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    """A one-process gloo world with megatron's parallel state (TP=1) around the module."""
    from vime.backends.megatron import model as mmodel
    from vime.weights.transports import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    mmodel.init_model_parallel(tp=1, seed=1234)
    yield
    mmodel.destroy_model_parallel()


@pytest.fixture
def local_ray() -> Iterator[ModuleType]:
    """A fresh two-CPU local Ray around one test, shut down after it even when the test
    fails; yields the ``ray`` module (the test is skipped where Ray does not import)."""
    ray = pytest.importorskip("ray")
    from vime.ray.cluster import init_local_ray

    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def gqa_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The budget tests' model: the actor harness's tiny Qwen3 with 2 KV heads (GQA),
    saved once as an HF folder."""
    from actor_harness import VOCAB
    from tiny_models import save_tiny, tiny_qwen3_config

    config = tiny_qwen3_config(VOCAB)
    config.num_key_value_heads = 2
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3_gqa"), config, seed=0)
