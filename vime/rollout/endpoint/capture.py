"""One trajectory's side of the OpenAI endpoint: requests in, token ids captured.

Where it fits: the endpoint's server (``vime.rollout.endpoint.server``) hands every
request of one agent's trajectory to its :class:`Conversation`, which runs it on the
sample's ``EngineHandle`` (the multi-turn seam's, ``vime.rollout.agent``: seeded per
sample and request, weight versions and log-probs included) and records it. The
trajectory trained is built from ids alone: the first request's rendered prompt is its
prompt, each completion's ids are the model's tokens (mask 1, the engine's log-probs)
and what a later request adds after them is context (mask 0).

A later request must extend the trajectory: its messages (``tools`` included) start
with the previous request's plus the assistant message returned, unchanged; a
completion's prompt starts with the previous prompt and completion. The model's own
ids then stand for its turn (never re-rendered, never re-tokenized) and only the
template's text after it is rendered and tokenized (``ToolTurnRenderer.tool_turn_ids``,
as the tool loop does). A request that does not extend it (the agent edited earlier
context, or the template renders earlier turns differently once new ones follow) is
*drift*: it is served from its own rendering and counted (``Trajectory.drift``,
``agent/endpoint_drift``), and the trajectory keeps its last consistent prefix --
nothing from that request on is recorded. A request past ``--max-turns`` or the
response budget (``--rollout-max-response-len``, context tokens included) is refused
and cuts the trajectory (``cut`` "max_turns" / "budget"); the agent is then stopped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from vime.rollout.agent import AgentSample, EngineHandle, Trajectory, Turn
from vime.rollout.decoding import decode_turns
from vime.rollout.tools.toolbox import TOOL_CALL_OPEN, ParseError, ToolCall, call_closing_ids
from vime.rollout.tools.turns import TemplateDriftError, ToolTurnRenderer

Parse = Callable[[str], list[ToolCall] | ParseError]
CUT_BUDGET, CUT_MAX_TURNS = "budget", "max_turns"


class Refusal(Exception):
    """A request answered with an OpenAI-shaped error instead of a completion."""

    def __init__(
        self, status: int, message: str, code: str | None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


def normalize(message: Any) -> dict[str, Any]:
    """A chat message as the template renders it and drift is judged: role, text content,
    tool calls as name + argument object (ids dropped), a tool message's name and id."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise Refusal(400, "each message must be an object with a 'role'", "invalid_value")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: the text ones, joined
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: dict[str, Any] = {"role": message["role"], "content": content or ""}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_call_of(c) for c in calls]
    for key in ("name", "tool_call_id"):
        if message.get(key):
            out[key] = message[key]
    return out


