"""Architecture flags (``MODEL_ARGS``) checked against the checkpoint's ``config.json``.

Where it fits: called from ``vime.config.validate`` while flags are parsed. Both
backends build the model from ``--hf-checkpoint``'s config.json, so the
Megatron-style architecture flags that ``scripts/models/*.sh`` set are never a
second source of truth: they are a statement about the checkpoint, and a run
whose statement is wrong (a 1.7B recipe pointed at a 0.6B folder) stops here,
with one line naming the flag and both values, rather than training something
else or failing deep inside model construction.

``ARCH_FLAGS`` maps each flag's argparse dest to how an HF config dict states
it. Only flags the user gave (not None) are checked; a field the config does
not state is not checked either, since the model will be built with the
library's default for it. Stdlib only: parsing must not import torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vime.errors import ConfigError

# Model types whose attention normalises q and k per head before RoPE (Megatron's
# qk_layernorm). Other families with a "q_norm" (OLMo 2) normalise the whole projection,
# which is a different layer, so they are deliberately not listed.
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})

# A config's rope theta may be stored as 1000000 or 1e6 or 999999.99..., all meaning
# the same model; a genuine mismatch differs by orders of magnitude.
FLOAT_REL_TOL = 1e-6


@dataclass(frozen=True)
class Stated:
    """What config.json says about one flag: the value to compare, and how to report it."""

    value: Any  # in the flag's terms (e.g. untied = not tie_word_embeddings)
    where: str  # the config.json field(s) it came from
    shown: str  # that field's value as config.json spells it


@dataclass(frozen=True)
class ArchField:
    """One architecture flag and how to read the same quantity from an HF config dict."""

    flag: str
    read: Callable[[Mapping[str, Any]], Stated | None]
    # Why a boolean flag's config value means false, for the error line.
    hint: str = ""


def _plain(value: Any, where: str) -> Stated:
    return Stated(value, where, json.dumps(value))


def _key(name: str) -> Callable[[Mapping[str, Any]], Stated | None]:
    def read(config: Mapping[str, Any]) -> Stated | None:
        value = config.get(name)
        return None if value is None else _plain(value, name)

    return read


def _query_groups(config: Mapping[str, Any]) -> Stated | None:
    if config.get("num_key_value_heads") is not None:
        return _plain(config["num_key_value_heads"], "num_key_value_heads")
    # Without the key, HF models use multi-head attention: one group per head.
    if config.get("num_attention_heads") is not None:
        return _plain(config["num_attention_heads"], "num_attention_heads (no num_key_value_heads)")
    return None


def _head_dim(config: Mapping[str, Any]) -> Stated | None:
    if config.get("head_dim") is not None:
        return _plain(config["head_dim"], "head_dim")
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return _plain(hidden // heads, "hidden_size / num_attention_heads (no head_dim)")
    return None


def _rope_theta(config: Mapping[str, Any]) -> Stated | None:
    if config.get("rope_theta") is not None:
        return _plain(config["rope_theta"], "rope_theta")
    # Newer transformers write rope settings as one dict (rope_parameters); some
    # configs put the theta inside rope_scaling. Per-layer-type nested dicts are not
    # a single theta, so they are left unchecked.
    for holder in ("rope_parameters", "rope_scaling"):
        params = config.get(holder)
        if isinstance(params, Mapping) and params.get("rope_theta") is not None:
            return _plain(params["rope_theta"], f"{holder}.rope_theta")
    return None


def _qk_layernorm(config: Mapping[str, Any]) -> Stated | None:
    model_type = config.get("model_type")
    if model_type is None:
        return None
    return Stated(model_type in QK_NORM_MODEL_TYPES, "model_type", json.dumps(model_type))


def _untied(config: Mapping[str, Any]) -> Stated | None:
    tied = config.get("tie_word_embeddings")
    # The default differs by model class, so a config that omits it is not checked.
    return None if tied is None else Stated(not tied, "tie_word_embeddings", json.dumps(tied))


ARCH_FLAGS: dict[str, ArchField] = {
    "num_layers": ArchField("--num-layers", _key("num_hidden_layers")),
    "hidden_size": ArchField("--hidden-size", _key("hidden_size")),
    "ffn_hidden_size": ArchField("--ffn-hidden-size", _key("intermediate_size")),
    "num_attention_heads": ArchField("--num-attention-heads", _key("num_attention_heads")),
    "num_query_groups": ArchField("--num-query-groups", _query_groups),
    "kv_channels": ArchField("--kv-channels", _head_dim),
    "vocab_size": ArchField("--vocab-size", _key("vocab_size")),
    "rotary_base": ArchField("--rotary-base", _rope_theta),
    "norm_epsilon": ArchField("--norm-epsilon", _key("rms_norm_eps")),
    "qk_layernorm": ArchField(
        "--qk-layernorm",
        _qk_layernorm,
        hint=f"QK layernorm is only in {', '.join(sorted(QK_NORM_MODEL_TYPES))}",
    ),
    "untie_embeddings_and_output_weights": ArchField(
        "--untie-embeddings-and-output-weights",
        _untied,
        hint="the output layer shares the embedding weights",
    ),
}


def _same(flag_value: Any, config_value: Any) -> bool:
    if isinstance(flag_value, bool) or isinstance(config_value, bool):
        return bool(flag_value) == bool(config_value)
    if isinstance(flag_value, int | float) and isinstance(config_value, int | float):
        if isinstance(flag_value, float) or isinstance(config_value, float):
            return math.isclose(flag_value, config_value, rel_tol=FLOAT_REL_TOL)
        return flag_value == config_value
    return flag_value == config_value


def _show_flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "(set)"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))  # --rotary-base 1000000, as the user typed it
    return str(value)


def _mismatch_line(field: ArchField, flag_value: Any, stated: Stated) -> str:
    hint = f"; {field.hint}" if field.hint and not stated.value else ""
    given = f"{field.flag} {_show_flag_value(flag_value)}"
    if flag_value is False:  # the --no- form of a boolean flag
        given = f"--no-{field.flag.removeprefix('--')}"
    return (
        f"{given} does not match the checkpoint (config.json {stated.where} = {stated.shown}{hint})"
    )


def given_arch_flags(args: argparse.Namespace) -> list[str]:
    """The dests of the architecture flags set on the command line."""
    return [dest for dest in ARCH_FLAGS if getattr(args, dest, None) is not None]


def check_model_args(args: argparse.Namespace, config: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` if a given architecture flag disagrees with ``config``.

    ``config`` is an HF config.json as a dict. The message names the first
    disagreeing flag with both values, and the other disagreeing flags by name.
    """
    problems: list[str] = []
    flags: list[str] = []
    for dest in given_arch_flags(args):
        field = ARCH_FLAGS[dest]
        stated = field.read(config)
        flag_value = getattr(args, dest)
        if stated is not None and not _same(flag_value, stated.value):
            problems.append(_mismatch_line(field, flag_value, stated))
            flags.append(field.flag)
    if not problems:
        return
    more = f" (also {', '.join(flags[1:])})" if len(flags) > 1 else ""
    raise ConfigError(problems[0] + more)


def check_model_args_against_checkpoint(args: argparse.Namespace) -> None:
    """Check the given architecture flags against ``--hf-checkpoint``/config.json.

    No architecture flag: nothing to do. Architecture flags without
    ``--hf-checkpoint`` are an error: they describe a checkpoint, and the
    embedded default model is not one they could describe.
    """
    given = given_arch_flags(args)
    if not given:
        return
    if args.hf_checkpoint is None:
        names = ", ".join(ARCH_FLAGS[dest].flag for dest in given[:3])
        etc = ", ..." if len(given) > 3 else ""
        raise ConfigError(
            f"architecture flags ({names}{etc}) describe --hf-checkpoint; pass it or drop them"
        )
    path = os.path.join(args.hf_checkpoint, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"--hf-checkpoint {args.hf_checkpoint} has no config.json (give an HF model folder)"
        ) from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot read it as JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    check_model_args(args, config)
