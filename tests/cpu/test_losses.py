"""policy_loss, kl_penalty and aggregate_loss: values and gradients equal their definitions.

Proves: PPO clip (asymmetric), dual clip and GSPO per-token losses and
metrics match hand-computed numbers and a brute-force loop over the formulas;
d(loss)/d(logp) matches finite differences (float64 gradcheck) at token and
sequence level, with and without dual clip, and for every KL kind; GSPO's
gradient under seq-mean-token-mean equals autograd of the direct sequence
objective; the first update of a rollout (logp == old_logp) gives ratio
exactly 1, ppo_kl exactly 0, clipfrac 0; garbage (NaN/inf) at masked
positions gives 0 loss and 0 gradient there; aggregate_loss's four modes,
default normalizers and an all-empty batch; bad arguments raise ValueError.
"""

from __future__ import annotations

import math

import pytest
import torch

from vime.algo.aggregation import AGGREGATION_MODES, aggregate_loss
from vime.algo.losses import KL_TYPES, kl_penalty, policy_loss

D = torch.float64
LN = math.log


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


def _random_batch(seed: int, b: int = 4, t: int = 6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=D) * 3
    logp = old + torch.randn(b, t, generator=gen, dtype=D) * 0.4
    adv = torch.randn(b, generator=gen, dtype=D)
    mask = torch.ones(b, t, dtype=D)
    for i in range(b):  # ragged lengths 6, 5, 4, 3; sequence 0 full
        mask[i, t - i :] = 0
    return logp, old, adv, mask


# ---------------------------------------------------------------- brute force


def _clip(r: float, lo: float, hi: float) -> float:
    return min(max(r, 1 - lo), 1 + hi)


def _reference_policy_loss(logp, old, adv, mask, *, lo, hi, c=None, level="token"):
    """The docstring formulas, one token at a time."""
    b, t = logp.shape
    out = torch.zeros(b, t, dtype=D)
    for i in range(b):
        toks = [j for j in range(t) if mask[i, j] > 0]
        if level == "sequence":
            seq = math.exp(sum(logp[i, j].item() - old[i, j].item() for j in toks) / len(toks))
        for j in toks:
            a = adv[i].item() if adv.dim() == 1 else adv[i, j].item()
            r = seq if level == "sequence" else math.exp(logp[i, j].item() - old[i, j].item())
            loss = max(-a * r, -a * _clip(r, lo, hi))
            if c is not None and a < 0:
                loss = min(loss, -a * c)
            out[i, j] = loss
    return out


# ---------------------------------------------------------------- policy_loss values


def test_ppo_clip_hand_computed():
    # ratios 1.5, 0.5, 1.5, 0.5 with A = +1, +1, −1, −1 (ε = 0.2):
    #   max(−1.5, −1.2) = −1.2 (clipped) | max(−0.5, −0.8) = −0.5
    #   max( 1.5,  1.2) =  1.5           | max( 0.5,  0.8) =  0.8 (clipped)
    logp = _t([[LN(1.5), LN(0.5), LN(1.5), LN(0.5)]])
    old = torch.zeros_like(logp)
    adv = _t([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones_like(logp)
    loss, m = policy_loss(logp, old, adv, mask, eps_clip=0.2)
    torch.testing.assert_close(loss, _t([[-1.2, -0.5, 1.5, 0.8]]))
    assert m["clipfrac"].tolist() == [[1.0, 0.0, 0.0, 1.0]]
    torch.testing.assert_close(m["ratio"], _t([[1.5, 0.5, 1.5, 0.5]]))
    torch.testing.assert_close(m["ppo_kl"], -logp)
    assert "dual_clipfrac" not in m


def test_asymmetric_clip_hand_computed():
    # upper bound 1 + 0.28 for A > 0; lower bound 1 − 0.2 for A < 0
    logp = _t([[LN(1.5), LN(0.5)]])
    adv = _t([[1.0, -1.0]])
    loss, _ = policy_loss(
        logp, torch.zeros_like(logp), adv, torch.ones_like(logp), eps_clip=0.2, eps_clip_high=0.28
    )
    torch.testing.assert_close(loss, _t([[-1.28, 0.8]]))


def test_dual_clip_hand_computed():
    # ratio 4, A = −1: PPO gives max(4, 1.2) = 4; the dual cap −A·c = 3 wins.
    # ratio 2, A = −1: 2 < 3, unchanged. ratio 4, A = +1: dual clip never applies.
    logp = _t([[LN(4.0), LN(2.0), LN(4.0)]])
    adv = _t([[-1.0, -1.0, 1.0]])
    loss, m = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp), eps_clip_c=3.0)
    torch.testing.assert_close(loss, _t([[3.0, 2.0, -1.2]]))
    assert m["dual_clipfrac"].tolist() == [[1.0, 0.0, 0.0]]


