"""The built-in tool loop (``--tools``) against a scripted engine, in both formats.

Proves, with the real tools, parser, chat template renderer and embedded
tokenizer (the engine's turns are scripted so every path is reached on purpose):
a call's answer is appended as environment tokens (mask 0, log-prob 0) exactly
as the format renders it, and the next turn sees it; every failure (malformed
call, unknown tool, bad arguments, a tool that raises or times out) becomes text
the model reads and is counted by kind, never a crash; a turn stopped on the
``</tool_call>`` stop id is read as its call; ``--max-turns`` and the
response budget cut a trajectory and say so; long answers are truncated to
``--tool-max-output-tokens``; ``build_agent`` refuses a chat model without
``--apply-chat-template`` and ``--tools`` together with a custom function; and
``--tool-parser``: ``auto`` picks the format and reads every turn as the loop did
before the flag, a named parser reaches the loop's turns, and each combination that
cannot work is one line.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from chat_fixtures import TOOLS_PY, chat_tokenizer

from vime.config import parse_args
from vime.config.rollout_settings import agent_settings
from vime.data.prompts import Prompt
from vime.data.tasks import CHARSET, LOOKUP_TOOLS, _lookup_table
from vime.errors import ConfigError
from vime.models.embedded import EOS_ID, build_tokenizer
from vime.rollout.agent import CALLS_PER_SAMPLE, AgentRollouts
from vime.rollout.settings import ToolSettings
from vime.rollout.tools import toolbox as tools
from vime.rollout.tools.loop import (
    ChatFormat,
    PlainFormat,
    ToolLoop,
    ToolLoopSettings,
    build_agent,
    check_tool_format,
    tool_format,
)
from vime.rollout.tools.toolbox import ParseError, Toolbox, ToolCall, load_tools
from vime.rollout.types import Completion, SamplingParams


class ScriptedEngine:
    """Answers turn t of sample i with ``script[i][t]`` (text, encoded, then the end of
    turn unless the text ends on one of ``stops``), cut to the call's budget; records
    each turn's context."""

    def __init__(self, tokenizer, script: list[list[str]], eot: int, stops=()) -> None:
        self.tokenizer, self.script, self.eot = tokenizer, script, eot
        self.stops = {eot, *stops}
        self.contexts: dict[tuple[int, int], list[int]] = {}

    def generate(self, prompts, params):
        out = []
        for prompt, stream in zip(prompts, params.prompt_indices, strict=True):
            sample, turn = divmod(stream, CALLS_PER_SAMPLE)
            self.contexts[sample, turn] = list(prompt)
            ids = self.tokenizer.encode(self.script[sample][turn], add_special_tokens=False)
            if not ids or ids[-1] not in self.stops:
                ids = [*ids, self.eot]
            ids = ids[: params.max_new_tokens]
            finish = "stop" if ids and ids[-1] in self.stops else "length"
            logps = [-1.0 - k for k in range(len(ids))]
            out.append([Completion(list(prompt), ids, logps, finish)])
        return out


def _run(loop, engine, prompts, budget=64, n=1):
    rows = [Prompt(index=i, text=t, label=None) for i, t in enumerate(prompts)]
    tok = loop.tokenizer
    if getattr(tok, "chat_template", None):
        ids = [
            tok.apply_chat_template(
                [{"role": "user", "content": t}],
                tools=loop.toolbox.schemas,
                add_generation_prompt=True,
                tokenize=False,
            )
            for t in prompts
        ]
        ids = [tok.encode(t, add_special_tokens=False) for t in ids]
    else:
        ids = [tok.encode(t, add_special_tokens=False) for t in prompts]
    groups = AgentRollouts(loop, engine, budget).generate(rows, ids, SamplingParams(n=n))
    return [c for g in groups for c in g], ids


# ----- the plain format: the embedded tokenizer and the lookup task's tool -------------------


@pytest.fixture(scope="module")
def chars():
    return build_tokenizer(CHARSET)


@pytest.fixture
def lookup():
    box = Toolbox(LOOKUP_TOOLS)
    yield box
    box.close()


