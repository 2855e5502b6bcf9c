"""Ctrl-C and SIGTERM never raise inside logging's lock (vime.interrupts)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from vime import cli
from vime.interrupts import inside_logging, raise_in_main
from vime.ray import cluster
from vime.ray.errors import Terminated


def _a_frame_inside_logging() -> FrameType:
    """A frame of logging's own code, as the main thread has in its at-fork handler."""
    frames: list[FrameType] = []

    class Grab(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            frames.append(sys._getframe(1))
            return False

    logger = logging.getLogger("vime.tests.interrupts")
    grab = Grab()
    logger.addFilter(grab)
    try:
        logger.error("grabbed")
    finally:
        logger.removeFilter(grab)
    return frames[0]


def test_only_frames_of_logging_count_as_inside_it() -> None:
    """The check finds logging in the frame or any caller, and nowhere else."""
    assert inside_logging(_a_frame_inside_logging())
    assert not inside_logging(sys._getframe())
    assert not inside_logging(None)


@pytest.mark.parametrize(
    ("handler", "signum", "error"),
    [
        (cli._on_sigint, signal.SIGINT, KeyboardInterrupt),
        (cluster._raise_terminated, signal.SIGTERM, Terminated),
    ],
)
def test_a_stop_landing_in_logging_is_raised_once_out_of_it(
    handler: Callable[[int, Any], None], signum: int, error: type[BaseException]
) -> None:
    """The run's Ctrl-C and SIGTERM handlers raise nothing in logging (where an exception
    would leave its lock held and hang the run); the signal comes again and raises then."""
    before = signal.signal(signum, handler)
    try:
        handler(signum, _a_frame_inside_logging())  # raised here, it would fail the test
        with pytest.raises(error):
            threading.Event().wait(10)  # the resent signal interrupts this wait
    finally:
        signal.signal(signum, before)
        cli._INTERRUPTED.clear()


def test_outside_logging_the_error_is_raised_at_once() -> None:
    with pytest.raises(RuntimeError, match="now"):
        raise_in_main(RuntimeError("now"), signal.SIGUSR1, sys._getframe())
