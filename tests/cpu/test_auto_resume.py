"""``--auto-resume N``, and ``--load`` after a crash: a run resumes from its checkpoint.

Proves, on real ``vime-train`` runs of the embedded default (no mocks; the kills sent
by the chaos hooks of ``fault_hooks.py``): the driver killed (SIGKILL, with the rank
writing) while rollout 3's checkpoint is written leaves the tracker on rollout 1's, the
half-written one never taken as the latest; a new ``vime-train --load`` resumes after
rollout 1. There a rank killed mid-step (SIGKILL to its own pid, in its loss) while
training rollout 5, after the checkpoint of rollout 3 and the line of rollout 4, is
followed by one console line and a restart in the same process that resumes after
rollout 3; the run exits 0 with rollouts 0..5 in metrics.jsonl once each,
``fault/auto_resumes`` on the restarted run's first line, and every redone rollout
equal, bit for bit, to the line the dead run logged for it. The restart policy (no
retry of a configuration error or a stop, the budget, the ``--load`` of a restart) is
checked on plain callables.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from fault_hooks import BEFORE_KILL, CHECKPOINT, DRIVER_PID, TRAIN_STEP, RankChaos, vime_train

from vime.auto_resume import RESUMES_KEY, resumed_config, run_resuming
from vime.checkpoint import TRACKER, iteration_dir, latest, partial_dir
from vime.config import ConfigError, parse_args
from vime.perf import StartupClock
from vime.ray.errors import Terminated
from vime.tracking import METRICS_FILE, read_metrics

HOOK = Path(__file__).with_name("fault_hooks.py")
# Timing and the start-up differ between any two runs; everything else must not.
UNSTABLE = ("perf/", "phase/", "time/")


def _same_rollout(redone: dict[str, Any], dead: dict[str, Any]) -> None:
    stable = [k for k in dead if not k.startswith(UNSTABLE)]
    assert "train/loss" in stable and "rollout/reward_mean" in stable
    assert {k: redone[k] for k in stable} == {k: dead[k] for k in stable}


def test_a_killed_driver_and_a_dead_rank_each_resume_as_one_run(tmp_path: Path) -> None:
    """The driver killed mid-checkpoint of rollout 3: ``--load`` resumes after rollout 1.
    A rank killed in rollout 5 then costs one restart after rollout 3. The metrics read
    as one run of 6 rollouts, each redone rollout the dead run's, bit for bit."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    flags = (
        *("--num-rollout", "6", "--rollout-batch-size", "8", "--n-samples-per-prompt", "2"),
        *("--seed", "7", "--save", str(ckpt), "--save-interval", "2", "--auto-resume", "1"),
        *("--output-dir", str(out), "--custom-loss-function-path", f"{HOOK}:policy_loss"),
    )
    mid_save = RankChaos(CHECKPOINT, 3, str(out))
    killed = vime_train(
        *flags, cwd=tmp_path, env={**os.environ, **mid_save.env()}, pid_file=out / DRIVER_PID
    )
    report = killed.stdout[-3000:] + killed.stderr[-5000:]
    assert killed.returncode == -signal.SIGKILL and mid_save.marker.exists(), report
    assert partial_dir(ckpt, 3).is_dir() and latest(ckpt) == 1  # killed mid-save
    first = read_metrics(out / METRICS_FILE)
    assert [r["rollout_id"] for r in first] == [0, 1, 2, 3]

    mid_step = RankChaos(TRAIN_STEP, 5, str(out))
    result = vime_train(
        *flags, "--load", str(ckpt), cwd=tmp_path, env={**os.environ, **mid_step.env()}
    )
    report = result.stdout[-3000:] + result.stderr[-5000:]
    assert result.returncode == 0, report
    assert mid_step.marker.exists(), report  # the failure did happen
    said = [line for line in result.stderr.splitlines() if "auto-resume 1 of 1" in line]
    assert len(said) == 1 and "restarting after rollout 3" in said[0], report
    assert "training rank 0" in said[0], said

    rows = read_metrics(out / METRICS_FILE)
    assert [r["rollout_id"] for r in rows] == list(range(6))
    assert [r.get(RESUMES_KEY) for r in rows] == [None, None, None, None, 1.0, None]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "done" and summary["auto_resumes"] == 1
    assert (ckpt / TRACKER).read_text().strip() == "5" and iteration_dir(ckpt, 5).is_dir()

    before = read_metrics(out / BEFORE_KILL)
    assert [r["rollout_id"] for r in before] == [0, 1, 2, 3, 4]
    assert rows[:2] == first[:2] and rows[:4] == before[:4]  # kept as written
    for redone, dead in ((rows[2], first[2]), (rows[3], first[3]), (rows[4], before[4])):
        _same_rollout(redone, dead)


def _config(*extra: str) -> Any:
    return parse_args(["--save", "ckpt", "--auto-resume", "2", *extra], for_run=True)


def _runner(failures: list[BaseException]) -> tuple[Any, list[int]]:
    """A run that raises ``failures`` in turn, then succeeds; and the resumes it saw."""
    seen: list[int] = []

    def run(config: Any, *, startup: StartupClock, auto_resumes: int) -> dict[str, Any]:
        seen.append(auto_resumes)
        if failures:
            raise failures.pop(0)
        return {"status": "done"}

    return run, seen


def test_failures_are_retried_up_to_the_budget(tmp_path: Path, monkeypatch, capsys) -> None:
    """Two failures within --auto-resume 2 end in a finished run after two restarts; a
    third is raised as it came, after the line that says the budget is spent."""
    monkeypatch.chdir(tmp_path)
    config = _config("--output-dir", str(tmp_path))
    restarts: list[Any] = []
    run, seen = _runner([RuntimeError("one"), RuntimeError("two")])
    assert run_resuming(run, config, StartupClock(), restarts.append) == {"status": "done"}
    assert seen == [0, 1, 2] and len(restarts) == 2
    assert "auto-resume 2 of 2: restarting from the start" in capsys.readouterr().err

    run, seen = _runner([RuntimeError(str(i)) for i in range(3)])
    with pytest.raises(RuntimeError, match=r"^2$"):
        run_resuming(run, config, StartupClock(), restarts.append)
    assert seen == [0, 1, 2]
    assert "--auto-resume 2 spent" in capsys.readouterr().err
    assert "RuntimeError: 2" in (tmp_path / "error.log").read_text()  # the driver's traceback


@pytest.mark.parametrize("stop", [ConfigError("bad"), KeyboardInterrupt(), Terminated()])
def test_configuration_errors_and_stops_are_not_retried(stop: BaseException) -> None:
    """A configuration error, Ctrl-C and SIGTERM end the run at once, whatever the budget."""
    run, seen = _runner([stop])
    restarts: list[Any] = []
    with pytest.raises(type(stop)):
        run_resuming(run, _config(), StartupClock(), restarts.append)
    assert seen == [0] and restarts == []


def test_a_restart_loads_the_save_folder_once_it_holds_a_checkpoint(tmp_path: Path) -> None:
    """Before the first checkpoint a restart starts over (no --load); after it, it loads
    the --save folder."""
    ckpt = tmp_path / "ckpt"
    config = parse_args(["--save", str(ckpt), "--auto-resume", "1"], for_run=True)
    assert resumed_config(config).load is None
    iteration_dir(ckpt, 3).mkdir(parents=True)
    (ckpt / TRACKER).write_text("3\n")
    assert resumed_config(config).load == str(ckpt)
