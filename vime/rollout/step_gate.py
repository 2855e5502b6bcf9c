"""``StepGate``: new weights land between two decode steps of a generation in flight.

Where it fits: an engine that can take weights while it generates (asynchronous
rollout, ``--max-staleness`` >= 1) runs each forward inside ``step()`` and each weight
load inside ``load()``, the two from different threads of its actor. A load waits for
the forward in progress, then runs alone; a step waits while a load is waiting or
running. Loads go first: a plain lock released and taken again at every step would
let a busy generation keep it for its whole length (the thread that releases a lock
usually takes it back before a waiter wakes), so the weights would arrive only once
the generation ended -- the draining that asynchrony exists to avoid. A load whose
wait raises stops counting as waiting, or every later step would wait for it for ever.
A load taken again by the thread that holds one is part of it, so several loads
(LoRA's base and adapter) land as one between two steps. ``progress`` counts the steps
and loads begun and ended: what the driver's health calls read to tell a busy engine
from a hung one (``vime.ray.engine_watch``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class StepGate:
    """One forward or one weight load at a time; waiting loads go before the next step."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._stepping = False
        self._loading = False
        self._loads_waiting = 0  # the running load included
        self._loader: int | None = None  # the thread running the load
        self._progress = 0

    @property
    def progress(self) -> int:
        """Steps and loads begun and ended so far: it moves while the engine works."""
        return self._progress

    @property
    def loads_waiting(self) -> int:
        """Loads waiting for the step in progress or running (for tests and metrics)."""
        with self._cond:
            return self._loads_waiting

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One forward of a generation (or a scoring pass): waits for pending loads."""
        with self._cond:
            while self._loads_waiting or self._stepping:
                self._cond.wait()
            self._stepping = True
            self._progress += 1
        try:
            yield
        finally:
            with self._cond:
                self._stepping = False
                self._progress += 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def load(self) -> Iterator[None]:
        """A whole weight load: after the step in progress, before any later one. Inside
        a load of the same thread it is part of that load (no step between the two)."""
        me = threading.get_ident()
        with self._cond:
            if self._loader == me:
                nested = True
            else:
                nested = False
                self._loads_waiting += 1
                entered = False
                try:
                    while self._stepping or self._loading:
                        self._cond.wait()
                    self._loading, self._loader = True, me
                    self._progress += 1
                    entered = True
                finally:
                    if not entered:  # the wait raised (a signal, an interrupt): not waiting
                        self._loads_waiting -= 1
                        self._cond.notify_all()
        if nested:
            yield
            return
        try:
            yield  # runs without the condition held: a slow transfer blocks only steps
        finally:
            with self._cond:
                self._loading, self._loader = False, None
                self._progress += 1
                self._loads_waiting -= 1
                self._cond.notify_all()
