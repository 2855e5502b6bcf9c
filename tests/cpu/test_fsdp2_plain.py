"""The fsdp2 backend at world size 1: the HF model as it is, no ``fully_shard``, no DTensor.

Proves, on real gloo groups and a tiny random Qwen3: a one-rank rollout of training
(log-probs, reference swap, backward, clipping, AdamW, the weight source) runs no
Python frame of FSDP2 or DTensor, on plain parameters; ``--fsdp-param-dtype
bfloat16`` still computes in bf16 (weights in use, activations) over fp32 master
weights, gradients and moments, near the fp32 gradient, and gradient checkpointing
recomputes each block in bf16 to the same gradient bit for bit; ``--fsdp-cpu-offload``
keeps FSDP2 (its offload is FSDP2's); and a checkpoint saved by the plain model on one
rank loads on two sharded ranks with the same weights and resharded AdamW state.
"""

from __future__ import annotations

import sys

import pytest
import torch
from actor_harness import VOCAB, actor_args, make_schedule, spawn
from tiny_models import save_tiny, tiny_qwen3_config

from vime.config.train_settings import train_settings

# Where FSDP2 and DTensor live in torch (path separators as the frames report them).
FORBIDDEN = ("torch/distributed/fsdp/", "torch/distributed/tensor/")
BF16 = ("--fsdp-param-dtype", "bfloat16")
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)  # fp32 up to summation order, through AdamW


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3"), tiny_qwen3_config(VOCAB), seed=0)


def _actor(args):
    from vime.backends.policy_actor import make_actor

    actor = make_actor("fsdp2")
    return actor, actor.init(train_settings(args))


def _profiled_rollout(actor, args) -> set[str]:
    """The source files of every Python function called by one rollout of ``train`` and a
    read of the weight source."""
    files: set[str] = set()

    def hook(frame, event, _arg) -> None:
        if event == "call":
            files.add(frame.f_code.co_filename.replace("\\", "/"))

    sys.setprofile(hook)
    try:
        actor.train(make_schedule(args, 0, actor.world))
        for _bucket in actor.weight_buckets(1 << 30):
            pass
    finally:
        sys.setprofile(None)
    return files


def _step0(actor, args) -> dict:
    """The step-0 gradient, and what its forward saw: the dtype layer 0's q_proj weight
    had in use and layer 0's output had, and block forwards per block and micro-batch."""
    from vime.algo.metrics import MetricAccumulator

    sched = make_schedule(args, 0, actor.world)
    ref = actor.compute_log_probs(sched, "ref")
    blocks = list(actor.backend.model.model.layers)
    seen: dict = {"calls": 0}

    def count(*_) -> None:
        seen["calls"] += 1

    def in_use(module, _inputs) -> None:
        seen.setdefault("weight", module.weight.dtype)

    def output(_module, _inputs, out) -> None:
        seen.setdefault("activation", (out[0] if isinstance(out, tuple) else out).dtype)

    hooks = [b.register_forward_pre_hook(count) for b in blocks]
    hooks.append(blocks[0].self_attn.q_proj.register_forward_pre_hook(in_use))
    hooks.append(blocks[0].register_forward_hook(output))
    actor.backward_step(sched, 0, MetricAccumulator(), ref=ref)
    for h in hooks:
        h.remove()
    model = actor.backend.model
    micro_batches = len(sched.plan.steps[0].for_rank(actor.dp_rank))
    got = {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "grad_dtypes": {p.grad.dtype for p in actor.backend.params},
        "calls_per_block": seen.pop("calls") / (len(blocks) * micro_batches),
        "seen": seen,
    }
    actor.optimizer.zero_grad(set_to_none=True)
    actor.train(sched)
    got["params"] = {(type(p).__name__, p.dtype) for p in model.parameters()}
    moments = (v for state in actor.optimizer.state.values() for k, v in state.items())
    got["moments"] = {v.dtype for v in moments if v.ndim > 0}
    return got


def job_one_rank(rank: int, world: int, hf: str) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    args = actor_args(hf, world)
    actor, _ = _actor(args)
    model = actor.backend.model
    got = {
        "param_types": {type(p).__name__ for p in model.parameters()},
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "files": _profiled_rollout(actor, args),
        "fp32": _step0(_actor(args)[0], args),
        "bf16": _step0(_actor(actor_args(hf, world, *BF16))[0], args),
    }
    ckpt = actor_args(hf, world, *BF16, "--gradient-checkpointing")
    got["bf16_ckpt"] = _step0(_actor(ckpt)[0], args)
    offload, _ = _actor(actor_args(hf, world, "--fsdp-cpu-offload"))
    got["offload_dtensors"] = all(isinstance(p, DTensor) for p in offload.backend.params)
    return got


