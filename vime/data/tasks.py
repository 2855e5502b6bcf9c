"""Built-in tasks for the embedded default run: prompts, labels and rule-based rewards.

Where it fits: ``builtin:<task>`` prompt specs (``vime.data.prompts``) draw their
rows from here, the embedded tiny model's character tokenizer is built from
``CHARSET``, and the rollout side scores completions with ``Task.reward`` (dense,
for GRPO's advantages) and ``Task.is_correct`` (exact, for accuracy / pass@1).

Each task's universe of examples is split into train and eval once, with a fixed
seed, so the two never overlap whatever ``--seed`` is; the run's seed only orders
the rows. A response is everything generated before EOS; only surrounding
whitespace is ignored.

Reward design (measured: with loose shaping a random model collapses within
seconds onto a constant answer that games it):

    reward = 0.8 * matching answer positions / answer length
           + 0.1 * length closeness + 0.1 * share of characters from the answer alphabet

so an exact answer scores 1.0, anything else less, and the shaping terms (0.2 at
most) are far below what correctness pays. A task whose answers are numbers aligns
positions from the right, so a right units digit earns credit even when the tens
digit is missing.
"""

from __future__ import annotations

import functools
import itertools
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from vime.errors import ConfigError

# The embedded tokenizer's vocabulary (besides special tokens) is exactly these
# characters, in this order: changing it changes every token id of the default model.
CHARSET: str = string.ascii_lowercase + string.digits + " +="

SPLITS = ("train", "eval")
EVAL_SIZE = 100
# Fixed, not --seed: the train/eval membership must not move between runs.
_SPLIT_SEED = 20240611

_POSITION_WEIGHT = 0.8
_LENGTH_WEIGHT = 0.1
_ALPHABET_WEIGHT = 0.1

Example = tuple[str, str]  # (prompt, label)


@dataclass(frozen=True)
class Segment:
    """A piece of a demonstration (``Task.demonstration``): its text, whether the model
    writes it (trained) or the environment does (a tool's answer), and whether the
    model's turn ends after it (the tokenizer's EOS follows, trained)."""

    text: str
    trained: bool = True
    ends_turn: bool = False


@dataclass(frozen=True)
class Task:
    """A built-in task: a fixed universe of (prompt, label) pairs and its reward.

    ``build`` returns the (train, eval) pools, each a tuple of (prompt, label); it
    is called once per task and cached.
    """

    name: str
    description: str
    answer_alphabet: str
    right_align: bool
    build: Callable[[], tuple[tuple[Example, ...], tuple[Example, ...]]]
    # The reward reads the whole trajectory (tool turns included), not the final answer.
    reads_trajectory: ClassVar[bool] = False

    def make_examples(self, split: str, seed: int) -> list[dict]:
        """Rows ``{"prompt", "label"}`` of ``split`` ("train" or "eval"), ordered by ``seed``.

        The set of rows of a split never depends on ``seed``; eval has exactly
        ``EVAL_SIZE`` rows.
        """
        if split not in SPLITS:
            raise ConfigError(f"task '{self.name}' has no split '{split}'; use one of: train, eval")
        train, held_out = _pools(self)
        rows = list(train if split == "train" else held_out)
        random.Random(f"{self.name}:{split}:{seed}").shuffle(rows)
        return [{"prompt": prompt, "label": label} for prompt, label in rows]

    def is_correct(self, response: str, label: str) -> bool:
        """Exact skill check: the response, stripped of surrounding whitespace, is the label."""
        return response.strip() == label

    def demonstration(self, prompt: str, label: str) -> tuple[Segment, ...]:
        """A right response to ``prompt``, for ``--sft-warmup-steps``: the label, then EOS."""
        return (Segment(label, ends_turn=True),)

    def reward(self, response: str, label: str) -> float:
        """Dense reward in [0, 1]; 1.0 exactly when ``is_correct``."""
        answer = response.strip()
        if answer == label:
            return 1.0
        if not answer or not label:
            return 0.0
        if self.right_align:
            answer_chars, label_chars = answer[::-1], label[::-1]
        else:
            answer_chars, label_chars = answer, label
        matches = sum(a == b for a, b in zip(answer_chars, label_chars, strict=False))
        length = max(0.0, 1.0 - abs(len(answer) - len(label)) / len(label))
        in_alphabet = sum(c in self.answer_alphabet for c in answer) / len(answer)
        # Positions count against the longer of the two: characters after the answer
        # dilute the credit, so stopping (EOS) is what turns a right prefix into 1.0.
        score = (
            _POSITION_WEIGHT * matches / max(len(label), len(answer))
            + _LENGTH_WEIGHT * length
            + _ALPHABET_WEIGHT * in_alphabet
        )
        # A miss with every position right differs in length, so it stays below 1.0.
        return score


