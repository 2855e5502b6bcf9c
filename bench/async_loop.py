"""Synchronous against asynchronous rollout: the same ``vime-train`` work at K = 0, 1, 2.

Where it fits: the check of ``--max-staleness`` (bench/README.md). Each row is a cold
``vime-train`` subprocess (Ray actors, the hf engine, the fsdp2 backend), run one after
the other on the embedded default model and task with the same seed: K = 0 generates,
then trains, in turn; K >= 1 keeps the engine generating while the trainer trains, on
batches at most K weight versions old. Every row but one pins the training rank and the
engine to cores of their own (``--cpu-split on``), so the synchronous baseline has the
same threads as the asynchronous rows; one synchronous row with ``--cpu-split off``
(both sides on every core, today's default) is there for reference.

The throughput work is the embedded default with longer responses (``--response-len``,
128 by default, against the default's 8: most stop at EOS well before), so that in a
synchronous step the rollout and train phases are about even and neither takes more
than two thirds of the step: the most the overlap can then buy is visible. Each
synchronous row prints its phases' shares of the step time, so a reader sees whether
that condition held.

Printed per row: trained samples/s (rollout batch x samples per prompt over the median
step, and over the sum of all step times), the ratio to the synchronous split row, the
engine's and the trainer's idle fractions (means), staleness (mean and max) and the stale
groups dropped; medians and means skip the first 2 steps. ``--learn`` runs the embedded
default itself (400 rollouts, greedy eval every 20) at K = 0 and K = 1, and the reference
row, and prints the seconds of steps (eval excluded) to 50 % greedy accuracy.

    PYTHONPATH=. python bench/async_loop.py                # throughput, 4 rows; run it alone
    PYTHONPATH=. python bench/async_loop.py --learn        # time to 50 %, 3 rows of ~5 min
    PYTHONPATH=. python bench/async_loop.py --smoke        # tiny, K = 0 and 1, for the tests
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
WARMUP = 2  # steps left out of medians and means: allocation, first kernels, Ray's first calls
SHARE_LIMIT = 2 / 3  # neither phase of a synchronous step should take more than this

# (rollouts, prompts per rollout, samples per prompt, response length, eval interval);
# None: vime-train's embedded default. An eval interval past the last rollout leaves only
# the final eval, after the timed steps.
MODES: dict[str, dict[str, Any]] = {
    "throughput": dict(rollouts=60, prompts=None, samples=None, response_len=128, eval=None),
    "learn": dict(rollouts=400, prompts=None, samples=None, response_len=None, eval=20),
    "smoke": dict(rollouts=3, prompts=4, samples=2, response_len=None, eval=2),
}  # fmt: skip
EMBEDDED = dict(prompts=64, samples=8, response_len=8)  # vime/config/flags.py's defaults


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--learn",
        action="store_true",
        help="the embedded default, 400 rollouts at K = 0 and 1 (and the reference row): "
        "time to 50 %% greedy accuracy",
    )
    p.add_argument("--smoke", action="store_true", help="3 rollouts of 4 x 2, K = 0 and 1")
    p.add_argument("--rollouts", type=int, help="rollouts a row (default per mode)")
    p.add_argument("--rollout-batch-size", type=int, help="prompts a rollout")
    p.add_argument("--n-samples-per-prompt", type=int, help="samples a prompt")
    p.add_argument("--response-len", type=int, help="--rollout-max-response-len")
    p.add_argument("--eval-interval", type=int, help="greedy eval every K rollouts")
    p.add_argument(
        "--staleness",
        help="the asynchronous rows' K, comma-separated (default 1,2; --learn, --smoke: 1)",
    )
    p.add_argument(
        "--no-reference", action="store_true", help="leave out the synchronous --cpu-split off row"
    )
    p.add_argument("--vime-flags", default="", help="more vime-train flags for every row")
    p.add_argument("--workdir", help="keep outputs and logs here (default: a temp dir)")
    p.add_argument("--json", help="also write every figure to this file")
    args = p.parse_args(argv)
    args.mode = "smoke" if args.smoke else "learn" if args.learn else "throughput"
    spec = dict(MODES[args.mode])
    for key, flag in (("rollouts", "rollouts"), ("prompts", "rollout_batch_size"),
                      ("samples", "n_samples_per_prompt"), ("response_len", "response_len"),
                      ("eval", "eval_interval")):  # fmt: skip
        if getattr(args, flag) is not None:
            spec[key] = getattr(args, flag)
    args.spec = spec
    staleness = args.staleness or ("1,2" if args.mode == "throughput" else "1")
    ks = [int(k) for k in staleness.split(",") if k.strip()]
    if any(k < 1 for k in ks):
        p.error("--staleness: the asynchronous rows' K are >= 1")
    reference = args.mode != "smoke" and not args.no_reference
    # (label, K, --cpu-split): the synchronous split row first, the baseline of the ratios.
    args.rows = [("K=0", 0, "on"), *((f"K={k}", k, "on") for k in ks)]
    if reference:
        args.rows.append(("K=0 split off (ref)", 0, "off"))
    return args


def _flags(args: argparse.Namespace, k: int, split: str, out: Path) -> list[str]:
    spec = args.spec
    flags = ["--output-dir", str(out), "--num-rollout", str(spec["rollouts"]), "--seed",
             str(SEED), "--rollout-engine", "hf", "--max-staleness", str(k),
             "--cpu-split", split]  # fmt: skip
    if spec["prompts"] is not None:
        flags += ["--rollout-batch-size", str(spec["prompts"])]
    if spec["samples"] is not None:
        flags += ["--n-samples-per-prompt", str(spec["samples"])]
    if spec["response_len"] is not None:
        flags += ["--rollout-max-response-len", str(spec["response_len"])]
    flags += ["--eval-interval", str(spec["eval"] or spec["rollouts"] + 1)]
    return flags + args.vime_flags.split()


def _batch(spec: dict[str, Any]) -> int:
    prompts = spec["prompts"] or EMBEDDED["prompts"]
    return prompts * (spec["samples"] or EMBEDDED["samples"])


def run_row(args: argparse.Namespace, label: str, k: int, split: str, work: Path) -> dict:
    """One cold ``vime-train`` run to its end; its flags, wall time and metrics lines."""
    name = label.split()[0].replace("=", "") + ("_off" if split == "off" else "")
    out, log = work / name, work / f"{name}.log"
    shutil.rmtree(out, ignore_errors=True)  # a kept --workdir: metrics.jsonl starts afresh
    flags = _flags(args, k, split, out)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    print(f"running {label}: vime-train {' '.join(flags)}", flush=True)
    started = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.run([sys.executable, "-m", "vime.cli", *flags], cwd=ROOT, env=env,
                              stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        sys.exit(f"{label}: vime-train failed (exit {proc.returncode}):\n{tail}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"label": label, "k": k, "cpu_split": split, "flags": flags, "wall_s": wall,
            "metrics": lines, "final_eval": summary.get("final_eval")}  # fmt: skip


# ----- figures ----------------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _time_to_half(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds of steps (eval excluded, and included) and the rollout at the first eval
    with greedy accuracy >= 0.5; None where it never got there."""
    steps_s = with_eval_s = 0.0
    for m in lines:
        with_eval_s += m["perf/step_time_s"]
        steps_s += m["perf/step_time_s"] - m.get("phase/eval_s", 0.0)
        if m.get("eval/pass@1") is not None and m["eval/pass@1"] >= 0.5:
            return {"s": steps_s, "s_with_eval": with_eval_s, "rollout": m["rollout_id"] + 1}
    return {"s": None, "s_with_eval": None, "rollout": None}


