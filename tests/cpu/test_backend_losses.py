"""Every loss flag through real optimizer steps of both backends, against its definition.

Proves, on a tiny random Qwen3 (CPU, fp32, gloo), for each loss flag -- the rollout
correction (token / sequence / geometric level, truncate / mask), the asymmetric and the dual clip,
GSPO, each KL estimator, the entropy bonus, a custom loss -- and each of the four
aggregation modes: (a) the fsdp2 and megatron actors, fed the same packed micro-batches
with the same stale π_old and engine log-probs, give the same loss, metrics and gradient
norm, and the same weights after the optimizer step, flag after flag; (b) fsdp2's
gradient equals the gradient of the objective written out here per sample and per token
(unpacked HF forward, no vime code). And for every aggregation mode, DP 1 and DP 2 and
four micro-batch geometries give the same gradient in both backends. With one update
per rollout, π_old taken from the update's own forward equals a recomputed π_old on
samples as stale as an asynchronous run's, in both backends.

Multi-turn (tool-using) samples, whose loss masks have environment tokens inside the
response, get the same checks -- alignment, the definition, DP and geometry -- and:
junk in the engine's log-probs and π_old at those tokens changes nothing, bit for bit,
and the token-mean loss and token metrics are means over the model's tokens only.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from actor_harness import (
    VOCAB,
    full_tensor,
    has_interior_hole,
    make_batch,
    make_multiturn_batch,
    spawn,
)
from tiny_models import save_tiny, tiny_qwen3_config

pytest.importorskip("megatron.core")

from vime.algo.metrics import MetricAccumulator
from vime.config import parse_args
from vime.config.train_settings import loss_settings, train_settings
from vime.data.batch import RolloutBatch, schedule

CUSTOM_LOSS = """
from vime.algo import policy_loss

def scaled_loss(logp, old_logp, advantages, mask, **kw):
    loss, stats = policy_loss(logp, old_logp, advantages, mask, **kw)
    return 0.75 * loss, stats
