"""Training-step throughput: a vime backend's actor (packed rows) vs a naive padded HF step.

Where it fits: the backends' performance check (bench/README.md). Both paths
train the same random Qwen3 (written to a temp HF folder) on the same long-tailed
rollout with the same GRPO token-mean loss, AdamW and clip, one step per rollout:
vime = the ``--backend`` actor at world size 1 (``FSDP2Backend``: gloo/fp32 on CPU,
NCCL/bf16 on GPU; ``MegatronBackend``: megatron-core local layers, fp32, a
block-diagonal mask over each packed row) on rows packed under
``--max-tokens-per-gpu``; naive = the plain HF model on fixed micro-batches in
rollout order, right-padded, full-vocabulary log-softmax.

Printed side by side: real (non-pad) tokens/s, tokens forwarded per real token (padding
above 1; below 1 where vime computes a group's shared prompt once), model FLOP/s (6 x matmul
params x real tokens / s) as a fraction of the matmul peak measured in the same run
(before and after the steps, so a change in machine load shows), and the ratio
vime/naive. The first steps start from the same weights, so their grad norms must
agree (their losses too, though at ratio 1 the loss depends on the advantages alone);
otherwise the two paths did different work and the bench exits 1.

    PYTHONPATH=. python bench/train_step.py              # default size, CPU; run it alone
    PYTHONPATH=. python bench/train_step.py --smoke      # tiny, for the tests
    PYTHONPATH=. python bench/train_step.py --backend megatron
    PYTHONPATH=. python bench/train_step.py --device cuda --hidden 1024 --layers 16
    ... --max-tokens-per-gpu 16384 --compile-decoder --sync-debug   # scripts/gpu-check.sh

Below the table: the packed-row attention kernel(s) vime ran
(``vime.backends.varlen_attention.choose_kernel``) and, with ``--sync-debug`` on CUDA,
the host syncs of vime's timed steps by source line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

Step = Callable[[], tuple[float, float]]  # one optimizer step -> (loss, grad norm before clip)
SMOKE = dict(
    hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=128, samples=8, group=4,
    prompt_min=4, prompt_max=12, response_median=12, response_max=48, naive_micro_batch_size=4,
    warmup=0, repeats=1, matmul_size=256,
)  # fmt: skip


FLAGS: tuple[tuple[str, type, Any, str], ...] = (  # flag, type, default, help
    ("backend", str, "fsdp2", "vime's training backend: fsdp2 or megatron"),
    ("threads", int, os.cpu_count(), "torch intra-op threads"),
    ("seed", int, 0, "of the weights and the rollout"),
    ("hidden", int, 256, "random Qwen3: hidden size"),
    ("layers", int, 4, "decoder layers"),
    ("heads", int, 4, "query heads"),
    ("kv-heads", int, 2, "key/value heads"),
    ("head-dim", int, 64, "per head"),
    ("intermediate", int, None, "MLP width (default 3 x hidden)"),
    ("vocab", int, 2048, "vocabulary size"),
    ("samples", int, 32, "samples per rollout, one optimizer step"),
    ("group", int, 8, "GRPO group size"),
    ("prompt-min", int, 16, "prompt length, uniform"),
    ("prompt-max", int, 64, "prompt length, uniform"),
    ("response-median", int, 96, "response length, lognormal"),
    ("response-sigma", float, 1.0, "response length, lognormal"),
    ("response-min", int, 8, "response length clip"),
    ("response-max", int, 512, "response length clip"),
    ("naive-micro-batch-size", int, 8, "samples per padded naive micro-batch"),
    ("max-tokens-per-gpu", int, None, "vime's row cap (default: naive micro-batch size x the "
     "longest possible sample, the worst-case activation budget of a naive micro-batch)"),
    ("vime-flags", str, "", "more vime-train flags for the vime path, e.g. "
     "'--attn-implementation sdpa' (whole-row attention under a block mask)"),
    ("lr", float, 1e-5, "AdamW learning rate of both paths"),
    ("warmup", int, 1, "untimed steps per path"),
    ("repeats", int, 3, "timed steps per path"),
    ("matmul-size", int, None, "largest matmul of the peak (default 2048 CPU, 8192 GPU)"),
    ("json", str, None, "also write the figures to this file"),
)  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one step per path")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--compile-decoder", action="store_true", help="vime path: torch.compile each block"
    )
    p.add_argument(
        "--sync-debug",
        action="store_true",
        help="CUDA: count the host syncs of vime's timed steps "
        '(torch.cuda.set_sync_debug_mode("warn")) and print where they happen',
    )
    for flag, kind, default, help_text in FLAGS:
        p.add_argument(f"--{flag}", type=kind, default=default, help=help_text)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(n_max: int, dtype: torch.dtype, device: torch.device) -> tuple[int, float]:
    """(n, best GFLOP/s) of n x n x n matmuls, n doubling from 256 up to ``n_max``.

    Doubling stops early once the next matmul would take over a second: without
    native bf16 (AVX2-only CPUs) bf16 runs ~100x slower than fp32, and one 2048-cube
    would take a minute.
    """
    n = min(256, n_max)
    while True:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        a @ b  # the first call pays for allocation and kernel selection
        best = math.inf
        for _ in range(3):
            _sync(device)
            start = time.perf_counter()
            a @ b
            _sync(device)
            best = min(best, time.perf_counter() - start)
        if n * 2 > n_max or best * 8 > 1.0:
            return n, 2 * n**3 / best / 1e9
        n *= 2


def write_model(args: argparse.Namespace, path: str) -> int:
    """Save a random Qwen3 at ``path``; return its matmul parameter count (all but the
    input embedding, a table lookup)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        intermediate_size=args.intermediate or 3 * args.hidden, head_dim=args.head_dim,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt_max + args.response_max, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    embed = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embed)


