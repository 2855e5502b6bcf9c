"""``DeviceTurns``: under ``--colocate`` training and the engines take turns on devices.

Where it fits: ``vime.trainer`` calls ``rollout``, ``train`` and ``weight_sync`` before
each phase of a step; colocated, each turn puts one side's memory to sleep before the
other's wakes (``vime.backends.base.TRAIN_MEMORY_TAGS``, ``vime.rollout.types
.MEMORY_TAGS``), so only the two sides' weights ever share the devices. Without
``--colocate`` every call is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vime.backends.base import TRAIN_MEMORY_TAGS
from vime.rollout.types import MEMORY_TAGS


class DeviceTurns:
    """Under ``--colocate`` training and the engines share devices and take turns on them;
    without it every call is a no-op.

    ``rollout``: the engines generate, score and evaluate while training sleeps.
    ``train``: training runs (and saves, and exports) while the engines sleep.
    ``weight_sync``: training holds its weights only (from ``train`` it parks its
    ``train_state``, gradients and optimizer state: the sync reads only the weights) and
    the engines wake their weights, so the new ones load beside training's weights (their
    source, which also scores the probe); the KV cache comes back at the next
    ``rollout``, once training sleeps. Each turn puts parts to sleep before others wake:
    only the two sides' weights ever share the devices.

    The engines are started here (``start_engines``), colocated after training has gone
    to sleep: vLLM starts only where its share of the device is free. So training starts
    asleep under ``--colocate``, the engines awake.
    """

    def __init__(
        self, train_group: Any, start_engines: Callable[[], Any], *, colocate: bool
    ) -> None:
        self.train_group, self.colocate = train_group, colocate
        self.trainer_awake: frozenset[str] = frozenset(TRAIN_MEMORY_TAGS)
        if colocate:
            train_group.sleep()
            self.trainer_awake = frozenset()
        self.engines = start_engines()
        self.engines_awake: frozenset[str] = frozenset(MEMORY_TAGS)

    def rollout(self) -> None:
        self._turn(trainer=frozenset(), engines=frozenset(MEMORY_TAGS))

    def train(self) -> None:
        self._turn(trainer=frozenset(TRAIN_MEMORY_TAGS), engines=frozenset())

    def weight_sync(self) -> None:
        weights = frozenset({"weights"})
        self._turn(trainer=weights, engines=self.engines_awake | weights)

    def _turn(self, *, trainer: frozenset[str], engines: frozenset[str]) -> None:
        if not self.colocate:
            return
        awake = self.engines_awake
        if self.trainer_awake - trainer:
            self.train_group.sleep(sorted(self.trainer_awake - trainer))
        if awake and not engines:
            self.engines.sleep()
            awake = frozenset()
        if trainer - self.trainer_awake:
            self.train_group.wake_up(sorted(trainer - self.trainer_awake))
        if engines - awake:
            self.engines.wake_up(sorted(engines - awake))
            awake |= engines
        self.trainer_awake, self.engines_awake = trainer, awake
