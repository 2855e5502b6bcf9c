"""Builders of the run's Ray side: Ray and the placement, the training ranks, the engines.

Where it fits: ``vime.setup.run.build_run`` calls ``build_cluster`` on its
``ClusterSettings`` (Ray started or joined, the cluster's devices checked, one placement
group: ``vime.ray``), then ``build_actors`` on its ``ActorSettings``: the ranks
initialise while the engines start on ``EngineOptions`` (``vime.rollout.engines.registry``),
or after them under ``--colocate`` (``DeviceTurns``). ``--cpu-split`` gives each side
cores of its own on a CPU run (``cpu_split``).
"""

from __future__ import annotations

import os
import time

from vime import perf
from vime.config.validate import check_devices
from vime.ray.cluster import cluster_gpus, start_ray
from vime.ray.engines import EngineGroup
from vime.ray.placement import Layout, layout_of, reserve, split_cores
from vime.ray.train_group import RayTrainGroup
from vime.ray.turns import DeviceTurns
from vime.rollout.engines.registry import EngineOptions
from vime.setup.parts import Actors, Cluster, Console, Model
from vime.setup.settings import ActorSettings, ClusterSettings, EngineSettings

# The start-up line's words for each engine-side LoRA receiver (vime.weights.lora).
_LORA_RECEIVERS = {
    "AdapterLoader": "as adapters the engine serves itself (the base once)",
    "AdapterMerger": "as adapters merged on the engine (the base once)",
}


def build_cluster(settings: ClusterSettings) -> Cluster:
    """Ray's start (unless vime-train started it already) and the run's placement."""
    start_ray(settings.ray_address, layout_of(settings.placement, use_gpu=False).num_bundles)
    # The cluster's devices, not this driver's: a driver on a CPU-only head node still
    # places the ranks and engines on the workers' GPUs.
    use_gpu = cluster_gpus() > 0
    lacking = "none is visible here"
    if settings.joins_cluster:
        address = settings.ray_address or os.environ.get("RAY_ADDRESS")
        lacking = f"the Ray cluster at {address} has none"
    placement = settings.placement
    check_devices(
        settings.weight_sync, placement.gpus_per_engine, placement.colocate, use_gpu, lacking
    )
    return Cluster(use_gpu, reserve(layout_of(placement, use_gpu)))


def build_actors(
    settings: ActorSettings,
    model: Model,
    cluster: Cluster,
    startup: perf.StartupClock,
    console: Console,
) -> Actors:
    """The training ranks and the engines. The ranks initialise while the engines start;
    colocated, training goes to sleep first (``DeviceTurns``), so the engines wait for it."""
    layout = cluster.layout
    threads = max(1, (os.cpu_count() or 1) // max(1, settings.gpus_per_node))
    train_cores, engine_cores = None, None
    split = cpu_split(
        settings.cpu_split, settings.max_staleness, cluster.use_gpu, settings.joins_cluster
    )
    if split:  # both sides work at once: on the CPU each gets cores of its own, as on GPUs
        cores = sorted(os.sched_getaffinity(0))
        train_cores, engine_cores = split_cores(cores, layout.num_train, layout.num_engines)
    train_group = RayTrainGroup(settings.train_backend, cluster.placement)
    started = time.time()
    train_group.start_init(settings.train, threads, train_cores, settings.rank_folders)
    if settings.colocate:
        start_rollout = train_group.finish_init()
        startup.mark("trainer")
    engines = settings.engines
    options = engine_options(engines, model)
    turns = DeviceTurns(
        train_group,
        lambda: EngineGroup(
            engines.kind,
            model.checkpoint,
            cluster.placement,
            options,
            engine_cores,
            faults=engines.faults,
            say=console.say,
        ),
        colocate=settings.colocate,
    )
    if settings.colocate:
        startup.mark("engines")
    else:
        startup.add("engines", time.time() - started)
        start_rollout = train_group.finish_init()
        done_at = min(train_group.init_done_at or started, time.time())
        startup.add("trainer", done_at - started)  # the ranks' clock: clamped to ours
        startup.together("trainer", "engines")
    actors = Actors(cluster.placement, train_group, turns, start_rollout)
    _say_engines(settings, actors, layout, options, engine_cores is not None, console)
    return actors


def engine_options(settings: EngineSettings, model: Model) -> EngineOptions:
    """What every engine is built with: ``settings`` and what ``model`` is."""
    return EngineOptions(
        # The embedded model's matmuls are too small to split over threads: on one it
        # generates faster (bench/README.md: 0.078 against 0.105 s a rollout, 2 cores).
        num_threads=1 if model.embedded else (os.cpu_count() or 1),
        tensor_parallel_size=settings.tensor_parallel_size,
        seed=settings.seed,
        max_model_len=settings.max_model_len,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tiny_model=model.embedded,  # auto gives it the faster engine (resolve_engine)
        lora=settings.lora,
    )


def cpu_split(mode: str, max_staleness: int, use_gpu: bool, joins_cluster: bool) -> bool:
    """Whether the training ranks and the engines get CPU cores of their own
    (``--cpu-split`` ``mode``; auto: when both work at once, on a CPU run on this
    machine)."""
    if use_gpu or joins_cluster or mode == "off":
        return False
    return mode == "on" or max_staleness > 0


def _say_engines(
    settings: ActorSettings,
    actors: Actors,
    layout: Layout,
    options: EngineOptions,
    split: bool,
    console: Console,
) -> None:
    """The start-up lines on the engines: which, how LoRA syncs reach them, the cores."""
    engines = actors.engines
    console.say(
        f"vime: rollout engine {engines.kind} ({engines.reason}), {layout.num_engines} engine(s)"
    )
    if options.lora is not None:
        how = _LORA_RECEIVERS[engines.lora_receiver]
        if options.lora.settings.merge_on_sync or settings.weight_sync == "disk":
            how = "as merged weights, the whole model at every sync"
        console.say(f"vime: LoRA syncs reach the engines {how}")
    if split:  # as the processes see it, not as planned
        cores = f"training {actors.train_group.cpu_cores()}, engines {engines.cpu_cores()}"
        console.say(f"vime: CPU cores split (--cpu-split): {cores}")
