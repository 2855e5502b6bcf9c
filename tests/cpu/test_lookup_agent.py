"""``examples/lookup_agent.py``: the lookup task played by an ``openai``-client agent.

Proves: ``--prompt-data builtin:lookup --agent-function-path`` parses (the task's
implied ``--tools`` gives way to the agent); and, through the real endpoint and
``Conversation`` on scripted turns that reach every branch (a call and its answer, a
direct answer, repeated calls cut by ``--max-turns``, a turn cut by the budget, a
call whose answer would not fit), the agent's trajectories are the built-in tool
loop's token for token -- ids, masks, log-probs, finish reason, turns, calls and cut.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tool_loop import ScriptedEngine, _run

from vime.config.parser import parse_args
from vime.data.tasks import CHARSET, LOOKUP_TOOLS, _lookup_table
from vime.models.embedded import EOS_ID, build_tokenizer
from vime.rollout.endpoint.agent import EndpointAgent, load_agent_function
from vime.rollout.endpoint.server import EndpointServer
from vime.rollout.tools.loop import ToolLoop, ToolLoopSettings
from vime.rollout.tools.toolbox import Toolbox, parse_plain

AGENT = f"{Path(__file__).parents[2] / 'examples' / 'lookup_agent.py'}:lookup_agent"


def test_the_lookup_task_takes_an_agent_function_in_place_of_its_tools() -> None:
    """The built-in task implies ``--tools`` only when nothing else runs them."""
    args = parse_args(["--prompt-data", "builtin:lookup", "--agent-function-path", AGENT])
    assert args.tools is None and args.agent_function_path == AGENT
    assert parse_args(["--prompt-data", "builtin:lookup"]).tools == "vime.data.tasks:LOOKUP_TOOLS"


@pytest.mark.parametrize(
    ("budget", "max_turns", "cut"),
    [(32, 4, None), (16, 4, "budget"), (400, 2, "max_turns")],
    ids=["run", "budget", "turns"],
)
def test_the_agent_builds_the_tool_loops_trajectories(
    budget: int, max_turns: int, cut: str | None
) -> None:
    """Each scripted sample gives equal completions through the loop and the agent;
    the cases reach calls, answers and the cut each names. (Plain completions carry
    no call structure, so the endpoint counts no tool calls: only the loop does.)"""
    value = _lookup_table()["abcd"]
    script = [
        ["get abcd", value],  # the call, then the value copied
        ["dcba"],  # a direct answer
        ["get abcd", "get abcd", "get abcd", "get abcd", "get abcd"],  # calls until cut
        ["get zzzz", "no"],  # a key that is not there: the tool says so
        ["get abcd", "abcdabcdabcdabcdabcdabcdabcdabcd"],  # the answer runs out of room
    ]
    prompts = ["get abcd="] * len(script)
    chars = build_tokenizer(CHARSET)
    box, server = Toolbox(LOOKUP_TOOLS), EndpointServer().start()
    try:
        loop = ToolLoop(box, chars, ToolLoopSettings(max_turns=max_turns), stop_token_ids=[EOS_ID])
        agent = EndpointAgent(
            load_agent_function(AGENT),
            server,
            chars,
            max_turns=max_turns,
            parse=lambda text: parse_plain(text, box),
            stops=frozenset({EOS_ID}),
        )
        by_loop, _ = _run(loop, ScriptedEngine(chars, script, EOS_ID), prompts, budget)
        by_agent, _ = _run(agent, ScriptedEngine(chars, script, EOS_ID), prompts, budget)
    finally:
        server.close()
        box.close()
    cuts = set()
    for want, got in zip(by_loop, by_agent, strict=True):
        assert (got.prompt_ids, got.response_ids) == (want.prompt_ids, want.response_ids)
        assert (got.loss_mask, got.log_probs) == (want.loss_mask, want.log_probs)
        assert got.finish_reason == want.finish_reason
        keys = ("turns", "cut", "drift")
        assert [got.extra["agent"][k] for k in keys] == [want.extra["agent"][k] for k in keys]
        cuts.add(want.extra["agent"]["cut"])
    assert sum(c.extra["agent"]["tool_calls"] for c in by_loop) >= 3
    assert cuts >= {None, cut}
