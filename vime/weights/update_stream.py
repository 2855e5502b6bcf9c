"""One engine weight update fed bucket by bucket across several calls.

Where it fits: the receiving side of the push transports (``broadcast``,
``cuda-ipc``). Training rank 0 hands a rollout engine one bucket per Ray call
(``vime.ray.transports``), and ``vime.ray.engines.EngineActor`` passes each one to
an ``UpdateStream``, which feeds them all into a *single* ``update_weights`` call
running on a thread of its own, as if the whole set had arrived at once.

Why one call: vLLM's in-place reload prepares and finalizes every layer of the
model on each call (about 20 ms a call at 36 layers, ``bench/engine_update.py``),
and it rebuilds a fused layer (qkv, gate_up) from what one call carried, so a layer
whose HF parts arrive in two buckets must not be loaded by two calls. In one call it
may be: vLLM holds the first part until the rest arrives. The tensors put in must
therefore belong to the stream (the broadcast allocates them; CUDA-IPC views are
cloned first), since the engine may keep one until the update ends.

``put`` returns once the update has finished with the bucket (it asked for the next
one), so at most one bucket is in flight and a sender that reuses its memory after
the call returns is safe. An error in the update comes out of the ``put`` or
``finish`` that meets it, as raised by the engine.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vime.weights.buckets import Bucket

_END = object()
# How often a waiting call checks that the update thread still runs (it cannot be told).
_POLL_S = 0.1


class UpdateStream:
    """Runs ``update(buckets)`` on a thread, ``buckets`` being what ``put`` hands over
    until ``finish`` (or ``abort``)."""

    def __init__(self, update: Callable[[Iterable[Bucket]], Any]) -> None:
        self._inbox: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._taken: queue.Queue[None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(update,), name="vime-weight-update", daemon=True
        )
        self._thread.start()

    def put(self, bucket: Bucket) -> None:
        """Hand ``bucket`` to the update; return once the update is done with it."""
        self._inbox.put(bucket)  # never blocks: the update took the previous bucket
        while True:
            try:
                return self._taken.get(timeout=_POLL_S)
            except queue.Empty:
                self._raise_if_ended()

    def finish(self) -> None:
        """End the set: wait for the update to complete it; raise what it raised."""
        self._raise_if_ended()
        self._inbox.put(_END)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """End the update with what it has (the caller failed half-way); swallow its
        complaint (an incomplete set, say): the caller is already raising its own."""
        if self._thread.is_alive():
            self._inbox.put(_END)
            self._thread.join()

    def _buckets(self) -> Iterator[Bucket]:
        while (bucket := self._inbox.get()) is not _END:
            yield bucket
            # The update asks for the next bucket: it has loaded (or kept) this one.
            self._taken.put(None)

    def _run(self, update: Callable[[Iterable[Bucket]], Any]) -> None:
        try:
            update(self._buckets())
        except BaseException as err:  # handed to the caller's thread
            self._error = err

    def _raise_if_ended(self) -> None:
        if self._thread.is_alive():
            return
        if self._error is not None:
            raise self._error
        raise RuntimeError("the engine's weight update ended before it took every bucket")
