"""The parts of a run the builders make (``vime.setup``), and what releases them.

Where it fits: each builder returns one of these frozen records; ``RunParts`` is what
``vime.setup.run.build_run`` hands ``vime.trainer.Run``. ``Closer`` holds what must be
released, registered by each builder as it builds, so a start that fails part-way
releases what it built and a finished run releases everything once. ``Console`` is
where the start-up's lines go before the tracker exists and after.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from vime import perf
from vime.data.batch import RolloutBatch
from vime.data.prompts import PromptSource
from vime.ray.engines import EngineGroup
from vime.ray.placement import Layout, Placement
from vime.ray.train_group import RayTrainGroup
from vime.ray.transports import WeightTransport
from vime.ray.turns import DeviceTurns
from vime.rollout.manager import RolloutManager
from vime.rollout.producer import RolloutProducer
from vime.rollout.tools.toolbox import Toolbox
from vime.setup.settings import LoopSettings
from vime.step_timing import StepTiming
from vime.tracking import Tracker


class Closer:
    """What the builders made that must be released, released last built first: an
    ``ExitStack`` (every release runs, the first error is raised) whose releases learn
    how the run ended (``status``: the tracker writes it into ``summary.json``)."""

    def __init__(self) -> None:
        self._releases: list[Callable[[str], object]] = []

    def push(self, release: Callable[[str], object]) -> None:
        self._releases.append(release)

    def callback(self, release: Callable[[], object]) -> None:
        self.push(lambda _status: release())

    def close(self, status: str) -> None:
        releases, self._releases = self._releases, []
        with ExitStack() as stack:
            for release in releases:
                stack.callback(release, status)


class Console:
    """Where the run's lines go: printed until the tracker exists, then through it (so a
    line does not break its live progress line)."""

    def __init__(self) -> None:
        self.tracker: Tracker | None = None

    def say(self, text: str) -> None:
        if self.tracker is not None:
            self.tracker.message(text)
        else:
            print(text, flush=True)


@dataclass(frozen=True)
class Model:
    """The checkpoint (``--hf-checkpoint``, or the embedded model written for the run),
    its tokenizer, the built-in task the prompts name, and the tools (``--tools``)."""

    checkpoint: str
    embedded: bool
    tokenizer: Any
    task: Any
    toolbox: Toolbox | None


@dataclass(frozen=True)
class Prompts:
    """The training prompts (drawn from ``source``) and the eval prompts, as token ids by
    prompt index; ``dropped``: those over ``--rollout-max-prompt-len``, as metrics."""

    source: PromptSource
    ids: dict[int, list[int]]
    eval_prompts: list[Any] | None
    eval_ids: dict[int, list[int]] | None
    dropped: dict[str, float]


@dataclass(frozen=True)
class Cluster:
    """Ray's devices as the run uses them, and the run's one placement group."""

    use_gpu: bool
    placement: Placement

    @property
    def layout(self) -> Layout:
        return self.placement.layout


@dataclass(frozen=True)
class Actors:
    """The training ranks and the engines (through ``turns``: ``--colocate``'s turns) on
    their ``placement``, and the first rollout (after the checkpoint ``--load`` resumes
    from)."""

    placement: Placement
    train_group: RayTrainGroup
    turns: DeviceTurns
    start_rollout: int

    @property
    def engines(self) -> EngineGroup:
        return self.turns.engines


@dataclass(frozen=True)
class RunParts:
    """Everything a run's loop works with, built (``build_run``)."""

    loop: LoopSettings
    startup: perf.StartupClock
    prompts: Prompts
    actors: Actors
    manager: RolloutManager
    producer: RolloutProducer | None
    transport: WeightTransport
    timing: StepTiming
    tracker: Tracker
    closer: Closer
    # The supervised warm start's batches (``vime.setup.warm_start``), trained before the
    # first rollout of a run that does not resume.
    warm_start: tuple[RolloutBatch, ...] = ()
