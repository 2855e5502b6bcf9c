"""Placement: the layout of the run's bundles, their order, and the CPU split.

Proves: ``layout_of`` (of the flags' ``placement_settings``) gives one bundle per
training rank plus the rollout devices (none extra when colocated), engine bundles
never overlap training bundles unless colocated, and bad counts are refused. Ranks
and engines take the placement group's bundles node by node, however Ray numbered
them. ``split_cores`` gives each side cores of its own.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vime.config import ConfigError
from vime.config.cluster_settings import placement_settings
from vime.ray.placement import Layout, layout_of, node_major_order, split_cores


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
    layout = layout_of(
        placement_settings(_args(rollout_num_gpus=4, rollout_num_gpus_per_engine=2)), use_gpu=True
    )
    assert layout == Layout(2, 2, 2, False, True)
    assert layout.num_bundles == 6
    assert layout.engine_bundles(0) == [2, 3] and layout.engine_bundles(1) == [4, 5]


def test_colocated_layout_shares_training_bundles() -> None:
    layout = layout_of(placement_settings(_args(colocate=True)), use_gpu=True)
    assert layout.num_engines == 2 and layout.num_bundles == 2
    assert layout.engine_bundles(1) == [1]


def test_default_is_one_engine_beside_training() -> None:
    layout = layout_of(placement_settings(_args(actor_num_gpus_per_node=1)), use_gpu=False)
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
        layout_of(placement_settings(_args(**kw)), use_gpu=False)


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