"""
CUSTOM_SCALE = 0.75

# The flags of each case, on top of BASE. Every case trains one optimizer step.
CASES = {
    "plain": [],
    "tis-token-truncate": ["--use-tis", "--tis-clip", "1.5"],
    "tis-token-mask": ["--use-tis", "--tis-mode", "mask", "--tis-clip", "1.5"],
    "tis-sequence-truncate": ["--use-tis", "--tis-level", "sequence", "--tis-clip", "1.2"],
    "tis-sequence-mask": [
        *("--use-tis", "--tis-level", "sequence", "--tis-mode", "mask"),
        *("--tis-clip", "5", "--tis-clip-low", "0.3"),
    ],
    "tis-geometric-mask": [
        *("--use-tis", "--tis-level", "geometric", "--tis-mode", "mask"),
        *("--tis-clip", "1.6", "--tis-clip-low", "0.8"),
    ],
    "eps-clip-high": ["--eps-clip-high", "0.6"],
    "dual-clip": ["--eps-clip-c", "1.5"],
    "gspo": ["--policy-loss-level", "sequence", "--loss-agg-mode", "seq-mean-token-mean"],
    **{
        f"kl-{kind}": ["--use-kl-loss", "--kl-loss-coef", "0.5", "--kl-loss-type", kind]
        for kind in ("k1", "k2", "k3", "low_var_kl")
    },
    "entropy": ["--entropy-coef", "0.05"],
    "custom": ["--custom-loss-function-path", "CUSTOM"],
    **{
        f"agg-{mode}": ["--loss-agg-mode", mode, "--use-tis", "--entropy-coef", "0.05"]
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    },
    "agg-dr-grpo": ["--loss-agg-mode", "seq-mean-token-sum-norm", "--loss-agg-norm-len", "12"],
}
# Multi-turn (tool-using) samples under every flag that reads the loss mask: the rollout
# correction at both levels and modes, GSPO, each KL estimator, the entropy bonus, the
# dual clip, and the four aggregation modes. "mt-token-mean" is also checked by hand.
MULTITURN_CASES = {
    "mt-token-mean": [
        *("--use-tis", "--tis-clip", "1.5", "--entropy-coef", "0.05"),
        *("--kl-loss-coef", "0.5", "--kl-loss-type", "k1"),
    ],
    "mt-tis-sequence-mask": [
        *("--use-tis", "--tis-level", "sequence", "--tis-mode", "mask"),
        *("--tis-clip", "50", "--tis-clip-low", "0.1", "--entropy-coef", "0.05"),
    ],
    "mt-gspo": [
        *("--policy-loss-level", "sequence", "--loss-agg-mode", "seq-mean-token-mean"),
        *("--use-tis", "--tis-level", "geometric"),
    ],
    "mt-seq-mean-token-mean": [
        *("--loss-agg-mode", "seq-mean-token-mean", "--use-tis", "--tis-mode", "mask"),
        *("--tis-clip", "1.5", "--kl-loss-coef", "0.5", "--kl-loss-type", "low_var_kl"),
    ],
    "mt-seq-mean-token-sum": [
        *("--loss-agg-mode", "seq-mean-token-sum", "--eps-clip-c", "1.5"),
        *("--kl-loss-coef", "0.5", "--kl-loss-type", "k3", "--entropy-coef", "0.05"),
    ],
    "mt-dr-grpo": [
        *("--loss-agg-mode", "seq-mean-token-sum-norm", "--loss-agg-norm-len", "24"),
        *("--use-tis", "--kl-loss-coef", "0.5", "--kl-loss-type", "k2"),
    ],
}
FIELDS = ("tokens", "prompt_lengths", "loss_masks", "advantages")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
GEOMETRIES = ({"micro_batch_size": 1}, {"micro_batch_size": 2}, {"micro_batch_size": 4},
              {"max_tokens_per_gpu": 16})  # fmt: skip
GEOMETRY_BATCHES = ("single", "multiturn")  # make_batch(1); make_multiturn_batch(2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    # pad=0: the batches hold id 0, so HF's padding_idx (and megatron's twin of it) runs.
    config = tiny_qwen3_config(VOCAB, pad=0)
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3_losses"), config, 0)


@pytest.fixture(scope="module")
def custom_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("custom_loss") / "scaled.py"
    path.write_text(CUSTOM_LOSS)
    return f"{path}:scaled_loss"


def _base(hf: str, world: int, backend: str) -> list[str]:
    flags = ["--train-backend", backend, "--hf-checkpoint", hf]
    flags += ["--actor-num-gpus-per-node", str(world), "--rollout-batch-size", "4"]
    flags += ["--n-samples-per-prompt", "2", "--global-batch-size", "8", "--micro-batch-size", "2"]
    # --use-kl-loss at start-up keeps the reference model, which the KL cases need.
    flags += ["--lr", "1e-3", "--weight-decay", "0.1", "--use-kl-loss"]
    return flags


def _stale_batch(current: dict[int, torch.Tensor] | None = None, base: RolloutBatch | None = None):
    """Rollout 1 of the harness (or ``base``) with engine log-probs, and a π_old a few steps
    stale.

    π_old is ``current`` (the actor's log-probs now; default ≈ −ln 64, what the tiny
    random model gives every token) plus noise, and the engine's log-probs are π_old
    plus a per-sequence offset and noise: ratios on both sides of every bound. For a
    ``base`` batch, even samples' engine log-probs are 0 at mask-0 (environment) tokens,
    as an engine reports tokens it did not sample."""
    batch = make_batch(1) if base is None else base
    gen = torch.Generator().manual_seed(11)
    old, rollout = {}, []
    for i, mask in enumerate(batch.loss_masks):
        n = len(mask)
        now = torch.full((n,), -math.log(VOCAB)) if current is None else current[i]
        old[i] = now + 0.5 * torch.randn(n, generator=gen)
        offset = 0.9 * (i % 4 - 1.5) / 1.5  # whole sequences past 1.6 and below 0.8
        values = old[i] + offset + 0.3 * torch.randn(n, generator=gen)
        if base is not None and i % 2 == 0:
            values = torch.where(torch.tensor(mask) > 0, values, 0.0)
        rollout.append(values.tolist())
    stale = RolloutBatch(
        batch.tokens, batch.prompt_lengths, batch.loss_masks, batch.advantages, rollout
    )
    return stale, old


def _flags_of(case: list[str], custom: str) -> list[str]:
    return [custom if flag == "CUSTOM" else flag for flag in case]


def _grads(actor) -> dict[str, torch.Tensor] | None:
    """Full gradients in HF names (fsdp2 only: megatron's are checked through the norm)."""
    if actor.backend.name != "fsdp2":
        return None
    return {n: full_tensor(p.grad).clone() for n, p in actor.backend.model.named_parameters()}


def _full_weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in actor.weight_buckets(1 << 16) for n, t in bucket}


