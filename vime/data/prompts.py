"""Prompt datasets: loading rows, turning them into token ids, and the training order.

Where it fits: the rollout side loads ``--prompt-data`` / ``--eval-prompt-data``
with ``load_prompts`` (a ``.jsonl`` or ``.parquet`` file, ``builtin:<task>``
from ``vime.data.tasks``, or ``reasoning-gym:<task>`` from ``vime.data.reasoning_gym``),
renders each prompt with ``render_prompt``, drops the over-long ones with
``filter_prompt_lengths`` (``--rollout-max-prompt-len``, counted after templating),
and draws each rollout's prompts from a ``PromptSource``. The
source's position is part of a checkpoint, so a resumed run sees exactly the
prompts the uninterrupted run would have seen.

A row's input is a string, or -- with ``--apply-chat-template`` only -- a list of
chat messages (``{"role": str, "content": str}`` objects, as in slime's and verl's
converted datasets; a parquet list-of-struct column reads as one), which is the
conversation handed to the tokenizer's chat template.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime.data.reasoning_gym import PREFIX as GYM_PREFIX
from vime.data.reasoning_gym import load_gym_prompts
from vime.data.tasks import SPLITS, Task, get_task
from vime.data.verifiers_env import PREFIX as VERIFIERS_PREFIX
from vime.data.verifiers_env import load_env_prompts
from vime.errors import ConfigError

BUILTIN_PREFIX = "builtin:"
SUPPORTED = ".jsonl, .parquet, builtin:<task>[:eval] or reasoning-gym:<task>[:eval][?size=N&seed=S]"


@dataclass(frozen=True)
class Prompt:
    """One prompt row: its text, its label for the reward (None if absent), free metadata.

    ``text`` is the input as the data gives it: a string, or a list of chat messages
    (``{"role", "content"}`` dicts, loaded only with ``--apply-chat-template``).
    ``index`` is the row's position in its dataset (0-based), stable across epochs.
    """

    text: str | list[dict]
    label: Any
    metadata: dict = field(default_factory=dict)
    index: int = 0


def builtin_task_of(spec: str) -> str | None:
    """The task name of a ``builtin:<task>[:split]`` spec, None for a file path."""
    if not spec.startswith(BUILTIN_PREFIX):
        return None
    return spec[len(BUILTIN_PREFIX) :].split(":", 1)[0]


def load_prompts(
    spec: str,
    *,
    input_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str = "metadata",
    seed: int = 1234,
    require_label: bool = False,
    apply_chat_template: bool = False,
    say: Callable[[str], None] = print,
) -> list[Prompt]:
    """Load every prompt of ``spec``; ConfigError with file and line for bad data.

    ``spec`` is a ``.jsonl`` file (one JSON object per line, blank lines skipped),
    a ``.parquet`` file (one row per prompt), ``builtin:<task>`` (the task's train
    split), ``builtin:<task>:eval``, or a reasoning-gym split (``vime.data.reasoning_gym``). The
    metadata field is optional; so is the label, unless ``require_label`` (the reward
    compares with it, see ``vime.rollout.rewards.reward_needs_label``): then a row
    without one, or with a null one, is an error. ``seed`` only orders a built-in or
    reasoning-gym task's rows. An input that is a list of chat messages needs
    ``apply_chat_template`` (``--apply-chat-template``); a malformed list is an error
    either way. ``say`` gets a line about rows dropped from a reasoning-gym eval split.
    """
    if spec.startswith(BUILTIN_PREFIX):
        return _load_builtin(spec, seed)
    if spec.startswith(GYM_PREFIX):
        return _load_gym(spec, seed, say)
    if spec.startswith(VERIFIERS_PREFIX):
        rows = load_env_prompts(spec)
        meta = {"task": spec}
        return [Prompt(text=t, label=i, metadata=dict(meta), index=i) for t, i in rows]
    path = Path(spec)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise ConfigError(f"prompt data '{spec}': unsupported file type; use {SUPPORTED}")
    if not path.is_file():
        raise ConfigError(f"prompt data file not found: {spec}")
    rows = _jsonl_rows(path) if suffix == ".jsonl" else _parquet_rows(path)
    prompts = [
        _to_prompt(
            row,
            where,
            index,
            input_key,
            label_key,
            metadata_key,
            require_label,
            apply_chat_template,
        )
        for index, (where, row) in enumerate(rows)
    ]
    if not prompts:
        raise ConfigError(f"prompt data '{spec}' holds no prompts; give a file with at least one")
    return prompts


def parse_builtin_spec(spec: str) -> tuple[Task, str] | None:
    """``(task, split)`` of a ``builtin:<task>[:split]`` spec (split "train" by default),
    None for a file path; ConfigError naming the known tasks or splits otherwise. Cheap
    (nothing is generated), so the flags are checked with it before any process starts."""
    if not spec.startswith(BUILTIN_PREFIX):
        return None
    parts = spec[len(BUILTIN_PREFIX) :].split(":")
    if len(parts) > 2 or not parts[0]:
        raise ConfigError("write builtin:<task> or builtin:<task>:eval")
    task = get_task(parts[0])
    split = parts[1] if len(parts) == 2 else "train"
    if split not in SPLITS:
        raise ConfigError(f"no split '{split}'; use one of: {', '.join(SPLITS)}")
    return task, split


def _load_builtin(spec: str, seed: int) -> list[Prompt]:
    try:
        parsed = parse_builtin_spec(spec)
    except ConfigError as err:
        raise ConfigError(f"prompt data '{spec}': {err}") from None
    assert parsed is not None  # load_prompts sends only builtin: specs here
    task, split = parsed
    rows = task.make_examples(split, seed)
    return [
        Prompt(text=row["prompt"], label=row["label"], metadata={"task": task.name}, index=i)
        for i, row in enumerate(rows)
    ]


def _load_gym(spec: str, seed: int, say: Callable[[str], None]) -> list[Prompt]:
    rows, dropped = load_gym_prompts(spec, seed)
    if dropped:
        say(f"vime: {spec}: dropped {dropped} eval rows whose question is a train question")
    task = {"task": spec.split("?", 1)[0]}
    return [
        Prompt(text=q, label=ref, metadata=dict(task), index=i) for i, (q, ref) in enumerate(rows)
    ]


def _jsonl_rows(path: Path) -> Iterable[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
            yield where, row


def _parquet_rows(path: Path) -> Iterable[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{path}: reading parquet needs pyarrow; `pip install pyarrow` or use .jsonl"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise ConfigError(f"{path}: not a readable parquet file: {e}") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {number}", row


def _to_prompt(
    row: Any,
    where: str,
    index: int,
    input_key: str,
    label_key: str,
    metadata_key: str,
    require_label: bool,
    apply_chat_template: bool,
) -> Prompt:
    if not isinstance(row, Mapping):
        raise ConfigError(f"{where}: expected an object with a '{input_key}' key, got {_kind(row)}")
    keys = ", ".join(map(str, row)) or "none"
    if input_key not in row:
        raise ConfigError(
            f"{where}: no key '{input_key}'; keys present: {keys} (choose one with --input-key)"
        )
    if require_label and label_key not in row:
        raise ConfigError(
            f"{where}: no key '{label_key}' and the reward compares with a label; keys present: "
            f"{keys} (choose one with --label-key)"
        )
    if require_label and row[label_key] is None:
        raise ConfigError(
            f"{where}: '{label_key}' is null and the reward compares with a label; "
            "give every row one"
        )
    text = _input_of(row[input_key], f"{where}: '{input_key}'", apply_chat_template)
    metadata = row.get(metadata_key)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, Mapping):
        raise ConfigError(f"{where}: '{metadata_key}' must be an object, got {_kind(metadata)}")
    return Prompt(text=text, label=row.get(label_key), metadata=dict(metadata), index=index)


def _input_of(value: Any, where: str, apply_chat_template: bool) -> str | list[dict]:
    """A row's input: a string, or a well-formed message list when ``apply_chat_template``.

    ``where`` is "file:line: 'key'". A malformed list is reported before the missing
    flag, since adding the flag would not fix it.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a string, got {_kind(value)}")
    messages = _messages(value, where)
    if not apply_chat_template:
        raise ConfigError(
            f"{where} is a list of chat messages, which only a chat template can turn into "
            "a prompt; add --apply-chat-template"
        )
    return messages


