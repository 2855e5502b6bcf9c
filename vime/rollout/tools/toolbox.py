"""Tools a policy may call during a rollout: loading, parsing calls, running them.

Where it fits: the tool loop (``vime.rollout.tools.loop``) loads the user's functions
once with :func:`load_tools` (``module:NAME``, NAME a list of functions), shows
their JSON schemas (``Toolbox.schemas``) to the chat template, parses each
generated turn with the ``--tool-parser``'s function (:func:`parse_hermes`, the
Qwen/Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks;
:func:`parse_llama3_json`, Llama 3.x's bare JSON call turn; :func:`parse_plain`,
``name arg ...``; ``auto``'s :func:`parse_tool_calls`; the names are
``vime.rollout.tools.parsers``'s) and awaits :meth:`Toolbox.run` per call. This
module owns the tools' contract: a bad tool list is a one-line ``ConfigError`` at
start-up; at rollout time nothing raises -- every failure (malformed call, unknown
tool, bad arguments, a tool that raised or ran past its timeout) is a
:class:`ToolResult` whose text the model reads and whose ``kind`` feeds metrics.
Rendering results back into token ids lives in
:mod:`vime.rollout.tools.turns`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from vime.algo.custom import import_module_spec
from vime.errors import ConfigError

ErrorKind = Literal["parse", "unknown_tool", "bad_arguments", "raised", "timeout"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("parse", "unknown_tool", "bad_arguments", "raised", "timeout")

MAX_ERROR_CHARS = 300  # an error line the model reads stays short
_FORM = "expected 'module.path:NAME' or 'path/to/file.py:NAME', NAME a list of functions"


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a tool name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """What a call gave back: ``text`` for the model; ``kind`` is None or an ErrorKind."""

    name: str
    text: str
    kind: ErrorKind | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.kind is None


@dataclass(frozen=True)
class ParseError:
    """A turn whose tool calls could not be read; ``message`` is one line for the model."""

    message: str

    def as_result(self) -> ToolResult:
        return ToolResult(name="", text=f"error: {self.message}", kind="parse")


# ---------------------------------------------------------------- loading


def load_tools(spec: str, *, max_threads: int = 32) -> Toolbox:
    """The :class:`Toolbox` of ``spec`` = ``<module>:<NAME>``, NAME a list of functions.

    ``<module>`` resolves as in :func:`vime.algo.custom.load_function` (a dotted
    module or a ``.py`` path). Every problem is a one-line ``ConfigError``.
    """
    module_part, _, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not module_part or not name.isidentifier():
        raise ConfigError(f"--tools {spec!r}: {_FORM}")
    try:
        module = import_module_spec(module_part)
    except ValueError as e:
        raise ConfigError(f"--tools {spec!r}: {e}") from e
    if not hasattr(module, name):
        raise ConfigError(f"--tools {spec!r}: module {module_part!r} has no attribute {name!r}")
    tools = getattr(module, name)
    if not isinstance(tools, list | tuple):
        raise ConfigError(
            f"--tools {spec!r}: {name} is a {type(tools).__name__}; expected a list of functions"
        )
    return Toolbox(tools, source=f"--tools {spec!r}", max_threads=max_threads)


@dataclass(frozen=True)
class _Tool:
    fn: Callable[..., Any]
    schema: dict[str, Any]
    signature: inspect.Signature
    is_async: bool


def _schema(fn: Callable[..., Any], where: str) -> dict[str, Any]:
    """transformers' schema of ``fn``, its errors turned into what to fix."""
    from transformers.utils import get_json_schema

    name = fn.__name__
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ConfigError(
                f"{where}: tool {name!r}: parameter {p.name!r} is {p.kind.description}; "
                "tool arguments arrive by name, so use plain named parameters"
            )
    try:
        return get_json_schema(fn)
    except Exception as e:
        msg = " ".join(str(a) for a in e.args)
        if "has no docstring" in msg:
            fix = "no docstring; add one (a description, then 'Args:' with 'name: text' lines)"
        elif m := re.search(r"no description for the argument '(\w+)'", msg):
            arg = m.group(1)
            fix = f"the docstring's Args: section does not describe {arg!r}; add '{arg}: <text>'"
            if re.search(rf"^\s*{arg}\s*\(", inspect.getdoc(fn) or "", re.M):
                fix += f" (transformers reads no type in parentheses: not '{arg} (type): ...')"
        elif m := re.search(r"Argument (\w+) is missing a type hint", msg):
            fix = f"argument {m.group(1)!r} has no type hint; annotate it (e.g. {m.group(1)}: str)"
        else:
            fix = (
                f"no JSON schema from its type hints ({type(e).__name__}: {msg}); use str, int, "
                "float, bool, list[...], dict[str, ...], Literal[...] or unions of them"
            )
        raise ConfigError(f"{where}: tool {name!r}: {' '.join(fix.split())}") from e