def make_rollout(args: argparse.Namespace) -> Any:
    """Random tokens, lognormal response lengths, GRPO advantages of random 0/1 rewards;
    the ``--group`` samples of a group share their prompt, as a rollout's do."""
    from vime.algo import compute_advantages
    from vime.data.batch import RolloutBatch

    rng = random.Random(args.seed)
    tokens, prompts, masks = [], [], []
    for i in range(args.samples):
        if i % args.group == 0:
            p = rng.randint(args.prompt_min, args.prompt_max)
            prompt = [rng.randrange(args.vocab) for _ in range(p)]
        r = round(rng.lognormvariate(math.log(args.response_median), args.response_sigma))
        r = min(max(r, args.response_min), args.response_max)
        tokens.append(prompt + [rng.randrange(args.vocab) for _ in range(r)])
        prompts.append(p)
        masks.append([1] * r)
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in range(args.samples)])
    adv = compute_advantages(rewards, args.group).tolist()
    return RolloutBatch(tokens=tokens, prompt_lengths=prompts, loss_masks=masks, advantages=adv)


def vime_path(args: argparse.Namespace, hf_dir: str, batch: Any) -> tuple[Step, dict]:
    from vime.backends import policy_actor
    from vime.config import parse_args
    from vime.config.train_settings import train_settings
    from vime.data.batch import schedule

    longest = args.prompt_max + args.response_max
    cap = args.max_tokens_per_gpu or args.naive_micro_batch_size * longest
    flags = (
        f"--train-backend {args.backend} --lr {args.lr} "
        f"--rollout-batch-size {args.samples // args.group} --n-samples-per-prompt {args.group} "
        f"--global-batch-size {args.samples} "
        f"--use-dynamic-batch-size --max-tokens-per-gpu {cap} --prompt-data builtin:reverse"
    )  # --prompt-data only satisfies validation: the rollout here is made up
    if args.compile_decoder:
        flags += " --compile-decoder"
    actor = policy_actor.make_actor(args.backend)
    actor.init(
        train_settings(
            parse_args(["--hf-checkpoint", hf_dir, *flags.split(), *args.vime_flags.split()])
        )
    )
    sched = schedule(batch, global_batch_size=args.samples, dp_size=1, max_tokens_per_gpu=cap)
    rows = [mb for step in sched.plan.for_rank(0) for mb in step]

    def step() -> tuple[float, float]:
        metrics = actor.train(sched)
        return metrics["train/loss"], metrics["train/grad_norm"]

    hf_config = getattr(actor.backend.model, "config", None)
    attn = getattr(hf_config, "_attn_implementation", None) or "megatron local, THD per-run"
    # What the rows hold: shared prompts once each (fsdp2 with varlen_sdpa, megatron's
    # local layers), no padding.
    share = getattr(actor.backend, "shares_prompts", False)
    forwarded = sum(batch.pack(mb, share_prompts=share).row_length for mb in rows)
    batching = f"<={cap} tok/row" + (", compiled blocks" if args.compile_decoder else "")
    return step, dict(rows=len(rows), forwarded=forwarded, attn=attn, batching=batching)


