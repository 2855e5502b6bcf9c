"""Rollout correction weights equal their definitions, token by token.

Proves: for token, sequence (product) and geometric level, truncate and mask mode,
default and explicit lower bounds, the weights and the truncated / masked flags equal a
brute-force loop over the docstring's formulas (float64); hand-computed cases, where
sequence is the product of the token ratios (verl's, slime's and TRL's "sequence") and
geometric their geometric mean; NaN or inf at padded positions stays out; bad settings
raise one line each.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from vime.algo.correction import RolloutCorrection, correction_weights

D = torch.float64
LN = math.log
# The correction each test varies: settings of the tests' own, not the flags' defaults.
BASE = RolloutCorrection(level="token", mode="truncate", high=2.0, low=None)


def _tis(**changes) -> RolloutCorrection:
    return dataclasses.replace(BASE, **changes)


def _reference(old, roll, mask, correction: RolloutCorrection):
    """The docstring's formulas, one token at a time."""
    b, t = old.shape
    weight = torch.zeros(b, t, dtype=D)
    flag = torch.zeros(b, t, dtype=D)
    low = 1 / correction.high if correction.low is None else correction.low
    for i in range(b):
        toks = [j for j in range(t) if mask[i, j] > 0]
        deltas = {j: old[i, j].item() - roll[i, j].item() for j in toks}
        product = math.prod(math.exp(d) for d in deltas.values())
        geometric = product ** (1 / len(toks)) if toks else 0.0
        for j in toks:
            rho = {"token": math.exp(deltas[j]), "sequence": product, "geometric": geometric}[
                correction.level
            ]
            if correction.mode == "truncate":
                weight[i, j] = min(rho, correction.high)
                flag[i, j] = float(rho > correction.high)
            else:
                keep = low <= rho <= correction.high
                weight[i, j] = rho if keep else 0.0
                flag[i, j] = float(not keep)
    return weight, flag


def _batch(seed: int, b: int = 6, t: int = 7, spread: float = 1.0):
    """``spread`` scales the log-ratios (small for the product, which adds them up)."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=D) * 3
    # Per-row offsets put whole sequences past 2 and below 1/2, the noise single tokens.
    offset = torch.linspace(-1.2, 1.2, b, dtype=D)[:, None]
    roll = old + spread * (offset + torch.randn(b, t, generator=gen, dtype=D) * 0.5)
    mask = torch.ones(b, t, dtype=D)
    for i in range(b):
        mask[i, t - 1 - i :] = 0  # ragged, the last row empty
    return old, roll, mask


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize(("mode", "low"), [("truncate", None), ("mask", None), ("mask", 0.7)])
def test_weights_match_bruteforce(level, mode, low):
    old, roll, mask = _batch(seed=3, spread=0.15 if level == "sequence" else 1.0)
    correction = _tis(level=level, mode=mode, high=1.6, low=low)
    weight, stats = correction_weights(old, roll, mask, correction)
    expected, flag = _reference(old, roll, mask, correction)
    torch.testing.assert_close(weight, expected, rtol=1e-12, atol=1e-12)
    name = "truncated" if mode == "truncate" else "masked"
    assert torch.equal(stats[name], flag)
    # The batch exercises both sides of the bound.
    valid = mask > 0
    assert 0 < flag[valid].sum() < valid.sum()


def test_hand_computed():
    old = torch.zeros(2, 2, dtype=D)
    roll = torch.tensor([[-LN(1.5), -LN(3.0)], [-LN(0.25), 0.0]], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=D)
    token = correction_weights(old, roll, mask, _tis(high=2.0))
    # ratios 1.5, 3 (→ 2), 0.25; the padded token is 0
    torch.testing.assert_close(token[0], torch.tensor([[1.5, 2.0], [0.25, 0.0]], dtype=D))
    assert token[1]["truncated"].tolist() == [[0.0, 1.0], [0.0, 0.0]]
    masked = correction_weights(old, roll, mask, _tis(mode="mask", high=2.0))
    # bounds [0.5, 2]: 1.5 kept, 3 and 0.25 leave
    torch.testing.assert_close(masked[0], torch.tensor([[1.5, 0.0], [0.0, 0.0]], dtype=D))
    assert masked[1]["masked"].tolist() == [[0.0, 1.0], [1.0, 0.0]]
    seq = correction_weights(old, roll, mask, _tis(level="sequence", high=5.0))
    # row 0: 1.5 · 3 = 4.5 on both tokens; row 1: 0.25 on its one token
    torch.testing.assert_close(
        seq[0], torch.tensor([[4.5, 4.5], [0.25, 0.0]], dtype=D), rtol=1e-12, atol=0
    )
    geo = correction_weights(old, roll, mask, _tis(level="geometric", high=5.0))
    # row 0: (1.5 · 3)^(1/2) = √4.5 on both tokens; row 1: 0.25 on its one token
    torch.testing.assert_close(
        geo[0], torch.tensor([[math.sqrt(4.5)] * 2, [0.25, 0.0]], dtype=D), rtol=1e-12, atol=0
    )
    capped = correction_weights(old, roll, mask, _tis(level="sequence", high=2.0))
    # the product 4.5 is truncated for the whole sequence
    torch.testing.assert_close(capped[0], torch.tensor([[2.0, 2.0], [0.25, 0.0]], dtype=D))
    assert capped[1]["truncated"].tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_garbage_at_padded_positions_stays_out():
    old, roll, mask = _batch(seed=5)
    pad = mask == 0
    old = old.masked_fill(pad, float("nan"))
    roll = roll.masked_fill(pad, float("inf"))
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask"):
            weight, stats = correction_weights(old, roll, mask, _tis(level=level, mode=mode))
            assert torch.isfinite(weight).all() and torch.all(weight[pad] == 0)
            for value in stats.values():
                assert torch.isfinite(value).all() and torch.all(value[pad] == 0)


def test_long_sequence_product_stays_finite():
    """A product over many tokens (Σδ = 300 or −300) neither overflows nor underflows to
    NaN: the exponent is clamped, so truncate gives the cap and mask drops the sequence."""
    mask = torch.ones(2, 300, dtype=D)
    old = torch.zeros(2, 300, dtype=D)
    roll = torch.stack([-torch.ones(300, dtype=D), torch.ones(300, dtype=D)])
    weight, stats = correction_weights(old, roll, mask, _tis(level="sequence"))
    assert torch.equal(weight, torch.stack([torch.full((300,), 2.0, dtype=D), stats["ratio"][1]]))
    assert torch.isfinite(stats["ratio"]).all() and float(stats["ratio"][1, 0]) > 0
    masked, _ = correction_weights(old, roll, mask, _tis(level="sequence", mode="mask"))
    assert torch.equal(masked, torch.zeros_like(masked))


def test_weights_are_detached():
    old, roll, mask = _batch(seed=7)
    old = old.clone().requires_grad_()
    weight, _ = correction_weights(old, roll, mask, BASE)
    assert not weight.requires_grad


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="unknown correction level 'seq'"):
        _tis(level="seq")
    with pytest.raises(ValueError, match="unknown correction mode 'clip'"):
        _tis(mode="clip")
    with pytest.raises(ValueError, match="upper bound must be > 0"):
        _tis(high=0.0)
    with pytest.raises(ValueError, match="lower bound applies only to mask mode"):
        _tis(low=0.5)
    with pytest.raises(ValueError, match="need 0 <= low < high"):
        _tis(mode="mask", high=2.0, low=2.0)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"must all be \[B, T\]"):
        correction_weights(x, torch.zeros(2, 4), x, BASE)
