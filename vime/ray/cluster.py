"""Start or join Ray for the run, and stop it: authentication, SIGTERM, reachability.

Where it fits: ``vime-train`` (``vime.cli``, or ``vime.trainer`` when called directly)
calls ``start_ray`` before anything is placed (``vime.ray.placement``) and ``stop_ray``
at the end. A local Ray is started with the workers' environment set and its default
token-authentication notice quieted, and tried again when its raylet starts late; after
``ray.init`` SIGTERM stops the run like Ctrl-C (``vime.ray.errors.Terminated``).

Joining a cluster is checked first, because ``ray.init`` handles a wrong
address badly: with nothing listening, or with a listener that is not a Ray
GCS (an HTTP server: for minutes or for ever; another gRPC server such as the
client port: 20 s, then a misleading error), Ray 2.60 retries, printing a
warning every few seconds. A TCP connect, a gRPC handshake and one
unauthenticated GCS call answer that in seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import ray

from vime.errors import ConfigError
from vime.interrupts import raise_in_main
from vime.ray.errors import Terminated
from vime.tracking import HF_PROGRESS_BARS_VAR

LOCAL_START_TRIES = 3
# What Ray 2.60's ``Node`` raises when the raylet has not registered within 30 s.
_LATE_START = "timed out during startup"
# How long joining a cluster waits for its GCS port to accept a connection, and then
# for a gRPC handshake and for an answer to one call (a real GCS takes milliseconds).
CONNECT_TIMEOUT_S = 5.0


def start_ray(address: str | None, min_cpus: int) -> None:
    """Join ``address`` (or RAY_ADDRESS) if given, else start a local Ray.

    A cluster address that nothing answers on, or that something other than Ray
    answers on, is refused at once with a ``ConfigError`` naming it: ``ray.init``
    would otherwise retry for minutes or for ever.
    """
    if ray.is_initialized():
        return
    before = signal.getsignal(signal.SIGTERM)
    address = address or os.environ.get("RAY_ADDRESS")
    # Workers inherit the driver's environment; Ray's own noise is not the user's business.
    env_vars = {"TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}
    # Actors on other nodes of a cluster do not inherit the driver's environment.
    if HF_PROGRESS_BARS_VAR in os.environ:
        env_vars[HF_PROGRESS_BARS_VAR] = os.environ[HF_PROGRESS_BARS_VAR]
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, runtime_env={"env_vars": env_vars}, log_to_driver=True)
        except ConnectionError as err:
            # The port answered, so the usual cause is Ray's token authentication: a
            # driver given an explicit address only sends a token when told to.
            raise ConfigError(
                f"could not join the Ray cluster at {address}: {str(err).splitlines()[0]}; "
                "if it uses token authentication (`ray start` enables it when "
                "~/.ray/auth_token exists), set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or "
                "RAY_AUTH_TOKEN_PATH for vime-train as well"
            ) from None
    else:
        cpus = max(os.cpu_count() or 1, min_cpus)
        _quiet_default_auth_notice()
        # A local Ray's workers inherit its raylet's environment, so the variables go there
        # rather than into a job runtime_env: workers of a job with a runtime_env of its own
        # cannot be the ones Ray starts ahead with the raylet (one per CPU), and each actor
        # would wait for a fresh process (~1.5 s on two cores) instead of taking one ready.
        # The "ray" logger at WARNING: a local start's INFO line ("Started a local Ray
        # instance") tells the user nothing they did not ask for.
        with _environment(env_vars):
            init_local_ray(
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=True,
                logging_level=logging.WARNING,
            )
    _stop_on_sigterm(before)


def init_local_ray(**kwargs: Any) -> None:
    """``ray.init(**kwargs)`` for a new local Ray, tried up to ``LOCAL_START_TRIES`` times.

    Ray 2.60 gives its raylet a fixed 30 s to register with the GCS, then raises. On a
    busy machine (two cores shared with other jobs) that start can be late once and
    fine the next time, so a late start is shut down and tried again, with one line.
    ``address="local"`` unless given: a Ray of its own, never the cluster another job or
    ``ray start`` left on the machine (ray.init would join it and refuse ``num_cpus``).
    """
    kwargs.setdefault("address", "local")
    for attempt in range(1, LOCAL_START_TRIES + 1):
        before = _child_pids()
        try:
            ray.init(**kwargs)
            return
        except Exception as err:  # Ray raises a bare Exception for this
            if _LATE_START not in str(err) or attempt == LOCAL_START_TRIES:
                raise
            # The failed node's GCS, raylet and reaper are this process's children and
            # nothing else holds them (``ray.init`` never kept the node): stop them.
            for pid in _child_pids() - before:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            ray.shutdown()
            print(
                f"vime: Ray's local node did not start within Ray's 30 s (a busy machine?); "
                f"trying again ({attempt + 1} of {LOCAL_START_TRIES})",
                flush=True,
            )


@contextlib.contextmanager
def _environment(env_vars: dict[str, str]) -> Iterator[None]:
    """``env_vars`` set in this process's environment for the block, then put back."""
    saved = {name: os.environ.get(name) for name in env_vars}
    os.environ.update(env_vars)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _child_pids() -> set[int]:
    """This process's child processes, from ``/proc`` (empty where there is none)."""
    me, pids = os.getpid(), set()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                path = f"/proc/{entry.name}/stat"
                with contextlib.suppress(OSError, IndexError, ValueError), open(path) as f:
                    # ``pid (comm) state ppid ...``; comm may hold spaces.
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        pids.add(int(entry.name))
    return pids


