"""A supervised warm start before the first rollout (``--sft-warmup-steps``).

Where it fits: ``build_warm_start`` turns the built-in task's demonstrations
(``vime.data.tasks.Task.demonstration``: the right answer, or for a tool task the call,
the tool's answer and the final answer) of the training prompts into ``RolloutBatch``es,
one an optimizer step; ``vime.trainer.Run`` trains them before its first rollout and
syncs the engines. A demonstration is trained by the run's own loss with every
advantage 1: the ratio is 1 at each step's single update, so the policy-gradient term
is the mean negative log-likelihood of its model tokens (tool answers masked out), as a
cold start's supervised step, and the other terms (KL, entropy) apply as the flags set
them, but no rollout correction (``--use-tis``, on by default with ``--max-staleness``):
no engine wrote them. The RL prompt order is not touched: the warm start draws its own
rows by seed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from vime.data.batch import RolloutBatch
from vime.data.prompts import Prompt
from vime.setup.settings import WarmStartSettings


def demonstration_ids(task: Any, prompt: Prompt, tokenizer: Any) -> tuple[list[int], list[int]]:
    """The response token ids of ``prompt``'s demonstration and their loss mask: each
    segment's text as the tokenizer encodes it (as the tool loop encodes a tool's
    answer), EOS after a model turn, mask 1 on the model's tokens and 0 on the rest."""
    ids: list[int] = []
    mask: list[int] = []
    for segment in task.demonstration(prompt.text, prompt.label):
        piece = list(tokenizer.encode(segment.text, add_special_tokens=False))
        if segment.ends_turn:
            piece.append(tokenizer.eos_token_id)
        ids += piece
        mask += [int(segment.trained)] * len(piece)
    return ids, mask


def build_warm_start(
    settings: WarmStartSettings | None,
    task: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    prompt_ids: Mapping[int, list[int]],
) -> list[RolloutBatch]:
    """The warm start's batches: for each step, ``batch_size`` training prompts drawn
    without replacement (with replacement across steps) by ``settings.seed``, each
    sample its prompt's ids and its demonstration, advantage 1. None (a resumed run,
    warm already) or 0 steps: none."""
    if settings is None or settings.steps <= 0:
        return []
    rng = random.Random(f"warm-start:{settings.seed}")
    pool = list(prompts)
    size = min(settings.batch_size, len(pool))
    demonstrations: dict[int, tuple[list[int], list[int]]] = {}  # prompt index -> its ids
    batches = []
    for _ in range(settings.steps):
        tokens, prompt_lengths, masks = [], [], []
        for prompt in rng.sample(pool, size):
            head = prompt_ids[prompt.index]
            if prompt.index not in demonstrations:
                demonstrations[prompt.index] = demonstration_ids(task, prompt, tokenizer)
            ids, mask = demonstrations[prompt.index]
            tokens.append(list(head) + ids)
            prompt_lengths.append(len(head))
            masks.append(list(mask))
        batches.append(
            RolloutBatch(tokens, prompt_lengths, masks, [1.0] * size, demonstrations=True)
        )
    return batches