def _messages(value: list, where: str) -> list[dict]:
    """``value`` as a list of message dicts (copies); ConfigError saying what is wrong."""
    if not value:
        raise ConfigError(f"{where} is an empty list of messages; give at least one")
    for number, message in enumerate(value, start=1):
        if not isinstance(message, Mapping):
            raise ConfigError(
                f"{where} message {number} must be an object with string 'role' and "
                f"'content', got {_kind(message)}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise ConfigError(f"{where} message {number} has no '{key}'")
            if not isinstance(message[key], str):
                raise ConfigError(
                    f"{where} message {number}: '{key}' must be a string, got {_kind(message[key])}"
                )
    return [dict(message) for message in value]


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def as_messages(text: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A prompt row as chat messages: a message list as is (copies), a string as one
    user turn."""
    if isinstance(text, str):
        return [{"role": "user", "content": text}]
    return [dict(m) for m in text]


def render_prompt(
    text: str | list[dict],
    tokenizer: Any,
    apply_chat_template: bool,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of a prompt, ready for the engine.

    With ``apply_chat_template`` the conversation -- ``text`` itself when it is a
    list of messages, else one user message holding it -- is followed by the
    template's generation prompt (the template adds whatever BOS or role tokens it
    wants), so a string and the one-user-message list give the same ids; ``tools``
    (JSON schemas) are shown to the model as the template shows them. Without
    it the ids are the text's tokens and nothing else: no BOS, no EOS, so a
    raw-text prompt is exactly what the data says; a message list is then an error.
    """
    if apply_chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(
                "--apply-chat-template: the tokenizer has no chat template; drop the flag"
            )
        messages = as_messages(text)
        extra = {"tools": tools} if tools else {}
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **extra
        )
    elif not isinstance(text, str):
        raise ConfigError(
            "a prompt that is a list of chat messages needs a chat template; "
            "add --apply-chat-template"
        )
    else:
        out = tokenizer(text, add_special_tokens=False)
    # transformers 5 returns a BatchEncoding by default; older versions a plain list.
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(i) for i in out]