def summarize(run: dict[str, Any], batch: int) -> dict[str, Any]:
    lines = run["metrics"]
    timed = lines[WARMUP:] or lines[-1:]
    step = [m["perf/step_time_s"] - m.get("phase/eval_s", 0.0) for m in timed]
    total = sum(m["perf/step_time_s"] - m.get("phase/eval_s", 0.0) for m in lines)
    median = statistics.median(step)
    phases = {p: sum(m.get(f"phase/{p}_s", 0.0) for m in timed) / sum(step)
              for p in ("rollout", "train", "sync", "probe")}  # fmt: skip
    evals = [m["eval/pass@1"] for m in lines if m.get("eval/pass@1") is not None]
    rewards = [m["rollout/reward_mean"] for m in lines]
    # Only the asynchronous loop reports staleness (a synchronous batch is never stale).
    stale_max = [m["async/staleness_max"] for m in lines if "async/staleness_max" in m]
    dropped = [m["async/groups_stale_dropped"] for m in lines if "async/staleness_max" in m]
    return {
        "steps": len(lines), "step_s": median, "steps_total_s": total,
        "samples_per_s": batch / median, "samples_per_s_whole": batch * len(lines) / total,
        "rollout_s": statistics.median(m["phase/rollout_s"] for m in timed),
        "train_s": statistics.median(m["phase/train_s"] for m in timed),
        "sync_s": statistics.median(m["phase/sync_s"] for m in timed),
        "phase_share": phases,
        "engine_idle": _mean([m.get("perf/engine_idle_frac_mean") for m in timed]),
        "trainer_idle": _mean([m.get("perf/trainer_idle_frac_mean") for m in timed]),
        "staleness_mean": _mean([m.get("async/staleness_mean") for m in timed]),
        "staleness_max": max(stale_max) if stale_max else None,
        "stale_dropped": sum(dropped) if dropped else None,
        "response_len": _mean([m.get("rollout/response_len_mean") for m in timed]),
        "reward_first": _mean(rewards[:5]), "reward_last": _mean(rewards[-5:]),
        "startup_s": lines[0].get("perf/startup_s"), "to_half": _time_to_half(lines),
        "last_eval": evals[-1] if evals else None,
    }  # fmt: skip


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    import torch

    spec, rows = args.spec, figures["rows"]
    prompts = spec["prompts"] or EMBEDDED["prompts"]
    samples = spec["samples"] or EMBEDDED["samples"]
    length = spec["response_len"] or EMBEDDED["response_len"]
    evals = f"greedy eval every {spec['eval']}" if spec["eval"] else "eval only after the steps"
    print(
        f"\nasync loop bench: {args.mode}, embedded model and task, {prompts} prompts x "
        f"{samples} samples, <= {length} new tokens, "
        f"{spec['rollouts']} rollouts a row, {evals}, hf engine, fsdp2"
    )
    before, after = figures["load"]
    print(
        f"machine: {os.cpu_count()} cores, torch {torch.__version__}, {figures['date']}, "
        f"1-min load average {before:.2f} before the runs, {after:.2f} after"
    )
    print(
        f"medians and means over steps {WARMUP + 1}-{spec['rollouts']} (all if fewer); "
        f"samples/s = {figures['batch']} samples a rollout over the median step, and over "
        "the sum of all step times (whole); step times exclude eval\n"
    )
    for label, r in rows.items():
        if r["k"] == 0:
            share = r["phase_share"]
            held = max(share["rollout"], share["train"]) <= SHARE_LIMIT
            print(
                f"sync step, {label}: rollout {share['rollout']:.0%}, train {share['train']:.0%}, "
                f"sync {share['sync']:.0%}, probe {share['probe']:.0%} of the step time; "
                f"neither phase over 2/3: {'yes' if held else 'NO'}"
            )
    print()
    print(
        f"{'row':<21}{'s/step':>8}{'samples/s':>10}{'whole':>8}{'x sync':>8}{'x whole':>8}"
        f"{'gen s':>7}{'train s':>8}{'eng idle':>9}{'trn idle':>9}{'stale':>7}{'max':>5}"
        f"{'dropped':>8}{'len':>6}{'reward':>12}"
    )
    for label, r in rows.items():
        ratio = figures["ratios"][label]
        print(
            f"{label:<21}{r['step_s']:>8.3f}{r['samples_per_s']:>10.0f}"
            f"{r['samples_per_s_whole']:>8.0f}{_fmt(ratio['median'], '.2f'):>8}"
            f"{_fmt(ratio['whole'], '.2f'):>8}{r['rollout_s']:>7.3f}{r['train_s']:>8.3f}"
            f"{_fmt(r['engine_idle'], '.2f'):>9}{_fmt(r['trainer_idle'], '.2f'):>9}"
            f"{_fmt(r['staleness_mean'], '.2f'):>7}{_fmt(r['staleness_max'], '.0f'):>5}"
            f"{_fmt(r['stale_dropped'], '.0f'):>8}{_fmt(r['response_len'], '.1f'):>6}"
            f"{_fmt(r['reward_first'], '.2f'):>6}{_fmt(r['reward_last'], '.2f'):>6}"
        )
    print(
        "\nx sync: samples/s over the K=0 --cpu-split on row's (x whole: over whole runs); "
        "gen s: the step's rollout phase (asynchronous: the wait for a ready batch); "
        "reward: mean of the first and of the last 5 rollouts"
    )
    if spec["eval"]:
        print(f"\n{'row':<21}{'to 50% s':>9}{'(with eval)':>12}{'rollout':>8}{'last acc':>9}")
        for label, r in rows.items():
            half = r["to_half"]
            print(
                f"{label:<21}{_fmt(half['s'], '.1f'):>9}{_fmt(half['s_with_eval'], '.1f'):>12}"
                f"{_fmt(half['rollout'], 'd'):>8}{_fmt(r['last_eval'], '.2f'):>9}"
            )
        for label, ratio in figures["ratios"].items():
            if label != "K=0":
                print(f"time to 50 %, K=0 / {label}: {_fmt(ratio['time_to_half'], '.2f')}")


def main(argv: list[str]) -> int:
    args = parse(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vime_async_loop_"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    try:
        # One after the other, never together: two torch jobs on the same cores slow
        # each other many-fold.
        runs = {label: run_row(args, label, k, split, work) for label, k, split in args.rows}
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    batch = _batch(args.spec)
    rows = {label: {"k": run["k"], **summarize(run, batch)} for label, run in runs.items()}
    base = rows["K=0"]
    ratios = {}
    for label, r in rows.items():
        half, base_half = r["to_half"]["s"], base["to_half"]["s"]
        ratios[label] = {
            "median": r["samples_per_s"] / base["samples_per_s"],
            "whole": r["samples_per_s_whole"] / base["samples_per_s_whole"],
            "time_to_half": base_half / half if half and base_half else None,
        }
    figures = {
        "args": dict(vars(args)),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu_count": os.cpu_count(), "load": (load_before, os.getloadavg()[0]),
        "batch": batch, "rows": rows, "ratios": ratios, "runs": runs,
    }  # fmt: skip
    report(args, figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
