"""reasoning-gym tasks as prompt data, each scored by its dataset's own ``score_answer``.

Where it fits: ``--prompt-data reasoning-gym:<task>[:eval][?size=N&seed=S]`` is loaded
here by ``vime.data.prompts.load_prompts``; the flags are checked with ``parse_spec``
and ``check_spec`` while parsing, and ``vime.setup.data`` hands ``gym_task(spec)`` to the
reward scorer as a built-in task would be (``reward``, ``is_correct``). reasoning-gym
(the ``agents`` extra) generates its rows locally and is imported only when named.

Splits: the train split is ``size`` rows (default ``DEFAULT_SIZE``) of the generator
seeded ``seed`` (default ``DEFAULT_SEED``, fixed, not ``--seed``: which rows a split
holds must not move between runs; ``--seed`` only orders them). Most generators draw
row i from ``seed + i``, so the eval split (``EVAL_SIZE`` rows) is generated from
``seed + size`` on: a disjoint range of seeds. A small task universe can still repeat a
question, so eval rows whose question is a train question are dropped (and counted).

A row's label is a ``GymReference`` (task, size, seed, index, answer): what a reward
needs to rebuild its entry deterministically, small to pickle, and the answer as text
(``str()``) for ``--rm-type exact|math`` or ``--rm-url``.

The answer scored (``final_answer``): the text after the last ``</think>`` (nothing while
a ``<think>`` is still open), then the contents of its last ``<answer>...</answer>`` --
reasoning-gym's own convention -- if it has one, else that text; stripped.
"""

from __future__ import annotations

import difflib
import functools
import random
import re
from dataclasses import dataclass
from typing import Any

from vime.errors import ConfigError
from vime.rollout.math_answer import answer_text

PREFIX = "reasoning-gym:"
DEFAULT_SIZE = 1000
DEFAULT_SEED = 0
EVAL_SIZE = 100
MAX_SIZE = 1_000_000
INSTALL = "needs reasoning-gym, which is not installed; pip install -e '.[agents]'"
_KEYS = ("size", "seed")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class GymSpec:
    """A parsed ``reasoning-gym:`` spec: the task, its train split's size and seed, and
    which split ("train" or "eval") it names."""

    task: str
    size: int = DEFAULT_SIZE
    seed: int = DEFAULT_SEED
    split: str = "train"

    @property
    def eval_seed(self) -> int:
        """The eval split's generator seed: just past the train rows' seeds."""
        return self.seed + self.size

    def eval_spec(self) -> str:
        """The spec of this train split's eval split."""
        return f"{PREFIX}{self.task}:eval?size={self.size}&seed={self.seed}"


@dataclass(frozen=True)
class GymReference:
    """A row's label: the generator (task, size, seed) and index of its entry, and the
    entry's answer, which ``str()`` gives."""

    task: str
    size: int
    seed: int
    index: int
    answer: str

    def __str__(self) -> str:
        return self.answer


def is_gym_spec(spec: str | None) -> bool:
    """Whether ``spec`` names reasoning-gym data."""
    return bool(spec) and spec.startswith(PREFIX)


def parse_spec(spec: str) -> GymSpec:
    """The ``GymSpec`` of ``reasoning-gym:<task>[:eval][?size=N&seed=S]``; ConfigError
    for bad syntax. Cheap: the task name is checked by ``check_spec``."""
    body, _, query = spec[len(PREFIX) :].partition("?")
    task, _, split = body.partition(":")
    split = split or "train"
    if not task or split not in ("train", "eval"):
        raise ConfigError(f"'{spec}': write {PREFIX}<task>[:eval][?size=N&seed=S]")
    values = {"size": DEFAULT_SIZE, "seed": DEFAULT_SEED}
    for pair in filter(None, query.split("&")):
        key, eq, text = pair.partition("=")
        if key not in _KEYS or not eq:
            raise ConfigError(f"'{spec}': bad query '{pair}'; give size=N and/or seed=S")
        try:
            values[key] = int(text)
        except ValueError:
            raise ConfigError(f"'{spec}': {key} must be a whole number, got '{text}'") from None
    if not 1 <= values["size"] <= MAX_SIZE:
        raise ConfigError(f"'{spec}': size must be 1 to {MAX_SIZE}, got {values['size']}")
    if values["seed"] < 0:
        raise ConfigError(f"'{spec}': seed must be 0 or more, got {values['seed']}")
    return GymSpec(task, values["size"], values["seed"], split)


