"""``vime-train --environment verifiers:...`` end to end, on both training backends.

Proves, on real processes (one training rank, the hf engine, the tiny chat model that
calls a tool): verifiers environments built from local data train unchanged -- two
rollouts each, whose episodes ran through the run's endpoint with no drift, whose
rewards are exactly the rubric's (as it logged them), trained with a non-zero gradient
and synced back to the engine. To keep the suite short, two runs cover both
environments and both backends: the SingleTurnEnv on fsdp2, the ToolEnv (its ``add``
tool called) on megatron.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("verifiers")

from verifiers_fixtures import LOG, answer_reward_of

from tests.cpu.test_trainer_endpoint import endpoint_run

HERE = Path(__file__).parent
SAMPLES = 2  # per rollout: --rollout-batch-size 1 x --n-samples-per-prompt 2


def _environment_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str, backend: str
) -> list[dict]:
    """Two rollouts of ``env`` on ``backend``; checks what every run must show and
    returns the metrics lines."""
    # The taskset id is the fixtures' top-level module name: tests/cpu on the path of the
    # run, its Ray workers and the processes verifiers starts (chat program, tools).
    path = [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))
    log = tmp_path / "rubric.jsonl"
    monkeypatch.setenv(LOG, str(log))
    rows = endpoint_run(
        tmp_path,
        *("--environment", f"verifiers:verifiers_fixtures:{env}"),
        *("--train-backend", backend, "--actor-num-gpus-per-node", "1"),
        *("--rollout-batch-size", "1", "--n-samples-per-prompt", "2"),
    )
    # GRPO: a rollout whose rewards differ trains (a group all alike has advantage 0).
    assert any(r["train/grad_norm"] > 0 for r in rows)
    for r in rows:
        assert (r["train/grad_norm"] > 0) == (r["rollout/reward_std"] > 0)
        assert r["train/skipped_steps"] == 0
    # Every episode the run did not cut was scored by the rubric once; the run's rewards
    # (a cut one scores 0) sum to the rubric's.
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    cut = sum(r["agent/cut_budget"] + r["agent/cut_max_turns"] for r in rows)
    assert len(logged) == SAMPLES * len(rows) - cut >= 1
    assert all(x["reward"] == answer_reward_of(x["answer"]) for x in logged)
    run_total = sum(r["rollout/reward_mean"] * SAMPLES for r in rows)
    assert run_total == pytest.approx(sum(x["reward"] for x in logged))
    return rows


def test_a_single_turn_env_trains_on_fsdp2(tmp_path, monkeypatch) -> None:
    """The SingleTurnEnv on fsdp2: one model turn per episode, rubric rewards trained."""
    rows = _environment_run(tmp_path, monkeypatch, "single_turn_env", "fsdp2")
    assert all(r["agent/turns_max"] == 1 and r["agent/tool_calls"] == 0 for r in rows)


def test_a_tool_env_trains_on_megatron(tmp_path, monkeypatch) -> None:
    """The ToolEnv on megatron: the episodes call the environment's ``add`` tool."""
    pytest.importorskip("megatron.core")
    rows = _environment_run(tmp_path, monkeypatch, "tool_env", "megatron")
    assert sum(r["agent/tool_calls"] for r in rows) >= 1
