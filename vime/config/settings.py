"""The parsed flags, converted once into frozen per-component settings.

Where it fits: ``vime.config.parse_args`` gives the validated flag namespace
(``Config``); ``build_settings`` turns it, once the run has resolved it
(``vime.config.setup_settings.resolve_run``), into a ``RunSettings`` whose fields are
each component's own settings, and the run hands every component only its part. The
dataclasses live beside the components that take them; the conversions live here, in
``rollout_settings``, ``setup_settings`` and ``cluster_settings``, so no module outside
``vime.config`` reads a flag. ``loss_settings``, ``lora_settings`` and
``adamw_settings`` are also parts of what a training rank is given
(``vime.config.train_settings``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vime.algo.correction import RolloutCorrection
from vime.algo.custom import load_function
from vime.algo.losses import policy_loss
from vime.algo.objective import LossConfig
from vime.backends.optim import AdamWSettings
from vime.config.algo_flags import DEFAULT_KL_TYPE
from vime.config.cluster_settings import cluster_settings
from vime.config.rollout_settings import agent_settings, reward_settings, rollout_settings
from vime.config.setup_settings import loop_settings, timing_settings, tracker_settings
from vime.config.train_settings import train_settings
from vime.config.validate import joins_cluster
from vime.ray.transports import SyncSettings
from vime.rollout.settings import AgentSettings, RolloutSettings
from vime.setup.settings import (
    ActorSettings,
    ClusterSettings,
    EngineSettings,
    LoopSettings,
    ScorerSettings,
    TimingSettings,
    TrackerSettings,
)
from vime.weights.lora import LoraSettings, engine_lora


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
    )


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
    )


def sync_settings(args: argparse.Namespace) -> SyncSettings:
    return SyncSettings(
        weight_sync=args.weight_sync,
        bucket_bytes=args.update_weight_buffer_size,
        colocate=args.colocate,
        gpus_per_engine=args.rollout_num_gpus_per_engine,
        output_dir=args.output_dir,
    )


def adamw_settings(args: argparse.Namespace) -> AdamWSettings:
    return AdamWSettings(
        lr=args.lr,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
    )


def lora_settings(args: argparse.Namespace) -> LoraSettings:
    return LoraSettings(
        rank=args.lora_rank,
        alpha=args.lora_alpha,
        dropout=args.lora_dropout,
        target_modules=tuple(args.lora_target_modules),
        merge_on_sync=args.lora_merge_on_sync,
        modules_to_save=tuple(args.lora_modules_to_save),
    )


def loss_settings(args: argparse.Namespace) -> LossConfig:
    """The loss the flags ask for, the custom policy loss imported."""
    policy_loss_fn = policy_loss
    if args.custom_loss_function_path:
        policy_loss_fn = load_function(args.custom_loss_function_path, expected=policy_loss)
    correction = None
    if args.use_tis:
        correction = RolloutCorrection(
            level=args.tis_level, mode=args.tis_mode, high=args.tis_clip, low=args.tis_clip_low
        )
    return LossConfig(
        eps_clip=args.eps_clip,
        eps_clip_high=args.eps_clip_high,
        eps_clip_c=args.eps_clip_c,
        level=args.policy_loss_level,
        correction=correction,
        use_kl=args.use_kl_loss,
        kl_coef=args.kl_loss_coef,
        kl_type=args.kl_loss_type or DEFAULT_KL_TYPE,
        entropy_coef=args.entropy_coef,
        agg_mode=args.loss_agg_mode,
        norm_len=args.loss_agg_norm_len or args.rollout_max_response_len,
        policy_loss_fn=policy_loss_fn,
        policy_loss_path=args.custom_loss_function_path or None,
    )