def naive_model(hf_dir: str, device: torch.device, lr: float) -> tuple[Any, Any]:
    """The plain HF model (its default sdpa attention) and its AdamW: vime's default
    settings, and torch's multi-tensor kernels (its default on CUDA; on the CPU torch
    would loop per tensor), so the optimizer costs what vime's does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-8, foreach=True)
    return model, opt


def naive_micro_batches(batch: Any, mbs: int, device: torch.device) -> list[list[torch.Tensor]]:
    """``batch`` in rollout order, ``mbs`` samples a row right-padded to the longest:
    (token ids, attention mask, loss mask by target position, advantages) per row."""
    micro = []
    for start in range(0, len(batch), mbs):
        idx = range(start, min(start + mbs, len(batch)))
        width = max(len(batch.tokens[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        attn_mask = torch.zeros(len(idx), width, dtype=torch.long)
        loss_mask = torch.zeros(len(idx), width)  # by target position
        for row, i in enumerate(idx):
            n, p = len(batch.tokens[i]), batch.prompt_lengths[i]
            ids[row, :n] = torch.tensor(batch.tokens[i])
            attn_mask[row, :n] = 1
            loss_mask[row, p:n] = torch.tensor(batch.loss_masks[i], dtype=torch.float32)
        adv = torch.tensor([batch.advantages[i] for i in idx])
        micro.append([t.to(device) for t in (ids, attn_mask, loss_mask[:, 1:], adv)])
    return micro


def naive_row(model: Any, row: list[torch.Tensor], n_loss_tokens: int) -> torch.Tensor:
    """Forward and backward of one padded row under the GRPO token-mean loss; the loss.
    On GPU: bf16 compute over fp32 master weights, as vime's FSDP mixed precision does."""
    ids, attn_mask, mask, adv = row
    device = ids.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=ids, attention_mask=attn_mask, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    # GRPO with pi_old = pi: the ratio is 1 and its gradient is grad logp.
    ratio = torch.exp(logp - logp.detach())
    loss = (-adv[:, None] * ratio * mask).sum() / n_loss_tokens
    loss.backward()
    return loss.detach()


