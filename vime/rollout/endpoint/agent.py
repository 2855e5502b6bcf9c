"""``--agent-function-path``: agent code written against the ``openai`` client, trained.

Where it fits: a generate function on the multi-turn seam (``vime.rollout.agent``), so
it composes with ``--max-staleness``, the rewards, loss masks and both engines as the
tool loop does. Per sample it opens a ``Conversation`` on the run's
:class:`~vime.rollout.endpoint.server.EndpointServer` and calls the user's
``async fn(sample, client) -> float | dict | None`` with an ``openai.AsyncOpenAI``
whose ``base_url`` is the endpoint, ``api_key`` the run's token and default headers
name the trajectory (``X-Vime-Trajectory``); requests use ``model="vime"``. That client
calls the routes in this process (``EndpointServer.transport``); code that builds its
own from ``base_url`` goes over HTTP. The trajectory trained is what the endpoint
captured, as token ids. The reward: a float returned is it; a dict is metadata for the
run's reward function, which scores the final answer (as does None). A trajectory cut
by the budget or ``--max-turns`` stops the agent (its task is cancelled) and is scored
by the run's reward.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from vime.rollout.agent import (
    AgentRollouts,
    AgentSample,
    EngineHandle,
    Trajectory,
    load_async_function,
)
from vime.rollout.endpoint.capture import Conversation
from vime.rollout.endpoint.server import HEADER, EndpointServer

AgentFn = Callable[[AgentSample, Any], Awaitable[Any]]


async def _reference_agent(sample: AgentSample, client: Any) -> float:
    """The seam's contract, for ``load_function``'s signature check."""
    raise NotImplementedError


def load_agent_function(spec: str) -> AgentFn:
    """``--agent-function-path MODULE:FN``: an ``async def fn(sample, client)``."""
    return load_async_function(spec, "--agent-function-path", _reference_agent)


class EndpointAgent:
    """``async (sample, engine) -> Trajectory``: runs ``fn`` against ``server``; ``parse``
    reads a chat turn's tool calls; ``stops``: the run's stop ids."""

    def __init__(
        self,
        fn: AgentFn,
        server: EndpointServer,
        tokenizer: Any,
        *,
        max_turns: int,
        parse: Callable[[str], Any],
        stops: frozenset[int],
    ) -> None:
        self.fn, self.server, self.tokenizer = fn, server, tokenizer
        self.max_turns, self.parse, self.stops = max_turns, parse, stops

    async def __call__(self, sample: AgentSample, engine: EngineHandle) -> Trajectory:
        import openai

        conversation = Conversation(
            sample,
            engine,
            self.tokenizer,
            budget=engine.budget,
            max_turns=self.max_turns,
            parse=self.parse,
            stops=self.stops,
        )
        key = self.server.open(conversation)
        client = openai.AsyncOpenAI(
            # The routes called in this process: no socket, no TLS context, so a client a
            # trajectory is cheap. base_url still serves what the agent starts elsewhere
            # (verifiers' harness, a client of its own).
            http_client=openai.DefaultAsyncHttpxClient(transport=self.server.transport()),
            base_url=self.server.base_url,
            api_key=self.server.token,
            default_headers={HEADER: key},
            max_retries=0,  # a refusal stands; the lock-step waits as long as it must
            timeout=None,
        )
        task = asyncio.ensure_future(self.fn(sample, client))
        conversation.on_cut = task.cancel
        try:
            out = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not conversation.stopped or (current is not None and current.cancelling()):
                raise
            out = None
        finally:
            self.server.release(key)
            await client.close()
        if conversation.error is not None:
            raise conversation.error
        return _scored(conversation.trajectory(), out, sample)


def _scored(traj: Trajectory, out: Any, sample: AgentSample) -> Trajectory:
    if isinstance(out, bool) or not isinstance(out, int | float | dict | type(None)):
        raise TypeError(
            f"agent function: sample {sample.index} returned {type(out).__name__}; "
            "expected a float reward, a metadata dict or None"
        )
    if isinstance(out, dict):
        traj.metadata.update(out)
    elif out is not None:
        traj.reward = float(out)
    return traj


def build_endpoint_agent(settings: Any, tokenizer: Any, engines: Any) -> AgentRollouts:
    """The run's ``--agent-function-path`` rollouts, the endpoint started; its ``close``
    stops the endpoint (the run's closer calls it)."""
    from vime.backends.registry import resolve
    from vime.rollout.decoding import stop_token_ids
    from vime.rollout.tools.parsers import resolve_tool_parser

    endpoint = settings.endpoint
    if settings.environment is not None:
        from vime.rollout.endpoint.verifiers_agent import environment_agent

        fn, name = environment_agent(settings.environment), f"--environment {settings.environment}"
    else:
        fn = load_agent_function(settings.agent_function)
        name = f"--agent-function-path {settings.agent_function}"
    spec = resolve_tool_parser(endpoint.parser, True)
    parse = resolve(spec.parse)
    stops = frozenset(stop_token_ids(settings.stop_token_ids, tokenizer.eos_token_id))
    server = EndpointServer(endpoint.host, endpoint.port).start()
    agent = EndpointAgent(
        fn,
        server,
        tokenizer,
        max_turns=endpoint.max_turns,
        parse=lambda text: parse(text, None),
        stops=stops,
    )
    return AgentRollouts(agent, engines, settings.budget, name=name, close=server.close)
