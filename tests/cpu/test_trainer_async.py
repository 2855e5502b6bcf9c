"""``vime-train --max-staleness K`` end to end, and its refusals.

Proves, on real processes: with K = 1 a run trains every rollout on samples at most one
version old (two fsdp2 ranks on gloo, an hf engine on a core of its own, every thread
of each process pinned), weights its loss by the behaviour correction without being
asked, logs the asynchronous metrics, keeps
the probe check exact after every in-flight weight sync, and evaluates and checkpoints
while the producer runs; the checkpoint holds the prompts in flight, and a resumed run
(K = 1) finishes from it; resuming it synchronously is refused in one
line; Ctrl-C stops it with its outputs and in-flight prompts kept. With K = 2 the gloo
broadcast streaming into an engine that is generating, failing rewards, dynamic
sampling and the rollout correction all run. ``--colocate`` and an engine that cannot
take weights mid-generation are refused while parsing.
"""

from __future__ import annotations

import ast
import json
import math
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.cpu.test_trainer import FLAKY_REWARD, REQUIRED, SMALL, _metrics, _start, _train
from vime.checkpoint import TRACKER, iteration_dir, load_metadata
from vime.config.parser import parse_args
from vime.errors import ConfigError

ASYNC = ["--max-staleness", "1"]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("async")
    result = _train(
        *ASYNC,
        *("--num-rollout", "4", "--output-dir", str(out / "out")),
        *("--save", str(out / "ckpt"), "--save-interval", "2", "--eval-interval", "2"),
        cwd=out,
    )
    (out / "stdout.txt").write_text(result.stdout)
    return out


def test_every_rollout_trains_samples_at_most_k_old(async_run: Path) -> None:
    rows = _metrics(async_run / "out")
    stdout = (async_run / "stdout.txt").read_text()
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        # Scoring runs in the producer's thread, in whichever step a call returns.
        missing = [k for k in REQUIRED if k not in r and k != "phase/reward_s"]
        assert not missing, missing
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 1
        assert r["async/groups_in_flight"] >= 0 and r["async/buffer_groups"] >= 0
        assert r["perf/rollout_tokens_per_s"] >= 0  # 0 where no call returned in the step
        assert r["weights/version"] == r["rollout_id"] + 1
        assert r["weights/probe_logprob_abs_diff"] < 1e-4  # the engines serve what trained
        assert r["train/train_rollout_logprob_abs_diff"] >= 0
        # Decoupled PPO's behaviour correction is on by default (no --use-tis given).
        assert r["train/tis_weight_mean"] > 0 and "train/tis_truncated_frac" in r
    assert sum(r["perf/rollout_tokens_per_s"] for r in rows) > 0
    assert rows[0]["async/staleness_max"] == 0  # the first batch: version 0, trained at 0
    assert max(r["async/staleness_max"] for r in rows) == 1  # generation ran ahead
    assert "eval/pass@1" in rows[1] and "eval/pass@1" in rows[3]
    # Each side on cores of its own, as the processes report them.
    line = next(x for x in stdout.splitlines() if "CPU cores split" in x)
    found = re.fullmatch(r".*: training (\[.*\]), engines (\[.*\])", line)
    assert found, line
    training, engines = (ast.literal_eval(found.group(k)) for k in (1, 2))
    assert len(training) == 2 and len(engines) == 1
    assert not {c for r in training for c in r} & {c for e in engines for c in e}
    summary = json.loads((async_run / "out" / "summary.json").read_text())
    assert summary["status"] == "done"


def test_a_checkpoint_keeps_the_prompts_in_flight_and_resumes(
    async_run: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(iteration_dir(async_run / "ckpt", 1), iteration_dir(ckpt, 1))
    (ckpt / TRACKER).write_text("1\n")
    position = load_metadata(iteration_dir(ckpt, 1))["extra"]["data"]
    assert position["pending"]  # generation ran ahead of the checkpoint
    out = tmp_path / "out"
    _train(
        *ASYNC, "--num-rollout", "4", "--output-dir", str(out), "--load", str(ckpt), cwd=tmp_path
    )
    resumed = _metrics(out)
    assert [r["rollout_id"] for r in resumed] == [2, 3]
    assert all(r["async/staleness_max"] <= 1 for r in resumed)
    assert resumed[-1]["weights/version"] == 4

    with pytest.raises(AssertionError, match="asynchronous run had drawn and not trained"):
        _train(
            "--num-rollout",
            "4",
            "--output-dir",
            str(tmp_path / "o2"),
            "--load",
            str(ckpt),
            cwd=tmp_path,
        )


def test_filtered_groups_failing_rewards_and_a_streamed_broadcast(tmp_path: Path) -> None:
    """K = 2 with the gloo broadcast streaming one tensor a call into the engine while it
    generates, a reward that raises for some samples (counted, masked, the run goes on),
    dynamic sampling discarding groups whose rewards agree, and the rollout correction
    between the recomputed pi_old and the engine's log-probs (mask mode, reported)."""
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    _train(
        *("--max-staleness", "2", "--num-rollout", "4", "--output-dir", str(tmp_path / "out")),
        *("--weight-sync", "broadcast", "--update-weight-buffer-size", "4096"),
        *("--custom-rm-path", "flaky:reward", "--dynamic-sampling-filter"),
        *("--use-tis", "--tis-mode", "mask"),
        cwd=tmp_path,
    )
    rows = _metrics(tmp_path / "out")
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["rollout/reward_failures"] for r in rows) > 0
    for row in rows:
        assert row["async/staleness_max"] <= 2
        assert row["weights/version"] == row["rollout_id"] + 1
        assert row["weights/probe_logprob_abs_diff"] < 1e-4
        assert "rollout/groups_filtered" in row and "train/tis_masked_frac" in row
        assert math.isfinite(row["train/loss"])


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--colocate"], "drop --colocate or use --max-staleness 0"),
        (["--cpu-split", "on", "--colocate", "--max-staleness", "0"], "drop one of the two"),
    ],
)
def test_refused_while_parsing(flags: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_args([*SMALL, *ASYNC, *flags], for_run=True)


def test_ctrl_c_stops_an_asynchronous_run_and_keeps_its_outputs(tmp_path: Path) -> None:
    """Ctrl-C while the producer's thread generates: exit 130 within a bounded time, no
    traceback, the metrics and the summary kept, and the checkpoint holds the prompts
    in flight."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = [*ASYNC, "--num-rollout", "1000", "--output-dir", str(out)]
    proc = _start(*args, "--save", str(ckpt), "--save-interval", "2", cwd=tmp_path)
    try:
        deadline = time.monotonic() + 600
        while not (ckpt / TRACKER).exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.5)
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout[-2000:] + stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    rows = _metrics(out)
    assert rows and all(r["async/staleness_max"] <= 1 for r in rows)
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"
    last = int((ckpt / TRACKER).read_text())
    assert load_metadata(iteration_dir(ckpt, last))["extra"]["data"]["pending"]
