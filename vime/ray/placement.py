"""Start or join Ray and reserve the run's devices in one placement group.

Where it fits: ``vime.trainer`` calls ``start_ray`` then ``reserve``; the train
group and the engine group take their bundles from the returned ``Placement``.
One bundle per training rank, then one per rollout device unless
``--colocate`` puts the engines on the training ranks' bundles. On a CPU-only
machine a bundle is one logical CPU and the local Ray is told it has at least
as many CPUs as the run has bundles, so a laptop runs any layout (slowly).

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
import re
import signal
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.config.errors import ConfigError
from vime.config.validate import rollout_device_count
from vime.tracking import HF_PROGRESS_BARS_VAR

READY_TIMEOUT_S = 120.0
LOCAL_START_TRIES = 3
# What Ray 2.60's ``Node`` raises when the raylet has not registered within 30 s.
_LATE_START = "timed out during startup"
# How long joining a cluster waits for its GCS port to accept a connection, and then
# for a gRPC handshake and for an answer to one call (a real GCS takes milliseconds).
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Layout:
    """How many bundles of what, derived from the flags alone (pure, testable)."""

    num_train: int
    num_engines: int
    gpus_per_engine: int
    colocate: bool
    use_gpu: bool

    @property
    def num_rollout_bundles(self) -> int:
        return 0 if self.colocate else self.num_engines * self.gpus_per_engine

    @property
    def num_bundles(self) -> int:
        return self.num_train + self.num_rollout_bundles

    def engine_bundles(self, engine: int) -> list[int]:
        """Bundle indices engine ``engine`` runs on (its tensor-parallel group)."""
        first = engine * self.gpus_per_engine
        if not self.colocate:
            first += self.num_train
        return list(range(first, first + self.gpus_per_engine))


def split_cores(
    cores: Sequence[int], num_train: int, num_engines: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Each training rank's and each engine's CPU cores, for a CPU run whose two sides
    work at once (``--max-staleness`` >= 1), as a GPU run's sides have devices of their
    own: the first half of ``cores`` (at least one) to training, the rest to the
    engines, each side's cores split evenly between its processes. With one core, or
    more processes than cores on a side, processes share."""
    cores = sorted(cores)
    train_n = max(1, len(cores) // 2)
    train, engines = cores[:train_n], cores[train_n:] or cores[:1]

    def share(side: list[int], k: int) -> list[list[int]]:
        if k > len(side):
            return [[side[i % len(side)]] for i in range(k)]
        bounds = [round(i * len(side) / k) for i in range(k + 1)]
        return [side[bounds[i] : bounds[i + 1]] for i in range(k)]

    return share(train, num_train), share(engines, num_engines)


def pin_process(cores: Sequence[int]) -> None:
    """Keep this whole process on ``cores``: every thread it has (Ray's, and the pools
    that run an actor's calls, started before the actor's code) and so every thread
    they start. ``os.sched_setaffinity(0, ...)`` alone moves the calling thread only."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task), cores)


def process_cores() -> list[int]:
    """The cores any thread of this process may run on (what ``pin_process`` set)."""
    cores: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            cores |= os.sched_getaffinity(int(task))
    return sorted(cores)


def layout_of(args: Any, use_gpu: bool) -> Layout:
    num_train = args.actor_num_nodes * args.actor_num_gpus_per_node
    per_engine = args.rollout_num_gpus_per_engine
    engines = rollout_device_count(args) // per_engine
    return Layout(num_train, engines, per_engine, args.colocate, use_gpu)


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
    """
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


class Terminated(KeyboardInterrupt):
    """The driver got SIGTERM (a scheduler's stop, ``kill``): the run stops as on Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


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


def node_major_order(bundle_nodes: Sequence[str], num_train: int) -> list[int]:
    """The placement group's bundles in the order ranks and engines take them (pure).

    Ray does not promise that a PACK group's consecutive bundles share a node, while
    consecutive training ranks form the tensor-parallel groups whose collectives must
    stay inside a node, and a tensor-parallel engine's bundles should too. So the
    training bundles ``[0, num_train)`` come first, then the rollout ones, each grouped
    by node (nodes in order of first appearance, bundles in index order within one).
    ``bundle_nodes[b]`` is the node bundle ``b`` landed on.
    """

    def grouped(indices: range) -> list[int]:
        rank_of_node: dict[str, int] = {}
        for b in indices:
            rank_of_node.setdefault(bundle_nodes[b], len(rank_of_node))
        return sorted(indices, key=lambda b: rank_of_node[bundle_nodes[b]])

    return grouped(range(num_train)) + grouped(range(num_train, len(bundle_nodes)))


@dataclass
class Placement:
    """The run's placement group; ``order[i]`` is the bundle that logical bundle ``i`` of
    the layout (training rank i, then the rollout devices) runs on."""

    group: PlacementGroup
    layout: Layout
    order: list[int]

    def strategy(
        self, bundle: int, *, capture_child_tasks: bool = False
    ) -> PlacementGroupSchedulingStrategy:
        """Schedule onto logical bundle ``bundle`` (mapped through ``order``)."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.order[bundle],
            placement_group_capture_child_tasks=capture_child_tasks,
        )


def reserve(layout: Layout) -> Placement:
    """One placement group for the whole run; a clear error if the cluster is too small."""
    bundle = {"CPU": 1, "GPU": 1} if layout.use_gpu else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(layout.num_bundles)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=READY_TIMEOUT_S)
    if not ready:
        have = ray.cluster_resources()
        kind = "GPU" if layout.use_gpu else "CPU"
        raise RuntimeError(
            f"the run needs {layout.num_bundles} x {bundle} ({layout.num_train} training, "
            f"{layout.num_rollout_bundles} rollout) but the Ray cluster has "
            f"{have.get(kind, 0):g} {kind}; lower the counts or add nodes"
        )
    nodes = placement_group_table(group)["bundles_to_node_id"]
    order = node_major_order([nodes[b] for b in range(layout.num_bundles)], layout.num_train)
    return Placement(group, layout, order)


def wait_all(refs: list[Any], what: str) -> list[Any]:
    """``ray.get`` of every ref, failing as soon as any one fails (no hang on the others).

    A rank that dies leaves its peers blocked in a collective; waiting on the
    refs one by one would hang there, so finished refs are checked as they land.
    The failure's message names the actor (as ``label_actor`` called it) and what
    happened to it: the remote exception's line, or how its process died.
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
        reason = how.group(1) if how else "its process died"
        return f"{who}{f' (pid {pid.group(1)})' if pid else ''} died: {reason}"
    return f"{who}: {_short(detail)}" if who else _short(detail)


# Ray colours the remote actor's name in its error text; a log file wants plain text.
_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_ACTOR_ID = re.compile(r"actor_id[=:] ?([0-9a-f]+)")
_CLASS_NAME = re.compile(r"class_name: \S*?(\w+)\s")  # the last part of a dotted name
_PID = re.compile(r"\bpid[=:] ?(\d+)")
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
