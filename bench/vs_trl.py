"""vime against TRL's GRPOTrainer: the same GRPO work, run one after the other.

Where it fits: the end-to-end comparison with the reference trainer (bench/README.md).
Both sides start cold in a subprocess of their own (``vime-train``; this script as a
TRL worker) on the same Qwen3 (same weights), the same built-in task and reward, the
same prompt token ids and the same GRPO step: group-normalised advantages, PPO clip 0.2,
no KL, token-mean loss over the whole rollout, one AdamW step per rollout, clip 1.0,
fp32 on the CPU. ``--size embedded`` is the work of ``vime-train`` with no flags (the
265 k-parameter model learning to reverse strings); ``--size 25m`` a random 25 M model
generating up to 64 tokens at a near-zero learning rate, for throughput alone.

Printed per side: s/step, generation, training and (vime) weight-sync seconds, generated
and trained tokens/s, train MFU, start-up (launch to the first generation) and, with
eval, the training time to 50 % greedy accuracy on the held-out prompts; then the
ratios vime/TRL. Medians skip the first 2 steps; step times exclude eval on both sides.

    PYTHONPATH=. python bench/vs_trl.py                   # embedded, 400 steps; run it alone
    PYTHONPATH=. python bench/vs_trl.py --size 25m        # 25 M params, 12 steps, no eval
    PYTHONPATH=. python bench/vs_trl.py --size 25m --max-staleness 0,1   # + asynchronous
    PYTHONPATH=. python bench/vs_trl.py --steps 40 --engine hf --json figures.json
    PYTHONPATH=. python bench/vs_trl.py --smoke           # tiny, both sides, for the tests
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEED = 1234
WARMUP = 2  # steps left out of the medians: allocation, first kernels, Ray's first calls

# vime-train's own embedded defaults (vime/config/flags.py), spelled out for TRL.
SIZES: dict[str, dict[str, Any]] = {
    "embedded": dict(prompts=64, samples=8, max_new=8, lr=3e-4, steps=400, eval_interval=20,
                     eval_prompts=100, shape={}),
    "25m": dict(prompts=8, samples=8, max_new=64, lr=1e-9, steps=12, eval_interval=0,
                eval_prompts=0, shape=dict(hidden_size=512, intermediate_size=1536,
                                           num_hidden_layers=8, num_attention_heads=8,
                                           num_key_value_heads=4, head_dim=64)),
}  # fmt: skip
SMOKE = dict(prompts=8, samples=4, steps=3, eval_interval=2, eval_prompts=10)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="embedded")
    p.add_argument("--smoke", action="store_true", help="embedded model, 3 steps of 8x4, hf")
    p.add_argument("--steps", type=int, help="rollouts = optimizer steps (default per size)")
    engines = "vime rollout engines, comma-separated (default: hf, plus vllm when it imports)"
    p.add_argument("--engine", help=engines + "; TRL always generates with transformers")
    p.add_argument("--eval-interval", type=int, help="greedy eval every K steps (0: none)")
    p.add_argument(
        "--max-staleness",
        default="0",
        help="vime's --max-staleness values, comma-separated: a vime row per engine and "
        "value (K >= 1: asynchronous; its 'gen' column is then the trainer's wait)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads of the TRL worker")
    p.add_argument("--workdir", help="keep models, logs and outputs here (default: a temp dir)")
    p.add_argument("--json", help="also write every figure to this file")
    p.add_argument("--_trl-worker", dest="trl_worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    spec = dict(SIZES[args.size])
    if args.smoke:
        args.size = "embedded"
        spec = {**SIZES["embedded"], **SMOKE}
        args.engine = args.engine or "hf"
    if args.steps is not None:
        spec["steps"] = args.steps
    if args.eval_interval is not None:
        spec["eval_interval"] = args.eval_interval
    if not args.engine:
        try:
            import vllm  # noqa: F401

            args.engine = "hf,vllm"
        except ImportError:
            args.engine = "hf"
    args.engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    args.stalenesses = [int(k) for k in args.max_staleness.split(",") if k.strip()]
    args.spec = spec
    return args


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    # Offline: TRL would otherwise try to send telemetry from the worker.
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip


def _launch(cmd: list[str], log_path: Path) -> tuple[float, list[tuple[float, str]]]:
    """Run ``cmd`` to its end; (launch time.time(), [(seconds since launch, stdout line)])."""
    launched = time.time()  # wall clock: the TRL worker stamps its first generation with it
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    with open(log_path, "w") as log:
        for line in proc.stdout:
            lines.append((time.time() - launched, line.rstrip("\n")))
            log.write(line)
    if proc.wait() != 0:
        tail = "\n".join(text for _, text in lines[-40:])
        sys.exit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{tail}")
    return launched, lines


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _timed(steps: list[dict[str, float]]) -> list[dict[str, float]]:
    """The steps the medians are taken over: all but the warm-up (at least the last)."""
    return steps[WARMUP:] or steps[-1:]


def _time_to_half(steps: list[dict[str, float]]) -> tuple[float | None, int | None]:
    """(training seconds, step) at the first eval with accuracy >= 0.5, eval time excluded."""
    total = 0.0
    for i, step in enumerate(steps):
        total += step["step_s"]
        if step.get("eval_acc") is not None and step["eval_acc"] >= 0.5:
            return total, i + 1
    return None, None


# ----- vime -------------------------------------------------------------------------------


def run_vime(args: argparse.Namespace, engine: str, model: Path, eval_file: Path | None,
             work: Path, staleness: int = 0) -> dict[str, Any]:  # fmt: skip
    name = f"vime_{engine}" + (f"_k{staleness}" if staleness else "")
    spec, out = args.spec, work / name
    shutil.rmtree(out, ignore_errors=True)  # a kept --workdir: metrics.jsonl starts afresh
    batch = spec["prompts"] * spec["samples"]
    flags = [
        "--rollout-engine", engine, "--output-dir", str(out), "--num-rollout", str(spec["steps"]),
        "--rollout-batch-size", str(spec["prompts"]), "--n-samples-per-prompt",
        str(spec["samples"]), "--global-batch-size", str(batch), "--seed", str(SEED),
        "--max-staleness", str(staleness),
    ]  # fmt: skip
    if args.size == "embedded":
        # No --hf-checkpoint: vime-train's embedded default writes the same model itself
        # (checked below) and keeps its defaults: lr, lengths, rows, eval of 100 prompts.
        if eval_file is not None:
            flags += ["--eval-prompt-data", str(eval_file)]
        if spec["eval_interval"] != 20:
            # vime takes no 0; an interval past the last step leaves only the final eval,
            # after the timed loop.
            flags += ["--eval-interval", str(spec["eval_interval"] or spec["steps"] + 1)]
    else:
        flags += [
            "--hf-checkpoint", str(model), "--prompt-data", "builtin:reverse",
            "--rollout-max-prompt-len", "64", "--rollout-max-response-len", str(spec["max_new"]),
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--lr", str(spec["lr"]),
        ]  # fmt: skip
    _, lines = _launch([sys.executable, "-m", "vime.cli", *flags], work / f"{name}.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = []
    for m in rows:
        eval_s = m.get("phase/eval_s", 0.0)
        steps.append({
            "step_s": m["perf/step_time_s"] - eval_s, "gen_s": m["phase/rollout_s"],
            "train_s": m["phase/train_s"], "sync_s": m["phase/sync_s"],
            "gen_tok_s": m["perf/rollout_tokens_per_s"],
            "train_tok_s": m["perf/train_tokens_per_s"],
            "mfu": m["perf/train_mfu"], "peak_flops": m["perf/peak_flops"], "eval_s": eval_s,
            "eval_acc": m.get("eval/pass@1"), "reward": m["rollout/reward_mean"],
            "response_len": m["rollout/response_len_mean"],
        })  # fmt: skip
    # vime prints nothing at the first rollout's start; its progress line comes at the
    # end of that rollout, so start-up = that line's arrival - the first step's time.
    first = next((t for t, text in lines if re.match(r"rollout 1/\d+", text)), None)
    threads = next((m.group(1) for _, text in lines
                    if (m := re.search(r"(\d+) thread\(s\) per rank", text))), "?")  # fmt: skip
    embedded = out / "embedded_model" / "model.safetensors"
    return {
        "steps": steps,
        "startup_s": first - rows[0]["perf/step_time_s"] if first is not None else None,
        "threads": threads,
        "weights_sha": _sha(embedded if embedded.exists() else model / "model.safetensors"),
        "final_eval": json.loads((out / "summary.json").read_text()).get("final_eval"),
    }


# ----- TRL --------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace, model: Path, work: Path) -> dict[str, Any]:
    spec_path, out = work / "trl_spec.json", work / "trl_result.json"
    spec = {**args.spec, "model": str(model), "out": str(out), "threads": args.threads,
            "output_dir": str(work / "trl_out")}  # fmt: skip
    spec_path.write_text(json.dumps(spec))
    launched, _ = _launch(
        [sys.executable, str(Path(__file__).resolve()), "--_trl-worker", str(spec_path)],
        work / "trl.log",
    )
    result = json.loads(out.read_text())
    result["startup_s"] = result.pop("first_generation_time") - launched
    result["weights_sha"] = _sha(model / "model.safetensors")
    return result


def trl_worker(spec_path: str) -> int:
    """TRL's GRPOTrainer on the spec's work; per-step timings into ``spec["out"]``."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers
    from datasets import Dataset
    from tokenizers import processors
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from vime import perf
    from vime.data.prompts import render_prompt
    from vime.data.tasks import get_task
    from vime.models.embedded import EOS_ID, PAD_ID

    transformers.utils.logging.disable_progress_bar()
    task = get_task("reverse")
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    vime_ids = lambda text: render_prompt(text, tokenizer, False)  # noqa: E731
    # TRL tokenizes plain-text prompts with add_special_tokens=True (a <bos> first);
    # vime renders them with add_special_tokens=False: drop the <bos> template so TRL
    # sees vime's ids (checked on the first batch below).
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A $B"
    )
    shape = perf.model_shape(spec["model"])

    def decode(ids: list[int]) -> str:
        # As vime's RolloutManager.decode: the final stop token off, special tokens kept.
        ids = list(ids)
        if ids and ids[-1] == EOS_ID:
            ids.pop()
        return tokenizer.decode(ids, skip_special_tokens=False)

    def reward(prompts, completions, completion_ids, label, **_):
        pairs = zip(completion_ids, label, strict=True)
        return [task.reward(decode(ids), lab) for ids, lab in pairs]

    rec: dict[str, Any] = {"steps": [], "first_generation_time": None, "prompt_check": None}
    first_start = [0.0]  # perf_counter of the first generation: step 1 starts there
    cur = {"gen_s": 0.0, "gen_tokens": 0, "lengths": []}

    class TimedGRPO(GRPOTrainer):
        def _tokenize_prompts(self, prompts):
            ids, *rest = super()._tokenize_prompts(prompts)
            if rec["prompt_check"] is None:
                want = [vime_ids(p) for p in prompts]
                rec["prompt_check"] = {
                    "text": prompts[0], "trl_ids": list(ids[0]), "vime_ids": want[0],
                    "checked": len(prompts), "match": [list(i) for i in ids] == want,
                }  # fmt: skip
            return (ids, *rest)

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            if rec["first_generation_time"] is None:
                rec["first_generation_time"], first_start[0] = time.time(), start
                rec["threads"] = torch.get_num_threads()  # as TRL runs, whatever set it
            out = super()._generate_and_score_completions(inputs)
            cur["gen_s"] += time.perf_counter() - start
            prompt, completion = out["prompt_mask"].sum(1), out["completion_mask"].sum(1)
            cur["gen_tokens"] += int(completion.sum())
            cur["lengths"] += (prompt + completion).tolist()
            return out

    rows = task.make_examples("eval", SEED)[: spec["eval_prompts"]]
    eval_ids = [vime_ids(r["prompt"]) for r in rows]

    def greedy_accuracy(model) -> float:
        """Greedy completions of the eval prompts, scored as vime's eval scores them."""
        width = max(len(i) for i in eval_ids)
        ids = torch.tensor([[PAD_ID] * (width - len(i)) + i for i in eval_ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in eval_ids])
        config = GenerationConfig(do_sample=False, max_new_tokens=spec["max_new"],
                                  eos_token_id=EOS_ID, pad_token_id=PAD_ID)  # fmt: skip
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        model.train(was_training)
        correct = 0
        for row, r in zip(out[:, width:].tolist(), rows, strict=True):
            cut = row.index(EOS_ID) + 1 if EOS_ID in row else len(row)
            correct += task.is_correct(decode(row[:cut]), r["label"])
        return correct / len(rows)

    class StepClock(TrainerCallback):
        """Per optimizer step: wall time since the last step ended (eval excluded), of it
        generation (``_generate_and_score_completions``: generate, reward, advantages)
        and training (the rest: forward/backward micro-batches, clip, AdamW)."""

        last: float | None = None

        def on_step_end(self, _args, state, control, model=None, **_):
            now = time.perf_counter()
            step_s = now - (self.last if self.last is not None else first_start[0])
            flops = perf.train_flops(shape, cur["lengths"])
            step = {
                "step_s": step_s, "gen_s": cur["gen_s"], "train_s": step_s - cur["gen_s"],
                "gen_tok_s": cur["gen_tokens"] / cur["gen_s"],
                "train_tok_s": sum(cur["lengths"]) / (step_s - cur["gen_s"]),
                "train_flops": flops, "eval_acc": None, "eval_s": 0.0,
            }  # fmt: skip
            interval = spec["eval_interval"]
            if interval and rows and state.global_step % interval == 0:
                step["eval_acc"] = greedy_accuracy(model)
                step["eval_s"] = time.perf_counter() - now
            rec["steps"].append(step)
            cur.update(gen_s=0.0, gen_tokens=0, lengths=[])
            self.last = time.perf_counter()  # the eval just run is not the next step's

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    n = spec["samples"]
    config = GRPOConfig(
        output_dir=spec["output_dir"], report_to="none", save_strategy="no", disable_tqdm=True,
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=SEED,
        max_steps=spec["steps"],
        # One rollout of prompts x n samples = one optimizer step over n micro-batches.
        per_device_train_batch_size=spec["prompts"], gradient_accumulation_steps=n,
        num_generations=n, num_iterations=1, max_completion_length=spec["max_new"],
        temperature=1.0, top_p=1.0, top_k=0,
        # "dapo": each micro-batch's token loss sum over the whole rollout's completion
        # tokens (num_items_in_batch), so the step is vime's token-mean over all samples.
        loss_type="dapo", scale_rewards="group", beta=0.0, epsilon=0.2,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-8,
        weight_decay=0.0, max_grad_norm=1.0,
    )  # fmt: skip
    trainer = TimedGRPO(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(task.make_examples("train", SEED)),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()
    Path(spec["out"]).write_text(json.dumps(rec))
    return 0


# ----- report -----------------------------------------------------------------------------


def summarize(run: dict[str, Any], peak: float | None) -> dict[str, Any]:
    steps = run["steps"]
    timed = _timed(steps)
    if "mfu" not in steps[0] and peak:  # TRL: vime's model FLOPs over vime's measured peak
        for s in steps:
            s["mfu"] = s["train_flops"] / s["train_s"] / peak
    half_s, half_step = _time_to_half(steps)
    evals = [s["eval_acc"] for s in steps if s.get("eval_acc") is not None]
    return {
        key: _median([s.get(key) for s in timed])
        for key in ("step_s", "gen_s", "train_s", "sync_s", "gen_tok_s", "train_tok_s", "mfu")
    } | {
        "startup_s": run["startup_s"], "half_s": half_s, "half_step": half_step,
        "last_eval": evals[-1] if evals else None, "steps_run": len(steps),
    }  # fmt: skip


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    import torch
    import transformers
    import trl

    spec, rows = args.spec, figures["rows"]
    runs = figures["runs"]
    vime_threads = "/".join(sorted({str(r["threads"]) for n, r in runs.items() if n != "TRL"}))
    evals = f"greedy eval of {spec['eval_prompts']} prompts every {spec['eval_interval']}"
    print(
        f"vime vs TRL bench: size {args.size}{' (smoke)' if args.smoke else ''} "
        f"(Qwen3, {figures['params'] / 1e6:.2f}M params), "
        f"{spec['prompts']} prompts x {spec['samples']} samples, <= {spec['max_new']} new "
        f"tokens, lr {spec['lr']:g}, {spec['steps']} steps, "
        f"{evals if spec['eval_interval'] else 'no eval'}"
    )
    print(
        f"machine: {os.cpu_count()} cores, torch {torch.__version__} (TRL worker "
        f"{runs['TRL']['threads']} threads, vime {vime_threads} per rank), "
        f"TRL {trl.__version__}, transformers {transformers.__version__}, {figures['date']}"
    )
    check = figures["prompt_check"]
    print(
        f"prompt ids: {check['text']!r} -> vime {check['vime_ids']}, TRL {check['trl_ids']}; "
        f"all {check['checked']} of TRL's first batch match: {'ok' if check['match'] else 'NO'}"
    )
    print(f"initial weights: same file on both sides: {'ok' if figures['same_weights'] else 'NO'}")
    print(
        f"medians over steps {WARMUP + 1}-{spec['steps']} (all if fewer); step times exclude "
        "eval; TRL's generation = _generate_and_score_completions, its training = the rest\n"
    )
    print(
        f"{'side':<10}{'s/step':>8}{'gen s':>8}{'train s':>8}{'sync s':>8}{'gen tok/s':>10}"
        f"{'train tok/s':>12}{'MFU':>7}{'start-up s':>11}{'to 50% s':>10}{'(step)':>7}{'acc':>6}"
    )
    for name, r in rows.items():
        print(
            f"{name:<10}{_fmt(r['step_s'], '.3f'):>8}{_fmt(r['gen_s'], '.3f'):>8}"
            f"{_fmt(r['train_s'], '.3f'):>8}{_fmt(r['sync_s'], '.3f'):>8}"
            f"{_fmt(r['gen_tok_s'], '.0f'):>10}{_fmt(r['train_tok_s'], '.0f'):>12}"
            f"{_fmt(r['mfu'], '.1%'):>7}{_fmt(r['startup_s'], '.1f'):>11}"
            f"{_fmt(r['half_s'], '.1f'):>10}{_fmt(r['half_step'], 'd'):>7}"
            f"{_fmt(r['last_eval'], '.2f'):>6}"
        )
    print()
    for name, ratio in figures["ratios"].items():
        half = _fmt(ratio["time_to_half"], ".2f")
        print(
            f"ratio vime/TRL ({name}): throughput {_fmt(ratio['throughput'], '.2f')}x "
            f"(TRL s/step / vime s/step), time to 50 %: {half}{'x' if half != '-' else ''} "
            "(TRL / vime)"
        )


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    from transformers.utils import logging as hf_logging

    from vime.data.tasks import CHARSET, get_task
    from vime.models.embedded import write_embedded_checkpoint
    from vime.perf import safetensors_shapes

    hf_logging.disable_progress_bar()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vime_vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        spec = args.spec
        model = Path(write_embedded_checkpoint(
            work / "model", charset=CHARSET, seed=SEED, **spec["shape"]
        ))  # fmt: skip
        eval_file = None
        if spec["eval_interval"] and spec["eval_prompts"] < 100:
            eval_file = work / "eval.jsonl"
            rows = get_task("reverse").make_examples("eval", SEED)[: spec["eval_prompts"]]
            eval_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        # One after the other, never together: two torch jobs on the same cores slow
        # each other many-fold.
        runs = {
            f"vime {e}" + (f" K={k}" if k else ""): run_vime(args, e, model, eval_file, work, k)
            for e in args.engines
            for k in args.stalenesses
        }
        runs["TRL"] = run_trl(args, model, work)
        params = sum(math.prod(s) for s in safetensors_shapes(model / "model.safetensors").values())
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    peak = _median([s.get("peak_flops") for r in runs.values() for s in r["steps"]])
    rows = {name: summarize(run, peak) for name, run in runs.items()}
    trl = rows["TRL"]
    ratios = {}
    for name in runs:
        if name == "TRL":
            continue
        v = rows[name]
        ratios[name] = {
            "throughput": trl["step_s"] / v["step_s"],
            "time_to_half": trl["half_s"] / v["half_s"] if trl["half_s"] and v["half_s"] else None,
        }
    check = runs["TRL"]["prompt_check"]
    same_weights = len({r["weights_sha"] for r in runs.values()}) == 1
    figures = {
        "args": {k: v for k, v in vars(args).items() if k != "trl_worker"},
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu_count": os.cpu_count(), "params": params, "peak_flops": peak, "prompt_check": check,
        "same_weights": same_weights, "rows": rows, "ratios": ratios, "runs": runs,
    }  # fmt: skip
    report(args, figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    # Different prompt ids or weights: the two sides did not do the same work.
    return 0 if check["match"] and same_weights else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