def test_gspo_hand_computed():
    # seq 0: log-ratios [ln 2, 0] → s = exp(ln2 / 2) = √2 > 1.2, A = +1 → clipped −1.2
    # seq 1: one token, log-ratio ln 0.9 → s = 0.9, A = −1 → max(0.9, 0.9) = 0.9
    logp = _t([[LN(2.0), 0.0], [LN(0.9), 123.0]])
    mask = _t([[1, 1], [1, 0]])
    loss, m = policy_loss(logp, torch.zeros_like(logp), _t([1.0, -1.0]), mask, level="sequence")
    torch.testing.assert_close(loss, _t([[-1.2, -1.2], [0.9, 0.0]]))
    torch.testing.assert_close(m["ratio"], _t([[math.sqrt(2), math.sqrt(2)], [0.9, 0.0]]))
    torch.testing.assert_close(m["ppo_kl"], _t([[-LN(2) / 2, -LN(2) / 2], [-LN(0.9), 0.0]]))
    assert m["clipfrac"].tolist() == [[1.0, 1.0], [0.0, 0.0]]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dual", [None, 2.5])
@pytest.mark.parametrize("adv_per_token", [False, True])
def test_matches_bruteforce_reference(level, dual, adv_per_token):
    logp, old, adv, mask = _random_batch(seed=7)
    logp = old + (logp - old) * 3  # push many ratios past the clip bounds
    if adv_per_token:
        adv = adv[:, None] * torch.linspace(-1, 2, logp.shape[1], dtype=D)
    loss, m = policy_loss(
        logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.3, eps_clip_c=dual, level=level
    )
    ref = _reference_policy_loss(logp, old, adv, mask, lo=0.2, hi=0.3, c=dual, level=level)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    assert 0 < m["clipfrac"].sum() < mask.sum()  # the test exercises both branches
    for v in m.values():
        assert v.shape == logp.shape and not v.requires_grad
        assert torch.all(v[mask == 0] == 0)


# ---------------------------------------------------------------- first update


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_first_update_ratio_exactly_one(level):
    logp, _, adv, mask = _random_batch(seed=11)
    logp = logp.float().requires_grad_()
    old = logp.detach().clone()
    loss, m = policy_loss(logp, old, adv.float(), mask.float(), level=level, eps_clip_c=3.0)
    assert torch.equal(m["ratio"], mask.float())  # exactly 1 on every response token
    assert torch.equal(m["ppo_kl"], torch.zeros_like(old))
    assert torch.equal(m["clipfrac"], torch.zeros_like(old))
    assert torch.equal(m["dual_clipfrac"], torch.zeros_like(old))
    assert torch.equal(loss.detach(), (-adv.float()[:, None] * mask.float()))


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("dual", [None, 2.0])
@pytest.mark.parametrize("adv_per_token", [False, True])
def test_token_level_gradcheck(dual, adv_per_token):
    logp, old, adv, mask = _random_batch(seed=21)
    logp = old + (logp - old) * 3
    if adv_per_token:
        adv = adv[:, None] * torch.linspace(-2, 1, logp.shape[1], dtype=D)

    def f(x):
        return policy_loss(x, old, adv, mask, eps_clip_c=dual, eps_clip_high=0.28)[0]

    x = logp.clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-6)
    # …and through the aggregation the trainer uses
    for mode in AGGREGATION_MODES:
        assert torch.autograd.gradcheck(lambda x, mode=mode: aggregate_loss(f(x), mask, mode), (x,))


