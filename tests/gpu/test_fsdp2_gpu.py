"""The fsdp2 backend on one CUDA device: NCCL process group, bf16 compute, fp32 master weights.

Proves: ``sleep`` frees most of the rank's CUDA memory (parameter shards and
AdamW moments leave the device) and ``wake_up`` puts every shard and moment
back bit for bit, after which a training step runs; packed log-probs equal
per-sample log-probs (one sample a row) within bf16 rounding, while the same
row with position ids that do not restart — samples attending to each other —
lands far outside that tolerance, so the tolerance cannot hide a packing bug;
``--attn-implementation auto`` picks ``varlen_sdpa`` (its kernel flash-attn's or
torch's varlen one where installed); ``--fsdp-cpu-offload`` keeps the shards
(pinned) and AdamW moments on the host yet trains two rollouts to the loss and
gradient norm of a run that keeps them on the GPU. Skipped without CUDA
(``conftest.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from vime.config.train_settings import train_settings
from vime.weights.transports import free_port

from .fsdp2_harness import fsdp2_args, random_batch, write_qwen3

pytestmark = pytest.mark.gpu

# bf16 keeps 8 significant bits, so a logit near 1 moves in steps of 2**-7 ~ 0.008; log-probs
# are taken in fp32 from bf16 logits. Packing changes only kernel tiling and summation order,
# which flips a few roundings: on CPU bf16 the largest packed-vs-single gap of this model
# shape was 0.006, while letting the packed samples attend to each other moved log-probs by
# more than 0.5. 0.05 is ~6 such steps: room for GPU kernels, far below a leak.
LOGP_ATOL = 0.05
# CPU offload computes with the same bf16 weights, gathered from host shards instead of
# device shards; only AdamW (on the host there, on the GPU here) and the grad-norm sum run
# different fp32 kernels. An fp32 ulp of difference in a master weight flips its bf16
# rounding only next to a rounding boundary, so the later steps' loss and norm move by far
# less than one bf16 step (relative 2**-8), while a lost or stale update shifts every weight
# by an AdamW step (~lr = 1e-3 against an init scale of 0.02).
OFFLOAD_RTOL = 2**-8


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen3_gpu")
    return write_qwen3(path, hidden=256, intermediate=512, layers=2, heads=4)


def _flash_attn_importable() -> bool:
    try:
        importlib.import_module("flash_attn")
    except ImportError:
        return False
    return True


def _schedule(batch, micro_batch_size: int, steps: int = 1):
    from vime.data.batch import schedule

    return schedule(
        batch,
        global_batch_size=len(batch) // steps,
        dp_size=1,
        micro_batch_size=micro_batch_size,
    )


@torch.no_grad()
def _leaky_log_probs(actor, batch) -> dict[int, torch.Tensor]:
    """Log-probs of the whole batch packed in one row whose position ids run on across
    samples: attention then treats the row as one sequence and samples see each other."""
    from vime.data.micro_batch import response_log_probs

    indices = tuple(range(len(batch)))
    packed = batch.pack(indices).to(actor.device)
    positions = torch.arange(packed.row_length, device=actor.device)[None]
    leaky = dataclasses.replace(packed, position_ids=positions)
    logits = actor.backend.model(**leaky.model_inputs()).logits
    logp, _ = response_log_probs(logits.float(), leaky)
    return {i: logp[row, : int(leaky.response_lengths[row])].cpu() for row, i in enumerate(indices)}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard; a plain tensor (one rank, no offload: no fully_shard) as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _state_tensors(actor) -> list[torch.Tensor]:
    tensors = [_local(p) for p in actor.backend.params]
    for state in actor.optimizer.state.values():
        tensors += [_local(v) for k, v in state.items() if k != "step"]
    return tensors


def _offload_vs_resident(hf: str) -> dict:
    """Two fresh actors, one with ``--fsdp-cpu-offload``, train the same two rollouts (two
    optimizer steps each): their metrics and where their shards and AdamW moments live."""
    from vime.backends.policy_actor import make_actor

    runs = {}
    for name, extra in (("resident", ()), ("offload", ("--fsdp-cpu-offload",))):
        actor = make_actor("fsdp2")
        actor.init(train_settings(fsdp2_args(hf, *extra)))
        metrics = [
            actor.train(_schedule(random_batch(rid), micro_batch_size=2, steps=2)) for rid in (0, 1)
        ]
        runs[name] = {
            "metrics": metrics,
            "state_devices": {t.device.type for t in _state_tensors(actor)},
            # FSDP2 pins host shards (CPUOffloadPolicy(pin_memory=True) on a GPU run) so the
            # per-block copies to the device are DMA transfers; AdamW's moments are not.
            "pinned": all(_local(p).is_pinned() for p in actor.backend.params),
        }
        del actor
        torch.cuda.empty_cache()
    return runs


def _worker(rank: int, port: int, hf: str, out: str) -> None:
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    from vime.backends.policy_actor import make_actor

    actor = make_actor("fsdp2")
    actor.init(train_settings(fsdp2_args(hf)))
    batch = random_batch(0)
    packed = actor.compute_log_probs(_schedule(batch, micro_batch_size=len(batch)), "actor")
    single = actor.compute_log_probs(_schedule(batch, micro_batch_size=1), "actor")
    leaky = _leaky_log_probs(actor, batch)

    actor.train(_schedule(batch, micro_batch_size=2))  # AdamW moments now exist
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per stream that memory_allocated counts and sleep does not
    # own (tens of MB on Hopper, more than this model's state): out of both readings.
    torch._C._cuda_clearCublasWorkspaces()
    awake_bytes = torch.cuda.memory_allocated(actor.device)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in _state_tensors(actor)}
    state_bytes = sum(storage.nbytes() for storage in storages.values())
    snapshot = [t.detach().cpu().clone() for t in _state_tensors(actor)]
    actor.sleep()
    torch._C._cuda_clearCublasWorkspaces()
    asleep_bytes = torch.cuda.memory_allocated(actor.device)
    actor.wake_up()
    tensors = _state_tensors(actor)
    on_device = all(t.is_cuda for t in tensors)
    restored = all(torch.equal(t.cpu(), s) for t, s in zip(tensors, snapshot, strict=True))
    metrics = actor.train(_schedule(random_batch(1), micro_batch_size=2))
    after = _state_tensors(actor)
    moved = any(not torch.equal(t.cpu(), s) for t, s in zip(after, snapshot, strict=True))
    attn = actor.backend.model.config._attn_implementation

    torch.save(
        {
            "device": str(actor.device),
            "attn": attn,
            "flash_importable": _flash_attn_importable(),
            "offload": _offload_vs_resident(hf),
            "packed": packed,
            "single": single,
            "leaky": leaky,
            "masks": batch.loss_masks,
            "awake_bytes": awake_bytes,
            "asleep_bytes": asleep_bytes,
            "state_bytes": state_bytes,
            "state_tensors": len(snapshot),
            "on_device": on_device,
            "restored": restored,
            "metrics": metrics,
            "moved": moved,
        },
        out,
    )
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def got(hf_dir, tmp_path_factory) -> dict:
    out = str(Path(tmp_path_factory.mktemp("gpu")) / "result.pt")
    mp.spawn(_worker, args=(free_port(), hf_dir, out), nprocs=1)
    return torch.load(out, weights_only=False)


def test_sleep_frees_memory_and_wake_restores_bitwise(got) -> None:
    assert got["device"].startswith("cuda")
    assert got["state_tensors"] > 0
    freed = got["awake_bytes"] - got["asleep_bytes"]
    # Every shard and moment left the device (a little slack for allocator rounding).
    assert freed >= 0.95 * got["state_bytes"], (freed, got["state_bytes"], got["awake_bytes"])
    assert got["on_device"], "a parameter shard or AdamW moment did not come back to the GPU"
    assert got["restored"], "wake_up did not restore every shard and moment bit for bit"
    assert got["metrics"]["train/skipped_steps"] == 0.0
    assert torch.isfinite(torch.tensor(got["metrics"]["train/loss"]))
    assert got["moved"], "the step after wake_up did not update the weights"


def test_packed_log_probs_match_per_sample_in_bf16(got) -> None:
    assert set(got["packed"]) == set(got["single"]) == set(range(len(got["masks"])))
    leak = 0.0
    for i, single in got["single"].items():
        assert single.shape == got["packed"][i].shape
        torch.testing.assert_close(got["packed"][i], single, atol=LOGP_ATOL, rtol=0)
        if i > 0:  # the first sample of the row sees nothing before it either way
            leak = max(leak, float((got["leaky"][i] - single).abs().max()))
    assert leak > 4 * LOGP_ATOL, f"cross-sample attention moved log-probs by only {leak}"


def test_auto_attention_is_varlen_sdpa(got) -> None:
    """bf16 compute on a GPU: per-sample attention, whose kernel is flash-attn's or torch's
    varlen kernel where installed (``vime.backends.varlen_attention.choose_kernel``)."""
    assert got["attn"] == "varlen_sdpa", (got["attn"], got["flash_importable"])


def test_cpu_offload_trains_as_the_resident_run(got) -> None:
    """Two rollouts of two steps: every step after the first computes with weights the
    previous AdamW step (host or device) produced, so a lost or stale update shows."""
    resident, offload = got["offload"]["resident"], got["offload"]["offload"]
    assert resident["state_devices"] == {"cuda"}
    assert offload["state_devices"] == {"cpu"}, "--fsdp-cpu-offload left state on the GPU"
    assert offload["pinned"], "offloaded parameter shards are not in pinned host memory"
    pairs = zip(resident["metrics"], offload["metrics"], strict=True)
    for rollout, (want, have) in enumerate(pairs):
        assert have["train/skipped_steps"] == want["train/skipped_steps"] == 0.0, rollout
        for key in ("train/loss", "train/grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=OFFLOAD_RTOL), (rollout, key)
