"""The rollout planner keeps its promises, and the step normalizers make the gradient geometry-free.

Proves, over hundreds of random rollouts in both packing modes: every sample is
planned exactly once; steps hold exactly global_batch_size samples, consecutive
(or consecutive chunks of a seed-reproducible permutation); token caps hold
except for a lone over-long sample; fixed-size mode gives every rank exactly
global_batch_size/dp samples; all ranks of a step have the same micro-batch
count; the heaviest and lightest rank differ by at most the longest sample; the
step normalizers are right; planning is deterministic; bad input raises.

Then the point of the global normalizers: for all four aggregation modes, the
gradient summed over micro-batches and over simulated dp ranks, each
micro-batch normalized by its step's numbers, equals the gradient of
``aggregate_loss`` over the whole step as one batch (float64, tight) -- and a
negative control shows that per-micro-batch normalizers would break it. The
rollouts include multi-turn masks (environment tokens inside a response), and
``schedule`` counts only their mask-1 tokens in the normalizers.
"""

from __future__ import annotations

import random

import pytest
import torch

from vime.algo.aggregation import AGGREGATION_MODES, aggregate_loss
from vime.data.batch import RolloutBatch, schedule
from vime.data.packing import RolloutPlan, _equalize_micro_counts, plan_rollout

# Dr. GRPO's constant length (the run's generation budget), the same for every step.
NORM_LEN = 16


def _random_rollout(rng: random.Random):
    dp = rng.choice([1, 2, 3, 4, 8])
    gbs = dp * rng.randint(1, 6)
    n = gbs * rng.randint(1, 3)
    long_tail = rng.random() < 0.3
    total = [
        rng.randint(2, 40) if not long_tail or rng.random() < 0.8 else rng.randint(100, 400)
        for _ in range(n)
    ]
    loss = [0 if rng.random() < 0.15 else rng.randint(0, t - 1) for t in total]
    return total, loss, gbs, dp


def _check_plan(plan: RolloutPlan, total, loss, gbs, dp, cap=None, mbs=None, seed=None):
    n = len(total)
    assert plan.dp_size == dp and plan.num_steps == n // gbs
    order = list(range(n))
    if seed is not None:
        random.Random(seed).shuffle(order)
    seen = []
    for s, step in enumerate(plan.steps):
        assert len(step.micro_batches) == dp
        members = [i for rank in step.micro_batches for mb in rank for i in mb]
        assert sorted(members) == sorted(order[s * gbs : (s + 1) * gbs])
        assert step.sample_indices == tuple(sorted(members))
        seen += members
        # Collectives run once per micro-batch: counts must match on every rank.
        assert len({len(rank) for rank in step.micro_batches}) == 1
        for rank in step.micro_batches:
            for mb in rank:
                if cap is not None:
                    assert len(mb) == 1 or sum(total[i] for i in mb) <= cap
                else:
                    assert len(mb) <= mbs
            if any(len(mb) == 0 for mb in rank):
                # Empty fillers only once no row is left to split.
                assert all(len(mb) <= 1 for mb in rank)
            if mbs is not None:
                assert sum(len(mb) for mb in rank) == gbs // dp
        loads = [sum(total[i] for mb in rank for i in mb) for rank in step.micro_batches]
        assert list(step.rank_tokens) == loads
        assert max(loads) - min(loads) <= max(total[i] for i in members)
        assert step.num_tokens == sum(loss[i] for i in members)
        assert step.num_samples == sum(1 for i in members if loss[i] > 0)
    assert sorted(seen) == list(range(n))  # every sample exactly once


