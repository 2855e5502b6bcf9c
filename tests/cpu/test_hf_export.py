"""HF export: the bucket stream becomes a folder ``from_pretrained`` loads exactly.

Proves, on a tiny random Qwen3 (tied and untied embeddings), that
``save_hf_folder`` fed with ``iter_buckets`` over the model's state dict
writes a single ``model.safetensors`` or numbered shards plus an index (whose
``weight_map`` and ``total_size`` are right) and that
``AutoModelForCausalLM.from_pretrained`` gives bitwise-identical logits; that
a tied ``lm_head.weight`` is dropped and re-tied on load; that a bf16 export
loads as bf16; that shards are streamed (tensors of a flushed shard are freed
before the stream ends); that a tokenizer is saved and loads back with
``AutoTokenizer``; and that the folder only ever appears complete: a stream
that fails half-way leaves no final folder, leaves an existing one untouched,
and leaves no temporary files behind, while a successful export replaces the
old folder wholesale.
"""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tiny_models import tiny_qwen3_config
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from vime.weights import hf_export
from vime.weights.buckets import entries_from_state_dict, iter_buckets
from vime.weights.hf_export import INDEX_FILE, SINGLE_FILE, save_hf_folder

TOKENS = torch.tensor([[1, 5, 9, 17, 33, 64, 100, 127], [0, 2, 4, 8, 16, 32, 64, 3]])


def _tiny(tie: bool, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = tiny_qwen3_config(128, tie=tie)
    return Qwen3ForCausalLM(config).eval()


def _buckets(model: torch.nn.Module, bucket_bytes: int = 40_000):
    return iter_buckets(entries_from_state_dict(model.state_dict()), bucket_bytes)


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=TOKENS, use_cache=False).logits


def _weight_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


def _no_leftovers(parent: Path) -> None:
    hidden = [p.name for p in parent.iterdir() if p.name.startswith(".")]
    assert hidden == [], f"temporary files left behind: {hidden}"


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("sharded", [False, True])
def test_roundtrip_bitwise(tmp_path: Path, tie: bool, sharded: bool) -> None:
    model = _tiny(tie)
    out = tmp_path / "hf"
    max_shard = 20_000 if sharded else 5 * 2**30
    written = save_hf_folder(out, _buckets(model), config=model.config, max_shard_bytes=max_shard)
    assert written == out
    files = _weight_files(out)
    if sharded:
        assert len(files) > 2
        count = len(files)
        assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        index = json.loads((out / INDEX_FILE).read_text())
        weight_map = index["weight_map"]
        assert set(weight_map.values()) == set(files)
        total = 0
        for name in files:
            with safe_open(str(out / name), "pt") as f:
                keys = list(f.keys())
                assert all(weight_map[k] == name for k in keys)
                sizes = [f.get_tensor(k).nbytes for k in keys]
            assert sum(sizes) <= max_shard or len(keys) == 1
            total += sum(sizes)
        assert index["metadata"]["total_size"] == total
        names = set(weight_map)
    else:
        assert files == [SINGLE_FILE]
        assert not (out / INDEX_FILE).exists()
        with safe_open(str(out / SINGLE_FILE), "pt") as f:
            names = set(f.keys())
    expected = set(model.state_dict()) - ({"lm_head.weight"} if tie else set())
    assert names == expected
    _no_leftovers(tmp_path)

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.tie_word_embeddings is tie
    if tie:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(_logits(loaded), _logits(model))


def test_bf16_export_loads_as_bf16(tmp_path: Path) -> None:
    model = _tiny(tie=False)
    # As in a model loaded from an fp32 checkpoint: a loader trusts this over
    # the tensors, so the export must record the dtype it actually wrote.
    model.config.dtype = torch.float32
    save_hf_folder(tmp_path / "bf16", _buckets(model), config=model.config, dtype=torch.bfloat16)
    assert model.config.dtype == torch.float32, "the caller's config must not change"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_shards_are_streamed(tmp_path: Path) -> None:
    refs: list[weakref.ref] = []
    dead_at_request: list[bool] = []

    def stream():
        for i in range(6):
            # Every tensor fills a shard, so tensor i-2 was flushed by the
            # time bucket i is requested and nothing may still hold it.
            dead_at_request.append(i < 2 or refs[i - 2]() is None)
            # Track the *memory*, not the tensor object (the exporter may
            # re-wrap it): a numpy array lives exactly as long as the storage.
            array = np.random.rand(128)
            refs.append(weakref.ref(array))
            yield [(f"w{i}", torch.from_numpy(array))]
            del array

    save_hf_folder(tmp_path / "s", stream(), config=_tiny(False).config, max_shard_bytes=1024)
    assert all(ref() is None for ref in refs)
    assert dead_at_request == [True] * 6
    assert len(_weight_files(tmp_path / "s")) == 6


