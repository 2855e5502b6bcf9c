"""Start or join Ray and reserve the run's devices in one placement group.

Where it fits: ``vime.trainer`` calls ``start_ray`` then ``reserve``; the train
group and the engine group take their bundles from the returned ``Placement``.
One bundle per training rank, then one per rollout device unless
``--colocate`` puts the engines on the training ranks' bundles. On a CPU-only
machine a bundle is one logical CPU and the local Ray is told it has at least
as many CPUs as the run has bundles, so a laptop runs any layout (slowly).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.config.errors import ConfigError

READY_TIMEOUT_S = 120.0
# How long joining a cluster waits for its GCS port to accept a connection.
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


def layout_of(args: Any, use_gpu: bool) -> Layout:
    num_train = args.actor_num_nodes * args.actor_num_gpus_per_node
    per_engine = args.rollout_num_gpus_per_engine
    rollout_gpus = args.rollout_num_gpus or (num_train if args.colocate else per_engine)
    if rollout_gpus % per_engine != 0:
        raise ValueError(
            f"--rollout-num-gpus {rollout_gpus} is not a multiple of "
            f"--rollout-num-gpus-per-engine {per_engine}"
        )
    if args.colocate and rollout_gpus > num_train:
        raise ValueError(
            f"--colocate puts engines on the {num_train} training devices; "
            f"--rollout-num-gpus {rollout_gpus} does not fit"
        )
    return Layout(num_train, rollout_gpus // per_engine, per_engine, args.colocate, use_gpu)


def start_ray(address: str | None, min_cpus: int) -> None:
    """Join ``address`` (or RAY_ADDRESS) if given, else start a local Ray.

    A cluster address that nothing answers on is refused at once with a
    ``ConfigError`` naming it: ``ray.init`` would otherwise retry for ever.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    # Workers inherit the driver's environment; Ray's own noise is not the user's business.
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}}
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, runtime_env=env, log_to_driver=True)
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
        ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=env, log_to_driver=True)


def _check_reachable(address: str) -> None:
    """Fail fast unless something accepts TCP connections at ``address``'s host:port."""
    if address in ("auto", "local"):  # Ray finds (or starts) the cluster itself
        return
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(
            f"Ray address {address!r} is not host:port (as printed by `ray start --head`); "
            "fix --ray-address or RAY_ADDRESS"
        )
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise ConfigError(_unreachable(address, err.strerror or str(err))) from None


def _unreachable(address: str, reason: str) -> str:
    return (
        f"no Ray cluster answers at {address} (from --ray-address or RAY_ADDRESS): {reason}; "
        "start one there with `ray start --head --port PORT`, fix the address, or drop "
        "--ray-address and unset RAY_ADDRESS to start a local Ray"
    )


@dataclass
class Placement:
    group: PlacementGroup
    layout: Layout

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=bundle
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
    return Placement(group, layout)


def wait_all(refs: list[Any], what: str) -> list[Any]:
    """``ray.get`` of every ref, failing as soon as any one fails (no hang on the others).

    A rank that dies leaves its peers blocked in a collective; waiting on the
    refs one by one would hang there, so finished refs are checked as they land.
    """
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                raise ActorFailure(f"{what} failed: {_short(err)}") from err
    return ray.get(refs)


class ActorFailure(RuntimeError):
    """A training rank or an engine raised or died; the run stops."""


def _short(err: BaseException) -> str:
    text = str(err).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    # Ray's message ends with the remote exception's own line; keep it first.
    last = lines[-1] if lines else type(err).__name__
    return last if len(lines) <= 1 else f"{last} (remote traceback above)"