@pytest.mark.parametrize("dual", [None, 2.0])
def test_sequence_level_gradcheck(dual):
    logp, old, adv, mask = _random_batch(seed=5)
    adv[1] = -abs(adv[1]) - 0.5
    x = logp.clone().requires_grad_()

    def f(x):
        loss, _ = policy_loss(x, old, adv, mask, level="sequence", eps_clip_c=dual)
        return aggregate_loss(loss, mask, "seq-mean-token-mean")

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [0.3, 3.0])  # mostly unclipped / mostly clipped
def test_gspo_gradient_equals_direct_sequence_objective(scale):
    logp, old, adv, mask = _random_batch(seed=9)
    logp = old + (logp - old) * scale
    x1 = logp.clone().requires_grad_()
    per_tok, _ = policy_loss(x1, old, adv, mask, level="sequence", eps_clip=0.2)
    ours = aggregate_loss(per_tok, mask, "seq-mean-token-mean")
    ours.backward()

    # Direct definition: sᵢ = exp(masked mean of the log-ratio), Lᵢ = max(−A s, −A clip(s)).
    x2 = logp.clone().requires_grad_()
    s = torch.exp(((x2 - old) * mask).sum(1) / mask.sum(1))
    direct = torch.maximum(-adv * s, -adv * s.clamp(0.8, 1.2)).mean()
    direct.backward()

    torch.testing.assert_close(ours, direct, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-12)
    assert x1.grad.abs().sum() > 0


# ---------------------------------------------------------------- masked garbage


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_garbage_at_masked_positions_is_harmless(level):
    logp, old, _, mask = _random_batch(seed=17)
    adv = torch.randn(logp.shape, dtype=D)
    pad = mask == 0
    logp = logp.masked_fill(pad, float("nan"))
    old = old.masked_fill(pad, float("-inf"))
    adv = adv.masked_fill(pad, float("inf"))
    x = logp.clone().requires_grad_()
    loss, m = policy_loss(x, old, adv, mask, level=level, eps_clip_c=3.0)
    assert torch.isfinite(loss).all() and torch.all(loss[pad] == 0)
    for v in m.values():
        assert torch.isfinite(v).all() and torch.all(v[pad] == 0)
    aggregate_loss(loss, mask, "token-mean").backward()
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[pad] == 0)
    assert x.grad[~pad].abs().sum() > 0


def test_huge_log_ratio_stays_finite():
    logp = _t([[500.0, -500.0]]).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros_like(logp), _t([-1.0]), torch.ones_like(logp))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()


# ---------------------------------------------------------------- policy_loss errors


def test_policy_loss_bad_arguments():
    x = torch.zeros(2, 3)
    a = torch.zeros(2)
    with pytest.raises(ValueError, match=r"dual-clip eps_clip_c must be > 1; got 1\.0"):
        policy_loss(x, x, a, x, eps_clip_c=1.0)
    with pytest.raises(ValueError, match=r"unknown policy loss level 'seq'; choose from \("):
        policy_loss(x, x, a, x, level="seq")
    with pytest.raises(ValueError, match=r"advantages must be \[B\] or \[B, T\]"):
        policy_loss(x, x, torch.zeros(3), x)
    with pytest.raises(ValueError, match=r"logp, old_logp and mask must all be \[B, T\]"):
        policy_loss(x, torch.zeros(2, 4), a, x)


# ---------------------------------------------------------------- kl_penalty


def test_kl_hand_computed():
    logp = _t([[0.0, LN(2.0), -1.0]])
    ref = _t([[0.0, 0.0, 0.0]])
    # δ = logp − ref = [0, ln2, −1]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), _t([[0.0, LN(2.0), -1.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), _t([[0.0, LN(2) ** 2 / 2, 0.5]]))
    # k3 = exp(−δ) + δ − 1: [0, 0.5 + ln2 − 1, e − 2]
    k3 = _t([[0.0, LN(2.0) - 0.5, math.e - 2.0]])
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), k3)
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), k3)


