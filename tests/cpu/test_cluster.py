"""Ray's start for a run (``vime.ray.cluster``).

Proves: joining an address where a server accepts connections but is not a Ray
GCS (one that says nothing, one that answers like a web server) is refused by
``start_ray`` with a one-line ``ConfigError`` naming the address and the head's
port, where ``ray.init`` would retry for minutes. Once Ray is up SIGTERM stops the
run as Ctrl-C does, until ``stop_ray`` gives the signal its handler back; Ray's
notice of its default authentication is quieted, its warning of none is not. A
local start later than Ray's fixed 30 s is cleaned up and tried again.
"""

from __future__ import annotations

import logging
import os
import signal
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from vime.config import ConfigError
from vime.ray.cluster import init_local_ray, start_ray, stop_ray
from vime.ray.errors import Terminated


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
    import vime.ray.cluster as cluster

    # The probe waits this long for a gRPC handshake a non-Ray server never completes.
    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT_S", 1.0)
    with pytest.raises(ConfigError, match="accepts connections but is not a Ray GCS") as caught:
        start_ray(not_ray, 1)
    message = str(caught.value)
    assert not_ray in message and "--port" in message and "\n" not in message


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

    from vime.ray.cluster import _quiet_default_auth_notice

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
    Any other error, or a start late every time, is raised as it is. (The real start
    may itself be late on a loaded machine: it then takes a third try.)"""
    import subprocess

    ray = pytest.importorskip("ray")
    from vime.ray import cluster

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
        assert ray.is_initialized() and 2 <= len(calls) <= cluster.LOCAL_START_TRIES
        assert all(
            call == dict(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
            for call in calls
        )
    finally:
        ray.shutdown()
    assert strays[0].wait(timeout=10) == -signal.SIGKILL  # the late start's process is gone
    assert "did not start within Ray's 30 s" in capsys.readouterr().out

    calls.clear()
    monkeypatch.setattr(ray, "init", late_then(real=False))
    with pytest.raises(Exception, match="timed out during startup"):
        init_local_ray(num_cpus=1)
    assert len(calls) == cluster.LOCAL_START_TRIES
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


LOOPBACK_CHECK = """
import json, os, sys
from vime.cli import local_ray_on_loopback
from vime.config import parse_args
config = parse_args(sys.argv[1:])
local_ray_on_loopback(config)
print(json.dumps({"var": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}))
if not config.ray_address:
    import ray
    from vime.ray.cluster import start_ray, stop_ray
    start_ray(None, 1)
    print(json.dumps({"node": ray.util.get_node_ip_address(),
                      "gcs": ray.get_runtime_context().gcs_address}))
    stop_ray()
"""


def test_a_ray_the_run_starts_itself_serves_on_loopback_only() -> None:
    """vime-train's own local Ray takes 127.0.0.1 as its node address (Ray would take the
    machine's outward one); a run that joins a cluster leaves Ray's choice alone."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env.pop("RAY_ADDRESS", None)

    def run(*flags: str) -> list[dict]:
        out = subprocess.run(
            [sys.executable, "-c", LOOPBACK_CHECK, *flags],
            capture_output=True, text=True, timeout=300, env=env, check=True,
        )  # fmt: skip
        return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

    local = run()
    assert local[0]["var"] == "0"
    assert local[1]["node"] == "127.0.0.1" and local[1]["gcs"].startswith("127.0.0.1:")
    joined = run("--ray-address", "10.255.255.1:6379")  # parsed only: nothing is joined
    assert joined == [{"var": None}]


OTHER_CLUSTER_CHECK = """
import json
from ray.cluster_utils import Cluster
other = Cluster(initialize_head=True, connect=False, head_node_args={
    "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
import ray
from vime.ray.cluster import start_ray, stop_ray
try:
    start_ray(None, 1)
    print(json.dumps({"other": other.address, "gcs": ray.get_runtime_context().gcs_address}))
    stop_ray()
finally:
    other.shutdown()
"""


def test_a_run_without_an_address_starts_its_own_ray_beside_another() -> None:
    """A Ray cluster already up on the machine (``ray start``, another job's) is not
    joined by a run given no address: it starts its own (before the fix ``ray.init``
    joined the other one and refused ``num_cpus``)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-c", OTHER_CLUSTER_CHECK],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("{")))
    assert got["gcs"] != got["other"], got