def _clear_grads(actor) -> None:
    for param in actor.trained_params:
        param.grad = None


def _step(actor, sched, step_index: int, old) -> dict:
    """One step's backward on every rank: loss (summed over DP), metrics, norm, grads."""
    import torch.distributed as dist

    ref = actor.compute_log_probs(sched, "ref") if actor.loss_config.use_kl else None
    metrics = MetricAccumulator()
    loss = actor.backward_step(sched, step_index, metrics, ref=ref, old=old).float()
    dist.all_reduce(loss)
    return {
        "loss": float(loss),
        "metrics": metrics.all_reduce().means(),
        "grad_norm": float(actor.backend.grad_norm()),
        "grads": _grads(actor),
    }


def scenario_cases(actor, args, cases: dict, custom: str) -> dict:
    """Each case: swap in its loss settings, one step's backward, the optimizer step. π_old
    is drawn around the actor's log-probs of the moment, so every case is as stale."""
    out = {}
    for name, case in cases.items():
        flags = _base(args.hf_checkpoint, actor.world, actor.backend.name)
        actor.loss_config = loss_settings(parse_args(flags + _flags_of(case, custom)))
        fresh = schedule(
            make_batch(1), global_batch_size=8, dp_size=actor.world, micro_batch_size=2
        )
        batch, old = _stale_batch(actor.compute_log_probs(fresh, "actor"))
        sched = schedule(batch, global_batch_size=8, dp_size=actor.world, micro_batch_size=2)
        before = _full_weights(actor)
        result = _step(actor, sched, 0, old)
        actor._optimizer_step(8)
        out[name] = {**result, "before": before, "after": _full_weights(actor), "old": old}
        out[name]["rollout"] = batch.rollout_log_probs
    return out


def scenario_geometry(actor, args, cases: dict, custom: str) -> dict:
    """Per batch (the harness's, and multi-turn samples whose masks have interior holes),
    aggregation mode and micro-batch geometry, both steps' gradients (no update)."""
    out = {}
    for kind in GEOMETRY_BATCHES:
        batch, old = _stale_batch(base=make_multiturn_batch(2) if kind == "multiturn" else None)
        for mode in AGG_MODES:
            flags = _base(args.hf_checkpoint, actor.world, actor.backend.name)
            flags += ["--loss-agg-mode", mode, "--use-tis", "--entropy-coef", "0.05"]
            actor.loss_config = loss_settings(parse_args(flags))
            for k, geometry in enumerate(GEOMETRIES):
                sched = schedule(batch, global_batch_size=4, dp_size=actor.world, **geometry)
                for step in range(2):
                    out[kind, mode, k, step] = _step(actor, sched, step, old)
                    _clear_grads(actor)
    return out


def scenario_proximal(actor, args, cases: dict, custom: str) -> dict:
    """One update on samples whose engine log-probs are far from the trainer's (as stale
    samples of an asynchronous run are), with the rollout correction on: π_old taken as
    the update's own forward (``old=None``, what ``train`` does with one update per
    rollout) and π_old recomputed by a separate pass first."""
    flags = _base(args.hf_checkpoint, actor.world, actor.backend.name)
    flags += ["--use-tis", "--tis-mode", "truncate", "--max-staleness", "2"]
    actor.loss_config = loss_settings(parse_args(flags))
    batch, _ = _stale_batch()
    sched = schedule(batch, global_batch_size=8, dp_size=actor.world, micro_batch_size=2)
    shortcut = _step(actor, sched, 0, None)
    _clear_grads(actor)
    recomputed = _step(actor, sched, 0, actor.compute_log_probs(sched, "actor"))
    _clear_grads(actor)
    return {"shortcut": shortcut, "recomputed": recomputed}


# Junk for the engine's log-probs and π_old at mask-0 (environment) tokens: a run must
# never read them.
JUNK = (math.nan, math.inf, -math.inf, 1e4, -30.0)


