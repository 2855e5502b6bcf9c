"""Token ids of the environment's side of a tool-using conversation.

Where it fits: the tool loop (``vime.rollout.tools.loop``) starts each episode from
:meth:`ToolTurnRenderer.prompt_ids` (the chat template with ``tools=`` and the
generation prompt) and, after a turn that called tools, appends
:meth:`ToolTurnRenderer.tool_turn_ids` to the engine's generated ids before
generating again. Token in, token out: the model's own tokens are never decoded
and re-tokenized; only the template's text *after* the model's turn (the rest
of its scaffolding, the tool turn, the next generation prompt) is rendered and
tokenized, found as the difference between rendering the conversation without
and with the new messages, with a check that the template did not re-render
what came before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vime.rollout.tools.toolbox import ToolResult

TRUNCATED = "…[truncated]"


class TemplateDriftError(ValueError):
    """The chat template renders earlier turns differently once new messages follow."""


def truncate_output(text: str, tokenizer: Any, max_tokens: int) -> str:
    """``text`` cut to its first ``max_tokens`` tokens plus :data:`TRUNCATED`, if longer."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=False) + TRUNCATED


class ToolTurnRenderer:
    """The chat template of ``tokenizer`` with ``tools`` (JSON schemas, ``Toolbox.schemas``).

    ``end_of_turn`` is the text of the token that ends the model's turn, the
    stop token kept at the end of its generated ids (default: the tokenizer's
    EOS, ``<|im_end|>`` for Qwen instruct models, ``<|eot_id|>`` for Llama 3).
    ``template_kwargs`` go to every render (e.g. ``enable_thinking=False``).
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[Mapping[str, Any]],
        *,
        end_of_turn: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tool use needs a chat template, and the tokenizer has none")
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools]
        self.end_of_turn = end_of_turn or tokenizer.eos_token
        if not self.end_of_turn:
            raise ValueError("no end_of_turn given and the tokenizer has no EOS token")
        self.template_kwargs = dict(template_kwargs or {})

    @property
    def end_of_turn_id(self) -> int:
        """The id a model turn ends with before a tool turn: the tool loop appends it (mask
        0) to a turn that stopped on another stop token (``vime.rollout.tools.loop``)."""
        return self.tokenizer.convert_tokens_to_ids(self.end_of_turn)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text (the template wrote any BOS itself, as tokenize=True does)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The first prompt: ``messages`` with the tools' schemas and the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def tool_messages(
        self, results: Sequence[ToolResult], *, max_output_tokens: int
    ) -> list[dict[str, Any]]:
        """One ``tool`` message per result, in call order, each output truncated first."""
        return [
            {
                "role": "tool",
                "name": r.name,
                "content": truncate_output(r.text, self.tokenizer, max_output_tokens),
            }
            for r in results
        ]

    def tool_turn_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        *,
        strict: bool = True,
    ) -> list[int]:
        """Ids to append after the model's turn: the rest of that turn's scaffolding
        (e.g. the newline after ``<|im_end|>``), ``new_messages`` (tool results), and
        the generation prompt of the next assistant turn.

        ``messages`` is the conversation so far, ending with the assistant turn
        whose generated ids end with :attr:`end_of_turn`. The text appended is
        what follows the end of that turn in the rendering with ``new_messages``.
        ``strict``: that rendering must start with the rendering without them,
        or :class:`TemplateDriftError`. With ``strict=False`` a template that
        re-renders earlier turns (Qwen3's drops the empty ``<think>`` block of an
        assistant turn that is no longer last, and the reasoning of turns before
        the last user message) is accepted: the cut is then the same count of
        ``end_of_turn`` markers into the new rendering. Either way what is
        appended is exactly the tail of the new rendering, tokenized alone.
        """
        before = self.render(messages, add_generation_prompt=False)
        after = self.render([*messages, *new_messages], add_generation_prompt=True)
        eot = self.end_of_turn
        turns = before.count(eot)
        if not turns:
            raise ValueError(
                f"the rendered conversation has no end-of-turn marker {eot!r}; "
                "pass the stop token the model's turns end with as end_of_turn"
            )
        if after.startswith(before):
            cut = before.rindex(eot) + len(eot)
        elif strict:
            raise TemplateDriftError(_drift(before, after))
        else:
            cut = _nth_end(after, eot, turns)
            closing = before[before.rindex(eot) + len(eot) :]
            if cut < 0 or not after.startswith(closing, cut):
                raise TemplateDriftError(
                    _drift(before, after) + f"; and the {turns}th {eot!r} does not line up"
                )
        return self.encode(after[cut:])


def _nth_end(text: str, marker: str, n: int) -> int:
    """The index just past the ``n``-th occurrence of ``marker`` in ``text``, or -1."""
    at = -len(marker)
    for _ in range(n):
        at = text.find(marker, at + len(marker))
        if at < 0:
            return -1
    return at + len(marker)


def _drift(before: str, after: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), None)
    i = min(len(before), len(after)) if i is None else i
    return (
        "the chat template re-renders the conversation when messages are added "
        f"(first difference at char {i}: {before[max(0, i - 20) : i + 20]!r} became "
        f"{after[max(0, i - 20) : i + 20]!r}); appending its tail would not match the "
        "tokens so far (strict=False cuts after the last turn's end-of-turn marker instead)"
    )
