"""progress.png: a run's reward, response length and phase times, drawn from metrics.jsonl.

Where it fits: ``vime.tracking.Tracker.finish`` calls ``plot_progress`` on the
records of the whole run (``read_metrics``), so the plot covers the run across
restarts. The metric keys it reads are named here; the console line reads the reward
and length keys too. matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import math
import os
from typing import Any

REWARD_KEY = "rollout/reward_mean"
REWARD_STD_KEY = "rollout/reward_std"
REWARD_MIN_KEY = "rollout/reward_min"
REWARD_MAX_KEY = "rollout/reward_max"
# The driver's phases drawn per rollout (vime.step_timing): label, metric.
PHASE_KEYS = (
    ("rollout", "phase/rollout_s"),
    ("train", "phase/train_s"),
    ("sync", "phase/sync_s"),
    ("probe", "phase/probe_s"),
    ("eval", "phase/eval_s"),
)
LENGTH_KEY = "rollout/response_len_mean"
EVAL_KEYS = ("eval/reward_mean", "eval/pass@1")
# Multi-turn rollouts: the share of trajectories that called a tool (train, eval).
CALLING_KEYS = ("agent/calling_frac", "eval/calling_frac")


def finite_number(metrics: dict[str, Any], key: str) -> float | None:
    """``metrics[key]`` as a float when it is a finite number, else None (missing, null,
    a bool, text)."""
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for record in records:
        value = finite_number(record, key)
        if value is not None:
            xs.append(record["rollout_id"])
            ys.append(value)
    return xs, ys


def reward_band(records: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float]]:
    """``(rollouts, lower, upper)`` of the plot's reward band: mean ∓ std, kept within the
    rollout's observed min and max where recorded (a reward in [0, 1] with a large spread
    would otherwise draw a band below 0)."""
    xs: list[int] = []
    lower: list[float] = []
    upper: list[float] = []
    for record in records:
        mean, std = finite_number(record, REWARD_KEY), finite_number(record, REWARD_STD_KEY)
        if mean is None or std is None:
            continue
        low, high = finite_number(record, REWARD_MIN_KEY), finite_number(record, REWARD_MAX_KEY)
        xs.append(record["rollout_id"])
        lower.append(mean - std if low is None else max(low, mean - std))
        upper.append(mean + std if high is None else min(high, mean + std))
    return xs, lower, upper


def phase_seconds(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Seconds per driver phase per rollout (``PHASE_KEYS``), for the phases logged."""
    series = {label: _series(records, key) for label, key in PHASE_KEYS}
    return {label: xy for label, xy in series.items() if xy[0]}


def plot_progress(records: list[dict[str, Any]], path: str | os.PathLike[str]) -> str | None:
    """Draw reward (±std within min/max, eval points), response length (and, for tool
    use, the share of trajectories calling a tool) and seconds per phase over
    rollout_id to a PNG.

    Uses a bare Figure with the Agg canvas, so neither pyplot's global state nor
    the process-wide backend is touched. Returns the path, or None when there
    is nothing to draw or matplotlib is missing.
    """
    if not records:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None

    fig = Figure(figsize=(9, 8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_reward, ax_len, ax_time = fig.subplots(3, 1, sharex=True)

    _plot_reward(ax_reward, records)
    _plot_lengths(ax_len, records)
    for label, (px, py) in phase_seconds(records).items():
        # Eval runs every --eval-interval rollouts: points, not a line through the gaps.
        ax_time.plot(px, py, "o" if label == "eval" else "-", markersize=3, label=label)
    ax_time.set_ylabel("seconds per phase")
    ax_time.set_xlabel("rollout")
    ax_time.grid(alpha=0.3)
    if ax_time.get_legend_handles_labels()[0]:
        ax_time.legend(loc="best", fontsize="small", ncol=5)

    fig.savefig(path, dpi=100)
    return str(path)


def _plot_reward(ax: Any, records: list[dict[str, Any]]) -> None:
    """Reward mean, its ±std band and the eval points."""
    xs, mean = _series(records, REWARD_KEY)
    ax.plot(xs, mean, color="tab:blue", label="reward mean")
    bx, lower, upper = reward_band(records)
    if bx:
        ax.fill_between(bx, lower, upper, color="tab:blue", alpha=0.2, label="± std")
    for key, color in zip(EVAL_KEYS, ("tab:red", "tab:green"), strict=True):
        ex, ey = _series(records, key)
        if ex:
            ax.plot(ex, ey, "o", color=color, label=key)
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small")


def _plot_lengths(ax: Any, records: list[dict[str, Any]]) -> None:
    """Response length, and for tool use the share of trajectories calling a tool."""
    lx, ly = _series(records, LENGTH_KEY)
    ax.plot(lx, ly, color="tab:orange")
    ax.set_ylabel("response length (tokens)")
    ax.grid(alpha=0.3)
    cx, cy = _series(records, CALLING_KEYS[0])
    if cx:
        ax_calls = ax.twinx()
        ax_calls.plot(cx, cy, color="tab:purple", label="calling a tool")
        ex, ey = _series(records, CALLING_KEYS[1])
        if ex:
            ax_calls.plot(ex, ey, "o", color="tab:purple", label="eval, greedy")
        ax_calls.set_ylim(-0.02, 1.02)
        ax_calls.set_ylabel("share of trajectories calling a tool")
        ax_calls.legend(loc="best", fontsize="small")
