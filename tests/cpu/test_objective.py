"""From flags to the micro-batch loss: every loss flag reaches it, and the loss is its definition.

Proves: each loss flag of the algorithm group changes ``loss_settings`` and the
loss or gradient ``micro_batch_loss`` computes from the same log-probs (a flag parsed but
never reaching the loss fails here), every choice of such a flag gives a loss of its own
(a choice parsed but computed as another fails here), and every algorithm flag is either
such a flag or named as acting elsewhere; the loss with rollout correction, KL and entropy equals a
plain per-token computation, with the correction weighting only the policy term and
its metrics reported; ``--use-tis`` without the engine's log-probs stops with one line;
Dr. GRPO's normalizer is the run's constant, not the step's longest response; with
GSPO, token-level TIS weights each token's gradient by its own weight. An asynchronous
run's loss (``--max-staleness`` >= 1) is decoupled PPO's, behaviour-corrected by default.
A custom loss reaches a process that never loaded its file (a training rank) by its spec,
and one that is NaN on a sequence without loss tokens leaves the loss and gradient finite.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import pickle
import sys

import pytest
import torch

from vime.algo import policy_loss
from vime.algo.aggregation import AGGREGATION_MODES
from vime.algo.correction import RolloutCorrection
from vime.algo.objective import LossConfig, Normalizers, micro_batch_loss
from vime.config import algo_flags, parse_args
from vime.config.train_settings import loss_settings

D = torch.float64
CUSTOM = f"{__file__}:halved_loss"


def halved_loss(logp, old_logp, advantages, mask, **kw):
    """A custom policy loss (``--custom-loss-function-path``): half the built-in."""
    loss, stats = policy_loss(logp, old_logp, advantages, mask, **kw)
    return 0.5 * loss, stats


def sequence_mean_loss(logp, old_logp, advantages, mask, **kw):
    """A custom policy loss giving each token its sequence's mean loss: 0/0, NaN, on a
    sequence with no loss tokens."""
    loss, stats = policy_loss(logp, old_logp, advantages, mask, **kw)
    per_seq = (loss * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
    return per_seq.expand_as(loss), stats


def _batch(seed: int = 0, b: int = 5, t: int = 6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=D) * 2 - 0.1
    logp = old + torch.randn(b, t, generator=gen, dtype=D) * 0.5  # many ratios clipped
    ref = old + torch.randn(b, t, generator=gen, dtype=D) * 0.3
    offset = torch.linspace(-1.0, 1.0, b, dtype=D)[:, None]
    rollout = old + offset + torch.randn(b, t, generator=gen, dtype=D) * 0.4
    adv = torch.tensor([1.3, -0.7, 0.4, -1.9, 0.8], dtype=D)[:b]
    entropy = torch.rand(b, t, generator=gen, dtype=D) * 2
    mask = torch.ones(b, t, dtype=D)
    for i in range(b):
        mask[i, t - 1 - i % 3 :] = 0
    return dict(logp=logp, old=old, ref=ref, rollout=rollout, adv=adv, entropy=entropy, mask=mask)


def _config(*argv: str) -> LossConfig:
    return loss_settings(parse_args(["--prompt-data", "builtin:reverse", *argv]))


def _loss_and_grad(config: LossConfig, data: dict, norm: Normalizers | None = None):
    logp = data["logp"].clone().requires_grad_()
    entropy = data["entropy"].clone().requires_grad_()
    loss, metrics = micro_batch_loss(
        logp,
        data["mask"],
        data["adv"],
        norm or Normalizers(num_tokens=int(data["mask"].sum()), num_samples=len(data["adv"])),
        config,
        old_logp=data["old"],
        ref_logp=data["ref"],
        rollout_logp=data["rollout"],
        entropy=entropy,
    )
    loss.backward()
    entropy_grad = torch.zeros_like(entropy) if entropy.grad is None else entropy.grad
    grad = torch.cat([logp.grad.flatten(), entropy_grad.flatten()])
    return float(loss.detach()), grad, metrics.means()


# What --use-tis alone gives: the flags' defaults, filled in while parsing.
TIS = RolloutCorrection(
    level=algo_flags.DEFAULT_TIS_LEVEL,
    mode=algo_flags.DEFAULT_TIS_MODE,
    high=algo_flags.DEFAULT_TIS_CLIP,
    low=None,
)


def _tis(**changes) -> RolloutCorrection:
    return dataclasses.replace(TIS, **changes)


# Each loss flag with its precondition, and the LossConfig field it must set.
LOSS_FLAGS = {
    "--eps-clip": (["--eps-clip", "0.1"], {"eps_clip": 0.1}),
    "--eps-clip-high": (["--eps-clip-high", "0.5"], {"eps_clip_high": 0.5}),
    "--eps-clip-c": (["--eps-clip-c", "1.5"], {"eps_clip_c": 1.5}),
    "--policy-loss-level": (["--policy-loss-level", "sequence"], {"level": "sequence"}),
    "--use-kl-loss": (["--use-kl-loss", "--kl-loss-coef", "0.5"], {"use_kl": True}),
    "--kl-loss-coef": (["--use-kl-loss", "--kl-loss-coef", "0.25"], {"kl_coef": 0.25}),
    "--kl-loss-type": (
        ["--use-kl-loss", "--kl-loss-coef", "0.5", "--kl-loss-type", "k1"],
        {"kl_type": "k1"},
    ),
    "--entropy-coef": (["--entropy-coef", "0.1"], {"entropy_coef": 0.1}),
    "--loss-agg-mode": (
        ["--loss-agg-mode", "seq-mean-token-sum"],
        {"agg_mode": "seq-mean-token-sum"},
    ),
    "--loss-agg-norm-len": (
        ["--loss-agg-mode", "seq-mean-token-sum-norm", "--loss-agg-norm-len", "3"],
        {"norm_len": 3},
    ),
    "--use-tis": (["--use-tis"], {"correction": TIS}),
    "--no-use-tis": (["--max-staleness", "1", "--no-use-tis"], {"correction": None}),
    "--tis-clip": (["--use-tis", "--tis-clip", "1.2"], {"correction": _tis(high=1.2)}),
    "--tis-level": (
        ["--use-tis", "--tis-level", "sequence"],
        {"correction": _tis(level="sequence")},
    ),
    "--tis-mode": (
        ["--use-tis", "--tis-mode", "mask"],
        {"correction": _tis(mode="mask")},
    ),
    "--tis-clip-low": (
        ["--use-tis", "--tis-mode", "mask", "--tis-clip-low", "0.9"],
        {"correction": _tis(mode="mask", low=0.9)},
    ),
    "--custom-loss-function-path": (["--custom-loss-function-path", CUSTOM], {}),
}
# The other flags of the algorithm group act before the loss: on advantages or batching.
NOT_LOSS_FLAGS = {
    "--advantage-estimator",
    "--custom-advantage-function-path",
    "--global-batch-size",
    "--num-steps-per-rollout",
    "--shuffle-updates",
    "--micro-batch-size",
    "--use-dynamic-batch-size",
    "--max-tokens-per-gpu",
}
# What each flag is compared with: the same preconditions, the flag itself left out.
BASELINES = {
    "--kl-loss-coef": ["--use-kl-loss", "--kl-loss-coef", "0.5"],
    "--kl-loss-type": ["--use-kl-loss", "--kl-loss-coef", "0.5"],
    "--loss-agg-norm-len": ["--loss-agg-mode", "seq-mean-token-sum-norm"],
    "--no-use-tis": ["--max-staleness", "1"],
    "--tis-clip": ["--use-tis"],
    "--tis-level": ["--use-tis"],
    "--tis-mode": ["--use-tis"],
    "--tis-clip-low": ["--use-tis", "--tis-mode", "mask"],
}


def test_every_algorithm_flag_is_accounted_for():
    parser = argparse.ArgumentParser()
    algo_flags.add_algorithm_flags(parser)
    names = {opt for action in parser._actions for opt in action.option_strings if opt != "-h"}
    names -= {"--help"}
    assert names == set(LOSS_FLAGS) | NOT_LOSS_FLAGS


@pytest.mark.parametrize("flag", sorted(LOSS_FLAGS))
def test_each_loss_flag_reaches_the_loss(flag):
    argv, fields = LOSS_FLAGS[flag]
    config = _config(*argv)
    base = _config(*BASELINES.get(flag, []))
    for name, value in fields.items():
        assert getattr(config, name) == value and getattr(base, name) != value, name
    data = _batch()
    loss, grad, _ = _loss_and_grad(config, data)
    base_loss, base_grad, _ = _loss_and_grad(base, data)
    assert abs(loss - base_loss) > 1e-6 or (grad - base_grad).abs().max() > 1e-6, flag


def test_a_custom_loss_is_pickled_as_its_spec():
    """The settings a training rank is sent carry a custom loss loaded from a file as its
    spec, imported again on the other side: the file's module, named by vime, is not one
    that process could import by name."""
    config = _config("--custom-loss-function-path", CUSTOM)
    blob = pickle.dumps(config)
    module = config.policy_loss_fn.__module__
    del sys.modules[module]  # as in a process that never loaded the file
    copy = pickle.loads(blob)
    assert module in sys.modules and copy == config
    assert copy.policy_loss_fn is not config.policy_loss_fn
    assert copy.policy_loss_fn.__qualname__ == "halved_loss"
    data = _batch()
    assert _loss_and_grad(copy, data)[0] == _loss_and_grad(config, data)[0]
    assert pickle.loads(pickle.dumps(_config())).policy_loss_fn is policy_loss


# Each loss flag with choices: the preconditions its choices are compared under.
CHOICE_BASES = {
    "--policy-loss-level": [],
    "--kl-loss-type": ["--use-kl-loss", "--kl-loss-coef", "0.5"],
    "--loss-agg-mode": [],
    "--tis-level": ["--use-tis"],
    "--tis-mode": ["--use-tis"],
}
# Choices that give the same loss on this batch, and why that is right.
SAME_HERE = {
    ("--kl-loss-type", frozenset({"k3", "low_var_kl"})): "low_var_kl is k3 clamped to ±10",
}


def _choices(flag: str) -> tuple[str, ...]:
    parser = argparse.ArgumentParser()
    algo_flags.add_algorithm_flags(parser)
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return tuple(action.choices or ())


def test_every_choice_of_a_loss_flag_gives_its_own_loss():
    with_choices = {flag for flag in LOSS_FLAGS if _choices(flag)}
    assert with_choices == set(CHOICE_BASES)
    data = _batch(seed=1)
    for flag, base in CHOICE_BASES.items():
        results = {
            choice: _loss_and_grad(_config(*base, flag, choice), data) for choice in _choices(flag)
        }
        for a, b in itertools.combinations(results, 2):
            (loss_a, grad_a, _), (loss_b, grad_b, _) = results[a], results[b]
            same = abs(loss_a - loss_b) < 1e-9 and (grad_a - grad_b).abs().max() < 1e-9
            assert same == ((flag, frozenset({a, b})) in SAME_HERE), (flag, a, b)


def test_sequence_and_geometric_tis_levels_are_their_formulas():
    """--tis-level sequence weights every token of sample i by min(Πₜ ρᵢₜ, clip) and
    geometric by min((Πₜ ρᵢₜ)^(1/nᵢ), clip), ρ = exp(old − rollout), written out here."""
    data = _batch(seed=2)
    data["rollout"] = data["old"] + 0.15 * (data["rollout"] - data["old"])  # products near 1
    mask = data["mask"]
    for level in ("sequence", "geometric"):
        config = _config("--use-tis", "--tis-level", level, "--tis-clip", "1.1")
        expected = torch.zeros_like(mask)
        for i in range(mask.shape[0]):
            tokens = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
            rhos = [math.exp(float(data["old"][i, t] - data["rollout"][i, t])) for t in tokens]
            rho = math.prod(rhos) ** (1 / len(rhos) if level == "geometric" else 1)
            for t in tokens:
                expected[i, t] = min(rho, 1.1)
        assert 0 < float((expected == 1.1).sum()) < float(mask.sum())  # both sides of 1.1
        plain = _config()
        _, g_plain, _ = _loss_and_grad(plain, data)
        _, g_tis, metrics = _loss_and_grad(config, data)
        n = data["logp"].numel()
        torch.testing.assert_close(g_tis[:n], expected.flatten() * g_plain[:n])
        assert metrics["tis_weight_mean"] == pytest.approx(float(expected[mask > 0].mean()))


def _plain_loss(data: dict, *, high: float, kl_coef: float, entropy_coef: float, eps=0.2):
    """Token-mean PPO + token-truncated correction + k3 KL − entropy, one token at a time."""
    logp = data["logp"].clone().requires_grad_()
    total = torch.zeros((), dtype=D)
    mask, n = data["mask"], float(data["mask"].sum())
    for i in range(mask.shape[0]):
        a = float(data["adv"][i])
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                continue
            ratio = torch.exp(logp[i, t] - data["old"][i, t])
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps, 1 + eps))
            w = min(math.exp(float(data["old"][i, t] - data["rollout"][i, t])), high)
            d = logp[i, t] - data["ref"][i, t]
            kl = torch.exp(-d) + d - 1
            total = total + w * pg + kl_coef * kl - entropy_coef * data["entropy"][i, t]
    loss = total / n
    loss.backward()
    return float(loss.detach()), logp.grad


def test_loss_with_correction_kl_and_entropy_is_its_definition():
    data = _batch(seed=3)
    config = _config(
        "--use-tis",
        "--tis-clip",
        "1.5",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.2",
        "--kl-loss-type",
        "k3",
        "--entropy-coef",
        "0.05",
    )
    loss, grad, metrics = _loss_and_grad(config, data)
    expected, expected_grad = _plain_loss(data, high=1.5, kl_coef=0.2, entropy_coef=0.05)
    assert loss == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(grad[: data["logp"].numel()].view_as(expected_grad), expected_grad)
    valid = data["mask"] > 0
    ratio = torch.exp(data["old"] - data["rollout"])[valid]
    assert metrics["tis_ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-12)
    assert metrics["tis_ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-12)
    assert metrics["tis_weight_mean"] == pytest.approx(float(ratio.clamp(max=1.5).mean()))
    assert metrics["tis_truncated_frac"] == pytest.approx(float((ratio > 1.5).double().mean()))
    assert 0 < metrics["tis_truncated_frac"] < 1


def test_asynchronous_loss_is_behaviour_corrected_by_default():
    """With --max-staleness >= 1 and no correction flag the loss is AReaL's decoupled PPO:
    each token's clipped term times min(π_prox / π_behav, 2), written out here (π_prox:
    old, π_behav: the engine's log-probs); --no-use-tis keeps the uncorrected loss."""
    data = _batch(seed=6)
    config = _config("--max-staleness", "2")
    assert config.correction == RolloutCorrection(
        level="token", mode="truncate", high=2.0, low=None
    )
    loss, grad, metrics = _loss_and_grad(config, data)
    expected, expected_grad = _plain_loss(data, high=2.0, kl_coef=0.0, entropy_coef=0.0)
    assert loss == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(grad[: data["logp"].numel()].view_as(expected_grad), expected_grad)
    assert 0 < metrics["tis_truncated_frac"] < 1  # the cap is reached on this batch
    uncorrected = _config("--max-staleness", "2", "--no-use-tis")
    assert uncorrected.correction is None
    assert _loss_and_grad(uncorrected, data)[0] != pytest.approx(loss)
    # The synchronous loop keeps its default: no correction unless asked for.
    assert _config().correction is None


