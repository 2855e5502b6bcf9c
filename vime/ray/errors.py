"""The errors the loop catches from Ray, and the wait that raises them.

Where it fits: every call the driver makes on the training ranks and the engines
waits through ``wait_all``, which fails as soon as one actor raises or dies, with
an ``ActorFailure`` naming it (as ``label_actor`` called it); ``vime.cli`` and
``vime.trainer`` catch that, and ``Terminated``, which SIGTERM raises once
``vime.ray.cluster.start_ray`` has run.
"""

from __future__ import annotations

import re
from typing import Any

import ray


class Terminated(KeyboardInterrupt):
    """The driver got SIGTERM (a scheduler's stop, ``kill``): the run stops as on Ctrl-C."""


def wait_all(refs: list[Any], what: str) -> list[Any]:
    """``ray.get`` of every ref, failing as soon as any one fails (no hang on the others).

    A rank that dies leaves its peers blocked in a collective; waiting on the
    refs one by one would hang there, so finished refs are checked as they land.
    The failure's message names the actor (as ``label_actor`` called it) and what
    happened to it: the remote exception's line, or how its process (or its
    node) died.
    """
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                cause = _root_cause(err, pending)
                detail = _ANSI_COLOUR.sub("", str(cause))
                message = f"{what} failed: {_describe(cause, detail)}"
                raise ActorFailure(message, detail=detail) from cause
    return ray.get(refs)


def _root_cause(first: Exception, pending: list[Any], grace_s: float = 2.0) -> Exception:
    """``first``, unless an actor among ``pending`` died meanwhile: when a rank dies, its
    peers' collectives fail too ("connection closed by peer"), sometimes before Ray has
    noticed the death, and the death is what the user needs to read."""
    if isinstance(first, ray.exceptions.ActorDiedError) or not pending:
        return first
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.ActorDiedError as err:
            return err
        except ray.exceptions.RayError:
            pass
    return first


# actor id (hex) -> what the run calls it ("training rank 1"); filled by ``label_actor``.
_ACTOR_LABELS: dict[str, str] = {}


def label_actor(handle: Any, label: str) -> Any:
    """Name ``handle``'s actor in failure messages (``wait_all``); returns the handle."""
    _ACTOR_LABELS[handle._actor_id.hex()] = label
    return handle


def _describe(err: Exception, detail: str) -> str:
    """'<actor>: <remote exception line>', or '<actor> died (<how>)' for a dead process."""
    actor_id = getattr(err, "actor_id", None)
    if not isinstance(actor_id, str):
        found = _ACTOR_ID.search(detail)
        actor_id = found.group(1) if found else None
    who = _ACTOR_LABELS.get(actor_id or "")
    if isinstance(err, ray.exceptions.ActorDiedError):
        if who is None:
            found = _CLASS_NAME.search(detail)
            who = f"actor {found.group(1)}" if found else "an actor"
        pid = _PID.search(detail)
        how = _EXIT_DETAIL.search(detail)
        reason = _node_death(detail) or (how.group(1) if how else "its process died")
        return f"{who}{f' (pid {pid.group(1)})' if pid else ''} died: {reason}"
    return f"{who}: {_short(detail)}" if who else _short(detail)


def died_with_node(failure: BaseException) -> bool:
    """Whether ``failure`` (``wait_all``'s) is an actor lost because its node died."""
    return isinstance(failure, ActorFailure) and _NODE_DIED.search(failure.detail) is not None


def _node_death(detail: str) -> str | None:
    """'its node <ip> (Ray node <id>) <what became of it>' when the actor died with its
    node (a machine lost, a raylet stopped), else None: the node is what to look at."""
    found = _NODE_DIED.search(detail)
    if found is None:
        return None
    ip = _IP.search(detail)
    where = f"{ip.group(1)} (Ray node {found.group(1)[:12]})" if ip else found.group(1)[:12]
    return f"its node {where} {f'was {found.group(2)}' if found.group(2) else 'died'}"


# Ray colours the remote actor's name in its error text; a log file wants plain text.
_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_ACTOR_ID = re.compile(r"actor_id[=:] ?([0-9a-f]+)")
_CLASS_NAME = re.compile(r"class_name: \S*?(\w+)\s")  # the last part of a dotted name
_PID = re.compile(r"\bpid[=:] ?(\d+)")
# "The actor died because its node has died. Node Id: <hex>" then, on the next line,
# "the actor's node was terminated expectedly: received SIGTERM" (Ray 2.60's GCS).
_NODE_DIED = re.compile(
    r"its node has died\. Node Id: ([0-9a-f]+)(?:\s+the actor's node was ([^\n]+))?"
)
_IP = re.compile(r"^\s*ip: (\S+)", re.MULTILINE)
# "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of ..."
_EXIT_DETAIL = re.compile(r"Worker exit detail: (.+?\.)(?:\s|$)")


class ActorFailure(RuntimeError):
    """A training rank or an engine raised or died; the run stops.

    The message is one line (the remote error's own last line); ``detail`` is Ray's
    whole report, remote traceback included, for a log file or the console.
    """

    def __init__(self, message: str, *, detail: str = "", log_path: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail
        self.log_path = log_path

    def logged_to(self, path: str) -> ActorFailure:
        """This failure with its detail written to ``path``, and the message saying where."""
        with open(path, "w") as f:
            f.write(self.detail or str(self))
            f.write("\n")
        return ActorFailure(f"{self} (full report in {path})", detail=self.detail, log_path=path)


def _short(detail: str) -> str:
    """The remote exception's own line, which Ray puts last in its message."""
    lines = [line for line in detail.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "the remote actor gave no reason"
