"""The built-in tool loop (``--tools``): generate, run the calls, append the answers, repeat.

Where it fits: a generate function for the multi-turn seam (``vime.rollout.agent``).
Each turn the model's tokens are parsed for tool calls (:class:`ToolFormat`); no call
means the turn is the final answer. Otherwise every call runs
(``vime.rollout.tools.Toolbox``, concurrently; failures become error text the model
reads), the answers are rendered as the environment's tokens and appended, and the
model generates again -- until it answers, ``max_turns`` model turns were taken, or
the response budget (``--rollout-max-response-len``, env tokens included) is spent.

Two formats: ``chat`` renders tool turns with the checkpoint's chat template and
parses ``<tool_call>{json}</tool_call>`` (Qwen, Hermes) or a bare JSON call turn
(Llama 3.x); ``plain``, for a tokenizer
without a template (the embedded model's characters), reads a turn ``name arg ...``
whose first word is a tool's name as a call with positional arguments, and appends
the answer text followed by ``=`` (the built-in tasks' prompt end).

A turn ends on its stop token. A tool turn is written to follow the format's end of
turn (the template's end-of-turn token, ``<|im_end|>`` / ``<|eot_id|>``; EOS for
``plain``). A call turn that stopped on another of the run's stop tokens
(``--rollout-stop-token-ids``, e.g. ``<|endoftext|>``) is closed first: the end of turn
is appended as an environment token (mask 0, never trained), so the context the
model sees next is the template's, token for token, and the model's own tokens stay
as it generated them.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vime.config.errors import ConfigError
from vime.data.prompts import as_messages
from vime.rollout.agent import (
    AgentRollouts,
    AgentSample,
    EngineHandle,
    Trajectory,
    load_generate_function,
)
from vime.rollout.decoding import decode_turns, stop_token_ids
from vime.rollout.tool_turns import ToolTurnRenderer, truncate_output
from vime.rollout.tools import (
    ParseError,
    Toolbox,
    ToolCall,
    ToolResult,
    ToolSettings,
    parse_tool_calls,
)

CUT_BUDGET, CUT_MAX_TURNS = "budget", "max_turns"
PLAIN_PROMPT_END = "="


@dataclass(frozen=True)
class ToolLoopSettings:
    """``max_turns`` model turns at most; the tools' own limits."""

    max_turns: int = 4
    tools: ToolSettings = field(default_factory=ToolSettings)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"--max-turns must be >= 1, got {self.max_turns}")

    @classmethod
    def from_args(cls, args: Any) -> ToolLoopSettings:
        return cls(args.max_turns, ToolSettings(args.tool_timeout, args.tool_max_output_tokens))


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
    """Tool turns rendered by the chat template; calls in ``<tool_call>`` JSON blocks."""

    def __init__(self, tokenizer: Any, toolbox: Toolbox, max_output_tokens: int) -> None:
        self.renderer = ToolTurnRenderer(tokenizer, toolbox.schemas)
        self.max_output_tokens = max_output_tokens

    def start(self, sample: AgentSample) -> list[dict[str, Any]]:
        return as_messages(sample.prompt.text)

    def parse(self, text: str) -> list[ToolCall] | ParseError:
        return parse_tool_calls(text)

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
    """``name arg ...`` calls (the first word a tool's name); answers as text then ``=``."""

    def __init__(self, tokenizer: Any, toolbox: Toolbox, max_output_tokens: int) -> None:
        self.tokenizer, self.toolbox = tokenizer, toolbox
        self.max_output_tokens = max_output_tokens

    def start(self, sample: AgentSample) -> None:
        return None

    @property
    def end_of_turn_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def parse(self, text: str) -> list[ToolCall] | ParseError:
        words = text.split()
        if not words or words[0] not in self.toolbox.names:
            return []
        return [self.toolbox.positional_call(words[0], words[1:])]

    def answer_ids(self, state: None, turn_text: str, results: Sequence[ToolResult]) -> list[int]:
        text = " ".join(
            truncate_output(r.text, self.tokenizer, self.max_output_tokens) for r in results
        )
        return list(self.tokenizer.encode(text + PLAIN_PROMPT_END, add_special_tokens=False))


def tool_format(tokenizer: Any, toolbox: Toolbox, max_output_tokens: int) -> ToolFormat:
    """``chat`` when the tokenizer has a chat template, else ``plain``."""
    if getattr(tokenizer, "chat_template", None):
        return ChatFormat(tokenizer, toolbox, max_output_tokens)
    return PlainFormat(tokenizer, toolbox, max_output_tokens)


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
        self.format = fmt or tool_format(tokenizer, toolbox, settings.tools.max_output_tokens)

    def _text(self, ids: Sequence[int]) -> str:
        return decode_turns(self.tokenizer, [ids], self.stop_token_ids)[0]

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
    args: Any, tokenizer: Any, engines: Any, toolbox: Toolbox | None
) -> AgentRollouts | None:
    """The run's multi-turn generation: ``--custom-generate-function-path``, the tool
    loop over ``toolbox`` (``--tools``), or None for one engine call per prompt."""
    budget = args.rollout_max_response_len
    spec = args.custom_generate_function_path
    if spec is not None:
        return AgentRollouts(load_generate_function(spec), engines, budget, name=spec)
    if toolbox is None:
        return None
    if getattr(tokenizer, "chat_template", None) and not args.apply_chat_template:
        raise ConfigError(
            f"--tools {args.tools}: the model reads the tools through its chat template; "
            "add --apply-chat-template"
        )
    stops = stop_token_ids(args.rollout_stop_token_ids, tokenizer.eos_token_id)
    loop = ToolLoop(toolbox, tokenizer, ToolLoopSettings.from_args(args), stop_token_ids=stops)
    return AgentRollouts(loop, engines, budget, name=f"--tools {args.tools}")