def test_plain_call_answer_and_final_turn(chars, lookup) -> None:
    """``get abc`` runs the tool; its answer then ``=`` is appended untrained; the
    next turn sees it; the final answer is the last turn."""
    value = _lookup_table()["abcd"]
    loop = ToolLoop(lookup, chars, ToolLoopSettings(), stop_token_ids=[EOS_ID])
    engine = ScriptedEngine(chars, [["get abcd", value]], EOS_ID)
    (c,), (prompt,) = _run(loop, engine, ["get abcd="])
    enc = lambda t: chars.encode(t, add_special_tokens=False)  # noqa: E731
    call, env, answer = [*enc("get abcd"), EOS_ID], enc(value + "="), [*enc(value), EOS_ID]
    assert c.response_ids == call + env + answer
    assert c.loss_mask == [1] * len(call) + [0] * len(env) + [1] * len(answer)
    assert all(lp == 0.0 for lp, m in zip(c.log_probs, c.loss_mask, strict=True) if not m)
    assert engine.contexts[0, 1] == prompt + call + env
    stats = c.extra["agent"]
    assert (stats["turns"], stats["tool_calls"], stats["cut"]) == (2, 1, None)
    assert stats["answer_start"] == len(call) + len(env) and stats["tool_errors"] == {}
    assert c.finish_reason == "stop"


def test_plain_no_call_is_a_final_answer_and_bad_arity_an_error(chars, lookup) -> None:
    """A turn whose first word is no tool's name answers at once; ``get`` with two
    words is a bad-arguments error the model reads, counted."""
    loop = ToolLoop(lookup, chars, ToolLoopSettings(), stop_token_ids=[EOS_ID])
    engine = ScriptedEngine(chars, [["123"], ["get ab cd", "9"]], EOS_ID)
    (direct, wrong), _ = _run(loop, engine, ["get abcd=", "get abdd="], budget=400)
    assert direct.loss_mask == [1] * 4 and direct.extra["agent"]["tool_calls"] == 0
    assert wrong.extra["agent"]["tool_errors"] == {"bad_arguments": 1}
    env = [t for t, m in zip(wrong.response_ids, wrong.loss_mask, strict=True) if not m]
    # The characters the embedded tokenizer lacks (':', quotes) read as <unk>.
    assert chars.decode(env, skip_special_tokens=True).startswith("error bad arguments for get")


def test_max_turns_and_budget_cut_trajectories(chars, lookup) -> None:
    """A model still calling at ``--max-turns`` is cut there; one whose next context
    would leave no room, or whose turn hits the budget, is cut by the budget."""
    loop = ToolLoop(lookup, chars, ToolLoopSettings(max_turns=2), stop_token_ids=[EOS_ID])
    calls = ["get abcd"] * 5
    engine = ScriptedEngine(chars, [calls, calls, ["1234567890" * 5]], EOS_ID)
    (turns, _, budget), _ = _run(loop, engine, ["get abcd="] * 3, budget=40)
    assert turns.extra["agent"]["cut"] == "max_turns" and turns.extra["agent"]["turns"] == 2
    assert turns.finish_reason == "length" and turns.extra["agent"]["tool_calls"] == 1
    assert budget.extra["agent"]["cut"] == "budget" and len(budget.response_ids) == 40
    engine = ScriptedEngine(chars, [calls], EOS_ID)
    (room,), _ = _run(loop, engine, ["get abcd="], budget=12)  # call 9 + answer 9 > 12
    assert room.extra["agent"]["cut"] == "budget" and room.loss_mask == [1] * 9


# ----- the chat format: a Qwen3-style template, JSON calls ---------------------------------


@pytest.fixture(scope="module")
def chat():
    return chat_tokenizer()


@pytest.fixture
def tools_spec(tmp_path: Path) -> str:
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_PY)
    return f"{path}:TOOLS"


@pytest.fixture
def box(tools_spec: str):
    toolbox = load_tools(tools_spec)
    yield toolbox
    toolbox.close()


