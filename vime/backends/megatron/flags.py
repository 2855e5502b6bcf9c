"""Flags of the ``megatron`` backend, their validation, and the settings they make.

Where it fits: named by the registry, loaded by the CLI parser only when
``--train-backend megatron`` is selected (or to recognise a misplaced flag).
``settings`` turns the flags into the frozen ``MegatronSettings`` that
``vime.config.train_settings`` hands the training ranks (``MegatronBackend.setup``).
Argparse, stdlib and the light ``vime.models.embedded`` only: importing this
module must not import torch or megatron-core (validating ``--megatron-transformer-impl
transformer_engine``, and only that, asks torch whether CUDA is there). The
architecture rules (``check_architecture``) live here, not in ``convert``, so that
one function judges the checkpoint's config.json while the flags are parsed and
the transformers config again when the actor converts it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vime.config.validate import joins_cluster
from vime.errors import ConfigError
from vime.models.embedded import architecture_fields

# Where a parse-time error says the model came from when no --hf-checkpoint is given.
EMBEDDED_MODEL = "the embedded default model (no --hf-checkpoint)"

RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
# Which layers megatron-core builds (``model.build_gpt_model``): its local ones (torch
# only, vime's packed attention) or TransformerEngine's fused ones.
TRANSFORMER_IMPLS = ("local", "transformer_engine")
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
# The only llama3 RoPE scaling megatron-core's RotaryEmbedding reproduces: it fixes these
# three (RotaryEmbedding._apply_scaling) and takes only the factor as a parameter.
LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


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
        help="megatron-core's DDP wrapper and DistributedOptimizer: gradients "
        "reduce-scattered (overlapping the step's last backward), fp32 main weights and "
        "AdamW state sharded over the data-parallel ranks, updated weights all-gathered "
        "(checkpoints resume at another DP size only)",
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
    g.add_argument(
        "--megatron-transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default="local",
        help="layers: local = megatron-core's own (torch; vime's per-sample attention over "
        "packed rows); transformer_engine = TransformerEngine's fused norm+linear layers "
        "and its THD attention (needs CUDA and the transformer_engine package)",
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
    # On a Ray cluster the training ranks' machines decide, and the actor names what lacks.
    if args.megatron_transformer_impl == "transformer_engine" and not joins_cluster(args):
        missing = transformer_engine_missing()
        if missing:
            raise ConfigError(
                f"--megatron-transformer-impl transformer_engine needs {missing}; "
                "use --megatron-transformer-impl local"
            )
    hf_config = _read_hf_config(args.hf_checkpoint)
    model = args.hf_checkpoint or EMBEDDED_MODEL
    _check_architecture(model, hf_config, tp)
    first = args.megatron_decoder_first_pipeline_num_layers
    last = args.megatron_decoder_last_pipeline_num_layers
    _check_layers(model, hf_config, pp, first, last)
    return world // (tp * pp)


@dataclass(frozen=True)
class MegatronSettings:
    """The megatron flags, as ``MegatronBackend`` reads them (``param_dtype`` by name,
    resolved on the rank's device)."""

    tp: int
    pp: int
    first_stage_layers: int | None  # --megatron-decoder-first-pipeline-num-layers
    last_stage_layers: int | None
    sequence_parallel: bool
    distributed_optimizer: bool
    param_dtype: str
    recompute_granularity: str
    transformer_impl: str


def settings(args: argparse.Namespace) -> MegatronSettings:
    """The validated megatron flags of ``args`` as ``MegatronSettings``."""
    return MegatronSettings(
        tp=args.megatron_tensor_parallel_size,
        pp=args.megatron_pipeline_parallel_size,
        first_stage_layers=args.megatron_decoder_first_pipeline_num_layers,
        last_stage_layers=args.megatron_decoder_last_pipeline_num_layers,
        sequence_parallel=args.megatron_sequence_parallel,
        distributed_optimizer=args.megatron_use_distributed_optimizer,
        param_dtype=args.megatron_param_dtype,
        recompute_granularity=args.megatron_recompute_granularity,
        transformer_impl=args.megatron_transformer_impl,
    )


def transformer_engine_missing() -> str | None:
    """What this machine lacks for TransformerEngine's layers -- CUDA and an importable
    ``transformer_engine`` -- in words, or None when it has both.

    The package is looked up, not imported (importing TE is slow and needs CUDA
    libraries); torch is imported only here, when TE is asked for, to ask for CUDA.
    """
    missing = []
    try:
        have_te = importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        have_te = False
    if not have_te:
        missing.append("the transformer_engine package (not installed here)")
    from vime import device  # imports torch: only paid when TE is asked for

    if not device.cuda_available():
        missing.append("a CUDA GPU (none is visible here)")
    return " and ".join(missing) or None


@dataclass(frozen=True)
class Rope:
    """The RoPE settings megatron-core's ``GPTModel`` takes, as ``check_architecture`` read them."""

    base: float
    scaling: bool
    factor: float


def num_kv_heads(hf_config: Any) -> int:
    kv = getattr(hf_config, "num_key_value_heads", None)
    return int(kv) if kv else int(hf_config.num_attention_heads)


def _rope(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(base, scaling parameters) from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` / ``rope_scaling`` attributes."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
        base = params.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return float(base), params
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    return float(getattr(hf_config, "rope_theta", 10000.0)), scaling


def _reject(hf_config: Any, reason: str) -> None:
    raise ValueError(f"megatron backend: unsupported {hf_config.model_type!r} model: {reason}")


def _sliding_window(hf_config: Any) -> str | None:
    """Why the model has sliding-window layers, or None. transformers lists each layer's
    attention kind in ``layer_types``; a raw config.json of an older Qwen2 has only the
    flag, which transformers turns into sliding layers from ``max_window_layers`` on."""
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        if any(t != "full_attention" for t in layer_types):
            return f"sliding-window layers {sorted(set(layer_types))}"
        return None
    if not getattr(hf_config, "use_sliding_window", False):
        return None
    first = getattr(hf_config, "max_window_layers", 0)
    layers = getattr(hf_config, "num_hidden_layers", first + 1)
    if getattr(hf_config, "sliding_window", None) is None or first >= layers:
        return None
    return "sliding-window attention (use_sliding_window=True)"


def check_architecture(hf_config: Any, tp: int = 1) -> Rope:
    """Check ``hf_config`` is an architecture the megatron backend reproduces exactly,
    split over ``tp`` tensor-parallel ranks; return its RoPE settings.

    ``hf_config`` is a transformers config, or (at parse time) the attributes of a raw
    config.json: both answer ``getattr`` alike. Pure: no torch, no megatron. Raises
    ``ValueError`` naming the first unsupported feature.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"megatron backend: unsupported model_type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (--train-backend fsdp2 trains "
            "other HF causal LMs)"
        )
    if getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None):
        _reject(hf_config, "mixture-of-experts layers")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        _reject(hf_config, f"hidden_act {hf_config.hidden_act!r} (only SwiGLU with silu)")
    sliding = _sliding_window(hf_config)
    if sliding is not None:
        _reject(hf_config, sliding)
    # Qwen2 always has q/k/v biases and nothing else; Qwen3 and Llama put attention_bias
    # on o_proj as well, which megatron can only express as a bias on every linear layer.
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        _reject(hf_config, "attention_bias=True (o_proj bias)")
    if getattr(hf_config, "mlp_bias", False):
        _reject(hf_config, "mlp_bias=True")
    if getattr(hf_config, "partial_rotary_factor", 1.0) != 1.0:
        _reject(hf_config, "partial rotary embeddings (partial_rotary_factor != 1)")
    rope = _check_rope(hf_config)
    _check_heads(hf_config, tp)
    return rope


def _check_rope(hf_config: Any) -> Rope:
    """The RoPE settings, if megatron-core's RoPE computes them: default or llama3."""
    base, scaling = _rope(hf_config)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    rope_scaling, factor = False, 8.0
    if rope_type == "llama3":
        fixed = {k: scaling.get(k) for k in LLAMA3_ROPE_FIXED}
        if any(
            fixed[k] is None or not math.isclose(float(fixed[k]), v)
            for k, v in LLAMA3_ROPE_FIXED.items()
        ):
            _reject(
                hf_config, f"llama3 rope scaling {fixed} (megatron-core fixes {LLAMA3_ROPE_FIXED})"
            )
        rope_scaling, factor = True, float(scaling["factor"])
    elif rope_type != "default":
        _reject(hf_config, f"rope scaling type {rope_type!r} (only default and llama3)")
    return Rope(base, rope_scaling, factor)


def _check_heads(hf_config: Any, tp: int) -> None:
    """The attention heads group evenly, and ``tp`` divides the KV heads and the MLP."""
    heads, kv_heads = int(hf_config.num_attention_heads), num_kv_heads(hf_config)
    if heads % kv_heads:
        _reject(hf_config, f"{heads} attention heads not divisible by {kv_heads} KV heads")
    if tp < 1 or kv_heads % tp:
        _reject(
            hf_config,
            f"tensor-parallel size {tp} (--megatron-tensor-parallel-size) must divide the "
            f"{kv_heads} KV heads (and so the {heads} query heads)",
        )
    if int(hf_config.intermediate_size) % tp:
        _reject(
            hf_config,
            f"tensor-parallel size {tp} (--megatron-tensor-parallel-size) must divide "
            f"intermediate_size {hf_config.intermediate_size}",
        )


def _read_hf_config(hf_checkpoint: str | None) -> dict[str, Any] | None:
    """The checkpoint's config.json as a dict (plain JSON, so parsing stays light); None
    when it cannot be read -- the model loader reports that. Without a checkpoint the run
    trains the embedded default, so its fields are judged instead."""
    if not hf_checkpoint:
        return architecture_fields()
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((Path(hf_checkpoint) / "config.json").read_text())
        if isinstance(config, dict):
            return config
    return None


def _check_architecture(model: str, config: dict[str, Any] | None, tp: int) -> None:
    """``check_architecture`` on the raw config.json (or the embedded default's fields)
    of ``model`` (its name in the error), so an unsupported model or a TP size that does
    not split it stops the run before any process starts."""
    # Without model_type the file is no HF config at all: the model loader says so.
    if config is None or "model_type" not in config:
        return
    try:
        check_architecture(SimpleNamespace(**config), tp)
    except ValueError as err:
        raise ConfigError(f"{model}: {err}") from None
    except (AttributeError, TypeError):
        return  # a field the rules need is missing or malformed: the loader's to report


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


def _check_layers(
    model: str, config: dict[str, Any] | None, pp: int, first: int | None, last: int | None
) -> None:
    """The layers must split over the ``pp`` pipeline stages, ``first`` and ``last`` on
    the end stages when given (``stage_layer_counts``); the layer count is read from
    ``model``'s ``config.json`` (or the embedded default's)."""
    if pp == 1 and first is None and last is None:
        return
    layers = None
    if config is not None:
        # An unusable layer count is the model loader's to report.
        with contextlib.suppress(KeyError, TypeError, ValueError):
            layers = int(config["num_hidden_layers"])
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
        where = "" if args_only else f"{model}: "
        raise ConfigError(f"{where}{err}") from None
