"""``--compile-decoder`` (``vime.backends.compile``) on the CPU, both backends.

Proves: with the flag every decoder block's forward is compiled (dynamo builds graphs
while a training step runs) and the step's loss and gradient norm equal the eager
step's within 1e-5 on the tiny model; the blocks found are the HF decoder layers and
megatron-core's ``TransformerLayer``s, and a model with neither is refused. Slow (inductor
compiles C++ on the CPU); CI runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from actor_harness import VOCAB, actor_args, make_schedule, spawn
from tiny_models import save_tiny, tiny_qwen3_config

from vime.backends.compile import decoder_blocks
from vime.config.train_settings import train_settings


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3_compile"), tiny_qwen3_config(VOCAB), 0)


def _step_job(rank: int, world: int, backend: str, hf: str, compiled: bool) -> dict:
    from torch._dynamo.utils import counters

    from vime.backends.policy_actor import make_actor

    args = actor_args(hf, world, *(["--compile-decoder"] if compiled else []), backend=backend)
    actor = make_actor(backend)
    actor.init(train_settings(args))
    metrics = actor.train(make_schedule(args, 0, world))
    blocks = decoder_blocks(actor.backend.model)
    return {
        "loss": metrics["train/loss"],
        "grad_norm": metrics["train/grad_norm"],
        "blocks": [type(b).__name__ for b in blocks],
        "compiled": sum(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks),
        "graphs": int(counters["stats"]["unique_graphs"]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_compiled_step_equals_eager(backend: str, hf_dir: str, tmp_path: Path) -> None:
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    eager = spawn(_step_job, 1, tmp_path, backend, hf_dir, False)
    compiled = spawn(_step_job, 1, tmp_path, backend, hf_dir, True)
    assert eager["graphs"] == 0 and compiled["graphs"] > 0, (eager, compiled)
    layers = tiny_qwen3_config(VOCAB).num_hidden_layers
    # One fsdp2 rank trains the plain HF model (vime.backends.fsdp2.plain): no FSDP class.
    block = "Qwen3DecoderLayer" if backend == "fsdp2" else "TransformerLayer"
    assert compiled["blocks"] == [block] * layers and compiled["compiled"] == layers
    assert eager["compiled"] == 0
    for key in ("loss", "grad_norm"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-5, abs=1e-5), key


def test_a_model_without_decoder_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="found no decoder blocks"):
        decoder_blocks(torch.nn.Linear(2, 2))
