"""vLLM's own LoRA against merging on the engine: a later sync's time, a rollout's time.

Where it fits: the engine half of the LoRA check of bench/README.md (``lora.py`` is the
trainer's). One random Qwen3 (the size ``lora.py`` uses by default) served by vLLM (CPU
build, fp32, in-process), once per path, each in a process of its own:

- ``merge``: an engine without LoRA. A later sync is ``AdapterMerger.update``:
  ``W + s·BA`` for every adapted layer, then the whole model reloaded.
- ``native``: an engine with vLLM's LoRA on. A later sync is ``AdapterLoader.update``:
  the adapters written as a PEFT folder and loaded in place of the last.

Each path gets the first sync (base and adapters), then ``--syncs`` adapter-only syncs,
each followed by one seeded rollout (``--prompts`` x ``--samples`` completions of
``--tokens`` tokens); it reports the median sync and rollout times and the log-probs of
one fixed sequence, which must agree between the paths (they serve the same model).
Prints the ratios native / merge.

    PYTHONPATH=. python bench/lora_engine.py            # default size; run it alone
    PYTHONPATH=. python bench/lora_engine.py --smoke    # tiny, for the tests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from lora import MODEL_FLAGS
from train_step import write_model

SMOKE = dict(
    hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=128, rank=4, syncs=2,
    prompts=2, samples=2, tokens=8,
)  # fmt: skip
FLAGS = (
    *MODEL_FLAGS,
    ("syncs", int, 4, "adapter-only syncs per path, each followed by a rollout"),
    ("prompts", int, 4, "prompts a rollout"),
    ("samples", int, 4, "completions per prompt"),
    ("tokens", int, 64, "tokens per completion"),
    ("prompt-max", int, 24, "prompt length"),
    ("response-max", int, 64, "the context the engine is sized for, beyond the prompt"),
    ("path", str, None, "run one path (merge or native) and write its figures to --json"),
    ("json", str, None, "write the figures to this file"),
)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, two syncs per path")
    p.add_argument("--model", help=argparse.SUPPRESS)  # the folder a --path run serves
    for flag, kind, default, help_text in FLAGS:
        p.add_argument(f"--{flag}", type=kind, default=default, help=help_text)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    args.response_max = max(args.response_max, args.tokens)
    return args


def _adapters(model: torch.nn.Module, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Random A and B for every linear projection of the decoder blocks (a trained
    adapter's scale: the served model moves, it does not break)."""
    from vime.config.lora_flags import DEFAULT_TARGETS
    from vime.weights.lora import adapter_names

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in DEFAULT_TARGETS:
            a, b = adapter_names(name)
            out[a] = torch.randn(rank, module.in_features, generator=g) / module.in_features**0.5
            out[b] = torch.randn(module.out_features, rank, generator=g) * 0.01
    return out


def run_path(args: argparse.Namespace) -> dict[str, Any]:
    """One path's figures, in this process."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from vime.rollout.engines.vllm import VLLMEngine
    from vime.rollout.types import SamplingParams
    from vime.weights.lora import AdapterLoader, AdapterMerger, EngineLora, LoraSettings

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    native = args.path == "native"
    engine = VLLMEngine(
        args.model,
        dtype="float32",
        seed=args.seed,
        max_model_len=args.prompt_max + args.response_max,
        max_lora_rank=args.rank if native else None,
    )
    settings = EngineLora(LoraSettings(rank=args.rank, alpha=args.alpha), bucket_bytes=64 << 20)
    receiver = AdapterLoader(settings) if native else AdapterMerger(settings)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    base = list(model.state_dict().items())
    start = time.perf_counter()
    receiver.update(engine, [base, list(_adapters(model, args.rank, args.seed).items())], 1)
    first_sync = time.perf_counter() - start
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_max), generator=g).tolist()
    params = SamplingParams(
        n=args.samples, temperature=1.0, max_new_tokens=args.tokens, seed=args.seed
    )
    syncs, rollouts, tokens = [], [], 0
    for version in range(2, args.syncs + 2):
        adapters = _adapters(model, args.rank, args.seed + version)
        start = time.perf_counter()
        receiver.update(engine, [list(adapters.items())], version)
        syncs.append(time.perf_counter() - start)
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        rollouts.append(time.perf_counter() - start)
        tokens += sum(len(c.response_ids) for group in out for c in group)
    probe = (prompts[0] + out[0][0].response_ids)[:-1]  # room for score's one extra token
    return {
        "first_sync": first_sync,
        "syncs": syncs,
        "rollouts": rollouts,
        "tokens": tokens,
        "probe": engine.score(probe, args.prompt_max, 1.0),
        "adapter_bytes": sum(t.numel() * t.element_size() for t in adapters.values()),
        "params": sum(p.numel() for p in model.parameters()),
    }


def report(args: argparse.Namespace, r: dict[str, dict[str, Any]]) -> float:
    merge, native = r["merge"], r["native"]
    gap = max(abs(a - b) for a, b in zip(merge["probe"], native["probe"], strict=True))
    print(
        f"vime LoRA engine bench: vLLM (CPU, fp32) serving a random Qwen3 h{args.hidden} "
        f"L{args.layers} vocab {args.vocab}, {merge['params'] / 1e6:.1f}M params, "
        f"{args.threads} threads; LoRA rank {args.rank} on every linear projection "
        f"({native['adapter_bytes'] / 2**20:.2f} MiB of adapters a sync); a rollout is "
        f"{args.prompts}x{args.samples} completions of {args.tokens} tokens"
    )
    rows = [
        ("first sync (base + adapters)", lambda p: p["first_sync"]),
        ("each later sync (median)", lambda p: statistics.median(p["syncs"])),
        ("rollout (median)", lambda p: statistics.median(p["rollouts"])),
    ]
    print(f"\n{'':<30}{'merge':>10}{'native':>10}{'native/merge':>14}")
    for name, value in rows:
        m, n = value(merge), value(native)
        print(f"{name:<30}{m:>9.3f}s{n:>9.3f}s{n / m:>14.3f}")
    print(f"probe log-probs, largest gap between the paths: {gap:.2e}")
    return gap


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.path is not None:  # one path, in a process of its own
        with open(args.json, "w") as f:
            json.dump(run_path(args), f)
        return 0
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        model_dir = os.path.join(folder, "model")
        write_model(args, model_dir)
        for path in ("merge", "native"):
            out = os.path.join(folder, f"{path}.json")
            command = [sys.executable, __file__, *argv, "--path", path]
            command += ["--model", model_dir, "--json", out]
            subprocess.run(command, check=True)
            with open(out) as f:
                results[path] = json.load(f)
    gap = report(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "probe_gap": gap, **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
