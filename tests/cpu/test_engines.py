"""``vime.ray.engines``: the engine choice and how prompts are split over engines.

Proves that ``--rollout-engine auto`` picks vLLM exactly when it can be imported
and says why, that an explicit choice is kept, that the prompt split gives
every engine a contiguous chunk, sizes differing by at most one, covering every
prompt once, and how engine actors are placed: on their own bundles, a whole GPU
or a colocated share of one, and for tensor-parallel engines no GPU on the actor
but its bundles named for vLLM's Ray workers (never the training ranks' bundles).
Also that ``EngineGroup.generate`` samples the same completions for the same seed
whether one, two or three engines (here in-process HF engines standing in for the
actors) share the batch.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import save_tiny, tiny_qwen3_config

from vime.ray import engines
from vime.ray.engines import (
    COLOCATED_GPU_SHARE,
    EngineGroup,
    _split,
    engine_actor_spec,
    resolve_engine,
)
from vime.ray.placement import Layout
from vime.rollout.types import SamplingParams


@pytest.mark.parametrize("have_vllm", [True, False])
def test_auto_picks_vllm_when_importable(monkeypatch: pytest.MonkeyPatch, have_vllm) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args):
        if name == "vllm":
            return object() if have_vllm else None
        return real(name, *args)

    monkeypatch.setattr(engines.importlib.util, "find_spec", find_spec)
    kind, reason = resolve_engine("auto")
    assert kind == ("vllm" if have_vllm else "hf")
    assert reason == ("auto: vllm is importable" if have_vllm else "auto: vllm is not installed")
    assert resolve_engine("hf") == ("hf", "--rollout-engine hf")
    assert resolve_engine("vllm") == ("vllm", "--rollout-engine vllm")


@pytest.mark.parametrize(("n", "parts"), [(0, 1), (7, 1), (7, 3), (8, 4), (3, 5)])
def test_split_is_contiguous_and_balanced(n: int, parts: int) -> None:
    chunks = _split(n, parts)
    assert len(chunks) == parts
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    sizes = [stop - start for start, stop in chunks]
    assert max(sizes) - min(sizes) <= 1


def test_one_gpu_engines_take_their_gpu_on_their_own_bundle() -> None:
    layout = Layout(num_train=2, num_engines=2, gpus_per_engine=1, colocate=False, use_gpu=True)
    specs = [engine_actor_spec(layout, e) for e in range(2)]
    assert [s.bundle for s in specs] == [2, 3]  # after the two training bundles
    assert all(s.num_gpus == 1 and s.num_cpus == 1 and not s.capture_child_tasks for s in specs)
    assert all("VLLM_RAY_BUNDLE_INDICES" not in s.env_vars for s in specs)
    assert all(s.env_vars["OMP_WAIT_POLICY"] == "PASSIVE" for s in specs)


def test_colocated_engines_share_the_training_gpus() -> None:
    layout = Layout(num_train=2, num_engines=2, gpus_per_engine=1, colocate=True, use_gpu=True)
    specs = [engine_actor_spec(layout, e) for e in range(2)]
    assert [s.bundle for s in specs] == [0, 1]
    assert all(s.num_gpus == COLOCATED_GPU_SHARE and s.num_cpus == 0 for s in specs)


@pytest.mark.parametrize("colocate", [False, True])
def test_tensor_parallel_engines_name_their_bundles_for_vllm(colocate: bool) -> None:
    layout = Layout(num_train=4, num_engines=2, gpus_per_engine=2, colocate=colocate, use_gpu=True)
    specs = [engine_actor_spec(layout, e) for e in range(2)]
    first = 0 if colocate else 4
    assert [s.env_vars["VLLM_RAY_BUNDLE_INDICES"] for s in specs] == [
        f"{first},{first + 1}",
        f"{first + 2},{first + 3}",
    ]
    share = str(COLOCATED_GPU_SHARE if colocate else 1.0)
    assert all(s.env_vars["VLLM_RAY_PER_WORKER_GPUS"] == share for s in specs)
    assert all(s.num_gpus == 0 and s.capture_child_tasks for s in specs)
    assert [s.bundle for s in specs] == [first, first + 2]


def test_cpu_engines_take_no_gpu() -> None:
    layout = Layout(num_train=1, num_engines=1, gpus_per_engine=2, colocate=False, use_gpu=False)
    spec = engine_actor_spec(layout, 0)
    assert spec.num_gpus == 0 and not spec.capture_child_tasks
    assert "VLLM_RAY_BUNDLE_INDICES" not in spec.env_vars


def _in_process_group(engine_list: list) -> EngineGroup:
    """An ``EngineGroup`` whose actors are engines in this process: ``generate.remote``
    answers at once, and the answer stands in for its Ray ref (``wait_all`` is patched)."""
    group = object.__new__(EngineGroup)
    group.kind = "hf"
    group.actors = [
        SimpleNamespace(generate=SimpleNamespace(remote=e.generate)) for e in engine_list
    ]
    return group


def test_completions_do_not_depend_on_the_number_of_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same seed gives token-identical completions from 1, 2 or 3 engines: each chunk
    is seeded by its whole-batch prompt indices, not by its position within the chunk."""
    from vime.rollout.hf_engine import HFEngine

    monkeypatch.setattr(engines, "wait_all", lambda refs, what: list(refs))
    checkpoint = save_tiny(str(tmp_path / "model"), tiny_qwen3_config(vocab_size=48), seed=3)
    pool = [HFEngine(checkpoint) for _ in range(3)]
    prompts = [[5, 9, 14], [17], [4, 4, 8, 2], [40, 2, 33]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5)

    def tokens(num_engines: int) -> list[list[list[int]]]:
        out = _in_process_group(pool[:num_engines]).generate(prompts, params)
        return [[c.response_ids for c in group] for group in out]

    one = tokens(1)
    assert len(one) == len(prompts) and all(len(g) == 2 for g in one)
    assert len({tuple(r) for g in one for r in g}) > len(prompts)  # real draws, not greedy
    assert tokens(2) == one
    assert tokens(3) == one
