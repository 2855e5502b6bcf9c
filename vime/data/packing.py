"""The rollout planner: samples -> optimizer steps -> DP ranks -> padding-free micro-batches.

Where it fits: between the rollout (which produced samples with lengths) and the
training backends. Both backends (FSDP2 and Megatron) consume the same
:class:`RolloutPlan`, so a run trains the same micro-batches whichever backend
runs it. The planner is pure, deterministic Python on sample *lengths* only: no
torch, no ``torch.distributed``; every rank computes the same plan from the
same lengths and reads its own share with :meth:`RolloutPlan.for_rank`.

The schedule, level by level:

1. Samples (optionally shuffled by ``random.Random(shuffle_seed)``) are cut into
   consecutive optimizer steps of ``global_batch_size`` samples.
2. Each step is split across ``dp_size`` ranks balanced by ``total_lengths``
   (tokens a rank must forward). The heaviest and lightest rank differ by at
   most the longest sample of the step. In ``micro_batch_size`` mode every rank
   gets exactly ``global_batch_size // dp_size`` samples, still balanced.
3. Each rank's share is packed into micro-batches, one padding-free row each:
   first-fit-decreasing under ``max_tokens_per_gpu`` (a sample longer than the
   cap sits alone in its row), or ``micro_batch_size`` samples per row.
4. Every rank of a step gets the *same* number of micro-batches: FSDP and
   Megatron run collectives once per micro-batch forward/backward, so unequal
   counts would hang. Ranks with fewer rows split their largest rows; a rank
   still short (fewer samples than micro-batches) gets **empty micro-batches**
   ``()``. The backend must still run a forward/backward for an empty
   micro-batch (``pack_micro_batch([], [])`` gives a one-token dummy row) with
   a loss of weight zero, so its collectives line up with the other ranks.

The loss contract (why the step carries *global* normalizers): every
micro-batch's loss is ::

    aggregate_loss(values, mask, mode, num_tokens=step.num_tokens,
                   num_seqs=step.num_samples, norm_len=<the run's constant>)

and its backward accumulates into the gradient. The backend must **sum** (not
average) the gradients over DP ranks (i.e. undo FSDP/DDP's default 1/dp
averaging, or scale the loss by dp). Then the step's gradient equals the
gradient of ``aggregate_loss`` over the whole step as one batch, for every
aggregation mode, independent of ``dp_size`` and of the micro-batch geometry.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

MicroBatch = tuple[int, ...]
"""Sample indices packed into one padding-free row (may be empty, see module doc)."""
RankSchedule = tuple[MicroBatch, ...]
"""One rank's micro-batches of one optimizer step, in execution order."""


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: ``micro_batches[dp_rank][micro][position] -> sample index``.

    ``num_tokens`` and ``num_samples`` are the step's global loss normalizers
    (over all ranks and micro-batches): Σ loss_lengths and the count of samples
    with loss_lengths > 0.
    ``rank_tokens[r]`` is the total_lengths sum rank r forwards (for balance metrics).
    """

    micro_batches: tuple[RankSchedule, ...]
    num_tokens: int
    num_samples: int
    rank_tokens: tuple[int, ...]

    @property
    def dp_size(self) -> int:
        return len(self.micro_batches)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (identical on every rank by construction)."""
        return len(self.micro_batches[0])

    @property
    def sample_indices(self) -> tuple[int, ...]:
        """Every sample of the step, sorted."""
        return tuple(sorted(i for rank in self.micro_batches for mb in rank for i in mb))

    def for_rank(self, dp_rank: int) -> RankSchedule:
        return self.micro_batches[dp_rank]


