"""Built-in tasks: labels are right, rewards are dense but not gameable, splits hold.

Proves, for every task in ``TASKS``: the label of each eval prompt is the true
answer, an exact answer scores 1.0 and is correct while any miss scores below 1
and is not, rewards stay in [0, 1], train and eval are disjoint, eval has 100
rows, a seed fixes the order but never the membership, every character lies in
``CHARSET``, and no constant answer earns anywhere near full reward on eval.
"""

from __future__ import annotations

import pytest

from vime.data.tasks import CHARSET, DEFAULT_TASK, TASKS, get, get_task
from vime.errors import ConfigError

NAMES = sorted(TASKS)
# Tasks whose reward reads the response alone (a tool task's reads the trajectory).
ANSWER_TASKS = [name for name in NAMES if not TASKS[name].reads_trajectory]


def _solve(name: str, prompt: str) -> str:
    """Independent reference solution of each task, from the prompt text alone."""
    body = prompt.removesuffix("=")
    if name == "reverse":
        return body[::-1]
    if name == "add":
        return str(sum(int(x) for x in body.split("+")))
    if name == "largest_digit":
        return max(body.removeprefix("max "))
    raise AssertionError(f"no reference solution for {name}")


def test_known_tasks_and_default() -> None:
    assert {"reverse", "add", "largest_digit", "lookup"} <= set(TASKS)
    assert DEFAULT_TASK == "reverse"
    assert get_task("add") is TASKS["add"]


def test_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown built-in task 'nope'.*add.*reverse"):
        get_task("nope")


def test_unknown_split_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no split 'test'"):
        TASKS["reverse"].make_examples("test", seed=0)


@pytest.mark.parametrize("name", ANSWER_TASKS)
def test_labels_are_the_true_answers_and_score_one(name: str) -> None:
    task = TASKS[name]
    for split in ("train", "eval"):
        for row in task.make_examples(split, seed=0):
            assert set(row) == {"prompt", "label"}
            assert row["prompt"].endswith("=")
            assert row["label"] == _solve(name, row["prompt"])
            assert task.reward(row["label"], row["label"]) == 1.0
            assert task.is_correct(row["label"], row["label"])
            # Surrounding whitespace is not a mistake; inner whitespace is.
            assert task.is_correct(f" {row['label']}\n", row["label"])
            assert task.reward(f" {row['label']}\n", row["label"]) == 1.0


@pytest.mark.parametrize("name", ANSWER_TASKS)
def test_misses_score_below_one_and_within_bounds(name: str) -> None:
    task = TASKS[name]
    for row in task.make_examples("eval", seed=0):
        label = row["label"]
        misses = [
            "",
            label + label[-1],  # right prefix, one character too many
            label[:-1],
            label[::-1] + "x" if len(set(label)) > 1 else label + "x",
            "?" * len(label),
            "zzzzzzzzzzzzzzzzzzzz",
            label[0] + " " + label[1:],
        ]
        for response in misses:
            if response.strip() == label:
                continue
            score = task.reward(response, label)
            assert 0.0 <= score < 1.0, (response, label, score)
            assert not task.is_correct(response, label)


def test_reward_is_dense_on_reverse() -> None:
    """Each extra correct position (and the right length) raises the reward."""
    task = TASKS["reverse"]
    scores = [task.reward(r, "dcba") for r in ("", "x", "a", "d", "da", "dc", "dcb", "dcbb")]
    assert scores[0] == 0.0
    assert scores[1] < scores[2] < scores[3]  # alphabet, then a right position
    assert scores[3] < scores[5] < scores[6] < scores[7] < 1.0
    assert scores[4] < scores[5]


def test_numbers_align_from_the_right() -> None:
    """A right units digit earns credit in 'add' even when the tens digit is missing."""
    task = TASKS["add"]
    assert task.reward("7", "17") > task.reward("1", "17")
    assert task.reward("27", "17") > task.reward("21", "17")