@pytest.fixture(scope="module")
def one_rank(hf_dir, tmp_path_factory) -> dict:
    return spawn(job_one_rank, 1, tmp_path_factory.mktemp("one_rank"), hf_dir)


def test_one_rank_step_runs_no_fsdp_or_dtensor_code(one_rank) -> None:
    """Plain parameters, no FSDP2 group, and not one FSDP2 or DTensor frame in a rollout
    of training, while the profile did see the model's and the optimizer's frames."""
    files = one_rank["files"]
    assert any("torch/nn/modules/" in f for f in files) and any("torch/optim/" in f for f in files)
    assert any("modeling_qwen3" in f for f in files)
    hit = sorted(f for f in files if any(place in f for place in FORBIDDEN))
    assert not hit, hit
    assert one_rank["param_types"] == {"Parameter"}
    assert one_rank["fsdp_modules"] == 0


def test_one_rank_bf16_computes_in_bf16_over_fp32_masters(one_rank) -> None:
    """bf16 weights in use and activations, fp32 gradients, parameters and moments after
    the step (the casts are undone), and a gradient a few bf16 roundings from fp32's."""
    fp32, bf16 = one_rank["fp32"], one_rank["bf16"]
    assert fp32["seen"] == {"weight": torch.float32, "activation": torch.float32}
    assert bf16["seen"] == {"weight": torch.bfloat16, "activation": torch.bfloat16}
    assert bf16["grad_dtypes"] == {torch.float32}
    assert bf16["params"] == {("Parameter", torch.float32)}
    assert bf16["moments"] == {torch.float32}
    err = sum(float((bf16["grads"][n] - g).square().sum()) for n, g in fp32["grads"].items())
    norm = sum(float(g.square().sum()) for g in fp32["grads"].values())
    assert norm > 1e-6, "zero gradient: the comparison would prove nothing"
    assert 1e-4 < (err / norm) ** 0.5 < 0.05, (err / norm) ** 0.5


def test_one_rank_checkpointing_recomputes_in_bf16(one_rank) -> None:
    """Every block runs twice (forward, then recomputed in backward), the recomputation
    cast as the forward was: the gradient is the one without checkpointing, bit for bit."""
    plain, ckpt = one_rank["bf16"], one_rank["bf16_ckpt"]
    assert plain["calls_per_block"] == 1 and ckpt["calls_per_block"] == 2
    for name, grad in plain["grads"].items():
        assert torch.equal(ckpt["grads"][name], grad), name


def test_one_rank_cpu_offload_keeps_fsdp2(one_rank) -> None:
    """Host offload is FSDP2's own: asked for at one rank, the parameters are DTensors."""
    assert one_rank["offload_dtensors"]


def _full_weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in actor.weight_buckets(1 << 30) for n, t in bucket}


def job_save(rank: int, world: int, hf: str, ckpt: str) -> dict:
    args = actor_args(hf, world, "--save", ckpt)
    actor, _ = _actor(args)
    actor.train(make_schedule(args, 0, world))
    actor.save(0)
    saved = _full_weights(actor)
    actor.train(make_schedule(args, 1, world))
    return {"saved": saved, "uninterrupted": _full_weights(actor)}


def job_resume(rank: int, world: int, hf: str, ckpt: str) -> dict:
    args = actor_args(hf, world, "--load", ckpt)
    actor, start = _actor(args)
    loaded = _full_weights(actor)
    actor.train(make_schedule(args, start, world))
    return {"start": start, "loaded": loaded, "after": _full_weights(actor)}


def test_checkpoint_of_one_plain_rank_loads_on_two(hf_dir, tmp_path, capfd) -> None:
    """DCP reshards the plain model's weights (exactly) and AdamW state onto 2 FSDP2 ranks."""
    ckpt = str(tmp_path / "ckpt")
    before = spawn(job_save, 1, tmp_path, hf_dir, ckpt)
    got = spawn(job_resume, 2, tmp_path, hf_dir, ckpt)
    assert got["start"] == 1
    for name, weight in before["saved"].items():
        assert torch.equal(got["loaded"][name], weight), name
    # The next update only matches if the AdamW moments were resharded too.
    for name, weight in before["uninterrupted"].items():
        torch.testing.assert_close(got["after"][name], weight, **WEIGHT_TOL, msg=name)
    assert "saved by 1 ranks and is loaded on 2" in capfd.readouterr().out
