"""``docs/flags.md``, written from the parser itself.

Run ``python -m vime.config.flag_docs > docs/flags.md`` after changing a flag;
``tests/cpu/test_flag_docs.py`` fails while the committed file differs from what
this prints. The reference lists what ``vime-train --help`` does, as a table per
group: the common flags (``vime.config.flags``, the rollout engines' own flags
included), then each training backend's own flags (the registry's ``add_flags``).

Where it fits: a tool beside the parser, never imported by it; like parsing, it
imports no torch, engine or backend library.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Iterator

from vime.backends import registry
from vime.config.flags import (
    EMBEDDED_DEFAULTS,
    EMBEDDED_EVAL_INTERVAL,
    non_negative_int,
    positive_int,
)
from vime.config.parser import PROG, build_parser

COMMAND = "python -m vime.config.flag_docs > docs/flags.md"

# What the embedded default (no --hf-checkpoint) sets beyond EMBEDDED_DEFAULTS, once
# the flags are parsed (``apply_embedded_eval_defaults``).
EMBEDDED_DERIVED = {
    "eval_prompt_data": "builtin:<task>:eval",
    "eval_interval": EMBEDDED_EVAL_INTERVAL,
}

HEADER = f"""\
# Flags

<!-- Generated from the parser: `{COMMAND}`.
Edit the flags' help in the code, not this file; tests/cpu/test_flag_docs.py
fails while the two differ. -->

Every flag `{PROG}` parses, with the help `{PROG} --help` prints: the common flags
by group, then each training backend's own, which parse only after
`--train-backend NAME` (`{PROG} --train-backend NAME --help` lists them). A flag
of the other backend, or a misspelt one, is refused in one line that says so.

Without `--hf-checkpoint` the run trains the embedded default model, and the
*embedded* column's settings replace the defaults, each still overridable; a
built-in tool task also sets its own token budget and run length
(`vime/data/tasks.py`).
"""

_PLACEHOLDERS = {int: "N", positive_int: "N", non_negative_int: "N", float: "X"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) if value else "none"
    return str(value)


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    return _value(action.default)


def _embedded(action: argparse.Action) -> str:
    for source in (EMBEDDED_DEFAULTS, EMBEDDED_DERIVED):
        if action.dest in source:
            return f"`{_value(source[action.dest])}`"
    return ""


def _invocation(action: argparse.Action) -> str:
    # As --help spells it ("--rollout-engine {auto,vllm,hf}", "--use-tis, --no-use-tis"),
    # a value without a metavar of its own shown by its type: N, X or VALUE.
    if action.metavar is None and action.choices is None and action.nargs != 0:
        action = copy.copy(action)
        action.metavar = _PLACEHOLDERS.get(action.type, "VALUE")
    return argparse.HelpFormatter(PROG)._format_action_invocation(action)


def _help(action: argparse.Action) -> str:
    return (action.help or "").replace("%%", "%")


def _table(actions: list[argparse.Action], embedded: bool) -> Iterator[str]:
    if embedded:
        yield "| flag | default | embedded | what it does |"
        yield "|---|---|---|---|"
    else:
        yield "| flag | default | what it does |"
        yield "|---|---|---|"
    for action in actions:
        cells = [f"`{_invocation(action)}`", f"`{_default(action)}`"]
        if embedded:
            cells.append(_embedded(action))
        cells.append(_help(action))
        yield "| " + " | ".join(_cell(c) for c in cells) + " |"


def _documented(group: argparse._ArgumentGroup) -> list[argparse.Action]:
    return [
        a
        for a in group._group_actions
        if a.option_strings
        and a.help != argparse.SUPPRESS
        and not isinstance(a, argparse._HelpAction)
    ]


def _section(title: str, group: argparse._ArgumentGroup, level: str) -> Iterator[str]:
    actions = _documented(group)
    if not actions:
        return
    yield ""
    yield f"{level} {title}"
    yield ""
    if group.description:
        yield group.description[0].upper() + group.description[1:] + "."
        yield ""
    yield from _table(actions, embedded=any(_embedded(a) for a in actions))


def render() -> str:
    """The whole reference, as ``docs/flags.md`` holds it."""
    lines = [HEADER.rstrip("\n"), "", "## Common flags"]
    common = build_parser(None)
    for group in common._action_groups:
        title = group.title if group.description else "top level"
        lines += _section(title, group, "###")
    common_titles = {group.title for group in common._action_groups}
    lines += ["", "## Backend flags"]
    for spec in registry.BACKENDS.values():
        parser = build_parser(spec.name)
        for group in parser._action_groups:
            if group.title not in common_titles:
                title = f"{group.title} (`--train-backend {spec.name}`)"
                lines += _section(title, group, "###")
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
