"""Flags of the ``megatron`` backend and their validation.

Where it fits: named by the registry, loaded by the CLI parser only when
``--train-backend megatron`` is selected (or to recognise a misplaced flag).
Argparse only: importing this module must not import torch or megatron-core.
"""

from __future__ import annotations

import argparse
import contextlib
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
        help="pipeline-parallel stages (1F1B schedule): the layers are split evenly over them "
        "unless the end stages get their own counts (below)",
    )
    g.add_argument(
        "--megatron-decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="layers on the first pipeline stage (it also holds the embeddings); the "
        "stages without a fixed count split the rest evenly",
    )
    g.add_argument(
        "--megatron-decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="layers on the last pipeline stage (it also holds the output layer and loss)",
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


def stage_layer_counts(
    num_layers: int, stages: int, first: int | None = None, last: int | None = None
) -> tuple[int, ...]:
    """Decoder layers per pipeline stage: ``first`` / ``last`` on the end stages when
    given, the rest split evenly over the others (megatron-core's uneven rule,
    ``transformer_block.get_num_layers_to_build``). Every stage gets at least one.

    Raises ``ValueError`` with the fix when the split is impossible.
    """
    fixed = {"--megatron-decoder-first-pipeline-num-layers": first}
    fixed["--megatron-decoder-last-pipeline-num-layers"] = last
    given = {flag: n for flag, n in fixed.items() if n is not None}
    for flag, n in given.items():
        if stages == 1:
            raise ValueError(f"{flag} needs --megatron-pipeline-parallel-size > 1")
        if n < 1:
            raise ValueError(f"{flag} must be >= 1, got {n}")
    free = stages - len(given)
    rest = num_layers - sum(given.values())
    if free == 0 and rest != 0:
        raise ValueError(
            f"the first and last stages' {num_layers - rest} layers must add up to the "
            f"model's {num_layers}"
        )
    if free and (rest < free or rest % free):
        split = f"{rest} layers left" if given else f"the model's {num_layers} layers"
        raise ValueError(
            f"{split} do not split evenly over {free} pipeline stage(s) "
            "(--megatron-pipeline-parallel-size, --megatron-decoder-first/last-pipeline-"
            "num-layers)"
        )
    each = rest // free if free else 0
    counts = [each] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def _check_layers(args: argparse.Namespace, pp: int) -> None:
    """The layers must split over the pipeline stages (``stage_layer_counts``); the
    layer count is read from the checkpoint's ``config.json`` (plain JSON, so parsing
    stays light)."""
    first = args.megatron_decoder_first_pipeline_num_layers
    last = args.megatron_decoder_last_pipeline_num_layers
    if pp == 1 and first is None and last is None:
        return
    layers = None
    if args.hf_checkpoint:
        config = Path(args.hf_checkpoint) / "config.json"
        # An unreadable config is the model loader's to report.
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            layers = int(json.loads(config.read_text())["num_hidden_layers"])
    if layers is None:
        # Unknown model size: check the flags alone, against a model they split exactly
        # (one layer on each stage without a fixed count).
        fixed = [n for n in (first, last) if n is not None]
        layers = sum(fixed) + max(pp - len(fixed), 0)
        args_only = True
    else:
        args_only = False
    try:
        stage_layer_counts(layers, pp, first, last)
    except ValueError as err:
        where = "" if args_only else f"{args.hf_checkpoint}: "
        raise ConfigError(f"{where}{err}") from None
