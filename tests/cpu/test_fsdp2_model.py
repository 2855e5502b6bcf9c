"""Placement rules of the fsdp2 backend (one test on a real 2-rank gloo group).

Proves that decoder blocks are found from ``_no_split_modules`` or named
explicitly, that a model with no recognisable block fails instead of silently
training unsharded, and so does a misspelt ``--fsdp-block-classes`` name next to a
valid one (the error names it and the model's blocks); that the root-group check
names a trainable parameter left outside every ``fully_shard`` group in a
multi-rank run, and that ``shard_model`` really runs it (with its root group
left out, sharding fails on the embeddings); that ``--fsdp-cpu-offload``
materializes the shards on the host and only the buffers on the device; and that
``auto`` attention is vime's per-sample ``varlen_sdpa`` without flash-attention
(registered with transformers, so a model builds with it), ``sdpa`` for a model
with sliding-window layers, and an explicit choice is kept.
"""

from __future__ import annotations

import pytest
import torch
from actor_harness import spawn
from tiny_models import tiny_qwen3_config
from transformers import Qwen2Config, Qwen3ForCausalLM

from vime.backends.fsdp2.model import (
    _buffers_to,
    check_every_parameter_sharded,
    find_block_classes,
    materialize_device,
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


def test_misspelt_block_class_next_to_a_valid_one_fails() -> None:
    with pytest.raises(ValueError, match=r"names Typo, not a .*its decoder blocks: Qwen3Decoder"):
        find_block_classes(_tiny(), "Qwen3DecoderLayer,Typo")
    names = [c.__name__ for c in find_block_classes(_tiny(), "Qwen3MLP, Qwen3DecoderLayer")]
    assert names == ["Qwen3DecoderLayer", "Qwen3MLP"]


def test_cpu_offload_materializes_shards_on_the_host() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert materialize_device(cuda, cpu_offload=True) == cpu
    assert materialize_device(cuda, cpu_offload=False) == cuda
    assert materialize_device(cpu, cpu_offload=True) == cpu
    # The forward runs on the device: buffers (rotary tables) go there, parameters stay.
    model = _tiny()
    _buffers_to(model, torch.device("meta"))
    assert {b.device.type for b in model.buffers()} == {"meta"}
    assert {p.device.type for p in model.parameters()} == {"cpu"}


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


def _job_shard_without_root_group(rank: int, world: int) -> dict:
    """``shard_model`` twice on 2 ranks: as is, then with its root ``fully_shard`` skipped."""
    import torch.distributed as dist

    from vime.backends.fsdp2 import model as fsdp_model

    dist.init_process_group("gloo")
    mesh = fsdp_model.build_mesh("full", world, None, torch.device("cpu"))
    kwargs = dict(
        block_classes=None,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        reshard_after_forward=True,
        cpu_offload=False,
    )
    fsdp_model.shard_model(_tiny(), mesh, **kwargs)  # the root group claims the rest
    model = _tiny()
    real = fsdp_model.fully_shard

    def blocks_only(module, **kw):
        return module if module is model else real(module, **kw)

    fsdp_model.fully_shard = blocks_only
    try:
        fsdp_model.shard_model(model, mesh, **kwargs)
    except RuntimeError as e:
        return {"error": str(e)}
    finally:
        fsdp_model.fully_shard = real
    return {"error": None}


def test_shard_model_fails_fast_without_a_root_group(tmp_path) -> None:
    got = spawn(_job_shard_without_root_group, 2, tmp_path)
    assert got["error"] is not None, "sharding with no root group went through"
    assert "model.embed_tokens.weight is outside every fully_shard group" in got["error"]
