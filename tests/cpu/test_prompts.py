"""Prompt datasets: loading, error messages, rendering and a resumable training order.

Proves that jsonl and parquet rows load with their label and metadata (both
optional), that each kind of bad data fails with one message naming the file,
the line and the fix (a missing or null label too, when the reward needs one),
that ``builtin:`` specs give a task's train or eval split, that
``render_prompt`` yields the text's own tokens (chat template: wrapped in it),
that a list of chat messages (jsonl or a parquet list-of-struct column) loads
only with ``--apply-chat-template``, is refused with the fix without it and
with what is wrong when malformed, renders one user message exactly like the
plain string and is measured after templating for ``--rollout-max-prompt-len``,
that dropping every prompt for ``--rollout-max-prompt-len`` is an error that
says so, that ``PromptSource`` is deterministic, reshuffles every epoch,
covers each epoch exactly once, that a source restored from ``state_dict``
continues exactly like the uninterrupted one, and that a restore under other
data, seed, --num-epoch or shuffling is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vime.data.prompts import (
    Prompt,
    PromptSource,
    builtin_task_of,
    filter_prompt_lengths,
    load_prompts,
    render_prompt,
)
from vime.data.tasks import CHARSET, TASKS
from vime.errors import ConfigError


def _write_jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_rows_with_optional_label_and_metadata(tmp_path: Path) -> None:
    spec = _write_jsonl(
        tmp_path / "p.jsonl",
        [
            json.dumps({"q": "1+1=", "a": "2", "meta": {"src": "x"}}),
            "",  # blank lines are skipped, not counted as prompts
            json.dumps({"q": "2+2="}),
        ],
    )
    prompts = load_prompts(spec, input_key="q", label_key="a", metadata_key="meta")
    assert prompts == [
        Prompt(text="1+1=", label="2", metadata={"src": "x"}, index=0),
        Prompt(text="2+2=", label=None, metadata={}, index=1),
    ]


def test_parquet_rows(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    table = pa.table({"prompt": ["ab=", "cd="], "label": ["ba", "dc"], "other": [1, 2]})
    pq.write_table(table, path)
    prompts = load_prompts(str(path))
    assert [(p.text, p.label, p.metadata, p.index) for p in prompts] == [
        ("ab=", "ba", {}, 0),
        ("cd=", "dc", {}, 1),
    ]
    with pytest.raises(ConfigError, match=r"p\.parquet: row 1: no key 'question'; keys present"):
        load_prompts(str(path), input_key="question")


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        (['{"prompt": "a"}', "{oops"], r"p\.jsonl:2: not valid JSON: "),
        (['["a", "b"]'], r"p\.jsonl:1: expected an object with a 'prompt' key, got a list"),
        (
            ['{"prompt": "a"}', '{"text": "b", "label": 1}'],
            r"p\.jsonl:2: no key 'prompt'; keys present: text, label \(choose one with --input-key",
        ),
        (['{"prompt": 5}'], r"p\.jsonl:1: 'prompt' must be a string, got a number"),
        (['{"prompt": "a", "metadata": [1]}'], r"p\.jsonl:1: 'metadata' must be an object"),
        (["", "  "], r"p\.jsonl' holds no prompts"),
    ],
)
def test_bad_jsonl_rows_name_file_and_line(tmp_path: Path, lines: list[str], pattern: str) -> None:
    spec = _write_jsonl(tmp_path / "p.jsonl", lines)
    with pytest.raises(ConfigError, match=pattern):
        load_prompts(spec)


def test_a_label_is_required_only_when_asked(tmp_path: Path) -> None:
    spec = _write_jsonl(
        tmp_path / "p.jsonl",
        [json.dumps({"q": "1+1=", "answer": "2"}), json.dumps({"q": "2+2=", "label": "4"})],
    )
    # A custom reward may score without a label: the row loads with None.
    assert load_prompts(spec, input_key="q")[0].label is None
    with pytest.raises(ConfigError) as caught:
        load_prompts(spec, input_key="q", require_label=True)
    assert str(caught.value) == (
        f"{spec}:1: no key 'label' and the reward compares with a label; keys present: "
        "q, answer (choose one with --label-key)"
    )
    labels = load_prompts(spec, input_key="q", label_key="answer", require_label=False)
    assert [p.label for p in labels] == ["2", None]
    with pytest.raises(ConfigError, match=r"p\.jsonl:2: no key 'answer' .* keys present: q, label"):
        load_prompts(spec, input_key="q", label_key="answer", require_label=True)
    null = _write_jsonl(
        tmp_path / "n.jsonl", ['{"prompt": "a", "label": "b"}', '{"prompt": "c", "label": null}']
    )
    with pytest.raises(ConfigError) as caught:
        load_prompts(null, require_label=True)
    assert str(caught.value) == (
        f"{null}:2: 'label' is null and the reward compares with a label; give every row one"
    )
    assert len(load_prompts("builtin:add", require_label=True)) > 0


def test_parquet_row_without_label(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["ab="], "other": [1]}), path)
    with pytest.raises(ConfigError) as caught:
        load_prompts(str(path), require_label=True)
    assert str(caught.value) == (
        f"{path}: row 1: no key 'label' and the reward compares with a label; keys present: "
        "prompt, other (choose one with --label-key)"
    )


def test_missing_file_and_unknown_type(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"prompt data file not found: .*nothere\.jsonl"):
        load_prompts(str(tmp_path / "nothere.jsonl"))
    csv = tmp_path / "p.csv"
    csv.write_text("prompt\na\n")
    with pytest.raises(ConfigError, match=r"unsupported file type; use \.jsonl, \.parquet"):
        load_prompts(str(csv))


def test_builtin_specs() -> None:
    train = load_prompts("builtin:reverse", seed=3)
    held_out = load_prompts("builtin:reverse:eval", seed=3)
    assert [p.text for p in train] == [
        r["prompt"] for r in TASKS["reverse"].make_examples("train", 3)
    ]
    assert len(held_out) == 100
    assert not {p.text for p in train} & {p.text for p in held_out}
    assert all(p.metadata == {"task": "reverse"} for p in train)
    assert [p.index for p in held_out] == list(range(100))
    assert load_prompts("builtin:add:train", seed=3)[0].label is not None
    assert builtin_task_of("builtin:add:eval") == "add"
    assert builtin_task_of("builtin:reverse") == "reverse"
    assert builtin_task_of("data/x.jsonl") is None
    with pytest.raises(ConfigError, match="known tasks: add, largest_digit, lookup, reverse"):
        load_prompts("builtin:nope")
    with pytest.raises(ConfigError, match="no split 'test'"):
        load_prompts("builtin:add:test")


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(text=f"p{i}", label=None, metadata={}, index=i) for i in range(n)]


def _drain(source: PromptSource, n: int) -> list[list[int]]:
    batches = []
    while not source.exhausted:
        batches.append([p.index for p in source.next_batch(n)])
    return batches


def test_source_is_deterministic_and_reshuffles_each_epoch() -> None:
    source = PromptSource(_prompts(10), num_epoch=3, seed=5)
    flat = [i for batch in _drain(source, 10) for i in batch]
    epochs = [flat[0:10], flat[10:20], flat[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # each prompt once per epoch
    assert len({tuple(e) for e in epochs}) == 3  # a new order every epoch
    again = PromptSource(_prompts(10), num_epoch=3, seed=5)
    assert [i for b in _drain(again, 10) for i in b] == flat
    other = PromptSource(_prompts(10), num_epoch=3, seed=6)
    assert [i for b in _drain(other, 10) for i in b] != flat
    unshuffled = PromptSource(_prompts(4), num_epoch=1, shuffle=False)
    assert [p.index for p in unshuffled.next_batch(4)] == [0, 1, 2, 3]


def test_order_does_not_depend_on_batch_size() -> None:
    flat_3 = [i for b in _drain(PromptSource(_prompts(10), num_epoch=2, seed=1), 3) for i in b]
    flat_7 = [i for b in _drain(PromptSource(_prompts(10), num_epoch=2, seed=1), 7) for i in b]
    assert flat_3 == flat_7 and len(flat_3) == 20


def test_batches_span_epochs_and_the_end_is_short() -> None:
    source = PromptSource(_prompts(5), num_epoch=2, seed=0)
    assert source.batches_per_epoch(2) == 2
    assert source.total_batches(2) == 5
    assert source.total_batches(3) == 3
    sizes = [len(b) for b in _drain(source, 3)]
    assert sizes == [3, 3, 3, 1]  # the second batch straddles the epoch boundary
    assert source.exhausted
    with pytest.raises(StopIteration):
        source.next_batch(1)


def test_resume_from_state_dict_continues_identically() -> None:
    reference = _drain(PromptSource(_prompts(7), num_epoch=3, seed=9), 3)
    interrupted = PromptSource(_prompts(7), num_epoch=3, seed=9)
    first = [[p.index for p in interrupted.next_batch(3)] for _ in range(3)]  # mid epoch 2
    state = json.loads(json.dumps(interrupted.state_dict()))  # survives a JSON checkpoint
    assert state["epoch"] == 1 and state["position"] == 2
    resumed = PromptSource(_prompts(7), num_epoch=3, seed=9)
    resumed.load_state_dict(state)
    assert first + _drain(resumed, 3) == reference


def test_resume_with_other_data_or_seed_is_refused() -> None:
    state = PromptSource(_prompts(7), seed=9).state_dict()
    with pytest.raises(ConfigError, match="taken with 7 prompts but the data has 8"):
        PromptSource(_prompts(8), seed=9).load_state_dict(state)
    with pytest.raises(ConfigError, match="--seed 9, this run has 1"):
        PromptSource(_prompts(7), seed=1).load_state_dict(state)


def test_resume_with_other_epochs_or_shuffling_is_refused() -> None:
    """A checkpoint's --num-epoch and shuffling are checked on resume, so a run with
    other settings stops instead of continuing with another length or order."""
    state = json.loads(json.dumps(PromptSource(_prompts(7), num_epoch=2, seed=9).state_dict()))
    with pytest.raises(ConfigError, match="--num-epoch 2, this run has 3; resume with the same"):
        PromptSource(_prompts(7), num_epoch=3, seed=9).load_state_dict(state)
    with pytest.raises(ConfigError, match="prompt shuffling True, this run has False"):
        PromptSource(_prompts(7), num_epoch=2, seed=9, shuffle=False).load_state_dict(state)
    PromptSource(_prompts(7), num_epoch=2, seed=9).load_state_dict(state)  # same settings: fine


def test_filter_prompt_lengths() -> None:
    prompts = _prompts(4)
    ids = [[1], [1, 2, 3], [1, 2], [1, 2, 3, 4]]
    kept, kept_ids, dropped = filter_prompt_lengths(prompts, ids, 2)
    assert [p.index for p in kept] == [0, 2] and kept_ids == [[1], [1, 2]] and dropped == 2
    assert filter_prompt_lengths(prompts, ids, None) == (prompts, ids, 0)


def test_every_prompt_too_long_names_the_flag() -> None:
    prompts = _prompts(3)
    ids = [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3]]
    kept, _, dropped = filter_prompt_lengths(prompts, ids, 3)
    assert len(kept) == 2 and dropped == 1  # one left is enough
    with pytest.raises(ConfigError) as caught:
        filter_prompt_lengths(prompts, ids, 2, spec="data/p.jsonl")
    assert str(caught.value) == (
        "prompt data 'data/p.jsonl': all 3 prompts are longer than --rollout-max-prompt-len 2 "
        "tokens (the shortest has 3); raise it or use shorter prompts"
    )
    with pytest.raises(ConfigError) as caught:
        filter_prompt_lengths(prompts, ids, 1)
    assert str(caught.value) == (
        "all 3 prompts are longer than --rollout-max-prompt-len 1 tokens (the shortest has 3); "
        "raise it or use shorter prompts"
    )


@pytest.fixture(scope="module")
def char_tokenizer():
    """A character tokenizer over CHARSET with two chat-role special tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<user>": 1, "<bot>": 2}
    vocab |= {c: i + 3 for i, c in enumerate(CHARSET)}
    vocab["<sys>"] = len(vocab)  # last, so the character ids stay 3 + CHARSET.index
    core = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<eos>",
        additional_special_tokens=["<user>", "<bot>", "<sys>"],
    )
    tokenizer.chat_template = (
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}<sys>{% elif m['role'] == 'assistant' %}<bot>"
        "{% else %}<user>{% endif %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<bot>{% endif %}"
    )
    return tokenizer


