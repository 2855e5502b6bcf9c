"""``vime.weights.lora``: the merge and the engine side of an adapter-only sync.

Proves: ``merge`` is ``W + (alpha/R)·B A`` in float32, cast to the base's dtype; the
engine's merger keeps the base it was sent beside the first adapters and merges each
later adapter-only set into it (layers without an adapter pass as they are); merged
weights with no adapter pass through without replacing the kept base; adapters that
arrive before any base, or name a layer with no base weight, are refused in one line;
an engine with LoRA of its own gets the adapters as they are only where every sync
is not merged weights and no module trains in full beside them.
"""

from __future__ import annotations

import pytest
import torch

from vime.weights.lora import (
    AdapterLoader,
    AdapterMerger,
    EngineLora,
    LoraSettings,
    adapter_layer,
    adapter_names,
    engine_lora,
    engine_receiver,
    merge,
)


def test_merge_is_the_lora_formula_in_float32() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g).to(torch.bfloat16)
    a, b = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    got = merge(w, a, b, 0.5, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (w.float() + 0.5 * (b @ a)).to(torch.bfloat16))


def test_wire_names_round_trip() -> None:
    a, b = adapter_names("model.layers.0.mlp.up_proj")
    assert (a, b) == (
        "model.layers.0.mlp.up_proj.lora_A.weight",
        "model.layers.0.mlp.up_proj.lora_B.weight",
    )
    assert adapter_layer(a) == adapter_layer(b) == "model.layers.0.mlp.up_proj"
    assert adapter_layer("model.layers.0.mlp.up_proj.weight") is None


def _flat(buckets) -> dict[str, torch.Tensor]:
    return {n: t for bucket in buckets for n, t in bucket}


def test_the_merger_keeps_the_base_and_merges_each_adapter_set() -> None:
    g = torch.Generator().manual_seed(1)
    base = {"l.q.weight": torch.randn(4, 3, generator=g), "norm.weight": torch.ones(3)}
    qa, qb = adapter_names("l.q")

    def adapters() -> dict[str, torch.Tensor]:
        return {qa: torch.randn(2, 3, generator=g), qb: torch.randn(4, 2, generator=g)}

    merger = AdapterMerger(EngineLora(LoraSettings(rank=2, alpha=4.0), bucket_bytes=16))
    first = adapters()
    got = _flat(merger.expand([list(base.items()), list(first.items())]))
    assert got.keys() == base.keys()
    assert torch.equal(
        got["l.q.weight"], merge(base["l.q.weight"], first[qa], first[qb], 2.0, torch.float32)
    )
    assert torch.equal(got["norm.weight"], base["norm.weight"])
    second = adapters()
    got = _flat(merger.expand([list(second.items())]))  # adapters alone
    assert torch.equal(
        got["l.q.weight"], merge(base["l.q.weight"], second[qa], second[qb], 2.0, torch.float32)
    )
    # Merged weights (no adapter) are served as they came; the kept base is untouched.
    merged = {name: t + 1 for name, t in base.items()}
    assert all(
        torch.equal(_flat(merger.expand([list(merged.items())]))[n], t) for n, t in merged.items()
    )
    assert torch.equal(merger.base["l.q.weight"], base["l.q.weight"])


def test_adapters_without_a_base_are_refused() -> None:
    qa, qb = adapter_names("l.q")
    pair = [(qa, torch.zeros(1, 2)), (qb, torch.zeros(2, 1))]
    merger = AdapterMerger(EngineLora(LoraSettings(rank=2, alpha=2.0), bucket_bytes=64))
    with pytest.raises(ValueError, match="before the engine received the base"):
        list(merger.expand([pair]))
    with pytest.raises(ValueError, match=r"'l\.q', which has no base weight"):
        list(merger.expand([[("other.weight", torch.zeros(2, 2)), *pair]]))


def test_an_engine_serves_the_adapters_itself_only_where_they_come_alone() -> None:
    lora = LoraSettings(rank=4)
    assert engine_lora(LoraSettings(), 1024, "broadcast") is None
    assert engine_lora(lora, 1024, "broadcast") == EngineLora(lora, 1024, "auto")
    assert engine_lora(lora, 1024, "broadcast", "on").native == "on"
    merged = LoraSettings(rank=4, merge_on_sync=True)
    saved = LoraSettings(rank=4, modules_to_save=("norm",))
    assert engine_lora(merged, 1024, "broadcast", "on").native == "off"
    assert engine_lora(saved, 1024, "object-store").native == "off"
    assert engine_lora(lora, 1024, "disk").native == "off"  # its folder is the merged model
    # auto: vLLM's LoRA on a GPU, the merge on the CPU; never for an engine without LoRA.
    for native, cuda, kind in [
        ("auto", True, AdapterLoader),
        ("auto", False, AdapterMerger),
        ("on", False, AdapterLoader),
        ("off", True, AdapterMerger),
    ]:
        settings = EngineLora(lora, 1024, native)
        assert isinstance(engine_receiver(settings, native_lora=True, cuda=cuda), kind)
        assert isinstance(engine_receiver(settings, native_lora=False, cuda=cuda), AdapterMerger)
