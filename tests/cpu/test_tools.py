"""Tools for multi-turn rollouts: loading, parsing, running, and their token ids.

Proves that ``module:NAME`` (file or module) loads a list of sync and async
functions with transformers' JSON schemas, and that each bad tool list is a
one-line ConfigError saying what to fix; that ``Toolbox.run`` turns every
failure (unknown tool, bad arguments, raised, timed out, malformed call) into
an error result of the right kind, never an exception, and runs calls
concurrently (sync ones up to the thread pool's size); that the Qwen/Hermes
parser tells "no call", "calls" and "malformed" apart, the llama3_json one reads
every call of a turn (``;`` or one a line), and each ``--tool-parser``
(looked up by name) reads its own form and takes the others' for answers; and, with
a Qwen3-style
template on a byte-level BPE tokenizer built here, that the schemas reach the
system prompt, the ids appended after a turn are the tail of tokenizing the
whole conversation, template drift (Qwen3's think-block handling) is caught,
long outputs are truncated by tokens, and parse → run → render round-trips.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from chat_fixtures import TOOLS_PY, chat_tokenizer

from vime.backends.registry import resolve
from vime.errors import ConfigError
from vime.rollout.settings import ToolSettings
from vime.rollout.tools.parsers import PARSERS, get_tool_parser, tool_parser_choices
from vime.rollout.tools.toolbox import (
    ParseError,
    Toolbox,
    ToolCall,
    ToolResult,
    load_tools,
    parse_llama3_json,
    parse_tool_calls,
)
from vime.rollout.tools.turns import (
    TRUNCATED,
    TemplateDriftError,
    ToolTurnRenderer,
    truncate_output,
)


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(TOOLS_PY)
    return path


@pytest.fixture
def box(tools_file: Path):
    toolbox = load_tools(f"{tools_file}:TOOLS")
    yield toolbox
    toolbox.close()


# ---------------------------------------------------------------- loading


def test_load_from_a_file_or_a_module(tools_file: Path, monkeypatch) -> None:
    from transformers.utils import get_json_schema

    toolbox = load_tools(f"{tools_file}:TOOLS")
    assert toolbox.names == ["add", "lookup", "nap", "anap", "fail", "loop"]
    add = toolbox.schemas[0]["function"]
    assert add["name"] == "add" and add["description"] == "Add two integers."
    assert add["parameters"]["required"] == ["a", "b"]
    assert add["parameters"]["properties"]["b"] == {
        "type": "integer",
        "description": "The second addend.",
    }
    assert toolbox.schemas[1]["function"]["parameters"]["properties"]["key"]["enum"] == ["pi", "e"]
    monkeypatch.syspath_prepend(str(tools_file.parent))
    by_module = load_tools("my_tools:TOOLS")
    assert by_module.schemas == [get_json_schema(f) for f in __import__("my_tools").TOOLS]
    toolbox.close()
    by_module.close()


def _no_doc(a: int) -> int:
    return a


def _typed_in_doc(a: int, b: int) -> int:
    """Add.

    Args:
        a: First.
        b (int): Second.
    """
    return a + b


def _no_hint(a, b: int) -> int:  # type: ignore[no-untyped-def]
    """Add.

    Args:
        a: First.
        b: Second.
    """
    return b


def _star(*values: int) -> int:
    """Sum.

    Args:
        values: Numbers.
    """
    return sum(values)


def _one_tuple(pair: tuple[int]) -> int:
    """First.

    Args:
        pair: A tuple of one.
    """
    return pair[0]


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([], "tools: the tool list is empty; give at least one function"),
        (
            [_no_doc, 3],
            "tools: tool '_no_doc': no docstring; add one (a description, "
            "then 'Args:' with 'name: text' lines)",
        ),
        (
            [_typed_in_doc],
            "tools: tool '_typed_in_doc': the docstring's Args: section does not "
            "describe 'b'; add 'b: <text>' (transformers reads no type in parentheses: "
            "not 'b (type): ...')",
        ),
        (
            [_no_hint],
            "tools: tool '_no_hint': argument 'a' has no type hint; annotate it (e.g. a: str)",
        ),
        (
            [_star],
            "tools: tool '_star': parameter 'values' is variadic positional; tool "
            "arguments arrive by name, so use plain named parameters",
        ),
        (
            [_one_tuple],
            "tools: tool '_one_tuple': no JSON schema from its type hints "
            "(TypeHintParsingException: The type hint tuple[int] is a Tuple with a single",
        ),
        ([len], "tools: item 1 is a builtin_function_or_method; tools must be functions"),
        (["add"], "tools: item 1 is a str, not callable"),
        ([_typed_in_doc.__call__], "tools: item 1 is a method-wrapper; tools must be functions"),
    ],
)
def test_bad_tool_lists_are_one_line_config_errors(tools: list, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Toolbox(tools)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_bad_specs_are_one_line_config_errors(tools_file: Path) -> None:
    def twice(a: int) -> int:
        """Twice.

        Args:
            a: A number.
        """
        return 2 * a

    cases = {
        "no_colon": "--tools 'no_colon': expected 'module.path:NAME' or",
        f"{tools_file}:NOT_A_LIST": "NOT_A_LIST is a function; expected a list of functions",
        f"{tools_file}:EMPTY": "the tool list is empty",
        f"{tools_file}:MISSING": "has no attribute 'MISSING'",
        "no_such_module_xyz:TOOLS": "module 'no_such_module_xyz' not found",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError) as caught:
            load_tools(spec)
        assert message in str(caught.value) and "\n" not in str(caught.value), spec
    with pytest.raises(ConfigError, match="two tools are named 'twice'; tool names must be"):
        Toolbox([twice, twice])
    with pytest.raises(ConfigError, match="--tool-timeout must be > 0 seconds, got 0"):
        ToolSettings(timeout_s=0)
    with pytest.raises(ConfigError, match="--tool-max-output-tokens must be >= 1, got 0"):
        ToolSettings(max_output_tokens=0)
    assert ToolSettings().max_output_tokens == 256


# ---------------------------------------------------------------- running


def test_run_results_and_every_error_kind(box: Toolbox) -> None:
    async def main() -> list[ToolResult]:
        calls = [
            ToolCall("add", {"a": 2, "b": 3}),
            ToolCall("lookup", {"key": "pi"}),
            ToolCall("nap", {"seconds": 0}),
            ToolCall("foo", {}),
            ToolCall("add", {"a": 1}),
            ToolCall("add", {"a": 1, "b": 2, "c": 3}),
            ToolCall("fail", {"message": "disk\nfull"}),
            ToolCall("lookup", {"key": "tau"}),
            ToolCall("anap", {"seconds": 5}),
            ToolCall("nap", {"seconds": 5}),
            ToolCall("loop", {"n": 1}),
        ]
        return list(await asyncio.gather(*(box.run(c, timeout_s=0.5) for c in calls)))

    start = time.perf_counter()
    got = asyncio.run(main())
    assert time.perf_counter() - start < 3.0  # both sleepers abandoned at 0.5 s
    assert [(r.name, r.text, r.kind) for r in got[:3]] == [
        ("add", "5", None),
        ("lookup", "3.14159", None),
        ("nap", '{"slept": 0}', None),
    ]
    assert got[0].ok and not got[3].ok
    assert [r.kind for r in got[3:]] == [
        "unknown_tool",
        "bad_arguments",
        "bad_arguments",
        "raised",
        "raised",
        "timeout",
        "timeout",
        "raised",
    ]
    assert got[3].text == "error: unknown tool 'foo'; tools: add, lookup, nap, anap, fail, loop"
    assert got[4].text == (
        "error: bad arguments for add: missing a required argument: 'b'; it takes (a, b)"
    )
    assert got[5].text == (
        "error: bad arguments for add: got an unexpected keyword argument 'c'; it takes (a, b)"
    )
    assert got[6].text == "error: fail raised RuntimeError: disk full"
    assert got[7].text == "error: lookup raised KeyError: 'tau'"
    assert got[8].text == "error: anap timed out after 0.5 s"
    assert got[10].text == "error: loop raised ValueError: Circular reference detected"
    assert 0.45 < got[8].seconds < 2.0 and 0.45 < got[9].seconds < 2.0
    assert all("\n" not in r.text for r in got)


def test_calls_run_concurrently_up_to_the_thread_pool(tools_file: Path) -> None:
    async def timed(toolbox: Toolbox, name: str, n: int, seconds: float) -> float:
        start = time.perf_counter()
        calls = [ToolCall(name, {"seconds": seconds}) for _ in range(n)]
        results = await asyncio.gather(*(toolbox.run(c, timeout_s=30) for c in calls))
        assert all(r.ok for r in results), results
        return time.perf_counter() - start

    wide = load_tools(f"{tools_file}:TOOLS")
    narrow = load_tools(f"{tools_file}:TOOLS", max_threads=2)
    try:
        # 4 x 0.4 s one after the other would be 1.6 s.
        assert asyncio.run(timed(wide, "nap", 4, 0.4)) < 1.2
        # Two threads: two rounds of 0.4 s, no fewer.
        assert asyncio.run(timed(narrow, "nap", 4, 0.4)) >= 0.75
        # Async tools need no thread: 20 overlap even on the 2-thread toolbox.
        assert asyncio.run(timed(narrow, "anap", 20, 0.4)) < 1.5
    finally:
        wide.close()
        narrow.close()


# ---------------------------------------------------------------- parsing


def test_parse_no_call_calls_and_argument_strings() -> None:
    assert parse_tool_calls("The answer is 5.") == []
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"pi\\"}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("lookup", {"key": "pi"}),
        ToolCall("now", {}),
    ]
    # A call mentioned while thinking is not a call.
    thinking = '<think>\nmaybe <tool_call>{"name": "add"}</tool_call>\n</think>\n\nIt is 5.'
    assert parse_tool_calls(thinking) == []


def test_parse_llama3_json_calls() -> None:
    """Llama 3.x calls a tool with a turn that is one JSON object (``parameters``),
    optionally after ``<|python_tag|>``; JSON that names no call is an answer."""
    call = ToolCall("add", {"a": 2, "b": 3})
    assert parse_tool_calls('{"name": "add", "parameters": {"a": 2, "b": 3}}') == [call]
    assert parse_tool_calls('<|python_tag|>{"name": "add", "arguments": {"a": 2, "b": 3}}') == [
        call
    ]
    assert parse_tool_calls('{"name": "Ada", "age": 36}') == []
    assert parse_tool_calls("{not json}") == []
    bad = parse_tool_calls('{"name": "add", "parameters": 3}')
    assert isinstance(bad, ParseError) and "must be a JSON object" in bad.message


def test_parse_llama3_json_reads_every_call_of_a_turn() -> None:
    """Several Llama 3.x JSON calls in one turn, separated by ``;`` or one a line, are
    each a call, in order; one malformed call is a ParseError naming it; a turn with
    other text between the objects, or an object naming no call, is an answer."""
    add = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    pi = '{"name": "lookup", "parameters": {"key": "pi"}}'
    calls = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("lookup", {"key": "pi"})]
    for text in (f"{add}; {pi}", f"{add};{pi}", f"<|python_tag|>{add}\n{pi}", f"{add} ;\n{pi}"):
        assert parse_llama3_json(text) == calls, text
    bad = parse_llama3_json(f'{add}; {{"name": "lookup", "parameters": 3}}')
    assert isinstance(bad, ParseError) and bad.message.startswith("tool call 2 (lookup)")
    assert parse_llama3_json(f"{add} then {pi}") == []
    assert parse_llama3_json(f"{add};; {pi}") == []
    assert parse_llama3_json(f'{add}; {{"name": "Ada", "age": 36}}') == []


# One call in each parser's form, and malformed ones; what each parser makes of them.
ADD = ToolCall("add", {"a": 2, "b": 3})
FORMS = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "llama3": '{"name": "add", "parameters": {"a": 2, "b": 3}}',
    "python_tag": '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}',
    "plain": "add 2 3",
    "bad_hermes": '<tool_call>{"name": "add", </tool_call>',
    "bad_llama3": '{"name": "add", "parameters": 3}',
}
READS = {
    "hermes": {"hermes": [ADD], "bad_hermes": ParseError},
    "llama3_json": {"llama3": [ADD], "python_tag": [ADD], "bad_llama3": ParseError},
    "plain": {"plain": [ToolCall("add", {"a": "2", "b": "3"})]},
}


@pytest.mark.parametrize("name", list(PARSERS))
def test_each_parser_reads_its_own_form_and_answers_the_others(name: str, box: Toolbox) -> None:
    """Looked up by name, each parser turns its own form into the call (a malformed one
    into a ParseError) and every other parser's form into [] (an answer, not a call):
    a hermes turn is no llama3_json call, nor a bare JSON turn a hermes call."""
    parse = resolve(get_tool_parser(name).parse)
    for form, text in FORMS.items():
        want = READS[name].get(form, [])
        got = parse(text, box)
        if want is ParseError:
            assert isinstance(got, ParseError), (form, got)
        else:
            assert got == want, form
    assert set(tool_parser_choices()) == {"auto", *READS}
    choices = "choose from: auto, hermes, llama3_json, plain"
    with pytest.raises(
        ConfigError, match=f"^--tool-parser 'qwen': no such tool parser; {choices}$"
    ):
        get_tool_parser("qwen")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('<tool_call>{"name": "add", </tool_call>', "tool call 1: invalid JSON (Expecting"),
        ("<tool_call>[1, 2]</tool_call>", "tool call 1: a JSON list; expected {"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'tool call 1: no "name" string'),
        (
            '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "add", "arguments": 3}'
            "</tool_call>",
            'tool call 2 (add): "arguments" must be a JSON object',
        ),
        (
            '<tool_call>{"name": "add", "arguments": "{a"}</tool_call>',
            "tool call 1 (add): arguments string is not JSON (Expecting",
        ),
        ('<tool_call>{"name": "add", "arguments": {}}', "tool call 1: <tool_call> is never closed"),
        (
            '<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>',
            "tool call 1: <tool_call> is",
        ),
        ('{"name": "add"}</tool_call>', "</tool_call> without <tool_call> (call 1)"),
    ],
)
def test_malformed_calls_are_parse_errors(text: str, message: str) -> None:
    got = parse_tool_calls(text)
    assert isinstance(got, ParseError)
    assert got.message.startswith(message), got.message
    result = got.as_result()
    assert result.kind == "parse" and result.text == f"error: {got.message}"


# ---------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture
def renderer(tokenizer, box: Toolbox) -> ToolTurnRenderer:
    return ToolTurnRenderer(tokenizer, box.schemas)


QUESTION = [
    {"role": "system", "content": "Be exact."},
    {"role": "user", "content": "What is 2 + 3, and what is pi?"},
]
THOUGHT = "<think>\nI need two tools.\n</think>\n\n"
CALLS = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "lookup", "arguments": "{\\"key\\": \\"pi\\"}"}\n</tool_call>'
)


def test_prompt_shows_the_tool_schemas(renderer: ToolTurnRenderer, box: Toolbox) -> None:
    text = renderer.render(QUESTION, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe exact.\n\n# Tools\n")
    for schema in box.schemas:  # transformers' tojson is json.dumps, non-ASCII kept
        assert "\n" + json.dumps(schema, ensure_ascii=False) + "\n" in text
    assert text.endswith(
        "<|im_start|>user\nWhat is 2 + 3, and what is pi?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = renderer.prompt_ids(QUESTION)
    assert ids == renderer.tokenizer.encode(text, add_special_tokens=False)
    assert renderer.tokenizer.decode(ids) == text
    assert renderer.end_of_turn_id == renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")


def _tool_turn(renderer: ToolTurnRenderer, box: Toolbox, generated: str, **kw: Any):
    """Parse ``generated``, run its calls, render their turn: (messages, appended ids)."""
    calls = parse_tool_calls(generated)
    assert isinstance(calls, list) and len(calls) == 2

    async def run_all() -> list[ToolResult]:
        return list(await asyncio.gather(*(box.run(c, timeout_s=5) for c in calls)))

    results = asyncio.run(run_all())
    tool_messages = renderer.tool_messages(results, max_output_tokens=64)
    convo = [*QUESTION, {"role": "assistant", "content": generated}]
    return [*convo, *tool_messages], renderer.tool_turn_ids(convo, tool_messages, **kw)


def test_parse_run_render_round_trip(renderer: ToolTurnRenderer, box: Toolbox) -> None:
    tok = renderer.tokenizer
    generated = THOUGHT + CALLS
    # What a scripted engine hands back: the turn's tokens, ending with the stop token.
    generated_ids = tok.encode(generated + "<|im_end|>", add_special_tokens=False)
    assert generated_ids[-1] == renderer.end_of_turn_id
    messages, appended = _tool_turn(renderer, box, generated)
    assert tok.decode(appended) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\n3.14159\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # Token in, token out: prompt + generated + appended is the whole conversation.
    stream = renderer.prompt_ids(QUESTION) + generated_ids + appended
    whole = renderer.render(messages, add_generation_prompt=True)
    assert stream == tok.encode(whole, add_special_tokens=False)


def test_qwen3_empty_think_block_drift(renderer: ToolTurnRenderer, box: Toolbox) -> None:
    # No reasoning: the template gives the last assistant turn an empty think
    # block, and takes it away once tool messages follow it.
    with pytest.raises(TemplateDriftError, match=r"re-renders the conversation.*<think>"):
        _tool_turn(renderer, box, CALLS)
    messages, appended = _tool_turn(renderer, box, CALLS, strict=False)
    whole = renderer.tokenizer.encode(
        renderer.render(messages, add_generation_prompt=True), add_special_tokens=False
    )
    assert whole[-len(appended) :] == appended
    assert renderer.tokenizer.decode(appended).startswith(
        "\n<|im_start|>user\n<tool_response>\n5\n"
    )


def test_earlier_reasoning_stripped_by_a_new_user_turn(renderer: ToolTurnRenderer) -> None:
    convo = [*QUESTION, {"role": "assistant", "content": THOUGHT + "It is 5."}]
    follow_up = [{"role": "user", "content": "And pi?"}]
    with pytest.raises(TemplateDriftError, match="first difference at char"):
        renderer.tool_turn_ids(convo, follow_up)
    appended = renderer.tool_turn_ids(convo, follow_up, strict=False)
    assert renderer.tokenizer.decode(appended) == (
        "\n<|im_start|>user\nAnd pi?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_long_outputs_are_truncated_by_tokens(renderer: ToolTurnRenderer) -> None:
    tok = renderer.tokenizer
    text = "The answer is 5. " * 40
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 20
    short = truncate_output(text, tok, 20)
    assert short == tok.decode(ids[:20]) + TRUNCATED and text.startswith(short[: -len(TRUNCATED)])
    assert truncate_output("The answer is 5.", tok, 20) == "The answer is 5."
    [message] = renderer.tool_messages([ToolResult("nap", text)], max_output_tokens=20)
    assert message == {"role": "tool", "name": "nap", "content": short}
