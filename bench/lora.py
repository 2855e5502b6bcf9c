"""LoRA against full-weight training on the fsdp2 backend: memory, sync bytes, step time.

Where it fits: the LoRA check of bench/README.md. One random Qwen3 (written to a temp
HF folder, over 100 M parameters at the default size) and one made-up rollout; two
``fsdp2`` actors at world size 1 train it with the same flags (GRPO + k3 KL against
the reference, AdamW), one full-weight, one with ``--lora-rank`` adapters on every
linear projection. Each path reports what it holds, counted from its own tensors:
parameters, gradients (read just before each optimizer step), AdamW state and the
host copy of the reference (LoRA keeps none: its reference is the base with the
adapters off); the bytes its first and a later weight sync move (``sync_buckets``:
LoRA sends the base once, then the adapters alone); and its median train-step time.
Printed side by side with the ratios LoRA / full.

    PYTHONPATH=. python bench/lora.py              # default size, CPU; run it alone
    PYTHONPATH=. python bench/lora.py --smoke      # tiny, for the tests
    PYTHONPATH=. python bench/lora.py --device cuda   # bf16 compute, the LoRA base in bf16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from train_step import make_rollout, write_model

SMOKE = dict(
    hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=128, samples=8, group=4,
    prompt_min=4, prompt_max=8, response_median=8, response_max=16, steps=1, rank=4,
)  # fmt: skip
# The model and the adapters (bench/lora_engine.py takes the same).
MODEL_FLAGS: tuple[tuple[str, type, Any, str], ...] = (  # flag, type, default, help
    ("threads", int, os.cpu_count(), "torch intra-op threads"),
    ("seed", int, 0, "of the weights and the rollout"),
    ("hidden", int, 768, "random Qwen3: hidden size"),
    ("layers", int, 12, "decoder layers"),
    ("heads", int, 12, "query heads"),
    ("kv-heads", int, 4, "key/value heads"),
    ("head-dim", int, 64, "per head"),
    ("intermediate", int, None, "MLP width (default 3 x hidden)"),
    ("vocab", int, 32768, "vocabulary"),
    ("rank", int, 16, "LoRA rank"),
    ("alpha", float, 32.0, "LoRA alpha"),
)
FLAGS = (
    *MODEL_FLAGS,
    ("samples", int, 8, "rollout samples (one optimizer step)"),
    ("group", int, 4, "samples per prompt"),
    ("prompt-min", int, 8, "prompt length range"),
    ("prompt-max", int, 24, ""),
    ("response-min", int, 4, "response lengths: lognormal, clipped"),
    ("response-median", int, 48, ""),
    ("response-sigma", float, 0.6, ""),
    ("response-max", int, 128, ""),
    ("lr", float, 1e-5, "AdamW learning rate"),
    ("steps", int, 3, "timed train steps per path (after one warm-up step)"),
    ("bucket-mb", int, 64, "weight-sync bucket size"),
    ("json", str, None, "also write the figures to this file"),
)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one timed step per path")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    for flag, kind, default, help_text in FLAGS:
        p.add_argument(f"--{flag}", type=kind, default=default, help=help_text)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    return p.parse_args(argv)


def _bytes(tensors: Any) -> int:
    """Bytes held by ``tensors`` (DTensors by their local shard), each storage once."""
    storages = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _sync_bytes(actor: Any, bucket_bytes: int) -> int:
    return sum(t.numel() * t.element_size() for b in actor.sync_buckets(bucket_bytes) for _, t in b)


def run_path(args: argparse.Namespace, hf_dir: str, batch: Any, lora: bool) -> dict[str, Any]:
    """One actor's figures: held bytes by kind, sync bytes, step times, first-step loss."""
    from vime.backends.policy_actor import make_actor
    from vime.config import parse_args
    from vime.config.train_settings import train_settings
    from vime.data.batch import schedule

    flags = (
        f"--hf-checkpoint {hf_dir} --prompt-data builtin:reverse --lr {args.lr} "
        f"--rollout-batch-size {args.samples // args.group} --n-samples-per-prompt {args.group} "
        f"--global-batch-size {args.samples} --micro-batch-size {args.samples} "
        "--use-kl-loss --kl-loss-coef 0.01 --kl-loss-type k3"
    )  # --prompt-data only satisfies validation: the rollout here is made up
    if lora:
        flags += f" --lora-rank {args.rank} --lora-alpha {args.alpha}"
    actor = make_actor("fsdp2")
    actor.init(train_settings(parse_args(flags.split())))
    sched = schedule(batch, global_batch_size=args.samples, dp_size=1, micro_batch_size=8)
    grad_bytes: list[int] = []
    actor.optimizer.register_step_pre_hook(
        lambda opt, *_: grad_bytes.append(
            _bytes(p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None)
        )
    )
    bucket = args.bucket_mb << 20
    first_sync = _sync_bytes(actor, bucket)
    times, metrics = [], []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        metrics.append(actor.train(sched))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    later_sync = _sync_bytes(actor, bucket)
    state = [t for s in actor.optimizer.state.values() for k, t in s.items() if k != "step"]
    held = {
        "params": _bytes(actor.backend.model.parameters()),
        "grads": max(grad_bytes),
        "optimizer": _bytes(state),
        "reference": _bytes(actor.ref_shards or []),
    }
    trainable = sum(p.numel() for p in actor.backend.params)
    total = sum(p.numel() for p in actor.backend.model.parameters())
    del actor
    gc.collect()  # the actor's objects hold cycles: free its memory before the next path
    return {
        "held": held,
        "held_total": sum(held.values()),
        "first_sync": first_sync,
        "later_sync": later_sync,
        "times": times[1:],
        "trainable": trainable,
        "params": total,
        "loss": [m["train/loss"] for m in metrics],
    }


