"""The megatron backend's actor against the fsdp2 actor (CPU, fp32, gloo, tiny random Qwen3).

Proves: the same HF weights and the same planned rollout give, in ``MegatronBackend``
and ``FSDP2Backend``, the same per-token log-probs (actor and reference, 1e-5), the
same loss, the same gradient norm (1e-5 relative) and, after AdamW steps, the same
weights parameter by parameter in HF names -- on a second rollout whose KL term is
against a reference that by then differs from the actor, with the entropy term on,
and through ``train`` (two optimizer steps per rollout: old log-probs recomputed).
Checked for Qwen3 at TP=1/DP=1, TP=2 (two gloo processes) and DP=2, for a tied
Llama at TP=2, and for a four-layer tied Llama at TP=2 x PP=2 with sequence parallel
and stages of one and three layers (four processes), at PP=4 (two middle stages
without embeddings or output), and at PP=2 x DP=2 with megatron-core's distributed
optimizer (tied embeddings summed over the pipeline ends after the reduce-scatter;
two micro-batches per replica and step).

Also: the weight source yields exactly the HF weights it loaded, in HF-named
buckets under the budget, and the HF export reloads in transformers; at PP=2
(uneven), save -> new processes -> load -> continue equals the uninterrupted run bitwise,
and the checkpoint (megatron-core ``dist_checkpointing``) loads without pipelining,
weights and moments bitwise; a TP=1 checkpoint loads at TP=2 with weights and AdamW
moments bitwise equal in HF names; at DP=2 the save is spread over both replicas
(each writes part of the bytes) and loads back at DP=2 with the saved weights and
moments bitwise; megatron-core's distributed optimizer (in bf16)
shards fp32 main weights and moments over DP, trains like the plain run (same decay
groups; a few weights a bf16 rounding apart), resumes bitwise (step count included),
re-splits its checkpoint over another DP size and refuses a run without it or at
another TP size; at TP=2 x DP=2 in fp32 it matches the plain run to 5e-5; its
reduce-scatters start in the step's last backward and are in flight when it ends; a
non-finite gradient norm skips the step, with torch AdamW and with the distributed
optimizer; a checkpoint of another backend is rejected;
``vime-train --train-backend megatron`` runs 2 rollouts end to end (PP=2, the
default rollout engine, weight sync checked by the trainer's log-prob probe).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from actor_harness import VOCAB, actor_args, make_batch, make_schedule, spawn
from tiny_models import save_tiny, tiny_llama_config, tiny_qwen3_config

pytest.importorskip("megatron.core")

from tests.commands import vime_train_command
from vime.algo.metrics import MetricAccumulator
from vime.config.train_settings import train_settings
from vime.data.batch import schedule

# VOCAB (64) is padded to 128 (TP=1) / 256 (TP=2) rows inside megatron.
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    # Two KV heads so TP=2 splits the attention (one KV group per rank).
    config = tiny_qwen3_config(VOCAB)
    config.num_key_value_heads = 2
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3_kv2"), config, seed=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    # Tied embeddings: megatron's word embeddings double as the (vocab-parallel) output layer.
    config = tiny_llama_config(VOCAB, tie=True)
    config.num_key_value_heads = 2
    return save_tiny(tmp_path_factory.mktemp("tiny_llama_tied_kv2"), config, seed=1)


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory) -> str:
    # Four layers: at PP=4 the two middle stages hold neither embeddings nor output.
    config = tiny_llama_config(VOCAB, tie=True)
    config.num_key_value_heads = 2
    config.num_hidden_layers = 4
    return save_tiny(tmp_path_factory.mktemp("tiny_llama_tied_4l"), config, seed=2)


@pytest.fixture(scope="module")
def llama4_dropout_dir(tmp_path_factory) -> str:
    # Attention dropout draws from megatron's named RNG streams, which a resume must restore.
    config = tiny_llama_config(VOCAB, tie=True)
    config.num_key_value_heads = 2
    config.num_hidden_layers = 4
    config.attention_dropout = 0.1
    return save_tiny(tmp_path_factory.mktemp("tiny_llama_tied_4l_dropout"), config, seed=2)


def _actor(backend: str):
    if backend == "megatron":
        from vime.backends.policy_actor import make_actor

        return make_actor("megatron")
    from vime.backends.policy_actor import make_actor

    return make_actor("fsdp2")


def _scenario_job(rank: int, world: int, backend: str, scenario: str, args) -> dict:
    actor = _actor(backend)
    start = actor.init(train_settings(args))
    return SCENARIOS[scenario](actor, args, start)


def run(backend: str, scenario: str, args, world: int, tmp_path: Path):
    return spawn(_scenario_job, world, tmp_path, backend, scenario, args)


def _dp(actor) -> int:
    return getattr(actor.backend, "dp_size", actor.world)


def _full_weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in actor.weight_buckets(1 << 16) for n, t in bucket}


def _grad_norm(actor) -> float:
    return float(actor.backend.grad_norm())


def _all_log_probs(actor, sched, which: str) -> dict[int, torch.Tensor]:
    import torch.distributed as dist

    own = actor.compute_log_probs(sched, which)
    gathered = [None] * actor.world
    dist.all_gather_object(gathered, own)
    return {k: v for part in gathered for k, v in part.items()}


def scenario_align(actor, args, start):
    """Rollout 0 through ``train`` (2 steps); on rollout 1, step 0 by hand: log-probs,
    loss, grad norm; then the optimizer step; weights in HF names."""
    import torch.distributed as dist

    dp = _dp(actor)
    metrics0 = actor.train(make_schedule(args, 0, dp))
    sched = make_schedule(args, 1, dp)
    ref = actor.compute_log_probs(sched, "ref")
    old = actor.compute_log_probs(sched, "actor")
    all_ref = _all_log_probs(actor, sched, "ref")
    all_old = _all_log_probs(actor, sched, "actor")
    metrics = MetricAccumulator()
    loss = actor.backward_step(sched, 0, metrics, ref=ref, old=old).float()
    # Sum the DP shares once (every TP rank of a DP group holds the same share).
    loss /= getattr(actor.backend, "tp", 1)
    dist.all_reduce(loss)
    micro = metrics.all_reduce().means()  # pipeline stages without the loss add nothing
    grad_norm = _grad_norm(actor)
    actor._optimizer_step(len(sched.plan.steps[0].sample_indices))
    return {
        "metrics0": metrics0,
        "ref": all_ref,
        "old": all_old,
        "loss": float(loss),
        "micro": micro,
        "grad_norm": grad_norm,
        "weights": _full_weights(actor),
        "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    }


def scenario_train(actor, args, start, count: int = 2):
    rollouts = range(start, start + count)
    metrics = [actor.train(make_schedule(args, rid, _dp(actor))) for rid in rollouts]
    return {"weights": _full_weights(actor), "metrics": metrics, "start": start}


def scenario_train4(actor, args, start):
    return scenario_train(actor, args, start, count=4)


def _full_moments(actor) -> dict[str, dict[str, torch.Tensor]]:
    """The AdamW moments in HF names and layout (gathered like the weights), and the step."""
    from vime.weights.buckets import iter_buckets

    out: dict = {"step": actor.optimizer.state[actor.backend.params[0]]["step"].clone()}
    for moment in ("exp_avg", "exp_avg_sq"):
        entries = actor.backend._hf_entries(
            torch.float32, lambda _n, p, m=moment: actor.optimizer.state[p][m]
        )
        out[moment] = {n: t.clone() for bucket in iter_buckets(entries, 1 << 16) for n, t in bucket}
    return out


def scenario_save(actor, args, start):
    result = scenario_train(actor, args, start)
    actor.save(start + 1)
    return result


def scenario_save_fresh(actor, args, start):
    """A save before any optimizer step (id 0), then 2 rollouts and a save (id 1)."""
    actor.save(start)
    result = scenario_train(actor, args, start)
    actor.save(start + 1)
    return {**result, "moments": _full_moments(actor)}


def scenario_train_moments(actor, args, start):
    return {**scenario_train(actor, args, start), "moments": _full_moments(actor)}


def scenario_load(actor, args, start):
    return {"start": start, "weights": _full_weights(actor), "moments": _full_moments(actor)}


def scenario_export(actor, args, start):
    initial = _full_weights(actor)
    actor.train(make_schedule(args, 0, _dp(actor)))
    actor.export_hf(args.save_hf)
    buckets = [[(n, tuple(t.shape)) for n, t in b] for b in actor.weight_buckets(40_000)]
    return {"initial": initial, "weights": _full_weights(actor), "buckets": buckets}


def scenario_nan(actor, args, start):
    before = _full_weights(actor)
    batch = make_batch(0)
    batch.advantages[0] = float("nan")
    sched = schedule(batch, global_batch_size=8, dp_size=_dp(actor), micro_batch_size=2)
    metrics = actor.train(sched)
    after = _full_weights(actor)
    clean = actor.train(make_schedule(args, 1, _dp(actor)))  # nothing of the NaN may linger
    return {"before": before, "after": after, "metrics": metrics, "clean": clean}


def _optimizer_share(actor) -> dict:
    """What this rank's optimizer holds: its main-weight elements, and whether each
    moment has exactly their shape (megatron-core's distributed optimizer: a slice)."""
    state = actor.optimizer.state
    mains = actor.trained_params
    return {
        "elements": sum(p.numel() for p in mains),
        "dtypes": sorted({str(p.dtype) for p in mains}),
        "moments_match": all(
            state[p][m].shape == p.shape for p in mains for m in ADAM_MOMENTS if p in state
        ),
    }


def scenario_share_save(actor, args, start):
    import torch.distributed as dist

    result = scenario_train(actor, args, start)
    actor.save(start + 1)
    shares = [None] * actor.world
    dist.all_gather_object(shares, _optimizer_share(actor))
    return {**result, "shares": shares}


def scenario_overlap(actor, args, start):
    """Two rollouts, the first at one micro-batch per rank and step, the second at
    ``args``' size; on the second, whether every bucket's reduce-scatter was in flight
    when the step's backward passes had ended. (megatron-core learns from the first step
    how many gradients each bucket gets before its reduction may start: one micro-batch's
    worth here, so a second micro-batch can only be right if vime says which is last.)"""
    in_flight: list[bool] = []
    finish = actor.backend.finish_grads

    def recording() -> None:
        groups = actor.optimizer.ddp.bucket_groups
        in_flight.extend(g.grad_reduce_handle is not None for g in groups)
        finish()

    batch, dp = make_batch(0), _dp(actor)
    one_each = args.global_batch_size // dp
    actor.train(
        schedule(batch, global_batch_size=one_each * dp, dp_size=dp, micro_batch_size=one_each)
    )
    actor.backend.finish_grads = recording
    result = scenario_train(actor, args, 1, count=1)
    return {**result, "in_flight": in_flight}


def scenario_load_train(actor, args, start):
    return {"loaded": _full_weights(actor), **scenario_train(actor, args, start)}


SCENARIOS = {
    f.__name__.removeprefix("scenario_"): f
    for f in (
        scenario_align,
        scenario_train,
        scenario_train4,
        scenario_save,
        scenario_save_fresh,
        scenario_train_moments,
        scenario_load,
        scenario_export,
        scenario_nan,
        scenario_share_save,
        scenario_load_train,
        scenario_overlap,
    )
}


def _assert_aligned(fsdp: dict, mega: dict) -> None:
    for key in ("train/loss", "train/grad_norm", "train/kl_loss", "train/entropy"):
        assert mega["metrics0"][key] == pytest.approx(fsdp["metrics0"][key], rel=1e-5, abs=1e-7)
    for which in ("ref", "old"):
        assert sorted(mega[which]) == sorted(fsdp[which]) == list(range(8))
        for i, logp in fsdp[which].items():
            torch.testing.assert_close(mega[which][i], logp, rtol=0, atol=1e-5)
    # The reference really differs from the actor by now: the KL term is not trivially 0.
    assert max((fsdp["ref"][i] - fsdp["old"][i]).abs().max() for i in fsdp["ref"]) > 1e-4
    assert fsdp["micro"]["kl_loss"] > 0
    assert mega["loss"] == pytest.approx(fsdp["loss"], rel=1e-5, abs=1e-7)
    for key in ("kl_loss", "entropy", "pg_loss"):
        assert mega["micro"][key] == pytest.approx(fsdp["micro"][key], rel=1e-5, abs=1e-7)
    assert fsdp["grad_norm"] > 1e-3
    assert mega["grad_norm"] == pytest.approx(fsdp["grad_norm"], rel=1e-5)
    assert sorted(mega["weights"]) == sorted(fsdp["weights"])
    # Three AdamW steps of lr 1e-3. AdamW's step is m/sqrt(v): for an element whose
    # gradient is near Adam's eps (1e-8; e.g. the tied embedding row of a token the
    # batch never shows), fp32 summation-order noise of ~1e-7 relative in the two
    # backends' gradients moves its step by up to a few 1e-5 (measured: 2.3e-5, one
    # element of 4096). So: every element within 5 % of one step, and all but one in
    # a thousand within 1 %. A real gradient bug shifts most elements by ~1e-3.
    for name, weight in fsdp["weights"].items():
        diff = (mega["weights"][name] - weight).abs()
        assert diff.max() <= 5e-5, (name, float(diff.max()))
        assert (diff > 1e-5).float().mean() <= 1e-3, (name, int((diff > 1e-5).sum()))


_FSDP_REFERENCES: dict[str, dict] = {}


def _fsdp_reference(model_dir: str, tmp_path: Path) -> dict:
    """The fsdp2 run (one rank) of ``scenario_align``, computed once per model."""
    if model_dir not in _FSDP_REFERENCES:
        args = actor_args(model_dir, 1, backend="fsdp2")
        _FSDP_REFERENCES[model_dir] = run("fsdp2", "align", args, 1, tmp_path)
    return _FSDP_REFERENCES[model_dir]


@pytest.mark.parametrize(
    ("arch", "world", "tp", "pp", "extra"),
    [
        ("qwen3", 1, 1, 1, ()),
        ("qwen3", 2, 2, 1, ()),
        ("qwen3", 2, 1, 1, ()),
        ("llama_tied", 2, 2, 1, ()),
        (
            "llama_tied_4l",
            4,
            2,
            2,
            ("--megatron-sequence-parallel", "--megatron-decoder-first-pipeline-num-layers", "1"),
        ),
        ("llama_tied_4l", 4, 1, 4, ()),
        (
            "llama_tied_4l",
            4,
            1,
            2,
            # Two micro-batches per replica and step: megatron-core's schedule keeps the
            # first backward's gradient out of the reduce-scatter (no_sync).
            ("--megatron-use-distributed-optimizer", "--micro-batch-size", "1"),
        ),
    ],
    ids=[
        "qwen3-tp1",
        "qwen3-tp2",
        "qwen3-dp2",
        "llama_tied-tp2",
        "llama_tied_4l-tp2-pp2-sp-uneven",
        "llama_tied_4l-pp4",
        "llama_tied_4l-pp2-dp2-distributed-optimizer-mbs1",
    ],
)
def test_megatron_matches_fsdp2(
    hf_dir, llama_dir, llama4_dir, tmp_path, arch, world, tp, pp, extra
) -> None:
    model_dir = {"qwen3": hf_dir, "llama_tied": llama_dir, "llama_tied_4l": llama4_dir}[arch]
    reference = _fsdp_reference(model_dir, tmp_path)
    mega = run(
        "megatron",
        "align",
        actor_args(model_dir, world, *extra, backend="megatron", tp=tp, pp=pp),
        world,
        tmp_path,
    )
    _assert_aligned(reference, mega)
    if tp > 1:  # one CUDA hardware queue: collectives stay ahead of the matmuls they overlap
        assert mega["max_connections"] == "1"


def test_hf_export_and_buckets(hf_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "export")
    args = actor_args(hf_dir, 2, "--save-hf", out, backend="megatron", tp=2)
    got = run("megatron", "export", args, 2, tmp_path)
    initial = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    expected = {n: p.detach() for n, p in initial.named_parameters()}
    assert sorted(got["initial"]) == sorted(expected)
    for name, weight in expected.items():  # load -> TP shards -> weight source is exact
        assert torch.equal(got["initial"][name], weight), name
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), got["weights"][name]), name
        assert not torch.equal(param.detach(), expected[name]), f"{name} never trained"
    # Buckets respect the byte budget (a tensor larger than it travels alone).
    for bucket in got["buckets"]:
        sizes = [4 * torch.Size(shape).numel() for _, shape in bucket]
        assert len(bucket) == 1 or sum(sizes) <= 40_000


