"""Spans, busy time and the merged trace (vime/profiling.py), and ``--profile-rollouts``.

Proves that busy time is the union of spans clipped to the step (nested and
overlapping spans count once), that a recorder not enabled keeps nothing, that a span
still running at a drain counts in both steps' busy time (once in the trace), that the
step metrics (phase seconds, idle fractions, driver-only share, sync bytes, eval
tokens/s, log-prob passes) are what the spans say, that a timed scorer's calls are
driver "reward" phases, that torch.profiler's events come back on the wall clock
the spans use, that the merged trace puts each part in its own process, and that
``--profile-rollouts`` takes ids and ranges and refuses anything else in one line.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from vime import profiling
from vime.config.parser import parse_args
from vime.errors import ConfigError
from vime.profiling import PhaseClock, Recorder, TimedCalls, covered_ns, timing_metrics

S = 1_000_000_000  # one second in ns


def test_busy_time_is_the_union_of_spans_within_the_window() -> None:
    spans = [
        ("a", 0, 10, {}),
        ("nested", 2, 5, {}),  # inside a: counted once
        ("b", 8, 14, {}),  # overlaps a
        ("c", 20, 40, {}),  # clipped at the window's end
        ("before", -5, -1, {}),
        ("after", 35, 50, {}),
    ]
    assert covered_ns(spans, 0, 30) == 14 + 10
    assert covered_ns([], 0, 30) == 0


def test_a_recorder_records_only_once_enabled() -> None:
    recorder = Recorder()
    with recorder.span("off"):
        pass
    assert recorder.drain() == []
    recorder.enabled = True
    with recorder.span("generate", prompts=2) as info:
        info["tokens"] = 7
    (span,) = recorder.drain()
    assert span[0] == "generate" and span[3] == {"prompts": 2, "tokens": 7}
    assert span[1] <= span[2]
    assert recorder.drain() == []


def test_a_span_that_outlives_a_drain_is_busy_time_of_both_steps() -> None:
    """A call still running at a drain (an engine generating across two steps) comes out
    as open, ending at the drain, and again whole once it ended: each step's busy time
    has its part; the trace keeps only the whole span."""
    recorder = Recorder()
    recorder.enabled = True
    with recorder.span("generate", tokens=3):
        first = recorder.drain()
        middle = time.time_ns()
    (running,) = first
    assert running[0] == "generate" and running[3] == {"open": True}
    assert running[1] <= running[2] <= middle
    (whole,) = recorder.drain()
    assert whole[1] == running[1] and whole[2] >= middle and whole[3] == {"tokens": 3}
    assert covered_ns([whole], middle, whole[2]) == whole[2] - middle  # the second step's part
    events = profiling._span_events([running, whole], pid=1, tid=1, origin=0)
    assert [e["args"] for e in events] == [{"tokens": 3}]


def test_step_metrics_are_what_the_spans_say() -> None:
    driver = [
        ("rollout", 0, 2 * S, {}),
        ("reward", S, 2 * S, {}),  # inside rollout: not counted twice in other_s
        ("train", 2 * S, 6 * S, {}),
        ("sync", 6 * S, 7 * S, {}),
        ("eval", 7 * S, 9 * S, {}),
    ]
    ranks = [
        [("train", 2 * S, 6 * S, {}), ("log_probs", 2 * S, 3 * S, {"which": "ref"})],
        [("train", 2 * S, 5 * S, {}), ("send_weights", 6 * S, 7 * S, {})],
    ]
    engines = [
        [
            ("generate", 0, S, {"tokens": 100}),
            ("update_weights", 6 * S, 7 * S, {"bytes": 4000}),
            ("generate", 7 * S, 9 * S, {"tokens": 300}),
        ]
    ]
    got = timing_metrics((0, 10 * S), driver, ranks, engines)
    assert got == pytest.approx(
        {
            "phase/rollout_s": 2.0,
            "phase/reward_s": 1.0,
            "phase/train_s": 4.0,
            "phase/sync_s": 1.0,
            "phase/eval_s": 2.0,
            "phase/other_s": 1.0,
            "perf/engine_idle_frac_mean": 0.6,
            "perf/engine_idle_frac_max": 0.6,
            "perf/trainer_idle_frac_mean": (0.6 + 0.6) / 2,
            "perf/trainer_idle_frac_max": 0.6,
            # Nobody works in [1, 2) (the reward) and [9, 10).
            "perf/driver_only_frac": 0.2,
            "perf/weight_sync_bytes": 4000.0,
            "perf/weight_sync_bytes_per_s": 4000.0,
            "perf/eval_tokens_per_s": 150.0,
            "perf/log_prob_passes": 1.0,
        }
    )
    busy = profiling.phase_busy_fractions(driver, ranks, engines)
    assert busy["train"] == {"engines": 0.0, "ranks": pytest.approx(0.875)}
    assert busy["rollout"] == {"engines": 0.5, "ranks": 0.0}


def test_timed_calls_are_reward_phases_of_the_driver() -> None:
    class Scorer:
        label = "x"

        def score_sync(self, samples: list[int]) -> list[float]:
            time.sleep(0.01)
            return [1.0] * len(samples)

    clock = PhaseClock()
    timed = TimedCalls(Scorer(), clock, "reward", ["score_sync"])
    assert timed.score_sync([1, 2]) == [1.0, 1.0]
    assert timed.label == "x"
    ((name, start, end, _),) = clock.drain()
    assert name == "reward" and end - start >= 10_000_000


def test_torch_profiler_events_are_on_the_wall_clock() -> None:
    profile = profiling.TorchProfile()
    profile.start()
    before = time.time_ns()
    x = torch.randn(32, 32, requires_grad=True)
    (x @ x).sum().backward()
    after = time.time_ns()
    events = profile.stop()
    mm = [e for e in events if e.get("name") == "aten::mm"]
    assert mm, sorted({e.get("name") for e in events})
    assert all(before <= e["ts_ns"] <= after for e in mm)


def test_the_merged_trace_gives_each_part_a_process() -> None:
    origin = 10 * S
    driver = [("train", origin + S, origin + 3 * S, {})]
    torch_ops = [{"ph": "X", "name": "aten::mm", "pid": 42, "tid": 7, "ts_ns": origin + 2 * S}]
    ranks = [([("train", origin + S, origin + 3 * S, {})], torch_ops)]
    engines = [[("generate", origin, origin + S, {"tokens": 3})]]
    events = profiling.chrome_trace(origin, driver, ranks, engines)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {1: "driver", 100: "training rank 0", 200: "rollout engine 0"}
    (op,) = [e for e in events if e.get("name") == "aten::mm"]
    assert op["pid"] == 100 and op["ts"] == 2e6 and "ts_ns" not in op
    (gen,) = [e for e in events if e.get("name") == "generate"]
    assert (gen["pid"], gen["ts"], gen["dur"], gen["args"]) == (200, 0.0, 1e6, {"tokens": 3})


def test_profile_rollouts_takes_ids_and_ranges() -> None:
    assert parse_args(["--profile-rollouts", "1"]).profile_rollouts == (1,)
    assert parse_args(["--profile-rollouts", "4,1-2"]).profile_rollouts == (1, 2, 4)
    assert parse_args([]).profile_rollouts == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("x", "give rollout ids (from 0) as N, A,B or A-B"),
        ("3-1", "3-1 is not a range of ids >= 0"),
        ("-1", "give rollout ids"),
        ("5", "names rollout 5, and the run has 3 (ids 0-2"),
    ],
)
def test_bad_profile_rollouts_are_one_line_errors(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        parse_args(["--num-rollout", "3", f"--profile-rollouts={value}"])
    assert "\n" not in str(err.value)