def naive_update(model: Any, opt: Any) -> torch.Tensor:
    """Clip to 1.0, step, clear the gradients; the norm before the clip."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def naive_path(
    args: argparse.Namespace, hf_dir: str, batch: Any, device: torch.device
) -> tuple[Step, dict]:
    """The textbook padded step (HF's default sdpa attention) that vime is measured against."""
    model, opt = naive_model(hf_dir, device, args.lr)
    mbs = args.naive_micro_batch_size
    n_loss_tokens = sum(sum(m) for m in batch.loss_masks)
    micro = naive_micro_batches(batch, mbs, device)

    def step() -> tuple[float, float]:
        total = sum(float(naive_row(model, row, n_loss_tokens)) for row in micro)
        return total, float(naive_update(model, opt))

    forwarded = sum(ids.numel() for ids, *_ in micro)
    return step, dict(rows=len(micro), forwarded=forwarded, attn="sdpa", batching=f"{mbs}/row")


@contextlib.contextmanager
def sync_warnings(device: torch.device, into: Counter[str] | None) -> Iterator[None]:
    """Around a step on CUDA: torch's sync debug mode warns at every op that makes the host
    wait; each warning is counted in ``into`` by where it was raised (None: off)."""
    if into is None or device.type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            into[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Build both paths on one rollout and time their steps; figures for ``report``."""
    batch = make_rollout(args)
    with tempfile.TemporaryDirectory(prefix="vime_bench_") as hf_dir:
        params = write_model(args, hf_dir)
        paths = {
            f"vime {args.backend} (packed)": vime_path(args, hf_dir, batch),
            "naive HF (padded)": naive_path(args, hf_dir, batch, device),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        first: dict[str, tuple[float, float]] = {}
        syncs: Counter[str] = Counter()
        # Interleaved, so a change in background load hits both paths alike.
        for rep in range(args.warmup + args.repeats):
            for name, (step, _) in paths.items():
                watch = args.sync_debug and rep >= args.warmup and name.startswith("vime")
                _sync(device)
                start = time.perf_counter()
                with sync_warnings(device, syncs if watch else None):
                    result = step()
                _sync(device)
                if rep >= args.warmup:
                    times[name].append(time.perf_counter() - start)
                first.setdefault(name, result)
        from vime.backends import varlen_attention

        vime_info = next(iter(paths.values()))[1]
        # The packed-row attention kernels the vime path ran (varlen_attention.choose_kernel).
        vime_info["kernels"] = varlen_attention.kernels_used()
    responses = sorted(len(t) - p for t, p in zip(batch.tokens, batch.prompt_lengths, strict=True))
    return {
        "params": params,
        "samples": len(batch),
        "real_tokens": sum(len(t) for t in batch.tokens),
        "response_quantiles": [responses[int(q * (len(responses) - 1))] for q in (0.5, 0.9, 1)],
        "paths": {name: {**info, "times": times[name]} for name, (_, info) in paths.items()},
        "first_step": first,
        "syncs": dict(syncs) if args.sync_debug else None,
    }


def report(args: argparse.Namespace, device: torch.device, r: dict[str, Any]) -> bool:
    """Print the side-by-side table; return whether both paths did the same first step."""
    model_dtype = "bfloat16" if device.type == "cuda" else "float32"
    # The higher of the two peak readings is the one less disturbed by other jobs.
    ref_peak = max(r["peaks"][model_dtype][1], r["peaks_end"][model_dtype][1])
    print(
        f"vime train-step bench: Qwen3 h{args.hidden} L{args.layers} heads {args.heads}/"
        f"{args.kv_heads}x{args.head_dim} vocab {args.vocab}, {r['params'] / 1e6:.2f}M matmul "
        f"params, {device.type} {model_dtype}, {args.threads} threads, torch {torch.__version__}"
    )
    median, p90, longest = r["response_quantiles"]
    print(
        f"rollout: {r['samples']} samples, {r['real_tokens']} real tokens, prompts "
        f"{args.prompt_min}-{args.prompt_max}, responses median {median} p90 {p90} max {longest}"
    )
    peaks = (
        f"{d} {r['peaks'][d][1]:.1f} -> {r['peaks_end'][d][1]:.1f} GFLOP/s (n={r['peaks'][d][0]})"
        for d in r["peaks"]
    )
    print("matmul peak, start -> end of run: " + ", ".join(peaks))
    print(f"MFU = 6 x matmul params x real tokens / s over the higher {model_dtype} peak\n")
    print(
        f"{'path':<21}{'tokens/s':>9}{'s/step':>8}{'min':>7}{'GFLOP/s':>8}{'MFU':>7}{'rows':>5}"
        f"{'fwd':>7}{'loss@1':>11}{'gnorm@1':>9}  batching"
    )
    tps, best = {}, {}
    for name, path in r["paths"].items():
        med = statistics.median(path["times"])
        tps[name], best[name] = r["real_tokens"] / med, r["real_tokens"] / min(path["times"])
        gflops = 6 * r["params"] * tps[name] / 1e9
        # Tokens forwarded per real token: > 1 is padding, < 1 prompts computed once.
        fwd = path["forwarded"] / r["real_tokens"]
        loss, gnorm = r["first_step"][name]
        print(
            f"{name:<21}{tps[name]:>9.0f}{med:>8.3f}{min(path['times']):>7.3f}{gflops:>8.1f}"
            f"{gflops / ref_peak:>7.1%}{path['rows']:>5}{fwd:>7.2f}{loss:>11.6f}{gnorm:>9.5f}"
            f"  {path['batching']}, {path['attn']}"
        )
    vime_path = next(iter(r["paths"].values()))
    print(f"\npacked-row attention kernel(s): {', '.join(vime_path['kernels']) or 'none of vime'}")
    if r["syncs"] is not None:
        counted = sum(r["syncs"].values())
        where = ", ".join(f"{loc} x{n}" for loc, n in Counter(r["syncs"]).most_common(8))
        note = "" if device.type == "cuda" else " (CUDA only: not counted on the CPU)"
        print(f"host syncs in vime's {args.repeats} timed steps: {counted}{note} {where}")
    (vime, naive), (vime_best, naive_best) = tps.values(), best.values()
    # The fastest steps are the least disturbed by other jobs on a shared machine.
    fastest = vime_best / naive_best
    print(f"ratio vime/naive: {vime / naive:.2f}x tokens/s ({fastest:.2f}x on fastest steps)")
    if next(iter(r["paths"].values()))["attn"] == "sdpa":
        print(
            "note: without varlen attention a packed row attends over its whole length under a "
            "block-diagonal mask,\n  so attention costs O(row^2): --max-tokens-per-gpu trades "
            "that against padding"
        )
    (v_loss, v_norm), (n_loss, n_norm) = r["first_step"].values()
    tol = 1e-3 if model_dtype == "float32" else 5e-2
    same = math.isclose(v_loss, n_loss, rel_tol=tol, abs_tol=1e-6)
    same = same and math.isclose(v_norm, n_norm, rel_tol=tol)
    # At ratio 1 with no entropy term the loss is -sum(A * mask) / N whatever the weights:
    # only the grad norm tells whether the two paths computed the same thing.
    verdict = "ok" if same else "NO"
    print(f"check: first-step grad norm (and the loss) agree within {tol:g}: {verdict}")
    return same


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the actor takes CUDA whenever it sees it
    elif args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is visible")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.threads)
    # A lone rank on a free port, so parallel test runs and other jobs cannot collide.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    n = args.matmul_size or (8192 if device.type == "cuda" else 2048)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    peaks = {name: matmul_peak(n, dtype, device) for name, dtype in dtypes.items()}
    results = measure(args, device)
    results["peaks"] = peaks
    results["peaks_end"] = {name: matmul_peak(n, dtype, device) for name, dtype in dtypes.items()}
    torch.distributed.destroy_process_group()
    same = report(args, device, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results, "check": same}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
