"""``vime-train --max-staleness K`` end to end, and its refusals.

Proves, on real processes: with K = 1 a run trains every rollout on samples at most one
version old (two fsdp2 ranks on gloo, an hf engine on a core of its own, every thread
of each process pinned), weights its loss by the behaviour correction without being
asked, logs the asynchronous metrics, keeps
the probe check exact after every in-flight weight sync, and evaluates and checkpoints
while the producer runs; the checkpoint holds the prompts in flight, and a resumed run
(K = 1) trains on from it; resuming it synchronously is refused in one line; Ctrl-C
stops an asynchronous run with its outputs and in-flight prompts kept. The resumed run
is the one Ctrl-C stops (a start of ``vime-train`` costs the suite more than its
rollouts), each claim asserted in a test of its own. With K = 2 the gloo
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
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.cpu.test_trainer import (
    FLAKY_REWARD,
    REQUIRED,
    SMALL,
    _metrics,
    _start,
    _stop_after_a_save,
    _train,
)
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


@pytest.fixture(scope="module")
def stopped_resume(async_run: Path, tmp_path_factory) -> SimpleNamespace:
    """A K = 1 run resumed from the checkpoint of rollout 1 (in flight: prompts drawn and
    not trained), saving every 2 rollouts to a folder of its own, and stopped by Ctrl-C
    once it saved (after rollout 3) while its producer's thread generates."""
    tmp_path = tmp_path_factory.mktemp("resume")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(iteration_dir(async_run / "ckpt", 1), iteration_dir(ckpt, 1))
    (ckpt / TRACKER).write_text("1\n")
    out, saved = tmp_path / "out", tmp_path / "saved"
    args = [*ASYNC, "--num-rollout", "1000", "--output-dir", str(out), "--load", str(ckpt)]
    proc = _start(*args, "--save", str(saved), "--save-interval", "2", cwd=tmp_path)
    stdout, stderr = _stop_after_a_save(proc, saved, signal.SIGINT, settle_s=1, timeout_s=60)
    return SimpleNamespace(
        tmp_path=tmp_path, ckpt=ckpt, out=out, saved=saved, code=proc.returncode,
        console=stdout[-2000:] + stderr[-3000:], stderr=stderr,
    )  # fmt: skip


def test_a_checkpoint_keeps_the_prompts_in_flight_and_resumes(
    stopped_resume: SimpleNamespace,
) -> None:
    """The checkpoint of rollout 1 holds prompts in flight; a K = 1 run resumed from it
    trains rollouts 2 and 3 (and on), at most one version old, the weights' version going
    on from the checkpoint's; resuming it synchronously is refused."""
    run = stopped_resume
    position = load_metadata(iteration_dir(run.ckpt, 1))["extra"]["data"]
    assert position["pending"]  # generation ran ahead of the checkpoint
    resumed = _metrics(run.out)
    assert [r["rollout_id"] for r in resumed] == list(range(2, 2 + len(resumed)))
    assert len(resumed) >= 2, run.console  # rollouts 2 and 3 before the save
    assert all(r["async/staleness_max"] <= 1 for r in resumed)
    assert all(r["weights/version"] == r["rollout_id"] + 1 for r in resumed)
    assert resumed[1]["weights/version"] == 4

    with pytest.raises(AssertionError, match="asynchronous run had drawn and not trained"):
        _train(
            "--num-rollout",
            "4",
            "--output-dir",
            str(run.tmp_path / "o2"),
            "--load",
            str(run.ckpt),
            cwd=run.tmp_path,
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


def test_ctrl_c_stops_an_asynchronous_run_and_keeps_its_outputs(
    stopped_resume: SimpleNamespace,
) -> None:
    """Ctrl-C while the producer's thread generates (the resumed run above): exit 130
    within a bounded time, no traceback, the metrics and the summary kept, and the
    checkpoint holds the prompts in flight."""
    run = stopped_resume
    assert run.code == 130, run.console
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    rows = _metrics(run.out)
    assert rows and all(r["async/staleness_max"] <= 1 for r in rows)
    assert json.loads((run.out / "summary.json").read_text())["status"] == "interrupted"
    last = int((run.saved / TRACKER).read_text())
    assert load_metadata(iteration_dir(run.saved, last))["extra"]["data"]["pending"]
