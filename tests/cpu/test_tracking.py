"""What a run writes about itself (vime/tracking.py, vime/progress_plot.py).

Proves that metrics.jsonl holds one strict-JSON line per rollout (non-finite
values as null), that a resumed run rewrites it to exactly the rollouts before
its start (dropping a half-written crash line), that the progress line shows
what it should on a TTY (redrawn with \\r) and off one (a line per rollout),
that finish() writes summary.json and a real PNG, that TensorBoard receives the
scalars, that --use-wandb without wandb is a ConfigError that leaves nothing
behind, and that with wandb (offline mode, no network) the rollouts' metrics
land in the W&B run and a resumed run continues the same W&B run id. The plot's
reward band stays within each rollout's observed min and max reward, and its time
panel has one series per driver phase logged. A one-off metric (the start-up time)
lands on the next line only, and entries given early reach summary.json.
"""

from __future__ import annotations

import io
import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from vime.errors import ConfigError
from vime.progress_plot import phase_seconds, plot_progress, reward_band
from vime.tracking import Tracker, default_output_dir, format_duration, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _raw_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_default_output_dir_is_timestamped() -> None:
    assert default_output_dir(datetime(2025, 3, 7, 14, 5, 9)) == "runs/20250307-140509"


def test_lines_are_strict_json_with_nonfinite_as_null(tmp_path: Path) -> None:
    config = {"lr": 1e-4, "prompt_data": Path("data/x.jsonl")}
    with Tracker(str(tmp_path), num_rollouts=3, config=config, stream=io.StringIO()) as tracker:
        tracker.log(0, {"rollout/reward_mean": 0.25, "train/loss": math.nan})
        tracker.log(1, {"rollout/reward_mean": torch.tensor(0.5), "train/grad_norm": math.inf})

    def strict(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    lines = _raw_lines(tmp_path / "metrics.jsonl")
    records = [json.loads(line, parse_constant=strict) for line in lines]
    assert records == [
        {"rollout_id": 0, "rollout/reward_mean": 0.25, "train/loss": None},
        {"rollout_id": 1, "rollout/reward_mean": 0.5, "train/grad_norm": None},
    ]
    assert read_metrics(tmp_path / "metrics.jsonl") == records
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved == {"lr": 1e-4, "prompt_data": "data/x.jsonl"}


def test_resume_keeps_only_earlier_rollouts_and_drops_a_torn_line(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"rollout_id": i, "rollout/reward_mean": i / 10} for i in range(5)]
    whole = "".join(json.dumps(row) + "\n" for row in rows)
    metrics.write_text(whole + '{"rollout_id": 5, "rollout/rew')  # killed mid-write

    tracker = Tracker(str(tmp_path), num_rollouts=8, start_rollout=3, stream=io.StringIO())
    assert [r["rollout_id"] for r in read_metrics(metrics)] == [0, 1, 2]
    for i in range(3, 6):
        tracker.log(i, {"rollout/reward_mean": 1.0})
    tracker.finish()

    lines = _raw_lines(metrics)
    assert [json.loads(line)["rollout_id"] for line in lines] == [0, 1, 2, 3, 4, 5]
    assert json.loads(lines[2])["rollout/reward_mean"] == 0.2  # old value kept
    assert json.loads(lines[3])["rollout/reward_mean"] == 1.0  # new value, not duplicated
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rollouts_logged"] == 6
    assert summary["last_rollout_id"] == 5


def test_fresh_start_over_an_old_run_discards_its_metrics(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"rollout_id": 0, "x": 1}\n')
    Tracker(str(tmp_path), num_rollouts=2, stream=io.StringIO()).finish()
    assert read_metrics(tmp_path / "metrics.jsonl") == []


FULL = {
    "rollout/reward_mean": 0.42,
    "rollout/response_len_mean": 5.14,
    "perf/rollout_tokens_per_s": 1234.0,
    "perf/step_time_s": 3.4,
}


def test_progress_lines_off_a_tty(tmp_path: Path) -> None:
    out = io.StringIO()
    tracker = Tracker(str(tmp_path), num_rollouts=4, stream=out)
    tracker.log(0, FULL)
    tracker.message("eval done")
    tracker.log(1, {**FULL, "perf/step_time_s": 5.4})
    tracker.finish()
    assert "\r" not in out.getvalue()
    # ETA = mean recent step time x rollouts left: 3.4 x 3 = 10.2 s, then 4.4 x 2 = 8.8 s.
    assert out.getvalue().splitlines() == [
        "rollout 1/4  reward 0.42  len 5.1  1.2k tok/s  step 3.4s  ETA 10s",
        "eval done",
        "rollout 2/4  reward 0.42  len 5.1  1.2k tok/s  step 5.4s  ETA 9s",
    ]


