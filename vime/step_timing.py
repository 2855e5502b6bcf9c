"""Per-rollout timing on the driver: phase times, idle fractions, MFU, and the trace.

Where it fits: ``vime.setup.run`` builds one ``StepTiming`` for ``vime.trainer.Run``.
``Run.step`` opens it with ``begin``, wraps its phases in ``phase(name)`` and ends with
``step_metrics(lengths)``, which drains the spans the ranks and engines recorded
(``vime.profiling``) and returns the step's ``phase/*`` and ``perf/*`` metrics; the
loop calls ``end`` once the rollout's line is logged and its checkpoint saved. For a
rollout named by ``--profile-rollouts`` the ranks run torch.profiler from ``begin``
to ``end`` and ``end`` (re)writes the trace file with everything recorded in that
time, the save included.

The train phase's MFU is ``vime.perf``'s: the FLOPs of the lengths trained, with the
log-prob passes rank 0 ran in that phase, over the phase's wall time and the sum of
the ranks' peaks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from vime import perf
from vime.profiling import PhaseClock, Span, chrome_trace, timing_metrics, write_trace


class StepTiming:
    """The timing of each rollout (see the module docstring)."""

    def __init__(
        self,
        train_group: Any,
        engines: Any,
        clock: PhaseClock,
        *,
        shape: perf.ModelShape,
        peaks: Sequence[perf.Peak],
        profile_rollouts: Sequence[int] = (),
        trace_path: str | None = None,
    ) -> None:
        self.train_group, self.engines, self.clock = train_group, engines, clock
        self.shape = shape
        self.peak_flops = float(sum(p.flops_per_s for p in peaks))
        self.peak_source = "; ".join(dict.fromkeys(p.source for p in peaks))
        self.profile_rollouts = frozenset(profile_rollouts)
        self.trace_path = trace_path
        self.traced: list[int] = []  # rollouts whose trace is written
        self._events: list[dict[str, Any]] = []
        self._origin: int | None = None
        self._window = (0, 0)
        self._kept: tuple[list[Span], list[list[Span]], list[list[Span]]] | None = None
        self._rollout_id = -1

    def begin(self, rollout_id: int) -> None:
        self._rollout_id = rollout_id
        if self.profiling:
            self.train_group.start_profile()  # before the clock: its start-up is not the step's
        self._window = (self.clock.start(), 0)

    @property
    def profiling(self) -> bool:
        return self._rollout_id in self.profile_rollouts and self.trace_path is not None

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.clock.phase(name)

    def step_metrics(self, lengths: Sequence[int]) -> dict[str, float]:
        """The step's time metrics (``vime.profiling.timing_metrics``) with the train
        phase's tokens/s, FLOPs and MFU; ``lengths``: the trained samples' token counts."""
        window = (self._window[0], time.time_ns())
        self._window = window
        driver = self.clock.drain()
        ranks, engines = self.train_group.drain_spans(), self.engines.drain_spans()
        if self.profiling:
            self._kept = (driver, ranks, engines)
        out = timing_metrics(window, driver, ranks, engines)
        train_s = out.get("phase/train_s", 0.0)
        passes = int(out.pop("perf/log_prob_passes"))
        flops = perf.train_flops(self.shape, lengths, passes)
        out.update(
            {
                "perf/step_time_s": (window[1] - window[0]) / 1e9,
                "perf/train_time_s": train_s,
                "perf/weight_sync_time_s": out.get("phase/sync_s", 0.0),
                "perf/train_tokens_per_s": sum(lengths) / max(train_s, 1e-9),
                "perf/train_flops": flops,
                "perf/peak_flops": self.peak_flops,
                "perf/train_mfu": perf.mfu(flops, train_s, self.peak_flops),
            }
        )
        return out

    def end(self) -> None:
        """After the rollout's line and checkpoint: a profiled rollout's trace is written."""
        if not self.profiling or self._kept is None:
            return
        torch_events = self.train_group.stop_profile()
        driver, ranks, engines = self._kept
        self._kept = None
        start = self._window[0]
        driver = [
            (f"rollout {self._rollout_id}", start, self._window[1], {}),
            *driver,
            *self.clock.drain(),
        ]
        later_ranks, later_engines = self.train_group.drain_spans(), self.engines.drain_spans()

        def recent(spans: list[Span]) -> list[Span]:
            return [sp for sp in spans if sp[2] > start]

        ranks = [recent(a + b) for a, b in zip(ranks, later_ranks, strict=True)]
        engines = [recent(a + b) for a, b in zip(engines, later_engines, strict=True)]
        if self._origin is None:
            self._origin = start
        per_rank = list(zip(ranks, torch_events, strict=True))
        self._events += chrome_trace(self._origin, recent(driver), per_rank, engines)
        write_trace(self.trace_path, self._events, self._origin)
        self.traced.append(self._rollout_id)
