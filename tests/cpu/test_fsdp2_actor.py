"""The fsdp2 backend on real gloo process groups (CPU, fp32, tiny random Qwen3, tied
Llama and Qwen2 with q/k/v biases).

Proves: the sharded model's packed log-probs equal an unsharded model's
per-sample log-probs; the step-0 gradient on two ranks equals a plain fp32
computation of the same loss written here independently (entropy + KL terms,
so it is not zero, and the test fails if it is); biases and 1-D weights sit in
the optimizer's no-decay group, every matrix in the decayed one; dp=1 and dp=2
give the same weights after two rollouts with KL against a reference that by
then differs from the actor, for token-mean and seq-mean-token-mean; once a
rollout has trained the actor away from the reference, the reference swap
computes the initial weights' log-probs and restores the actor's shards bit for
bit; ``train/lr`` is the LR schedule at the samples consumed, for global batch
sizes 4 and 8 alike; the old policy's log-probs are recomputed with two updates
per rollout and skipped with one; a non-finite gradient skips the step, and
``train/grad_norm`` is the mean over the steps taken (absent when none was, never a
0 for the skipped one); save -> new processes -> load -> continue equals the
uninterrupted run bitwise; the HF export loads in transformers with the same
weights and the same logits; a bf16 checkpoint trains in fp32 master weights but
publishes and exports bf16 (buckets, safetensors and config.json); a --save or --load
folder the ranks do not share is refused on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from actor_harness import VOCAB, actor_args, make_batch, make_schedule, spawn
from tiny_models import save_tiny, tiny_llama_config, tiny_qwen2_config, tiny_qwen3_config

from vime.backends.optim import LRSchedule
from vime.config.train_settings import train_settings
from vime.data.batch import RolloutBatch, schedule

# Four rollouts of 8 samples under a warmup + cosine schedule (32 samples in all).
LR_FLAGS = ("--num-rollout", "4", "--lr-decay-style", "cosine", "--lr-warmup-samples", "8")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3"), tiny_qwen3_config(VOCAB), seed=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    return save_tiny(path, tiny_llama_config(VOCAB, tie=True), seed=1)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    """Tiny Qwen2 with non-zero q/k/v biases (HF initialises biases to 0, which would leave
    the bias path of the forward untested)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(VOCAB))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen3_bf16")
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(VOCAB), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return str(path)


def _scenario_job(rank: int, world: int, scenario: str, args) -> dict:
    from vime.backends.policy_actor import make_actor

    actor = make_actor("fsdp2")
    start = actor.init(train_settings(args))
    return SCENARIOS[scenario](actor, args, start)


def run(scenario: str, args, world: int, tmp_path: Path):
    return spawn(_scenario_job, world, tmp_path, scenario, args)


def _full_weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in actor.weight_buckets(1 << 30) for n, t in bucket}


def scenario_train(actor, args, start, count: int = 2):
    rollouts = range(start, start + count)
    metrics = [actor.train(make_schedule(args, rid, actor.world)) for rid in rollouts]
    return {"weights": _full_weights(actor), "metrics": metrics, "start": start}


def scenario_train4(actor, args, start):
    """Four rollouts, recording which log-prob passes ``train`` asks for (a spy that calls
    the real method) and how many forwards the model runs, next to the micro-batches one
    pass over a rollout takes on this rank."""
    passes: list[str] = []
    real = actor.compute_log_probs

    def recording(sched, which, **kw):
        passes.append(which)
        return real(sched, which, **kw)

    actor.compute_log_probs = recording
    forwards = [0]

    def count(*_):
        forwards[0] += 1

    actor.backend.model.register_forward_pre_hook(count)
    result = scenario_train(actor, args, start, count=4)
    micro = [
        sum(len(m) for m in make_schedule(args, rid, actor.world).plan.for_rank(actor.dp_rank))
        for rid in range(start, start + 4)
    ]
    return {**result, "passes": passes, "forwards": forwards[0], "micro_per_pass": micro}