def report(args: argparse.Namespace, r: dict[str, dict[str, Any]]) -> None:
    full, lora = r["full"], r["lora"]
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    print(
        f"vime LoRA bench: Qwen3 h{args.hidden} L{args.layers} heads {args.heads}/"
        f"{args.kv_heads}x{args.head_dim} vocab {args.vocab}, {full['params'] / 1e6:.1f}M params, "
        f"{args.device} {dtype}, {args.threads} threads, torch {torch.__version__}; "
        f"LoRA rank {args.rank} "
        f"alpha {args.alpha:g} on every linear projection "
        f"({lora['trainable'] / 1e6:.2f}M trainable)"
    )
    mb = 1 << 20
    rows = [
        ("parameters", lambda p: p["held"]["params"] / mb, "MiB"),
        ("gradients", lambda p: p["held"]["grads"] / mb, "MiB"),
        ("AdamW state", lambda p: p["held"]["optimizer"] / mb, "MiB"),
        ("reference copy", lambda p: p["held"]["reference"] / mb, "MiB"),
        ("trainer memory", lambda p: p["held_total"] / mb, "MiB"),
        ("first sync", lambda p: p["first_sync"] / mb, "MiB"),
        ("each later sync", lambda p: p["later_sync"] / mb, "MiB"),
        ("train step (median)", lambda p: statistics.median(p["times"]), "s"),
    ]
    print(f"\n{'':<22}{'full':>12}{'LoRA':>12}{'LoRA/full':>11}")
    for name, value, unit in rows:
        f, lo = value(full), value(lora)
        ratio = f"{lo / f:.4f}" if f else "-"
        print(f"{name:<22}{f:>10.2f} {unit:<3}{lo:>8.2f} {unit:<3}{ratio:>9}")
    print(
        f"\nratios LoRA/full: trainer memory {lora['held_total'] / full['held_total']:.3f}, "
        f"bytes per later sync {lora['later_sync'] / full['later_sync']:.4f}, "
        f"train step {statistics.median(lora['times']) / statistics.median(full['times']):.2f}"
    )


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the actor takes CUDA whenever it sees it
    elif not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is visible")
    torch.set_num_threads(args.threads)
    with socket.socket() as s:  # a lone rank on a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as hf_dir:
        write_model(args, hf_dir)
        batch = make_rollout(args)
        results = {name: run_path(args, hf_dir, batch, name == "lora") for name in ("full", "lora")}
    torch.distributed.destroy_process_group()
    report(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