def _call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_chat_every_error_kind_is_read_by_the_model_and_counted(chat, box) -> None:
    """Malformed JSON, an unknown tool, bad arguments, a raising tool and a timeout:
    each becomes a tool turn the next generation sees; the run goes on."""
    eot = chat.convert_tokens_to_ids("<|im_end|>")
    settings = ToolLoopSettings(max_turns=8, tools=ToolSettings(timeout_s=0.3))
    loop = ToolLoop(box, chat, settings, stop_token_ids=[eot])
    script = [
        "<tool_call>\n{not json}\n</tool_call>",
        _call("nope", "{}"),
        _call("add", '{"a": 1}'),
        _call("fail", '{"message": "kaput"}'),
        _call("nap", '{"seconds": 5}'),
        _call("add", '{"a": 2, "b": 3}'),
        "The answer is 5.",
    ]
    engine = ScriptedEngine(chat, [script], eot)
    (c,), _ = _run(loop, engine, ["What is 2 + 3?"], budget=4000)
    stats = c.extra["agent"]
    assert stats["tool_errors"] == {
        "parse": 1,
        "unknown_tool": 1,
        "bad_arguments": 1,
        "raised": 1,
        "timeout": 1,
    }
    assert stats["turns"] == 7 and stats["tool_calls"] == 6 and stats["cut"] is None
    assert 0.3 <= stats["tool_seconds"] < 3
    last_context = chat.decode(engine.contexts[0, 6])
    for seen in ("invalid JSON", "unknown tool 'nope'", "bad arguments for add", "kaput"):
        assert seen in last_context
    assert "nap timed out after 0.3 s" in last_context
    assert "<tool_response>\n5\n</tool_response>" in last_context
    assert chat.decode(c.response_ids[stats["answer_start"] :]).startswith("The answer is 5.")


def test_chat_tool_turns_are_the_template_tail_and_outputs_truncate(chat, box) -> None:
    """The appended ids are the template's rendering of the tool turn (token in, token
    out: the model's ids are kept as generated); a long answer is cut to its tokens."""
    eot = chat.convert_tokens_to_ids("<|im_end|>")
    settings = ToolLoopSettings(tools=ToolSettings(max_output_tokens=3))
    loop = ToolLoop(box, chat, settings, stop_token_ids=[eot])
    engine = ScriptedEngine(chat, [[_call("lookup", '{"key": "pi"}'), "Pi."]], eot)
    (c,), _ = _run(loop, engine, ["What is pi?"], budget=4000)
    model = [*chat.encode(_call("lookup", '{"key": "pi"}'), add_special_tokens=False), eot]
    assert c.response_ids[: len(model)] == model
    env = [t for t, m in zip(c.response_ids, c.loss_mask, strict=True) if not m]
    text = chat.decode(env)
    assert text.startswith("\n<|im_start|>user\n<tool_response>\n")
    assert "…[truncated]" in text and "3.14159" not in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_turn_ended_by_another_stop_token_is_closed_before_the_tool_turn(chat, box) -> None:
    """A call turn that stopped on a token other than the template's end of turn (here
    ``<|endoftext|>``) gets that end of turn as an environment token (mask 0): the next
    turn's context is the template's rendering of the conversation, token for token."""
    eot = chat.convert_tokens_to_ids("<|im_end|>")
    other = chat.convert_tokens_to_ids("<|endoftext|>")
    loop = ToolLoop(box, chat, ToolLoopSettings(), stop_token_ids=[eot, other])
    call = _call("add", '{"a": 2, "b": 3}')
    engine = ScriptedEngine(chat, [[call + "<|endoftext|>", "5."]], eot, stops=[other])
    (c,), _ = _run(loop, engine, ["What is 2 + 3?"], budget=4000)
    model = chat.encode(call + "<|endoftext|>", add_special_tokens=False)
    assert model[-1] == other and c.response_ids[: len(model)] == model
    assert c.response_ids[len(model)] == eot and c.loss_mask[len(model)] == 0
    # The model's tokens, then the template's rendering from its end of turn on.
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "add", "content": "5"},
    ]
    rendered = chat.apply_chat_template(
        messages, tools=box.schemas, add_generation_prompt=True, tokenize=False
    )
    assert chat.decode(engine.contexts[0, 1]) == rendered.replace(call, call + "<|endoftext|>")
    assert c.extra["agent"]["tool_calls"] == 1 and c.extra["agent"]["tool_errors"] == {}
    assert c.extra["agent"]["turns"] == 2 and c.finish_reason == "stop"


