"""The fsdp2 backend on real gloo process groups (CPU, fp32, tiny random Qwen3).

Proves: the sharded model's packed log-probs equal an unsharded model's
per-sample log-probs; the step-0 gradient on two ranks equals a plain fp32
computation of the same loss written here independently (entropy + KL terms,
so it is not zero, and the test fails if it is); dp=1 and dp=2 give the same
weights after two rollouts with KL against a reference that by then differs
from the actor, for token-mean and seq-mean-token-mean; the reference swap
restores the actor bit for bit; a non-finite gradient skips the step, and
``train/grad_norm`` is the mean over the steps taken (absent when none was, never a
0 for the skipped one); save -> new processes -> load -> continue equals the
uninterrupted run bitwise; the HF export loads in transformers with the same
weights and the same logits; a bf16 checkpoint trains in fp32 master weights but
publishes and exports bf16 (buckets, safetensors and config.json).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from actor_harness import VOCAB, actor_args, make_batch, spawn
from tiny_models import save_tiny, tiny_llama_config, tiny_qwen3_config

from vime.data.batch import RolloutBatch, schedule


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3"), tiny_qwen3_config(VOCAB), seed=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    return save_tiny(path, tiny_llama_config(VOCAB, tie=True), seed=1)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen3_bf16")
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(VOCAB), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return str(path)


def _scenario_job(rank: int, world: int, scenario: str, args) -> dict:
    from vime.backends.fsdp2.actor import FSDP2Actor

    actor = FSDP2Actor()
    start = actor.init(args)
    return SCENARIOS[scenario](actor, args, start)


def run(scenario: str, args, world: int, tmp_path: Path):
    return spawn(_scenario_job, world, tmp_path, scenario, args)


def _full_weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in actor.weight_buckets(1 << 30) for n, t in bucket}


def _sched(args, rollout_id: int, dp: int, **kw):
    return schedule(
        make_batch(rollout_id, **kw),
        global_batch_size=args.global_batch_size,
        dp_size=dp,
        micro_batch_size=args.micro_batch_size,
        rollout_id=rollout_id,
    )


def scenario_train(actor, args, start, count: int = 2):
    rollouts = range(start, start + count)
    metrics = [actor.train(_sched(args, rid, actor.world)) for rid in rollouts]
    return {"weights": _full_weights(actor), "metrics": metrics, "start": start}


def scenario_train4(actor, args, start):
    return scenario_train(actor, args, start, count=4)


def scenario_logprobs_and_grad(actor, args, start):
    sched = _sched(args, 0, actor.world)
    before = [p.to_local().clone() for p in actor.params]
    ref = actor.compute_log_probs(sched, "ref")
    restored = all(torch.equal(b, p.to_local()) for b, p in zip(before, actor.params, strict=True))
    own = actor.compute_log_probs(sched, "actor")
    import torch.distributed as dist

    gathered = [None] * actor.world
    dist.all_gather_object(gathered, own)
    from vime.algo.metrics import MetricAccumulator

    # Old log-probs recomputed at the training geometry: the first update's ratio is exactly 1.
    metrics = MetricAccumulator()
    actor.backward_step(sched, 0, metrics, ref=ref, old=own)
    grads = {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
    merged = {k: v for part in gathered for k, v in part.items()}
    names, packed = metrics.to_tensor()
    dist.all_reduce(packed)
    first = MetricAccumulator.from_tensor(names, packed).means()
    return {"logp": merged, "grads": grads, "restored": restored, "first": first}


def scenario_nan(actor, args, start):
    before = _full_weights(actor)
    sched = schedule(
        make_batch(0, nan=True), global_batch_size=8, dp_size=actor.world, micro_batch_size=2
    )
    metrics = actor.train(sched)
    after = _full_weights(actor)
    # Two steps of 4: the NaN sample's step is skipped, the other one is taken.
    results = []
    step = actor._optimizer_step

    def recording(num_samples):
        results.append(step(num_samples))
        return results[-1]

    actor._optimizer_step = recording
    two_steps = schedule(
        make_batch(0, nan=True), global_batch_size=4, dp_size=actor.world, micro_batch_size=2
    )
    mixed = actor.train(two_steps)
    return {"before": before, "after": after, "metrics": metrics, "mixed": mixed, "steps": results}


def scenario_save(actor, args, start):
    result = scenario_train(actor, args, start)
    actor.save(start + 1)
    return result


def scenario_save_unstepped(actor, args, start):
    actor.save(0)
    return {}


def scenario_train_from1(actor, args, start):
    return scenario_train(actor, args, 1)


def _packed_row(args, world):
    """The first micro-batch of rollout 1 as one packed row (several samples)."""
    sched = _sched(args, 1, world)
    indices = next(iter(sched.plan.steps[0].for_rank(0)))
    return sched.batch.pack(indices)


def scenario_export(actor, args, start):
    actor.train(_sched(args, 0, actor.world))
    actor.export_hf(args.save_hf)
    with torch.no_grad():
        logits = actor.model(**_packed_row(args, actor.world).model_inputs()).logits
    return {"weights": _full_weights(actor), "logits": logits}


def scenario_dtypes(actor, args, start):
    actor.train(_sched(args, 0, actor.world))
    actor.export_hf(args.save_hf)
    buckets = {n: t.dtype for bucket in actor.weight_buckets(1 << 16) for n, t in bucket}
    return {"master": {p.dtype for p in actor.params}, "buckets": buckets}


SCENARIOS = {
    f.__name__.removeprefix("scenario_"): f
    for f in (
        scenario_train,
        scenario_train4,
        scenario_logprobs_and_grad,
        scenario_nan,
        scenario_save,
        scenario_save_unstepped,
        scenario_train_from1,
        scenario_export,
        scenario_dtypes,
    )
}


def _reference_loss(model, batch: RolloutBatch, indices, args) -> torch.Tensor:
    """The loss written plainly, per sample, unpacked: GRPO (ratio 1) + k3 KL + entropy."""
    total_tokens = sum(sum(batch.loss_masks[i]) for i in indices)
    loss = torch.zeros(())
    for i in indices:
        ids = torch.tensor([batch.tokens[i]])
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        p = batch.prompt_lengths[i]
        logprobs = torch.log_softmax(logits[p - 1 : -1], dim=-1)
        target = ids[0, p:]
        logp = logprobs.gather(1, target[:, None])[:, 0]
        entropy = -(logprobs.exp() * logprobs).sum(-1)
        ratio = torch.exp(logp - logp.detach())
        pg = -batch.advantages[i] * ratio  # unclipped at ratio 1
        ref_logp = logp.detach()  # reference == initial actor at step 0
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        per_token = pg + args.kl_loss_coef * kl - args.entropy_coef * entropy
        mask = torch.tensor(batch.loss_masks[i], dtype=torch.float32)
        loss = loss + (per_token * mask).sum()
    return loss / total_tokens


@pytest.mark.parametrize("arch", ["qwen3", "llama_tied"])
def test_logprobs_gradient_and_reference_swap(arch, hf_dir, llama_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    hf_dir = hf_dir if arch == "qwen3" else llama_dir
    args = actor_args(hf_dir, 2)
    got = run("logprobs_and_grad", args, 2, tmp_path)
    assert got["restored"], "reference swap did not restore the actor bit for bit"
    assert got["first"]["ppo_kl"] == 0.0 and got["first"]["clipfrac"] == 0.0
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    batch = make_batch(0)
    for i, logp in got["logp"].items():
        ids = torch.tensor([batch.tokens[i]])
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0]
        p = batch.prompt_lengths[i]
        expected = torch.log_softmax(logits[p - 1 : -1], -1).gather(1, ids[0, p:, None])[:, 0]
        mask = torch.tensor(batch.loss_masks[i], dtype=torch.bool)
        torch.testing.assert_close(logp[mask], expected[mask], atol=1e-5, rtol=0)
    assert len(got["logp"]) == len(batch)
    step0 = _sched(args, 0, 2).plan.steps[0].sample_indices
    _reference_loss(model, batch, step0, args).backward()
    ref_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters()))
    assert ref_norm > 1e-3, "reference gradient is zero: the comparison would prove nothing"
    for name, param in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], param.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_dp1_equals_dp2(hf_dir, tmp_path, mode) -> None:
    one = run("train", actor_args(hf_dir, 1, "--loss-agg-mode", mode), 1, tmp_path)
    two = run("train", actor_args(hf_dir, 2, "--loss-agg-mode", mode), 2, tmp_path)
    assert one["metrics"][1]["train/kl_loss"] > 0, "reference never differed from the actor"
    # Same gradient up to fp32 summation order; AdamW divides by sqrt(v), which turns a
    # 1e-7 gradient difference on a tiny-gradient weight into ~1e-6 of a 1e-3 step.
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-4, atol=1e-5)
    for key in ("train/loss", "train/grad_norm", "train/ppo_kl", "train/entropy"):
        assert two["metrics"][1][key] == pytest.approx(one["metrics"][1][key], rel=1e-4, abs=1e-7)
    assert one["metrics"][1]["train/ppo_kl"] != 0.0, "second update should be off-policy"


def test_non_finite_gradient_skips_step(hf_dir, tmp_path) -> None:
    got = run("nan", actor_args(hf_dir, 2), 2, tmp_path)
    assert got["metrics"]["train/skipped_steps"] == 1.0
    assert "train/grad_norm" not in got["metrics"], "no step taken, yet a grad norm was logged"
    for name, w in got["before"].items():
        assert torch.equal(got["after"][name], w), name
    skipped, taken = sorted(got["steps"], key=lambda r: not r.skipped)
    assert skipped.skipped and not taken.skipped and taken.grad_norm > 1e-3
    assert got["mixed"]["train/skipped_steps"] == 1.0
    # The mean over the one step taken, not (taken + 0) / 2.
    assert got["mixed"]["train/grad_norm"] == pytest.approx(taken.grad_norm, rel=1e-12)


def test_resume_equals_uninterrupted(hf_dir, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    common = ("--num-rollout", "4", "--lr-decay-style", "cosine", "--lr-warmup-samples", "8")
    whole = run("train4", actor_args(hf_dir, 2, *common), 2, tmp_path)
    first = run("save", actor_args(hf_dir, 2, *common, "--save", ckpt), 2, tmp_path)
    # New processes: load the checkpoint of rollout 1 and run rollouts 2 and 3.
    resumed = run(
        "train", actor_args(hf_dir, 2, *common, "--load", ckpt, "--save", ckpt), 2, tmp_path
    )
    assert resumed["start"] == 2
    assert first["metrics"] == whole["metrics"][:2]
    assert resumed["metrics"] == whole["metrics"][2:]
    for name, weight in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name


def test_never_stepped_optimizer_round_trips(hf_dir, tmp_path) -> None:
    """A checkpoint taken before any update resumes as if no save had happened
    (DCP would otherwise fabricate an AdamW step and shift its bias correction)."""
    ckpt = str(tmp_path / "ckpt0")
    run("save_unstepped", actor_args(hf_dir, 2, "--save", ckpt), 2, tmp_path)
    resumed = run("train", actor_args(hf_dir, 2, "--load", ckpt), 2, tmp_path)
    fresh = run("train_from1", actor_args(hf_dir, 2), 2, tmp_path)
    assert resumed["start"] == 1
    assert resumed["metrics"] == fresh["metrics"]
    for name, weight in fresh["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name


def test_hf_export_same_logits(hf_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "export")
    got = run("export", actor_args(hf_dir, 2, "--save-hf", out), 2, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), got["weights"][name]), name
    # The reloaded model (transformers' own attention) computes what the trained one did.
    row = _packed_row(actor_args(hf_dir, 2), 2)
    assert len(row.response_lengths) > 1, "one sample per row would not test packing"
    with torch.no_grad():
        logits = model(**row.model_inputs()).logits
    assert float(logits.abs().max()) > 1e-2
    torch.testing.assert_close(logits, got["logits"], atol=1e-5, rtol=1e-5)


def test_bf16_checkpoint_publishes_and_exports_bf16(bf16_dir, tmp_path) -> None:
    import json

    from safetensors.torch import load_file

    out = tmp_path / "export"
    got = run("dtypes", actor_args(bf16_dir, 1, "--save-hf", str(out)), 1, tmp_path)
    assert got["master"] == {torch.float32}, "training master weights must stay fp32"
    assert len(got["buckets"]) > 0 and set(got["buckets"].values()) == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    exported = load_file(out / "model.safetensors")
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
