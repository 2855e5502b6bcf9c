"""The vLLM engine on a CUDA device: bf16 log-probs against the trainer, sleep/wake, NCCL sync.

Proves: sampled-token log-probs of a bf16 Qwen3 served by vLLM match a
transformers bf16 forward of the same weights within bf16 rounding; vLLM's sleep
mode frees device memory and ``wake_up`` serves the same weights again; new
weights delivered over the NCCL ``BroadcastGroup`` (training rank 0 -> engine)
are what the engine serves afterwards; CUDA IPC handles of a bucket open in another
process (the colocated transport) with the sender's exact values; a whole
``vime-train --colocate`` run (the engine, vLLM or hf, and an fsdp2 rank on one
GPU, CUDA-IPC sync) exits 0 with the engine serving each new version and agreeing
with the trainer within bf16 rounding. Skipped without CUDA (``conftest.py``); the
vLLM tests without vLLM (the lent GPU's image has none, and its wheel is too large to
carry there: scripts/gpu-kit.sh); the NCCL test needs two devices (NCCL refuses two
ranks on one device).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.commands import vime_train_command

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

# bf16 logits move in steps of ~2**-7 near 1; vLLM and transformers use different
# attention and GEMM kernels, so a few roundings differ per token. 0.1 is ~12 such
# steps: generous for kernels, far below a wrong weight (>> 1 on this model).
LOGP_ATOL = 0.1


def _checkpoint(path: Path, seed: int = 0, logit_scale: float = 1.0) -> str:
    """A random bf16 Qwen3; ``logit_scale`` multiplies its output layer (a random model's
    log-probs sit near -log(vocab) whatever its seed: a larger scale tells models apart)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    return str(path)


