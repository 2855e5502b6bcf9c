"""compute_advantages: every estimator equals its definition.

Proves: each estimator against hand-computed numbers and against a brute-force
per-sample loop over the definition; GRPO/Dr.GRPO/RLOO give *exact* zeros for
an all-equal group and for a group of one (never NaN); REINFORCE++-baseline
whitens the whole batch; bad ``n_samples_per_prompt`` and unknown estimators
raise ValueError with a clear message; the result keeps the input dtype. With a
``valid`` mask, left-out samples get 0 and the others get what the definitions
give for groups holding only the valid samples (whitening over valid samples
only); an all-true mask changes nothing, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from vime.algo.advantages import ADVANTAGE_ESTIMATORS, compute_advantages


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _reference(rewards: list[float], n: int, estimator: str, eps: float = 1e-6) -> list[float]:
    """The definitions, one sample at a time with plain Python loops."""
    out: list[float] = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            if len(set(group)) == 1:
                out.append(0.0)
            elif estimator == "grpo":
                out.append((r - _mean(group)) / (_std(group) + eps))
            elif estimator == "rloo":
                out.append(r - _mean(others))
            else:  # dr_grpo, and the first stage of reinforce_plus_plus_baseline
                out.append(r - _mean(group))
    if estimator == "reinforce_plus_plus_baseline":
        if len(set(out)) == 1:
            return [0.0] * len(out)
        m, s = _mean(out), _std(out)
        out = [(x - m) / (s + eps) for x in out]
    return out


def test_grpo_hand_computed():
    # group [1, 0, 0, 1]: mean 0.5, Bessel std sqrt(1/3); group [2, 2, 2, 5]: mean 2.75, std 1.5
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0], dtype=torch.float64)
    adv = compute_advantages(rewards, 4, "grpo", eps=0.0)
    s = math.sqrt(1 / 3)
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, -0.5, -0.5, -0.5, 1.5]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def test_dr_grpo_and_rloo_hand_computed():
    rewards = torch.tensor([1.0, 2.0, 6.0], dtype=torch.float64)
    torch.testing.assert_close(
        compute_advantages(rewards, 3, "dr_grpo"), torch.tensor([-2.0, -1.0, 3.0]).double()
    )
    # rloo: 1 − (2+6)/2 = −3, 2 − (1+6)/2 = −1.5, 6 − (1+2)/2 = 4.5
    torch.testing.assert_close(
        compute_advantages(rewards, 3, "rloo"), torch.tensor([-3.0, -1.5, 4.5]).double()
    )


def test_reinforce_pp_baseline_hand_computed():
    # centered per group of 2: [-1, 1, -2, 2]; mean 0, Bessel std sqrt(10/3)
    rewards = torch.tensor([0.0, 2.0, 1.0, 5.0], dtype=torch.float64)
    adv = compute_advantages(rewards, 2, "reinforce_plus_plus_baseline", eps=0.0)
    s = math.sqrt(10 / 3)
    torch.testing.assert_close(adv, torch.tensor([-1 / s, 1 / s, -2 / s, 2 / s]).double())
    assert abs(adv.mean().item()) < 1e-12
    assert abs(adv.std().item() - 1.0) < 1e-12


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_matches_bruteforce_reference(estimator: str, n: int):
    gen = torch.Generator().manual_seed(1000 + n)
    rewards = torch.randint(0, 4, (4 * n,), generator=gen).double() * 0.5
    rewards[:n] = 0.25  # always one flat group
    adv = compute_advantages(rewards, n, estimator)
    expected = torch.tensor(_reference(rewards.tolist(), n, estimator), dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_all_equal_groups_are_exactly_zero(estimator: str):
    # In float64, 0.1 and 0.7 are inexact: a plain r − mean leaves ±1e-16 here.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], dtype=torch.float64)
    adv = compute_advantages(rewards, 3, estimator)
    assert torch.equal(adv, torch.zeros(6, dtype=torch.float64))


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_group_of_one_is_zero_not_nan(estimator: str):
    adv = compute_advantages(torch.tensor([0.3, 1.0, -2.0]), 1, estimator)
    assert torch.equal(adv, torch.zeros(3))


def test_grpo_flat_group_beside_informative_group():
    adv = compute_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, "grpo")
    assert adv[:2].tolist() == [0.0, 0.0]
    assert adv[2] < 0 < adv[3]


def test_dtype_preserved_and_int_rewards_accepted():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.bfloat16)
    assert compute_advantages(rewards, 2).dtype == torch.bfloat16
    adv = compute_advantages(torch.tensor([0, 1, 1, 1]), 2)
    assert adv.dtype == torch.get_default_dtype()
    assert adv.tolist()[2:] == [0.0, 0.0] and adv[0] < 0 < adv[1]


@pytest.mark.parametrize(
    ("n", "match"),
    [
        (0, "n_samples_per_prompt must be a positive int; got 0"),
        (-2, "n_samples_per_prompt must be a positive int; got -2"),
        (4, r"n_samples_per_prompt=4 does not divide the number of rewards N=6"),
    ],
)
def test_bad_n_raises(n: int, match: str):
    with pytest.raises(ValueError, match=match):
        compute_advantages(torch.zeros(6), n)


def test_unknown_estimator_and_bad_shape_raise():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; choose from \("):
        compute_advantages(torch.zeros(4), 2, "ppo")
    with pytest.raises(ValueError, match=r"rewards must be 1-D \[N\]; got shape \(2, 2\)"):
        compute_advantages(torch.zeros(2, 2), 2)


def _reference_valid(
    rewards: list[float], valid: list[bool], n: int, estimator: str, eps: float = 1e-6
) -> list[float]:
    """The definitions on each group's valid samples alone; 0 for the others."""
    local = "dr_grpo" if estimator == "reinforce_plus_plus_baseline" else estimator
    out = [0.0] * len(rewards)
    for g in range(0, len(rewards), n):
        kept = [i for i in range(g, g + n) if valid[i]]
        values = _reference([rewards[i] for i in kept], len(kept), local, eps) if kept else []
        for i, a in zip(kept, values, strict=True):
            out[i] = a if len(kept) >= 2 else 0.0
    if estimator == "reinforce_plus_plus_baseline":
        xs = [out[i] for i in range(len(out)) if valid[i]]
        if len(set(xs)) <= 1:
            return [0.0] * len(out)
        m, s = _mean(xs), _std(xs)
        out = [(x - m) / (s + eps) if valid[i] else 0.0 for i, x in enumerate(out)]
    return out


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_invalid_samples_leave_their_groups(estimator: str) -> None:
    gen = torch.Generator().manual_seed(0)
    n, groups = 5, 6
    rewards = torch.rand(n * groups, generator=gen, dtype=torch.float64)
    rewards[10:15] = 0.5  # a group whose valid samples agree
    valid = torch.rand(n * groups, generator=gen) > 0.3
    valid[20:25] = torch.tensor([True, False, False, False, False])  # one valid: no signal
    valid[25:30] = True
    got = compute_advantages(rewards, n, estimator, valid=valid)
    want = _reference_valid(rewards.tolist(), valid.tolist(), n, estimator)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert torch.all(got[~valid] == 0.0)
    assert torch.all(got[20:25] == 0.0) or estimator == "reinforce_plus_plus_baseline"
    # Masking is not filling: the scored samples of a group with failures see a smaller group.
    assert not torch.allclose(got, compute_advantages(rewards, n, estimator))


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_all_valid_mask_changes_nothing(estimator: str) -> None:
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    plain = compute_advantages(rewards, 4, estimator)
    masked = compute_advantages(rewards, 4, estimator, valid=torch.ones(12, dtype=torch.bool))
    assert torch.equal(plain, masked)


def test_valid_mask_shape_is_checked() -> None:
    with pytest.raises(ValueError, match="valid must have the shape of rewards"):
        compute_advantages(torch.zeros(8), 4, valid=torch.ones(4, dtype=torch.bool))