def test_render_prompt_plain_and_chat(char_tokenizer) -> None:
    text_ids = [3 + CHARSET.index(c) for c in "ab c="]
    assert render_prompt("ab c=", char_tokenizer, apply_chat_template=False) == text_ids
    assert render_prompt("ab c=", char_tokenizer, apply_chat_template=True) == [1, *text_ids, 2]
    template, char_tokenizer.chat_template = char_tokenizer.chat_template, None
    try:
        with pytest.raises(ConfigError, match="no chat template; drop the flag"):
            render_prompt("ab", char_tokenizer, apply_chat_template=True)
    finally:
        char_tokenizer.chat_template = template


SYS = [{"role": "system", "content": "be brief"}]
USER = [{"role": "user", "content": "ab c="}]


def _ids(text: str) -> list[int]:
    return [3 + CHARSET.index(c) for c in text]


def test_message_list_loads_with_the_chat_template_flag(tmp_path: Path) -> None:
    spec = _write_jsonl(
        tmp_path / "p.jsonl",
        [json.dumps({"prompt": SYS + USER, "label": "5"}), json.dumps({"prompt": "ab="})],
    )
    prompts = load_prompts(spec, apply_chat_template=True)
    assert prompts == [
        Prompt(text=SYS + USER, label="5", metadata={}, index=0),
        Prompt(text="ab=", label=None, metadata={}, index=1),
    ]


