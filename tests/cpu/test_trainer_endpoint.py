"""``vime-train --agent-function-path`` end to end, on vLLM (the hf engine without it).

Proves, on real processes (two fsdp2 ranks, a tiny chat model that calls a tool): an
``openai``-client agent trains unchanged -- its endpoint starts with the run, the
trajectories it captured are trained (the agent metrics logged, tool calls among
them, no drift), the engines' weights stay in sync, and the run ends cleanly; with
``--max-staleness 1``, on the vLLM engine that ``--rollout-engine auto`` starts for a
model of its own where vLLM imports (always under CI; its start-up line says so). One
run holds these claims: each start of ``vime-train`` costs the suite more than its
rollouts. The run's endpoint on the hf engine is ``test_trainer_verifiers``' (its
episodes go through it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from endpoint_fixtures import save_endpoint_model, write_prompts

from tests.cpu.test_trainer import _metrics, _train

FIXTURES = Path(__file__).with_name("endpoint_fixtures.py")


def endpoint_run(tmp_path: Path, *flags: str) -> list[dict]:
    """Two rollouts of the tool-calling chat model, trained with ``flags`` (the source of
    prompts and trajectories, the sizes); its metrics lines, once each shows the run's
    trajectories captured with no drift and the engine's weights in sync. The run's
    console is left in ``stdout.txt`` there."""
    model = save_endpoint_model(tmp_path / "m")
    result = _train(
        *("--hf-checkpoint", model, "--apply-chat-template", "--use-dynamic-batch-size"),
        *("--rollout-max-response-len", "80", "--num-rollout", "2"),
        *("--output-dir", str(tmp_path / "o"), *flags),
        cwd=tmp_path,
    )
    (tmp_path / "stdout.txt").write_text(result.stdout)
    rows = _metrics(tmp_path / "o")
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for r in rows:
        assert r["agent/endpoint_drift"] == 0 and r["agent/turns_mean"] >= 1
        assert r["weights/probe_logprob_abs_diff"] < 1e-4
    return rows


def _agent_run(tmp_path: Path, *extra: str) -> list[dict]:
    rows = endpoint_run(
        tmp_path,
        *("--prompt-data", write_prompts(tmp_path / "p.jsonl"), "--rm-type", "exact"),
        *("--agent-function-path", f"{FIXTURES}:tool_agent"),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-epoch", "2"),
        *extra,
    )
    assert all(r["agent/turns_mean"] <= 3 for r in rows)
    assert sum(r["agent/tool_calls"] for r in rows) >= 1
    return rows


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory) -> tuple[list[dict], str]:
    """The tool agent's run with ``--max-staleness 1`` on the engine ``auto`` picks for
    this (not embedded) model: vLLM where it imports, else hf; its rows and console."""
    tmp_path = tmp_path_factory.mktemp("agent")
    rows = _agent_run(tmp_path, "--max-staleness", "1")
    return rows, (tmp_path / "stdout.txt").read_text()


def test_an_openai_agent_trains_asynchronously(agent_run: tuple[list[dict], str]) -> None:
    """With --max-staleness 1: the producer's calls, each in a thread and event loop of
    its own, share the one endpoint, at most one version old."""
    rows, _ = agent_run
    assert all(r["async/staleness_max"] <= 1 for r in rows)


def test_an_openai_agent_trains_on_vllm(agent_run: tuple[list[dict], str]) -> None:
    """On vLLM (CPU), where it imports: ``auto`` started a vLLM engine for this model, and
    said why at start-up (``test_engines`` covers the choice itself), and the agent's
    checks above hold on its tokens."""
    pytest.importorskip("vllm")
    rows, stdout = agent_run
    line = "vime: rollout engine vllm (auto: vllm is importable), 1 engine(s)"
    assert line in stdout.splitlines(), stdout[-3000:]
    assert sum(r["agent/tool_calls"] for r in rows) >= 1