def _assert_loads_as_saved(loaded: dict, saved: dict) -> None:
    """``scenario_load``'s weights and AdamW moments (HF names) are bitwise those the
    saving run ended with, step count included, and every moment was really written."""
    assert sorted(loaded["weights"]) == sorted(saved["weights"])
    for name, weight in saved["weights"].items():
        assert torch.equal(loaded["weights"][name], weight), name
    assert torch.equal(loaded["moments"]["step"], saved["moments"]["step"])
    for moment in ("exp_avg", "exp_avg_sq"):
        assert sorted(loaded["moments"][moment]) == sorted(saved["weights"])
        for name, value in saved["moments"][moment].items():
            assert value.abs().sum() > 0, f"{name}: {moment} never written"
            assert torch.equal(loaded["moments"][moment][name], value), (moment, name)


def test_resume_equals_uninterrupted(llama4_dropout_dir, tmp_path) -> None:
    """At PP=2, split unevenly (one layer, then three; tied embeddings), with attention
    dropout kept on (--keep-dropout): save -> new processes -> load -> continue equals
    the uninterrupted run bitwise (megatron's named RNG streams travel in the
    checkpoint), and the same checkpoint loads in one process without pipelining,
    weights and AdamW moments bitwise equal in HF names. (TP re-splitting is
    ``test_checkpoint_is_dist_checkpointing_and_reshards``.)"""
    ckpt = str(tmp_path / "ckpt")

    def args(world: int, pp: int, *extra: str):
        if pp > 1:
            extra = (*extra, "--megatron-decoder-first-pipeline-num-layers", "1")
        # --keep-dropout: RL forwards run without dropout unless asked (test_dropout.py).
        extra = ("--keep-dropout", *extra)
        return actor_args(
            llama4_dropout_dir, world, "--num-rollout", "4", *extra, backend="megatron", pp=pp
        )

    whole = run("megatron", "train4", args(2, 2), 2, tmp_path)
    first = run("megatron", "save_fresh", args(2, 2, "--save", ckpt), 2, tmp_path)
    resumed = run("megatron", "train", args(2, 2, "--load", ckpt), 2, tmp_path)
    assert resumed["start"] == 2
    assert first["metrics"] == whole["metrics"][:2]
    assert resumed["metrics"] == whole["metrics"][2:]
    for name, weight in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name
    single = run("megatron", "load", args(1, 1, "--load", ckpt), 1, tmp_path)
    assert single["start"] == 2
    _assert_loads_as_saved(single, first)


