"""Placement and loading rules of the fsdp2 backend (one real 2-rank gloo job).

Proves that decoder blocks are found from ``_no_split_modules`` or named
explicitly, that a model with no recognisable block fails instead of silently
training unsharded, and so does a misspelt ``--fsdp-block-classes`` name next to a
valid one (the error names it and the model's blocks); that nested block classes
(a decoder layer and its MLP) shard as nested groups and compute the unsharded
model's logits and gradient on 2 ranks; that the root-group check
names a trainable parameter left outside every ``fully_shard`` group in a
multi-rank run, and that ``shard_model`` really runs it (with its root group
left out, sharding fails on the embeddings); that ``--fsdp-cpu-offload``
materializes the shards on the host and only the buffers on the device; and that
``auto`` attention is vime's per-sample ``varlen_sdpa`` without flash-attention
(registered with transformers, so a model builds with it), ``sdpa`` for a model
with sliding-window layers, and an explicit choice is kept, while where
flash-attention is usable ``auto`` is still ``varlen_sdpa`` (``flash_attention_2`` only
for sliding-window layers in bf16);
and that only rank 0 reads the checkpoint's weights (rank 1, given a folder with no
weight file, builds on the meta device and receives its shards), which arrive as fp32
master weights from a bf16 checkpoint, with rank 0's non-persistent buffers.
"""

from __future__ import annotations

import shutil

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


def test_auto_attention_is_varlen_unless_sliding(monkeypatch) -> None:
    """Where ``has_flash_attn`` says yes (a GPU with flash-attn, as transformers checks it),
    ``auto`` still resolves to ``varlen_sdpa`` (which runs flash-attn's varlen kernel
    itself and reads shared-prompt rows), except for sliding-window layers in bf16, which
    get ``flash_attention_2``; an explicit choice is kept."""
    from vime import device as vime_device

    monkeypatch.setattr(vime_device, "has_flash_attn", lambda: True)
    gpu, bf16, fp32 = torch.device("cuda", 0), torch.bfloat16, torch.float32
    sliding = Qwen2Config(
        use_sliding_window=True, sliding_window=16, max_window_layers=1, num_hidden_layers=2
    )
    assert resolve_attn_implementation("auto", gpu, bf16, tiny_qwen3_config()) == "varlen_sdpa"
    assert resolve_attn_implementation("auto", gpu, bf16, sliding) == "flash_attention_2"
    assert resolve_attn_implementation("auto", gpu, fp32, sliding) == "sdpa"
    assert resolve_attn_implementation("auto", gpu, fp32, tiny_qwen3_config()) == "varlen_sdpa"
    assert resolve_attn_implementation("sdpa", gpu, bf16, tiny_qwen3_config()) == "sdpa"


def _nested_blocks(mesh, kwargs: dict, rank: int, world: int) -> dict:
    """``shard_model`` with a block class inside another (decoder layer and its MLP), then
    a forward and backward of a different sequence on each rank, next to an unsharded twin
    that runs every rank's sequence and backpropagates their summed loss."""
    import copy

    from torch.distributed.fsdp import FSDPModule

    from vime.backends.fsdp2 import model as fsdp_model

    torch.manual_seed(4)
    plain = _tiny()
    sharded = copy.deepcopy(plain)
    nested = {**kwargs, "block_classes": "Qwen3DecoderLayer,Qwen3MLP"}
    fsdp_model.shard_model(sharded, mesh, **nested)
    ids = torch.randint(0, 64, (world, 1, 7), generator=torch.Generator().manual_seed(5))

    def loss_of(logits: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[0, :-1], row[0, 1:])

    logits = sharded(input_ids=ids[rank]).logits
    loss_of(logits, ids[rank]).backward()
    plain_logits = [plain(input_ids=row).logits for row in ids]
    sum(loss_of(lg, row) for lg, row in zip(plain_logits, ids, strict=True)).backward()
    layer = sharded.model.layers[0]
    return {
        "groups": (isinstance(layer, FSDPModule), isinstance(layer.mlp, FSDPModule)),
        "logits": (logits.detach(), plain_logits[rank].detach()),
        "grads": {
            n: (p.grad.full_tensor(), q.grad)
            for (n, p), q in zip(sharded.named_parameters(), plain.parameters(), strict=True)
        },
    }


