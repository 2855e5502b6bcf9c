"""What flows between the rollout manager and an engine.

Where it fits: ``RolloutManager`` sends token-id prompts and one
``SamplingParams``; every engine (``engines.hf``, ``engines.vllm``) answers with
``Completion`` objects carrying the sampled tokens and their log-probs at the
sampling temperature, which training compares against its own forward. The
``RolloutEngine`` protocol is the whole contract an engine must meet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# What an engine holds on its device and can free in ``sleep`` (vLLM's sleep-mode tags):
# ``wake_up(("weights",))`` brings back only the weights, so new ones can be loaded while
# the trainer still holds its memory; the KV cache follows once the trainer sleeps.
MEMORY_TAGS = ("weights", "kv_cache")


def wake_tags(tags: Sequence[str] | None) -> frozenset[str]:
    """The parts ``wake_up(tags)`` restores: all of ``MEMORY_TAGS`` for ``None``."""
    if tags is None:
        return frozenset(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown wake_up tags {unknown}; use {list(MEMORY_TAGS)} or None")
    return frozenset(tags)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings; ``seed`` makes the draw reproducible.

    ``n`` completions per prompt; ``top_k=-1`` and ``top_p=1.0`` disable those
    filters; ``temperature=0`` means greedy. ``stop_token_ids`` end a
    completion (the stop token is kept in the response, as EOS is).

    Completion j of the request's prompt i is drawn with a seed derived from
    ``(seed, first_prompt_index + i, j)`` alone. ``first_prompt_index`` is the
    index of the request's first prompt in the whole batch (0 when the request
    is the whole batch): a caller that splits one batch over several engines
    passes each part's offset, so a completion does not depend on how many
    engines there are or how the prompts were split between them.

    ``prompt_indices`` (one per prompt) replaces ``first_prompt_index + i`` as
    prompt i's index in that derivation: the multi-turn loop batches whichever
    turns are ready and names each by its trajectory and turn, so a turn's draw
    does not depend on what else shares its call.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    first_prompt_index: int = 0
    prompt_indices: tuple[int, ...] | None = None

    def prompt_index(self, i: int) -> int:
        """The index prompt ``i`` of the request is seeded by."""
        if self.prompt_indices is not None:
            return self.prompt_indices[i]
        return self.first_prompt_index + i


@dataclass(frozen=True)
class Completion:
    """One sampled response to one prompt."""

    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]  # one per response token, at the sampling temperature
    finish_reason: str = "length"  # "stop" (EOS / stop token) or "length"
    extra: dict[str, Any] = field(default_factory=dict)
    # (oldest, newest) weight version that sampled its tokens: they differ when new
    # weights arrived while it was generating (asynchronous rollout). None: not recorded.
    weight_versions: tuple[int, int] | None = None
    # One 0/1 per response token: 1 for the model's own tokens, 0 for what the
    # environment appended (a multi-turn trajectory's tool turns). None: all the model's.
    loss_mask: list[int] | None = None

    @property
    def generated(self) -> int:
        """Tokens the engine generated (the environment's left out)."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)


class RolloutEngine(Protocol):
    """The contract the rollout manager relies on."""

    weight_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order."""
        ...

    def score(self, token_ids: list[int], prompt_len: int, temperature: float) -> list[float]:
        """Log-probs of ``token_ids[prompt_len:]`` given what precedes each token."""
        ...

    def update_weights(self, buckets: Iterable[list[tuple[str, Any]]], version: int) -> None:
        """Load HF-named tensors (a full set, bucket by bucket, taken lazily: a set that
        arrives over several calls streams in through ``vime.weights.update_stream``)
        and serve ``version``."""
        ...

    def sleep(self) -> None:
        """Free device memory; until ``wake_up`` the engine refuses to generate, score or
        load weights (on CPU too, where nothing is freed)."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what ``sleep`` freed: the ``MEMORY_TAGS`` parts named, or all. Loading
        weights needs ``weights``; generating and scoring need both."""
        ...