class Toolbox:
    """Named tools with their schemas; :meth:`run` executes one call, never raising.

    Sync tools run on a private thread pool of ``max_threads`` workers (a call
    past its timeout is abandoned, but its thread cannot be killed and stays
    busy until the function returns); async tools run on the caller's loop.
    """

    def __init__(
        self, tools: Sequence[Callable[..., Any]], *, source: str = "tools", max_threads: int = 32
    ) -> None:
        if not tools:
            raise ConfigError(f"{source}: the tool list is empty; give at least one function")
        self._tools: dict[str, _Tool] = {}
        for i, fn in enumerate(tools, 1):
            if not callable(fn):
                raise ConfigError(f"{source}: item {i} is a {type(fn).__name__}, not callable")
            if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
                raise ConfigError(
                    f"{source}: item {i} is a {type(fn).__name__}; tools must be functions "
                    "(def / async def) with a docstring, so wrap it in one"
                )
            if fn.__name__ in self._tools:
                raise ConfigError(
                    f"{source}: two tools are named {fn.__name__!r}; tool names must be unique"
                )
            self._tools[fn.__name__] = _Tool(
                fn, _schema(fn, source), inspect.signature(fn), inspect.iscoroutinefunction(fn)
            )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_threads, thread_name_prefix="vime-tool"
        )

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The ``tools=`` list for ``apply_chat_template`` (transformers' JSON schemas)."""
        return [t.schema for t in self._tools.values()]

    def positional_call(self, name: str, values: Sequence[Any]) -> ToolCall:
        """A call whose arguments came in order (the plain format), bound to the tool's
        parameter names; values beyond them keep numbered names, which ``run`` reports."""
        tool = self._tools.get(name)
        params = list(tool.signature.parameters) if tool else []
        names = params + [f"arg{k + 1}" for k in range(len(params), len(values))]
        return ToolCall(name, dict(zip(names, values, strict=False)))

    async def run(self, call: ToolCall, *, timeout_s: float) -> ToolResult:
        """Run ``call``; any failure becomes an error :class:`ToolResult`."""
        start = time.perf_counter()

        def result(text: str, kind: ErrorKind | None = None) -> ToolResult:
            if kind is not None:
                text = _one_line(f"error: {text}")
            return ToolResult(call.name, text, kind, time.perf_counter() - start)

        tool = self._tools.get(call.name)
        if tool is None:
            return result(
                f"unknown tool {call.name!r}; tools: {', '.join(self._tools)}", "unknown_tool"
            )
        try:
            tool.signature.bind(**call.arguments)
        except TypeError as e:
            takes = ", ".join(
                p.name if p.default is p.empty else f"{p.name}="
                for p in tool.signature.parameters.values()
            )
            return result(
                f"bad arguments for {call.name}: {e}; it takes ({takes})", "bad_arguments"
            )
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                value = await self._call(tool, call.arguments)
                # str as is, anything else as JSON (what json cannot encode, as str()).
                text = (
                    value
                    if isinstance(value, str)
                    else json.dumps(value, ensure_ascii=False, default=str)
                )
        except TimeoutError:
            if deadline.expired():
                return result(f"{call.name} timed out after {timeout_s:g} s", "timeout")
            return result(f"{call.name} raised TimeoutError", "raised")
        except (Exception, SystemExit) as e:
            return result(f"{call.name} raised {type(e).__name__}: {e}", "raised")
        return result(text)

    async def _call(self, tool: _Tool, arguments: dict[str, Any]) -> Any:
        if tool.is_async:
            return await tool.fn(**arguments)
        loop = asyncio.get_running_loop()
        value = await loop.run_in_executor(self._pool, functools.partial(tool.fn, **arguments))
        # A sync wrapper may hand back an awaitable (e.g. it returns a coroutine).
        return await value if inspect.isawaitable(value) else value

    def close(self) -> None:
        """Release the worker threads (abandoned calls keep theirs until they return)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


# ---------------------------------------------------------------- parsing

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_CLOSE = "</think>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open a call with it


def call_closing_ids(tokenizer: Any, stops: Iterable[int]) -> frozenset[int]:
    """The ids among ``stops`` whose text is a call's closing tag, ``</tool_call>`` (one
    token in Qwen's vocabulary). A turn that stopped on one ends with a complete call,
    so the text its parser reads keeps the tag: decode it with these ids left out of
    the stops (``vime.rollout.decoding.decode_turns``). The ids stay the engine's."""
    return frozenset(
        i for i in stops if tokenizer.decode([i], skip_special_tokens=False) == TOOL_CALL_CLOSE
    )


def parse_tool_calls(text: str, toolbox: Toolbox | None = None) -> list[ToolCall] | ParseError:
    """``--tool-parser auto``'s reading of a chat model's turn (the only one before the
    flag): :func:`parse_hermes`, and a turn without any ``<tool_call>`` tag read by
    :func:`parse_llama3_json`, whatever the template.

    ``[]``: no call, the turn is a final answer. A list: the calls to run.
    :class:`ParseError`: some call is malformed; the loop shows its message to the
    model. ``toolbox`` is not needed (a parser's signature: ``vime.rollout.tools.parsers``).
    """
    calls = parse_hermes(text)
    return calls if calls != [] else parse_llama3_json(text)


def parse_hermes(text: str, toolbox: Toolbox | None = None) -> list[ToolCall] | ParseError:
    """``--tool-parser hermes``: the Qwen/Hermes ``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`` blocks of one generated turn, in order; a turn without any is
    an answer (a bare JSON object too: that is ``llama3_json``'s form).

    :class:`ParseError` when some block is malformed (bad JSON, no ``name``,
    ``arguments`` not an object, an unterminated or stray tag). ``arguments`` may also
    be a JSON string holding the object, and may be left out (``{}``). Text up to the
    last ``</think>`` is reasoning and is not searched.
    """
    text = _after_thinking(text)
    calls: list[ToolCall] = []
    pos = 0
    while True:
        open_at = text.find(TOOL_CALL_OPEN, pos)
        stray = text.find(TOOL_CALL_CLOSE, pos)
        if stray != -1 and (open_at == -1 or stray < open_at):
            return ParseError(f"{TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN} (call {len(calls) + 1})")
        if open_at == -1:
            return calls
        body_at = open_at + len(TOOL_CALL_OPEN)
        close_at = text.find(TOOL_CALL_CLOSE, body_at)
        reopen = text.find(TOOL_CALL_OPEN, body_at)
        if close_at == -1 or (reopen != -1 and reopen < close_at):
            return ParseError(f"tool call {len(calls) + 1}: {TOOL_CALL_OPEN} is never closed")
        call = _parse_call(text[body_at:close_at], len(calls) + 1)
        if isinstance(call, ParseError):
            return call
        calls.append(call)
        pos = close_at + len(TOOL_CALL_CLOSE)


def parse_llama3_json(text: str, toolbox: Toolbox | None = None) -> list[ToolCall] | ParseError:
    """``--tool-parser llama3_json``: Llama 3.x's JSON tool calling, a turn that is JSON
    objects ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally after
    ``<|python_tag|>``, separated by ``;`` or one a line: one call each, in order. Any
    other turn is an answer, ``<tool_call>`` blocks and JSON that names no call
    included; a call with a malformed argument object is a :class:`ParseError`. Text
    up to the last ``</think>`` is not searched.
    """
    return _bare_json_call(_after_thinking(text))


def parse_plain(text: str, toolbox: Toolbox) -> list[ToolCall] | ParseError:
    """``--tool-parser plain``: a turn ``name arg ...`` whose first word is one of
    ``toolbox``'s tools is a call with those positional arguments
    (:meth:`Toolbox.positional_call`); any other turn is an answer."""
    words = text.split()
    if not words or words[0] not in toolbox.names:
        return []
    return [toolbox.positional_call(words[0], words[1:])]


def _after_thinking(text: str) -> str:
    """``text`` after its last ``</think>`` (reasoning is not searched for calls)."""
    return text.rsplit(THINK_CLOSE, 1)[1] if THINK_CLOSE in text else text


def _bare_json_call(text: str) -> list[ToolCall] | ParseError:
    """Llama 3.x's form: the whole turn JSON objects, each with a name and its parameters,
    separated by ``;`` or whitespace (one a line); any other text (JSON that names no
    call included) is an answer."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not (body.startswith("{") and body.endswith("}")):
        return []
    objects = _json_objects(body)
    if not objects or not all(
        isinstance(obj, dict) and "name" in obj and ("parameters" in obj or "arguments" in obj)
        for obj, _ in objects
    ):
        return []
    calls = [_parse_call(raw, n) for n, (_, raw) in enumerate(objects, 1)]
    error = next((c for c in calls if isinstance(c, ParseError)), None)
    return error if error is not None else [c for c in calls if isinstance(c, ToolCall)]


def _json_objects(body: str) -> list[tuple[Any, str]] | None:
    """Each JSON value of ``body`` with its text, in order, where values are separated
    by whitespace and at most one ``;``; None when ``body`` is not such a sequence."""
    decoder, objects, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return None
        objects.append((obj, body[pos:end]))
        rest = body[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        pos = len(body) - len(rest)
    return objects


def _parse_call(body: str, n: int) -> ToolCall | ParseError:
    want = 'expected {"name": "<tool>", "arguments": {...}}'
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ParseError(f"tool call {n}: invalid JSON ({e.msg} at char {e.pos}); {want}")
    if not isinstance(obj, dict):
        return ParseError(f"tool call {n}: a JSON {type(obj).__name__}; {want}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParseError(f'tool call {n}: no "name" string; {want}')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ParseError(f"tool call {n} ({name}): arguments string is not JSON ({e.msg})")
    if not isinstance(arguments, dict):
        return ParseError(f'tool call {n} ({name}): "arguments" must be a JSON object')
    return ToolCall(name, arguments)
