"""A Ray node lost mid-run: its engine restarts elsewhere, its training rank resumes.

Proves, on real runs of the embedded default joined to a Ray ``Cluster`` of this
machine (``ray.cluster_utils``, all on 127.0.0.1: a head with no CPU, where the driver
runs, and nodes of one CPU, so each holds one bundle and one node is spare), the node
removed with ``Cluster.remove_node`` as the driver hands out work (``fault_hooks``):
(a) the node of the rollout engine, during rollout 1's generation: Ray places the
engine's bundle on the spare node, the engine restarts there, and the run ends with
every rollout, one restart and the engine serving the last weights; (b) the node of
training rank 0, while it trains rollout 1: the run stops in one line naming the rank
and the node (no traceback), and ``--auto-resume`` resumes it after rollout 0's
checkpoint on the nodes left (a spare added); (c) with no other node left with room,
a restarted engine's start gives up after the limit (``Placement.wait_placed``, with
the run's ``--engine-timeout``), and goes on once a node has room again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from fault_hooks import on_generation, on_training  # noqa: E402

from vime import cli  # noqa: E402
from vime.config.parser import parse_args  # noqa: E402
from vime.ray.cluster import start_ray, stop_ray  # noqa: E402
from vime.ray.engine_watch import RESENT_KEY, RESTARTS_KEY  # noqa: E402
from vime.ray.placement import Layout, reserve  # noqa: E402
from vime.ray.train_group import RayTrainGroup  # noqa: E402
from vime.setup.run import build_run  # noqa: E402
from vime.tracking import read_metrics  # noqa: E402
from vime.trainer import Run  # noqa: E402

LOCAL = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
ROLLOUTS = 2
ARGS = (
    *("--num-rollout", str(ROLLOUTS), "--rollout-batch-size", "4"),
    *("--n-samples-per-prompt", "2", "--seed", "5", "--rollout-engine", "hf"),
)


@pytest.fixture(scope="module")
def nodes() -> Iterator[Any]:
    """A head without resources and three nodes of one CPU: one training rank, one
    engine and a spare. The driver joins it per test; all shut down after the module."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # a Ray left by another module: the runs must join this one
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={**LOCAL, "num_cpus": 0})
    try:
        for _ in range(3):
            cluster.add_node(**LOCAL, num_cpus=1)
        yield cluster
    finally:
        stop_ray()
        cluster.shutdown()


def _remove(cluster: Any, node_id: str) -> None:
    """Stop the node ``node_id`` (its raylet and every worker on it)."""
    (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
    cluster.remove_node(node)


def test_an_engine_whose_node_is_removed_restarts_on_the_spare_node(
    nodes: Any, tmp_path: Path
) -> None:
    """The engine's node removed as it is handed rollout 1's prompts: one restart, on the
    spare node, its prompts sent again, one line naming the engine and the node, and
    the run ends with both rollouts and the engine serving the last sync's weights."""
    args = [*ARGS, "--ray-address", nodes.address, "--output-dir", str(tmp_path)]
    run = Run(build_run(parse_args(args, for_run=True)))
    said: list[str] = []
    run.engines.say = said.append
    try:
        placement = run.parts.actors.placement
        engine_bundle = placement.layout.engine_bundles(0)[0]
        rank_node, engine_node = placement.nodes_of([0, engine_bundle])
        fired = on_generation(run.engines, 1, lambda: _remove(nodes, engine_node))
        run.train()
        versions, synced = run.engines.weight_versions(), run.transport.version
        moved_to = placement.nodes_of([engine_bundle])[0]
    finally:
        run.close("done")
        stop_ray()
    assert len(fired) == 1 and rank_node != engine_node
    assert moved_to not in ("", engine_node, rank_node)  # the spare
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == list(range(ROLLOUTS))
    assert [r[RESTARTS_KEY] for r in rows] == [0.0, 1.0] and rows[-1][RESENT_KEY] > 0
    assert versions == [synced] and synced >= ROLLOUTS
    node = f"its node 127.0.0.1 (Ray node {engine_node[:12]}) was terminated"
    assert len(said) == 1 and re.search(
        rf"rollout engine 0 \(pid \d+\) died: {re.escape(node)}", said[0]
    )
    assert (
        "restarted it on its bundle (1 of --max-engine-restarts 3 within 100 rollouts)" in said[0]
    )


def test_a_rank_whose_node_is_removed_stops_the_run_which_resumes(
    nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Rank 0's node removed while it trains rollout 1: the run stops in one line naming
    the rank and the node, no traceback, and ``--auto-resume 1`` resumes after rollout
    0's checkpoint on the nodes left; the metrics read as one run of both rollouts."""
    nodes.add_node(**LOCAL, num_cpus=1)  # a spare again: the first test used its own
    removed: list[str] = []

    def remove_rank0_node(group: RayTrainGroup) -> None:
        removed.append(group.rank_nodes[0])
        _remove(nodes, removed[0])

    monkeypatch.setattr(RayTrainGroup, "train", on_training(1, remove_rank0_node))
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    resume = ("--save", str(ckpt), "--save-interval", "1", "--auto-resume", "1")
    status = cli.main([*ARGS, "--ray-address", nodes.address, "--output-dir", str(out), *resume])
    stdout, stderr = capfd.readouterr()
    report = stdout[-3000:] + stderr[-5000:]
    assert status == 0 and len(removed) == 1, report
    said = [line for line in stderr.splitlines() if "auto-resume 1 of 1" in line]
    node = f"its node 127.0.0.1 (Ray node {removed[0][:12]}) was terminated"
    assert len(said) == 1 and "training rank 0 (pid " in said[0] and node in said[0], report
    assert "restarting after rollout 0" in said[0]
    assert "Traceback" not in stdout + stderr
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == list(range(ROLLOUTS))
    assert [r.get("fault/auto_resumes") for r in rows] == [None, 1.0]
    assert json.loads((out / "summary.json").read_text())["status"] == "done"
    assert "its node has died" in (out / "error.log").read_text()  # Ray's whole report


def test_a_bundle_with_no_node_to_go_to_is_waited_for_within_the_limit(nodes: Any) -> None:
    """An engine's bundle whose node is removed while the other nodes are full: a task
    started on it is given up after the limit (the engine restart's one-line stop); once
    a node has room (another placement group let go), Ray places the bundle there and
    the same task runs."""
    from ray.util.placement_group import placement_group, remove_placement_group

    start_ray(nodes.address, 1)
    try:
        placement = reserve(Layout(0, 1, 1, colocate=False, use_gpu=False))
        engine = placement.layout.engine_bundles(0)
        others = [{"CPU": 1}] * (len(nodes.worker_nodes) - 1)  # every other node: full
        blocker = placement_group(others, strategy="SPREAD")
        ray.get(blocker.ready())
        _remove(nodes, placement.nodes_of([engine[0]])[0])

        @ray.remote(num_cpus=1)
        def node() -> str:
            return ray.get_runtime_context().get_node_id()

        started = node.options(scheduling_strategy=placement.strategy(engine[0])).remote()
        assert not placement.wait_placed(started, engine, timeout_s=1.0)
        assert placement.nodes_of([engine[0]])[0] == ""
        freed = set(ray.util.placement_group_table(blocker)["bundles_to_node_id"].values())
        remove_placement_group(blocker)
        assert placement.wait_placed(started, engine, timeout_s=60.0)
        assert ray.get(started) == placement.nodes_of([engine[0]])[0] and ray.get(started) in freed
    finally:
        stop_ray()