def test_kl_matches_bruteforce_and_low_var_clamps():
    logp, ref, _, _ = _random_batch(seed=23)
    logp = ref + (logp - ref) * 20  # some δ beyond where k3 exceeds 10
    out = {k: kl_penalty(logp, ref, k) for k in KL_TYPES}
    for (i, j), lp in zip(
        torch.cartesian_prod(torch.arange(4), torch.arange(6)).tolist(),
        logp.flatten().tolist(),
        strict=True,
    ):
        d = lp - ref[i, j].item()
        k3 = math.exp(-d) + d - 1
        assert out["k1"][i, j].item() == pytest.approx(d, rel=1e-12)
        assert out["k2"][i, j].item() == pytest.approx(0.5 * d * d, rel=1e-12)
        assert out["k3"][i, j].item() == pytest.approx(k3, rel=1e-12)
        assert out["low_var_kl"][i, j].item() == pytest.approx(min(max(k3, -10), 10), rel=1e-12)
    assert (out["k3"] > 10).any() and out["low_var_kl"].max() == 10


@pytest.mark.parametrize("kind", KL_TYPES)
def test_kl_gradcheck(kind):
    logp, ref, _, _ = _random_batch(seed=29)
    x = logp.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, kind), (x,))


@pytest.mark.parametrize("kind", KL_TYPES)
def test_kl_mask_zeroes_garbage(kind):
    logp, ref, _, mask = _random_batch(seed=31)
    pad = mask == 0
    x = logp.masked_fill(pad, float("nan")).requires_grad_()
    kl = kl_penalty(x, ref.masked_fill(pad, float("inf")), kind, mask=mask)
    assert torch.all(kl[pad] == 0) and torch.isfinite(kl).all()
    kl.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[pad] == 0)


def test_kl_unknown_kind_lists_choices():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"unknown KL type 'k4'; choose from \('k1', 'k2', 'k3'"):
        kl_penalty(x, x, "k4")


# ---------------------------------------------------------------- aggregate_loss

# sequence 0: values [1, 2, 3] all valid (n=3); sequence 1: [4, 5, -] (n=2); sequence 2 empty
_V = _t([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0], [7.0, 7.0, 7.0]])
_M = _t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 15 / 5),  # Σ v·m / Σ m
        ("seq-mean-token-mean", (6 / 3 + 9 / 2) / 2),  # empty sequence not counted
        ("seq-mean-token-sum", (6 + 9) / 2),
        ("seq-mean-token-sum-norm", 15 / (2 * 3)),  # num_seqs · T
    ],
)
def test_aggregate_default_normalizers(mode, expected):
    assert aggregate_loss(_V, _M, mode).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 15 / 10),
        ("seq-mean-token-mean", (6 / 3 + 9 / 2) / 4),
        ("seq-mean-token-sum", 15 / 4),
        ("seq-mean-token-sum-norm", 15 / (4 * 8)),
    ],
)
def test_aggregate_explicit_global_normalizers(mode, expected):
    got = aggregate_loss(_V, _M, mode, num_tokens=10, num_seqs=4, norm_len=8)
    assert got.item() == pytest.approx(expected, rel=1e-12)


def test_aggregate_micro_batches_sum_to_whole_batch():
    # With the step's global normalizers, per-micro-batch losses add up exactly.
    for mode in AGGREGATION_MODES:
        whole = aggregate_loss(_V, _M, mode)
        kw = {"num_tokens": 5, "num_seqs": 2, "norm_len": 3}
        parts = sum(aggregate_loss(_V[i : i + 1], _M[i : i + 1], mode, **kw) for i in range(3))
        torch.testing.assert_close(parts, whole)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_all_empty_batch_is_zero_with_grad_path(mode):
    v = torch.randn(2, 3, dtype=D, requires_grad=True)
    out = aggregate_loss(v, torch.zeros(2, 3, dtype=D), mode)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(v.grad, torch.zeros(2, 3, dtype=D))


def test_aggregate_bad_arguments():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'"):
        aggregate_loss(_V, _M, "sum")
    with pytest.raises(ValueError, match=r"values and mask must both be \[B, T\]"):
        aggregate_loss(_V, _M[:, :2])