def filter_prompt_lengths(
    prompts: Sequence[Prompt],
    token_ids: Sequence[list[int]],
    max_len: int | None,
    *,
    spec: str | None = None,
) -> tuple[list[Prompt], list[list[int]], int]:
    """Keep the prompts whose token count is at most ``max_len`` (all when None).

    Returns (kept prompts, their ids, how many were dropped), in the input order.
    ConfigError when every prompt is too long (``spec``, the data's name, goes in
    the message): nothing would be left to sample from.
    """
    if len(prompts) != len(token_ids):
        raise ValueError(f"{len(prompts)} prompts but {len(token_ids)} token id lists")
    kept = [
        (p, ids)
        for p, ids in zip(prompts, token_ids, strict=True)
        if max_len is None or len(ids) <= max_len
    ]
    if prompts and not kept:
        shortest = min(len(ids) for ids in token_ids)
        where = f"prompt data '{spec}': " if spec else ""
        raise ConfigError(
            f"{where}all {len(prompts)} prompts are longer than --rollout-max-prompt-len "
            f"{max_len} tokens (the shortest has {shortest}); raise it or use shorter prompts"
        )
    return [p for p, _ in kept], [ids for _, ids in kept], len(prompts) - len(kept)


class PromptSource:
    """Training order over ``num_epoch`` passes of ``prompts``, resumable from a checkpoint.

    Each epoch is a permutation drawn from (seed, epoch) alone, so the order does
    not depend on batch sizes or on when a run was interrupted. ``next_batch(n)``
    continues across epoch boundaries; at the very end it returns what is left
    (fewer than n), and once nothing is left it raises StopIteration.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        *,
        num_epoch: int = 1,
        seed: int = 1234,
        shuffle: bool = True,
    ) -> None:
        if not prompts:
            raise ConfigError("no prompts to train on; check --prompt-data")
        if num_epoch < 1:
            raise ConfigError(f"--num-epoch must be at least 1, got {num_epoch}")
        self.prompts = list(prompts)
        self.num_epoch = num_epoch
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self.prompts)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            # A string seed is hashed with SHA-512: the same order in every process.
            random.Random(f"vime-prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    @property
    def exhausted(self) -> bool:
        """True once every epoch has been handed out."""
        return self.epoch >= self.num_epoch

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (fewer only at the very end); StopIteration when exhausted."""
        if n < 1:
            raise ValueError(f"batch size must be positive, got {n}")
        if self.exhausted:
            raise StopIteration("the prompt source is exhausted (all --num-epoch passes done)")
        batch: list[Prompt] = []
        while len(batch) < n and not self.exhausted:
            take = min(n - len(batch), len(self.prompts) - self.position)
            batch += [self.prompts[i] for i in self._order[self.position : self.position + take]]
            self.position += take
            if self.position == len(self.prompts):
                self._start_epoch(self.epoch + 1)
        return batch

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self._order = self._permutation(epoch)

    def batches_per_epoch(self, n: int) -> int:
        """Whole batches of ``n`` in one pass (batches may straddle epochs, so this is a floor)."""
        return len(self.prompts) // n

    def total_batches(self, n: int) -> int:
        """Whole batches of ``n`` in all epochs (``run_length``'s default, n the prompts a
        rollout draws)."""
        return self.num_epoch * len(self.prompts) // n

    def state_dict(self) -> dict:
        """Position and order settings to store in a checkpoint (plain values: JSON-safe)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_epoch": self.num_epoch,
            "shuffle": self.shuffle,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; ConfigError if the data, seed, --num-epoch or shuffling
        differ from the checkpoint's: the resumed order or length would silently differ."""
        if state["num_prompts"] != len(self.prompts):
            raise ConfigError(
                f"the checkpoint was taken with {state['num_prompts']} prompts but the data has "
                f"{len(self.prompts)}; resume with the same --prompt-data"
            )
        for flag, key in (
            ("--seed", "seed"),
            ("--num-epoch", "num_epoch"),
            ("prompt shuffling", "shuffle"),
        ):
            # A checkpoint from before num_epoch and shuffle were stored lacks them.
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"the checkpoint was taken with {flag} {state[key]}, this run has "
                    f"{getattr(self, key)}; resume with the same {flag} to continue the "
                    "same prompt order"
                )
        position = int(state["position"])
        if not 0 <= position < len(self.prompts):
            raise ConfigError(f"checkpoint prompt position {position} is out of range")
        self._start_epoch(int(state["epoch"]))
        self.position = position