def stop_ray() -> None:
    """Shut down what ``start_ray`` started or joined, and give SIGTERM back the handler
    it had before."""
    ray.shutdown()
    if _SIGTERM_BEFORE and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _SIGTERM_BEFORE.pop())


class _DefaultAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled")


def _quiet_default_auth_notice() -> None:
    """Ray 2.60 warns at every local start that it turned token authentication on, its
    default (set ``RAY_AUTH_MODE`` to choose): not news at every run. Its warning that
    authentication is *off* still shows."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DefaultAuthNotice) for f in logger.filters):
        logger.addFilter(_DefaultAuthNotice())


def _raise_terminated(signum: int, frame: Any) -> None:
    raise_in_main(Terminated(f"signal {signum}"), signum, frame)


# The SIGTERM handler start_ray replaced (a process-wide setting, so kept here).
_SIGTERM_BEFORE: list[Any] = []


def _stop_on_sigterm(before: Any) -> None:
    """Make SIGTERM stop the run like Ctrl-C: outputs closed, Ray shut down, a one-line
    exit. Set after ``ray.init``, whose own handler dumps a native stack and aborts."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)
        _SIGTERM_BEFORE[:] = [signal.SIG_DFL if before is None else before]


def cluster_gpus() -> int:
    """GPUs the Ray cluster (started or joined) has in all: whether the run is placed on
    GPUs is the cluster's answer, not the driver's, which may sit on a CPU-only node."""
    return int(ray.cluster_resources().get("GPU", 0))


def _check_reachable(address: str) -> None:
    """Fail fast unless a Ray server (a GCS, or for ray:// a client server) answers there."""
    if address in ("auto", "local"):  # Ray finds (or starts) the cluster itself
        return
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(
            f"Ray address {address!r} is not host:port (as printed by `ray start --head`); "
            "fix --ray-address or RAY_ADDRESS"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise ConfigError(_unreachable(address, err.strerror or str(err))) from None
    # A ray:// address is Ray Client's server, not the GCS: only its gRPC handshake is checked.
    client = address.startswith("ray://")
    if not _speaks_ray(target, gcs=not client):
        wanted = (
            "a Ray Client server: give the head's --ray-client-server-port (default 10001)"
            if client
            else "a Ray GCS: give the head's --port (default 6379, printed by "
            "`ray start --head`), not its dashboard, client or another port"
        )
        raise ConfigError(
            f"{address} (from --ray-address or RAY_ADDRESS) accepts connections but is not "
            f"{wanted}; fix --ray-address or RAY_ADDRESS"
        )


def _speaks_ray(target: str, gcs: bool) -> bool:
    """False only when ``target`` is known not to be Ray: no gRPC handshake, or no GCS service.

    gRPC reports a channel ready only after the HTTP/2 handshake, which no plain TCP
    or HTTP/1 server completes. Then, for a GCS, one call without credentials: a GCS
    answers it (OK, or UNAUTHENTICATED under token auth) where another gRPC server
    (Ray's client or agent ports) says UNIMPLEMENTED. The method name comes from
    Ray's generated protos, an internal module: if grpc or it cannot be loaded, or
    TLS is on (this probe speaks plaintext), the address is let through to
    ``ray.init`` as before rather than refused.
    """
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return True
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2

        service = gcs_service_pb2.DESCRIPTOR.services_by_name["NodeInfoGcsService"]
        method = f"/{service.full_name}/{service.methods_by_name['GetClusterId'].name}"
    except (ImportError, KeyError, AttributeError):
        return True
    # Like Ray's own clients, ignore http_proxy unless Ray's (lower-case) knob says otherwise.
    proxy = os.environ.get("RAY_grpc_enable_http_proxy", "0").lower() in ("1", "true")  # noqa: SIM112
    with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", int(proxy))]) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
        except grpc.FutureTimeoutError:
            return False
        if gcs:
            try:
                channel.unary_unary(method)(b"", timeout=CONNECT_TIMEOUT_S)
            except grpc.RpcError as err:
                # Anything but "no such method" (even a timeout) is left to ray.init.
                return err.code() != grpc.StatusCode.UNIMPLEMENTED
    return True


def _unreachable(address: str, reason: str) -> str:
    return (
        f"no Ray cluster answers at {address} (from --ray-address or RAY_ADDRESS): {reason}; "
        "start one there with `ray start --head --port PORT`, fix the address, or drop "
        "--ray-address and unset RAY_ADDRESS to start a local Ray"
    )
