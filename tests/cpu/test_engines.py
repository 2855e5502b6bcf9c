"""``vime.ray.engines``: the engine choice and how prompts are split over engines.

Proves that ``--rollout-engine auto`` picks vLLM exactly when it can be imported
and says why, that an explicit choice is kept, that the prompt split gives
every engine a contiguous chunk, sizes differing by at most one, covering every
prompt once, and how engine actors are placed: on their own bundles, a whole GPU
or a colocated share of one, and for tensor-parallel engines no GPU on the actor
but its bundles named for vLLM's Ray workers (never the training ranks' bundles).
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest

from vime.ray import engines
from vime.ray.engines import COLOCATED_GPU_SHARE, _split, engine_actor_spec, resolve_engine
from vime.ray.placement import Layout


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
