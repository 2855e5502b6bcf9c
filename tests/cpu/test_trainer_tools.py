"""``vime-train`` with tools end to end: the built-in lookup task's multi-turn loop.

Proves, on real processes (two fsdp2 ranks, an hf engine, the embedded model): a run
on ``builtin:lookup`` implies its tool, logs the agent metrics every rollout and the
fraction of held-out trajectories that call the tool; a run resumed from its
checkpoint redoes the next rollout exactly (same trajectories, rewards, loss); and
with ``--max-staleness 1`` the same trajectories are generated asynchronously,
at most one version old, on vLLM (where it imports: always under CI), turn after turn
as token ids. The asynchronous and the vLLM claims share one run: each start of
``vime-train`` costs the suite more than the rollouts it makes.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from tests.cpu.test_trainer import _metrics, _train
from vime.checkpoint import TRACKER, iteration_dir

LOOKUP = ["--prompt-data", "builtin:lookup", "--rollout-batch-size", "4", "--max-turns", "2"]
AGENT = [
    "agent/turns_mean",
    "agent/turns_max",
    "agent/tool_calls",
    "agent/calling_frac",
    "agent/tool_seconds",
    "agent/model_tokens_mean",
    "agent/env_tokens_mean",
    "agent/cut_max_turns",
    "agent/cut_budget",
    "agent/tool_errors_bad_arguments",
]


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tools")
    _train(
        *LOOKUP,
        *("--num-rollout", "3", "--output-dir", str(out / "out")),
        *("--save", str(out / "ckpt"), "--save-interval", "1", "--eval-interval", "2"),
        cwd=out,
    )
    return out


def test_a_tool_run_logs_the_agent_metrics(tool_run: Path) -> None:
    rows = _metrics(tool_run / "out")
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for r in rows:
        missing = [k for k in AGENT if k not in r]
        assert not missing, missing
        assert 1 <= r["agent/turns_mean"] <= r["agent/turns_max"] <= 2
        assert 0 <= r["agent/calling_frac"] <= 1
        # Every trajectory ends by answering, at --max-turns, or at the task's budget.
        assert r["rollout/response_len_mean"] <= 32
    assert "eval/calling_frac" in rows[1]


def test_resume_redoes_the_next_rollout_exactly(tool_run: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(iteration_dir(tool_run / "ckpt", 1), iteration_dir(ckpt, 1))
    (ckpt / TRACKER).write_text("1\n")
    _train(
        *LOOKUP,
        *("--num-rollout", "3", "--output-dir", str(tmp_path / "out"), "--load", str(ckpt)),
        cwd=tmp_path,
    )
    (resumed,) = _metrics(tmp_path / "out")
    original = _metrics(tool_run / "out")[2]
    assert resumed["rollout_id"] == 2
    for key in ["rollout/reward_mean", "rollout/response_len_mean", "train/loss", *AGENT]:
        if key == "agent/tool_seconds":
            continue
        assert resumed[key] == pytest.approx(original[key], rel=1e-6, abs=1e-9), key


@pytest.fixture(scope="module")
def async_tool_run(tmp_path_factory) -> list[dict]:
    """Three rollouts of the tool loop with ``--max-staleness 1``, on vLLM where it imports
    (else the hf engine, so the asynchronous claim holds without vLLM too)."""
    out = tmp_path_factory.mktemp("async_tools")
    engine = "vllm" if importlib.util.find_spec("vllm") else "hf"
    _train(
        *LOOKUP,
        *("--max-staleness", "1", "--rollout-engine", engine, "--num-rollout", "3"),
        *("--output-dir", str(out / "o")),
        cwd=out,
    )
    return _metrics(out / "o")


def test_tools_compose_with_the_asynchronous_producer(async_tool_run: list[dict]) -> None:
    """The tool loop under the asynchronous producer: every rollout trained on
    trajectories at most one version old, the agent metrics logged."""
    rows = async_tool_run
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["async/staleness_max"] <= 1
        assert 1 <= r["agent/turns_mean"] <= 2 and "agent/tool_calls" in r


def test_the_tool_loop_runs_on_vllm(async_tool_run: list[dict]) -> None:
    """The same tool run with vLLM as the engine (where vLLM imports): turn after turn as
    token ids, trained and synced, the agent metrics logged."""
    pytest.importorskip("vllm")
    rows = async_tool_run
    for r in rows:
        assert not [k for k in AGENT if k not in r]
        assert r["weights/probe_logprob_abs_diff"] < 1e-4