def test_failed_export_leaves_nothing_and_keeps_old_folder(tmp_path: Path) -> None:
    model = _tiny(tie=False)
    out = tmp_path / "hf"

    def failing():
        for i, bucket in enumerate(_buckets(model, 10_000)):
            if i == 5:
                raise RuntimeError("rank died mid-stream")
            yield bucket

    with pytest.raises(RuntimeError, match="mid-stream"):
        save_hf_folder(out, failing(), config=model.config, max_shard_bytes=20_000)
    assert not out.exists()
    _no_leftovers(tmp_path)

    save_hf_folder(out, _buckets(model), config=model.config, max_shard_bytes=20_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RuntimeError, match="mid-stream"):
        save_hf_folder(out, failing(), config=model.config)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    _no_leftovers(tmp_path)

    # A successful export replaces the old folder wholesale: no stale shards.
    other = _tiny(tie=False, seed=1)
    save_hf_folder(out, _buckets(other), config=other.config)
    assert _weight_files(out) == [SINGLE_FILE] and not (out / INDEX_FILE).exists()
    _no_leftovers(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(_logits(loaded), _logits(other))


def test_failed_swap_restores_old_folder(tmp_path: Path, monkeypatch) -> None:
    model = _tiny(tie=False)
    out = save_hf_folder(tmp_path / "hf", _buckets(model), config=model.config)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace = os.replace

    def replace(src, dst):
        # Fail exactly when the finished staging folder is renamed onto ``out``.
        if Path(dst) == out and Path(src).name.startswith(".hf.tmp-"):
            raise OSError("disk yanked")
        real_replace(src, dst)

    monkeypatch.setattr(hf_export.os, "replace", replace)
    with pytest.raises(OSError, match="yanked"):
        save_hf_folder(out, _buckets(_tiny(tie=False, seed=1)), config=model.config)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    _no_leftovers(tmp_path)


def test_empty_stream_and_duplicates_rejected(tmp_path: Path) -> None:
    config = _tiny(False).config
    with pytest.raises(ValueError, match="empty"):
        save_hf_folder(tmp_path / "e", iter([]), config=config)
    twice = [[("w", torch.ones(2))], [("w", torch.ones(2))]]
    with pytest.raises(ValueError, match="twice"):
        save_hf_folder(tmp_path / "d", twice, config=config)
    assert list(tmp_path.iterdir()) == []


def test_tensors_sharing_memory_are_written_separately(tmp_path: Path) -> None:
    # safetensors refuses aliased tensors in one file; the exporter copies.
    weight = torch.randn(4, 3)
    bucket = [("a", weight), ("b", weight), ("c", weight[1:])]
    out = save_hf_folder(tmp_path / "alias", [bucket], config=_tiny(False).config)
    with safe_open(str(out / SINGLE_FILE), "pt") as f:
        assert torch.equal(f.get_tensor("a"), weight) and torch.equal(f.get_tensor("b"), weight)
        assert torch.equal(f.get_tensor("c"), weight[1:])


def test_tokenizer_saved_and_reloaded(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "the", "cat", "sat", "on", "mat"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]"
    )
    model = _tiny(tie=True)
    out = save_hf_folder(
        tmp_path / "tok", _buckets(model), config=model.config, tokenizer=tokenizer
    )
    loaded = AutoTokenizer.from_pretrained(out)
    text = "the cat sat on the dog"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"] == [2, 3, 4, 5, 2, 1]
    assert loaded.pad_token == "[PAD]" and loaded.unk_token == "[UNK]"