def test_checkpoint_is_dist_checkpointing_and_reshards(hf_dir, tmp_path) -> None:
    """The folder is megatron-core's ``dist_checkpointing`` (weights, both AdamW moments,
    the step in ``common.pt``; none of the optimizer before its first step), and a TP=1
    save loads at TP=2 with weights and moments bitwise equal in HF names."""
    from megatron.core import dist_checkpointing

    ckpt = tmp_path / "ckpt"
    saved = run(
        "megatron",
        "save_fresh",
        actor_args(hf_dir, 1, "--save", str(ckpt), backend="megatron"),
        1,
        tmp_path,
    )
    fresh, trained = str(ckpt / "iter_0000000"), str(ckpt / "iter_0000001")
    for folder in (fresh, trained):
        assert dist_checkpointing.check_is_distributed_checkpoint(folder)
    fresh_keys = set(dist_checkpointing.load_tensors_metadata(fresh))
    metadata = dist_checkpointing.load_tensors_metadata(trained)
    assert fresh_keys and not any(k.startswith("optimizer.") for k in fresh_keys)
    assert "optimizer" not in dist_checkpointing.load_common_state_dict(fresh)
    # megatron-core's global layout: layers stacked, the vocab padded to 128 rows at TP=1.
    assert metadata["decoder.layers.self_attention.linear_qkv.weight"].global_shape[0] == 2
    assert metadata["embedding.word_embeddings.weight"].global_shape == (128, 64)
    for moment in ("exp_avg", "exp_avg_sq"):
        assert set(metadata) >= {f"optimizer.{moment}.{k}" for k in fresh_keys}
    common = dist_checkpointing.load_common_state_dict(trained)
    assert torch.equal(common["optimizer"]["step"], saved["moments"]["step"])
    assert float(saved["moments"]["step"]) == 4.0  # 2 rollouts x 2 optimizer steps

    loaded = run(
        "megatron",
        "load",
        actor_args(hf_dir, 2, "--load", str(ckpt), backend="megatron", tp=2),
        2,
        tmp_path,
    )
    assert loaded["start"] == 2
    _assert_loads_as_saved(loaded, saved)