def test_message_list_without_the_flag_names_the_fix(tmp_path: Path) -> None:
    spec = _write_jsonl(
        tmp_path / "p.jsonl", [json.dumps({"q": "ab="}), json.dumps({"q": SYS + USER})]
    )
    with pytest.raises(ConfigError) as caught:
        load_prompts(spec, input_key="q")
    message = str(caught.value)
    assert message.startswith(f"{spec}:2: 'q' is a list of chat messages")
    assert "add --apply-chat-template" in message and "\n" not in message


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        ([], r"p\.jsonl:1: 'prompt' is an empty list of messages"),
        (["hi"], r"p\.jsonl:1: 'prompt' message 1 must be an object .*, got a string"),
        ([{"role": "user", "content": "a"}, 3], r"p\.jsonl:1: 'prompt' message 2 .*got a number"),
        ([{"content": "a"}], r"p\.jsonl:1: 'prompt' message 1 has no 'role'"),
        ([{"role": "user"}], r"p\.jsonl:1: 'prompt' message 1 has no 'content'"),
        (
            [{"role": 1, "content": "a"}],
            r"p\.jsonl:1: 'prompt' message 1: 'role' must be a string, got a number",
        ),
        (
            [{"role": "user", "content": None}],
            r"p\.jsonl:1: 'prompt' message 1: 'content' must be a string, got null",
        ),
    ],
)
@pytest.mark.parametrize("flag", [True, False])
def test_malformed_message_lists_say_what_is_wrong(
    tmp_path: Path, value: list, pattern: str, flag: bool
) -> None:
    # Checked before the flag: adding --apply-chat-template would not fix these.
    spec = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": value})])
    with pytest.raises(ConfigError, match=pattern):
        load_prompts(spec, apply_chat_template=flag)