def _junk_at_env_tokens(batch: RolloutBatch, old: dict) -> tuple[RolloutBatch, dict]:
    """``batch`` and ``old`` with every mask-0 position's engine log-prob and π_old junk."""
    rollout, junk_old = [], {}
    for i, mask in enumerate(batch.loss_masks):
        fill = torch.tensor([JUNK[(i + t) % len(JUNK)] for t in range(len(mask))])
        env = torch.tensor(mask) == 0
        rollout.append(torch.where(env, fill, torch.tensor(batch.rollout_log_probs[i])).tolist())
        junk_old[i] = torch.where(env, fill.flip(0), old[i])
    fields = (batch.tokens, batch.prompt_lengths, batch.loss_masks, batch.advantages)
    return RolloutBatch(*fields, rollout), junk_old


def _moved_at_model_tokens(batch: RolloutBatch) -> RolloutBatch:
    """``batch`` with the engine's log-probs at mask-1 (model) tokens moved by 0.25."""
    rollout = [
        [v + 0.25 * m for v, m in zip(values, mask, strict=True)]
        for values, mask in zip(batch.rollout_log_probs, batch.loss_masks, strict=True)
    ]
    fields = (batch.tokens, batch.prompt_lengths, batch.loss_masks, batch.advantages)
    return RolloutBatch(*fields, rollout)