def _job_shard_and_load(rank: int, world: int, weights_dir: str, config_dir: str) -> dict:
    """On 2 ranks: ``shard_model`` as is, with nested block classes, and with its root
    ``fully_shard`` skipped; then ``load_sharded_model`` with rank 0 given the checkpoint
    and rank 1 a copy of its ``config.json`` alone. Every rank's local shards and buffers,
    gathered to rank 0."""
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
    nested = _nested_blocks(mesh, kwargs, rank, world)
    model = _tiny()
    real = fsdp_model.fully_shard

    def blocks_only(module, **kw):
        return module if module is model else real(module, **kw)

    fsdp_model.fully_shard = blocks_only
    error = None
    try:
        fsdp_model.shard_model(model, mesh, **kwargs)
    except RuntimeError as e:
        error = str(e)
    finally:
        fsdp_model.fully_shard = real

    loaded = fsdp_model.load_sharded_model(
        weights_dir if rank == 0 else config_dir,
        mesh=mesh,
        device=torch.device("cpu"),
        attn_implementation="sdpa",
        shard_kwargs=kwargs,
    )
    mine = {
        "locals": {n: p.to_local().clone() for n, p in loaded.named_parameters()},
        "buffers": {n: b.clone() for n, b in loaded.named_buffers()},
    }
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    return {"error": error, "ranks": ranks, "nested": nested}


@pytest.fixture(scope="module")
def shard_and_load(tmp_path_factory) -> dict:
    """A bf16 checkpoint, and a folder holding only its ``config.json``."""
    tmp = tmp_path_factory.mktemp("load")
    torch.manual_seed(3)
    Qwen3ForCausalLM(tiny_qwen3_config()).to(torch.bfloat16).save_pretrained(tmp / "weights")
    (tmp / "config_only").mkdir()
    shutil.copy(tmp / "weights" / "config.json", tmp / "config_only" / "config.json")
    got = spawn(_job_shard_and_load, 2, tmp, str(tmp / "weights"), str(tmp / "config_only"))
    return {"dir": tmp, **got}


def test_nested_block_classes_shard_and_train_as_unsharded(shard_and_load) -> None:
    """``--fsdp-block-classes Qwen3DecoderLayer,Qwen3MLP``: the MLP inside each decoder
    layer is a group of its own (not claimed first by its layer's), and the sharded model's
    logits and its gradient (summed over both ranks' sequences) are the unsharded model's."""
    got = shard_and_load["nested"]
    assert got["groups"] == (True, True)
    torch.testing.assert_close(*got["logits"], atol=1e-5, rtol=1e-5)
    assert max(float(plain.abs().max()) for _, plain in got["grads"].values()) > 1e-3
    for name, (sharded, plain) in got["grads"].items():
        torch.testing.assert_close(sharded, plain, atol=1e-6, rtol=1e-5, msg=name)


def test_shard_model_fails_fast_without_a_root_group(shard_and_load) -> None:
    assert shard_and_load["error"] is not None, "sharding with no root group went through"
    assert "model.embed_tokens.weight is outside every fully_shard group" in shard_and_load["error"]


def test_only_rank_0_reads_the_checkpoint(shard_and_load) -> None:
    """Rank 1 loads from a folder with no weight file (reading one there would fail, as
    transformers does below), yet both ranks end with their half of every checkpoint tensor,
    upcast exactly to fp32 master weights, and with rank 0's buffers (the rotary tables)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tmp = shard_and_load["dir"]
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(tmp / "config_only")
    saved = load_file(tmp / "weights" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    ranks = shard_and_load["ranks"]
    for rank, got in enumerate(ranks):
        assert saved.keys() <= got["locals"].keys()
        for name, tensor in saved.items():
            local = got["locals"][name]
            assert local.dtype == torch.float32, (rank, name)
            assert torch.equal(local, tensor.float().chunk(2)[rank]), (rank, name)
    assert ranks[0]["buffers"].keys() == ranks[1]["buffers"].keys() != set()
    for name, buf in ranks[0]["buffers"].items():
        assert torch.equal(ranks[1]["buffers"][name], buf), name
