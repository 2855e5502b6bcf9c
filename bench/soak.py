"""A soak run: the embedded default with its engine and a training rank killed, against
the same run undisturbed.

Where it fits: the long check of vime's fault handling (``--max-engine-restarts``,
``--auto-resume``; bench/README.md), run alone on the machine, never in CI. Two cold
``vime-train`` subprocesses, one after the other, with the same seed and flags
(``--save`` every ``--save-interval`` rollouts, ``--auto-resume 2``, restarts enough
for every kill): first undisturbed, then disturbed: watching the run's metrics.jsonl,
this script SIGKILLs the rollout engine's process (the Ray actor ``ray::EngineActor``
among the run's own processes, caught generating where it can be) as each multiple of
``--kill-every`` rollouts starts, and one training rank's (``ray::TrainWorker``) once,
midway between two engine kills. Then it prints, from each run's own records:

(a) the data read exactly once: metrics.jsonl holds one line per rollout, each naming
    the rows it trained (``rollout/prompt_indices``), as many as it drew; laid end to
    end they hold every prompt once an epoch, and as many as the last checkpoint's data
    position says were read;
(b) the final greedy accuracy (summary.json) of both runs, and whether the difference
    is within noise (two binomial standard errors of the difference);
(c) the engine restarts and auto-resumes (``fault/engine_restarts`` summed over the
    run's segments, ``fault/auto_resumes``; the run's log lines agree) against the
    kills sent, and the wall time they cost: the disturbed run's minus the
    undisturbed one's, each engine restart's (its rollout's step against the same
    rollout undisturbed) and the auto-resume's (the rest).

Exit status 1 if (a), (b) or the counts fail.

    PYTHONPATH=. python bench/soak.py                              # 1000 rollouts: ~13 min alone
    PYTHONPATH=. python bench/soak.py --rollouts 40 --kill-every 10   # a short check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vime.auto_resume import RESUMES_KEY
from vime.checkpoint import iteration_dir, latest, load_metadata
from vime.ray.engine_watch import RESTARTS_KEY
from vime.rollout.manager import PROMPT_INDICES_KEY
from vime.tracking import METRICS_FILE, read_metrics

ROOT = Path(__file__).resolve().parents[1]
# What is killed: the Ray actor's process title, and the call it is caught in.
TARGETS = {"engine": ("ray::EngineActor", "generate"), "rank": ("ray::TrainWorker", "train")}
POLL_S = 0.2
TAIL_BYTES = 1 << 16  # more than one metrics line
# How long a kill waits for its target to be seen at work (generating, training) before
# it kills it anyway: a step of the embedded default takes well under this.
CATCH_S = 10.0
RESTART_LINE = "restarted it on its bundle"
RESUME_LINE = "vime-train: run failed"
SAME_KEYS = (PROMPT_INDICES_KEY, "rollout/reward_mean", "train/loss")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=1000, help="rollouts of each run")
    p.add_argument("--kill-every", type=int, default=100, help="kill the engine every K rollouts")
    p.add_argument("--seed", type=int, default=1234, help="both runs' --seed")
    p.add_argument(
        "--save-interval", type=int, help="both runs' --save-interval (default: kill-every / 4)"
    )
    p.add_argument("--vime-flags", default="", help="more vime-train flags for both runs")
    p.add_argument("--workdir", help="keep the runs' folders here (default: a temporary one)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.kill_every < 2 or args.rollouts <= args.kill_every:
        p.error("--kill-every must be at least 2 and below --rollouts")
    args.save_interval = args.save_interval or max(1, args.kill_every // 4)
    args.engine_kills = list(range(args.kill_every, args.rollouts, args.kill_every))
    # One past the middle of the middle interval between engine kills: between two
    # checkpoints, so the resume redoes a rollout or more, as a real crash would.
    middle = args.engine_kills[(len(args.engine_kills) - 1) // 2]
    args.rank_kill = min(middle + args.kill_every // 2 + 1, args.rollouts - 1)
    return args


def _flags(args: argparse.Namespace, out: Path) -> list[str]:
    restarts = len(args.engine_kills) + 1  # all in one segment, at worst
    return [
        *("--output-dir", str(out / "run"), "--num-rollout", str(args.rollouts)),
        *("--seed", str(args.seed), "--save", str(out / "ckpt")),
        *("--save-interval", str(args.save_interval), "--keep-last-checkpoints", "2"),
        *("--auto-resume", "2", "--max-engine-restarts", str(restarts)),
        *args.vime_flags.split(),
    ]


# ----- the run and its faults --------------------------------------------------------------


def _actor_pids(root: int, name: str) -> list[tuple[int, str]]:
    """(pid, title) of this run's live Ray actor processes titled ``name`` (Ray titles a
    worker ``ray::Class`` idle and ``ray::Class.method`` at work)."""
    import psutil

    found = []
    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for proc in procs:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            title = " ".join(proc.cmdline()).strip()  # Ray pads its titles
        except psutil.Error:
            continue
        if title == name or title.startswith(name + "."):
            found.append((proc.pid, title))
    return found


def _kill(root: int, kind: str, rollout: int, log: list[dict]) -> bool:
    """SIGKILL this run's ``kind`` process (``TARGETS``), once seen at work (or after
    ``CATCH_S``); noted in ``log``. False if no such process is there (yet)."""
    name, busy = TARGETS[kind]
    deadline = time.monotonic() + CATCH_S
    while True:
        procs = _actor_pids(root, name)
        if not procs:
            return False
        working = [p for p in procs if p[1].startswith(f"{name}.{busy}")]
        if working or time.monotonic() > deadline:
            pid, title = (working or procs)[0]
            os.kill(pid, signal.SIGKILL)
            log.append({"kind": kind, "rollout": rollout, "pid": pid, "title": title})
            print(f"  killed the {kind} in rollout {rollout}: pid {pid} ({title})", flush=True)
            return True
        time.sleep(0.05)


def _last_rollout(metrics: Path) -> int:
    """The last rollout metrics.jsonl holds, -1 before the first: read from its tail
    only, as the script polls it all run long on the run's own cores."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return -1
    for line in reversed(lines):
        try:
            return json.loads(line)["rollout_id"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the seek or half written
    return -1


def run(args: argparse.Namespace, out: Path, disturbed: bool) -> dict[str, Any]:
    """One cold ``vime-train`` to its end, killing as the docstring says when
    ``disturbed``; its wall time, the kills sent and its log's path."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    flags, log = _flags(args, out), out / "vime-train.log"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    label = "disturbed" if disturbed else "undisturbed"
    print(f"running {label}: vime-train {' '.join(flags)}", flush=True)
    due = sorted([(r, "engine") for r in args.engine_kills] + [(args.rank_kill, "rank")])
    due = due if disturbed else []
    kills: list[dict] = []
    started = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "vime.cli", *flags], cwd=ROOT, env=env,
                                stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
        while proc.poll() is None:
            time.sleep(POLL_S)
            # The rollout after the last line logged is the one under way.
            now = _last_rollout(out / "run" / METRICS_FILE) + 1
            if due and now >= due[0][0] and _kill(proc.pid, due[0][1], now, kills):
                due.pop(0)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        sys.exit(f"{label}: vime-train failed (exit {proc.returncode}):\n{tail}")
    if due:
        sys.exit(f"{label}: kills never sent (no such process found): {due}")
    return {"label": label, "out": out, "wall_s": wall, "kills": kills, "log": log}


# ----- the checks --------------------------------------------------------------------------


def data_read_once(out: Path, rollouts: int) -> tuple[bool, str]:
    """Check (a) on a finished run's folder: (passed, what was found)."""
    rows = read_metrics(out / "run" / METRICS_FILE)
    if [r["rollout_id"] for r in rows] != list(range(rollouts)):
        return False, f"metrics.jsonl's rollouts are not 0..{rollouts - 1} once each"
    if any(len(r[PROMPT_INDICES_KEY]) != r["rollout/prompts_drawn"] for r in rows):
        return False, "a rollout trained other than the prompts it drew"
    flat = [i for r in rows for i in r[PROMPT_INDICES_KEY]]
    save = out / "ckpt"
    data = load_metadata(iteration_dir(save, latest(save)))["extra"]["data"]
    source, pending = data["prompts"], data.get("pending", [])  # pending: drawn, not trained
    size = source["num_prompts"]
    position = source["epoch"] * size + source["position"]
    if position != len(flat) + len(pending):
        return False, (
            f"the checkpoint read {position} prompts; metrics.jsonl trained {len(flat)}, "
            f"{len(pending)} pending"
        )
    epochs = [flat[k : k + size] for k in range(0, len(flat), size)]
    full = {frozenset(e) for e in epochs if len(e) == size}
    if any(len(set(e)) != len(e) for e in epochs) or len(full) > 1:
        return False, "a prompt was read twice within an epoch"
    return True, (
        f"{len(flat)} prompts over {rollouts} rollouts, {len(epochs)} epoch(s) of {size} "
        "begun, each prompt once an epoch; the checkpoint's data position agrees"
    )


def _final_eval(out: Path) -> dict[str, float]:
    summary = json.loads((out / "run" / "summary.json").read_text())
    return summary["final_eval"]


def accuracy(plain: Path, disturbed: Path) -> tuple[bool, dict[str, float]]:
    """Check (b): both runs' final greedy accuracy, within two standard errors of the
    difference of two binomial means over the eval prompts (at least one prompt)."""
    a, b = _final_eval(plain), _final_eval(disturbed)
    n = a["eval/num_prompts"]
    pa, pb = a["eval/pass@1"], b["eval/pass@1"]
    mean = (pa + pb) / 2
    noise = max(2 * math.sqrt(2 * mean * (1 - mean) / n), 1 / n)
    figures = {"undisturbed": pa, "disturbed": pb, "noise": noise, "prompts": n}
    return abs(pa - pb) <= noise + 1e-9, figures


def _segments(rows: list[dict]) -> list[list[dict]]:
    """metrics.jsonl's lines by process: a restarted run's first line has ``RESUMES_KEY``."""
    segments: list[list[dict]] = [[]]
    for row in rows:
        if row.get(RESUMES_KEY) and segments[-1]:
            segments.append([])
        segments[-1].append(row)
    return segments


def faults(plain: dict[str, Any], disturbed: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """Check (c): the restarts the run counted against the kills sent, and their cost."""
    rows = read_metrics(disturbed["out"] / "run" / METRICS_FILE)
    base = {r["rollout_id"]: r for r in read_metrics(plain["out"] / "run" / METRICS_FILE)}
    restarts = sum(max(r.get(RESTARTS_KEY, 0.0) for r in s) for s in _segments(rows))
    resumes = max((r.get(RESUMES_KEY, 0.0) for r in rows), default=0.0)
    text = disturbed["log"].read_text()
    said = {"engine": text.count(RESTART_LINE), "resume": text.count(RESUME_LINE)}
    sent = {k: sum(x["kind"] == k for x in disturbed["kills"]) for k in TARGETS}
    # Each engine restart's cost: its rollout's step against the same rollout undisturbed.
    restarted = []
    for segment in _segments(rows):
        last = 0.0  # each process counts from 0
        for row in segment:
            if row.get(RESTARTS_KEY, 0.0) > last:
                step = row["perf/step_time_s"] - base[row["rollout_id"]]["perf/step_time_s"]
                restarted.append(step)
            last = row.get(RESTARTS_KEY, 0.0)
    cost = disturbed["wall_s"] - plain["wall_s"]
    engine_cost = sum(restarted)
    figures = {
        "kills_sent": sent,
        "engine_restarts": restarts,
        "auto_resumes": resumes,
        "log_lines": said,
        "wall_s": {"undisturbed": plain["wall_s"], "disturbed": disturbed["wall_s"]},
        "cost_s": cost,
        "engine_restart_s": restarted,
        "auto_resume_s": (cost - engine_cost) / resumes if resumes else None,
    }
    # A restart the lost rollouts of a resumed segment logged is in the log, not the lines.
    counted = restarts <= sent["engine"] == said["engine"] and resumes == sent["rank"]
    return counted and said["resume"] == sent["rank"], figures


def report(plain: dict[str, Any], disturbed: dict[str, Any], args: argparse.Namespace) -> bool:
    ok = True
    print(f"\nsoak: {args.rollouts} rollouts, engine killed every {args.kill_every}, "
          f"a training rank in rollout {args.rank_kill}, seed {args.seed}")  # fmt: skip
    for run_ in (plain, disturbed):
        passed, text = data_read_once(run_["out"], args.rollouts)
        ok &= passed
        print(f"(a) data, {run_['label']}: {'ok' if passed else 'FAILED'}: {text}")
    # Not a check: the faults need not change what is trained, but where they do not, the
    # disturbed run trained the very same prompts in the same order, each as well rewarded.
    rows = [read_metrics(r["out"] / "run" / METRICS_FILE) for r in (plain, disturbed)]
    same = {k: sum(a[k] == b[k] for a, b in zip(*rows, strict=False)) for k in SAME_KEYS}
    print(f"    rollouts alike in both runs, of {args.rollouts}: {same}")
    passed, acc = accuracy(plain["out"], disturbed["out"])
    ok &= passed
    print(f"(b) final greedy accuracy: undisturbed {acc['undisturbed']:.3f}, disturbed "
          f"{acc['disturbed']:.3f} over {acc['prompts']:.0f} prompts: "
          f"{'within' if passed else 'OUTSIDE'} noise ({acc['noise']:.3f})")  # fmt: skip
    passed, f = faults(plain, disturbed)
    ok &= passed
    each = f["engine_restart_s"]
    per = f"{statistics.median(each):.2f} s median" if each else "none counted"
    resume = f"{f['auto_resume_s']:.1f} s each" if f["auto_resume_s"] is not None else "none"
    print(f"(c) faults: {'ok' if passed else 'FAILED'}: kills sent {f['kills_sent']}; "
          f"fault/engine_restarts {f['engine_restarts']:.0f}, fault/auto_resumes "
          f"{f['auto_resumes']:.0f}; log lines {f['log_lines']}")  # fmt: skip
    print(f"    wall: undisturbed {f['wall_s']['undisturbed']:.1f} s, disturbed "
          f"{f['wall_s']['disturbed']:.1f} s: the faults cost {f['cost_s']:.1f} s; "
          f"an engine restart {per}, an auto-resume {resume}")  # fmt: skip
    if args.json:
        figures = {"args": {k: v for k, v in vars(args).items()}, "accuracy": acc, "faults": f,
                   "kills": disturbed["kills"], "ok": ok}  # fmt: skip
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))
    return ok


def main(argv: list[str]) -> int:
    args = parse(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vime_soak_"))
    load_before = os.getloadavg()[0]
    try:
        # One after the other, never together (bench/README.md).
        plain = run(args, work / "undisturbed", disturbed=False)
        disturbed = run(args, work / "disturbed", disturbed=True)
        ok = report(plain, disturbed, args)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
