"""The ``--lora-*`` flags and their checks.

Where it fits: ``vime.config.flags`` adds this group to every parser;
``vime.config.validate`` calls ``check_lora``. The settings the trainer and the
engines use are built from these flags once (``vime.weights.lora.LoraSettings``).
A backend trains adapters only where the registry says it can
(``BackendSpec.lora``). Argparse only: no torch import.
"""

from __future__ import annotations

import argparse

from vime.backends import registry
from vime.errors import ConfigError

# The flags' defaults, which vime.weights.lora.LoraSettings reads too (LoraSettings() is
# LoRA off). Every linear projection of a decoder block, as the HF families vime runs
# name them:
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_ALPHA = 32.0
DEFAULT_DROPOUT = 0.0
DEFAULT_RANK = 0  # off
DEFAULT_MODULES_TO_SAVE: tuple[str, ...] = ()


def module_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("name at least one module, e.g. q_proj,v_proj")
    return names


def add_lora_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--lora-rank",
        type=int,
        default=DEFAULT_RANK,
        metavar="R",
        help="train rank-R adapters on the frozen model instead of every weight (0: off); "
        "the KL reference is then the model with its adapters off",
    )
    p.add_argument(
        "--lora-alpha",
        type=float,
        default=DEFAULT_ALPHA,
        help="the adapters' output is scaled by alpha / R",
    )
    p.add_argument(
        "--lora-dropout",
        type=float,
        default=DEFAULT_DROPOUT,
        help="dropout on the adapters' input in the update's forward (not in log-prob passes)",
    )
    p.add_argument(
        "--lora-target-modules",
        type=module_names,
        default=DEFAULT_TARGETS,
        metavar="NAMES",
        help="comma-separated names of the linear layers that get adapters "
        f"(default: {','.join(DEFAULT_TARGETS)})",
    )
    p.add_argument(
        "--lora-modules-to-save",
        type=module_names,
        default=DEFAULT_MODULES_TO_SAVE,
        metavar="NAMES",
        help="comma-separated modules trained in full beside the adapters (peft's "
        "modules_to_save: every module whose name ends so, e.g. norm for all the norms); "
        "the reference keeps their original weights, and every sync sends them",
    )
    p.add_argument(
        "--lora-merge-on-sync",
        action="store_true",
        help="send the engines the merged weights at every sync, instead of the base once "
        "and then the adapters alone",
    )


def check_lora(args: argparse.Namespace) -> None:
    """One line for a LoRA setting the run cannot honour."""
    if args.lora_rank < 0:
        raise ConfigError(f"--lora-rank must be >= 0 (0: off), got {args.lora_rank}")
    if not args.lora_rank:
        given = [
            flag
            for flag, value, default in (
                ("--lora-alpha", args.lora_alpha, DEFAULT_ALPHA),
                ("--lora-dropout", args.lora_dropout, DEFAULT_DROPOUT),
                ("--lora-target-modules", args.lora_target_modules, DEFAULT_TARGETS),
                (
                    "--lora-modules-to-save",
                    tuple(args.lora_modules_to_save),
                    DEFAULT_MODULES_TO_SAVE,
                ),
                ("--lora-merge-on-sync", args.lora_merge_on_sync, False),
            )
            if value != default
        ]
        if given:
            raise ConfigError(f"{given[0]} needs --lora-rank R (LoRA is off)")
        return
    spec = registry.get_backend(args.train_backend)
    if not spec.lora:
        raise ConfigError(
            f"--lora-rank: the {spec.name} backend does not train LoRA adapters; use "
            "--train-backend fsdp2"
        )
    if not args.lora_alpha > 0:
        raise ConfigError(f"--lora-alpha must be > 0, got {args.lora_alpha}")
    if not 0 <= args.lora_dropout < 1:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
