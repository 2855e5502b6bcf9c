"""The built-in tool loop (``--tools``): generate, run the calls, append the answers, repeat.

Where it fits: a generate function for the multi-turn seam (``vime.rollout.agent``).
Each turn the model's tokens are parsed for tool calls (:class:`ToolFormat`); no call
means the turn is the final answer. Otherwise every call runs
(``vime.rollout.tools.toolbox.Toolbox``, concurrently; failures become error text the model
reads), the answers are rendered as the environment's tokens and appended, and the
model generates again -- until it answers, ``max_turns`` model turns were taken, or
the response budget (``--rollout-max-response-len``, env tokens included) is spent.

Two formats: ``chat`` renders tool turns with the checkpoint's chat template; ``plain``,
for a tokenizer without a template (the embedded model's characters), appends the
answer text followed by ``=`` (the built-in tasks' prompt end). ``--tool-parser``
(``ToolLoopSettings.parser``, named in ``vime.rollout.tools.parsers``) says how a turn's
calls are read: ``hermes`` (``<tool_call>{json}</tool_call>``, Qwen, Hermes) and
``llama3_json`` (a bare JSON call turn, Llama 3.x) in the chat format, ``plain`` (a
turn ``name arg ...`` whose first word is a tool's name: a call with positional
arguments) in the plain one. ``auto``, the default, is the choice the loop always
made: with a chat template hermes, a turn without any ``<tool_call>`` tag read as
llama3_json; without one plain. A named chat parser needs a template, which is known
once the checkpoint's tokenizer is loaded: the run checks it then
(:func:`check_tool_format`), before it renders a prompt or starts Ray.

A turn ends on its stop token. One that stopped on ``</tool_call>`` (a stop id whose
text is the closing tag) is parsed with the tag, as the call it completes. A tool
turn is written to follow the format's end of turn (the template's end-of-turn token,
``<|im_end|>`` / ``<|eot_id|>``; EOS for ``plain``). A call turn that stopped on
another of the run's stop tokens (``--rollout-stop-token-ids``, e.g. ``<|endoftext|>``
or ``</tool_call>``) is closed first: the end of turn is appended as an environment
token (mask 0, never trained), so the context the model sees next is the template's,
token for token, and the model's own tokens stay as it generated them.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from vime.backends.registry import resolve
from vime.data.prompts import as_messages
from vime.errors import ConfigError
from vime.rollout.agent import (
    AgentRollouts,
    AgentSample,
    EngineHandle,
    Trajectory,
    load_generate_function,
)
from vime.rollout.decoding import decode_turns, stop_token_ids
from vime.rollout.settings import AgentSettings, ToolLoopSettings
from vime.rollout.tools.parsers import AUTO, ToolParserSpec, resolve_tool_parser
from vime.rollout.tools.toolbox import (
    ParseError,
    Toolbox,
    ToolCall,
    ToolResult,
    call_closing_ids,
    parse_plain,
    parse_tool_calls,
)
from vime.rollout.tools.turns import ToolTurnRenderer, truncate_output

# A parser (vime.rollout.tools.parsers): the calls of one turn, [] for an answer.
Parse = Callable[[str, Toolbox], list[ToolCall] | ParseError]

CUT_BUDGET, CUT_MAX_TURNS = "budget", "max_turns"
PLAIN_PROMPT_END = "="


class ToolFormat(Protocol):
    """How tool calls are read from a model turn and answers written back as tokens."""

    def start(self, sample: AgentSample) -> Any:
        """Per-trajectory state (the chat format's message list)."""
        ...

    def parse(self, text: str) -> list[ToolCall] | ParseError: ...

    @property
    def end_of_turn_id(self) -> int | None:
        """The token a model turn ends with before a tool turn follows it (None: none)."""
        ...

    def answer_ids(
        self, state: Any, turn_text: str, results: Sequence[ToolResult]
    ) -> list[int]: ...


class ChatFormat:
    """Tool turns rendered by the chat template; calls read by ``parse`` (default
    ``auto``'s: ``<tool_call>`` JSON blocks, else a bare JSON call turn)."""

    def __init__(
        self,
        tokenizer: Any,
        toolbox: Toolbox,
        max_output_tokens: int,
        parse: Parse = parse_tool_calls,
    ) -> None:
        self.renderer = ToolTurnRenderer(tokenizer, toolbox.schemas)
        self.toolbox, self.max_output_tokens, self._parse = toolbox, max_output_tokens, parse

    def start(self, sample: AgentSample) -> list[dict[str, Any]]:
        return as_messages(sample.prompt.text)

    def parse(self, text: str) -> list[ToolCall] | ParseError:
        return self._parse(text, self.toolbox)

    @property
    def end_of_turn_id(self) -> int:
        return self.renderer.end_of_turn_id

    def answer_ids(
        self, state: list[dict[str, Any]], turn_text: str, results: Sequence[ToolResult]
    ) -> list[int]:
        state.append({"role": "assistant", "content": turn_text})
        new = self.renderer.tool_messages(results, max_output_tokens=self.max_output_tokens)
        # Qwen3's template re-renders earlier turns; the tail is still exact (strict=False).
        ids = self.renderer.tool_turn_ids(state, new, strict=False)
        state.extend(new)
        return ids


class PlainFormat:
    """Answers as text then ``=``; calls read by ``parse`` (default ``name arg ...``, the
    first word a tool's name)."""

    def __init__(
        self,
        tokenizer: Any,
        toolbox: Toolbox,
        max_output_tokens: int,
        parse: Parse = parse_plain,
    ) -> None:
        self.tokenizer, self.toolbox = tokenizer, toolbox
        self.max_output_tokens, self._parse = max_output_tokens, parse

    def start(self, sample: AgentSample) -> None:
        return None

    @property
    def end_of_turn_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def parse(self, text: str) -> list[ToolCall] | ParseError:
        return self._parse(text, self.toolbox)

    def answer_ids(self, state: None, turn_text: str, results: Sequence[ToolResult]) -> list[int]:
        text = " ".join(
            truncate_output(r.text, self.tokenizer, self.max_output_tokens) for r in results
        )
        return list(self.tokenizer.encode(text + PLAIN_PROMPT_END, add_special_tokens=False))


def tool_parser_for(name: str, tokenizer: Any) -> ToolParserSpec:
    """The parser ``--tool-parser name`` reads ``tokenizer``'s turns with (``auto``: by
    whether it has a chat template); a chat parser (hermes, llama3_json) for a tokenizer
    without a template is a ConfigError."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    spec = resolve_tool_parser(name, has_template)
    if spec.chat and not has_template:
        raise ConfigError(
            f"--tool-parser {name}: the checkpoint's tokenizer has no chat template, and "
            f"{name} reads turns the template frames (its tool turns are the template's); "
            "use --tool-parser plain, without --apply-chat-template"
        )
    return spec


def tool_format(
    tokenizer: Any, toolbox: Toolbox, max_output_tokens: int, parser: str = AUTO
) -> ToolFormat:
    """The format of ``--tool-parser parser``: ``chat`` for hermes, llama3_json and
    ``auto`` with a chat template, else ``plain``; its turns read by the parser."""
    spec = tool_parser_for(parser, tokenizer)
    fmt = ChatFormat if spec.chat else PlainFormat
    return fmt(tokenizer, toolbox, max_output_tokens, resolve(spec.parse))


def check_tool_format(settings: AgentSettings, tokenizer: Any) -> ToolParserSpec:
    """The parser ``--tool-parser`` picks for the run's ``tokenizer``; ConfigError when
    it cannot read this model's turns: a named chat parser and no chat template, or a
    chat template without ``--apply-chat-template`` (the tools are shown through it).

    The template is known once the checkpoint's tokenizer is loaded: ``vime.trainer.Run``
    calls this then, before it renders a prompt or starts Ray; :func:`build_agent` again.
    """
    assert settings.loop is not None, "the tool loop's format: --tools only"
    spec = tool_parser_for(settings.loop.parser, tokenizer)
    if spec.chat and not settings.apply_chat_template:
        raise ConfigError(
            f"--tools {settings.tools}: the model reads the tools through its chat template; "
            "add --apply-chat-template"
        )
    return spec


class ToolLoop:
    """``async (sample, engine) -> Trajectory``: the built-in multi-turn tool loop."""

    def __init__(
        self,
        toolbox: Toolbox,
        tokenizer: Any,
        settings: ToolLoopSettings,
        *,
        stop_token_ids: Sequence[int] = (),
        fmt: ToolFormat | None = None,
    ) -> None:
        self.toolbox, self.tokenizer, self.settings = toolbox, tokenizer, settings
        self.stop_token_ids = frozenset(stop_token_ids)
        # A turn stopped on </tool_call> is read with the tag: the call is complete.
        self._text_stops = self.stop_token_ids - call_closing_ids(tokenizer, stop_token_ids)
        self.format = fmt or tool_format(
            tokenizer, toolbox, settings.tools.max_output_tokens, settings.parser
        )

    def _text(self, ids: Sequence[int]) -> str:
        return decode_turns(self.tokenizer, [ids], self._text_stops)[0]

    async def __call__(self, sample: AgentSample, engine: EngineHandle) -> Trajectory:
        traj = Trajectory()
        state = self.format.start(sample)
        errors: collections.Counter[str] = collections.Counter()
        context = list(sample.prompt_ids)
        for turn_number in range(1, self.settings.max_turns + 1):
            turn = await engine.generate(context + traj.response_ids)
            traj.add_turn(turn)
            if turn.finish_reason == "length":
                traj.cut = CUT_BUDGET
                break
            text = self._text(turn.token_ids)
            calls = self.format.parse(text)
            if calls == []:
                break
            if turn_number == self.settings.max_turns:
                traj.cut, traj.finish_reason = CUT_MAX_TURNS, "length"
                break
            results = await self._run(calls)
            traj.tool_calls += len(results)
            traj.tool_seconds += sum(r.seconds for r in results)
            errors.update(r.kind for r in results if r.kind is not None)
            answer = self.format.answer_ids(state, text, results)
            eot = self.format.end_of_turn_id
            if eot is not None and turn.token_ids[-1:] != [eot]:  # another stop: close the turn
                answer = [eot, *answer]
            if engine.room(context + traj.response_ids + answer) <= 0:
                traj.cut, traj.finish_reason = CUT_BUDGET, "length"
                break
            traj.add_env(answer)
        traj.tool_errors = dict(errors)
        return traj

    async def _run(self, calls: list[ToolCall] | ParseError) -> list[ToolResult]:
        if isinstance(calls, ParseError):
            return [calls.as_result()]
        timeout = self.settings.tools.timeout_s
        return list(await asyncio.gather(*(self.toolbox.run(c, timeout_s=timeout) for c in calls)))


def build_agent(
    settings: AgentSettings, tokenizer: Any, engines: Any, toolbox: Toolbox | None
) -> AgentRollouts | None:
    """The run's multi-turn generation: ``--agent-function-path`` (its endpoint started:
    the caller closes it), ``--custom-generate-function-path``, the tool loop over
    ``toolbox`` (``--tools``), or None for one engine call per prompt."""
    budget = settings.budget
    if settings.agent_function is not None or settings.environment is not None:
        from vime.rollout.endpoint.agent import build_endpoint_agent  # fastapi, openai

        return build_endpoint_agent(settings, tokenizer, engines)
    spec = settings.generate_function
    if spec is not None:
        return AgentRollouts(load_generate_function(spec), engines, budget, name=spec)
    if toolbox is None:
        return None
    check_tool_format(settings, tokenizer)
    assert settings.loop is not None
    stops = stop_token_ids(settings.stop_token_ids, tokenizer.eos_token_id)
    loop = ToolLoop(toolbox, tokenizer, settings.loop, stop_token_ids=stops)
    return AgentRollouts(loop, engines, budget, name=f"--tools {settings.tools}")
