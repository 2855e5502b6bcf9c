"""vime's placement on a Ray cluster of several nodes, all on this machine.

Proves, with Ray's own ``ray.cluster_utils.Cluster`` (everything on 127.0.0.1: a head
with no CPU or GPU, where this driver runs, and two nodes of 3 CPUs and 3 GPUs that
are Ray resources only), joined the way ``vime-train --ray-address`` joins one
(``build_cluster``): (a) four training ranks and two engines, more than a node holds,
take the placement group's bundles node by node as ``vime.ray.placement`` plans, and
each rank runs on the node of its bundle (asked inside the actor); (b) the driver's
node, with no training resources, holds none of them, and the run is placed on the
cluster's GPUs though the driver has none; (c) a folder one node sees differently is
refused by the ranks' start-up check (``vime.ray.folders``) with one line naming the
flag, the folder, the rank and its node, while a folder every node sees passes.

The different view in (c) is a real one, not a flag: node B's worker processes start
through a setup script of that node's own (Ray's per-node ``setup_worker_path``), which
puts each in a private mount namespace with a fresh tmpfs over one folder, as a node
with that path on its own disk would see it. The mount needs root (skipped otherwise).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from vime.config import ConfigError  # noqa: E402
from vime.ray.cluster import stop_ray  # noqa: E402
from vime.ray.placement import PlacementSettings, node_major_order  # noqa: E402
from vime.ray.train_group import RayTrainGroup  # noqa: E402
from vime.setup.actors import build_cluster  # noqa: E402
from vime.setup.settings import ClusterSettings  # noqa: E402

PRIVATE_VAR = "VIME_TEST_PRIVATE_DIR"  # the folder a node's workers mount over

# Run by node B's raylet for every worker it starts, in place of Ray's own setup script
# (which it then runs): the worker gets a private mount namespace and an empty tmpfs at
# the folder named in PRIVATE_VAR, its own view of that path.
PRIVATE_SETUP = textwrap.dedent(
    """
    import ctypes, os, runpy, sys
    import ray._private.workers.setup_worker as ray_setup

    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x00020000, 0x4000, 0x40000
    if (
        libc.unshare(CLONE_NEWNS)
        or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
        or libc.mount(b"tmpfs", os.environ["{var}"].encode(), b"tmpfs", 0, None)
    ):
        raise OSError(ctypes.get_errno(), "a private view of " + os.environ["{var}"])
    sys.argv[0] = ray_setup.__file__
    runpy.run_path(ray_setup.__file__, run_name="__main__")
    """
).format(var=PRIVATE_VAR)


def _can_mount_privately() -> bool:
    probe = "import ctypes; exit(ctypes.CDLL(None).unshare(0x00020000) != 0)"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """The cluster, the driver joined through ``build_cluster`` (4 ranks, 2 engines of one
    GPU each) and its training ranks; all shut down after the module."""
    from ray.cluster_utils import Cluster

    if not _can_mount_privately():
        pytest.skip("no private mount namespace here (needs root): node B's view")
    private = tmp_path_factory.mktemp("node_b_has_its_own")
    setup = tmp_path_factory.mktemp("setup") / "private_setup.py"
    setup.write_text(PRIVATE_SETUP)
    local = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
    nodes = Cluster(initialize_head=True, head_node_args={**local, "num_cpus": 0, "num_gpus": 0})
    try:
        a = nodes.add_node(**local, num_cpus=3, num_gpus=3)
        b = nodes.add_node(
            **local,
            num_cpus=3,
            num_gpus=3,
            setup_worker_path=str(setup),
            env_vars={PRIVATE_VAR: str(private)},
        )
        placement = PlacementSettings(
            num_train=4, rollout_devices=2, gpus_per_engine=1, colocate=False
        )
        run = build_cluster(ClusterSettings(nodes.address, True, placement, "auto"))
        group = RayTrainGroup("fsdp2", run.placement)
        yield SimpleNamespace(
            head=nodes.head_node.node_id,
            a=a.node_id,
            b=b.node_id,
            private=private,
            shared=tmp_path_factory.mktemp("shared"),
            run=run,
            group=group,
        )
    finally:
        stop_ray()
        nodes.shutdown()


def _bundle_nodes(run: SimpleNamespace) -> list[str]:
    """The node of each of the layout's (logical) bundles: training ranks, then engines."""
    return run.placement.nodes_of(range(len(run.placement.order)))


def _grouped(nodes: list[str]) -> bool:
    """Whether each node's entries are contiguous (one run per node)."""
    runs = [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n]
    return len(runs) == len(set(runs))


def test_ranks_and_engines_land_node_by_node(cluster: SimpleNamespace) -> None:
    """Four ranks span both nodes (a node holds three), consecutive ranks share a node,
    and each rank's actor runs on the node its bundle was placed on."""
    placed = _bundle_nodes(cluster.run)
    ranks, engines = placed[:4], placed[4:]
    assert set(ranks) == {cluster.a, cluster.b}
    assert _grouped(ranks) and _grouped(engines)
    table = ray.util.placement_group_table(cluster.run.placement.group)["bundles_to_node_id"]
    physical = [table[b] for b in range(6)]
    assert cluster.run.placement.order == node_major_order(physical, 4)
    assert cluster.group.check_folders([("--save", str(cluster.shared))]) == ranks


def test_a_driver_without_resources_places_everything_on_the_others(
    cluster: SimpleNamespace,
) -> None:
    """The driver's node (the head: no CPU, no GPU) holds no bundle, and the bundles are the
    cluster's GPUs: this driver has none."""
    assert ray.get_runtime_context().get_node_id() == cluster.head
    assert cluster.run.use_gpu
    assert cluster.head not in _bundle_nodes(cluster.run)
    bundles = ray.util.placement_group_table(cluster.run.placement.group)["bundles"]
    assert list(bundles.values()) == [{"CPU": 1.0, "GPU": 1.0}] * 6


def test_a_folder_one_node_sees_differently_is_refused(cluster: SimpleNamespace) -> None:
    """The first rank on node B does not see the driver's marker in the private folder:
    refused in one line; the markers are gone afterwards."""
    ranks = _bundle_nodes(cluster.run)[:4]
    first_b = ranks.index(cluster.b)
    out = cluster.private / "out"
    folders = [("--save", str(cluster.shared / "ckpt")), ("--output-dir", str(out))]
    with pytest.raises(ConfigError) as caught:
        cluster.group.check_folders(folders)
    message = str(caught.value)
    assert message.startswith(f"--output-dir {out}: training rank {first_b} on node 127.0.0.1")
    assert f"(Ray node {cluster.b[:12]})" in message and "\n" not in message
    assert sorted(p.name for p in cluster.private.iterdir()) == []
    assert sorted(p.name for p in cluster.shared.iterdir()) == []