@dataclass(frozen=True)
class RolloutPlan:
    """The whole rollout's schedule: consecutive optimizer steps."""

    steps: tuple[StepPlan, ...]
    dp_size: int

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def for_rank(self, dp_rank: int) -> tuple[RankSchedule, ...]:
        """This rank's micro-batches, one :data:`RankSchedule` per optimizer step."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {self.dp_size}")
        return tuple(step.for_rank(dp_rank) for step in self.steps)


def plan_rollout(
    total_lengths: Sequence[int],
    loss_lengths: Sequence[int],
    *,
    global_batch_size: int,
    dp_size: int,
    max_tokens_per_gpu: int | None = None,
    micro_batch_size: int | None = None,
    shuffle_seed: int | None = None,
) -> RolloutPlan:
    """Plan a rollout's samples into optimizer steps, DP ranks and micro-batches.

    ``total_lengths[i]`` is the row length of sample i (prompt + response);
    ``loss_lengths[i]`` the response tokens of sample i that carry loss (0 for a
    sample excluded from the loss). Exactly one of ``max_tokens_per_gpu`` and
    ``micro_batch_size`` must be given. See the module docstring for the
    schedule and the loss contract the backends must follow.
    """
    _validate(
        total_lengths,
        loss_lengths,
        global_batch_size,
        dp_size,
        max_tokens_per_gpu,
        micro_batch_size,
    )
    order = list(range(len(total_lengths)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)

    steps = []
    for start in range(0, len(order), global_batch_size):
        indices = order[start : start + global_batch_size]
        if micro_batch_size is None:
            shares = _balance_free(indices, total_lengths, dp_size)
            rows = [
                _pack_first_fit_decreasing(s, total_lengths, max_tokens_per_gpu) for s in shares
            ]
        else:
            shares = _balance_equal_count(indices, total_lengths, dp_size)
            rows = [_pack_fixed(s, micro_batch_size) for s in shares]
        rows = _equalize_micro_counts(rows, total_lengths)
        steps.append(
            StepPlan(
                micro_batches=tuple(tuple(tuple(mb) for mb in rank) for rank in rows),
                num_tokens=sum(loss_lengths[i] for i in indices),
                num_samples=sum(1 for i in indices if loss_lengths[i] > 0),
                rank_tokens=tuple(sum(total_lengths[i] for i in s) for s in shares),
            )
        )
    return RolloutPlan(steps=tuple(steps), dp_size=dp_size)


def _validate(
    total_lengths: Sequence[int],
    loss_lengths: Sequence[int],
    global_batch_size: int,
    dp_size: int,
    max_tokens_per_gpu: int | None,
    micro_batch_size: int | None,
) -> None:
    if (max_tokens_per_gpu is None) == (micro_batch_size is None):
        raise ValueError(
            "give exactly one of max_tokens_per_gpu and micro_batch_size; got "
            f"max_tokens_per_gpu={max_tokens_per_gpu}, micro_batch_size={micro_batch_size}"
        )
    for name, value in (
        ("max_tokens_per_gpu", max_tokens_per_gpu),
        ("micro_batch_size", micro_batch_size),
        ("global_batch_size", global_batch_size),
        ("dp_size", dp_size),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    n = len(total_lengths)
    if len(loss_lengths) != n:
        raise ValueError(f"{n} total_lengths but {len(loss_lengths)} loss_lengths")
    if n == 0:
        raise ValueError("cannot plan a rollout with no samples")
    if n % global_batch_size:
        raise ValueError(
            f"{n} samples is not a multiple of global_batch_size={global_batch_size} "
            f"({n % global_batch_size} left over)"
        )
    if global_batch_size % dp_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of dp_size={dp_size}"
        )
    for i, (total, loss) in enumerate(zip(total_lengths, loss_lengths, strict=True)):
        # A response token's log-prob is predicted from the position before it,
        # so at least one prompt token must precede the loss tokens.
        if total < 1 or not 0 <= loss <= total - 1:
            raise ValueError(
                f"sample {i}: need total_length >= 1 and 0 <= loss_length <= total_length - 1, "
                f"got total_length={total}, loss_length={loss}"
            )


def _by_length_desc(indices: Sequence[int], lengths: Sequence[int]) -> list[int]:
    # Index as tie-break keeps the plan deterministic for equal lengths.
    return sorted(indices, key=lambda i: (-lengths[i], i))


def _balance_free(indices: Sequence[int], lengths: Sequence[int], dp: int) -> list[list[int]]:
    """Longest-processing-time greedy: each sample goes to the currently lightest rank.

    Bound: placing x on the lightest rank makes it at most min + x, so the
    spread never exceeds the longest sample (by induction over placements).
    """
    heap = [(0, r) for r in range(dp)]
    shares: list[list[int]] = [[] for _ in range(dp)]
    for i in _by_length_desc(indices, lengths):
        load, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return [sorted(s) for s in shares]


def _balance_equal_count(
    indices: Sequence[int], lengths: Sequence[int], dp: int
) -> list[list[int]]:
    """Exactly len(indices)/dp samples per rank, balanced by tokens.

    Samples sorted by length are dealt in rounds of dp: in each round the
    longest goes to the lightest rank, the next to the second lightest, ...
    Bound: with loads l₁ ≤ … ≤ l_d and the round's x₁ ≥ … ≥ x_d, the new
    difference between ranks i > j is (lᵢ − lⱼ) + (xᵢ − xⱼ) ≤ old spread, and
    between i < j it is ≤ x₁ − x_d ≤ x₁; so the spread stays ≤ the longest
    sample. Pairwise swaps then shrink the spread further (never growing it).
    """
    ordered = _by_length_desc(indices, lengths)
    shares: list[list[int]] = [[] for _ in range(dp)]
    loads = [0] * dp
    for start in range(0, len(ordered), dp):
        ranks = sorted(range(dp), key=lambda r: (loads[r], r))
        for r, i in zip(ranks, ordered[start : start + dp], strict=True):
            shares[r].append(i)
            loads[r] += lengths[i]
    _refine_by_swaps(shares, loads, lengths)
    return [sorted(s) for s in shares]


def _refine_by_swaps(shares: list[list[int]], loads: list[int], lengths: Sequence[int]) -> None:
    """Swap one sample between the heaviest and lightest rank while it helps.

    A swap moving δ tokens with 0 < δ < spread keeps both ranks inside the old
    [min, max], so the global spread never grows; Σ load² strictly drops, so
    the loop terminates (capped anyway).
    """
    for _ in range(4 * sum(len(s) for s in shares)):
        heavy = max(range(len(loads)), key=lambda r: (loads[r], -r))
        light = min(range(len(loads)), key=lambda r: (loads[r], r))
        spread = loads[heavy] - loads[light]
        if spread <= 1:
            return
        light_sorted = sorted(shares[light], key=lambda i: (lengths[i], i))
        light_lengths = [lengths[i] for i in light_sorted]
        best = None  # (|spread - 2δ|, a, b, δ)
        for a in sorted(shares[heavy]):
            # The ideal partner b has length lengths[a] - spread/2.
            pos = bisect.bisect_left(light_lengths, lengths[a] - spread / 2)
            for k in (pos - 1, pos):
                if 0 <= k < len(light_sorted):
                    delta = lengths[a] - light_lengths[k]
                    if 0 < delta < spread:
                        cand = (abs(spread - 2 * delta), a, light_sorted[k], delta)
                        best = cand if best is None or cand < best else best
        if best is None:
            return
        _, a, b, delta = best
        shares[heavy][shares[heavy].index(a)] = b
        shares[light][shares[light].index(b)] = a
        loads[heavy] -= delta
        loads[light] += delta


def _pack_first_fit_decreasing(
    share: Sequence[int], lengths: Sequence[int], cap: int
) -> list[list[int]]:
    """First-fit-decreasing bin packing; a sample longer than ``cap`` gets a row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in _by_length_desc(share, lengths):
        for k, free in enumerate(room):
            if lengths[i] <= free:
                rows[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(cap - lengths[i])  # negative for an over-long sample: nothing fits
    return [sorted(r) for r in rows]


def _pack_fixed(share: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive chunks of ``micro_batch_size`` samples (the last may be shorter)."""
    return [list(share[k : k + micro_batch_size]) for k in range(0, len(share), micro_batch_size)]


def _equalize_micro_counts(
    rows_per_rank: list[list[list[int]]], lengths: Sequence[int]
) -> list[list[list[int]]]:
    """Give every rank the same number of micro-batches (collectives must line up).

    A short rank splits its heaviest multi-sample row in two (halves balanced
    by tokens, so caps stay respected) until it reaches the target count; if it
    runs out of samples, it gets empty micro-batches at the end.
    """
    target = max(len(rows) for rows in rows_per_rank)
    out = []
    for rows in rows_per_rank:
        rows = [list(r) for r in rows]
        while len(rows) < target:
            splittable = [k for k, r in enumerate(rows) if len(r) > 1]
            if not splittable:
                rows.extend([] for _ in range(target - len(rows)))
                break
            k = max(splittable, key=lambda k: (sum(lengths[i] for i in rows[k]), -k))
            first, second = _balance_free(rows[k], lengths, 2)
            rows[k : k + 1] = [first, second]
        out.append(rows)
    return out
