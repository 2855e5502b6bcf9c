"""The training ranks' settings, converted from the parsed flags.

Where it fits: the driver (``vime.setup.actors``) calls ``train_settings`` once and
hands the result to ``RayTrainGroup.start_init``; every rank builds its actor and
backend from that ``TrainSettings`` (``vime.backends.base``) alone, so nothing on a
rank reads a flag. The parts are each component's own dataclass: the LR schedule
(``vime.backends.optim.LRSchedule``), AdamW's, the loss (``loss_settings`` below,
which imports a custom policy loss), LoRA's, the checkpoint folders
(``vime.checkpoint``), the export (``vime.weights.hf_export``) and the backend's own,
made by its flag module's ``settings`` (``vime.backends.registry``).
"""

from __future__ import annotations

import argparse

from vime.algo.correction import RolloutCorrection
from vime.algo.custom import load_function
from vime.algo.losses import policy_loss
from vime.algo.objective import LossConfig
from vime.backends import registry
from vime.backends.base import TrainSettings
from vime.backends.optim import AdamWSettings, LRSchedule
from vime.checkpoint import CheckpointSettings
from vime.config.algo_flags import DEFAULT_KL_TYPE
from vime.weights.hf_export import ExportSettings
from vime.weights.lora import LoraSettings


def train_settings(args: argparse.Namespace) -> TrainSettings:
    """What every training rank of ``args``'s run needs (run-time values resolved)."""
    return TrainSettings(
        hf_checkpoint=args.hf_checkpoint,
        seed=args.seed,
        gpus_per_node=args.actor_num_gpus_per_node,
        temperature=args.rollout_temperature,
        keep_dropout=args.keep_dropout,
        lr_schedule=lr_schedule(args),
        clip_grad=args.clip_grad,
        adamw=adamw_settings(args),
        loss=loss_settings(args),
        lora=lora_settings(args),
        checkpoint=CheckpointSettings(
            save=args.save, load=args.load, keep_last=args.keep_last_checkpoints
        ),
        export=ExportSettings(
            bucket_bytes=args.update_weight_buffer_size, tokenizer=args.hf_checkpoint
        ),
        backend=registry.settings_maker(args.train_backend)(args),
        compile_decoder=args.compile_decoder,
        lm_head_tail=args.lm_head_tail,
    )


def lr_schedule(args: argparse.Namespace) -> LRSchedule:
    """The LR schedule over the run's samples: ``--num-rollout`` rollouts (1 when not
    fixed) of ``--rollout-batch-size`` x ``--n-samples-per-prompt``, after the warm start's
    ``--sft-warmup-steps`` x ``--rollout-batch-size`` demonstrations."""
    samples_per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
    warm_start = args.sft_warmup_steps * args.rollout_batch_size
    return LRSchedule(
        lr=args.lr,
        min_lr=args.min_lr,
        decay_style=args.lr_decay_style,
        warmup_samples=args.lr_warmup_samples,
        total_samples=(args.num_rollout or 1) * samples_per_rollout + warm_start,
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