def _decay_groups(actor) -> list[tuple[float, set[str]]]:
    """The optimizer's groups as (weight decay, parameter names)."""
    names = {id(p): n for n, p in actor.backend.model.named_parameters()}
    return [
        (g["weight_decay"], {names[id(p)] for p in g["params"]})
        for g in actor.optimizer.param_groups
    ]


def scenario_logprobs_and_grad(actor, args, start):
    sched = make_schedule(args, 0, actor.world)
    ref = actor.compute_log_probs(sched, "ref")
    own = actor.compute_log_probs(sched, "actor")
    import torch.distributed as dist

    gathered = [None] * actor.world
    dist.all_gather_object(gathered, own)
    from vime.algo.metrics import MetricAccumulator

    # Old log-probs recomputed at the training geometry: the first update's ratio is exactly 1.
    metrics = MetricAccumulator()
    actor.backward_step(sched, 0, metrics, ref=ref, old=own)
    grads = {n: p.grad.full_tensor().clone() for n, p in actor.backend.model.named_parameters()}
    merged = {k: v for part in gathered for k, v in part.items()}
    names, packed = metrics.to_tensor()
    dist.all_reduce(packed)
    first = MetricAccumulator.from_tensor(names, packed).means()
    # The reference swap once the actor has trained away from the reference: swapped out and
    # back, every local shard must hold the trained actor again, bit for bit.
    actor.optimizer.zero_grad(set_to_none=True)
    actor.train(sched)
    before = [p.to_local().clone() for p in actor.backend.params]
    ref_after = actor.compute_log_probs(sched, "ref")
    restored = all(
        torch.equal(b, p.to_local()) for b, p in zip(before, actor.backend.params, strict=True)
    )
    return {
        "logp": merged,
        "grads": grads,
        "first": first,
        "restored": restored,
        "ref": ref,
        "ref_after": ref_after,
        "actor_after": actor.compute_log_probs(sched, "actor"),
        "decay_groups": _decay_groups(actor),
    }


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
    sched = make_schedule(args, 1, world)
    indices = next(iter(sched.plan.steps[0].for_rank(0)))
    return sched.batch.pack(indices)


def scenario_export(actor, args, start):
    actor.train(make_schedule(args, 0, actor.world))
    actor.export_hf(args.save_hf)
    with torch.no_grad():
        logits = actor.backend.model(**_packed_row(args, actor.world).model_inputs()).logits
    return {"weights": _full_weights(actor), "logits": logits}


def scenario_dtypes(actor, args, start):
    actor.train(make_schedule(args, 0, actor.world))
    actor.export_hf(args.save_hf)
    buckets = {n: t.dtype for bucket in actor.weight_buckets(1 << 16) for n, t in bucket}
    return {"master": {p.dtype for p in actor.backend.params}, "buckets": buckets}


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


@pytest.mark.parametrize("arch", ["qwen3", "llama_tied", "qwen2"])
def test_logprobs_gradient_and_reference_swap(arch, hf_dir, llama_dir, qwen2_dir, tmp_path) -> None:
    """Per-sample log-probs, the step-0 gradient, the decay groups and, after a rollout of
    training, the reference swap (restores the actor's shards bit for bit, and computes
    the initial weights' log-probs, not the actor's) for Qwen3, tied Llama and Qwen2."""
    from transformers import AutoModelForCausalLM

    hf_dir = {"qwen3": hf_dir, "llama_tied": llama_dir, "qwen2": qwen2_dir}[arch]
    args = actor_args(hf_dir, 2)
    got = run("logprobs_and_grad", args, 2, tmp_path)
    assert got["first"]["ppo_kl"] == 0.0 and got["first"]["clipfrac"] == 0.0
    _check_reference_swap(got)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    _check_decay_groups(got["decay_groups"], model, args.weight_decay, arch)
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
    step0 = make_schedule(args, 0, 2).plan.steps[0].sample_indices
    _reference_loss(model, batch, step0, args).backward()
    ref_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters()))
    assert ref_norm > 1e-3, "reference gradient is zero: the comparison would prove nothing"
    for name, param in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], param.grad, rtol=1e-4, atol=1e-6)


