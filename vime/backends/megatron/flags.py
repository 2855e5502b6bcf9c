"""Flags of the ``megatron`` backend and their validation.

Where it fits: named by the registry, loaded by the CLI parser only when
``--train-backend megatron`` is selected (or to recognise a misplaced flag).
Argparse only: importing this module must not import torch or megatron-core.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vime.config.errors import ConfigError

RECOMPUTE_GRANULARITIES = ("none", "selective", "full")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the megatron group to ``parser``."""
    g = parser.add_argument_group("megatron backend", "megatron-core GPTModel")
    g.add_argument(
        "--megatron-tensor-parallel-size", type=int, default=1, help="tensor-parallel ranks"
    )
    g.add_argument(
        "--megatron-pipeline-parallel-size",
        type=int,
        default=1,
        help="pipeline-parallel stages: the layers are split evenly over them (1F1B schedule)",
    )
    g.add_argument(
        "--megatron-sequence-parallel",
        action="store_true",
        help="shard activations along the sequence in tensor-parallel regions",
    )
    g.add_argument(
        "--megatron-use-distributed-optimizer",
        action="store_true",
        help="shard the AdamW state over data-parallel ranks: each updates its share of "
        "the parameters and broadcasts it (no effect with one replica)",
    )
    g.add_argument(
        "--megatron-param-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="weights and compute; bfloat16 keeps fp32 main weights and gradient sums for "
        "the optimizer (auto: bfloat16 on GPU, float32 on CPU)",
    )
    g.add_argument(
        "--megatron-recompute-granularity",
        choices=RECOMPUTE_GRANULARITIES,
        default="none",
        help="activation recomputation: selective = core attention, full = every layer",
    )


def validate(args: argparse.Namespace) -> int:
    """Check the megatron flags; return the data-parallel size world / (TP x PP)."""
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    tp = args.megatron_tensor_parallel_size
    pp = args.megatron_pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ConfigError(
            "--megatron-tensor-parallel-size and --megatron-pipeline-parallel-size must be >= 1"
        )
    if world % (tp * pp) != 0:
        raise ConfigError(
            f"tensor-parallel {tp} x pipeline-parallel {pp} = {tp * pp} does not divide the "
            f"{world} training ranks (--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    if args.megatron_sequence_parallel and tp == 1:
        raise ConfigError("--megatron-sequence-parallel needs --megatron-tensor-parallel-size > 1")
    _check_layers(args, pp)
    return world // (tp * pp)


def _check_layers(args: argparse.Namespace, pp: int) -> None:
    """Pipeline stages take equal runs of layers: P must divide the model's layer count,
    read from the checkpoint's ``config.json`` (plain JSON, so parsing stays light)."""
    if pp == 1 or not args.hf_checkpoint:
        return
    config = Path(args.hf_checkpoint) / "config.json"
    try:
        layers = int(json.loads(config.read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # the model's own loader reports an unreadable config
    if layers % pp:
        raise ConfigError(
            f"--megatron-pipeline-parallel-size {pp} does not divide the {layers} layers of "
            f"{args.hf_checkpoint}; pick a divisor of {layers}"
        )