@functools.cache
def _pools(task: Task) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    train, held_out = task.build()
    if len(held_out) != EVAL_SIZE:
        raise AssertionError(f"task '{task.name}' built {len(held_out)} eval rows")
    overlap = {p for p, _ in train} & {p for p, _ in held_out}
    if overlap:
        raise AssertionError(f"task '{task.name}': train and eval share {sorted(overlap)[:3]}")
    return train, held_out


def _split_universe(
    universe: list[Example], name: str
) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    shuffled = sorted(universe)
    random.Random(f"{_SPLIT_SEED}:{name}").shuffle(shuffled)
    return tuple(shuffled[EVAL_SIZE:]), tuple(shuffled[:EVAL_SIZE])


# --- reverse: the default (alphabet of 4, length 3-4; 320 strings) -----------

_REVERSE_ALPHABET = "abcd"


def _build_reverse() -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    universe = [
        ("".join(chars) + "=", "".join(reversed(chars)))
        for length in (3, 4)
        for chars in itertools.product(_REVERSE_ALPHABET, repeat=length)
    ]
    return _split_universe(universe, "reverse")


# --- add: two or three single-digit operands (1,100 sums) ---------------------
# Two operands alone give only 100 problems, all of which the eval set would need.


def _build_add() -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    universe = [
        ("+".join(map(str, operands)) + "=", str(sum(operands)))
        for count in (2, 3)
        for operands in itertools.product(range(10), repeat=count)
    ]
    return _split_universe(universe, "add")


# --- largest_digit: digit strings of length 3-5, answers balanced over 1-9 ------
# Uniform digit strings have 9 as their largest digit a third of the time or more,
# which a constant "9" would exploit; so examples are drawn answer by answer.

_LARGEST_ANSWERS = range(1, 10)
_LARGEST_TRAIN_SIZE = 2700


def _build_largest_digit() -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    rng = random.Random(f"{_SPLIT_SEED}:largest_digit")
    by_answer: dict[str, list[str]] = {str(a): [] for a in _LARGEST_ANSWERS}
    for length in (3, 4, 5):
        for digits in itertools.product(string.digits, repeat=length):
            answer = max(digits)
            if answer in by_answer:
                by_answer[answer].append("".join(digits))
    train: list[Example] = []
    held_out: list[Example] = []
    per_train = _LARGEST_TRAIN_SIZE // len(by_answer)
    for index, (answer, strings) in enumerate(sorted(by_answer.items())):
        rng.shuffle(strings)
        # 100 eval rows over 9 answers: the first answer takes the one left over.
        n_eval = EVAL_SIZE // len(by_answer) + (index < EVAL_SIZE % len(by_answer))
        held_out += [(f"max {s}=", answer) for s in strings[:n_eval]]
        # Answers 1 and 2 have few strings (53, 295): their train rows repeat.
        rest = strings[n_eval:]
        picks = [rest[i % len(rest)] for i in range(per_train)]
        train += [(f"max {s}=", answer) for s in picks]
    return tuple(train), tuple(held_out)


# --- lookup: the answer lives only behind a tool -------------------------------
# Every key (4 letters of 'abcd', as the reverse task's strings) holds a random value
# (8 letters of 'abcd'), so a held-out key's value cannot be learned, only looked up:
# to the prompt ``get abcd=`` the model calls ``get abcd`` (the plain tool format of
# ``vime.rollout.tools.loop``), the tool's answer is appended as ``cadbbada=``, and the
# model then answers ``cadbbada``: the call and the answer each copy the token 9 back.
# The label is "<key> <value>".

_LOOKUP_ALPHABET = "abcd"
_VALUE_ALPHABET = "abcd"
_VALUE_LENGTH = 8  # 65536 values: none can be guessed
_EOS_TEXT = "<eos>"  # how the embedded tokenizer decodes its EOS (vime.models.embedded)


@functools.cache
def _lookup_table() -> dict[str, str]:
    rng = random.Random(f"{_SPLIT_SEED}:lookup:values")
    keys = ["".join(k) for k in itertools.product(_LOOKUP_ALPHABET, repeat=4)]
    return {key: "".join(rng.choices(_VALUE_ALPHABET, k=_VALUE_LENGTH)) for key in keys}


def get(key: str) -> str:
    """The value stored under a key.

    Args:
        key: four letters from a to d, e.g. abcd
    """
    return _lookup_table().get(key, f"no key {key}")


