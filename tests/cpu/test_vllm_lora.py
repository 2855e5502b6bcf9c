"""vLLM's own LoRA as the engine side of an adapter-only sync (``AdapterLoader``).

Proves, on a tiny random fp32 Qwen3 served by the CPU build of vLLM with LoRA on:
the first sync (base weights and adapters) and each later adapter-only one make the
engine score and greedily sample what transformers gives for the merged weights
``W + s·BA`` (1e-4), with adapters on part of a fused layer (q/v of qkv, down beside
gate/up); each sync is a new adapter version in place of the last (the one before is
far off), its folder removed once loaded; a sync of merged weights with no adapter serves them
bare (an adapter left on would count twice); a sync with nothing in it is refused; an
adapter loaded while a generation runs lands between two engine steps, the requests
going on with it on the KV cache the adapter before wrote; a sync's base and adapter
land as one, so a request that arrives between them samples with both and reports
the version it sampled from.
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from transformers import AutoModelForCausalLM

from tests.cpu.test_vllm_engine import (
    _greedy,
    _kept_cache_log_probs,
    _max_diff,
    _reference,
    _step_hook,
)
from tests.cpu.tiny_models import tiny_qwen3_config
from vime.rollout.engines.vllm import VLLMEngine
from vime.rollout.types import SamplingParams
from vime.weights.lora import (
    AdapterLoader,
    EngineLora,
    LoraSettings,
    adapter_names,
    merge,
)

VOCAB = 64
TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")  # parts of qkv and of gate_up
SETTINGS = LoraSettings(rank=4, alpha=8.0, target_modules=TARGETS)


def _adapters(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random A and B (B nonzero: the adapter changes the model) for every target."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            a_name, b_name = adapter_names(name)
            out[a_name] = torch.randn(SETTINGS.rank, module.in_features, generator=g) * 0.3
            out[b_name] = torch.randn(module.out_features, SETTINGS.rank, generator=g) * 0.3
    return out


def _merged(base: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_config(base.config, dtype=torch.float32).eval()
    state = dict(base.state_dict())
    for a_name, a in adapters.items():
        if a_name.endswith(".lora_A.weight"):
            layer = a_name.removesuffix(".lora_A.weight")
            b = adapters[layer + ".lora_B.weight"]
            state[layer + ".weight"] = merge(
                state[layer + ".weight"], a, b, SETTINGS.scale, torch.float32
            )
    model.load_state_dict(state)
    return model


def _check_serves(engine: VLLMEngine, model: torch.nn.Module) -> None:
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    assert _max_diff(engine.score(ids, 5, 1.0), _reference(model, ids, 5, 1.0)) < 1e-4
    prompt = [3, 17, 9, 40]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=0)
    assert engine.generate([prompt], greedy)[0][0].response_ids == _greedy(model, prompt, 6)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[VLLMEngine, torch.nn.Module]:
    """A vLLM engine with LoRA on, and the base model it serves."""
    folder = tmp_path_factory.mktemp("vllm_lora") / "model"
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_qwen3_config(VOCAB), dtype=torch.float32).eval()
    with torch.no_grad():
        base.lm_head.weight.mul_(4.0)  # clear greedy margins
    base.save_pretrained(folder)
    engine = VLLMEngine(
        str(folder), dtype="float32", max_model_len=256, max_lora_rank=SETTINGS.rank
    )
    return engine, base


def test_adapters_served_by_vllm_equal_the_merged_weights(served) -> None:
    engine, base = served
    loader = AdapterLoader(EngineLora(SETTINGS, bucket_bytes=1 << 20))
    base_weights = list(base.state_dict().items())

    first = _adapters(base, seed=1)
    loader.update(engine, [base_weights[:7], base_weights[7:], list(first.items())], 1)
    assert engine.weight_version == 1
    _check_serves(engine, _merged(base, first))

    second = _adapters(base, seed=2)
    loader.update(engine, [list(second.items())], 2)  # the adapters alone
    assert engine.weight_version == 2
    assert not Path(engine._adapter.lora_path).exists()  # read at the load, then removed
    merged = _merged(base, second)
    _check_serves(engine, merged)
    ids = list(range(3, 19))
    old = _reference(_merged(base, first), ids, 5, 1.0)
    assert _max_diff(engine.score(ids, 5, 1.0), old) > 1e-2  # the check above can fail

    # Merged weights with no adapter (a merged sync): served as they are.
    loader.update(engine, [list(merged.state_dict().items())], 3)
    assert engine.weight_version == 3
    _check_serves(engine, merged)

    with pytest.raises(ValueError, match="no weights and no adapters"):
        loader.update(engine, [], 4)


def test_an_adapter_loaded_mid_generation_serves_the_tokens_after(
    served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As new weights do (test_vllm_engine.py): an adapter sync from another thread lands
    between two engine steps; the tokens before have the old adapter's log-probs, the
    later ones the new adapter's on the KV cache the old one wrote."""
    engine, base = served
    loader = AdapterLoader(EngineLora(SETTINGS, bucket_bytes=1 << 20))
    first, second = _adapters(base, seed=3), _adapters(base, seed=4)
    loader.update(engine, [list(base.state_dict().items()), list(first.items())], 10)
    thread = threading.Thread(target=loader.update, args=(engine, [list(second.items())], 11))

    def start_the_load() -> None:  # inside step 2: the load waits for its end
        thread.start()
        while engine.gate.loads_waiting == 0:
            time.sleep(0.001)

    switch_after = 2
    _step_hook(monkeypatch, engine, switch_after, start_the_load)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    try:
        out = [c for group in engine.generate([[3, 17, 9], [40, 2, 51, 8]], params) for c in group]
    finally:
        monkeypatch.undo()
        thread.join(timeout=60)
    assert engine.weight_version == 11
    old_model, new_model = _merged(base, first), _merged(base, second)
    k = switch_after + 1
    long_ones = [c for c in out if len(c.response_ids) > k]
    assert long_ones, "no completion outlived the load; pick another seed"
    for c in long_ones:
        assert c.weight_versions == (10, 11)
        ids = c.prompt_ids + c.response_ids
        old = _reference(old_model, ids, len(c.prompt_ids), 1.0)
        assert _max_diff(c.log_probs[:k], old[:k]) < 1e-4
        kept = _kept_cache_log_probs(old_model, new_model, c, len(c.prompt_ids) + k - 1)
        assert _max_diff(c.log_probs[k:], kept) < 1e-4
        assert _max_diff(c.log_probs[k:], old[k:]) > 1e-2  # the old adapter is told apart


