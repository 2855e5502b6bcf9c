"""Bounded staleness bookkeeping of asynchronous rollout (``vime.rollout.staleness``).

Proves: with random generation times on several engines, weights that arrive mid-group,
groups filtered out at random and groups that finish behind later ones, no trained
group is ever more than K versions old, no prompt is trained twice, the loop never
stalls, and generation runs at most K rollouts ahead; K = 1 admits two rollouts' worth
at version 0; a batch is taken only whole; the oldest groups are taken first, so one
that finished behind newer ones is trained instead of going stale.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import pytest

from vime.rollout.staleness import Admission, ReadyGroups


@dataclass
class Group:
    prompt: int
    oldest: int


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_random_delays_never_train_a_group_older_than_k(k: int, seed: int) -> None:
    rng = random.Random(seed)
    batch, engines, rollouts = 4, 3, 60
    admission = Admission(batch_size=batch, max_staleness=k)
    ready: ReadyGroups[Group] = ReadyGroups(lambda g: g.oldest, max_staleness=k)
    next_prompt, retry, trained = 0, [], []
    engine_version = 0  # what the engines serve: the trainer's last sync
    in_flight: list[tuple[float, int, Group]] = []  # (finish time, tiebreak, group)
    now, tiebreak, stale_total, ahead_most = 0.0, 0, 0, 0

    def admit() -> None:
        nonlocal next_prompt, tiebreak, ahead_most
        while admission.room(engine_version) > 0 and len(in_flight) < 4 * engines:
            if retry:
                prompt = retry.pop(0)
            else:
                prompt, next_prompt = next_prompt, next_prompt + 1
            admission.start()
            tiebreak += 1
            # Long-tailed generation times: some groups finish far behind later ones.
            took = rng.expovariate(1.0) * (5 if rng.random() < 0.1 else 1)
            heapq.heappush(in_flight, (now + took, tiebreak, Group(prompt, engine_version)))
            ahead_most = max(ahead_most, (admission.live - 1) // batch - engine_version)

    for rollout in range(rollouts):
        while True:
            admit()
            taken, stale = ready.take(batch, rollout)
            stale_total += len(stale)
            admission.discard(len(stale))
            retry += [g.prompt for g in stale]
            if taken:
                break
            assert in_flight, "stalled: nothing generating and no batch ready"
            now, _, group = heapq.heappop(in_flight)
            if rng.random() < 0.2:  # dynamic sampling: its rewards all agreed
                admission.discard()
                retry.append(group.prompt)  # (a test shortcut: any discarded prompt again)
            else:
                ready.add(group)
        assert all(rollout - g.oldest <= k for g in taken)
        trained += [g.prompt for g in taken]
        now += rng.uniform(0.5, 2.0)  # training
        engine_version = rollout + 1  # the sync
    assert len(trained) == len(set(trained)) == rollouts * batch
    assert ahead_most <= k
    assert stale_total > 0  # late groups were met and taken out


def test_k_one_admits_two_rollouts_at_version_zero() -> None:
    admission = Admission(batch_size=8, max_staleness=1)
    assert admission.room(0) == 16
    admission.start(16)
    assert admission.room(0) == 0
    admission.discard(3)  # three filtered out: three more may start
    assert admission.room(0) == 3 and admission.room(1) == 11
    resumed = Admission(batch_size=8, max_staleness=1, first_rollout=5)
    assert resumed.room(5) == 16  # counted from the rollout it resumes at


def test_a_batch_is_taken_only_whole_and_stale_ones_leave() -> None:
    ready: ReadyGroups[Group] = ReadyGroups(lambda g: g.oldest, max_staleness=1)
    for prompt, oldest in [(0, 0), (1, 2), (2, 1)]:
        ready.add(Group(prompt, oldest))
    assert ready.take(3, rollout=2) == ([], [Group(0, 0)])
    assert len(ready) == 2
    batch, stale = ready.take(2, rollout=2)
    assert [g.prompt for g in batch] == [2, 1] and stale == [] and len(ready) == 0  # oldest first


def test_the_oldest_groups_are_taken_first_whatever_order_they_finished_in() -> None:
    """A version-0 group that finished after three version-1 groups goes into rollout 1's
    batch (s = 1 <= K) instead of waiting until rollout 2, where it would be stale."""
    ready: ReadyGroups[Group] = ReadyGroups(lambda g: g.oldest, max_staleness=1)
    for prompt, oldest in [(1, 1), (2, 1), (3, 1), (0, 0)]:  # finish order
        ready.add(Group(prompt, oldest))
    batch, stale = ready.take(2, rollout=1)
    assert [g.prompt for g in batch] == [0, 1] and stale == []
    batch, stale = ready.take(2, rollout=2)
    assert [g.prompt for g in batch] == [2, 3] and stale == []