def test_checkpoint_is_written_and_read_by_every_replica(hf_dir, tmp_path) -> None:
    """At DP=2 every tensor is replicated; the fully parallel save has each replica write
    a share (without it replica 0 writes everything and replica 1 nothing but metadata),
    and the checkpoint loads back at DP=2 with the saved weights and AdamW moments
    bitwise."""
    ckpt = tmp_path / "ckpt"
    args = actor_args(hf_dir, 2, "--save", str(ckpt), backend="megatron")
    saved = run("megatron", "save_fresh", args, 2, tmp_path)
    written = {0: 0, 1: 0}
    for shard in (ckpt / "iter_0000001").glob("__*_*.distcp"):
        written[int(shard.name.split("_")[2])] += shard.stat().st_size
    assert min(written.values()) > 0.3 * sum(written.values()), written

    loaded = run(
        "megatron",
        "load",
        actor_args(hf_dir, 2, "--load", str(ckpt), backend="megatron"),
        2,
        tmp_path,
    )
    assert loaded["start"] == 2
    _assert_loads_as_saved(loaded, saved)


def _save_job(rank: int, world: int, folder: str) -> dict:
    import multiprocessing

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from vime.backends.megatron import checkpoint as mcheckpoint
    from vime.backends.megatron import model as mmodel

    mmodel.init_model_parallel(tp=1)
    weight = torch.arange(6.0).reshape(2, 3)
    mcheckpoint.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, folder)
    target = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}
    return {
        "children": [p.name for p in multiprocessing.active_children()],
        "queue_reset": filesystem_async._results_queue is None,
        "loaded": dist_checkpointing.load(target, folder)["w"],
    }


