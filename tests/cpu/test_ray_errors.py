"""The fail-fast wait of the Ray layer (``vime.ray.errors``).

Proves: ``wait_all`` raises with the failing actor's error as soon as one actor
dies, while a peer is still blocked (as a rank stuck in a collective would be):
nothing hangs.
"""

from __future__ import annotations

import os
import re
import time
from types import ModuleType

import pytest

from vime.ray.errors import ActorFailure, label_actor, wait_all


def test_wait_all_fails_fast_when_an_actor_dies(local_ray: ModuleType) -> None:
    """A dead actor stops the wait at once, not when its stuck peer gives up, and the
    one-line message says which actor (``label_actor``) died or raised what."""

    @local_ray.remote
    class Rank:
        def block(self) -> None:
            time.sleep(600)  # a peer stuck in a collective

        def die(self, after_s: float = 1.0) -> None:
            time.sleep(after_s)
            os._exit(3)

        def fail(self) -> None:
            raise ValueError("bad shard 3")

    stuck, dying = Rank.remote(), label_actor(Rank.remote(), "training rank 1")
    start = time.monotonic()
    with pytest.raises(ActorFailure) as failure:
        wait_all([stuck.block.remote(), dying.die.remote()], "training")
    assert time.monotonic() - start < 120  # bounded: far below the 600 s block
    message = str(failure.value)
    # Which actor, that its process died, and Ray's one-sentence reason; one line.
    assert re.fullmatch(r"training failed: training rank 1 \(pid \d+\) died: .+\.", message)
    assert "\n" not in message

    raising = label_actor(Rank.remote(), "rollout engine 0")
    with pytest.raises(ActorFailure) as failure:
        wait_all([raising.fail.remote()], "generating")
    assert str(failure.value) == "generating failed: rollout engine 0: ValueError: bad shard 3"
    # A peer's collective fails first because a rank died: the death is reported.
    peer, dead = Rank.remote(), label_actor(Rank.remote(), "training rank 3")
    with pytest.raises(ActorFailure, match=r"^training failed: training rank 3 \(pid"):
        wait_all([peer.fail.remote(), dead.die.remote(0.3)], "training")
    unnamed = Rank.remote()
    with pytest.raises(ActorFailure, match=r"^generating failed: actor Rank \(pid \d+\) died"):
        wait_all([unnamed.die.remote()], "generating")