def test_a_turn_stopped_on_its_closing_tag_is_read_as_the_call(chat, box) -> None:
    """A call turn that stopped on the ``</tool_call>`` stop id (the engine keeps it last)
    is parsed as that call, not as an unclosed tag; the model's ids stay the engine's and
    the end of turn follows as an environment token."""
    eot = chat.convert_tokens_to_ids("<|im_end|>")
    close = chat.convert_tokens_to_ids("</tool_call>")
    loop = ToolLoop(box, chat, ToolLoopSettings(), stop_token_ids=[eot, close])
    call = _call("add", '{"a": 2, "b": 3}')
    engine = ScriptedEngine(chat, [[call, "5."]], eot, stops=[close])
    (c,), _ = _run(loop, engine, ["What is 2 + 3?"], budget=4000)
    model = chat.encode(call, add_special_tokens=False)
    assert model[-1] == close and c.response_ids[: len(model)] == model
    assert c.response_ids[len(model)] == eot and c.loss_mask[len(model)] == 0
    assert c.extra["agent"]["tool_calls"] == 1 and c.extra["agent"]["tool_errors"] == {}
    assert "<tool_response>\n5\n</tool_response>" in chat.decode(engine.contexts[0, 1])


# ----- build_agent --------------------------------------------------------------------------


def test_build_agent_refusals_and_choices(chat, chars, tmp_path: Path) -> None:
    """A chat model's tools need its template; no agent without --tools or a function;
    --tools with a custom function is refused while parsing (each refusal its whole
    line); --max-turns, --tool-timeout and --tool-max-output-tokens reach the loop."""
    path = tmp_path / "gen.py"
    path.write_text("async def gen(sample, engine):\n    pass\n")
    both = (
        "--tools and --custom-generate-function-path each generate the trajectories; "
        "give one (a custom function or an agent can run tools itself)"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(both)}$"):
        parse_args(
            [
                "--tools",
                "vime.data.tasks:LOOKUP_TOOLS",
                "--custom-generate-function-path",
                f"{path}:gen",
            ]
        )
    box = Toolbox(LOOKUP_TOOLS)
    args = parse_args(["--tools", "vime.data.tasks:LOOKUP_TOOLS"])
    template = (
        "--tools vime.data.tasks:LOOKUP_TOOLS: the model reads the tools through its chat "
        "template; add --apply-chat-template"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(template)}$"):
        build_agent(agent_settings(args), chat, None, box)
    assert isinstance(build_agent(agent_settings(args), chars, None, box).fn, ToolLoop)
    limits = ["--max-turns", "3", "--tool-timeout", "2.5", "--tool-max-output-tokens", "5"]
    tuned = parse_args(["--tools", "vime.data.tasks:LOOKUP_TOOLS", *limits])
    assert build_agent(agent_settings(tuned), chars, None, box).fn.settings == ToolLoopSettings(
        3, ToolSettings(2.5, 5)
    )
    assert (
        build_agent(agent_settings(tuned), chars, None, box).budget
        == tuned.rollout_max_response_len
    )
    assert build_agent(agent_settings(parse_args([])), chars, None, None) is None
    custom = build_agent(
        agent_settings(parse_args(["--custom-generate-function-path", f"{path}:gen"])),
        chars,
        None,
        None,
    )
    assert custom.fn.__name__ == "gen"
    box.close()
    with pytest.raises(ConfigError, match=r"^--max-turns must be >= 1, got 0$"):
        ToolLoopSettings(max_turns=0)
    with pytest.raises(ConfigError, match=r"^--tool-timeout must be > 0 seconds, got 0.0$"):
        parse_args(["--tools", "vime.data.tasks:LOOKUP_TOOLS", "--tool-timeout", "0"])


def test_prompts_show_the_tools_through_the_template(chat, box) -> None:
    """With --tools and a chat template, prompt ids are rendered with the tools' schemas
    (what the model must see to call them); without tools, the same template shows none."""
    from vime.data.prompts import render_prompt

    with_tools = chat.decode(render_prompt("What is pi?", chat, True, box.schemas))
    plain = chat.decode(render_prompt("What is pi?", chat, True))
    assert '"name": "lookup"' in with_tools and "<tools>" in with_tools
    assert "<tools>" not in plain and plain.endswith("<|im_start|>assistant\n")


# ----- --tool-parser -------------------------------------------------------------------------