def test_an_asynchronous_run_shows_its_staleness(tmp_path: Path) -> None:
    out = io.StringIO()
    tracker = Tracker(str(tmp_path), num_rollouts=1, stream=out)
    tracker.log(0, {**FULL, "async/staleness_mean": 0.75})
    tracker.finish()
    assert out.getvalue() == "rollout 1/1  reward 0.42  len 5.1  1.2k tok/s  stale 0.8  step 3.4s\n"


def test_missing_metrics_are_left_out(tmp_path: Path) -> None:
    out = io.StringIO()
    tracker = Tracker(str(tmp_path), num_rollouts=10, stream=out)
    tracker.log(0, {"rollout/reward_mean": 0.5, "train/loss": 1.0})
    tracker.finish()
    assert out.getvalue() == "rollout 1/10  reward 0.50\n"


def test_progress_redraws_one_line_on_a_tty(tmp_path: Path) -> None:
    out = TTY()
    tracker = Tracker(str(tmp_path), num_rollouts=3, stream=out)
    tracker.log(0, FULL)
    tracker.log(1, {"rollout/reward_mean": 0.9})
    assert "\n" not in out.getvalue()  # still one redrawn line
    assert out.getvalue().startswith("\rrollout 1/3  reward 0.42")
    assert "\rrollout 2/3  reward 0.90" in out.getvalue()

    tracker.message("saved checkpoint")
    text = out.getvalue()
    assert text.count("\n") == 1
    before, after = text.rsplit("\n", 1)
    assert before.endswith("saved checkpoint")
    assert after.startswith("rollout 2/3  reward 0.90")  # progress line drawn again below
    tracker.finish()
    assert out.getvalue().endswith("\n")


def test_format_duration() -> None:
    assert [format_duration(s) for s in (9.6, 130, 3600 * 3 + 300)] == ["10s", "2m10s", "3h05m"]


def test_finish_writes_summary_and_a_png_covering_a_resumed_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")

    def metrics(i: int) -> dict[str, float]:
        m = {
            "rollout/reward_mean": i / 10,
            "rollout/reward_std": 0.1,
            "rollout/response_len_mean": 4.0 + i,
            "phase/train_s": 0.5,
        }
        if i % 2 == 0:
            m["eval/pass@1"] = i / 8
        return m

    with Tracker(str(tmp_path), num_rollouts=6, stream=io.StringIO()) as first:
        for i in range(3):
            first.log(i, metrics(i))
    second = Tracker(str(tmp_path), num_rollouts=6, start_rollout=3, stream=io.StringIO())
    for i in range(3, 6):
        second.log(i, metrics(i))
    png = second.finish({"best_reward": 0.5, "nan_metric": math.nan})

    assert png == str(tmp_path / "progress.png")
    data = Path(png).read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["best_reward"] == 0.5 and summary["nan_metric"] is None
    assert summary["rollouts_logged"] == 6  # the plot's source spans both sessions
    assert summary["status"] == "ok"  # written by the first session, merged by the second
    assert second.finish() == png  # idempotent


