"""What a streamed weight update costs a rollout engine, against loading the same set in
one call.

A broadcast (or CUDA-IPC) weight sync hands the engine one bucket per Ray call, the
trainer's ``--update-weight-buffer-size`` at a time; the object-store and disk
transports hand it every bucket in one ``update_weights`` call. This bench times both
on the same engine and the same weights:

- **one call**: ``engine.update_weights(all buckets)``: the floor, what the engine
  itself spends loading the set;
- **broadcast, bucket by bucket**: ``EngineActor.receive_weights("broadcast", ...)``
  for each bucket over a real gloo ``BroadcastGroup`` (the sender, group rank 0, runs
  in a thread of this process), then ``finish_update``: the path a broadcast sync takes.

Every bucket holds about ``--bucket-layers`` decoder layers, so a deep model with small
buckets shows what each extra call costs. The engine is vLLM (CPU build, in-process)
when it imports and ``--engine`` does not say otherwise, else transformers. Prints the
median of ``--repeats`` runs of each and their ratio; after the timed runs it checks that
the engine serves the last version (the stream delivered the whole set).

    PYTHONPATH=. python bench/engine_update.py                  # 36 layers, a layer a bucket
    PYTHONPATH=. python bench/engine_update.py --smoke          # 4 layers, 1 repeat
    PYTHONPATH=. python bench/engine_update.py --engine hf --layers 24
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    p.add_argument("--layers", type=int, default=36, help="decoder layers (Qwen3-8B has 36)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--bucket-layers", type=int, default=1, help="decoder layers a bucket")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="4 layers, 1 repeat")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.repeats = 4, 1
    return args


def _build_model(folder: str, layers: int, hidden: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # vLLM's CPU attention needs >= 32
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _buckets(folder: str, bucket_layers: int) -> list[list[tuple[str, object]]]:
    """The checkpoint's tensors in HF order, cut every ``bucket_layers`` decoder layers."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(path))
    buckets: list[list[tuple[str, object]]] = [[]]
    layers_in_bucket, last = 0, None
    for name in sorted(tensors, key=_hf_order):
        layer = _LAYER.sub(r"\1", name)
        if layer != last and last is not None:
            layers_in_bucket += 1
            if layers_in_bucket >= bucket_layers:
                buckets.append([])
                layers_in_bucket = 0
        buckets[-1].append((name, tensors[name]))
        last = layer
    return buckets


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\..*")  # a decoder layer's weight -> that layer


def _hf_order(name: str) -> tuple[int, int, str]:
    """Embeddings, the layers in order, then the rest (as a model's state dict runs)."""
    parts = name.split(".")
    if "layers" in parts:
        return (1, int(parts[parts.index("layers") + 1]), name)
    return (0 if "embed" in name else 2, 0, name)


def _broadcast_sync(actor: Any, buckets: list[Any], version: int) -> float:
    """Time one sync over a fresh gloo group: a sender thread and ``actor`` receiving."""
    from vime.weights.transports import BroadcastGroup, free_port, metadata_of

    port = free_port()
    sender: dict[str, BroadcastGroup] = {}
    opened = threading.Thread(
        target=lambda: sender.update(group=BroadcastGroup("127.0.0.1", port, 0, 2))
    )
    opened.start()
    actor.open_weight_link("broadcast", "127.0.0.1", port, 1, 2, "gloo")
    opened.join()
    start = time.perf_counter()
    for bucket in buckets:
        sending = threading.Thread(target=sender["group"].send, args=(bucket,))
        sending.start()
        actor.receive_weights("broadcast", metadata_of(bucket))
        sending.join()
    actor.finish_update(version)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    from vime.ray.engines import EngineActor
    from vime.rollout.engines.registry import EngineOptions

    with tempfile.TemporaryDirectory() as tmp:
        folder = _build_model(str(Path(tmp) / "model"), args.layers, args.hidden)
        buckets = _buckets(folder, args.bucket_layers)
        actor = EngineActor(args.engine, folder, EngineOptions(num_threads=args.threads, seed=0))
        engine = actor.engine
        print(
            f"vime engine-update bench: {actor.kind} engine ({actor.reason}), "
            f"{args.layers} layers, {len(buckets)} buckets, {args.repeats} repeats"
        )
        one_call, streamed, version = [], [], 0
        for _ in range(args.repeats):
            version += 1
            start = time.perf_counter()
            engine.update_weights(buckets, version)
            one_call.append(time.perf_counter() - start)
            version += 1
            streamed.append(_broadcast_sync(actor, buckets, version))
        if engine.weight_version != version:
            print(f"FAILED: the engine serves version {engine.weight_version}, not {version}")
            return 1
    figures = {
        "engine": actor.kind,
        "layers": args.layers,
        "buckets": len(buckets),
        "one_call_s": statistics.median(one_call),
        "broadcast_s": statistics.median(streamed),
    }
    figures["ratio"] = figures["broadcast_s"] / figures["one_call_s"]
    per_bucket = (figures["broadcast_s"] - figures["one_call_s"]) / len(buckets)
    print(f"{'one call (object store, disk)':<34}{figures['one_call_s'] * 1e3:>10.1f} ms")
    print(f"{'broadcast, bucket by bucket':<34}{figures['broadcast_s'] * 1e3:>10.1f} ms")
    print(f"ratio broadcast/one call: {figures['ratio']:.2f} ({per_bucket * 1e3:+.1f} ms a bucket)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