def _check_reference_swap(got: dict) -> None:
    assert got["restored"], "reference swap did not restore the trained actor bit for bit"
    assert got["ref_after"].keys() == got["ref"].keys() == got["actor_after"].keys()
    for i, ref in got["ref"].items():
        # Still the initial weights, computed the same way: exactly the step-0 numbers.
        assert torch.equal(got["ref_after"][i], ref), i
    moved = max(float((got["actor_after"][i] - r).abs().max()) for i, r in got["ref"].items())
    assert moved > 1e-4, f"the trained actor's log-probs are the reference's (moved {moved})"


def _check_decay_groups(groups, model, weight_decay: float, arch: str) -> None:
    """Biases and 1-D weights in the no-decay group, every matrix decayed (names and shapes
    from the unsharded HF model, since the actor's parameters are DTensor shards)."""
    no_decay = {n for n, p in model.named_parameters() if n.endswith(".bias") or p.ndim <= 1}
    decay = {n for n, _ in model.named_parameters()} - no_decay
    assert dict(groups) == {weight_decay: decay, 0.0: no_decay}
    biases = {n for n in no_decay if n.endswith(".bias")}
    expected = {f"model.layers.{i}.self_attn.{x}_proj.bias" for i in (0, 1) for x in "qkv"}
    assert biases == (expected if arch == "qwen2" else set()), biases


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
    assert math.isnan(got["metrics"]["train/grad_norm"]), (
        "no step taken, yet a grad norm was logged"
    )
    for name, w in got["before"].items():
        assert torch.equal(got["after"][name], w), name
    skipped, taken = sorted(got["steps"], key=lambda r: not r.skipped)
    assert skipped.skipped and not taken.skipped and taken.grad_norm > 1e-3
    assert got["mixed"]["train/skipped_steps"] == 1.0
    # The mean over the one step taken, not (taken + 0) / 2.
    assert got["mixed"]["train/grad_norm"] == pytest.approx(taken.grad_norm, rel=1e-12)


@pytest.fixture(scope="module")
def two_steps_a_rollout(hf_dir, tmp_path_factory) -> dict:
    """Four rollouts on 2 ranks, global batch 4: two optimizer steps per rollout."""
    args = actor_args(hf_dir, 2, *LR_FLAGS)
    return {"args": args, **run("train4", args, 2, tmp_path_factory.mktemp("steps2"))}


@pytest.fixture(scope="module")
def one_step_a_rollout(hf_dir, tmp_path_factory) -> dict:
    """The same 32 samples on 1 rank with global batch 8: one optimizer step per rollout."""
    args = actor_args(hf_dir, 1, *LR_FLAGS, "--global-batch-size", "8")
    return {"args": args, **run("train4", args, 1, tmp_path_factory.mktemp("steps1"))}


def test_lr_follows_the_samples_consumed(two_steps_a_rollout, one_step_a_rollout) -> None:
    """``train/lr`` (a rollout's mean over its steps) is ``LRSchedule`` over the run's
    4 x 8 samples, taken at the samples consumed after each step: at 4 and 8 in rollout 0
    with global batch 4, at 8 with global batch 8. Stepping the schedule by the step count
    (1, 2, ...) instead, or sizing it by another total, gives other numbers in the warmup
    and in the decay."""
    for run_, batch in ((two_steps_a_rollout, 4), (one_step_a_rollout, 8)):
        args = run_["args"]
        sched = LRSchedule(
            lr=args.lr,
            min_lr=args.min_lr,
            decay_style="cosine",
            warmup_samples=8,
            total_samples=4 * 8,
        )
        for rollout, metrics in enumerate(run_["metrics"]):
            ends = range(8 * rollout + batch, 8 * rollout + 8 + 1, batch)
            expected = sum(sched(s) for s in ends) / len(ends)
            assert metrics["train/lr"] == pytest.approx(expected, rel=1e-9), (batch, rollout)
    by_batch = [
        [m["train/lr"] for m in r["metrics"]] for r in (two_steps_a_rollout, one_step_a_rollout)
    ]
    # The schedule moves (warmup, then decay), and the batch size shows in the means.
    assert len(set(by_batch[1])) == 4 and by_batch[0][0] < by_batch[1][0]


