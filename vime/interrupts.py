"""Raise a signal's exception in the main thread, but never inside logging's lock.

Python runs a signal handler in the main thread between two bytecodes, wherever that
thread is. Ctrl-C (``vime.cli``) and SIGTERM (``vime.ray.cluster``) raise there to stop
the run. One place must not see that exception: ``logging`` takes its module lock
before every ``fork`` (Ray and ``subprocess`` fork while a run starts) and releases it
in an at-fork handler. An exception raised in that handler is printed as "Exception
ignored", the lock stays held, and the next ``logging.getLogger`` anywhere hangs the
process for good. So a handler built on ``raise_in_main`` that lands in ``logging``
raises nothing there and sends the same signal again a moment later.
"""

from __future__ import annotations

import os
import threading
from types import FrameType

# How long a signal that landed inside logging waits before it is sent again.
RESEND_DELAY_S = 0.05


def inside_logging(frame: FrameType | None) -> bool:
    """Whether ``frame`` or a frame that called it runs ``logging``'s own code."""
    while frame is not None:
        if frame.f_globals.get("__name__") == "logging":
            return True
        frame = frame.f_back
    return False


def raise_in_main(error: BaseException, signum: int, frame: FrameType | None) -> None:
    """Raise ``error`` from a handler of ``signum`` that interrupted ``frame``; inside
    ``logging``, send ``signum`` to this process again after ``RESEND_DELAY_S`` instead."""
    if inside_logging(frame):
        timer = threading.Timer(RESEND_DELAY_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return
    raise error
