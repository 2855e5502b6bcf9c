"""Placement layout and the fail-fast wait of the Ray layer.

Proves: ``layout_of`` gives one bundle per training rank plus the rollout
devices (none extra when colocated), engine bundles never overlap training
bundles unless colocated, and bad counts are refused; ``wait_all`` raises with
the failing actor's error as soon as one actor dies, while a peer is still
blocked (as a rank stuck in a collective would be): nothing hangs.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from vime.ray.placement import ActorFailure, Layout, layout_of, wait_all


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
    with pytest.raises(ValueError, match=fragment):
        layout_of(_args(**kw), use_gpu=False)


def test_wait_all_fails_fast_when_an_actor_dies() -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Rank:
            def block(self) -> None:
                time.sleep(600)  # a peer stuck in a collective

            def die(self) -> None:
                time.sleep(1)
                os._exit(3)

        stuck, dying = Rank.remote(), Rank.remote()
        start = time.monotonic()
        with pytest.raises(ActorFailure, match="training failed"):
            wait_all([stuck.block.remote(), dying.die.remote()], "training")
        assert time.monotonic() - start < 120  # bounded: far below the 600 s block
    finally:
        ray.shutdown()
