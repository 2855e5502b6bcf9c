"""The setup's settings, converted from the parsed flags, and the values a run resolves.

Where it fits: ``vime.setup.run.build_run`` takes ``data_settings`` for what loads first
(the model, its tools, the prompts), then ``resolve_run`` fixes what is known only once
they have loaded (the checkpoint, the run's length, the export folder), and every later
part's settings come from the resolved flags (``vime.config.settings.build_settings``,
which takes the loop's, the timing's and the tracker's from here). The dataclasses are
``vime.setup.settings``'s; the cluster's conversions are ``vime.config.cluster_settings``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import fields

from vime.config.parser import Config
from vime.config.rollout_settings import agent_settings, reward_settings
from vime.data.prompts import PromptSource, prompts_per_rollout, run_length
from vime.rollout.rewards import reward_needs_label
from vime.setup.settings import (
    DataSettings,
    LoopSettings,
    ModelSettings,
    PromptSettings,
    TimingSettings,
    TrackerSettings,
    UpdateSettings,
)

# Where the trained embedded model is exported (``--save-hf``'s default without
# ``--hf-checkpoint``), in the output folder.
EMBEDDED_EXPORT_DIR = "model"


def data_settings(args: argparse.Namespace) -> DataSettings:
    """What the model, its tools and the prompts load with (none of it resolved later)."""
    return DataSettings(model_settings(args), prompt_settings(args), agent_settings(args))


def model_settings(args: argparse.Namespace) -> ModelSettings:
    return ModelSettings(
        hf_checkpoint=args.hf_checkpoint,
        output_dir=args.output_dir,
        seed=args.seed,
        prompt_data=args.prompt_data,
    )


def prompt_settings(args: argparse.Namespace) -> PromptSettings:
    return PromptSettings(
        prompt_data=args.prompt_data,
        eval_prompt_data=args.eval_prompt_data,
        input_key=args.input_key,
        label_key=args.label_key,
        metadata_key=args.metadata_key,
        apply_chat_template=args.apply_chat_template,
        max_prompt_len=args.rollout_max_prompt_len,
        num_epoch=args.num_epoch,
        seed=args.seed,
        # A row without a label is refused where the reward reads it.
        require_label=reward_needs_label(reward_settings(args)),
    )


def resolve_run(args: Config, checkpoint: str, embedded: bool, source: PromptSource) -> Config:
    """``args`` with what is known once the model (``checkpoint``, the ``embedded`` one or
    not) and the prompts (``source``) have loaded, so every process sees the same values:
    the run's length (the LR schedule needs it; over-sampling draws more prompts a
    rollout, and the run is as long as the data feeds), the checkpoint the embedded
    default wrote, and where its trained model goes."""
    per_rollout = prompts_per_rollout(args.rollout_batch_size, args.over_sampling_factor)
    embedded_out = os.path.join(args.output_dir, EMBEDDED_EXPORT_DIR) if embedded else None
    return args.replace(
        hf_checkpoint=checkpoint,
        num_rollout=run_length(source, per_rollout, args.num_rollout),
        save_hf=args.save_hf or embedded_out,
    )


def loop_settings(args: argparse.Namespace) -> LoopSettings:
    """What the loop reads of the (resolved) flags."""
    updates = UpdateSettings(
        global_batch_size=args.global_batch_size,
        dp_size=args.data_parallel_size,
        micro_batch_size=args.micro_batch_size,
        max_tokens_per_gpu=args.max_tokens_per_gpu if args.use_dynamic_batch_size else None,
        shuffle_seed=args.seed if args.shuffle_updates else None,
    )
    # Every other field is the flag of its name.
    flags = {f.name: getattr(args, f.name) for f in fields(LoopSettings) if f.name != "updates"}
    return LoopSettings(updates=updates, **flags)


def timing_settings(args: argparse.Namespace) -> TimingSettings:
    return TimingSettings(output_dir=args.output_dir, profile_rollouts=tuple(args.profile_rollouts))


def tracker_settings(args: argparse.Namespace) -> TrackerSettings:
    """The tracker's settings; the (resolved) flags themselves, as ``config.json`` holds
    them."""
    return TrackerSettings(
        output_dir=args.output_dir,
        num_rollouts=args.num_rollout,
        use_tensorboard=args.use_tensorboard,
        use_wandb=args.use_wandb,
        wandb_project=args.wandb_project,
        flags=dict(vars(args)),
    )
