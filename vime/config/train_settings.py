"""The training ranks' settings, converted from the parsed flags.

Where it fits: the driver (``vime.setup.actors``) calls ``train_settings`` once and
hands the result to ``RayTrainGroup.start_init``; every rank builds its actor and
backend from that ``TrainSettings`` (``vime.backends.base``) alone, so nothing on a
rank reads a flag. The parts are each component's own dataclass: the LR schedule
(``vime.backends.optim.LRSchedule``), AdamW's, the loss (``settings.loss_settings``,
which imports a custom policy loss), LoRA's, the checkpoint folders
(``vime.checkpoint``), the export (``vime.weights.hf_export``) and the backend's own,
made by its flag module's ``settings`` (``vime.backends.registry``).
"""

from __future__ import annotations

import argparse

from vime.backends import registry
from vime.backends.base import TrainSettings
from vime.backends.optim import LRSchedule
from vime.checkpoint import CheckpointSettings
from vime.config.settings import adamw_settings, lora_settings, loss_settings
from vime.weights.hf_export import ExportSettings


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
    )


def lr_schedule(args: argparse.Namespace) -> LRSchedule:
    """The LR schedule over the run's samples: ``--num-rollout`` rollouts (1 when not
    fixed) of ``--rollout-batch-size`` x ``--n-samples-per-prompt``."""
    samples_per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
    return LRSchedule(
        lr=args.lr,
        min_lr=args.min_lr,
        decay_style=args.lr_decay_style,
        warmup_samples=args.lr_warmup_samples,
        total_samples=(args.num_rollout or 1) * samples_per_rollout,
    )