def test_save_leaves_no_process_behind(tmp_path) -> None:
    """megatron-core's writer would start a multiprocessing Manager that outlives a rank
    ending in ``os._exit``; the save gives it an in-process queue instead."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    got = spawn(_save_job, 1, tmp_path, str(folder))
    assert got["children"] == []
    assert got["queue_reset"]
    assert torch.equal(got["loaded"], torch.arange(6.0).reshape(2, 3))


def test_save_without_psutil_fails_at_once(tmp_path, monkeypatch) -> None:
    """megatron-core's writer processes die at start without psutil and its save then
    waits forever; vime's save refuses first, naming the package."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from vime.backends.megatron import checkpoint as mcheckpoint
    from vime.checkpoint import CheckpointError

    monkeypatch.setattr(filesystem_async, "HAVE_PSUTIL", False)
    with pytest.raises(CheckpointError, match="pip install psutil"):
        mcheckpoint.save({}, tmp_path)


@pytest.mark.parametrize(
    ("tp", "extra"),
    [(2, ()), (1, ("--megatron-use-distributed-optimizer",))],
    ids=["tp2", "dp2-distributed-optimizer"],
)
def test_non_finite_gradient_skips_step(hf_dir, tmp_path, tp, extra) -> None:
    """A NaN advantage makes the step's grad norm NaN: the step is skipped and counted,
    the weights stay bitwise, and the next rollout trains with finite gradients (the
    gradients, or the distributed optimizer's buffers, were emptied)."""
    args = actor_args(hf_dir, 2, *extra, backend="megatron", tp=tp)
    got = run("megatron", "nan", args, 2, tmp_path)
    assert got["metrics"]["train/skipped_steps"] == 1.0
    for name, weight in got["before"].items():
        assert torch.equal(got["after"][name], weight), name
    assert got["clean"]["train/skipped_steps"] == 0.0
    assert 0 < got["clean"]["train/grad_norm"] < float("inf")


