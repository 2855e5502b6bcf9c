"""Placement layout and the fail-fast wait of the Ray layer.

Proves: ``layout_of`` gives one bundle per training rank plus the rollout
devices (none extra when colocated), engine bundles never overlap training
bundles unless colocated, and bad counts are refused; ``wait_all`` raises with
the failing actor's error as soon as one actor dies, while a peer is still
blocked (as a rank stuck in a collective would be): nothing hangs. Joining an
address where a server accepts connections but is not a Ray GCS (one that says
nothing, one that answers like a web server) is refused by ``start_ray`` with
a one-line ``ConfigError`` naming the address and the head's port, where
``ray.init`` would retry for minutes. Ranks and engines take the placement group's
bundles node by node, however Ray numbered them. Once Ray is up SIGTERM stops the
run as Ctrl-C does, until ``stop_ray`` gives the signal its handler back; Ray's
notice of its default authentication is quieted, its warning of none is not. A
local start later than Ray's fixed 30 s is cleaned up and tried again.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socketserver
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from vime.config import ConfigError
from vime.ray.placement import (
    ActorFailure,
    Layout,
    Terminated,
    init_local_ray,
    label_actor,
    layout_of,
    node_major_order,
    split_cores,
    start_ray,
    stop_ray,
    wait_all,
)


def _args(**kw) -> SimpleNamespace:
    base = dict(
        actor_num_nodes=1,
        actor_num_gpus_per_node=2,
        rollout_num_gpus=None,
        rollout_num_gpus_per_engine=1,
        colocate=False,
    )
    return SimpleNamespace(**{**base, **kw})


def test_separate_layout_puts_engines_after_training() -> None:
    layout = layout_of(_args(rollout_num_gpus=4, rollout_num_gpus_per_engine=2), use_gpu=True)
    assert layout == Layout(2, 2, 2, False, True)
    assert layout.num_bundles == 6
    assert layout.engine_bundles(0) == [2, 3] and layout.engine_bundles(1) == [4, 5]


def test_colocated_layout_shares_training_bundles() -> None:
    layout = layout_of(_args(colocate=True), use_gpu=True)
    assert layout.num_engines == 2 and layout.num_bundles == 2
    assert layout.engine_bundles(1) == [1]


def test_default_is_one_engine_beside_training() -> None:
    layout = layout_of(_args(actor_num_gpus_per_node=1), use_gpu=False)
    assert (layout.num_train, layout.num_engines, layout.num_bundles) == (1, 1, 2)


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"rollout_num_gpus": 3, "rollout_num_gpus_per_engine": 2}, "not a multiple"),
        ({"colocate": True, "rollout_num_gpus": 4}, "does not fit"),
    ],
)
def test_bad_counts_are_refused(kw, fragment) -> None:
    with pytest.raises(ConfigError, match=fragment):
        layout_of(_args(**kw), use_gpu=False)


def test_wait_all_fails_fast_when_an_actor_dies() -> None:
    """A dead actor stops the wait at once, not when its stuck peer gives up, and the
    one-line message says which actor (``label_actor``) died or raised what."""
    ray = pytest.importorskip("ray")
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Rank:
            def block(self) -> None:
                time.sleep(600)  # a peer stuck in a collective

            def die(self, after_s: float = 1.0) -> None:
                time.sleep(after_s)
                os._exit(3)

            def fail(self) -> None:
                raise ValueError("bad shard 3")

        stuck, dying = Rank.remote(), label_actor(Rank.remote(), "training rank 1")
        start = time.monotonic()
        with pytest.raises(ActorFailure) as failure:
            wait_all([stuck.block.remote(), dying.die.remote()], "training")
        assert time.monotonic() - start < 120  # bounded: far below the 600 s block
        message = str(failure.value)
        # Which actor, that its process died, and Ray's one-sentence reason; one line.
        assert re.fullmatch(r"training failed: training rank 1 \(pid \d+\) died: .+\.", message)
        assert "\n" not in message

        raising = label_actor(Rank.remote(), "rollout engine 0")
        with pytest.raises(ActorFailure) as failure:
            wait_all([raising.fail.remote()], "generating")
        assert str(failure.value) == "generating failed: rollout engine 0: ValueError: bad shard 3"
        # A peer's collective fails first because a rank died: the death is reported.
        peer, dead = Rank.remote(), label_actor(Rank.remote(), "training rank 3")
        with pytest.raises(ActorFailure, match=r"^training failed: training rank 3 \(pid"):
            wait_all([peer.fail.remote(), dead.die.remote(0.3)], "training")
        unnamed = Rank.remote()
        with pytest.raises(ActorFailure, match=r"^generating failed: actor Rank \(pid \d+\) died"):
            wait_all([unnamed.die.remote()], "generating")
    finally:
        ray.shutdown()


class _NotRay(socketserver.BaseRequestHandler):
    """Sends the server's ``reply`` (maybe nothing), then holds the connection until closed."""

    def handle(self) -> None:
        self.request.sendall(self.server.reply)
        while self.request.recv(4096):
            pass