def test_mask_mode_reports_the_masked_fraction():
    data = _batch(seed=4)
    _, _, metrics = _loss_and_grad(_config("--use-tis", "--tis-mode", "mask"), data)
    ratio = torch.exp(data["old"] - data["rollout"])[data["mask"] > 0]
    outside = (ratio < 0.5) | (ratio > 2.0)
    assert metrics["tis_masked_frac"] == pytest.approx(float(outside.double().mean()))
    assert 0 < metrics["tis_masked_frac"] < 1 and "tis_truncated_frac" not in metrics


def test_correction_without_engine_log_probs_is_refused():
    data = _batch()
    with pytest.raises(ValueError, match="--use-tis needs the rollout engine's log-probs"):
        micro_batch_loss(
            data["logp"],
            data["mask"],
            data["adv"],
            Normalizers(10, 5),
            _config("--use-tis"),
            old_logp=data["old"],
        )


def test_dr_grpo_normalizer_is_the_runs_constant():
    """Two steps whose longest responses differ (6 and 3 tokens) divide by the same
    number of sequences × the generation budget (--rollout-max-response-len)."""
    config = _config(
        "--loss-agg-mode", "seq-mean-token-sum-norm", "--rollout-max-response-len", "32"
    )
    assert config.norm_len == 32
    for width in (6, 3):
        data = _batch(seed=width, t=width)
        values = torch.ones(5, width, dtype=D)
        loss, _ = micro_batch_loss(
            torch.zeros(5, width, dtype=D),
            data["mask"],
            -torch.ones(5, dtype=D),  # ratio 1, A = −1: each token's loss is exactly 1
            Normalizers(num_tokens=int(data["mask"].sum()), num_samples=5),
            config,
        )
        assert float(loss) == pytest.approx(float((values * data["mask"]).sum()) / (5 * 32))