@pytest.mark.parametrize("value", [5, {"role": "user", "content": "a"}, True, None])
def test_other_input_types_keep_the_string_error(tmp_path: Path, value: object) -> None:
    spec = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": value})])
    with pytest.raises(ConfigError, match=r"p\.jsonl:1: 'prompt' must be a string, got "):
        load_prompts(spec, apply_chat_template=True)


def test_render_message_list(char_tokenizer) -> None:
    one_user = render_prompt(USER, char_tokenizer, apply_chat_template=True)
    assert one_user == render_prompt("ab c=", char_tokenizer, apply_chat_template=True)
    assert one_user == [1, *_ids("ab c="), 2]
    sys_id = char_tokenizer.convert_tokens_to_ids("<sys>")
    with_system = render_prompt(SYS + USER, char_tokenizer, apply_chat_template=True)
    assert with_system == [sys_id, *_ids("be brief"), 1, *_ids("ab c="), 2]
    with pytest.raises(ConfigError, match="add --apply-chat-template"):
        render_prompt(USER, char_tokenizer, apply_chat_template=False)


def test_message_lists_are_measured_after_templating(tmp_path: Path, char_tokenizer) -> None:
    spec = _write_jsonl(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": SYS + USER}),
            json.dumps({"prompt": USER}),
            json.dumps({"prompt": "ab"}),
        ],
    )
    prompts = load_prompts(spec, apply_chat_template=True)
    ids = [render_prompt(p.text, char_tokenizer, True) for p in prompts]
    assert [len(i) for i in ids] == [16, 7, 4]  # template tokens count
    kept, kept_ids, dropped = filter_prompt_lengths(prompts, ids, 7, spec=spec)
    assert [p.index for p in kept] == [1, 2] and kept_ids == ids[1:] and dropped == 1


def test_parquet_list_of_struct_column(tmp_path: Path, char_tokenizer) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    table = pa.table({"prompt": [SYS + USER, USER], "label": ["5", "6"]})
    assert pa.types.is_list(table.schema.field("prompt").type)  # list<struct<content, role>>
    pq.write_table(table, path)
    prompts = load_prompts(str(path), apply_chat_template=True)
    assert [(p.text, p.label, p.index) for p in prompts] == [(SYS + USER, "5", 0), (USER, "6", 1)]
    assert render_prompt(prompts[1].text, char_tokenizer, True) == [1, *_ids("ab c="), 2]
    with pytest.raises(ConfigError) as caught:
        load_prompts(str(path))
    assert str(caught.value).startswith(f"{path}: row 1: 'prompt' is a list of chat messages")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": None}]]}), bad)
    with pytest.raises(ConfigError, match=r"bad\.parquet: row 1: 'prompt' message 1: 'content'"):
        load_prompts(str(bad), apply_chat_template=True)