def prompts_per_rollout(batch_size: int, over_sampling_factor: float | None = None) -> int:
    """Prompts one rollout draws at the least: ``batch_size`` (--rollout-batch-size), or
    with dynamic sampling its first round's ceil(``over_sampling_factor`` x ``batch_size``),
    the same count ``RolloutManager.generate`` asks for."""
    if over_sampling_factor is None:
        return batch_size
    return math.ceil(batch_size * over_sampling_factor)


def run_length(source: PromptSource, per_rollout: int, requested: int | None = None) -> int:
    """The run's rollouts, which also set its LR schedule's length.

    ``requested`` (--num-rollout) if the data can feed it, else by default as many
    rollouts of ``per_rollout`` prompts (``prompts_per_rollout``) as all --num-epoch
    passes over ``source`` hold. ConfigError when that is not one rollout, or when
    ``requested`` needs more prompts than the passes hold: such a run would stop early
    with its LR schedule unfinished. A dynamic-sampling round beyond the first draws
    more, so such a run can still run out of data sooner (``DataExhausted``, logged).
    """
    fed = source.total_batches(per_rollout)
    held = source.num_epoch * len(source)
    if fed < 1:
        raise ConfigError(
            f"{len(source)} prompts make no full rollout of {per_rollout} prompts "
            f"(--rollout-batch-size, times --over-sampling-factor with dynamic sampling); "
            "lower it or add data"
        )
    if requested is None:
        return fed
    if requested > fed:
        raise ConfigError(
            f"--num-rollout {requested} needs {requested * per_rollout} prompts "
            f"({per_rollout} a rollout) but --num-epoch {source.num_epoch} of the "
            f"{len(source)} prompts hold {held}; lower --num-rollout to {fed} at most, "
            "or raise --num-epoch"
        )
    return requested