def _chat_reading_before(text: str) -> list[ToolCall] | ParseError:
    """The chat format's reading before --tool-parser (``parse_tool_calls`` at 307bea3),
    kept as it was: the reference ``auto`` must equal, turn for turn."""
    if tools.THINK_CLOSE in text:
        text = text.rsplit(tools.THINK_CLOSE, 1)[1]
    calls: list[ToolCall] = []
    pos = 0
    while True:
        open_at = text.find(tools.TOOL_CALL_OPEN, pos)
        stray = text.find(tools.TOOL_CALL_CLOSE, pos)
        if stray != -1 and (open_at == -1 or stray < open_at):
            return ParseError(f"</tool_call> without <tool_call> (call {len(calls) + 1})")
        if open_at == -1:
            return calls or tools._bare_json_call(text)
        body_at = open_at + len(tools.TOOL_CALL_OPEN)
        close_at = text.find(tools.TOOL_CALL_CLOSE, body_at)
        reopen = text.find(tools.TOOL_CALL_OPEN, body_at)
        if close_at == -1 or (reopen != -1 and reopen < close_at):
            return ParseError(f"tool call {len(calls) + 1}: <tool_call> is never closed")
        call = tools._parse_call(text[body_at:close_at], len(calls) + 1)
        if isinstance(call, ParseError):
            return call
        calls.append(call)
        pos = close_at + len(tools.TOOL_CALL_CLOSE)


def _plain_reading_before(text: str, box: Toolbox) -> list[ToolCall]:
    """The plain format's reading before --tool-parser, as it was."""
    words = text.split()
    if not words or words[0] not in box.names:
        return []
    return [box.positional_call(words[0], words[1:])]


FRAGMENTS = (
    "<tool_call>",
    "</tool_call>",
    '{"name": "add", "arguments": {"a": 2}}',
    '{"name": "add", "parameters": 3}',
    '{"x": 1}',
    "<think>",
    "</think>",
    "<|python_tag|>",
    "add 2 3",
    " \n",
)


def test_auto_picks_and_reads_every_turn_as_before(chat, chars, box, tools_spec) -> None:
    """``auto`` (the default) is the old choice on both fixtures: the chat format for the
    Qwen3-style template, the plain one for the embedded tokenizer; and each reads all
    1110 turns built from up to 3 fragments (tags, JSON, thinking) exactly as before."""
    turns = ["".join(p) for k in (1, 2, 3) for p in itertools.product(FRAGMENTS, repeat=k)]
    for tok in (chat, chars):
        fmt = tool_format(tok, box, 8)
        template = bool(getattr(tok, "chat_template", None))  # the old tool_format's test
        if template:
            assert isinstance(fmt, ChatFormat)
            before = _chat_reading_before
        else:
            assert isinstance(fmt, PlainFormat)
            before = lambda t: _plain_reading_before(t, box)  # noqa: E731
        for text in turns:
            assert fmt.parse(text) == before(text), text
        # The run's loop (the flag's default, through build_agent) makes the same choice.
        args = _args(tools_spec, *(["--apply-chat-template"] if template else []))
        assert args.tool_parser == "auto"
        assert type(build_agent(agent_settings(args), tok, None, box).fn.format) is type(fmt)


def _args(spec: str, *extra: str):
    return parse_args(["--tools", spec, *extra])


LLAMA3_CALL = '{"name": "add", "parameters": {"a": 2, "b": 3}}'


@pytest.mark.parametrize(
    ("parser", "own", "other"),
    [
        ("hermes", _call("add", '{"a": 2, "b": 3}'), LLAMA3_CALL),
        ("llama3_json", LLAMA3_CALL, _call("add", '{"a": 2, "b": 3}')),
    ],
)
def test_the_tool_parser_flag_reaches_the_loop(
    parser: str, own: str, other: str, chat, box, tools_spec: str, tmp_path: Path
) -> None:
    """``--tool-parser hermes`` / ``llama3_json``, parsed, decide the loop's turns: its own
    form runs the tool, the other's is the final answer (ignored, auto would run both)."""
    ckpt = ["--hf-checkpoint", str(tmp_path), "--apply-chat-template"]
    args = _args(tools_spec, *ckpt, "--tool-parser", parser)
    loop = build_agent(agent_settings(args), chat, None, box).fn
    assert loop.settings.parser == parser and isinstance(loop.format, ChatFormat)
    eot = chat.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(chat, [[own, "5."], [other, "5."]], eot)
    (called, answered), _ = _run(loop, engine, ["What is 2 + 3?"] * 2, budget=4000)
    assert (called.extra["agent"]["turns"], called.extra["agent"]["tool_calls"]) == (2, 1)
    assert "<tool_response>\n5\n</tool_response>" in chat.decode(engine.contexts[0, 1])
    assert (answered.extra["agent"]["turns"], answered.extra["agent"]["tool_calls"]) == (1, 0)