def test_checkpoint_of_another_backend_rejected(tmp_path) -> None:
    from vime import checkpoint
    from vime.backends.policy_actor import make_actor

    checkpoint.begin_save(tmp_path, 3, is_rank0=True)
    checkpoint.commit_save(tmp_path, 3, backend="fsdp2", world_size=1, extra={"counters": {}})
    with pytest.raises(checkpoint.CheckpointError, match="'fsdp2' backend"):
        make_actor("megatron")._load(str(tmp_path))


def test_distributed_optimizer(hf_dir, tmp_path) -> None:
    """``--megatron-use-distributed-optimizer`` (megatron-core's DDP wrapper and
    ``DistributedOptimizer``) at DP=2 in bf16: each rank holds fp32 main weights and
    moments for about half of the elements, and training equals the plain DP=2 run
    (torch AdamW on vime's fp32 main weights, the same no-decay groups) through 4
    rollouts, to a bf16 rounding of a few weights; with a save -> new processes -> load
    in the middle the resumed half is bitwise the uninterrupted distributed run (the
    AdamW step count included). The checkpoint also loads at DP=1 (megatron-core's DP
    re-split) with the saved weights and trains on like the DP=2 resume, and refuses a
    run without the flag by name."""
    from vime import checkpoint

    ckpt = str(tmp_path / "ckpt")
    bf16 = ("--megatron-param-dtype", "bfloat16")

    def args(world: int, *extra: str):
        return actor_args(hf_dir, world, "--num-rollout", "4", *bf16, *extra, backend="megatron")

    zero = ("--megatron-use-distributed-optimizer",)
    plain = run("megatron", "train4", args(2), 2, tmp_path)
    whole = run("megatron", "train4", args(2, *zero), 2, tmp_path)
    first = run("megatron", "share_save", args(2, *zero, "--save", ckpt), 2, tmp_path)
    resumed = run("megatron", "train", args(2, *zero, "--load", ckpt), 2, tmp_path)
    assert resumed["start"] == 2
    assert first["metrics"] == whole["metrics"][:2]
    assert resumed["metrics"] == whole["metrics"][2:]
    for name, weight in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name
    # The same updates: the two grad norms differ by fp32 summation order (~1e-7), so a
    # few main weights differ in their last bits and round to a neighbouring bf16 value.
    # The loss is a sum of signed advantage terms that nearly cancel (|loss| 0.08-0.5 here,
    # its terms ~0.5), so its tolerance is 1e-4 of the terms' scale, not of the sum
    # (measured in a fresh install: 1.4e-5 apart at rollout 4, where the loss is -0.12).
    for got, want in zip(whole["metrics"], plain["metrics"], strict=True):
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=5e-5), key
    for name, weight in plain["weights"].items():
        diff = (whole["weights"][name].float() - weight.float()).abs()
        assert diff.max() <= 5e-4, (name, float(diff.max()))
        assert (diff > 0).float().mean() <= 3e-2, (name, int((diff > 0).sum()))

    shares = first["shares"]
    total = sum(share["elements"] for share in shares)
    assert total >= sum(w.numel() for w in first["weights"].values())
    for share in shares:
        assert 0.4 * total < share["elements"] < 0.6 * total
        assert share["dtypes"] == ["torch.float32"] and share["moments_match"]

    single = run("megatron", "load_train", args(1, *zero, "--load", ckpt), 1, tmp_path)
    assert single["start"] == 2
    for name, weight in first["weights"].items():
        assert torch.equal(single["loaded"][name], weight), name
    # Trained on at DP=1 from the re-split moments and main weights, it continues like the
    # DP=2 resume (a scrambled re-split would move most weights by ~lr = 1e-3).
    # (The loss moves by ~1e-3 relative: a different DP split sums gradients in another
    # order, and in bf16 that rounds a few more weights differently than above.)
    for got, want in zip(single["metrics"], resumed["metrics"], strict=True):
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=5e-3)
    # Per weight, all but one element in a thousand within a quarter of one AdamW step
    # (lr 1e-3) plus one bf16 rounding step of the weight (measured: 10-15 % of the
    # elements one rounding step apart; 3 of 4096 embedding elements -- rows of tokens the
    # batch barely shows, where Adam's m/sqrt(v) amplifies noise -- up to 1.3e-3). A
    # scrambled moment moves most elements by ~lr.
    for name, weight in resumed["weights"].items():
        a, b = single["weights"][name].float(), weight.float()
        ulp = torch.exp2(torch.floor(torch.log2(b.abs() + 1e-30)) - 7)
        beyond = ((a - b).abs() > 2.5e-4 + ulp).float().mean()
        assert beyond <= 1e-3, (name, float(beyond))
    with pytest.raises(Exception, match="with --megatron-use-distributed-optimizer"):
        run("megatron", "load", args(1, "--load", ckpt), 1, tmp_path)
    assert checkpoint.latest(ckpt) == 1


