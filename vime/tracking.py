"""Everything a run writes about itself: console progress, metrics.jsonl, TensorBoard, plots.

The training loop (``trainer.py``) owns one :class:`Tracker` on the process that
reports (rank 0 / the driver) and calls :meth:`Tracker.log` once per rollout with
the flat ``{"group/name": value}`` metrics dict that ``algo/metrics`` and the
rollout manager produce. Layout of the output folder::

    OUTPUT_DIR/config.json      the run's flags, written at start
    OUTPUT_DIR/metrics.jsonl    one JSON object per rollout, fsync'd as written
    OUTPUT_DIR/tensorboard/     event files (``--use-tensorboard``)
    OUTPUT_DIR/summary.json     final numbers, written by ``finish``
    OUTPUT_DIR/progress.png     reward, response length and seconds per phase over the run
    OUTPUT_DIR/trace.json       Perfetto trace of the ``--profile-rollouts`` (vime.profiling)

metrics.jsonl is the source of truth: a resumed run rewrites it to the rollouts
before its start (so nothing is duplicated and a half-written line from a crash
disappears), and the final plot (``vime.progress_plot``) is drawn from it rather than
from memory, so it covers the run across restarts. TensorBoard, matplotlib and wandb
are imported only when used: none of them is a dependency of the core loop.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections import deque
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from vime.errors import ConfigError
from vime.progress_plot import LENGTH_KEY, REWARD_KEY, finite_number, plot_progress

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "progress.png"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id.txt"

STEP_TIME_KEY = "perf/step_time_s"
STALENESS_KEY = "async/staleness_mean"
# First key present wins; rollout throughput is what a user watches on the console.
THROUGHPUT_KEYS = ("perf/rollout_tokens_per_s", "perf/tokens_per_s", "perf/train_tokens_per_s")

# ETA averages this many recent step times: long enough to smooth noise, short
# enough to follow a run whose steps get slower as responses grow.
_ETA_WINDOW = 10


def default_output_dir(now: datetime | None = None) -> str:
    """``runs/<YYYYmmdd-HHMMSS>`` for ``now`` (default: the current local time)."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", stamp)


HF_PROGRESS_BARS_VAR = "HF_HUB_DISABLE_PROGRESS_BARS"


