"""fsdp2 placement modes, precision, memory sleep and checkpoint robustness on real gloo groups.

Proves, with two CPU processes and a tiny random Qwen3: ``--fsdp-mode hybrid``
(2 replicas of 1 shard), ``no_shard``, ``--gradient-checkpointing``,
``--fsdp-cpu-offload`` (on CPU the same code path, unpinned) and
``--no-fsdp-reshard-after-forward`` give the step-0 gradient and the weights
after a rollout of ``full`` mode, while their parameters really are laid out as
the mode says, checkpointing really recomputes every decoder block in backward,
the last block and the root stay gathered after the forward even when the other
blocks reshard, and without resharding every block stays gathered yet a second
rollout (reference no longer the actor) still trains what ``full`` does; on four
processes, hybrid with shard size 2 splits every tensor within each group,
replicates it across the two, and updates as ``full`` does;
``--fsdp-param-dtype bfloat16`` computes in bf16 (weights in use, activations,
log-probs within bf16 precision of fp32) over fp32 shards, gradients and AdamW
moments, and ``--fsdp-reduce-dtype`` is the dtype the gradients are summed in,
while ``float16`` (no loss scaling in vime) is refused for both at parse time;
``sleep``/``wake_up`` leave a CPU run untouched, and the host stash that sleep
uses on CUDA frees every storage in place and restores it bit for bit; a save
killed between its writes and its commit leaves the previous checkpoint
loadable and the run resumes exactly; a checkpoint saved by 2 ranks loads on 1
rank with the same weights and resharded optimizer state; with several
micro-batches a step, ``hybrid`` and ``no_shard`` all-reduce across replicas once
per FSDP group and step (not once per micro-batch) and still give ``full``'s
gradient and update; ``--load`` of a
checkpoint folder itself or of a folder whose tracker is lost, and a shard
corrupted at its right size, raise a CheckpointError naming the folder, while a
missing or empty ``--load`` (the first run of a resumable job) starts at
rollout 0.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from actor_harness import VOCAB, actor_args, make_batch, spawn
from tiny_models import save_tiny, tiny_qwen3_config
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.multiprocessing.spawn import ProcessException

from vime.config.train_settings import train_settings
from vime.data.batch import schedule

MODES = {
    "full": (),
    "hybrid": ("--fsdp-mode", "hybrid", "--fsdp-shard-size", "1"),
    "no_shard": ("--fsdp-mode", "no_shard"),
    "grad_ckpt": ("--gradient-checkpointing",),
    "cpu_offload": ("--fsdp-cpu-offload",),
    "no_reshard": ("--no-fsdp-reshard-after-forward",),
    "bf16": ("--fsdp-param-dtype", "bfloat16"),
    "bf16_reduce": ("--fsdp-param-dtype", "bfloat16", "--fsdp-reduce-dtype", "bfloat16"),
}
HYBRID4 = ("--fsdp-mode", "hybrid", "--fsdp-shard-size", "2")
# As in the dp=1 vs dp=2 tests: fp32 up to summation order; AdamW's 1/sqrt(v) can turn a
# 1e-7 gradient difference on a tiny-gradient weight into ~1e-6 of a 1e-3 step.
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3"), tiny_qwen3_config(VOCAB), seed=0)


def _actor(args):
    from vime.backends.policy_actor import make_actor

    actor = make_actor("fsdp2")
    start = actor.init(train_settings(args))
    return actor, start


def _sched(rollout_id: int, world: int):
    return schedule(make_batch(rollout_id), global_batch_size=4, dp_size=world, micro_batch_size=2)


def _full_weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in actor.weight_buckets(1 << 30) for n, t in bucket}


def _layout(actor) -> dict[str, dict]:
    """How rank 0 holds each parameter: mesh, placements, local and global shape."""
    out = {}
    for name, p in actor.backend.model.named_parameters():
        out[name] = {
            "mesh": tuple(p.device_mesh.shape),
            "dims": p.device_mesh.mesh_dim_names,
            "placements": tuple(p.placements),
            "local": tuple(p.to_local().shape),
            "global": tuple(p.shape),
            "device": p.to_local().device.type,
        }
    return out


def _step0(actor, sched) -> dict:
    """The step-0 gradient (full tensors), the reference log-probs, and what the forward of
    that step saw: how often decoder blocks started a forward during forward+backward
    (twice per block with recomputation, else once), the dtype layer 0's q_proj weight and
    output had, and whether layer 0, the last layer and the root's final norm were sharded
    again once the whole model's forward ended.

    A pre-hook counts, because checkpoint's recomputation stops as soon as it has rebuilt the
    saved tensors backward needs, so a block's forward post-hook never fires there.
    """
    from vime.algo.metrics import MetricAccumulator

    ref = actor.compute_log_probs(sched, "ref")
    calls = [0]
    seen: dict = {}
    blocks = list(actor.backend.model.model.layers)
    q_proj = blocks[0].self_attn.q_proj

    def count(*_):
        calls[0] += 1

    def first_output(_module, _inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        seen.setdefault("activation", hidden.dtype)

    def weight_in_use(module, _inputs):
        seen.setdefault("unsharded", module.weight.dtype)

    def after_forward(*_):
        seen["resharded"] = isinstance(q_proj.weight, DTensor)
        # Backward starts with the last block and ends in the root: both stay gathered.
        seen["last_resharded"] = isinstance(blocks[-1].self_attn.q_proj.weight, DTensor)
        seen["root_resharded"] = isinstance(actor.backend.model.model.norm.weight, DTensor)

    hooks = [b.register_forward_pre_hook(count) for b in blocks]
    hooks.append(blocks[0].register_forward_hook(first_output))
    hooks.append(q_proj.register_forward_pre_hook(weight_in_use))
    hooks.append(actor.backend.model.register_forward_hook(after_forward))
    actor.backward_step(sched, 0, MetricAccumulator(), ref=ref)
    for h in hooks:
        h.remove()
    grads = {n: p.grad.full_tensor().clone() for n, p in actor.backend.model.named_parameters()}
    seen["grad"] = {p.grad.dtype for p in actor.backend.params}
    actor.optimizer.zero_grad(set_to_none=True)
    micro_batches = len(list(sched.plan.steps[0].for_rank(actor.dp_rank)))
    return {
        "grads": grads,
        "ref_logp": ref,
        "micro_batches": micro_batches,
        "calls_per_block": calls[0] / (len(blocks) * micro_batches),
        "dtypes": seen,
    }


def job_modes(rank: int, world: int, hf: str) -> dict:
    results: dict = {}
    actors = {}
    for mode, extra in MODES.items():
        actor, _ = _actor(actor_args(hf, world, *extra))
        got = _step0(actor, _sched(0, world))
        actor.train(_sched(0, world))
        got.update(
            checkpointing=actor.backend.model.is_gradient_checkpointing,
            layout=_layout(actor),
            weights=_full_weights(actor),
            master=_master_dtypes(actor),
        )
        if mode == "no_reshard":
            # From rollout 1 on the reference differs from the actor: what a forward leaves
            # gathered must not be what the next forward computes with.
            actor.train(_sched(1, world))
            got["weights_after_1"] = _full_weights(actor)
        results[mode] = got
        actors[mode] = actor
    results["sleep"] = _sleep_then_continue(actors["full"], actor_args(hf, world), world)
    return results


@contextlib.contextmanager
def _counting_all_reduces() -> Iterator[list[int]]:
    """The element counts of the ``all_reduce`` calls made inside the block (the real
    collective still runs)."""
    import torch.distributed as dist

    calls: list[int] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = real


def job_replica_sums(rank: int, world: int, hf: str) -> dict:
    """Per mode, at two micro-batches a step: the step-0 gradient and the all-reduces its
    backward ran, the number of FSDP groups, and the weights after a rollout."""
    from torch.distributed.fsdp import FSDPModule

    from vime.algo.metrics import MetricAccumulator

    results = {}
    for mode in ("full", "hybrid", "no_shard"):
        actor, _ = _actor(actor_args(hf, world, *MODES[mode]))
        sched = schedule(make_batch(0), global_batch_size=4, dp_size=world, micro_batch_size=1)
        ref = actor.compute_log_probs(sched, "ref")
        with _counting_all_reduces() as calls:
            actor.backward_step(sched, 0, MetricAccumulator(), ref=ref)
        grads = {n: p.grad.full_tensor().clone() for n, p in actor.backend.model.named_parameters()}
        actor.optimizer.zero_grad(set_to_none=True)
        actor.train(sched)
        results[mode] = {
            "micro_batches": len(sched.plan.steps[0].for_rank(actor.dp_rank)),
            "all_reduces": len(calls),
            "groups": sum(isinstance(m, FSDPModule) for m in actor.backend.model.modules()),
            "grads": grads,
            "weights": _full_weights(actor),
        }
    return results


def _master_dtypes(actor) -> set[torch.dtype]:
    """The dtypes of the sharded parameters and of every AdamW moment (the master state)."""
    dtypes = {p.dtype for p in actor.backend.params} | {
        p.to_local().dtype for p in actor.backend.params
    }
    for state in actor.optimizer.state.values():
        dtypes |= {v.dtype for k, v in state.items() if k != "step"}
    return dtypes


def job_hybrid4(rank: int, world: int, hf: str) -> dict:
    """``--fsdp-mode hybrid --fsdp-shard-size 2`` on 4 ranks: rank 0's step-0 gradient,
    layout and weights after a rollout, and every rank's mesh coordinates and local shards."""
    import torch.distributed as dist

    actor, _ = _actor(actor_args(hf, world, *HYBRID4))
    got = _step0(actor, _sched(0, world))
    actor.train(_sched(0, world))
    got.update(layout=_layout(actor), weights=_full_weights(actor))
    mesh = actor.backend.params[0].device_mesh
    mine = {
        "at": (mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")),
        "locals": {n: p.to_local().clone() for n, p in actor.backend.model.named_parameters()},
    }
    got["ranks"] = [None] * world
    dist.all_gather_object(got["ranks"], mine)
    return got


def _state_tensors(actor) -> list[torch.Tensor]:
    tensors = [p.to_local() for p in actor.backend.params]
    for state in actor.optimizer.state.values():
        tensors += [v.to_local() for k, v in state.items() if k != "step"]
    return tensors


def _sleep_then_continue(actor, args, world: int) -> dict:
    """One more rollout after sleep/wake, and after the same sleep/wake parking host
    tensors as it parks CUDA ones on a GPU (first ``train_state`` alone, as a colocated
    weight sync runs, then everything), against a twin that trained without either."""
    before = [(t.data_ptr(), t.clone()) for t in _state_tensors(actor)]
    weights = _full_weights(actor)
    actor.sleep()
    untouched_asleep = all(
        t.data_ptr() == p for (p, _), t in zip(before, _state_tensors(actor), strict=True)
    )
    actor.wake_up()
    untouched = untouched_asleep and all(
        torch.equal(t, b) for (_, b), t in zip(before, _state_tensors(actor), strict=True)
    )
    parked = [t for keep, scratch in actor._park_plans().values() for t in keep + scratch]
    plain = not any(isinstance(t, DTensor) for t in parked)
    actor._parks_on = lambda device: True  # what sleep does to CUDA tensors, on host ones
    moments = _state_tensors(actor)[len(actor.backend.params) :]
    actor.sleep(["train_state"])
    partial = {
        "moments_freed": all(t.untyped_storage().nbytes() == 0 for t in moments),
        "shards_kept": all(
            p.to_local().untyped_storage().nbytes() > 0 for p in actor.backend.params
        ),
        "weights_readable": all(
            torch.equal(w, weights[n]) for n, w in _full_weights(actor).items()
        ),
    }
    try:
        actor.train(_sched(1, world))
        partial["train_refused"] = ""
    except RuntimeError as err:
        partial["train_refused"] = str(err)
    actor.sleep()
    freed = all(t.untyped_storage().nbytes() == 0 for t in _state_tensors(actor))
    stashed_bytes = sum(stash.nbytes for stash in actor._asleep.values())
    try:
        _full_weights(actor)
        buckets_refused = ""
    except RuntimeError as err:
        buckets_refused = str(err)
    actor.wake_up()
    del actor._parks_on
    restored = all(
        torch.equal(t, b) for (_, b), t in zip(before, _state_tensors(actor), strict=True)
    )
    actor.train(_sched(1, world))
    twin, _ = _actor(args)
    for rollout_id in (0, 1):
        twin.train(_sched(rollout_id, world))
    return {
        "untouched": untouched,
        "plain": plain,
        "partial": partial,
        "freed": freed,
        "buckets_refused": buckets_refused,
        "stashed_bytes": stashed_bytes,
        "restored": restored,
        "weights": _full_weights(actor),
        "twin": _full_weights(twin),
    }


def _sigkill_on_entering(func) -> None:
    """SIGKILL this process the moment ``func`` is called (a profile hook: nothing patched)."""
    code = func.__code__

    def hook(frame, event, arg) -> None:
        if event == "call" and frame.f_code is code:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.setprofile(hook)


def job_save_then_killed(rank: int, world: int, hf: str, ckpt: str, out: str) -> None:
    actor, _ = _actor(actor_args(hf, world, "--save", ckpt))
    actor.train(_sched(0, world))
    actor.save(0)
    saved = _full_weights(actor)
    actor.train(_sched(1, world))
    uninterrupted = _full_weights(actor)
    if rank == 0:
        torch.save({"saved": saved, "uninterrupted": uninterrupted}, out)
        from vime import checkpoint

        # Entering the commit: every rank has written its shards, nothing is renamed yet.
        _sigkill_on_entering(checkpoint.commit_save)
    actor.save(1)
    raise AssertionError("rank 0 should have been killed inside save(1)")


def job_resume(rank: int, world: int, hf: str, load: str) -> dict:
    actor, start = _actor(actor_args(hf, world, "--load", load))
    loaded = _full_weights(actor)
    actor.train(_sched(start, world))
    return {"start": start, "loaded": loaded, "after": _full_weights(actor)}


@pytest.fixture(scope="module")
def modes(hf_dir, tmp_path_factory) -> dict:
    return spawn(job_modes, 2, tmp_path_factory.mktemp("modes"), hf_dir)


@pytest.mark.parametrize("mode", ["hybrid", "no_shard", "grad_ckpt", "cpu_offload", "no_reshard"])
def test_mode_gives_the_full_mode_gradient_and_update(modes, mode) -> None:
    """Same non-zero step-0 gradient and same weights after a rollout as ``full``."""
    full, other = modes["full"], modes[mode]
    assert max(float(g.abs().max()) for g in full["grads"].values()) > 1e-3, "zero gradient"
    for name, grad in full["grads"].items():
        torch.testing.assert_close(other["grads"][name], grad, **GRAD_TOL, msg=name)
    for name, weight in full["weights"].items():
        torch.testing.assert_close(other["weights"][name], weight, **WEIGHT_TOL, msg=name)


def test_parameters_are_laid_out_as_the_mode_says(modes) -> None:
    """full: half of dim 0 per rank; hybrid (shard size 1) and no_shard: a (2, 1) mesh
    replicating whole tensors; cpu offload keeps full's layout (on CPU, unpinned)."""
    for name, full in modes["full"]["layout"].items():
        assert full["mesh"] == (2,) and full["dims"] == ("shard",), name
        assert full["placements"] == (Shard(0),), name
        # Rank 0 holds the first half of dim 0 (rounded up), never the whole tensor.
        assert full["local"][0] == (full["global"][0] + 1) // 2, name
        for mode in ("hybrid", "no_shard"):
            got = modes[mode]["layout"][name]
            assert got["mesh"] == (2, 1) and got["dims"] == ("replicate", "shard"), (mode, name)
            assert got["placements"] == (Replicate(), Shard(0)), (mode, name)
            assert got["local"] == got["global"], (mode, name)  # a whole replica per rank
        assert modes["cpu_offload"]["layout"][name] == full, name


@pytest.fixture(scope="module")
def replica_sums(hf_dir, tmp_path_factory) -> dict:
    return spawn(job_replica_sums, 2, tmp_path_factory.mktemp("replica_sums"), hf_dir)


@pytest.mark.parametrize("mode", ["hybrid", "no_shard"])
def test_replicas_all_reduce_once_per_step(replica_sums, mode) -> None:
    """Two micro-batches a step: one replica all-reduce per FSDP group (the partial sums of
    the first backward wait for the last), ``full`` none, and the gradient and update are
    still ``full``'s."""
    full, other = replica_sums["full"], replica_sums[mode]
    assert other["micro_batches"] == 2
    assert full["all_reduces"] == 0
    assert other["all_reduces"] == other["groups"] > 1
    assert max(float(g.abs().max()) for g in full["grads"].values()) > 1e-3, "zero gradient"
    for name, grad in full["grads"].items():
        torch.testing.assert_close(other["grads"][name], grad, **GRAD_TOL, msg=name)
    for name, weight in full["weights"].items():
        torch.testing.assert_close(other["weights"][name], weight, **WEIGHT_TOL, msg=name)


@pytest.fixture(scope="module")
def hybrid4(hf_dir, tmp_path_factory) -> dict:
    return spawn(job_hybrid4, 4, tmp_path_factory.mktemp("hybrid4"), hf_dir)


def test_hybrid_shards_within_groups_and_replicates_across(modes, hybrid4) -> None:
    """4 ranks as 2 replicas of a 2-way shard: each rank holds half of dim 0, the two ranks
    of a group hold the two halves, the same half is bitwise the same in both replicas, and
    the step-0 gradient and the update equal ``full`` mode's on 2 ranks."""
    assert sorted(r["at"] for r in hybrid4["ranks"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    by_at = {r["at"]: r["locals"] for r in hybrid4["ranks"]}
    for name, got in hybrid4["layout"].items():
        assert got["mesh"] == (2, 2) and got["dims"] == ("replicate", "shard"), name
        assert got["placements"] == (Replicate(), Shard(0)), name
        assert got["local"][0] == (got["global"][0] + 1) // 2 < got["global"][0], name
        for replica in (0, 1):
            halves = [by_at[(replica, shard)][name] for shard in (0, 1)]
            assert torch.equal(torch.cat(halves), hybrid4["weights"][name]), (replica, name)
        for shard in (0, 1):
            assert torch.equal(by_at[(0, shard)][name], by_at[(1, shard)][name]), (shard, name)
    for name, grad in modes["full"]["grads"].items():
        torch.testing.assert_close(hybrid4["grads"][name], grad, **GRAD_TOL, msg=name)
    for name, weight in modes["full"]["weights"].items():
        torch.testing.assert_close(hybrid4["weights"][name], weight, **WEIGHT_TOL, msg=name)


def test_no_reshard_after_forward_keeps_blocks_gathered(modes) -> None:
    """The flag reaches ``fully_shard``: after the forward, layer 0 still holds its gathered
    weights (``full`` has them sharded again, but not the last layer's nor the root's,
    which backward needs first); and the copies a log-prob forward leaves gathered are not
    what trains: two rollouts, the reference differing from the actor in the second, end
    where ``full`` mode does (the gradient check is above)."""
    assert modes["full"]["dtypes"]["resharded"] is True
    assert modes["full"]["dtypes"]["last_resharded"] is False
    assert modes["full"]["dtypes"]["root_resharded"] is False
    assert modes["no_reshard"]["dtypes"]["resharded"] is False
    for name, weight in modes["sleep"]["twin"].items():  # full mode after rollouts 0 and 1
        got = modes["no_reshard"]["weights_after_1"][name]
        torch.testing.assert_close(got, weight, **WEIGHT_TOL, msg=name)


def _bf16_representable(grads: dict[str, torch.Tensor]) -> float:
    """The fraction of gradient elements that a bf16 number holds exactly."""
    exact = sum(int((g.to(torch.bfloat16).float() == g).sum()) for g in grads.values())
    return exact / sum(g.numel() for g in grads.values())


@pytest.mark.parametrize("mode", ["bf16", "bf16_reduce"])
def test_bf16_param_dtype_computes_in_bf16_over_fp32_masters(modes, mode) -> None:
    """``--fsdp-param-dtype bfloat16``: the gathered weights and the activations are bf16,
    while the shards, their gradients and the AdamW moments stay fp32. The log-probs move
    off fp32's by a bf16-sized amount (more than fp32 summation noise, less than bf16's
    spacing of 2**-5 at |log p| ~ 4 for a 64-token vocabulary), and the gradient stays
    fp32's up to a few bf16 roundings (relative precision 2**-8) per layer."""
    full, got = modes["full"], modes[mode]
    assert full["dtypes"]["unsharded"] == full["dtypes"]["activation"] == torch.float32
    assert got["dtypes"]["unsharded"] == got["dtypes"]["activation"] == torch.bfloat16
    assert got["dtypes"]["grad"] == {torch.float32}
    assert got["master"] == {torch.float32}, "a master weight or moment is not fp32"
    diff = max(float((got["ref_logp"][i] - lp).abs().max()) for i, lp in full["ref_logp"].items())
    assert 1e-4 < diff < 2**-5, diff
    assert min(float(lp.min()) for lp in full["ref_logp"].values()) > -8  # |log p| < 8
    err = sum(float((got["grads"][n] - g).square().sum()) for n, g in full["grads"].items())
    norm = sum(float(g.square().sum()) for g in full["grads"].values())
    assert 1e-4 < (err / norm) ** 0.5 < 0.05, (err / norm) ** 0.5


@pytest.mark.parametrize("flag", ["--fsdp-param-dtype", "--fsdp-reduce-dtype"])
def test_float16_is_refused_at_parse_time(flag) -> None:
    """vime has no loss scaler, so fp16 gradients would underflow unnoticed: ``float16``
    fails the parse with one line that says why and names bf16 instead (which parses)."""
    from vime.config import ConfigError, parse_args

    with pytest.raises(ConfigError) as refused:
        parse_args([flag, "float16"])
    message = str(refused.value)
    assert "\n" not in message and flag in message
    assert "loss scaling" in message and f"{flag} bfloat16" in message
    assert getattr(parse_args([flag, "bfloat16"]), flag[2:].replace("-", "_")) == "bfloat16"


def test_reduce_dtype_is_the_dtype_gradients_are_summed_in(modes) -> None:
    """One micro-batch per rank, so each shard's gradient is a single reduce-scatter's sum
    of 2 ranks' bf16 gradients: summed in bf16 (``--fsdp-reduce-dtype bfloat16``) every
    element is a bf16 number; summed in fp32 (the default) many are not."""
    assert modes["bf16"]["micro_batches"] == modes["bf16_reduce"]["micro_batches"] == 1
    assert _bf16_representable(modes["bf16_reduce"]["grads"]) == 1.0
    assert _bf16_representable(modes["bf16"]["grads"]) < 0.9


def test_gradient_checkpointing_recomputes_blocks(modes) -> None:
    """The flag really turns recomputation on (and the gradient is unchanged, above)."""
    assert modes["grad_ckpt"]["checkpointing"] and not modes["full"]["checkpointing"]
    assert modes["full"]["calls_per_block"] == 1
    assert modes["grad_ckpt"]["calls_per_block"] == 2  # forward, then again in backward


def test_sleep_and_wake_are_noops_on_cpu_and_training_continues(modes) -> None:
    """On CPU no storage moves or changes, and the next rollout equals a twin's."""
    got = modes["sleep"]
    assert got["untouched"], "sleep/wake_up changed a parameter or optimizer tensor on CPU"
    for name, weight in got["twin"].items():
        assert torch.equal(got["weights"][name], weight), name


def test_host_stash_frees_in_place_and_restores_bitwise(modes) -> None:
    """sleep and wake_up as they run on CUDA, made to park host tensors: plain tensors
    only (a DTensor's storage is not its own, HostStash could not read it); ``train_state``
    alone frees the AdamW moments, keeps the shards and a readable weight source, and
    training refuses to run; then everything is freed, the weight source refuses, and
    wake_up restores it all bit for bit."""
    got = modes["sleep"]
    assert got["plain"], "sleep would hand HostStash a DTensor"
    partial = got["partial"]
    assert partial["moments_freed"] and partial["shards_kept"], partial
    assert partial["weights_readable"], "the weight source changed with train_state asleep"
    assert "train_state asleep" in partial["train_refused"], partial
    assert "weights asleep" in got["buckets_refused"], got["buckets_refused"]
    assert got["freed"], "a stashed storage still holds memory"
    assert got["stashed_bytes"] > 0
    assert got["restored"], "stash round trip changed a parameter or optimizer tensor"
    for name, weight in got["twin"].items():
        assert torch.equal(got["weights"][name], weight), name


@pytest.fixture(scope="module")
def killed_save(hf_dir, tmp_path_factory) -> tuple[Path, dict]:
    """2 ranks: save rollout 0, train rollout 1, and die entering the commit of save(1)."""
    tmp = tmp_path_factory.mktemp("killed")
    ckpt, out = tmp / "ckpt", tmp / "before_kill.pt"
    # Usually "process 0 terminated with signal SIGKILL"; under load the parent may first see
    # rank 1 fail on its dead peer instead. The folder checks in the tests pin down the rest.
    with pytest.raises(ProcessException):
        spawn(job_save_then_killed, 2, tmp, hf_dir, str(ckpt), str(out))
    return ckpt, torch.load(out, weights_only=False)


def test_killed_save_leaves_previous_checkpoint_loadable(hf_dir, killed_save, tmp_path) -> None:
    """The dead save's shards sit in its partial folder; the tracker still names rollout 0,
    whose weights fresh processes load, and their next rollout equals the killed run's."""
    from vime import checkpoint

    ckpt, before = killed_save
    partial = checkpoint.partial_dir(ckpt, 1)
    assert sorted(p.name for p in partial.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    assert any(partial.glob("*.distcp")), "the kill came before the shards were written"
    assert not checkpoint.iteration_dir(ckpt, 1).exists()
    assert checkpoint.latest(ckpt) == 0
    got = spawn(job_resume, 2, tmp_path, hf_dir, str(ckpt))
    assert got["start"] == 1
    for name, weight in before["saved"].items():
        assert torch.equal(got["loaded"][name], weight), name
    for name, weight in before["uninterrupted"].items():
        assert torch.equal(got["after"][name], weight), name


def test_checkpoint_of_two_ranks_loads_on_one(hf_dir, killed_save, tmp_path, capfd) -> None:
    """DCP reshards weights (exactly) and AdamW state onto 1 rank; RNG re-seeding is said."""
    ckpt, before = killed_save
    got = spawn(job_resume, 1, tmp_path, hf_dir, str(ckpt))
    assert got["start"] == 1
    for name, weight in before["saved"].items():
        assert torch.equal(got["loaded"][name], weight), name
    # The next update only matches if the AdamW moments were resharded too.
    for name, weight in before["uninterrupted"].items():
        torch.testing.assert_close(got["after"][name], weight, **WEIGHT_TOL, msg=name)
    out = capfd.readouterr().out
    assert "saved by 2 ranks and is loaded on 1" in out and "RNG streams re-seeded" in out


def job_load_each(rank: int, world: int, hf: str, loads: list[str]) -> list:
    """``init`` with ``--load L --save L`` for each L: the start rollout, or the error."""
    from vime.checkpoint import CheckpointError

    results = []
    for load in loads:
        try:
            results.append(_actor(actor_args(hf, world, "--load", load, "--save", load))[1])
        except CheckpointError as e:
            results.append(str(e))
    return results


def test_load_refuses_what_is_not_a_resumable_folder(hf_dir, killed_save, tmp_path) -> None:
    from vime import checkpoint

    ckpt, _ = killed_save
    iter0 = checkpoint.iteration_dir(ckpt, 0)
    lost = tmp_path / "tracker_lost"
    shutil.copytree(iter0, lost / iter0.name)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(iter0, corrupt / iter0.name)
    (corrupt / checkpoint.TRACKER).write_text("0")
    shard = sorted((corrupt / iter0.name).glob("*.distcp"))[0]
    size = shard.stat().st_size
    shard.write_bytes(bytes((i * 7 + 3) % 251 for i in range(size)))  # right size, wrong bytes
    empty = tmp_path / "empty"
    empty.mkdir()
    loads = [iter0, lost, corrupt, empty, tmp_path / "missing"]
    got = spawn(job_load_each, 2, tmp_path, hf_dir, [str(x) for x in loads])
    assert f"--load {iter0} names a checkpoint folder itself" in got[0]
    assert f"--load {ckpt}" in got[0]
    assert f"--load {lost} holds iter_0000000 but no {checkpoint.TRACKER}" in got[1]
    assert f"{corrupt / iter0.name} could not be read" in got[2] and "corrupt" in got[2]
    assert got[3:] == [0, 0]
