"""Engine faults: a dead or hung rollout engine is found, counted and replaced.

Where it fits: ``vime.ray.engines.EngineGroup`` owns one ``EngineFaults`` (the restart
budget, ``--max-engine-restarts`` within ``--engine-restart-window`` rollouts, which the
trainer's loop names as it starts each; the counts the metrics report) and one
``HealthWatch``, a driver thread that sends every started engine a health call in its
own concurrency group and kills the engine whose call is not answered within
``--engine-timeout`` seconds, or whose step counter (``vime.rollout.step_gate``) stands
still that long while a generation is in flight. A hung engine thus fails its callers
as a dead one does (Ray's ``ActorDiedError``), and one path restarts both: the group
starts a new actor on the same bundle, the run's weight transport loads the current
weights into it, and the calls it held are sent again (``EngineGroup``,
``vime.rollout.producer``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from vime.ray.errors import ActorFailure
from vime.rollout.settings import FaultSettings

RESTARTS_KEY = "fault/engine_restarts"
RESENT_KEY = "fault/requests_resent"
# The longest wait between two looks of the health watch.
MAX_WATCH_INTERVAL_S = 1.0


def engine_died(failure: BaseException) -> bool:
    """Whether ``failure`` (``wait_all``'s) is an engine's process gone, not an error it
    raised: only the former is restarted."""
    return isinstance(failure.__cause__, ray.exceptions.RayActorError)


@dataclass
class EngineFaults:
    """The run's restart budget and counts, and the engines waiting for a restart.

    The budget is ``max_restarts`` within any ``restart_window`` consecutive rollouts
    (0: the whole run), counted on the rollout the trainer last named (``at_rollout``).
    """

    settings: FaultSettings
    restarts: int = 0
    resent: int = 0
    # engine index -> the failure that took it (its actor is replaced by ``recover``)
    lost: dict[int, ActorFailure] = field(default_factory=dict)
    rollout: int = 0  # the rollout in progress
    # the rollout of each restart still inside the window, oldest first
    recent: deque[int] = field(default_factory=deque)

    def metrics(self) -> dict[str, float]:
        """The run's totals so far, for every metrics line."""
        return {RESTARTS_KEY: float(self.restarts), RESENT_KEY: float(self.resent)}

    def at_rollout(self, rollout_id: int) -> None:
        """The trainer starts rollout ``rollout_id``: restarts from now on count there."""
        self.rollout = rollout_id

    def budget(self) -> str:
        """The budget in words, for the console: ``--max-engine-restarts N`` and its window."""
        window = self.settings.restart_window
        within = f"within {window} rollouts" if window else "in the run"
        return f"--max-engine-restarts {self.settings.max_restarts} {within}"

    def take_restart(self, engine: int, failure: ActorFailure) -> None:
        """Count one restart of ``engine``, or raise: ``failure`` itself with restarts off
        (the run stops as it always did), one line naming the engine beyond the budget."""
        limit, window = self.settings.max_restarts, self.settings.restart_window
        if limit == 0:
            raise failure
        while window and self.recent and self.recent[0] <= self.rollout - window:
            self.recent.popleft()  # out of the window: forgiven
        if len(self.recent) >= limit:
            raise ActorFailure(
                f"rollout engine {engine} failed after {len(self.recent)} engine restart(s) "
                f"({self.budget()}): {failure}",
                detail=failure.detail,
            )
        self.recent.append(self.rollout)
        self.restarts += 1


@dataclass
class _Watched:
    """What the watch knows of one engine actor."""

    ping: Any = None  # the health call in flight
    sent: float = 0.0
    progress: int | None = None
    moved: float = 0.0  # when ``progress`` last changed, or the engine was last idle


class HealthWatch:
    """A driver thread: every engine's health call, each with ``timeout_s`` to answer.

    ``engines()`` gives ``(index, actor, pid, busy)`` of every started engine: ``pid``
    its process on the driver's node (0 elsewhere), ``busy`` whether a generation is in
    flight there. A hung engine is killed (its process too,
    when it runs on this node) and its reason kept for ``reason``: the calls it held
    fail with ``ActorDiedError``, which the group handles as any death.
    """

    def __init__(
        self,
        timeout_s: float,
        engines: Callable[[], Sequence[tuple[int, Any, int, bool]]],
    ) -> None:
        self.timeout_s, self._engines = timeout_s, engines
        self._watched: dict[str, _Watched] = {}
        self._reasons: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vime-engine-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def reason(self, actor: Any) -> str | None:
        """Why the watch killed ``actor``; None if it did not."""
        return self._reasons.get(actor._actor_id.hex())

    def _run(self) -> None:
        interval = min(MAX_WATCH_INTERVAL_S, self.timeout_s / 4)
        while not self._stop.wait(interval) and ray.is_initialized():
            try:
                for engine, actor, pid, busy in self._engines():
                    why = self._look(actor, busy)
                    if why is not None:
                        self._kill(engine, actor, pid, why)
            except Exception:  # Ray going down under it: the run ends anyway
                if not ray.is_initialized():
                    return
                raise

    def _look(self, actor: Any, busy: bool) -> str | None:
        """Why ``actor`` counts as hung now, or None."""
        key, now = actor._actor_id.hex(), time.monotonic()
        if key in self._reasons:
            return None
        seen = self._watched.setdefault(key, _Watched(moved=now))
        if seen.ping is None:
            seen.ping, seen.sent = actor.health.remote(), now
        done, _ = ray.wait([seen.ping], timeout=0)
        if done:
            seen.ping = None
            try:
                progress = ray.get(done[0])
            except ray.exceptions.RayError:  # dead: its callers see that themselves
                return None
            if progress != seen.progress:
                seen.progress, seen.moved = progress, now
        elif now - seen.sent > self.timeout_s:
            return f"did not answer a health call within --engine-timeout {self.timeout_s:g} s"
        if not busy:
            seen.moved = now
        elif now - seen.moved > self.timeout_s:
            return f"made no progress for --engine-timeout {self.timeout_s:g} s while generating"
        return None

    def _kill(self, engine: int, actor: Any, pid: int, why: str) -> None:
        self._reasons[actor._actor_id.hex()] = why
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        # A stopped or stuck process outlives ray.kill, holding its memory; on this node
        # (``pid`` given) it is ended here; elsewhere Ray's own kill is all there is.
        if pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
