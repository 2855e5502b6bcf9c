"""``vime-train --agent-function-path`` end to end, on the hf engine and on vLLM.

Proves, on real processes (two fsdp2 ranks, a tiny chat model that calls a tool): an
``openai``-client agent trains unchanged -- its endpoint starts with the run, the
trajectories it captured are trained (the agent metrics logged, tool calls among
them, no drift), the engines' weights stay in sync, and the run ends cleanly; with
``--max-staleness 1`` too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from endpoint_fixtures import save_endpoint_model, write_prompts

from tests.cpu.test_trainer import _metrics, _train

FIXTURES = Path(__file__).with_name("endpoint_fixtures.py")


def _agent_run(tmp_path: Path, *extra: str) -> list[dict]:
    model = save_endpoint_model(tmp_path / "m")
    _train(
        *("--hf-checkpoint", model, "--apply-chat-template"),
        *("--prompt-data", write_prompts(tmp_path / "p.jsonl"), "--rm-type", "exact"),
        *("--agent-function-path", f"{FIXTURES}:tool_agent"),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--rollout-max-response-len", "80", "--num-rollout", "2", "--num-epoch", "2"),
        "--use-dynamic-batch-size",
        *("--output-dir", str(tmp_path / "o"), *extra),
        cwd=tmp_path,
    )
    rows = _metrics(tmp_path / "o")
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for r in rows:
        assert 1 <= r["agent/turns_mean"] <= 3 and r["agent/endpoint_drift"] == 0
        assert r["weights/probe_logprob_abs_diff"] < 1e-4
    assert sum(r["agent/tool_calls"] for r in rows) >= 1
    return rows


def test_an_openai_agent_trains_on_the_hf_engine_asynchronously(tmp_path: Path) -> None:
    """On the hf engine with --max-staleness 1: the producer's calls, each in a thread and
    event loop of its own, share the one endpoint."""
    rows = _agent_run(tmp_path, "--max-staleness", "1")
    assert all(r["async/staleness_max"] <= 1 for r in rows)


def test_an_openai_agent_trains_on_vllm(tmp_path: Path) -> None:
    """On vLLM (CPU), where it imports, synchronously."""
    pytest.importorskip("vllm")
    _agent_run(tmp_path, "--rollout-engine", "vllm")