def test_pi_old_is_recomputed_only_with_several_steps_a_rollout(
    two_steps_a_rollout, one_step_a_rollout
) -> None:
    """With one update per rollout the old policy is the current one: ``train`` computes
    the reference log-probs but no actor pass, so each rollout runs the model over its
    micro-batches twice (reference, update), and the ratio is exactly 1. With two updates
    it recomputes the actor's log-probs first: three times."""
    for run_, actor_pass in ((one_step_a_rollout, False), (two_steps_a_rollout, True)):
        assert run_["passes"] == (["ref", "actor"] if actor_pass else ["ref"]) * 4
        per_rollout = 3 if actor_pass else 2
        assert run_["forwards"] == per_rollout * sum(run_["micro_per_pass"])
    for metrics in one_step_a_rollout["metrics"]:
        assert metrics["train/ppo_kl"] == 0.0 and metrics["train/clipfrac"] == 0.0


def test_resume_equals_uninterrupted(hf_dir, two_steps_a_rollout, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    whole = two_steps_a_rollout  # the uninterrupted run: rollouts 0 to 3
    first = run("save", actor_args(hf_dir, 2, *LR_FLAGS, "--save", ckpt), 2, tmp_path)
    # New processes: load the checkpoint of rollout 1 and run rollouts 2 and 3.
    resumed = run(
        "train", actor_args(hf_dir, 2, *LR_FLAGS, "--load", ckpt, "--save", ckpt), 2, tmp_path
    )
    assert resumed["start"] == 2
    assert first["metrics"] == whole["metrics"][:2]
    assert resumed["metrics"] == whole["metrics"][2:]
    for name, weight in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name


def _unshared_folders_job(rank: int, world: int, hf: str, tmp: str) -> dict:
    """Each rank given a --save, then a --load, of its own: what node-local folders on
    two nodes look like to the ranks (rank 0's folders hold the checkpoint, rank 1's not)."""
    from vime.backends.policy_actor import make_actor
    from vime.checkpoint import CheckpointError

    errors = {}
    actor = make_actor("fsdp2")
    actor.init(train_settings(actor_args(hf, world, "--save", f"{tmp}/save_rank{rank}")))
    try:
        actor.save(0)
    except CheckpointError as err:
        errors["save"] = str(err)
    shared = dataclasses.replace(actor.settings.checkpoint, save=f"{tmp}/shared")
    actor.settings = dataclasses.replace(actor.settings, checkpoint=shared)
    actor.save(0)  # one folder both ranks see: fine
    load = f"{tmp}/shared" if rank == 0 else f"{tmp}/empty_rank1"
    Path(load).mkdir(exist_ok=True)
    try:
        make_actor("fsdp2").init(train_settings(actor_args(hf, world, "--load", load)))
    except CheckpointError as err:
        errors["load"] = str(err)
    return errors


def test_folders_the_ranks_do_not_share_are_refused_on_every_rank(hf_dir, tmp_path) -> None:
    """A --save or --load on a node-local disk of a multi-node run: the ranks see different
    folders. Every rank raises the same one-line error naming the flag and the fix, instead
    of writing shards into a folder only some see, or of some ranks loading (a collective)
    while the others start afresh, which would hang."""
    errors = spawn(_unshared_folders_job, 2, tmp_path, hf_dir, str(tmp_path))
    assert "--save " in errors["save"] and "rank 1: missing" in errors["save"], errors
    assert "--load " in errors["load"] and "rank 0: 0, rank 1: None" in errors["load"], errors
    for message in errors.values():
        assert "must be a folder every training node shares" in message


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