LOOKUP_TOOLS = [get]


def _build_lookup() -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    universe = [(f"get {key}=", f"{key} {value}") for key, value in _lookup_table().items()]
    return _split_universe(universe, "lookup")


def _demonstrate_lookup(prompt: str, label: str) -> tuple[Segment, ...]:
    """``get abcd=`` -> the call ``get abcd``, the tool's answer ``cadbbada=`` (as the plain
    tool format appends it), the answer ``cadbbada``."""
    key, value = label.split()
    return (
        Segment(f"get {key}", ends_turn=True),
        Segment(f"{get(key)}=", trained=False),
        Segment(value, ends_turn=True),
    )


def _positions(answer: str, target: str) -> float:
    """Share of ``target``'s positions ``answer`` matches, over the longer of the two."""
    if not answer or not target:
        return 0.0
    matches = sum(a == b for a, b in zip(answer, target, strict=False))
    return matches / max(len(answer), len(target))


@dataclass(frozen=True)
class ToolTask(Task):
    """A task solved by calling ``tools`` (``module:NAME`` for ``--tools``); its reward
    reads the whole trajectory. ``embedded_defaults`` (flag dest -> value) replace the
    embedded default run's where the user gave no value: a trajectory's token budget,
    the rollouts it takes to learn."""

    tools: str = ""
    embedded_defaults: tuple[tuple[str, Any], ...] = ()
    demonstrate: Callable[[str, str], tuple[Segment, ...]] | None = None
    reads_trajectory: ClassVar[bool] = True

    def demonstration(self, prompt: str, label: str) -> tuple[Segment, ...]:
        """A right trajectory (the call, the tool's answer, the final answer)."""
        if self.demonstrate is None:
            raise ConfigError(f"task '{self.name}' has no demonstrations")
        return self.demonstrate(prompt, label)

    def is_correct(self, response: str, label: str) -> bool:
        """The final answer is the looked-up value."""
        return response.strip() == label.split()[1]

    def reward(self, response: str, label: str) -> float:
        """``response`` is the trajectory: 1.0 for the right final answer, else

            0.4 * (first turn against the right call)
          + 0.4 * (final answer against what the tool answered)

        by matching positions, so the call and copying the tool's answer are learned
        apart; copying a wrong key's value is right only for that key. (A bonus for
        any call was tried: the policy settled on a bare ``get``.)"""
        key, value = label.split()
        turns = response.split(_EOS_TEXT)
        answer = turns[-1].rsplit("=", 1)[-1].strip()
        if answer == value:
            return 1.0
        told = turns[1].split("=", 1)[0].strip() if len(turns) > 1 else ""
        copied = _positions(answer, told) if told else 0.0
        return 0.4 * _positions(turns[0].strip(), f"get {key}") + 0.4 * copied


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            name="reverse",
            description="reverse a string of 3-4 letters from 'abcd': 'abcd=' -> 'dcba'",
            answer_alphabet=_REVERSE_ALPHABET,
            right_align=False,
            build=_build_reverse,
        ),
        Task(
            name="add",
            description="add two or three single digits: '3+5+9=' -> '17'",
            answer_alphabet=string.digits,
            right_align=True,
            build=_build_add,
        ),
        Task(
            name="largest_digit",
            description="largest digit of 3-5 digits: 'max 3941=' -> '9'",
            answer_alphabet=string.digits,
            right_align=False,
            build=_build_largest_digit,
        ),
        ToolTask(
            name="lookup",
            description="look a key's value up with the get tool: 'get abcd=' -> "
            "'get abcd', then 'cadbbada'",
            answer_alphabet=_VALUE_ALPHABET,
            right_align=False,
            build=_build_lookup,
            tools="vime.data.tasks:LOOKUP_TOOLS",
            demonstrate=_demonstrate_lookup,
            embedded_defaults=(
                # The call (9 tokens), the tool's answer (9) and the final answer (9).
                ("rollout_max_response_len", 32),
                ("num_rollout", 500),
                # Sequence-level credit alone did not find the copy within 500 rollouts
                # on most seeds (bench/README.md); 30 supervised steps, short of the
                # copy's own onset (~45), leave greedy accuracy at 0 for RL to raise.
                ("sft_warmup_steps", 30),
            ),
        ),
    )
}

DEFAULT_TASK = "reverse"


def get_task(name: str) -> Task:
    """The built-in task called ``name``; ConfigError naming the known tasks otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        known = ", ".join(sorted(TASKS))
        raise ConfigError(f"unknown built-in task '{name}'; known tasks: {known}") from None
