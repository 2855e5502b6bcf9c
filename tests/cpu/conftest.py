"""Fixtures shared by the CPU test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

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


@pytest.fixture(scope="session")
def colocated_broadcast_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One ``vime-train`` run that two modules assert on: three rollouts of LoRA adapters
    (rank 4, the KL term on, the tied embedding and the norms trained in full), colocated
    with the hf engine and synced over the gloo broadcast a tensor a bucket, with a
    reward that raises for some samples, dynamic sampling, the rollout correction in mask
    mode, eval prompts, a checkpoint at the end and the HF exports; prompts over 4 tokens
    dropped. ``test_trainer`` checks the loop on it, ``test_trainer_lora`` the adapters:
    one start of ``vime-train`` costs the suite more than the rollouts it makes."""
    from tests.cpu.test_trainer import FLAKY_REWARD, _metrics, _train
    from tests.cpu.test_trainer_lora import LORA

    tmp_path = tmp_path_factory.mktemp("broadcast")
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    out = tmp_path / "out"
    result = _train(
        *LORA,
        *("--rollout-engine", "hf", "--colocate", "--weight-sync", "broadcast"),
        # A bucket a tensor: every layer reaches the engine over several calls.
        *("--update-weight-buffer-size", "4096"),
        *("--lora-modules-to-save", "embed_tokens,norm"),
        *("--custom-rm-path", "flaky:reward", "--dynamic-sampling-filter"),
        *("--dynamic-sampling-max-rounds", "3", "--over-sampling-factor", "2"),
        *("--use-tis", "--tis-mode", "mask", "--tis-level", "sequence"),
        *("--eval-prompt-data", "builtin:reverse:eval", "--rollout-max-prompt-len", "4"),
        *("--save", str(tmp_path / "ckpt"), "--output-dir", str(out)),
        *("--save-hf-merged", str(tmp_path / "merged")),
        cwd=tmp_path,
    )
    return SimpleNamespace(
        root=tmp_path, out=out, ckpt=tmp_path / "ckpt", rows=_metrics(out), stdout=result.stdout
    )