def test_one_off_metrics_go_on_the_next_line_and_early_entries_in_the_summary(
    tmp_path: Path,
) -> None:
    """``log_once`` (the start-up time) lands on the next line only; ``summarize`` reaches
    summary.json however the run ends, under what ``finish`` itself is given."""
    tracker = Tracker(str(tmp_path), num_rollouts=3, stream=io.StringIO())
    tracker.log_once({"perf/startup_s": 7.5})
    tracker.summarize({"startup_s": 7.5, "startup_parts_s": {"ray": 1.5}, "status": "early"})
    for i in range(2):
        tracker.log(i, {"rollout/reward_mean": 0.5})
    tracker.finish({"status": "interrupted"})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0]["perf/startup_s"] == 7.5 and "perf/startup_s" not in rows[1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["startup_s"] == 7.5 and summary["startup_parts_s"] == {"ray": 1.5}
    assert summary["status"] == "interrupted"


def test_reward_band_stays_within_the_observed_rewards() -> None:
    records = [
        # Mostly 0 with a few 1s: mean - std < 0 and mean + std < max.
        {"rollout_id": 0, "rollout/reward_mean": 0.1, "rollout/reward_std": 0.3}
        | {"rollout/reward_min": 0.0, "rollout/reward_max": 1.0},
        # Mostly 1: the upper edge would pass 1.
        {"rollout_id": 1, "rollout/reward_mean": 0.9, "rollout/reward_std": 0.3}
        | {"rollout/reward_min": 0.0, "rollout/reward_max": 1.0},
        # A metrics file from before min/max were logged: mean ± std as it was.
        {"rollout_id": 2, "rollout/reward_mean": 0.5, "rollout/reward_std": 0.1},
        {"rollout_id": 3, "rollout/reward_mean": 0.5},  # no std: no band
    ]
    xs, lower, upper = reward_band(records)
    assert xs == [0, 1, 2]
    assert lower == pytest.approx([0.0, 0.6, 0.4])
    assert upper == pytest.approx([0.4, 1.0, 0.6])


def test_time_panel_has_a_series_per_phase_logged() -> None:
    records = [
        {"rollout_id": i, "phase/rollout_s": 1.0 + i, "phase/train_s": 2.0, "phase/sync_s": 0.1}
        for i in range(4)
    ]
    records[1]["phase/eval_s"] = 3.0
    series = phase_seconds(records)
    assert list(series) == ["rollout", "train", "sync", "eval"]  # no probe logged
    assert series["rollout"] == ([0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0])
    assert series["eval"] == ([1], [3.0])


def test_the_plot_shows_the_share_calling_a_tool(tmp_path: Path) -> None:
    """A tool run's progress.png adds the share of trajectories calling a tool."""
    plain = [
        {"rollout_id": i, "rollout/reward_mean": 0.1 * i, "rollout/response_len_mean": 5.0}
        for i in range(4)
    ]
    tools = [{**r, "agent/calling_frac": 0.2 * r["rollout_id"]} for r in plain]
    tools[3]["eval/calling_frac"] = 0.9
    a = Path(plot_progress(plain, tmp_path / "a.png")).read_bytes()
    b = Path(plot_progress(tools, tmp_path / "b.png")).read_bytes()
    assert a[:8] == b[:8] == b"\x89PNG\r\n\x1a\n" and a != b


def test_context_manager_records_failure(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError),
        Tracker(str(tmp_path), num_rollouts=2, stream=io.StringIO()) as tracker,
    ):
        tracker.log(0, {"rollout/reward_mean": 0.0})
        raise RuntimeError("boom")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "boom" in summary["error"]
    with pytest.raises(RuntimeError, match="after finish"):
        tracker.log(1, {})


def test_tensorboard_receives_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(str(tmp_path), num_rollouts=2, use_tensorboard=True, stream=io.StringIO())
    tracker.log(0, {"rollout/reward_mean": 0.25})
    tracker.log(1, {"rollout/reward_mean": 0.75, "note": math.nan})
    tracker.finish()

    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    events = acc.Scalars("rollout/reward_mean")
    assert [(e.step, e.value) for e in events] == [(0, 0.25), (1, 0.75)]
    assert "note" not in acc.Tags()["scalars"]  # null is not a scalar


def test_use_wandb_without_wandb_is_a_config_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when absent
    out_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="pip install wandb"):
        Tracker(str(out_dir), num_rollouts=1, use_wandb=True, stream=io.StringIO())
    assert not out_dir.exists()  # nothing half-made left behind


def _wandb_run_file(out_dir: Path, run_id: str, index: int, holding: bytes) -> bytes:
    """The offline run file, once it holds ``holding`` (or as it is after 30 s).

    ``finish()`` hands the records to W&B's service process, which writes them a moment
    later: on a busy machine the file was read with only its header in it.
    """
    deadline = time.monotonic() + 30.0
    while True:
        runs = sorted((out_dir / "wandb").glob(f"offline-run-*-{run_id}"))
        data = (runs[index] / f"run-{run_id}.wandb").read_bytes() if runs else b""
        if holding in data or time.monotonic() > deadline:
            return data
        time.sleep(0.2)


def test_wandb_offline_receives_metrics_and_resume_keeps_the_run(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(str(tmp_path), num_rollouts=3, use_wandb=True, stream=io.StringIO())
    tracker.log(0, {"rollout/reward_mean": 0.125, "note": "text is not logged"})
    tracker.log(1, {"rollout/reward_mean": 0.375})
    tracker.finish()
    run_id = (tmp_path / "wandb_run_id.txt").read_text().strip()
    # The offline run file is W&B's record log: history keys and values appear verbatim.
    first = _wandb_run_file(tmp_path, run_id, 0, b"0.375")
    assert b"rollout/reward_mean" in first and b"0.125" in first and b"0.375" in first
    assert b"text is not logged" not in first

    resumed = Tracker(
        str(tmp_path), num_rollouts=3, start_rollout=2, use_wandb=True, stream=io.StringIO()
    )
    resumed.log(2, {"rollout/reward_mean": 0.625})
    resumed.finish()
    assert (tmp_path / "wandb_run_id.txt").read_text().strip() == run_id
    assert b"0.625" in _wandb_run_file(tmp_path, run_id, -1, b"0.625")