def _local_grads(actor) -> list[torch.Tensor]:
    """This rank's gradient tensors, plain (both backends), in ``trained_params`` order."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in actor.trained_params]
    return [(g.to_local() if isinstance(g, DTensor) else g).detach().clone() for g in grads]


def scenario_multiturn(actor, args, cases: dict, custom: str) -> dict:
    """Per multi-turn case, on tool-using samples (interior mask holes; half of them with
    engine log-probs 0 at environment tokens): one step's backward with junk at every
    mask-0 position of the engine's log-probs and π_old, one with the engine's log-probs
    moved at mask-1 positions (a control), then the step itself and its optimizer step."""
    out = {}
    tool = make_multiturn_batch(2)
    for name, case in MULTITURN_CASES.items():
        flags = _base(args.hf_checkpoint, actor.world, actor.backend.name)
        actor.loss_config = loss_settings(parse_args(flags + case))

        def plan(batch):
            return schedule(batch, global_batch_size=8, dp_size=actor.world, micro_batch_size=2)

        batch, old = _stale_batch(actor.compute_log_probs(plan(tool), "actor"), base=tool)
        junk_batch, junk_old = _junk_at_env_tokens(batch, old)
        junk = _step(actor, plan(junk_batch), 0, junk_old)
        junk["local_grads"] = _local_grads(actor)
        _clear_grads(actor)
        moved = _step(actor, plan(_moved_at_model_tokens(batch)), 0, old)
        _clear_grads(actor)
        before = _full_weights(actor)
        result = _step(actor, plan(batch), 0, old)
        result["local_grads"] = _local_grads(actor)
        actor._optimizer_step(8)
        out[name] = {**result, "junk": junk, "moved": moved, "before": before}
        out[name].update(after=_full_weights(actor), old=old, rollout=batch.rollout_log_probs)
    return out


SCENARIOS = {
    "cases": scenario_cases,
    "geometry": scenario_geometry,
    "proximal": scenario_proximal,
    "multiturn": scenario_multiturn,
}


def _job(rank: int, world: int, backend: str, scenario: str, args, cases, custom) -> dict:
    if backend == "megatron":
        from vime.backends.policy_actor import make_actor

        actor = make_actor("megatron")
    else:
        from vime.backends.policy_actor import make_actor

        actor = make_actor("fsdp2")
    actor.init(train_settings(args))
    rows = record_rows(actor.backend)
    return {**SCENARIOS[scenario](actor, args, cases, custom), "rows": rows}


def record_rows(backend) -> list[tuple[int, int]]:
    """From now on, each row ``backend`` forwards as (its length, the length of the same
    micro-batch packed unshared), in the list returned."""
    real, rows = backend._pack, []

    def pack(batch, indices):
        packed = real(batch, indices)
        rows.append((packed.row_length, batch.pack(indices).row_length))
        return packed

    backend._pack = pack
    return rows


_RUNS: dict[tuple, dict] = {}


def _run(hf: str, backend: str, scenario: str, world: int, custom: str, tmp_path: Path) -> dict:
    key = (hf, backend, scenario, world)
    if key not in _RUNS:
        args = parse_args(_base(hf, world, backend))
        _RUNS[key] = spawn(_job, world, tmp_path, backend, scenario, args, CASES, custom)
    return _RUNS[key]


# ----- the objective, written out per sample and per token ---------------------------------


def _reference_loss(model, ref_model, batch: RolloutBatch, old, flags) -> torch.Tensor:
    """The step's loss from its definition (docs/architecture.md and the vime.algo docstrings), one
    unpacked sample at a time; ``flags`` is the case's parsed configuration."""
    eps_lo = flags.eps_clip
    eps_hi = flags.eps_clip if flags.eps_clip_high is None else flags.eps_clip_high
    scale = CUSTOM_SCALE if flags.custom_loss_function_path else 1.0
    masks = [torch.tensor(m, dtype=torch.float32) for m in batch.loss_masks]
    num_tokens = sum(float(m.sum()) for m in masks)
    num_seqs = sum(1 for m in masks if m.sum() > 0)
    total = torch.zeros(())
    for i in range(len(batch)):
        ids = torch.tensor([batch.tokens[i]])
        p = batch.prompt_lengths[i]
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, p - 1 : -1].float(), -1)
        logp = logprobs.gather(1, ids[0, p:, None])[:, 0]
        entropy = -(logprobs.exp() * logprobs).sum(-1)
        with torch.no_grad():
            ref_all = torch.log_softmax(ref_model(input_ids=ids).logits[0, p - 1 : -1], -1)
            ref = ref_all.gather(1, ids[0, p:, None])[:, 0]
        m, a = masks[i], batch.advantages[i]
        if m.sum() == 0:
            continue
        tokens = [t for t in range(len(m)) if m[t] > 0]
        rollout = torch.tensor(batch.rollout_log_probs[i])
        # Rollout correction weight per token (detached numbers).
        w = [1.0] * len(m)
        if flags.use_tis:
            deltas = [float(old[i][t] - rollout[t]) for t in range(len(m))]
            product = math.prod(math.exp(deltas[t]) for t in tokens)
            per_sequence = {"sequence": product, "geometric": product ** (1 / len(tokens))}
            low = 1 / flags.tis_clip if flags.tis_clip_low is None else flags.tis_clip_low
            for t in tokens:
                rho = per_sequence.get(flags.tis_level, math.exp(deltas[t]))
                if flags.tis_mode == "truncate":
                    w[t] = min(rho, flags.tis_clip)
                else:
                    w[t] = rho if low <= rho <= flags.tis_clip else 0.0
        per_token = []
        if flags.policy_loss_level == "sequence":  # GSPO's sequence objective, spread evenly
            s = torch.exp(sum(logp[t] - old[i][t] for t in tokens) / len(tokens))
            seq_loss = torch.maximum(-a * s, -a * s.clamp(1 - eps_lo, 1 + eps_hi))
            pg = {t: seq_loss for t in tokens}
        else:
            pg = {}
            for t in tokens:
                r = torch.exp(logp[t] - old[i][t])
                pg[t] = torch.maximum(-a * r, -a * r.clamp(1 - eps_lo, 1 + eps_hi))
                if flags.eps_clip_c is not None and a < 0:
                    pg[t] = torch.minimum(pg[t], torch.tensor(-a * flags.eps_clip_c))
        for t in tokens:
            value = scale * w[t] * pg[t] - flags.entropy_coef * entropy[t]
            if flags.kl_loss_coef > 0:
                d = logp[t] - ref[t]
                k3 = torch.exp(-d) + d - 1
                kl = {"k1": d, "k2": 0.5 * d * d, "k3": k3, "low_var_kl": k3.clamp(-10, 10)}
                value = value + flags.kl_loss_coef * kl[flags.kl_loss_type]
            per_token.append(value)
        sample_sum = sum(per_token)
        mode = flags.loss_agg_mode
        if mode == "token-mean":
            total = total + sample_sum / num_tokens
        elif mode == "seq-mean-token-mean":
            total = total + sample_sum / len(tokens) / num_seqs
        elif mode == "seq-mean-token-sum":
            total = total + sample_sum / num_seqs
        else:
            norm_len = flags.loss_agg_norm_len or flags.rollout_max_response_len
            total = total + sample_sum / (num_seqs * norm_len)
    return total


