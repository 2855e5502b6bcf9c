"""The rollout engines' own flag checks, run while parsing.

Where it fits: ``vime.rollout.engines.registry`` names these functions in each engine's
``EngineSpec`` (``validate``); ``vime.config.validate`` runs them. The flags
themselves are added by ``vime.rollout.engines.flags``. Argparse only: no torch, no
engine library.
"""

from __future__ import annotations

import argparse

from vime.errors import ConfigError
from vime.rollout.engines.flags import (
    VLLM_COLOCATED_GPU_MEMORY_SHARE,
    VLLM_GPU_MEMORY_SHARE,
    VLLM_LORA_RANKS,
)


def validate_vllm_flags(args: argparse.Namespace) -> None:
    """Check vLLM's flags and fill in their defaults (``ConfigError``, one line)."""
    share = args.rollout_gpu_memory_utilization
    if share is None:
        # A colocated engine shares its GPU with a training rank that is awake (weights,
        # optimizer state) when vLLM starts and checks that this share is free.
        colocated = VLLM_COLOCATED_GPU_MEMORY_SHARE
        args.rollout_gpu_memory_utilization = colocated if args.colocate else VLLM_GPU_MEMORY_SHARE
    elif not 0 < share <= 1:
        raise ConfigError(f"--rollout-gpu-memory-utilization must be in (0, 1], got {share}")
    _check_vllm_lora(args)


def _check_vllm_lora(args: argparse.Namespace) -> None:
    if args.vllm_lora == "auto":
        return
    if not args.lora_rank:
        raise ConfigError("--vllm-lora needs --lora-rank R (LoRA is off)")
    if args.vllm_lora == "off":
        return
    if args.rollout_engine == "hf":
        raise ConfigError("--vllm-lora on needs --rollout-engine vllm (or auto), not hf")
    if args.lora_rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(
            f"--vllm-lora on: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not "
            f"{args.lora_rank}; use --vllm-lora off"
        )
    # What makes every sync merged weights, or sends modules an adapter cannot carry.
    blocker = next(
        (
            flag
            for flag, given in (
                ("--lora-merge-on-sync", args.lora_merge_on_sync),
                ("--weight-sync disk", args.weight_sync == "disk"),
                ("--lora-modules-to-save", bool(args.lora_modules_to_save)),
            )
            if given
        ),
        None,
    )
    if blocker is not None:
        raise ConfigError(
            f"--vllm-lora on: vLLM's LoRA serves adapters alone, and {blocker} sends the "
            "engines whole weights; drop one of the two"
        )
