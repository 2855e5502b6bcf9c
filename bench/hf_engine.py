"""Rollout throughput of the transformers engine against one batched ``model.generate``.

Where it fits: the ``hf`` rollout engine's performance check (bench/README.md). Both
paths sample the same prompts from the same checkpoint at temperature 1 with EOS (id 1)
as stop token, and both return each sampled token's log-prob:

- **HFEngine.generate**: ``vime.rollout.engines.hf.HFEngine`` at its defaults, one
  ``generate`` call with ``SamplingParams(n=..., seed=...)``;
- **model.generate**: one batched transformers ``model.generate(do_sample=True,
  num_return_sequences=n, output_scores=True, return_dict_in_generate=True, top_k=0,
  top_p=1, eos_token_id=1, pad_token_id=0)`` of the left-padded prompts, then a
  log-softmax gather of the sampled tokens from its scores.

Sizes: ``embedded`` (default) is the embedded default model (``vime-train`` with no
flags) on 64 prompts of the built-in reverse task x 8 samples, 8 new tokens at most;
``25m`` is a random Qwen3 of the same vocabulary (hidden 512, 8 layers, 8 heads, 4 KV
heads, FFN 1536) on 8 prompts x 8, 64 new tokens. The two paths' calls alternate, one
of each per repeat, so a change in the machine's load hits both. Printed side by side:
ms per call (median and fastest), generated tokens (up to and including EOS) per
second, and the ratio model.generate / HFEngine of the median and of the fastest calls
(above 1: the engine is faster).

    PYTHONPATH=. python bench/hf_engine.py                # embedded size, CPU; run it alone
    PYTHONPATH=. python bench/hf_engine.py --size 25m
    PYTHONPATH=. python bench/hf_engine.py --smoke        # tiny, for the tests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

EOS, PAD = 1, 0
SIZES: dict[str, dict[str, Any]] = {
    "embedded": dict(shape={}, prompts=64, n=8, max_new_tokens=8),
    "25m": dict(
        shape=dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, intermediate_size=1536),
        prompts=8, n=8, max_new_tokens=64,
    ),
}  # fmt: skip
SMOKE = dict(prompts=4, n=2, max_new_tokens=4, warmup=0, repeats=1)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="embedded")
    p.add_argument("--smoke", action="store_true", help="embedded model, 4 prompts x 2, 1 call")
    p.add_argument("--prompts", type=int, default=None, help="prompts (default: the size's)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0, help="of the first call; +1 per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per path")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per path")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    size = SIZES[args.size]
    for key in ("prompts", "n", "max_new_tokens"):
        if getattr(args, key) is None:
            setattr(args, key, SMOKE[key] if args.smoke else size[key])
    if args.smoke:
        args.warmup, args.repeats = SMOKE["warmup"], SMOKE["repeats"]
    return args


def make_inputs(args: argparse.Namespace, folder: str) -> list[list[int]]:
    """The checkpoint and the prompts' token ids (reverse-task prompts, with ``<bos>``)."""
    from transformers import AutoTokenizer

    from vime.data.tasks import CHARSET, get_task
    from vime.models.embedded import write_embedded_checkpoint

    write_embedded_checkpoint(folder, charset=CHARSET, seed=1234, **SIZES[args.size]["shape"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    examples = get_task("reverse").make_examples("train", 1234)[: args.prompts]
    if len(examples) < args.prompts:
        raise SystemExit(f"the reverse task has only {len(examples)} train prompts")
    return [tokenizer(e["prompt"], add_special_tokens=True)["input_ids"] for e in examples]


def generated(rows: list[list[int]]) -> int:
    """Tokens up to and including the first EOS of each row."""
    return sum(r.index(EOS) + 1 if EOS in r else len(r) for r in rows)


def engine_path(folder: str, prompts: list[list[int]], args: argparse.Namespace):
    from vime.rollout.engines.hf import HFEngine
    from vime.rollout.types import SamplingParams

    engine = HFEngine(folder)
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens)
    rows = len(prompts) * args.n
    per_batch = engine.rows_per_batch(prompts, params)
    batches = -(-rows // per_batch)

    def call(seed: int) -> int:
        params = SamplingParams(
            n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=seed
        )
        out = engine.generate(prompts, params)
        return sum(len(c.response_ids) for group in out for c in group)

    return call, f"{rows} rows in {batches} batch{'es' if batches > 1 else ''}"


def generate_path(folder: str, prompts: list[list[int]], args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    @torch.inference_mode()
    def call(seed: int) -> int:
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0,
            top_k=0, top_p=1.0, num_return_sequences=args.n, max_new_tokens=args.max_new_tokens,
            min_new_tokens=0, eos_token_id=EOS, pad_token_id=PAD, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        tokens = out.sequences[:, width:]
        logp = torch.stack(out.scores, dim=1).float().log_softmax(-1)
        logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()  # what a rollout returns
        return generated(tokens.tolist())

    return call


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = f"{tmp}/model"
        prompts = make_inputs(args, folder)
        engine_call, batching = engine_path(folder, prompts, args)
        paths = {
            "HFEngine.generate": engine_call,
            "model.generate": generate_path(folder, prompts, args),
        }
        load_before = os.getloadavg()
        times: dict[str, list[float]] = {name: [] for name in paths}
        tokens: dict[str, list[int]] = {name: [] for name in paths}
        for r in range(args.warmup + args.repeats):
            for name, call in paths.items():
                start = time.perf_counter()
                count = call(args.seed + r)
                elapsed = time.perf_counter() - start
                if r >= args.warmup:
                    times[name].append(elapsed)
                    tokens[name].append(count)

    load_after = os.getloadavg()
    lengths = sorted({len(p) for p in prompts})
    print(
        f"hf engine bench: size {args.size}, {args.prompts} prompts x {args.n} samples, "
        f"<= {args.max_new_tokens} new tokens, prompt lengths {lengths[0]}-{lengths[-1]}, "
        f"temperature 1, {args.threads} threads, {args.repeats} calls per path"
    )
    import transformers

    print(
        f"machine: {os.cpu_count()} cores, torch {torch.__version__}, transformers "
        f"{transformers.__version__}; 1-min load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after the calls (the bench adds about its threads; more: "
        "the machine was shared)"
    )
    print(f"engine: {batching} (rows_per_batch at its defaults)")
    print(f"{'path':<20}{'median ms':>11}{'fastest ms':>12}{'tokens/call':>13}{'tokens/s':>11}")
    figures: dict[str, Any] = {
        "size": args.size, "args": vars(args), "paths": {}, "engine_batching": batching,
        "load_average": [load_before[0], load_after[0]],
    }  # fmt: skip
    for name in paths:
        median, fastest = statistics.median(times[name]), min(times[name])
        mean_tokens = statistics.mean(tokens[name])
        per_s = mean_tokens / median
        figures["paths"][name] = dict(
            times=times[name], tokens=tokens[name], median_ms=median * 1e3, tokens_per_s=per_s
        )
        print(
            f"{name:<20}{median * 1e3:>11.1f}{fastest * 1e3:>12.1f}"
            f"{mean_tokens:>13.0f}{per_s:>11.0f}"
        )
    eng, ref = times["HFEngine.generate"], times["model.generate"]
    figures["ratio_median"] = statistics.median(ref) / statistics.median(eng)
    figures["ratio_fastest"] = min(ref) / min(eng)
    print(
        f"ratio model.generate/HFEngine: {figures['ratio_median']:.2f}x median, "
        f"{figures['ratio_fastest']:.2f}x fastest (above 1: the engine is faster)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
