"""Flags of the ``fsdp2`` backend, their validation, and the settings they make.

Where it fits: named by the registry, loaded by the CLI parser only when
``--train-backend fsdp2`` is selected (or to recognise a misplaced fsdp2 flag).
``settings`` turns the flags into the frozen ``Fsdp2Settings`` that
``vime.config.train_settings`` hands the training ranks (``FSDP2Backend.setup``).
Argparse only: importing this module must not import torch.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from vime.config.validate import joins_cluster
from vime.errors import ConfigError

# No float16: it needs loss scaling, which vime does not do; bf16 is the only half dtype
# vime trains in (the megatron backend offers the same choices).
DTYPES = ("auto", "float32", "bfloat16")
FSDP_MODES = ("full", "hybrid", "no_shard")
ATTN_IMPLEMENTATIONS = ("auto", "varlen_sdpa", "sdpa", "eager", "flash_attention_2")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the fsdp2 group to ``parser``."""
    g = parser.add_argument_group("fsdp2 backend", "HF transformers + torch fully_shard")
    g.add_argument(
        "--fsdp-param-dtype",
        type=_dtype("--fsdp-param-dtype"),
        choices=DTYPES,
        default="auto",
        help="compute dtype of the sharded parameters (auto: bfloat16 on GPU, float32 on CPU); "
        "optimizer master weights stay float32",
    )
    g.add_argument(
        "--fsdp-reduce-dtype",
        type=_dtype("--fsdp-reduce-dtype"),
        choices=DTYPES,
        default="float32",
        help="dtype of the gradient reduce-scatter (one rank: no reduction, gradients fp32)",
    )
    g.add_argument(
        "--fsdp-mode",
        choices=FSDP_MODES,
        default="full",
        help="full: shard over all ranks; hybrid: shard within --fsdp-shard-size ranks and "
        "replicate across groups; no_shard: replicate (DDP-like)",
    )
    g.add_argument(
        "--fsdp-shard-size", type=int, default=None, help="ranks per shard group (hybrid mode)"
    )
    g.add_argument(
        "--fsdp-reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="free gathered parameters after each block's forward (but the last block's, "
        "which backward needs first)",
    )
    g.add_argument(
        "--fsdp-cpu-offload",
        action="store_true",
        help="keep shards and optimizer on the host (FSDP2's offload: one rank keeps "
        "fully_shard for it)",
    )
    g.add_argument(
        "--fsdp-block-classes",
        default=None,
        metavar="NAME[,NAME]",
        help="decoder block classes to shard (default: the model's _no_split_modules)",
    )
    g.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in backward"
    )
    g.add_argument(
        "--attn-implementation",
        choices=ATTN_IMPLEMENTATIONS,
        default="auto",
        help="auto: varlen_sdpa, attention per packed sample (a varlen flash kernel on GPU "
        "in 16 bits, torch sdpa otherwise); for sliding-window models flash_attention_2 on "
        "GPU when installed, else sdpa: over the whole row under a block mask",
    )


def _dtype(flag: str) -> Callable[[str], str]:
    """A dtype flag's value as given; ``float16`` refused with the reason, not argparse's
    bare "invalid choice" (the choices themselves are checked after this)."""

    def parse(text: str) -> str:
        if text == "float16":
            raise argparse.ArgumentTypeError(
                "float16 is not supported: fp16 training needs loss scaling, which vime does "
                f"not do; bfloat16 is the only half dtype vime trains in (use {flag} bfloat16)"
            )
        return text

    return parse


def validate(args: argparse.Namespace) -> int:
    """Check the fsdp2 flags; return the data-parallel size (every rank holds a data shard)."""
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.fsdp_mode == "hybrid":
        shard = args.fsdp_shard_size
        if shard is None:
            raise ConfigError("--fsdp-mode hybrid needs --fsdp-shard-size (ranks per shard group)")
        if shard <= 0 or world % shard != 0 or world // shard < 2:
            raise ConfigError(
                f"--fsdp-shard-size {shard} must divide the {world} training ranks into at "
                "least 2 groups; use --fsdp-mode full for a single group"
            )
    elif args.fsdp_shard_size is not None:
        raise ConfigError("--fsdp-shard-size only applies with --fsdp-mode hybrid")
    # Only the cheap half of transformers' own check: whether a GPU can run it needs torch.
    # On a Ray cluster the training ranks' machines are the ones that need it.
    flash = args.attn_implementation == "flash_attention_2" and not joins_cluster(args)
    if flash and not _importable("flash_attn"):
        raise ConfigError(
            "--attn-implementation flash_attention_2 needs the flash-attn package, which is "
            "not installed here; install it or use --attn-implementation auto"
        )
    return world


@dataclass(frozen=True)
class Fsdp2Settings:
    """The fsdp2 flags, as ``FSDP2Backend`` reads them (dtypes by name, resolved on the rank's
    device)."""

    param_dtype: str
    reduce_dtype: str
    mode: str
    shard_size: int | None
    reshard_after_forward: bool
    cpu_offload: bool
    block_classes: str | None
    gradient_checkpointing: bool
    attn_implementation: str


def settings(args: argparse.Namespace) -> Fsdp2Settings:
    """The validated fsdp2 flags of ``args`` as ``Fsdp2Settings``."""
    return Fsdp2Settings(
        param_dtype=args.fsdp_param_dtype,
        reduce_dtype=args.fsdp_reduce_dtype,
        mode=args.fsdp_mode,
        shard_size=args.fsdp_shard_size,
        reshard_after_forward=args.fsdp_reshard_after_forward,
        cpu_offload=args.fsdp_cpu_offload,
        block_classes=args.fsdp_block_classes,
        gradient_checkpointing=args.gradient_checkpointing,
        attn_implementation=args.attn_implementation,
    )


def _importable(module: str) -> bool:
    """Whether ``module`` could be imported, without importing it (or anything heavy)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