def test_plain_parser_reads_a_chat_model_as_raw_text(chat, box, tools_spec, tmp_path) -> None:
    """``--tool-parser plain`` on a tokenizer with a template, without
    ``--apply-chat-template`` (which auto refuses): ``lookup pi`` runs the tool and its
    answer follows as text then ``=``, no template turn."""
    ckpt = ["--hf-checkpoint", str(tmp_path)]
    with pytest.raises(ConfigError, match=r"its chat template; add --apply-chat-template$"):
        build_agent(agent_settings(_args(tools_spec, *ckpt)), chat, None, box)
    loop = build_agent(
        agent_settings(_args(tools_spec, *ckpt, "--tool-parser", "plain")), chat, None, box
    ).fn
    assert isinstance(loop.format, PlainFormat)
    eot = chat.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(chat, [["lookup pi", "3.14159"]], eot)
    (c,), _ = _run(loop, engine, ["pi ="], budget=400)
    assert c.extra["agent"]["tool_calls"] == 1 and c.extra["agent"]["tool_errors"] == {}
    env = [t for t, m in zip(c.response_ids, c.loss_mask, strict=True) if not m]
    assert chat.decode(env) == "3.14159="


ONLY_TOOLS = "--tool-parser {p} applies only to --tools and --agent-function-path; "


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tool-parser", "hermes"], ONLY_TOOLS + "add --tools MODULE:NAME, or drop it"),
        (["--tool-parser", "auto"], ONLY_TOOLS + "add --tools MODULE:NAME, or drop it"),
        (
            ["--custom-generate-function-path", "{gen}", "--tool-parser", "plain"],
            ONLY_TOOLS + "a --custom-generate-function-path function reads its own turns",
        ),
        (
            ["--prompt-data", "builtin:lookup", "--tool-parser", "hermes"],
            "--tool-parser {p} reads turns a chat template frames, and the embedded model "
            "(no --hf-checkpoint) has none; use --tool-parser plain or auto",
        ),
        (
            ["--tools", "{spec}", "--hf-checkpoint", "{ckpt}", "--tool-parser", "llama3_json"],
            "--tool-parser {p} reads turns a chat template frames and renders the tools' "
            "answers with it; add --apply-chat-template",
        ),
        (
            ["--prompt-data", "builtin:lookup", "--tool-parser", "plain", "--apply-chat-template"],
            "--tool-parser {p} appends the tools' answers as raw text, not as the chat "
            "template's tool turns; drop --apply-chat-template, or use --tool-parser hermes "
            "or llama3_json",
        ),
        (
            ["--tools", "{spec}", "--tool-parser", "qwen"],
            "argument --tool-parser: invalid choice: 'qwen' (choose from 'auto', 'hermes', "
            "'llama3_json', 'plain')",
        ),
    ],
)
def test_tool_parser_refusals_are_one_line(
    argv: list[str], message: str, tools_spec: str, tmp_path: Path
) -> None:
    """Each --tool-parser combination that cannot work (without --tools, beside a custom
    function, a chat parser with no template or without --apply-chat-template, plain with
    it, an unknown name) is refused while parsing, with its whole one-line message."""
    gen = tmp_path / "gen.py"
    gen.write_text("async def gen(sample, engine):\n    pass\n")
    values = {"gen": f"{gen}:gen", "spec": tools_spec, "ckpt": str(tmp_path)}
    argv = [a.format(**values) for a in argv]
    line = message.format(p=argv[argv.index("--tool-parser") + 1])
    with pytest.raises(ConfigError, match=f"^{re.escape(line)}$"):
        parse_args(argv)


def test_a_chat_parser_without_a_template_is_refused_at_run_start(chars, tools_spec, tmp_path):
    """An --hf-checkpoint's template is known only once its tokenizer loads: the run's
    check (``check_tool_format``, before prompts and Ray) refuses hermes in one line."""
    ckpt = ["--hf-checkpoint", str(tmp_path), "--apply-chat-template"]
    args = _args(tools_spec, *ckpt, "--tool-parser", "hermes")
    line = (
        "--tool-parser hermes: the checkpoint's tokenizer has no chat template, and hermes "
        "reads turns the template frames (its tool turns are the template's); use "
        "--tool-parser plain, without --apply-chat-template"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(line)}$"):
        check_tool_format(agent_settings(args), chars)