def test_distributed_optimizer_overlaps_the_last_backward(hf_dir, tmp_path) -> None:
    """At DP=2 with two micro-batches per rank and step (fp32), the distributed optimizer's
    reduce-scatters are in flight when the step's backward ends (started by the last
    backward, bucket by bucket), and the first backward's gradient is not reduced on its
    own, also after a rollout of one micro-batch per step: training matches the plain
    DP=2 run."""
    mbs1 = ("--micro-batch-size", "1")
    plain = run("megatron", "train", actor_args(hf_dir, 2, *mbs1, backend="megatron"), 2, tmp_path)
    zero = "--megatron-use-distributed-optimizer"
    got = run(
        "megatron", "overlap", actor_args(hf_dir, 2, zero, *mbs1, backend="megatron"), 2, tmp_path
    )
    assert got["in_flight"] and all(got["in_flight"]), got["in_flight"]
    want = plain["metrics"][1]
    for key in ("train/loss", "train/grad_norm", "train/kl_loss", "train/entropy"):
        assert got["metrics"][0][key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    for name, weight in plain["weights"].items():
        assert (got["weights"][name] - weight).abs().max() <= 5e-5, name


def test_distributed_optimizer_at_tp2(hf_dir, tmp_path) -> None:
    """At TP=2 x DP=2 the distributed optimizer trains like the plain TP=2 x DP=2 run
    (fp32: loss and grad norm to 1e-5, weights to a fraction of one AdamW step), its
    checkpoint resumes at TP=2 x DP=1 with the saved weights and trains on, and a load
    at TP=1 is refused naming both layouts."""
    ckpt = str(tmp_path / "ckpt")
    zero = "--megatron-use-distributed-optimizer"
    plain = run("megatron", "train", actor_args(hf_dir, 4, backend="megatron", tp=2), 4, tmp_path)
    sharded = run(
        "megatron",
        "save",
        actor_args(hf_dir, 4, zero, "--save", ckpt, backend="megatron", tp=2),
        4,
        tmp_path,
    )
    for got, want in zip(sharded["metrics"], plain["metrics"], strict=True):
        for key in ("train/loss", "train/grad_norm", "train/kl_loss", "train/entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    for name, weight in plain["weights"].items():
        assert (sharded["weights"][name] - weight).abs().max() <= 5e-5, name
    resumed = run(
        "megatron",
        "load_train",
        actor_args(hf_dir, 2, zero, "--load", ckpt, "--num-rollout", "4", backend="megatron", tp=2),
        2,
        tmp_path,
    )
    assert resumed["start"] == 2
    for name, weight in sharded["weights"].items():
        assert torch.equal(resumed["loaded"][name], weight), name
    assert all(m["train/grad_norm"] > 0 for m in resumed["metrics"])
    with pytest.raises(Exception, match="saved at TP=2, PP=1"):
        run(
            "megatron",
            "load",
            actor_args(hf_dir, 1, zero, "--load", ckpt, backend="megatron"),
            1,
            tmp_path,
        )


def test_vime_train_end_to_end(tmp_path) -> None:
    """``vime-train --train-backend megatron`` on two pipeline stages: 2 rollouts of the
    embedded default, weights synced to the rollout engine from both stages (which then
    scores like the trainer), a checkpoint and the HF export. (TP with sequence parallel
    goes through the same trainer; its weight source is checked in the alignment tests.)"""
    command = vime_train_command()
    flags = ["--train-backend", "megatron", "--megatron-pipeline-parallel-size", "2"]
    flags += ["--actor-num-gpus-per-node", "2", "--rollout-batch-size", "8"]
    flags += ["--n-samples-per-prompt", "4", "--max-tokens-per-gpu", "256", "--seed", "7"]
    flags += ["--num-rollout", "2", "--output-dir", "out", "--save", "ckpt"]
    flags += ["--save-interval", "2"]
    result = subprocess.run(  # under pytest-timeout's 600 s, so the run's output is shown
        [*command, *flags], capture_output=True, text=True, timeout=540, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert len(metrics) == 2
    for m in metrics:
        assert m["weights/probe_logprob_abs_diff"] < 1e-5
        assert m["train/skipped_steps"] == 0.0 and m["train/grad_norm"] > 0
    assert (tmp_path / "ckpt" / "iter_0000001" / "vime_checkpoint.json").exists()
    # The export of two pipeline stages (tied embeddings: one tensor for both ends) is
    # a whole HF model: transformers finds every weight it expects and no stray one.
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out" / "model", output_loading_info=True
    )
    assert not any(info.values()), info
    assert model.config.tie_word_embeddings
