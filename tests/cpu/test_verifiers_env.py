"""``--environment verifiers:MODULE:FACTORY``: verifiers environments run through vime.

Proves, with environments built from local data (``verifiers_fixtures``: two in-memory
tasks, a rubric whose reward is a known function of the answer, a local ``add`` tool
served by verifiers as an MCP server): the taskset gives the prompts; an episode runs
verifiers' own chat program against the run's endpoint -- tool calls answered by the
environment's tool, every turn captured token-exact (no drift) -- and the rubric's
reward is the sample's; bad input is one ConfigError line while parsing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("verifiers")

from endpoint_fixtures import save_endpoint_model
from verifiers_fixtures import LOG, answer_reward_of

from vime.errors import ConfigError

HERE = Path(__file__).parent
SINGLE = "verifiers:verifiers_fixtures:single_turn_env"
TOOLS = "verifiers:verifiers_fixtures:tool_env"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_endpoint_model(tmp_path_factory.mktemp("vf") / "m")


@pytest.fixture(autouse=True)
def fixtures_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The taskset id is the fixtures' top-level module name: tests/cpu on the path of
    this process and of the processes verifiers starts (the chat program, the tools)."""
    import os

    path = os.pathsep.join(
        filter(None, [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH")])
    )
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.syspath_prepend(str(HERE))


def test_the_taskset_gives_the_prompts() -> None:
    """Each task's prompt is a row, its label the task's index."""
    from vime.data.prompts import load_prompts

    prompts = load_prompts(SINGLE)
    assert [p.text for p in prompts] == [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [{"role": "user", "content": "Add 2 and 3, please."}],
    ]
    assert [p.label for p in prompts] == [0, 1]


def test_an_episode_runs_through_the_endpoint_token_exact(model_dir, tmp_path, monkeypatch) -> None:
    """The tool environment on the hf engine: verifiers' chat program calls the tool,
    the turns are the engine's tokens with no drift, and each episode that ran to its
    end (a stopped one returns no reward) has the rubric's reward (as it logged it)."""
    import torch
    from endpoint_fixtures import endpoint_tokenizer
    from test_endpoint import assert_engine_exact, run_agent

    from vime.rollout.endpoint.server import EndpointServer
    from vime.rollout.endpoint.verifiers_agent import environment_agent
    from vime.rollout.engines.hf import HFEngine

    log = tmp_path / "rubric.jsonl"
    monkeypatch.setenv(LOG, str(log))
    torch.set_num_threads(1)
    engine, tok = HFEngine(model_dir), endpoint_tokenizer()
    server = EndpointServer().start()
    play = environment_agent(TOOLS)

    async def agent(sample, client):  # run_agent's prompts are the fixtures' in order
        object.__setattr__(sample.prompt, "label", sample.prompt.index)
        return await play(sample, client)

    try:
        done = run_agent(agent, engine, tok, server, n=2, budget=80)
    finally:
        server.close()
    info = [c.extra["agent"] for c in done]
    assert all(i["drift"] == 0 for i in info)
    assert sum(i["tool_calls"] for i in info) >= 1
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    scored = sorted(i["reward"] for i in info if i["reward"] is not None)  # ran to the end
    assert scored and scored == sorted(r["reward"] for r in logged)
    assert all(r["reward"] == answer_reward_of(r["answer"]) for r in logged)
    for k, c in enumerate(done):
        assert_engine_exact(engine, c, k, tok.eos_token_id)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--environment", "verifiers:no_such_module:f"], "not found"),
        (["--environment", "verifiers:verifiers_fixtures:nope"], "no attribute 'nope'"),
        (["--environment", "verifiers:verifiers_fixtures:not_an_env"], "not a verifiers.v1.Env"),
        (["--environment", "gym:x:y"], "write verifiers:MODULE:FACTORY"),
        (["--environment", SINGLE, "--prompt-data", "x.jsonl"], "--prompt-data"),
        (["--environment", SINGLE, "--agent-function-path", "m:f"], "--agent-function-path"),
        (["--environment", SINGLE, "--tools", "m:f"], "--tools"),
    ],
)
def test_bad_input_is_one_config_error(model_dir, argv, message) -> None:
    """Unknown module or factory, a factory returning no environment, another source of
    prompts or trajectories: refused while parsing."""
    from vime.config import parse_args

    with pytest.raises(ConfigError, match=message):
        parse_args([*argv, "--apply-chat-template", "--hf-checkpoint", model_dir])


def test_verifiers_missing_names_the_extra(monkeypatch) -> None:
    """Without verifiers: the install line."""
    import sys

    from vime.data import verifiers_env

    verifiers_env.load_environment.cache_clear()
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[agents\]'"):
        verifiers_env.load_environment(SINGLE)
