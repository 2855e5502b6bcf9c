"""What an idle vLLM rollout engine costs in CPU, and how fast it generates.

Starts a ``VLLMEngine`` the way ``tests/cpu/test_vllm_engine.py`` does (a tiny
random fp32 Qwen3 from ``tests/cpu/tiny_models.py``, CPU build of vLLM,
in-process engine), times ``--repeats`` generations of a fixed batch
(``--prompts`` prompts x ``--max-new-tokens`` tokens, no EOS, seeded), then
sleeps ``--idle`` seconds and reads the CPU time that this process and all its
children (an engine-core or worker process, if vLLM starts any) used in that
window. Prints the idle CPU as a fraction of one core, the busiest threads of
the idle window, and the median generation tokens/s, with the load average
next to them: on a shared machine the tokens/s move with the load, the idle
figure should not.

    PYTHONPATH=. python bench/engine_idle.py             # 10 s idle, 3 timed batches
    PYTHONPATH=. python bench/engine_idle.py --smoke     # 2 s idle, 1 small batch
    PYTHONPATH=. python bench/engine_idle.py --env OMP_WAIT_POLICY=PASSIVE  # try a knob
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_by_thread() -> dict[tuple[int, int], float]:
    """CPU seconds (user + system) of every thread of this process and its descendants."""
    import psutil

    me = psutil.Process()
    seconds: dict[tuple[int, int], float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            for thread in proc.threads():
                seconds[(proc.pid, thread.id)] = thread.user_time + thread.system_time
        except psutil.Error:
            continue
    return seconds


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def _build_model(folder: str, hidden: int, layers: int, vocab: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    sys.path.insert(0, str(ROOT / "tests" / "cpu"))
    from tiny_models import SHAPE

    shape = {**SHAPE, "hidden_size": hidden, "intermediate_size": 2 * hidden}
    shape["num_hidden_layers"] = layers
    config = Qwen3Config(vocab_size=vocab, head_dim=32, tie_word_embeddings=False, **shape)
    config.eos_token_id = None  # every completion runs to --max-new-tokens
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=float, default=10.0, help="idle window, seconds")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per timed batch")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed batches (median kept)")
    parser.add_argument("--hidden", type=int, default=64, help="model width (tiny: 64)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE",
        help="set before the engine starts (repeatable), to compare knobs",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="2 s idle, one small batch")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.idle, args.prompts, args.max_new_tokens, args.repeats = 2.0, 4, 8, 1
    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value

    from vime.rollout.engines.vllm import VLLMEngine
    from vime.rollout.types import SamplingParams

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = _build_model(folder, args.hidden, args.layers, args.vocab)
        started = time.perf_counter()
        engine = VLLMEngine(checkpoint, dtype="float32", seed=0, max_model_len=1024)
        start_s = time.perf_counter() - started

        prompts = [
            [(7 * i + 3 * j) % args.vocab for j in range(args.prompt_len)]
            for i in range(args.prompts)
        ]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
        engine.generate(prompts[:2], params)  # warm-up: first-call allocations
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = engine.generate(prompts, params)
            elapsed = time.perf_counter() - t0
            rates.append(sum(len(g[0].response_ids) for g in out) / elapsed)
        load_gen = os.getloadavg()[0]

        before = _cpu_by_thread()
        t0 = time.perf_counter()
        time.sleep(args.idle)
        window = time.perf_counter() - t0
        after = _cpu_by_thread()
        load_idle = os.getloadavg()[0]

    used = {key: after[key] - before.get(key, 0.0) for key in after}
    idle_cpu = sum(used.values())
    processes = len({pid for pid, _ in after})
    busiest = sorted(used.items(), key=lambda kv: -kv[1])[:3]
    figures = {
        "engine_start_s": start_s,
        "idle_window_s": window,
        "idle_cpu_s": idle_cpu,
        "idle_core_fraction": idle_cpu / window,
        "processes": processes,
        "threads": len(after),
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_all": rates,
        "batch": [args.prompts, args.max_new_tokens],
        "load_1min_generate": load_gen,
        "load_1min_idle": load_idle,
        "cpus": os.cpu_count(),
        "env": args.env,
    }
    print(
        f"vime engine-idle bench: random Qwen3 (hidden {args.hidden}, {args.layers} layers), "
        f"engine started in {start_s:.1f} s, {processes} process(es), {len(after)} threads"
    )
    print(
        f"idle: {idle_cpu:.3f} CPU s in {window:.1f} s = {idle_cpu / window:.3f} of one core "
        f"(1-min load {load_idle:.2f} on {os.cpu_count()} CPUs)"
    )
    for (pid, tid), seconds in busiest:
        print(f"  busiest idle thread: {_thread_name(pid, tid)} ({pid}/{tid}) {seconds:.3f} s")
    print(
        f"generate: {figures['tokens_per_s']:.0f} tokens/s median over {args.repeats} "
        f"batch(es) of {args.prompts} x {args.max_new_tokens} tokens "
        f"(each: {', '.join(f'{r:.0f}' for r in rates)}; 1-min load {load_gen:.2f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
