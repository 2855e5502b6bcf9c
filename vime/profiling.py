"""Where the time goes: spans recorded where the work runs, busy and idle fractions, traces.

Where it fits: every training rank (``vime.ray.train_group.TrainWorker``) and rollout
engine (``vime.ray.engines.EngineActor``) records a :class:`Span` around each call
that does work (generate, score, load weights; train, log-probs, send weights,
sleep/wake) with the module-level :func:`span`; the hf engine adds its prefill and
decode inside. The driver records its own phases with a :class:`PhaseClock`
(rollout, reward, train, sync, probe, eval, save) and, once per rollout, drains the
actors' spans (``StepTiming`` in ``vime.step_timing``) and turns them into metrics
with :func:`timing_metrics`. For ``--profile-rollouts`` the ranks also run
``torch.profiler`` (:class:`TorchProfile`) and :func:`chrome_trace` merges all of it
into one Chrome trace-event JSON (Perfetto, ``chrome://tracing``).

Clocks: every span is stamped with ``time.time_ns()`` (wall clock) in the process
that ran it, and torch.profiler's events are converted to the same clock (its
``baseTimeNanoseconds``). That lines the processes up exactly on one machine; across
nodes it assumes their clocks agree (NTP: typically within a millisecond).

Busy and idle, over a step's wall-clock window ``[t0, t1)``::

    busy(actor)  = | ∪ spans(actor) ∩ [t0, t1) |       (nested spans count once)
    idle(actor)  = 1 - busy(actor) / (t1 - t0)
    driver_only  = 1 - | ∪_all actors ∪ spans ∩ [t0, t1) | / (t1 - t0)

``driver_only`` is the share of the step in which no engine and no rank worked: the
driver's own work (reward, batching) and the calls' overhead.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

# (name, start_ns, end_ns, args): wall-clock nanoseconds (time.time_ns).
Span = tuple[str, int, int, dict[str, Any]]

# Driver phases nested in others (the reward is scored inside rollout and eval).
NESTED_PHASES = frozenset({"reward"})
# A recorder that nobody drains keeps at most this many spans (the oldest are dropped).
_MAX_SPANS = 200_000


class Recorder:
    """The spans of one process, kept until ``drain``. Off until ``enable``: a process
    that is not an actor (a test using an engine directly) keeps nothing."""

    def __init__(self) -> None:
        self.enabled = False
        self._spans: list[Span] = []
        self._open: dict[object, tuple[str, int]] = {}  # spans begun and not yet ended

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Record the ``with`` block as a span named ``name``; the block may add to the
        yielded ``args`` (e.g. the tokens it generated)."""
        if not self.enabled:
            yield args
            return
        start, key = time.time_ns(), object()
        self._open[key] = (name, start)
        try:
            yield args
        finally:
            del self._open[key]
            if len(self._spans) >= _MAX_SPANS:
                del self._spans[: _MAX_SPANS // 2]
            self._spans.append((name, start, time.time_ns(), args))

    def drain(self) -> list[Span]:
        """The spans ended since the last drain, and each span still running as one that
        ends now, marked ``{"open": True}`` (it comes again, whole, once it has ended): a
        call that outlives a step (asynchronous generation) is busy time of that step."""
        now = time.time_ns()
        spans, self._spans = self._spans, []
        running = [(name, start, now, {"open": True}) for name, start in list(self._open.values())]
        return spans + running


RECORDER = Recorder()


def enable() -> None:
    """Start recording this process's spans (each actor calls it once)."""
    RECORDER.enabled = True


def span(name: str, **args: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """A span of this process's recorder (a no-op until ``enable``)."""
    return RECORDER.span(name, **args)


def drain() -> list[Span]:
    """This process's spans since the last drain."""
    return RECORDER.drain()


def timed(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: every call of the function is a span ``name``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with span(name):
                return fn(*args, **kwargs)

        return call

    return wrap


# ----- busy time --------------------------------------------------------------------------


def covered_ns(spans: Iterable[Span], start: int, end: int) -> int:
    """Nanoseconds of ``[start, end)`` inside at least one of ``spans`` (their union)."""
    clipped = sorted((max(s, start), min(e, end)) for _, s, e, _ in spans)
    total, reach = 0, start
    for s, e in clipped:
        if e <= max(s, reach):  # outside the window, or already counted
            continue
        total += e - max(s, reach)
        reach = e
    return total


class PhaseClock(Recorder):
    """The driver's phases of one step: a recorder of its own, always on, whose spans are
    the phases (``phase`` is ``span``)."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = True

    def start(self) -> int:
        """The step's start, on the spans' clock."""
        return time.time_ns()

    def phase(self, name: str) -> contextlib.AbstractContextManager[dict[str, Any]]:
        return self.span(name)


class TimedCalls:
    """``target`` with the calls of ``methods`` recorded as driver phase ``phase`` (the
    reward scorer the rollout manager calls, timed without the manager knowing)."""

    def __init__(self, target: Any, clock: PhaseClock, phase: str, methods: Sequence[str]):
        self._target, self._clock, self._phase = target, clock, phase
        self._methods = frozenset(methods)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in self._methods:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._clock.phase(self._phase):
                return attr(*args, **kwargs)

        return call


def _per_phase(driver: list[Span], start: int, end: int) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for name, s, e, _ in driver:
        overlap = max(0, min(e, end) - max(s, start))
        seconds[name] = seconds.get(name, 0.0) + overlap / 1e9
    return seconds


def _inside(spans: Iterable[Span], windows: list[tuple[int, int]], name: str) -> list[Span]:
    """The spans called ``name`` whose midpoint falls in one of ``windows``."""
    return [
        sp
        for sp in spans
        if sp[0] == name and any(s <= (sp[1] + sp[2]) // 2 < e for s, e in windows)
    ]


def timing_metrics(
    window: tuple[int, int],
    driver: list[Span],
    ranks: Sequence[list[Span]],
    engines: Sequence[list[Span]],
) -> dict[str, float]:
    """One step's time metrics from its spans (see the module docstring and docs/performance.md):

    ``phase/<name>_s``: the driver's time in each phase (``reward`` is inside
    ``rollout`` and ``eval``); ``phase/other_s``: the rest of the step.
    ``perf/{engine,trainer}_idle_frac_{mean,max}`` over engines / ranks;
    ``perf/driver_only_frac``; ``perf/weight_sync_bytes`` (per engine, mean) and
    ``_bytes_per_s`` (over the sync phase); ``perf/eval_tokens_per_s`` when eval ran;
    ``perf/log_prob_passes``: forward-only passes rank 0 ran in the train phase.
    """
    start, end = window
    length = max(1, end - start)
    phases = _per_phase(driver, start, end)
    out = {f"phase/{name}_s": seconds for name, seconds in phases.items()}
    top = sum(v for k, v in phases.items() if k not in NESTED_PHASES)
    out["phase/other_s"] = max(0.0, length / 1e9 - top)
    for side, spans in (("engine", engines), ("trainer", ranks)):
        idle = [1.0 - covered_ns(s, start, end) / length for s in spans]
        if idle:
            out[f"perf/{side}_idle_frac_mean"] = sum(idle) / len(idle)
            out[f"perf/{side}_idle_frac_max"] = max(idle)
    every = [sp for actor in [*ranks, *engines] for sp in actor]
    out["perf/driver_only_frac"] = 1.0 - covered_ns(every, start, end) / length
    if engines:
        received = [
            sum(sp[3].get("bytes", 0) for sp in spans if start <= sp[1] < end) for spans in engines
        ]
        out["perf/weight_sync_bytes"] = float(sum(received) / len(received))
        if phases.get("sync"):
            out["perf/weight_sync_bytes_per_s"] = out["perf/weight_sync_bytes"] / phases["sync"]
    evals = [(s, e) for name, s, e, _ in driver if name == "eval"]
    if evals and phases.get("eval"):
        generated = [sp for spans in engines for sp in _inside(spans, evals, "generate")]
        tokens = sum(sp[3].get("tokens", 0) for sp in generated)
        out["perf/eval_tokens_per_s"] = tokens / phases["eval"]
    trains = [(s, e) for name, s, e, _ in driver if name == "train"]
    out["perf/log_prob_passes"] = float(len(_inside(ranks[0], trains, "log_probs")) if ranks else 0)
    return out


def phase_busy_fractions(
    driver: list[Span], ranks: Sequence[list[Span]], engines: Sequence[list[Span]]
) -> dict[str, dict[str, float]]:
    """For each top-level driver phase: the share of its time the engines (mean) and the
    ranks (mean) were busy. What a trace says phase by phase (the report, tests)."""
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(n for n, *_ in driver if n not in NESTED_PHASES):
        windows = [(s, e) for n, s, e, _ in driver if n == name]
        total = sum(e - s for s, e in windows) or 1
        busy = {}
        for side, actors in (("engines", engines), ("ranks", ranks)):
            shares = [sum(covered_ns(a, s, e) for s, e in windows) / total for a in actors]
            busy[side] = sum(shares) / len(shares) if shares else 0.0
        out[name] = busy
    return out


# ----- torch.profiler on a rank, and the merged trace ------------------------------------


class TorchProfile:
    """torch.profiler on this process between ``start`` and ``stop`` (CPU ops, and the
    GPU's kernels where there is one); ``stop`` returns its Chrome trace events with
    wall-clock timestamps (``ts_ns``)."""

    def __init__(self) -> None:
        self._profile: Any = None

    def start(self) -> None:
        import torch

        # Kineto prints a line at every start and stop on stdout (the run's console, via
        # Ray) unless told to log quietly; it reads this when the profiler starts.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()

    def stop(self) -> list[dict[str, Any]]:
        if self._profile is None:
            return []
        profile, self._profile = self._profile, None
        profile.stop()
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            profile.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        # Kineto's ts are microseconds after baseTimeNanoseconds (a Unix-epoch time).
        base = int(trace.get("baseTimeNanoseconds", 0))
        events = []
        for event in trace.get("traceEvents", []):
            # Flows link ops by ids that would collide between ranks; "Trace" spans the
            # profiler's own life, not work.
            if event.get("ph") not in ("X", "i", "M") or event.get("cat") == "Trace":
                continue
            if "ts" in event:
                event["ts_ns"] = base + round(float(event.pop("ts")) * 1000)
            events.append(event)
        return events


DRIVER_PID, RANK_PID, ENGINE_PID = 1, 100, 200


_PROCESS_META = ("process_name", "process_sort_index")


def _meta(pid: int, name: str, sort: int) -> list[dict[str, Any]]:
    named, sorted_ = ({"name": name}, {"sort_index": sort})
    return [
        {"ph": "M", "name": key, "pid": pid, "tid": 0, "args": args}
        for key, args in zip(_PROCESS_META, (named, sorted_), strict=True)
    ]


def _span_events(spans: Iterable[Span], pid: int, tid: int, origin: int) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "cat": "vime",
            "ph": "X",
            "pid": pid,
            "tid": tid,
            "ts": (s - origin) / 1000,
            "dur": (e - s) / 1000,
            "args": args,
        }
        for name, s, e, args in spans
        if not args.get("open")  # the whole span follows, drained once it ended
    ]


def chrome_trace(
    origin_ns: int,
    driver: list[Span],
    ranks: Sequence[tuple[list[Span], list[dict[str, Any]]]],
    engines: Sequence[list[Span]],
) -> list[dict[str, Any]]:
    """Trace events (Chrome JSON, microseconds after ``origin_ns``), one process per part:
    the driver's phases, each rank's calls (tid 0) beside its torch.profiler events
    (``TorchProfile.stop``, their own threads), each engine's calls."""
    events = _meta(DRIVER_PID, "driver", 0)
    events += _span_events(driver, DRIVER_PID, 0, origin_ns)
    for rank, (spans, torch_events) in enumerate(ranks):
        pid = RANK_PID + rank
        events += _meta(pid, f"training rank {rank}", 1 + rank)
        events.append(_thread_name(pid, 0, "vime calls"))
        events += _span_events(spans, pid, 0, origin_ns)
        for event in torch_events:
            if event.get("ph") == "M" and event.get("name") in _PROCESS_META:
                continue
            event = {**event, "pid": pid}
            if "ts_ns" in event:
                event["ts"] = (event.pop("ts_ns") - origin_ns) / 1000
            events.append(event)
    for e, spans in enumerate(engines):
        pid = ENGINE_PID + e
        events += _meta(pid, f"rollout engine {e}", 1 + len(ranks) + e)
        events += _span_events(spans, pid, 0, origin_ns)
    return events


def _thread_name(pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def write_trace(path: str, events: list[dict[str, Any]], origin_ns: int) -> None:
    """Write ``events`` as a Chrome trace-event JSON file (atomically)."""
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "vime --profile-rollouts",
            "origin_unix_ns": origin_ns,
            "clock": "time.time_ns() of each process; one machine, or nodes whose clocks agree",
        },
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, default=str)
    os.replace(tmp, path)
