"""The parsed flags, converted once into frozen per-component settings.

Where it fits: ``vime.config.parse_args`` gives the validated flag namespace
(``Config``); ``build_settings`` turns it into a ``RunSettings`` whose fields are each
component's own settings, and the run hands every component only its part. The
dataclasses live beside the components that take them; the conversions live here and
in ``vime.config.rollout_settings``, so no module outside ``vime.config`` reads a flag.
``loss_settings``, ``lora_settings`` and ``adamw_settings`` are also parts of what a
training rank is given (``vime.config.train_settings``).
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
from vime.config.rollout_settings import agent_settings, reward_settings, rollout_settings
from vime.ray.transports import SyncSettings
from vime.rollout.rewards import RewardSettings
from vime.rollout.settings import AgentSettings, RolloutSettings
from vime.weights.lora import LoraSettings


@dataclass(frozen=True)
class RunSettings:
    """Every component's settings of one run (``build_settings``); ``max_staleness``:
    rollouts the engines may run ahead of the weights (0: synchronous)."""

    rollout: RolloutSettings
    rewards: RewardSettings
    agent: AgentSettings
    sync: SyncSettings
    lora: LoraSettings
    max_staleness: int


def build_settings(args: argparse.Namespace) -> RunSettings:
    """``args`` (``parse_args``'s, run-time values resolved) as per-component settings."""
    return RunSettings(
        rollout=rollout_settings(args),
        rewards=reward_settings(args),
        agent=agent_settings(args),
        sync=sync_settings(args),
        lora=lora_settings(args),
        max_staleness=args.max_staleness,
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