def test_a_request_between_base_and_adapter_waits_for_both(
    served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync of base and adapters is one load: a request that arrives after the base is
    in and before the adapter is waits for the adapter, so the version it reports is
    the one it sampled from (not the new version on the base alone)."""
    engine, base = served
    loader = AdapterLoader(EngineLora(SETTINGS, bucket_bytes=1 << 20))
    loader.update(engine, [list(base.state_dict().items())], 20)  # the base alone, bare
    adapters = _adapters(base, seed=6)
    prompt, greedy = [5, 30, 12, 7], SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
    got: list = []
    between = threading.Thread(target=lambda: got.extend(engine.generate([prompt], greedy)))
    load_adapter = engine.load_adapter

    def request_in_between(folder, version) -> None:  # the base is in, the adapter not yet
        between.start()
        between.join(timeout=1.0)  # done here only if the engine steps between the two
        load_adapter(folder, version)

    monkeypatch.setattr(engine, "load_adapter", request_in_between)
    loader.update(engine, [list(base.state_dict().items()), list(adapters.items())], 21)
    between.join(timeout=60)
    assert engine.weight_version == 21
    (completion,) = got[0]
    assert completion.weight_versions == (21, 21)
    ids = completion.prompt_ids + completion.response_ids
    served_model, bare = _merged(base, adapters), _reference(base, ids, len(prompt), 1.0)
    want = _reference(served_model, ids, len(prompt), 1.0)
    assert _max_diff(want, bare) > 1e-2  # the adapter is told apart from the base alone
    assert _max_diff(completion.log_probs, want) < 1e-4
