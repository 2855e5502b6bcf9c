"""Reserve the run's devices in one placement group, and pin processes to CPU cores.

Where it fits: ``vime.trainer`` calls ``reserve`` once Ray runs (``vime.ray.cluster``);
the train group and the engine group take their bundles from the returned
``Placement``. One bundle per training rank, then one per rollout device unless
``--colocate`` puts the engines on the training ranks' bundles. On a CPU-only
machine a bundle is one logical CPU and the local Ray is told it has at least
as many CPUs as the run has bundles, so a laptop runs any layout (slowly).
``--cpu-split`` gives each side cores of its own (``split_cores``, ``pin_process``).
A node that dies takes its bundles; Ray places them again where there is room, and a
restarted engine waits for that, within a limit (``Placement.wait_placed``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

READY_TIMEOUT_S = 120.0
# How often ``Placement.wait_placed`` looks at where the bundles are.
PLACED_POLL_S = 0.25


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
    def bundle(self) -> dict[str, int]:
        """What each bundle holds: a GPU and a CPU, or a CPU."""
        return {"CPU": 1, "GPU": 1} if self.use_gpu else {"CPU": 1}

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


@dataclass(frozen=True)
class PlacementSettings:
    """The device counts a layout is built from (``vime.config.cluster_settings``):
    training ranks, rollout devices in all, devices an engine takes, ``--colocate``."""

    num_train: int
    rollout_devices: int
    gpus_per_engine: int
    colocate: bool


def layout_of(settings: PlacementSettings, use_gpu: bool) -> Layout:
    """The layout of ``settings``' devices, GPUs where ``use_gpu`` (else CPUs)."""
    engines = settings.rollout_devices // settings.gpus_per_engine
    return Layout(settings.num_train, engines, settings.gpus_per_engine, settings.colocate, use_gpu)


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

    def nodes_of(self, bundles: Sequence[int]) -> list[str]:
        """The Ray node each of logical ``bundles`` is on now ('' while Ray places it
        again, its node lost)."""
        table = placement_group_table(self.group)["bundles_to_node_id"]
        return [table.get(self.order[b]) or "" for b in bundles]

    def wait_placed(self, ref: Any, bundles: Sequence[int], timeout_s: float) -> bool:
        """Wait for ``ref``, the start of an actor on logical ``bundles``: True once it is
        done (or failed: ``ray.get`` it); False once some of ``bundles`` has been without a
        node for ``timeout_s`` seconds in a row. A node that dies takes its bundles with
        it; Ray places them again on a live node with room, and an actor started on one
        meanwhile waits for that, for ever if no node has room. The actor's own start is
        not limited (a large engine loads for minutes)."""
        unplaced_since: float | None = None
        while not ray.wait([ref], timeout=PLACED_POLL_S)[0]:
            if all(self.nodes_of(bundles)):
                unplaced_since = None
            elif unplaced_since is None:
                unplaced_since = time.monotonic()
            elif time.monotonic() - unplaced_since > timeout_s:
                return False
        return True


def reserve(layout: Layout) -> Placement:
    """One placement group for the whole run; a clear error if the cluster is too small."""
    bundle = layout.bundle
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
