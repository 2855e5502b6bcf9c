"""Placement rules of the fsdp2 backend that need no process group.

Proves that decoder blocks are found from ``_no_split_modules`` or named
explicitly, that a model with no recognisable block fails instead of silently
training unsharded, and that the root-group check names a trainable parameter
left outside every ``fully_shard`` group in a multi-rank run; and that ``auto``
attention is vime's per-sample ``varlen_sdpa`` without flash-attention (registered
with transformers, so a model builds with it), ``sdpa`` for a model with
sliding-window layers, and an explicit choice is kept.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3_config
from transformers import Qwen2Config, Qwen3ForCausalLM

from vime.backends.fsdp2.model import (
    check_every_parameter_sharded,
    find_block_classes,
    resolve_attn_implementation,
)


def _tiny() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(tiny_qwen3_config())


def test_blocks_found_from_no_split_modules() -> None:
    assert [c.__name__ for c in find_block_classes(_tiny(), None)] == ["Qwen3DecoderLayer"]


def test_blocks_named_explicitly() -> None:
    assert [c.__name__ for c in find_block_classes(_tiny(), "Qwen3MLP")] == ["Qwen3MLP"]


def test_no_block_class_fails() -> None:
    with pytest.raises(ValueError, match="--fsdp-block-classes"):
        find_block_classes(torch.nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match="NoSuchBlock"):
        find_block_classes(_tiny(), "NoSuchBlock")


def test_parameter_outside_every_group_fails_fast() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"parameter weight is outside every fully_shard"):
        check_every_parameter_sharded(model, world=2)
    check_every_parameter_sharded(model, world=1)  # one rank: nothing to reduce


def test_auto_attention_without_flash_attention() -> None:
    cpu, fp32 = torch.device("cpu"), torch.float32
    name = resolve_attn_implementation("auto", cpu, fp32, tiny_qwen3_config())
    assert name == "varlen_sdpa"
    model = Qwen3ForCausalLM._from_config(tiny_qwen3_config(), attn_implementation=name)
    assert model.config._attn_implementation == "varlen_sdpa"
    sliding = Qwen2Config(
        use_sliding_window=True, sliding_window=16, max_window_layers=1, num_hidden_layers=2
    )
    assert "sliding_attention" in sliding.layer_types
    assert resolve_attn_implementation("auto", cpu, fp32, sliding) == "sdpa"
    assert resolve_attn_implementation("sdpa", cpu, fp32, tiny_qwen3_config()) == "sdpa"
