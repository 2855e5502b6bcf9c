"""What ends a model turn, and a turn's tokens as the text rewards and tools read.

Where it fits: ``RolloutManager`` (single-turn responses, for the reward) and the
tool loop (``vime.rollout.tools.loop``, each model turn, for its parser) both stop
generation at the same ids and decode a turn the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def stop_token_ids(extra: Sequence[int], eos: int | None) -> tuple[int, ...]:
    """``--rollout-stop-token-ids``, then the tokenizer's EOS where it has one (once)."""
    stops = list(dict.fromkeys(extra))
    if eos is not None and eos not in stops:
        stops.append(eos)
    return tuple(stops)


def decode_turns(
    tokenizer: Any, turns: Sequence[Sequence[int]], stops: Sequence[int] | frozenset[int]
) -> list[str]:
    """Each turn as text, in one tokenizer call: a final stop token removed, every other
    token kept, special ones included. Skipping special tokens would make them free
    filler: a policy learns to pad wrong answers with them instead of stopping."""
    if not turns:  # batch_decode([]) is [""], one empty text
        return []
    trimmed = [list(ids[:-1]) if ids and ids[-1] in stops else list(ids) for ids in turns]
    return tokenizer.batch_decode(trimmed, skip_special_tokens=False)
