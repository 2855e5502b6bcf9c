r"""math-verify in a process of its own: the comparison behind ``--rm-type math``.

Where it fits: :func:`vime.rollout.math_answer.math_reward` picks the answer text and
the label's answers, then asks :class:`MathVerifyProcess` whether they are equal. That
runs math-verify (HF's checker, the ``agents`` extra) in a child Python process,
``parse`` on each side and ``verify(gold, answer)``, for two reasons:

- math-verify bounds each parse and comparison with ``signal.alarm``, which only works
  in a main thread, and vime scores rewards in other threads too (the asynchronous
  producer's). The child runs every check in its main thread, so math-verify's own
  timeouts hold; an answer that times out there is not equal (0.0).
- Without those timeouts sympy can take unbounded time and memory on what a model may
  write (``\boxed{9^{9^{9^{9}}}}`` against ``1`` ran past 5 minutes in-process).
  Should the child still not answer by a hard deadline it is killed, the check raises
  :class:`MathVerifyError` (the sample's reward fails, it is not scored 0), and the
  next check starts a new child.

The child is started on the first check (importing sympy takes a second or two) and
ends when its stdin closes: at exit, or when this process dies. Requests and replies
are JSON lines; the child answers each request with one line.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

PARSE_TIMEOUT_S = 5  # math-verify's defaults, per parse and per comparison
STARTUP_S = 120.0  # a loaded machine can take long to import sympy
# The child's own timeouts end almost every check well before this; the deadline is
# for what a signal cannot interrupt.
DEADLINE_S = 60.0
MATH_VERIFY_MISSING = (
    "--rm-type math checks answers with math-verify, which is not installed: "
    "pip install -e '.[agents]'"
)
_VIME_ROOT = str(Path(__file__).resolve().parents[2])


class MathVerifyError(RuntimeError):
    """The checker could not give a verdict (its process died or ran past the deadline)."""


def math_verify_installed() -> bool:
    """Whether the ``math_verify`` package can be imported (without importing it)."""
    return importlib.util.find_spec("math_verify") is not None


# ---------------------------------------------------------------- the child's side


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout_s: int) -> tuple:
    from math_verify import parse

    # A bare label ("x+1", "A") is found by the LaTeX extraction only inside $...$;
    # one with its own \boxed{} is parsed as it is.
    return tuple(parse(gold if "\\boxed" in gold else f"${gold}$", parsing_timeout=timeout_s))


def check(answer: str, golds: list[str], timeout_s: int = PARSE_TIMEOUT_S) -> bool:
    """Whether math-verify finds ``answer`` equal to any of ``golds``. Its timeouts are
    signals: call this in a main thread (the child does)."""
    from math_verify import parse, verify

    parsed = parse(answer, parsing_timeout=timeout_s)
    if not parsed:
        return False
    for gold in golds:
        gold_parsed = list(_parse_gold(gold, timeout_s))
        if gold_parsed and verify(gold_parsed, parsed, timeout_seconds=timeout_s):
            return True
    return False


def serve() -> None:
    """The child: one JSON request a line on stdin, one JSON reply a line back."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt replies
    sys.stdout = sys.stderr
    # A timed-out parse is a verdict here (not equal), not news for the log.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401

    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply: dict[str, Any] = {"equal": check(**request)}
        except Exception as err:
            reply = {"error": f"{type(err).__name__}: {err}"[:300]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# ---------------------------------------------------------------- this process's side


class MathVerifyProcess:
    """A child process that runs :func:`check`; one check at a time, from any thread."""

    def __init__(self, timeout_s: int = PARSE_TIMEOUT_S, deadline_s: float = DEADLINE_S):
        self.timeout_s, self.deadline_s = timeout_s, deadline_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def equal(self, answer: str, golds: list[str]) -> bool:
        """math-verify's verdict on ``answer`` against ``golds``; ``MathVerifyError`` when
        the child gives none in time."""
        request = {"answer": answer, "golds": golds, "timeout_s": self.timeout_s}
        with self._lock:
            proc = self._running()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write((json.dumps(request) + "\n").encode())
                proc.stdin.flush()
            except OSError:
                self._stop()
                raise MathVerifyError("math-verify's process ended before the check") from None
            reply = self._reply(proc.stdout, self.deadline_s, "the check")
        if "error" in reply:
            raise MathVerifyError(f"math-verify raised {reply['error']}")
        return bool(reply["equal"])

    def _running(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_VIME_ROOT, env.get("PYTHONPATH")) if p)
        code = "from vime.rollout.math_checker import serve; serve()"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert self._proc.stdout is not None
        self._reply(self._proc.stdout, STARTUP_S, "start-up")
        return self._proc

    def _reply(self, stdout: IO[bytes], wait_s: float, what: str) -> dict:
        end = time.monotonic() + wait_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                self._stop()
                raise MathVerifyError(f"math-verify gave no answer within {wait_s:.0f} s ({what})")
            ready, _, _ = select.select([stdout], [], [], left)
            if ready:
                break
        line = stdout.readline()
        if not line:
            code = self._stop()
            raise MathVerifyError(f"math-verify's process ended (exit status {code}) at {what}")
        return json.loads(line)

    def _stop(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # unflushed bytes to a dead pipe
                    pipe.close()
        return proc.wait()

    def close(self) -> None:
        """End the child (it also ends by itself when this process does)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