def _reference_grads(hf: str, weights: dict, batch, old, flags) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.load_state_dict(weights, strict=True)
    _reference_loss(model, ref_model, batch, old, flags).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _assert_same_step(mega: dict, fsdp: dict, case: str) -> None:
    assert mega["loss"] == pytest.approx(fsdp["loss"], rel=1e-5, abs=1e-7), case
    assert mega["grad_norm"] == pytest.approx(fsdp["grad_norm"], rel=1e-5), case
    assert sorted(mega["metrics"]) == sorted(fsdp["metrics"]), case
    for key, value in fsdp["metrics"].items():
        assert mega["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (case, key)


@pytest.mark.slow
def test_each_loss_flag_aligned_and_equal_to_its_definition(hf_dir, custom_path, tmp_path):
    fsdp = _run(hf_dir, "fsdp2", "cases", 1, custom_path, tmp_path)
    mega = _run(hf_dir, "megatron", "cases", 1, custom_path, tmp_path)
    for case, flags in CASES.items():
        old = fsdp[case]["old"]
        tokens = make_batch(1)  # with the engine's log-probs fsdp2 trained on
        batch = RolloutBatch(*(getattr(tokens, f) for f in FIELDS), fsdp[case]["rollout"])
        _assert_same_step(mega[case], fsdp[case], case)
        # The same weights after each optimizer step (tolerance of the alignment test).
        for name, weight in fsdp[case]["after"].items():
            diff = (mega[case]["after"][name] - weight).abs()
            assert diff.max() <= 5e-5, (case, name, float(diff.max()))
        # fsdp2's gradient is the gradient of the objective as defined.
        base = _base(hf_dir, 1, "fsdp2")
        parsed = parse_args(base + _flags_of(flags, custom_path))
        expected = _reference_grads(hf_dir, fsdp[case]["before"], batch, old, parsed)
        for name, grad in expected.items():
            torch.testing.assert_close(fsdp[case]["grads"][name], grad, rtol=1e-4, atol=1e-6)
        if case != "plain":  # at these weights the flag changes the objective's gradient
            plain = _reference_grads(hf_dir, fsdp[case]["before"], batch, old, parse_args(base))
            moved = max(float((expected[n] - g).abs().max()) for n, g in plain.items())
            size = max(float(g.abs().max()) for g in plain.values())
            assert moved > 1e-5, (case, moved, size)
    # The correction and clipping cases really sat on both sides of their bounds.
    for case, key in (
        ("tis-token-truncate", "tis_truncated_frac"),
        ("tis-token-mask", "tis_masked_frac"),
        ("tis-sequence-truncate", "tis_truncated_frac"),
        ("tis-sequence-mask", "tis_masked_frac"),
        ("tis-geometric-mask", "tis_masked_frac"),
        ("eps-clip-high", "clipfrac"),
    ):
        assert 0 < fsdp[case]["metrics"][key] < 1, (case, key, fsdp[case]["metrics"][key])
    assert fsdp["tis-token-truncate"]["metrics"]["tis_ratio_max"] > 1.5


@pytest.mark.slow
def test_every_aggregation_mode_is_free_of_dp_and_micro_batch_geometry(
    hf_dir, custom_path, tmp_path
):
    runs = {
        (backend, world): _run(hf_dir, backend, "geometry", world, custom_path, tmp_path)
        for backend in ("fsdp2", "megatron")
        for world in (1, 2)
    }
    reference = runs["fsdp2", 1]
    for kind, mode, step in itertools.product(GEOMETRY_BATCHES, AGG_MODES, range(2)):
        base = reference[kind, mode, 0, step]
        for (backend, world), run in runs.items():
            for k in range(len(GEOMETRIES)):
                got = run[kind, mode, k, step]
                where = (kind, mode, step, backend, world, GEOMETRIES[k])
                assert got["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-7), where
                assert got["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5), where
                if got["grads"] is not None:
                    for name, grad in base["grads"].items():
                        torch.testing.assert_close(
                            got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=str(where)
                        )
    # The four modes are four different objectives here (the comparison is not vacuous).
    for kind in GEOMETRY_BATCHES:
        assert len({reference[kind, mode, 0, 0]["grad_norm"] for mode in AGG_MODES}) == 4, kind


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_one_update_needs_no_second_pass_for_pi_old_however_stale(
    hf_dir, custom_path, tmp_path, backend
):
    """π_old is the proximal policy, the weights before the update: with one update per
    rollout the update's own forward is on exactly those, so taking its log-probs
    (detached) and recomputing them in a pass of their own give the same loss, metrics
    and gradient, on samples whose engine log-probs are far off and corrected for."""
    run = _run(hf_dir, backend, "proximal", 1, custom_path, tmp_path)
    a, b = run["shortcut"], run["recomputed"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for name in a["metrics"]:
        assert a["metrics"][name] == pytest.approx(b["metrics"][name], rel=1e-5, abs=1e-6), name
    assert a["metrics"]["tis_weight_mean"] != pytest.approx(1.0, abs=1e-3)  # correction on
    if a["grads"] is not None:
        for name, grad in a["grads"].items():
            torch.testing.assert_close(grad, b["grads"][name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_both_backends_forward_each_shared_prompt_once(hf_dir, custom_path, tmp_path, backend):
    """Where a micro-batch holds a group's samples, each backend's row holds their prompt
    once: shorter than the unshared row, and as long as the other backend's."""
    rows = _run(hf_dir, backend, "proximal", 1, custom_path, tmp_path)["rows"]
    assert rows and any(length < unshared for length, unshared in rows), rows
    assert all(length <= unshared for length, unshared in rows), rows
    other = "megatron" if backend == "fsdp2" else "fsdp2"
    assert rows == _run(hf_dir, other, "proximal", 1, custom_path, tmp_path)["rows"]


# ----- multi-turn (tool-using) samples: environment tokens inside the response ------------


def _multiturn_batch(rollout: list[list[float]]) -> RolloutBatch:
    tool = make_multiturn_batch(2)
    return RolloutBatch(*(getattr(tool, f) for f in FIELDS), rollout)


def test_multiturn_samples_aligned_and_equal_to_their_definition(hf_dir, custom_path, tmp_path):
    """On samples whose loss masks have interior holes (environment tokens), under every
    mask-reading flag, fsdp2 and megatron give the same loss, metrics, gradient norm and
    updated weights, and fsdp2's gradient is that of the objective written out by hand."""
    fsdp = _run(hf_dir, "fsdp2", "multiturn", 1, custom_path, tmp_path)
    mega = _run(hf_dir, "megatron", "multiturn", 1, custom_path, tmp_path)
    tool = make_multiturn_batch(2)
    assert sum(has_interior_hole(m) for m in tool.loss_masks) >= len(tool) - 1
    for case, flags in MULTITURN_CASES.items():
        _assert_same_step(mega[case], fsdp[case], case)
        for name, weight in fsdp[case]["after"].items():
            diff = (mega[case]["after"][name] - weight).abs()
            assert diff.max() <= 5e-5, (case, name, float(diff.max()))
        parsed = parse_args(_base(hf_dir, 1, "fsdp2") + flags)
        batch = _multiturn_batch(fsdp[case]["rollout"])
        expected = _reference_grads(hf_dir, fsdp[case]["before"], batch, fsdp[case]["old"], parsed)
        for name, grad in expected.items():
            torch.testing.assert_close(fsdp[case]["grads"][name], grad, rtol=1e-4, atol=1e-6)
    # The corrections sat on both sides of their bounds on these samples too.
    assert fsdp["mt-token-mean"]["metrics"]["tis_ratio_max"] > 1.5
    assert 0 < fsdp["mt-tis-sequence-mask"]["metrics"]["tis_masked_frac"] < 1


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_env_tokens_contribute_nothing(hf_dir, custom_path, tmp_path, backend):
    """Junk (NaN, ±inf, 1e4) in the engine's log-probs and π_old at every mask-0 token
    leaves the loss, every metric and every gradient bit-identical, under every
    multi-turn case; the same log-probs moved at mask-1 tokens do change them."""
    run = _run(hf_dir, backend, "multiturn", 1, custom_path, tmp_path)
    for case in MULTITURN_CASES:
        real, junk, moved = run[case], run[case]["junk"], run[case]["moved"]
        assert junk["loss"] == real["loss"], case
        assert junk["grad_norm"] == real["grad_norm"], case
        assert junk["metrics"] == real["metrics"], case
        assert "train_rollout_logprob_abs_diff" in real["metrics"], case
        assert all(math.isfinite(v) for v in real["metrics"].values()), case
        for a, b in zip(junk["local_grads"], real["local_grads"], strict=True):
            assert torch.equal(a, b), case
        # The control: what sits at model tokens is read.
        diff = "train_rollout_logprob_abs_diff"
        assert moved["metrics"][diff] != pytest.approx(real["metrics"][diff], abs=1e-3), case
        if "--use-tis" in MULTITURN_CASES[case]:
            assert moved["loss"] != pytest.approx(real["loss"], rel=1e-6, abs=1e-9), case


def test_multiturn_metrics_and_normalizers_count_model_tokens_only(hf_dir, custom_path, tmp_path):
    """With environment tokens inside the responses, the token-mean loss and the token
    metrics (entropy, KL, ppo_kl, the rollout correction's ratios, the train-rollout
    log-prob gap) are means over mask-1 tokens, computed here by hand from an HF forward."""
    from transformers import AutoModelForCausalLM

    case = "mt-token-mean"
    got = _run(hf_dir, "fsdp2", "multiturn", 1, custom_path, tmp_path)[case]
    batch, old = _multiturn_batch(got["rollout"]), got["old"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.load_state_dict(got["before"], strict=True)
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    sums: dict[str, float] = {}
    every_token_gap, ratio_max, num_tokens = 0.0, -math.inf, 0
    with torch.no_grad():
        for i in range(len(batch)):
            ids, p = torch.tensor([batch.tokens[i]]), batch.prompt_lengths[i]
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, p - 1 : -1], -1)
            ref_all = torch.log_softmax(ref_model(input_ids=ids).logits[0, p - 1 : -1], -1)
            logp = logprobs.gather(1, ids[0, p:, None])[:, 0]
            ref = ref_all.gather(1, ids[0, p:, None])[:, 0]
            rollout = torch.tensor(batch.rollout_log_probs[i])
            every_token_gap += float((logp - rollout).abs().sum())
            for t, m in enumerate(batch.loss_masks[i]):
                if not m:
                    continue
                num_tokens += 1
                ratio = math.exp(float(old[i][t] - rollout[t]))
                ratio_max = max(ratio_max, ratio)
                terms = {
                    "entropy": float(-(logprobs[t].exp() * logprobs[t]).sum()),
                    "kl_loss": float(logp[t] - ref[t]),  # k1
                    "ppo_kl": float(old[i][t] - logp[t]),
                    "train_rollout_logprob_abs_diff": abs(float(logp[t] - rollout[t])),
                    "tis_ratio_mean": ratio,
                    "tis_weight_mean": min(ratio, 1.5),
                    "tis_truncated_frac": float(ratio > 1.5),
                }
                for name, value in terms.items():
                    sums[name] = sums.get(name, 0.0) + value
    model_tokens = sum(sum(m) for m in batch.loss_masks)
    assert num_tokens == model_tokens < sum(len(m) for m in batch.loss_masks)
    for name, total in sums.items():
        assert got["metrics"][name] == pytest.approx(total / num_tokens, rel=1e-4, abs=1e-5), name
    assert got["metrics"]["tis_ratio_max"] == pytest.approx(ratio_max, rel=1e-4)
    parsed = parse_args(_base(hf_dir, 1, "fsdp2") + MULTITURN_CASES[case])
    want = _reference_loss(model, ref_model, batch, old, parsed)  # Σ over mask-1 / their count
    assert got["loss"] == pytest.approx(float(want.detach()), rel=1e-4, abs=1e-6)
    # Not vacuous: counting environment tokens would move the gap metric well off.
    response_tokens = sum(len(m) for m in batch.loss_masks)
    gap = got["metrics"]["train_rollout_logprob_abs_diff"]
    assert abs(every_token_gap / response_tokens - gap) > 0.1
