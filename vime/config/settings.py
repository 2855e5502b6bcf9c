"""The parsed flags, converted once into frozen per-component settings.

Where it fits: ``vime.config.parse_args`` gives the validated flag namespace
(``Config``); ``build_settings`` turns it, once the run has resolved it
(``vime.config.setup_settings.resolve_run``), into a ``RunSettings`` whose fields are
each component's own settings, and the run hands every component only its part. The
dataclasses live beside the components that take them; the conversions live here, in
``rollout_settings``, ``setup_settings`` and ``cluster_settings``, so no module outside
``vime.config`` reads a flag; what a training rank is given is built in
``vime.config.train_settings``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from vime.config.cluster_settings import cluster_settings
from vime.config.rollout_settings import agent_settings, reward_settings, rollout_settings
from vime.config.setup_settings import loop_settings, timing_settings, tracker_settings
from vime.config.train_settings import lora_settings, train_settings
from vime.config.validate import joins_cluster
from vime.ray.transports import SyncSettings
from vime.rollout.settings import AgentSettings, FaultSettings, RolloutSettings
from vime.setup.settings import (
    ActorSettings,
    ClusterSettings,
    EngineSettings,
    LoopSettings,
    ScorerSettings,
    TimingSettings,
    TrackerSettings,
    WarmStartSettings,
)
from vime.weights.lora import engine_lora


@dataclass(frozen=True)
class RunSettings:
    """The settings of every part a run builds once its model and prompts have loaded
    (those load on ``vime.setup.settings.DataSettings``), from the resolved flags;
    ``max_staleness``: rollouts the engines may run ahead of the weights (0:
    synchronous); ``load``: the checkpoint ``--load`` resumes from."""

    scorer: ScorerSettings
    cluster: ClusterSettings
    actors: ActorSettings
    rollout: RolloutSettings
    agent: AgentSettings
    sync: SyncSettings
    max_staleness: int
    load: str | None
    timing: TimingSettings
    tracker: TrackerSettings
    loop: LoopSettings
    warm_start: WarmStartSettings


def build_settings(args: argparse.Namespace) -> RunSettings:
    """``args`` (``parse_args``'s, run-time values resolved) as per-component settings."""
    return RunSettings(
        scorer=ScorerSettings(reward_settings(args), hook_args=args),
        cluster=cluster_settings(args),
        actors=actor_settings(args),
        rollout=rollout_settings(args),
        agent=agent_settings(args),
        sync=sync_settings(args),
        max_staleness=args.max_staleness,
        load=args.load,
        timing=timing_settings(args),
        tracker=tracker_settings(args),
        loop=loop_settings(args),
        warm_start=WarmStartSettings(args.sft_warmup_steps, args.rollout_batch_size, args.seed),
    )


def actor_settings(args: argparse.Namespace) -> ActorSettings:
    return ActorSettings(
        train_backend=args.train_backend,
        gpus_per_node=args.actor_num_gpus_per_node,
        cpu_split=args.cpu_split,
        max_staleness=args.max_staleness,
        colocate=args.colocate,
        joins_cluster=joins_cluster(args),
        weight_sync=args.weight_sync,
        engines=engine_settings(args),
        train=train_settings(args),
        rank_folders=rank_folders(args),
    )


def rank_folders(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The folders the training ranks read or write, as ``(flag, folder)``: the checkpoint
    folders, the exports, and the output folder where the ranks use it (the embedded
    model and its export live there, or ``--weight-sync disk`` passes the weights)."""
    out = os.path.abspath(args.output_dir) if args.output_dir else None
    inside = [args.hf_checkpoint, args.save_hf, args.save_hf_merged]
    uses_out = out is not None and (
        args.weight_sync == "disk"
        or any(p and os.path.abspath(p).startswith(out + os.sep) for p in inside)
    )
    named = [
        ("--output-dir", out if uses_out else None),
        ("--save", args.save),
        ("--load", args.load),
        ("--save-hf", args.save_hf),
        ("--save-hf-merged", args.save_hf_merged),
    ]
    return tuple((flag, folder) for flag, folder in named if folder)


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    lora = engine_lora(
        lora_settings(args), args.update_weight_buffer_size, args.weight_sync, args.vllm_lora
    )
    return EngineSettings(
        kind=args.rollout_engine,
        tensor_parallel_size=args.rollout_num_gpus_per_engine,
        seed=args.seed,
        # The longest sequence a rollout makes: what the KV cache must hold.
        max_model_len=args.rollout_max_prompt_len + args.rollout_max_response_len,
        gpu_memory_utilization=args.rollout_gpu_memory_utilization,
        lora=lora,
        faults=FaultSettings(
            args.max_engine_restarts, args.engine_timeout, args.engine_restart_window
        ),
    )


def sync_settings(args: argparse.Namespace) -> SyncSettings:
    return SyncSettings(
        weight_sync=args.weight_sync,
        bucket_bytes=args.update_weight_buffer_size,
        colocate=args.colocate,
        gpus_per_engine=args.rollout_num_gpus_per_engine,
        output_dir=args.output_dir,
    )