def _call_of(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise Refusal(400, "a tool call needs a function with a name", "invalid_value")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise Refusal(400, "a tool call's arguments are not JSON", "invalid_value") from None
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


class Conversation:
    """One sample's requests, served on ``engine`` and captured as a :class:`Trajectory`.

    ``parse`` reads a chat turn's tool calls (``--tool-parser``); ``stops``: the run's
    stop ids (a final one is not shown as text); ``on_cut`` runs once the trajectory
    is cut (the agent seam stops the agent). ``error``: an engine failure, raised by
    the seam once the agent is done.
    """

    def __init__(
        self,
        sample: AgentSample,
        engine: EngineHandle,
        tokenizer: Any,
        *,
        budget: int,
        max_turns: int,
        parse: Parse,
        stops: frozenset[int],
    ) -> None:
        self.sample, self.engine, self.tokenizer = sample, engine, tokenizer
        self.budget, self.max_turns, self.parse, self.stops = budget, max_turns, parse, stops
        # A chat turn stopped on </tool_call> is read with the tag: the call is complete.
        self.chat_stops = stops - call_closing_ids(tokenizer, stops)
        self.traj = Trajectory()
        self.prompt: list[int] | None = None
        self.frozen = False  # drifted: nothing more is recorded
        self.requests = 0
        self.last_prompt_len = 0
        self.unrecorded = 0  # tokens generated by requests not recorded, still budgeted
        self.messages: list[dict[str, Any]] | None = None  # chat: what the next must extend
        self.renderer: ToolTurnRenderer | None = None
        self.tools_key: str | None = None
        self.text: str | None = None  # completions: the prompt text the next must extend
        self.on_cut: Callable[[], object] = lambda: None
        self.stopped = False  # cut: on_cut has run
        self.error: BaseException | None = None
        self._one_at_a_time = asyncio.Lock()

    # ----------------------------------------------------------- the two request kinds

    async def chat(self, body: dict[str, Any]) -> tuple[Turn, str, list[ToolCall], str | None]:
        """A chat request: the turn, its text, its tool calls and the content shown."""
        async with self._one_at_a_time:  # concurrent requests of one trajectory queue
            return await self._chat(body)

    async def complete(self, body: dict[str, Any]) -> tuple[Turn, str]:
        """A completions request (a prompt string or token ids): the turn and its text."""
        async with self._one_at_a_time:
            return await self._complete(body)

    async def _chat(self, body: dict[str, Any]) -> tuple[Turn, str, list[ToolCall], str | None]:
        messages = [normalize(m) for m in body["messages"]]
        tools = body.get("tools") or []
        ids, context = self._chat_ids(messages, tools)
        turn = await self._generate(ids, context, body)
        text = decode_turns(self.tokenizer, [turn.token_ids], self.chat_stops)[0]
        calls = self.parse(text) if tools else []
        calls = [] if isinstance(calls, ParseError) else calls
        content: str | None = text
        if calls:  # the text before the calls (a bare JSON call turn has none)
            before = text.split(TOOL_CALL_OPEN, 1)[0] if TOOL_CALL_OPEN in text else ""
            content = before.strip() or None
        if context is not None:
            self.traj.tool_calls += len(calls)
            reply = {"role": "assistant", "content": content, "tool_calls": _openai_calls(calls)}
            self.messages = [*messages, normalize(reply)]
        return turn, text, calls, content

    async def _complete(self, body: dict[str, Any]) -> tuple[Turn, str]:
        prompt = body["prompt"]
        ids, context = self._completion_ids(prompt)
        turn = await self._generate(ids, context, body)
        text = decode_turns(self.tokenizer, [turn.token_ids], self.stops)[0]
        if context is not None and isinstance(prompt, str):
            self.text = prompt + text
        return turn, text

    def trajectory(self) -> Trajectory:
        self.traj.prompt_ids = self.prompt
        return self.traj

    # ----------------------------------------------------------- prompts and drift

    def _chat_ids(
        self, messages: list[dict[str, Any]], tools: list[Any]
    ) -> tuple[list[int], list[int] | None]:
        """The request's prompt ids and the context it adds to the trajectory (None: not
        recorded, the request drifted or an earlier one did)."""
        key = json.dumps(tools, sort_keys=True)
        try:
            renderer = self.renderer if key == self.tools_key else None
            renderer = renderer or ToolTurnRenderer(self.tokenizer, tools)
            fresh = renderer.prompt_ids
            if self.frozen:
                return fresh(messages), None
            if self.prompt is None:
                self.renderer, self.tools_key = renderer, key
                return self._start(fresh(messages))
            if self.messages is None:  # a chat request after completions ones
                return self._drift(fresh(messages))
            n = len(self.messages)
            if key != self.tools_key or messages[:n] != self.messages:
                return self._drift(fresh(messages))
            try:
                tail = renderer.tool_turn_ids(self.messages, messages[n:], strict=False)
            except TemplateDriftError:
                return self._drift(fresh(messages))
        except Refusal:
            raise
        except Exception as err:  # the template's own complaint about these messages
            message = f"the chat template cannot render the messages: {err}"
            raise Refusal(400, message, None) from err
        return self._extend(self._closed(renderer.end_of_turn_id) + tail)

    def _completion_ids(self, prompt: str | list[int]) -> tuple[list[int], list[int] | None]:
        if isinstance(prompt, str):
            fresh = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        else:
            fresh = list(prompt)
        if self.frozen:
            return fresh, None
        if self.prompt is None:
            self.text = prompt if isinstance(prompt, str) else None
            return self._start(fresh)
        so_far = self.prompt + self.traj.response_ids
        if isinstance(prompt, str) and self.text is not None and prompt.startswith(self.text):
            rest = prompt[len(self.text) :]
            return self._extend(list(self.tokenizer.encode(rest, add_special_tokens=False)))
        if fresh[: len(so_far)] == so_far:
            return self._extend(fresh[len(so_far) :])
        return self._drift(fresh)

    def _start(self, ids: list[int]) -> tuple[list[int], list[int]]:
        self.prompt = ids
        return ids, []

    def _extend(self, context: list[int]) -> tuple[list[int], list[int]]:
        assert self.prompt is not None
        return self.prompt + self.traj.response_ids + context, context

    def _drift(self, ids: list[int]) -> tuple[list[int], None]:
        self.traj.drift += 1
        self.frozen = True
        return ids, None

    def _closed(self, eot: int) -> list[int]:
        """A turn that stopped on another stop token (or ran out) is closed by the end of
        turn the template follows it with (context, as in the tool loop)."""
        last = self.traj.response_ids[-1:]
        return [] if last == [eot] or not self.traj.turns else [eot]

    # ----------------------------------------------------------- the engine and the budget

    async def _generate(self, ids: list[int], context: list[int] | None, body: dict) -> Turn:
        if self.requests >= self.max_turns:
            self._cut(CUT_MAX_TURNS)
            raise Refusal(
                400,
                f"this trajectory has had its {self.max_turns} requests (--max-turns)",
                "max_turns_exceeded",
            )
        used = len(self.traj.response_ids) + self.unrecorded + len(context or [])
        room = self.budget - used
        if room <= 0:
            self._cut(CUT_BUDGET)
            raise Refusal(
                400,
                f"this trajectory has spent its {self.budget} response tokens "
                "(--rollout-max-response-len)",
                "context_length_exceeded",
            )
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        self.requests += 1
        self.last_prompt_len = len(ids)
        try:
            turn = await self.engine.generate(ids, min(room, asked) if asked else room)
        except Exception as err:
            self.error = err
            raise
        if context is None:
            self.unrecorded += len(turn.token_ids)
        else:
            self.traj.add_env(context)
            self.traj.add_turn(turn)
            if turn.finish_reason == "length" and len(turn.token_ids) >= room:
                self.traj.cut = CUT_BUDGET  # the budget ended the turn, not the agent's cap
        return turn

    def _cut(self, why: str) -> None:
        if not self.frozen:
            self.traj.cut, self.traj.finish_reason = why, "length"
        self.frozen = self.stopped = True
        self.on_cut()


def _openai_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]] | None:
    return [
        {"type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for c in calls
    ] or None