def quiet_library_progress_bars() -> None:
    """Keep transformers' and huggingface_hub's progress bars ("Writing model shards",
    "Loading weights") off a run's console, which is vime's progress line's, in this
    process and (through the environment Ray passes on) in every actor. A user who wants
    them sets ``HF_HUB_DISABLE_PROGRESS_BARS=0``."""
    os.environ.setdefault(HF_PROGRESS_BARS_VAR, "1")
    if os.environ[HF_PROGRESS_BARS_VAR] == "1":
        # Already imported modules read the variable at import time: tell them directly.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, in file order; unparseable lines are skipped.

    A process killed mid-write leaves a truncated last line; skipping it is what
    makes the file readable after any crash. A missing file reads as no records.
    """
    records: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return records
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("rollout_id"), int):
            records.append(record)
    return records


def _clean(value: Any) -> Any:
    """A JSON-safe scalar: tensors/numpy scalars unwrapped, NaN and ±inf as null."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def format_duration(seconds: float) -> str:
    """``45s``, ``2m10s``, ``3h05m``: short enough for a progress line."""
    total = max(0, round(seconds))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def format_rate(value: float) -> str:
    """``850``, ``1.2k``, ``3.4M``: SI-style magnitude for tokens per second."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


class Tracker:
    """Writes one run's metrics to disk, TensorBoard, wandb and the console.

    Create it once per run on the reporting process; call :meth:`log` after each
    rollout and :meth:`finish` at the end (or use it as a context manager).
    ``start_rollout`` is the first rollout id this process will log: on resume,
    the rollouts at or after it are dropped from metrics.jsonl before appending.
    """

    def __init__(
        self,
        output_dir: str,
        *,
        num_rollouts: int,
        start_rollout: int = 0,
        use_tensorboard: bool = False,
        use_wandb: bool = False,
        wandb_project: str = "vime",
        config: dict[str, Any] | None = None,
        stream: IO[str] = sys.stderr,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.num_rollouts = num_rollouts
        self.start_rollout = start_rollout
        self.stream = stream
        self.metrics_path = self.output_dir / METRICS_FILE
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._progress_line = ""  # what is currently drawn on a TTY, to redraw after message()
        self._step_times: deque[float] = deque(maxlen=_ETA_WINDOW)
        self._last_log_time: float | None = None
        self._last_record: dict[str, Any] | None = None
        self._started = time.monotonic()
        self._finished = False
        self._plot_path: str | None = None
        self._once: dict[str, Any] = {}  # metrics for the next line only (log_once)
        self._summary: dict[str, Any] = {}  # summary.json entries known early (summarize)

        # Fail on a missing wandb before anything is written, so a typo'd
        # setup leaves no half-made run folder behind.
        wandb = self._import_wandb() if use_wandb else None

        self.output_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(
            self.output_dir / CONFIG_FILE,
            json.dumps(config or {}, indent=2, sort_keys=True, default=str) + "\n",
        )
        self._truncate_metrics(start_rollout)
        # Held open across log() calls for the whole run; finish() closes it.
        self._file: IO[str] | None = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115

        self._tb: Any = None
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events a crashed run wrote past the resume point,
            # the TensorBoard counterpart of truncating metrics.jsonl.
            self._tb = SummaryWriter(
                log_dir=str(self.output_dir / TENSORBOARD_DIR),
                purge_step=start_rollout if start_rollout > 0 else None,
            )

        self._wandb: Any = None
        if wandb is not None:
            self._wandb = self._start_wandb(wandb, wandb_project, config or {})

    # ----------------------------------------------------------------- setup

    @staticmethod
    def _import_wandb() -> Any:
        try:
            import wandb
        except ImportError as err:
            raise ConfigError("--use-wandb needs the wandb package: pip install wandb") from err
        return wandb

    def _start_wandb(self, wandb: Any, project: str, config: dict[str, Any]) -> Any:
        # The run id lives in the output folder so a resumed run continues the
        # same W&B run instead of starting a new one.
        id_path = self.output_dir / WANDB_ID_FILE
        if id_path.exists():
            run_id = id_path.read_text(encoding="utf-8").strip()
        else:
            # Our own id (W&B accepts any [a-z0-9] string): wandb's helper for it has moved
            # between releases.
            run_id = uuid.uuid4().hex[:16]
            _write_atomic(id_path, run_id + "\n")
        return wandb.init(
            project=project,
            id=run_id,
            resume="allow",
            dir=str(self.output_dir),
            name=self.output_dir.name,
            config=json.loads(json.dumps(config, default=str)),
        )

    def _truncate_metrics(self, start_rollout: int) -> None:
        """Keep only whole lines with rollout_id < start_rollout; atomic replace."""
        if not self.metrics_path.exists():
            return
        kept = [r for r in read_metrics(self.metrics_path) if r["rollout_id"] < start_rollout]
        _write_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))

    # ------------------------------------------------------------------- log

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        """Record one rollout's metrics everywhere enabled and redraw the progress line."""
        if self._file is None:
            raise RuntimeError("Tracker.log called after finish()")
        record: dict[str, Any] = {"rollout_id": rollout_id}
        record.update({key: _clean(value) for key, value in {**metrics, **self._once}.items()})
        self._once = {}
        # fsync per line: a rollout costs seconds, and a crash must not lose
        # the metrics of rollouts whose checkpoint already survived.
        self._file.write(json.dumps(record, allow_nan=False, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._last_record = record

        if self._tb is not None:
            for key, value in record.items():
                if key != "rollout_id" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, global_step=rollout_id)
            self._tb.flush()
        if self._wandb is not None:
            numeric = {k: v for k, v in record.items() if isinstance(v, int | float)}
            self._wandb.log(numeric, step=rollout_id)

        now = time.monotonic()
        step_time = finite_number(record, STEP_TIME_KEY)
        if step_time is None and self._last_log_time is not None:
            step_time = now - self._last_log_time
        if step_time is not None:
            self._step_times.append(step_time)
        self._last_log_time = now
        self._draw(self.progress_text(rollout_id, record))

    def log_once(self, metrics: dict[str, float]) -> None:
        """Add ``metrics`` to the next line :meth:`log` writes, and to no other (a one-off
        figure such as the run's start-up time, on its first line)."""
        self._once.update(metrics)

    def summarize(self, entries: dict[str, Any]) -> None:
        """Entries for summary.json, written by :meth:`finish` whenever the run ends (an
        interrupted or failed run's summary has them too); ``finish``'s own win."""
        self._summary.update(entries)

    def progress_text(self, rollout_id: int, metrics: dict[str, Any]) -> str:
        """The one-line progress summary; parts whose metric is missing are left out."""
        done = rollout_id + 1
        parts = [f"rollout {done}/{self.num_rollouts}"]
        reward = finite_number(metrics, REWARD_KEY)
        if reward is not None:
            parts.append(f"reward {reward:.2f}")
        length = finite_number(metrics, LENGTH_KEY)
        if length is not None:
            parts.append(f"len {length:.1f}")
        for key in THROUGHPUT_KEYS:
            rate = finite_number(metrics, key)
            if rate is not None:
                parts.append(f"{format_rate(rate)} tok/s")
                break
        staleness = finite_number(metrics, STALENESS_KEY)  # asynchronous rollout only
        if staleness is not None:
            parts.append(f"stale {staleness:.1f}")
        step_time = finite_number(metrics, STEP_TIME_KEY)
        if step_time is not None:
            parts.append(f"step {step_time:.1f}s")
        remaining = self.num_rollouts - done
        if self._step_times and remaining > 0:
            mean = sum(self._step_times) / len(self._step_times)
            parts.append(f"ETA {format_duration(mean * remaining)}")
        return "  ".join(parts)

    def message(self, text: str) -> None:
        """Print a line of text without breaking the live progress line."""
        if self._tty and self._progress_line:
            self.stream.write("\r" + " " * len(self._progress_line) + "\r")
            self.stream.write(text + "\n" + self._progress_line)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _draw(self, line: str) -> None:
        if self._tty:
            # Pad with spaces so a shorter line fully covers the previous one.
            pad = max(0, len(self._progress_line) - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._progress_line = line
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    # ---------------------------------------------------------------- finish

    def finish(self, summary: dict[str, Any] | None = None) -> str | None:
        """Write summary.json, close every writer, draw progress.png; return its path.

        Returns None when there is nothing to plot or matplotlib is not
        installed. Calling it again is a no-op that returns the same path.
        """
        if self._finished:
            return self._plot_path
        self._finished = True
        if self._tty and self._progress_line:
            self.stream.write("\n")
            self.stream.flush()
        self._progress_line = ""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

        records = read_metrics(self.metrics_path)
        self._plot_path = plot_progress(records, self.output_dir / PLOT_FILE)

        summary_path = self.output_dir / SUMMARY_FILE
        merged: dict[str, Any] = {}
        if summary_path.exists():
            try:
                merged = json.loads(summary_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                merged = {}
        merged.update(
            {
                "num_rollouts": self.num_rollouts,
                "rollouts_logged": len(records),
                "last_rollout_id": records[-1]["rollout_id"] if records else None,
                "final_metrics": records[-1] if records else None,
                "session_wall_time_s": time.monotonic() - self._started,
                "plot": self._plot_path,
            }
        )
        merged.update({key: _clean(value) for key, value in self._summary.items()})
        merged.update({key: _clean(value) for key, value in (summary or {}).items()})
        _write_atomic(
            summary_path, json.dumps(merged, indent=2, allow_nan=False, default=str) + "\n"
        )
        return self._plot_path

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        status = {"status": "ok"} if exc is None else {"status": "failed", "error": repr(exc)}
        self.finish(status)
