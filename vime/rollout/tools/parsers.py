"""Tool-call parser registry: ``--tool-parser`` name -> how the tool loop reads a turn's calls.

Where it fits: the only module that names a tool-call parser (vLLM's
``--tool-call-parser``, for vime's tool loop). The CLI asks it for the choices of
``--tool-parser`` (``vime.config.flags``) and ``vime.config.validate`` checks the flag
against the rest; the tool loop (``vime.rollout.tools.loop.tool_format``) resolves
``auto`` once the tokenizer is known and reads every turn with the spec's function.
The functions are named by ``module:attribute`` and resolved on demand, so
``vime-train --help`` imports no parser (and no torch); this module imports only
``vime.errors`` when it loads (vime.config imports it).

A parser is ``(text, toolbox) -> list[ToolCall] | ParseError`` (``vime.rollout.tools.toolbox``):
``[]`` when the turn is a final answer. ``chat`` parsers read turns framed by the
checkpoint's chat template, whose tool turns the template renders (they need a
template and ``--apply-chat-template``); ``plain`` reads raw text.

``auto`` is the loop's choice before the flag existed, unchanged: with a chat template
:data:`AUTO_CHAT` (``hermes``, and a turn without any ``<tool_call>`` tag read as
``llama3_json``, whatever the template), without one ``plain``.

Adding a parser: its function in ``vime.rollout.tools.toolbox`` and one ``ToolParserSpec`` below.
"""

from __future__ import annotations

from dataclasses import dataclass

from vime.errors import ConfigError


@dataclass(frozen=True)
class ToolParserSpec:
    """One tool-call parser: ``parse`` names its ``(text, toolbox)`` function by
    ``module:attribute``; ``chat``: it reads turns the chat template frames."""

    name: str
    summary: str
    parse: str
    chat: bool


_SPECS = (
    ToolParserSpec(
        name="hermes",
        summary="<tool_call>{json}</tool_call> blocks (Qwen, Hermes)",
        parse="vime.rollout.tools.toolbox:parse_hermes",
        chat=True,
    ),
    ToolParserSpec(
        name="llama3_json",
        summary="a turn of JSON calls, separated by ';' or one a line, optionally after "
        "<|python_tag|> (Llama 3.x)",
        parse="vime.rollout.tools.toolbox:parse_llama3_json",
        chat=True,
    ),
    ToolParserSpec(
        name="plain",
        summary="'name arg ...', the answer appended as text then '=' (no chat template: "
        "the embedded model)",
        parse="vime.rollout.tools.toolbox:parse_plain",
        chat=False,
    ),
)
PARSERS: dict[str, ToolParserSpec] = {spec.name: spec for spec in _SPECS}

AUTO = "auto"
# What auto reads a chat template's turns with: the tool loop's reading before
# --tool-parser, for every template alike.
AUTO_CHAT = ToolParserSpec(
    name=AUTO,
    summary="hermes, and a turn without <tool_call> as llama3_json",
    parse="vime.rollout.tools.toolbox:parse_tool_calls",
    chat=True,
)
# auto without a chat template.
AUTO_PLAIN = PARSERS["plain"]


def tool_parser_choices() -> tuple[str, ...]:
    """What ``--tool-parser`` accepts: ``auto``, then every registered parser."""
    return (AUTO, *PARSERS)


def get_tool_parser(name: str) -> ToolParserSpec:
    """The parser registered under ``name``; ConfigError naming the choices in one line."""
    spec = PARSERS.get(name)
    if spec is None:
        choices = ", ".join(tool_parser_choices())
        raise ConfigError(f"--tool-parser {name!r}: no such tool parser; choose from: {choices}")
    return spec


def resolve_tool_parser(name: str, has_template: bool) -> ToolParserSpec:
    """The parser ``name`` reads turns with: ``auto`` is :data:`AUTO_CHAT` for a tokenizer
    with a chat template, ``plain`` without; a registered name stands (whether it fits
    the tokenizer is the caller's check: ``vime.rollout.tools.loop.tool_parser_for``)."""
    if name == AUTO:
        return AUTO_CHAT if has_template else AUTO_PLAIN
    return get_tool_parser(name)
