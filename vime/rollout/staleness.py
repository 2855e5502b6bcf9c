"""Bounded staleness for asynchronous rollout: which groups may start, which may train.

Where it fits: with ``--max-staleness K`` >= 1 the producer (``vime.rollout.producer``)
asks ``Admission`` whether one more group may start generating, and the trainer takes
its batches from ``ReadyGroups``. Pure bookkeeping, no Ray: tested with random delays.

Versions: weights that have had v rollouts of training are version v (the engines
start at 0; rollout r trains version r and sends r + 1). A group whose oldest token
was sampled by version v_min and that rollout r trains has staleness s = r - v_min,
and every trained group has s <= K.

Admission: groups are counted in the order they start; a group that is discarded
(its rewards all agree under dynamic sampling, or it came too late) stops counting.
The L-th live group (from 0) is, trained in order, in rollout floor(L / B), so it may
start once the engines serve v >= floor(L / B) - K, i.e. while L < (v + K + 1) * B:
generation runs at most K rollouts ahead and a group trained in order is never stale.
One that finishes behind later ones can still reach the trainer with s > K: it is
taken out then, counted, and its prompt goes back to be generated again.

Taking: the oldest waiting groups first (by the version of their oldest token, then by
``order``: the producer's admission order), not the first to finish. A group's time runs
out at rollout v_min + K, so the oldest has the least left; taken in finish order, the
groups that finish late (the long responses) wait behind newer ones, go stale and are
generated again, and the trained batches lean to short responses
(``bench/ready_order.py`` measures it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

G = TypeVar("G")


@dataclass
class Admission:
    """How many groups may have started: ``(v + K + 1) * B`` live ones at version v."""

    batch_size: int  # B: groups a rollout trains
    max_staleness: int  # K >= 1
    first_rollout: int = 0  # the rollout these counts start at (a resumed run's)
    started: int = 0  # groups admitted so far
    discarded: int = 0  # of those, filtered out or dropped as stale

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_staleness < 0:
            raise ValueError(f"need B >= 1 and K >= 0, got {self.batch_size}, {self.max_staleness}")

    @property
    def live(self) -> int:
        return self.started - self.discarded

    def room(self, engine_version: int) -> int:
        """Groups that may start now, with the engines serving ``engine_version``."""
        ahead = engine_version - self.first_rollout + self.max_staleness + 1
        limit = ahead * self.batch_size
        return max(0, limit - self.live)

    def start(self, n: int = 1) -> None:
        self.started += n

    def discard(self, n: int = 1) -> None:
        self.discarded += n


@dataclass
class ReadyGroups(Generic[G]):
    """Scored groups waiting for the trainer, taken oldest first.

    ``oldest_version(group)`` is the version that sampled the group's oldest token;
    ``order(group)``, when given, the key groups are taken by (default: that version,
    ties in the order they finished).
    """

    oldest_version: Callable[[G], int]
    max_staleness: int
    groups: list[G] = field(default_factory=list)
    order: Callable[[G], Any] | None = None

    def add(self, group: G) -> None:
        self.groups.append(group)

    def __len__(self) -> int:
        return len(self.groups)

    def take(self, n: int, rollout: int) -> tuple[list[G], list[G]]:
        """``(batch, stale)``: the ``n`` oldest groups (by ``order``) that rollout ``rollout``
        may train (s <= K), or none while fewer wait; and every waiting group already too
        old for it (they would only age: out of the buffer, to be generated again)."""
        fresh: list[G] = []
        stale: list[G] = []
        for group in self.groups:
            too_old = rollout - self.oldest_version(group) > self.max_staleness
            (stale if too_old else fresh).append(group)
        if len(fresh) < n:
            self.groups = fresh
            return [], stale
        fresh.sort(key=self.order or self.oldest_version)  # stable: then in finish order
        self.groups = fresh[n:]
        return fresh[:n], stale
