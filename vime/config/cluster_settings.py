"""The cluster's settings, converted from the parsed flags: Ray and the devices to reserve.

Where it fits: ``vime.config.settings.build_settings`` takes ``cluster_settings`` for
``vime.setup.actors.build_cluster``; ``vime.cli`` takes ``placement_settings`` to size
the Ray it starts before the trainer is imported, so this module imports neither torch
nor the trainer's modules (Ray's start and those imports run side by side). The counts
are checked while parsing (``vime.config.validate.rollout_device_count``).
"""

from __future__ import annotations

import argparse

from vime.config.validate import joins_cluster, rollout_device_count
from vime.ray.placement import PlacementSettings
from vime.setup.settings import ClusterSettings


def placement_settings(args: argparse.Namespace) -> PlacementSettings:
    return PlacementSettings(
        num_train=args.actor_num_nodes * args.actor_num_gpus_per_node,
        rollout_devices=rollout_device_count(args),
        gpus_per_engine=args.rollout_num_gpus_per_engine,
        colocate=args.colocate,
    )


def cluster_settings(args: argparse.Namespace) -> ClusterSettings:
    return ClusterSettings(
        ray_address=args.ray_address,
        joins_cluster=joins_cluster(args),
        placement=placement_settings(args),
        weight_sync=args.weight_sync,
    )