def _reference(folder: str, ids: list[int], start: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda"), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(ids[start:], device="cuda")[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("vllm")
    from vime.rollout.engines.vllm import VLLMEngine

    folder = _checkpoint(tmp_path_factory.mktemp("ckpt") / "model")
    # Eager: the compile and CUDA-graph capture would take a minute of a short lease.
    engine = VLLMEngine(folder, dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True)
    return engine, folder


def test_sampled_log_probs_match_transformers_in_bf16(engine) -> None:
    from vime.rollout.types import SamplingParams

    llm, folder = engine
    prompt = [5, 17, 42, 9]
    done = llm.generate([prompt], SamplingParams(n=2, max_new_tokens=12, seed=3))[0]
    for completion in done:
        ids = prompt + completion.response_ids
        ref = _reference(folder, ids, len(prompt))
        diff = max(abs(a - b) for a, b in zip(completion.log_probs, ref, strict=True))
        assert diff < LOGP_ATOL, diff


def test_sleep_frees_memory_and_wake_serves_the_same_weights(engine) -> None:
    llm, _ = engine
    ids = [5, 17, 42, 9, 100, 200, 300]
    before = llm.score(ids, 3, 1.0)
    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    llm.sleep()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep > free_awake  # weights and KV cache left the device
    llm.wake_up()
    assert llm.score(ids, 3, 1.0) == before


def _send(port: int, bucket: list[tuple[str, torch.Tensor]]) -> None:
    torch.cuda.set_device(1)
    from vime.weights.transports import BroadcastGroup

    group = BroadcastGroup("127.0.0.1", port, 0, 2, backend="nccl", timeout_s=120)
    group.send([(name, t.cuda()) for name, t in bucket])
    torch.cuda.synchronize()


def test_nccl_broadcast_delivers_new_weights(engine, tmp_path: Path) -> None:
    """Another model's weights, broadcast over NCCL from a second device, arrive bit for
    bit, and the engine then scores like transformers on that model (not the old one)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a second device for the sending rank")
    from safetensors.torch import load_file

    from vime.weights.transports import BroadcastGroup, free_port, metadata_of

    llm, folder = engine
    other = _checkpoint(tmp_path / "other", seed=1, logit_scale=5.0)
    weights = load_file(str(Path(other) / "model.safetensors"))
    bucket = sorted(weights.items())
    port = free_port()
    sender = mp.get_context("spawn").Process(target=_send, args=(port, bucket))
    sender.start()
    group = BroadcastGroup("127.0.0.1", port, 1, 2, backend="nccl", timeout_s=120)
    received = group.receive(metadata_of(bucket))
    sender.join(timeout=120)
    assert sender.exitcode == 0
    llm.update_weights([[(n, t.cpu()) for n, t in received]], version=7)
    assert llm.weight_version == 7
    for (name, sent), (_, got) in zip(bucket, received, strict=True):
        assert torch.equal(sent, got.cpu()), name
    ids = [5, 17, 42, 9, 100, 200, 300]
    served = llm.score(ids, 3, 1.0)
    new, old = _reference(other, ids, 3), _reference(folder, ids, 3)
    assert max(abs(a - b) for a, b in zip(served, new, strict=True)) < LOGP_ATOL
    assert max(abs(a - b) for a, b in zip(served, old, strict=True)) > 10 * LOGP_ATOL


def _share(queue: mp.Queue, done: mp.Event) -> None:
    from vime.weights.transports import share_cuda_bucket

    bucket = [("w", torch.arange(12.0, device="cuda").view(3, 4)), ("b", torch.ones(5).cuda())]
    queue.put(share_cuda_bucket(bucket))
    done.wait(timeout=120)  # the memory must outlive the receiver's copy


def test_cuda_ipc_handles_open_in_another_process() -> None:
    from vime.weights.transports import open_cuda_bucket

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    sender = ctx.Process(target=_share, args=(queue, done))
    sender.start()
    bucket = dict(open_cuda_bucket(queue.get(timeout=120), torch.cuda.current_device()))
    copies = {name: t.clone() for name, t in bucket.items()}
    del bucket  # the views into the sender's memory go before the sender does
    done.set()
    sender.join(timeout=120)
    assert torch.equal(copies["w"].cpu(), torch.arange(12.0).view(3, 4))
    assert torch.equal(copies["b"].cpu(), torch.ones(5))


def _embedded_bf16(folder: Path) -> str:
    """The embedded default model and its character tokenizer, saved in bf16 (the GPU
    regime: vLLM serves the checkpoint's dtype, fsdp2 computes in bf16 on GPU)."""
    from transformers import AutoModelForCausalLM

    from vime.data.tasks import CHARSET
    from vime.models.embedded import write_embedded_checkpoint

    path = write_embedded_checkpoint(str(folder), charset=CHARSET, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.save_pretrained(path)  # config.json now says bfloat16; the tokenizer stays
    return path


@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_colocated_run_with_cuda_ipc(engine_name: str, tmp_path: Path) -> None:
    """Two rollouts of ``vime-train --colocate --weight-sync cuda-ipc`` on one GPU, with
    either engine: the engine sleeps (vLLM: its sleep mode, memory really freed; hf: its
    weights parked on the host) while the trainer trains, wakes its weights for the
    CUDA-IPC sync, then its KV cache for the probe and generation once the trainer
    sleeps. Exit 0, the engine serves versions 1 and 2, and both the sampled tokens'
    log-probs and the probe's agree with the trainer's within bf16 rounding: a stale or
    half-loaded weight (a wake restoring the parked copy over new weights) would be far
    off. The hf run needs no vLLM, so the colocated GPU loop is checked wherever CUDA is."""
    if engine_name == "vllm":
        pytest.importorskip("vllm")
    checkpoint = _embedded_bf16(tmp_path / "model")
    command = vime_train_command()
    out = tmp_path / "out"
    flags = [
        *("--hf-checkpoint", checkpoint, "--prompt-data", "builtin:reverse"),
        *("--colocate", "--rollout-engine", engine_name, "--weight-sync", "cuda-ipc"),
        *("--num-rollout", "2", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4"),
        *("--rollout-max-prompt-len", "64", "--rollout-max-response-len", "8"),
        *("--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024", "--lr", "3e-4"),
        *("--seed", "7", "--output-dir", str(out)),
    ]
    # NVML's CUDA check leaves fork usable for vLLM's engine process (scripts/gpu-check.sh);
    # the repository on the path, absolute, where vime is not pip-installed.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONPATH": path}
    # vLLM compiles the model and captures CUDA graphs at start (minutes on a cold cache).
    limit = 480 if engine_name == "vllm" else 220
    result = subprocess.run(
        [*command, *flags], capture_output=True, text=True, timeout=limit, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"rollout engine {engine_name} (--rollout-engine {engine_name})" in result.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for row in rows:
        assert row["weights/version"] == row["rollout_id"] + 1
        assert row["train/train_rollout_logprob_abs_diff"] < LOGP_ATOL, row
        assert row["weights/probe_logprob_abs_diff"] < LOGP_ATOL, row