def test_gspo_with_token_level_tis_weights_each_tokens_gradient() -> None:
    """GSPO with token-level TIS (``vime.algo.objective``): token t's gradient is its own
    weight wₜ times GSPO's uncorrected gradient, not mean(w) times it."""
    from vime.algo.correction import correction_weights

    data = _batch(3)
    gspo = ("--policy-loss-level", "sequence", "--loss-agg-mode", "seq-mean-token-mean")
    plain = _config(*gspo)
    corrected = _config(*gspo, "--use-tis", "--tis-level", "token")
    _, g_plain, _ = _loss_and_grad(plain, data)
    _, g_tis, _ = _loss_and_grad(corrected, data)
    w, _ = correction_weights(data["old"], data["rollout"], data["mask"], corrected.correction)
    n = data["logp"].numel()
    assert torch.allclose(g_tis[:n], w.flatten() * g_plain[:n], rtol=1e-12, atol=1e-15)
    per_sequence = (w * data["mask"]).sum(1, keepdim=True) / data["mask"].sum(1, keepdim=True)
    off = g_plain[:n] * per_sequence.expand_as(w).flatten()
    assert not torch.allclose(g_tis[:n], off)  # the mean-weight reading differs here


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_custom_loss_nan_on_an_empty_sequence_is_not_the_loss(mode: str) -> None:
    """A custom loss that is NaN on a sequence without loss tokens gives the loss and the
    finite gradient of the same batch without that sequence, as the built-in loss does."""
    config = dataclasses.replace(
        _config("--loss-agg-mode", mode), policy_loss_fn=sequence_mean_loss
    )
    data = _batch(seed=3)
    data["mask"][2] = 0
    norm = Normalizers(num_tokens=int(data["mask"].sum()), num_samples=4)
    keep = [0, 1, 3, 4]
    results = []
    for rows in (range(5), keep):
        logp = data["logp"][rows].clone().requires_grad_()
        loss, _ = micro_batch_loss(
            logp, data["mask"][rows], data["adv"][rows], norm, config, old_logp=data["old"][rows]
        )
        loss.backward()
        results.append((loss.detach(), logp.grad))
    (loss, grad), (loss_without, grad_without) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, loss_without)
    torch.testing.assert_close(grad[keep], grad_without)
    assert torch.equal(grad[2], torch.zeros_like(grad[2]))