@pytest.fixture(
    params=[b"", b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"], ids=["silent", "http"]
)
def not_ray(request: pytest.FixtureRequest) -> Iterator[str]:
    """A TCP server on 127.0.0.1 that is no Ray GCS; yields its host:port."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _NotRay)
    server.daemon_threads = True
    server.reply = request.param
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(60)  # a hang guard: without the probe ray.init retries for minutes
def test_start_ray_refuses_a_listener_that_is_not_ray(not_ray: str, monkeypatch) -> None:
    import vime.ray.placement as placement

    # The probe waits this long for a gRPC handshake a non-Ray server never completes.
    monkeypatch.setattr(placement, "CONNECT_TIMEOUT_S", 1.0)
    with pytest.raises(ConfigError, match="accepts connections but is not a Ray GCS") as caught:
        start_ray(not_ray, 1)
    message = str(caught.value)
    assert not_ray in message and "--port" in message and "\n" not in message


@pytest.mark.parametrize(
    ("nodes", "num_train", "expected"),
    [
        (["a", "a", "a"], 2, [0, 1, 2]),  # one node: as Ray numbered them
        (["a", "b", "a", "b"], 4, [0, 2, 1, 3]),  # interleaved: ranks 0-1 on a, 2-3 on b
        (["b", "a", "b", "a", "a", "b"], 4, [0, 2, 1, 3, 4, 5]),  # rollout bundles apart
        (["a", "b", "a", "b", "b", "a", "b"], 2, [0, 1, 2, 5, 3, 4, 6]),
    ],
)
def test_bundles_are_taken_node_by_node(nodes, num_train, expected) -> None:
    """Consecutive training ranks (the tensor-parallel groups) and each engine's bundles
    land on one node whatever order Ray numbered the bundles in; training bundles stay
    training bundles, and the order is a permutation."""
    order = node_major_order(nodes, num_train)
    assert order == expected
    assert sorted(order) == list(range(len(nodes)))
    assert all(b < num_train for b in order[:num_train])


def test_sigterm_stops_a_run_like_ctrl_c_until_ray_is_stopped() -> None:
    """After ``start_ray`` SIGTERM raises ``Terminated`` (a ``KeyboardInterrupt``: the
    run closes its outputs and shuts Ray down, where Ray's own handler would abort with
    a native stack dump); ``stop_ray`` gives SIGTERM back the handler it had before."""
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()

    def before(signum, frame) -> None:  # the embedding program's own handler
        raise AssertionError("not reached while the run is up")

    previous = signal.signal(signal.SIGTERM, before)
    try:
        start_ray(None, 1)
        try:
            with pytest.raises(Terminated):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs between two bytecodes of this thread
            assert isinstance(Terminated(), KeyboardInterrupt)
        finally:
            stop_ray()
        assert not ray.is_initialized()
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_only_rays_notice_of_its_default_auth_is_quieted() -> None:
    """Ray's warning that it turned token authentication on by default is dropped (every
    local start printed it); its warning that authentication is off still shows.

    A handler of the test's own on Ray's logger, not ``caplog``: Ray's loggers do not
    propagate to the root, and pytest 9.2 attaches ``caplog``'s handler to every logger
    that does not (here the "ray" logger), so adding it by hand too counted each record
    twice under 9.2 and once under 9.0."""
    from ray._private.authentication import authentication_token_setup as auth

    from vime.ray.placement import _quiet_default_auth_notice

    _quiet_default_auth_notice()
    seen = _Records()
    level = auth.logger.level
    auth.logger.addHandler(seen)
    auth.logger.setLevel(logging.WARNING)
    try:
        auth._warn_token_auth_enabled()
        auth._warn_token_auth_disabled()
    finally:
        auth.logger.removeHandler(seen)
        auth.logger.setLevel(level)
    messages = [r.getMessage() for r in seen.records]
    assert len(messages) == 1 and messages[0].startswith("Token authentication is disabled")


def test_a_late_local_start_is_cleaned_up_and_tried_again(monkeypatch, capsys) -> None:
    """Ray gives its raylet a fixed 30 s to register; on a busy machine a start can be
    late once. ``init_local_ray`` kills what the late start left (a real child process
    stands in for its GCS), says so in one line, and the next, real ``ray.init`` runs.
    Any other error, or a start late every time, is raised as it is."""
    import subprocess

    ray = pytest.importorskip("ray")
    from vime.ray import placement

    real_init, strays, calls = ray.init, [], []

    def late_then(real: bool):
        def init(**kwargs) -> None:
            calls.append(kwargs)
            if len(calls) == 1 or not real:
                strays.append(subprocess.Popen(["sleep", "600"]))
                raise Exception("The current node timed out during startup. This ...")
            real_init(**kwargs)

        return init

    monkeypatch.setattr(ray, "init", late_then(real=True))
    try:
        init_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
        assert ray.is_initialized() and len(calls) == 2
        assert (
            calls[0] == calls[1] == dict(num_cpus=1, include_dashboard=False, log_to_driver=False)
        )
    finally:
        ray.shutdown()
    assert strays[0].wait(timeout=10) == -signal.SIGKILL  # the late start's process is gone
    assert "did not start within Ray's 30 s" in capsys.readouterr().out

    calls.clear()
    monkeypatch.setattr(ray, "init", late_then(real=False))
    with pytest.raises(Exception, match="timed out during startup"):
        init_local_ray(num_cpus=1)
    assert len(calls) == placement.LOCAL_START_TRIES
    for stray in strays[1:]:
        stray.kill()

    def refuses(**kwargs) -> None:
        calls.append(kwargs)
        raise ValueError("num_cpus must be >= 0")

    calls.clear()
    monkeypatch.setattr(ray, "init", refuses)
    with pytest.raises(ValueError):
        init_local_ray(num_cpus=-1)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "cores, train, engines, expected",
    [
        ([0, 1], 1, 1, ([[0]], [[1]])),
        ([5], 1, 1, ([[5]], [[5]])),  # one core: shared
        (range(8), 2, 1, ([[0, 1], [2, 3]], [[4, 5, 6, 7]])),
        ([3, 1, 2], 1, 2, ([[1]], [[2], [3]])),
        ([0, 1], 2, 1, ([[0], [0]], [[1]])),  # more ranks than training's cores
    ],
)
def test_split_cores_gives_each_side_its_own(cores, train, engines, expected) -> None:
    """Training takes the first half of the cores, the engines the rest, each side's
    split evenly; the two sides never share a core unless there is only one."""
    assert split_cores(cores, train, engines) == expected
