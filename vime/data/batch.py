"""What a rollout hands to training: the samples' tokens, masks, advantages and the plan.

Where it fits: the rollout side fills a ``RolloutBatch`` (sample i = prompt +
response tokens of completion i, groups of one prompt contiguous), ``schedule``
plans it once with ``vime.data.packing``, and every training rank of either
backend receives the same ``TrainSchedule`` and reads its own part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vime.data.micro_batch import PackedBatch, pack_micro_batch
from vime.data.packing import RolloutPlan, plan_rollout
from vime.sync_budget import host_only


@dataclass(frozen=True)
class RolloutBatch:
    """Token-level content of one rollout's samples.

    ``loss_masks[i]`` has one 0/1 per response token (all zero for a sample
    excluded from the loss, e.g. a failed reward); ``rollout_log_probs[i]``
    (one per response token, from the engine) is optional. ``demonstrations``: the
    samples are a warm start's (``vime.setup.warm_start``), written by no engine, so
    no rollout correction weighs them.
    """

    tokens: list[list[int]]
    prompt_lengths: list[int]
    loss_masks: list[list[int]]
    advantages: list[float]
    rollout_log_probs: list[list[float]] | None = None
    demonstrations: bool = False

    def __post_init__(self) -> None:
        n = len(self.tokens)
        sizes = [len(self.prompt_lengths), len(self.loss_masks), len(self.advantages)]
        if self.rollout_log_probs is not None:
            sizes.append(len(self.rollout_log_probs))
        if any(size != n for size in sizes):
            raise ValueError(f"RolloutBatch fields disagree on the number of samples: {n}, {sizes}")

    def __len__(self) -> int:
        return len(self.tokens)

    def pack(
        self, indices: Sequence[int], pad_to_multiple_of: int = 1, share_prompts: bool = False
    ) -> PackedBatch:
        """The packed row of samples ``indices`` (one planned micro-batch), right-padded
        to a multiple of ``pad_to_multiple_of`` tokens (sequence parallel splits rows);
        with ``share_prompts`` each distinct prompt in it once (``vime.data.micro_batch``)."""
        return pack_micro_batch(
            [self.tokens[i] for i in indices],
            [self.prompt_lengths[i] for i in indices],
            [self.loss_masks[i] for i in indices],
            pad_to_multiple_of=pad_to_multiple_of,
            share_prompts=share_prompts,
        )

    def advantages_of(self, indices: Sequence[int]) -> torch.Tensor:
        return torch.tensor([self.advantages[i] for i in indices], dtype=torch.float32)

    def rollout_log_probs_of(self, indices: Sequence[int], width: int) -> torch.Tensor | None:
        """``[B, width]`` engine log-probs of samples ``indices`` (zero-padded), or None."""
        if self.rollout_log_probs is None:
            return None
        return pad_rows([self.rollout_log_probs[i] for i in indices], width)


def pad_rows(rows: Sequence[Sequence[float] | torch.Tensor], width: int) -> torch.Tensor:
    """Per-sample 1-D host values as a float32 ``[len(rows), width]`` host tensor, right
    zero-padded."""
    with host_only():  # host lists or host tensors in, a host tensor out
        return _pad_rows(rows, width)


def _pad_rows(rows: Sequence[Sequence[float] | torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    if not rows:
        return out
    lengths = torch.tensor([len(values) for values in rows])
    if int(lengths.max()) > width:
        raise ValueError(f"a row of {int(lengths.max())} values does not fit width {width}")
    # One assignment for all rows: a slice assignment per row costs ~10 us each.
    if any(isinstance(values, torch.Tensor) for values in rows):
        flat = torch.cat([torch.as_tensor(values, dtype=torch.float32) for values in rows])
    else:
        flat = torch.tensor([v for values in rows for v in values], dtype=torch.float32)
    out[torch.arange(width) < lengths[:, None]] = flat
    return out


@dataclass(frozen=True)
class TrainSchedule:
    """A rollout batch and its plan: the unit ``TrainActor.train`` consumes."""

    batch: RolloutBatch
    plan: RolloutPlan
    rollout_id: int = 0


def schedule(
    batch: RolloutBatch,
    *,
    global_batch_size: int,
    dp_size: int,
    max_tokens_per_gpu: int | None = None,
    micro_batch_size: int | None = None,
    shuffle_seed: int | None = None,
    rollout_id: int = 0,
) -> TrainSchedule:
    """Plan ``batch`` into optimizer steps, per-rank shares and packed micro-batches."""
    plan = plan_rollout(
        [len(t) for t in batch.tokens],
        [int(sum(m)) for m in batch.loss_masks],
        global_batch_size=global_batch_size,
        dp_size=dp_size,
        max_tokens_per_gpu=max_tokens_per_gpu,
        micro_batch_size=None if max_tokens_per_gpu is not None else micro_batch_size,
        shuffle_seed=shuffle_seed,
    )
    return TrainSchedule(batch=batch, plan=plan, rollout_id=rollout_id)
