"""``build_run``: every part of a run, built in order; and the builders of its last parts.

Where it fits: ``vime.trainer.run`` calls ``build_run`` and hands the ``RunParts`` to
``vime.trainer.Run``. After the data (``vime.setup.data``) and the actors
(``vime.setup.actors``) come the rollout source (a ``RolloutManager`` at the data
position ``--load`` resumes from, and with ``--max-staleness`` its ``RolloutProducer``),
the weight transport, the step timing and the tracker. Each builder registers what
must be released on the run's ``Closer``; a failure part-way releases what was built.
Refusals of flag combinations happen while parsing (``vime.config.validate``); those
here need the checkpoint's contents.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from vime import perf
from vime.config.parser import Config
from vime.config.settings import RunSettings, build_settings
from vime.config.setup_settings import data_settings, resolve_run
from vime.errors import ConfigError
from vime.profiling import PhaseClock, TimedCalls
from vime.ray.placement import Layout
from vime.ray.transports import make_transport
from vime.rollout.manager import RolloutManager
from vime.rollout.producer import ProducerSettings, RolloutProducer
from vime.rollout.tools.loop import build_agent
from vime.setup.actors import build_actors, build_cluster
from vime.setup.data import build_model, build_prompts, build_scorer
from vime.setup.parts import Actors, Closer, Console, Model, Prompts, RunParts
from vime.setup.settings import TimingSettings, TrackerSettings
from vime.setup.warm_start import build_warm_start
from vime.step_timing import StepTiming
from vime.tracking import Tracker, default_output_dir

TRACE_FILE = "trace.json"


def build_run(args: Config, startup: perf.StartupClock | None = None) -> RunParts:
    """Build every part of the run ``args`` configure, timing the start-up's parts on
    ``startup`` (reported when the first rollout starts). A failure part-way releases
    what was built (Ray, which the caller may have started, stays up) and raises."""
    startup = startup or perf.StartupClock()
    closer, console = Closer(), Console()
    args = args.replace(output_dir=args.output_dir or default_output_dir())
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        data = data_settings(args)  # none of it is what resolve_run fills in below
        model = build_model(data.model, data.agent, console, closer)
        prompts = build_prompts(data.prompts, model, console)
        args = resolve_run(args, model.checkpoint, model.embedded, prompts.source)
        settings = build_settings(args)  # every later part's, from the resolved flags
        scorer = build_scorer(settings.scorer, model, closer)
        startup.mark("model")  # the checkpoint, the tokenizer, the prompts, the reward
        cluster = build_cluster(settings.cluster)
        startup.mark("ray")
        actors = build_actors(settings.actors, model, cluster, startup, console)
        closer.callback(actors.engines.close)
        position = (
            _loaded_data_position(settings.load, actors) if actors.start_rollout > 0 else None
        )
        clock = PhaseClock()  # the driver's phases, the reward's among them
        manager = build_manager(
            settings, model, prompts, actors, scorer, clock, position, console, closer
        )
        producer = build_producer(settings, manager, actors, cluster.layout, position, closer)
        transport = make_transport(
            settings.sync, cluster.use_gpu, actors.train_group, actors.engines
        )
        transport.setup()
        # A restarted engine takes the weights last synced from the run's transport.
        actors.engines.restore = transport.restore
        startup.mark("other")
        timing = build_timing(settings.timing, model, actors, clock, console)
        startup.mark("peak")
        tracker = build_tracker(settings.tracker, actors.start_rollout, closer)
        console.tracker = tracker
        warm_start = build_warm_start(
            settings.warm_start if actors.start_rollout == 0 else None,
            model.task,
            model.tokenizer,
            prompts.source.prompts,
            prompts.ids,
        )
    except BaseException:
        closer.close("failed")
        raise
    return RunParts(
        settings.loop,
        startup,
        prompts,
        actors,
        manager,
        producer,
        transport,
        timing,
        tracker,
        closer,
        warm_start=tuple(warm_start),
    )


def build_manager(
    settings: RunSettings,
    model: Model,
    prompts: Prompts,
    actors: Actors,
    scorer: Any,
    clock: PhaseClock,
    position: dict[str, Any] | None,
    console: Console,
    closer: Closer,
) -> RolloutManager:
    """The rollout manager (its reward timed on ``clock``), at the data ``position`` the
    checkpoint ``--load`` resumes from was saved with, if any; its multi-turn agent
    released with the run (``--agent-function-path``'s endpoint stops)."""
    agent = build_agent(settings.agent, model.tokenizer, actors.engines, model.toolbox)
    if agent is not None:
        closer.callback(agent.close)
    manager = RolloutManager(
        settings.rollout,
        actors.engines,
        model.tokenizer,
        TimedCalls(scorer, clock, "reward", ["score_sync"]),
        prompts.source,
        prompts.ids,
        is_correct=model.task.is_correct if model.task else None,
        warn=console.say,
        agent=agent,
    )
    if position is not None:
        manager.load_state_dict(position)
    return manager


def build_producer(
    settings: RunSettings,
    manager: RolloutManager,
    actors: Actors,
    layout: Layout,
    position: dict[str, Any] | None,
    closer: Closer,
) -> RolloutProducer | None:
    """Asynchronous rollout (``--max-staleness`` >= 1): generation runs in the producer's
    thread and rollouts take their batches from it, first the prompts the resumed
    ``position`` holds drawn and not trained; None otherwise."""
    pending: list[int] = (position or {}).get("pending", [])
    staleness = settings.max_staleness
    if pending and not staleness:  # known only from the checkpoint
        raise ConfigError(
            f"--load {settings.load}: the checkpoint holds {len(pending)} prompts an "
            "asynchronous run had drawn and not trained; resume it with "
            "--max-staleness >= 1, so they are generated first"
        )
    if not staleness:
        return None
    producer = RolloutProducer(
        ProducerSettings.for_engines(settings.rollout, staleness, layout.num_engines),
        manager,
        actors.engines,
        weight_version=actors.start_rollout,
        pending=pending,
    )
    closer.callback(producer.close)  # before the scorer it calls closes
    return producer


def _loaded_data_position(load: str | None, actors: Actors) -> dict[str, Any]:
    """The data position the checkpoint ``--load`` (``load``) resumes from was saved with."""
    extra = actors.train_group.loaded_extra()
    if "data" not in extra:
        raise ConfigError(
            f"--load {load}: the checkpoint of rollout {actors.start_rollout - 1} holds "
            "no data position (it was not written by vime-train); start a new run with "
            "--hf-checkpoint instead"
        )
    return extra["data"]


def build_timing(
    settings: TimingSettings, model: Model, actors: Actors, clock: PhaseClock, console: Console
) -> StepTiming:
    """The steps' phase timing, and the training peak MFU is measured against."""
    timing = StepTiming(
        actors.train_group,
        actors.engines,
        clock,
        shape=perf.model_shape(model.checkpoint),
        peaks=actors.train_group.peaks(),
        profile_rollouts=settings.profile_rollouts,
        trace_path=os.path.join(settings.output_dir, TRACE_FILE),
    )
    peak = f"{timing.peak_flops / 1e9:.3g} GFLOP/s"
    console.say(f"vime: training peak {peak} over all ranks ({timing.peak_source})")
    return timing


def build_tracker(settings: TrackerSettings, start_rollout: int, closer: Closer) -> Tracker:
    """The run's metrics and console; released with the run's status (a run stopped
    early still writes its summary and plot)."""
    tracker = Tracker(
        settings.output_dir,
        num_rollouts=settings.num_rollouts,
        start_rollout=start_rollout,
        use_tensorboard=settings.use_tensorboard,
        use_wandb=settings.use_wandb,
        wandb_project=settings.wandb_project,
        config=settings.flags,
    )

    def finish(status: str) -> None:
        try:
            tracker.finish({"status": status})  # a no-op after Run.train finished it
        except Exception as err:  # the run's own error is the one to report
            print(f"vime: could not finish the run's outputs: {err}", file=sys.stderr)

    closer.push(finish)
    return tracker