@pytest.mark.parametrize("mode", ["tokens", "fixed"])
def test_plan_invariants_over_random_rollouts(mode):
    rng = random.Random(1234 if mode == "tokens" else 4321)
    for _ in range(300):
        total, loss, gbs, dp = _random_rollout(rng)
        seed = rng.choice([None, rng.randint(0, 10**6)])
        if mode == "tokens":
            cap, mbs = rng.choice([10, 40, 64, 200, 10_000]), None
        else:
            cap, mbs = None, rng.randint(1, gbs // dp + 1)
        plan = plan_rollout(
            total, loss, global_batch_size=gbs, dp_size=dp, max_tokens_per_gpu=cap,
            micro_batch_size=mbs, shuffle_seed=seed,
        )  # fmt: skip
        _check_plan(plan, total, loss, gbs, dp, cap=cap, mbs=mbs, seed=seed)


def test_equal_count_balance_bound_on_adversarial_lengths():
    # Heavy-tailed lengths with few samples per rank: where naive count-constrained
    # greedy can overshoot, the round dealing + swaps must stay within one sample.
    rng = random.Random(7)
    for _ in range(200):
        dp = rng.choice([2, 3, 4])
        per_rank = rng.randint(1, 5)
        total = [rng.choice([1, 2, 3, 500, 1000]) + rng.randint(0, 3) for _ in range(dp * per_rank)]
        plan = plan_rollout(
            total, [0] * len(total), global_batch_size=len(total), dp_size=dp, micro_batch_size=1
        )
        _check_plan(plan, total, [0] * len(total), len(total), dp, mbs=1)


def test_swap_refinement_improves_on_round_dealing():
    # Dealing sorted lengths in rounds gives {19, 12, 9} = 40 and {16, 15, 3} = 34;
    # swapping 19 and 16 balances them exactly.
    lengths = [19, 9, 15, 16, 12, 3]
    plan = plan_rollout(lengths, [1] * 6, global_batch_size=6, dp_size=2, micro_batch_size=3)
    assert plan.steps[0].rank_tokens == (37, 37)


def test_consecutive_steps_and_for_rank():
    total = [5, 6, 7, 8, 9, 10, 11, 12]
    plan = plan_rollout(total, [1] * 8, global_batch_size=4, dp_size=2, max_tokens_per_gpu=100)
    assert [s.sample_indices for s in plan.steps] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert plan.for_rank(1) == tuple(step.micro_batches[1] for step in plan.steps)
    with pytest.raises(ValueError, match="dp_rank"):
        plan.for_rank(2)


def test_shuffle_is_reproducible_by_seed():
    total = list(range(2, 66))
    kwargs = dict(global_batch_size=16, dp_size=4, max_tokens_per_gpu=80)
    a = plan_rollout(total, [1] * 64, shuffle_seed=3, **kwargs)
    assert a == plan_rollout(total, [1] * 64, shuffle_seed=3, **kwargs)
    assert a != plan_rollout(total, [1] * 64, shuffle_seed=4, **kwargs)
    assert a != plan_rollout(total, [1] * 64, **kwargs)
    assert plan_rollout(total, [1] * 64, **kwargs) == plan_rollout(total, [1] * 64, **kwargs)


def test_over_long_sample_sits_alone_and_short_rank_gets_empty_micro_batch():
    plan = plan_rollout(
        [30, 5, 5, 5], [3, 4, 0, 2], global_batch_size=4, dp_size=2, max_tokens_per_gpu=10
    )
    (step,) = plan.steps
    # Rank 0 holds only the over-long sample; rank 1 needs two rows, so rank 0
    # gets an empty filler micro-batch to keep the collectives in step.
    assert step.micro_batches == (((0,), ()), ((1, 2), (3,)))
    assert (step.num_tokens, step.num_samples) == (9, 3)


def test_short_rank_splits_its_largest_rows_first():
    lengths = [4, 4, 4, 1, 1, 1, 9]
    rows = _equalize_micro_counts([[[0, 1, 2], [6]], [[3], [4], [5], [6]]], lengths)
    assert [len(r) for r in rows] == [4, 4]
    assert all(mb for mb in rows[0])  # split, not padded with empty ones
    assert sorted(i for mb in rows[0] for i in mb) == [0, 1, 2, 6]
    # With two splittable rows, the heavier one (8 tokens, not 2) is split.
    rows = _equalize_micro_counts([[[3, 4], [0, 1]], [[5], [6], [2]]], lengths)
    assert rows[0] == [[3, 4], [0], [1]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(global_batch_size=4, dp_size=2), "exactly one"),
        (dict(global_batch_size=4, dp_size=2, max_tokens_per_gpu=9, micro_batch_size=1), "exactly"),
        (dict(global_batch_size=3, dp_size=1, micro_batch_size=1), "not a multiple of global"),
        (dict(global_batch_size=4, dp_size=3, micro_batch_size=1), "not a multiple of dp_size"),
        (dict(global_batch_size=4, dp_size=0, micro_batch_size=1), "dp_size must be >= 1"),
        (dict(global_batch_size=4, dp_size=2, max_tokens_per_gpu=0), "max_tokens_per_gpu"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_rollout([3] * 8, [1] * 8, **kwargs)


def test_bad_lengths_raise():
    ok = dict(global_batch_size=2, dp_size=1, micro_batch_size=1)
    with pytest.raises(ValueError, match="loss_lengths"):
        plan_rollout([3, 3], [1], **ok)
    with pytest.raises(ValueError, match="sample 1"):
        plan_rollout([3, 3], [1, 3], **ok)  # no prompt token left
    with pytest.raises(ValueError, match="sample 0"):
        plan_rollout([0, 3], [0, 1], **ok)
    with pytest.raises(ValueError, match="no samples"):
        plan_rollout([], [], **ok)


# --- gradient invariance ---------------------------------------------------------------------


def _turns_mask(length: int, run: int) -> torch.Tensor:
    """A multi-turn loss mask: ``run`` model tokens (1), ``run`` environment tokens (0), ..."""
    return ((torch.arange(length) // run) % 2 == 0).to(torch.float64)


def _has_hole(mask: torch.Tensor) -> bool:
    """A 0 between two 1s: environment tokens inside the response."""
    ones = mask.nonzero()
    return len(ones) > 0 and bool((mask[int(ones[0]) : int(ones[-1]) + 1] == 0).any())


def _step_data(num_samples: int, seed: int):
    """Per-token features, 0/1 loss masks and their lengths for a synthetic rollout: full
    masks, excluded samples, scattered zeros and multi-turn masks (runs of model and
    environment tokens, so holes inside the response)."""
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(1, 12, (num_samples,), generator=gen).tolist()
    prompts = torch.randint(1, 20, (num_samples,), generator=gen).tolist()
    feats = [torch.randn(r, 3, generator=gen, dtype=torch.float64) for r in responses]
    masks = [torch.ones(r, dtype=torch.float64) for r in responses]
    longest = max(range(num_samples), key=lambda i: responses[i])
    for i in range(num_samples):
        if i != longest and i % 5 == 1:
            masks[i] = torch.zeros(responses[i], dtype=torch.float64)  # excluded sample
        elif i != longest and i % 3 == 2:
            masks[i][torch.rand(responses[i], generator=gen) < 0.4] = 0.0  # e.g. tool tokens
        elif i != longest and i % 5 == 3:  # tool turns; no draw, so the stream is as before
            masks[i] = _turns_mask(responses[i], 1 + (i // 5) % 3)
    loss_lengths = [int(m.sum()) for m in masks]
    totals = [p + r for p, r in zip(prompts, responses, strict=True)]
    return feats, masks, totals, loss_lengths


def _values_and_mask(theta, feats, masks, indices):
    """A parameter-dependent per-token value (a stand-in for a PPO term), padded to [B, T].

    It depends on the sample (index i), never on where the planner put it.
    """
    width = max((feats[i].shape[0] for i in indices), default=0)
    values = theta.new_zeros(len(indices), width) + 0.0 * theta.sum()  # grad path when empty
    mask = torch.zeros(len(indices), width, dtype=torch.float64)
    for row, i in enumerate(indices):
        n = feats[i].shape[0]
        logp = -torch.nn.functional.softplus(feats[i] @ theta)
        values = values.index_put((torch.full((n,), row), torch.arange(n)), logp * (i % 4 - 1.5))
        mask[row, :n] = masks[i]
    return values, mask


def _planned_grad(plan, theta0, feats, masks, mode, step, global_norms=True):
    theta = theta0.clone().requires_grad_(True)
    for rank in step.micro_batches:  # each simulated dp rank; gradients are summed
        for mb in rank:
            values, mask = _values_and_mask(theta, feats, masks, list(mb))
            norms = (
                dict(num_tokens=step.num_tokens, num_seqs=step.num_samples, norm_len=NORM_LEN)
                if global_norms else {"norm_len": NORM_LEN}
            )  # fmt: skip
            aggregate_loss(values, mask, mode, **norms).backward()
    return theta.grad


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gradient_is_independent_of_dp_and_micro_geometry(mode):
    n, gbs = 24, 12
    feats, masks, totals, loss_lengths = _step_data(n, seed=0)
    theta0 = torch.tensor([0.3, -0.7, 1.1], dtype=torch.float64)
    geometries = [
        dict(dp_size=1, max_tokens_per_gpu=10**6),  # one micro-batch per step
        dict(dp_size=1, max_tokens_per_gpu=25),
        dict(dp_size=2, max_tokens_per_gpu=25),
        dict(dp_size=2, max_tokens_per_gpu=1, shuffle_seed=5),  # one sample per row
        dict(dp_size=2, micro_batch_size=4),
        dict(dp_size=3, micro_batch_size=1),
    ]
    # Every step holds samples whose masks have holes (multi-turn environment tokens).
    for start in range(0, n, gbs):
        assert sum(_has_hole(m) for m in masks[start : start + gbs]) >= 2
    for geometry in geometries:
        plan = plan_rollout(totals, loss_lengths, global_batch_size=gbs, **geometry)
        for step in plan.steps:
            theta = theta0.clone().requires_grad_(True)
            values, mask = _values_and_mask(theta, feats, masks, list(step.sample_indices))
            aggregate_loss(values, mask, mode, norm_len=NORM_LEN).backward()
            got = _planned_grad(plan, theta0, feats, masks, mode, step)
            torch.testing.assert_close(got, theta.grad, rtol=1e-12, atol=1e-14)


def test_per_micro_batch_normalizers_would_change_the_gradient():
    # Negative control: the invariance above is not vacuous.
    feats, masks, totals, loss_lengths = _step_data(12, seed=1)
    theta0 = torch.tensor([0.3, -0.7, 1.1], dtype=torch.float64)
    plan = plan_rollout(totals, loss_lengths, global_batch_size=12, dp_size=2, micro_batch_size=2)
    step = plan.steps[0]
    global_grad = _planned_grad(plan, theta0, feats, masks, "token-mean", step)
    local_grad = _planned_grad(plan, theta0, feats, masks, "token-mean", step, global_norms=False)
    assert not torch.allclose(global_grad, local_grad, rtol=1e-3)


def test_schedule_normalizers_count_model_tokens_of_multiturn_samples():
    """``schedule`` plans tool-using samples by their mask-1 tokens: a step's num_tokens is
    the model tokens (environment tokens inside the response are not counted) and its
    num_samples leaves out a sample with no model token at all."""
    masks = [[1, 1, 0, 0, 0, 1], [1, 0, 1, 0, 1, 1, 0], [0, 0, 0], [1, 1, 1, 1]]
    prompts = [3, 2, 4, 1]
    tokens = [list(range(p + len(m))) for p, m in zip(prompts, masks, strict=True)]
    batch = RolloutBatch(tokens, prompts, masks, [0.5, -1.0, 0.3, 1.2])
    for geometry in (dict(micro_batch_size=1), dict(max_tokens_per_gpu=9)):
        (step,) = schedule(batch, global_batch_size=4, dp_size=2, **geometry).plan.steps
        assert step.num_tokens == 3 + 4 + 0 + 4 < sum(len(m) for m in masks)
        assert step.num_samples == 3
        assert step.rank_tokens == tuple(
            sum(len(tokens[i]) for mb in rank for i in mb) for rank in step.micro_batches
        )
