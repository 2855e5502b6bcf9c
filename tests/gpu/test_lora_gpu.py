"""LoRA on the fsdp2 backend on one CUDA device: bf16 compute, bf16 base, fp32 adapters.

Proves: with ``--lora-rank`` and bf16 compute the frozen base lives on the GPU in bf16
and only the adapters are fp32 with AdamW state, so the trainer holds far less than a
full-weight actor of the same model; the LoRA actor's log-probs before training, and
its reference (adapters off) after two optimizer steps, equal the full-weight actor's
log-probs; the steps moved the adapters. vLLM's own LoRA on the GPU:
``test_vllm_lora_gpu.py``. Skipped without CUDA (``conftest.py``).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from vime.config.train_settings import train_settings
from vime.weights.transports import free_port

from .fsdp2_harness import fsdp2_args, random_batch, write_qwen3

pytestmark = pytest.mark.gpu

LORA = ("--lora-rank", "8", "--lora-alpha", "16")
# One optimizer step a rollout, KL against the reference on.
FLAGS = ("--global-batch-size", "8", "--use-kl-loss", "--kl-loss-coef", "0.1")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen3_lora_gpu")
    return write_qwen3(path, hidden=512, intermediate=1536, layers=4, heads=8)


def _schedule(rollout_id: int):
    from vime.data.batch import schedule

    return schedule(random_batch(rollout_id), global_batch_size=8, dp_size=1, micro_batch_size=2)


def _run(hf: str, *extra: str) -> dict:
    from vime.backends.policy_actor import make_actor

    # What this actor holds: memory over the baseline before it (an actor is freed by
    # the garbage collector, its objects hold cycles).
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    actor = make_actor("fsdp2")
    actor.init(train_settings(fsdp2_args(hf, *FLAGS, *extra)))
    out: dict = {}
    if actor.backend.lora.enabled:  # first, as in a run: FSDP2 meets the adapters switched off
        out["ref_start"] = actor.compute_log_probs(_schedule(0), "ref")
    out["start"] = actor.compute_log_probs(_schedule(0), "actor")
    trainable = [p.detach().clone() for p in actor.backend.params]
    out["metrics"] = [actor.train(_schedule(rid)) for rid in (0, 1)]
    out["moved"] = any(
        not torch.equal(p, q) for p, q in zip(actor.backend.params, trainable, strict=True)
    )
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    out["allocated"] = torch.cuda.memory_allocated(actor.device) - baseline
    named = list(actor.backend.model.named_parameters())
    out["dtypes"] = {n: (p.dtype, p.device.type) for n, p in named}
    ids = {id(p): n for n, p in named}
    out["optimizer_state"] = sorted(ids[id(p)] for p in actor.optimizer.state)
    if actor.backend.lora.enabled:
        out["ref_after"] = actor.compute_log_probs(_schedule(0), "ref")
    del actor
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _worker(rank: int, port: int, hf: str, out: str) -> None:
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    got = {"full": _run(hf), "lora": _run(hf, *LORA)}
    torch.save(got, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def got(hf_dir, tmp_path_factory) -> dict:
    out = str(Path(tmp_path_factory.mktemp("lora_gpu")) / "result.pt")
    mp.spawn(_worker, args=(free_port(), hf_dir, out), nprocs=1)
    return torch.load(out, weights_only=False)


def test_bf16_base_fp32_adapters_on_the_gpu(got) -> None:
    lora, full = got["lora"], got["full"]
    adapters = {v for n, v in lora["dtypes"].items() if ".lora_" in n}
    base = {v for n, v in lora["dtypes"].items() if ".lora_" not in n}
    assert adapters == {(torch.float32, "cuda")}
    assert base == {(torch.bfloat16, "cuda")}
    assert lora["optimizer_state"] and all(".lora_" in n for n in lora["optimizer_state"])
    # Full: fp32 weights + fp32 grads + two fp32 moments (16 bytes a weight); LoRA: the bf16
    # base (2 bytes a weight) and small adapters. Well under a quarter, with activations freed.
    print(f"\nGPU memory after two steps: LoRA {lora['allocated']} B, full {full['allocated']} B")
    assert lora["allocated"] < full["allocated"] / 4, (lora["allocated"], full["allocated"])


def test_lora_trains_and_its_reference_is_the_base(got) -> None:
    lora, full = got["lora"], got["full"]
    for run in (lora, full):
        for metrics in run["metrics"]:
            assert metrics["train/skipped_steps"] == 0.0
            assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert lora["moved"], "two optimizer steps left the adapters where they were"
    assert lora["metrics"][1]["train/kl_loss"] > 0, "the reference never differed"
    # B = 0 at start adds an exact zero; adapters off skip the adapter: the same bf16 base.
    for i, want in full["start"].items():
        torch.testing.assert_close(lora["start"][i], want, atol=1e-6, rtol=0)
        torch.testing.assert_close(lora["ref_start"][i], want, atol=1e-6, rtol=0)
        torch.testing.assert_close(lora["ref_after"][i], want, atol=1e-6, rtol=0)