@pytest.mark.parametrize("name", NAMES)
def test_splits_disjoint_sized_and_seeded(name: str) -> None:
    task = TASKS[name]
    train, held_out = task.make_examples("train", seed=7), task.make_examples("eval", seed=7)
    assert len(held_out) == 100
    assert len({r["prompt"] for r in held_out}) == 100
    assert len(train) >= 150  # lookup: 156 keys (its values cannot be memorised for eval)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert task.make_examples("train", seed=7) == train
    other = task.make_examples("train", seed=8)
    assert other != train  # the seed orders the rows ...
    assert sorted(map(str, other)) == sorted(map(str, train))  # ... but never picks them
    assert sorted(map(str, task.make_examples("eval", seed=8))) == sorted(map(str, held_out))


@pytest.mark.parametrize("name", NAMES)
def test_every_character_is_in_charset(name: str) -> None:
    task = TASKS[name]
    used = {
        c
        for split in ("train", "eval")
        for row in task.make_examples(split, seed=0)
        for c in row["prompt"] + row["label"]
    }
    assert used <= set(CHARSET), sorted(used - set(CHARSET))
    assert set(task.answer_alphabet) <= set(CHARSET)


def test_charset_is_small_and_unique() -> None:
    assert len(set(CHARSET)) == len(CHARSET) <= 48
    assert not any(c.isupper() for c in CHARSET)
    assert {" ", "="} <= set(CHARSET)


@pytest.mark.parametrize("name", ANSWER_TASKS)
def test_no_constant_answer_games_the_reward(name: str) -> None:
    """The best single answer for every eval prompt, from a wide pool, stays far from 1."""
    task = TASKS[name]
    rows = task.make_examples("eval", seed=0)
    candidates = {r["label"] for r in rows} | set(task.answer_alphabet) | {""}
    candidates |= {c * k for c in task.answer_alphabet for k in (2, 3, 4, 5)}
    best = max(
        sum(task.reward(answer, r["label"]) for r in rows) / len(rows) for answer in candidates
    )
    assert best < 0.5, best
    # A constant answer is exactly right on few prompts: shaping alone does not pay.
    best_accuracy = max(
        sum(task.is_correct(answer, r["label"]) for r in rows) / len(rows) for answer in candidates
    )
    assert best_accuracy <= 0.15, best_accuracy


def test_lookup_needs_its_tool_and_shapes_the_call() -> None:
    """Each label is the key and what ``get`` returns for it; only the right final
    answer after the call scores 1; credit grows with the call's right positions;
    answering without a call earns nothing, and no constant answer is right often."""
    task = TASKS["lookup"]
    assert task.tools == "vime.data.tasks:LOOKUP_TOOLS"
    assert task.reads_trajectory and not TASKS["reverse"].reads_trajectory
    rows = task.make_examples("eval", seed=0)
    for row in rows:
        key, value = row["label"].split()
        assert row["prompt"] == f"get {key}=" and get(key) == value
        assert task.is_correct(f" {value}\n", row["label"])
        assert task.reward(f"get {key}<eos>{value}={value}", row["label"]) == 1.0
    key, value = rows[0]["label"].split()
    label = rows[0]["label"]
    other = "".join("x" if c == "w" else "w" for c in value)  # wrong in every position
    calls = ["x", "g", "ge", "get", f"get {key[0]}", f"get {key}"]
    scores = [task.reward(f"{c}<eos>{value}={other}", label) for c in calls]
    assert scores == sorted(scores) and len(set(scores)) == len(scores) and scores[-1] < 1.0
    # Copying what the tool answered earns credit, right key or not; no call, nothing.
    wrong = "".join("a" if c != "a" else "b" for c in key)
    copied = task.reward(f"get {wrong}<eos>{get(wrong)}={get(wrong)}", label)
    assert copied > task.reward(f"get {wrong}<eos>{get(wrong)}=", label)
    assert task.reward(other, label) == 0.0
    assert get("zzzz") == "no key zzzz"
    values = [r["label"].split()[1] for r in rows]
    assert max(values.count(v) for v in values) <= 0.15 * len(rows)  # no constant pays