def _registry(spec: str) -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError(f"'{spec}' {INSTALL}") from None
    return DATASETS


def check_spec(spec: str) -> GymSpec:
    """``parse_spec``, and the task known to reasoning-gym (imported for it: seconds);
    ConfigError naming close task names otherwise."""
    parsed = parse_spec(spec)
    names = sorted(_registry(spec))
    if parsed.task not in names:
        close = difflib.get_close_matches(parsed.task, names, n=4, cutoff=0.5)
        hint = f"close: {', '.join(close)}" if close else f"e.g. {', '.join(names[:4])}"
        raise ConfigError(
            f"'{spec}': unknown reasoning-gym task '{parsed.task}' ({len(names)} known; {hint})"
        )
    return parsed


@functools.lru_cache(maxsize=16)
def _dataset(task: str, size: int, seed: int) -> Any:
    _registry(f"{PREFIX}{task}")  # the one-line error when reasoning-gym is missing
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed)


@functools.lru_cache(maxsize=1 << 16)
def _entry(task: str, size: int, seed: int, index: int) -> dict[str, Any]:
    # Generators draw each row from its own seed: row i is the same whenever rebuilt.
    return _dataset(task, size, seed)[index]


def _rows(task: str, size: int, seed: int) -> list[GymReference]:
    return [
        GymReference(task, size, seed, i, str(_entry(task, size, seed, i)["answer"]))
        for i in range(size)
    ]


def load_gym_prompts(spec: str, order_seed: int) -> tuple[list[tuple[str, GymReference]], int]:
    """The (question, reference) rows of ``spec``, ordered by ``order_seed`` (``--seed``),
    and how many eval rows were dropped for repeating a train question."""
    try:
        parsed = check_spec(spec)
    except ConfigError as err:
        raise ConfigError(f"prompt data {err}") from None
    task = parsed.task
    if parsed.split == "train":
        refs, dropped = _rows(task, parsed.size, parsed.seed), 0
    else:
        train = {_entry(task, parsed.size, parsed.seed, i)["question"] for i in range(parsed.size)}
        every = _rows(task, EVAL_SIZE, parsed.eval_seed)
        refs = [r for r in every if _question(r) not in train]
        dropped = len(every) - len(refs)
        if not refs:
            raise ConfigError(f"prompt data '{spec}': every eval question is a train question")
    rows = [(_question(r), r) for r in refs]
    random.Random(f"{spec}:{order_seed}").shuffle(rows)
    return rows, dropped


def _question(ref: GymReference) -> str:
    return _entry(ref.task, ref.size, ref.seed, ref.index)["question"]


def final_answer(response: str) -> str | None:
    """The answer ``response`` gives (see the module docstring); None while thinking."""
    text = answer_text(response)
    if text is None:
        return None
    tagged = _ANSWER_TAG.findall(text)
    return (tagged[-1] if tagged else text).strip()


def gym_reward(response: str, label: GymReference) -> float:
    """The dataset's own ``score_answer`` of ``response``'s final answer against the
    entry ``label`` names, rebuilt from its generator where not cached."""
    entry = _entry(label.task, label.size, label.seed, label.index)
    dataset = _dataset(label.task, label.size, label.seed)
    try:
        return float(dataset.score_answer(final_answer(response), entry))
    except Exception:
        # Some scorers parse the answer and raise on text they cannot read: the
        # model's answer is wrong, not the reward broken.
        return 0.0


@dataclass(frozen=True)
class GymTask:
    """A reasoning-gym task in the place of a built-in ``Task``: its reward and
    correctness test, which read the label's ``GymReference``."""

    name: str
    reads_trajectory: bool = False

    def reward(self, response: str, label: GymReference) -> float:
        return gym_reward(response, label)

    def is_correct(self, response: str, label: GymReference) -> bool:
        """Full marks from the dataset's scorer."""
        return gym_reward(response, label) >= 1.0


def gym_task(spec: str) -> GymTask:
    """The task a ``reasoning-gym:`` spec names; ConfigError for a bad spec."""
    return GymTask(check_spec(spec).task)
