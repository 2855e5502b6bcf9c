"""The vLLM rollout engine keeps the ``RolloutEngine`` contract with the trainer's numbers.

Proves, on a tiny random fp32 Qwen3 served by the CPU build of vLLM (one engine
shared by the module): sampled-token log-probs equal ``log_softmax(logits / T)``
of a transformers fp32 forward (T = 1 and 0.7, 1e-4), so do ``score`` results
(and scaling for one score leaves later calls at T = 1); seeded draws repeat
and do not depend on the rest of the batch, nor on the batch being split in two
requests when the second names its offset in ``first_prompt_index`` (what lets
several engines share a batch), other seeds differ; ``n`` samples
per prompt come back in prompt order; with top-k the log-probs are those of the
renormalised truncated distribution, greedy ones are at T = 1; EOS from the checkpoint config and
``stop_token_ids`` end completions (token kept, finish "stop"); ``update_weights``
makes the engine serve the new weights (no prefix cached by the old ones reused) and
advances ``weight_version``; a set that arrives one tensor per bucket, as the
broadcast and CUDA-IPC receivers may get it, serves the new weights exactly when
``UpdateStream`` feeds it into one update -- and serves wrong fused layers when each
bucket is its own update (vLLM's reload rebuilds each layer a call touched from
that call's tensors alone);
new weights loaded from another thread while ``generate`` runs land between two engine
steps: the requests go on, tokens sampled before have the old model's log-probs, later
ones the new model's on the KV cache the old one wrote, and each completion records
(version before, new version), or the version before twice if it had ended; an error
mid-generation aborts the requests left (the next call draws the same as before);
``score`` from another thread shares a generation's steps with its temperature scaling
its own prompt log-probs only, each caller getting its own outputs; the scale also wraps
vLLM's V2 model runner (CUDA's default; a stand-in here);
building the engine leaves the caller's RNG alone;
a sleeping engine refuses to generate, score or load weights (on CPU, where
nothing is freed, too), loads weights once its weights are awake and serves once
fully awake; an engine actor given the run's prompt + response length starts on
a checkpoint whose 40960-token window the CPU KV cache cannot hold (left to
itself vLLM refuses to start);
importing the module does not import vLLM; an engine actor started by
``EngineGroup`` runs with ``OMP_WAIT_POLICY=PASSIVE`` even when the driver has
``ACTIVE`` (an idle engine then leaves its core to training: bench/engine_idle.py).
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tiny_models import save_tiny, tiny_qwen3_config
from transformers import AutoModelForCausalLM, Qwen3Config

from vime.rollout.engines.registry import EngineOptions
from vime.rollout.engines.vllm import VLLMEngine
from vime.rollout.types import Completion, SamplingParams

VOCAB = 64
PROMPTS = [[3, 17, 9], [40, 2, 2, 51, 8], [12]]
EOS_PROMPT = [5, 6, 7]


def _random_model(seed: int, eos: int | None = None) -> torch.nn.Module:
    config = tiny_qwen3_config(VOCAB)
    config.eos_token_id = eos
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # Spread the logits so greedy paths have clear margins (HF and vLLM agree on them).
        model.lm_head.weight.mul_(4.0)
    return model


def _greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _reference(
    model: torch.nn.Module, ids: list[int], start: int, temperature: float
) -> list[float]:
    """The trainer's log-probs: log_softmax(logits / T) of tokens ids[start:], fp32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    log_probs = torch.log_softmax(logits[start - 1 : -1] / temperature, dim=-1)
    return log_probs.gather(-1, torch.tensor(ids[start:]).unsqueeze(-1)).squeeze(-1).tolist()


def _max_diff(a: list[float], b: list[float]) -> float:
    """Largest |a - b|; inf where either side is NaN (max() would skip a NaN after the
    first element, and a NaN first would fail every `>` check as well as every `<`)."""
    assert len(a) == len(b)
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return math.inf if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("vllm_engine")
    model = _random_model(seed=0)
    # EOS = the 3rd greedy token of EOS_PROMPT (first occurrence), so that prompt
    # must stop there; written to the checkpoint the way HF exports carry it.
    path = _greedy(model, EOS_PROMPT, 3)
    eos = path[2] if path[2] not in path[:2] else path[1]
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(root / "model")
    assert json.loads((root / "model" / "generation_config.json").read_text())["eos_token_id"]

    torch.manual_seed(1234)
    engine = VLLMEngine(str(root / "model"), dtype="float32", seed=0, max_model_len=1024)
    draw_after_start = torch.rand(3)
    torch.manual_seed(1234)
    return SimpleNamespace(
        engine=engine,
        model=model,
        eos=eos,
        root=root,
        rng_untouched=torch.equal(draw_after_start, torch.rand(3)),
    )


def test_import_does_not_load_vllm() -> None:
    code = "import sys, vime.rollout.engines.vllm; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_engine_start_leaves_caller_rng_alone(setup: SimpleNamespace) -> None:
    assert setup.rng_untouched


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_match_transformers(setup: SimpleNamespace, temperature: float) -> None:
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=7)
    results = setup.engine.generate(PROMPTS, params)
    assert [len(group) for group in results] == [2] * len(PROMPTS)
    version = setup.engine.weight_version
    for prompt, group in zip(PROMPTS, results, strict=True):
        for completion in group:
            assert completion.prompt_ids == prompt
            assert completion.weight_versions == (version, version)
            assert len(completion.response_ids) == len(completion.log_probs) >= 1
            ids = prompt + completion.response_ids
            expected = _reference(setup.model, ids, len(prompt), temperature)
            assert _max_diff(completion.log_probs, expected) < 1e-4


def test_n_samples_per_prompt_in_prompt_order(setup: SimpleNamespace) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=5, seed=1)
    results = setup.engine.generate(PROMPTS, params)
    assert len(results) == len(PROMPTS)
    for prompt, group in zip(PROMPTS, results, strict=True):
        assert len(group) == 3
        for c in group:
            assert c.prompt_ids == prompt
            assert 1 <= len(c.response_ids) <= 5
            assert c.finish_reason == ("stop" if c.response_ids[-1] == setup.eos else "length")
        # Three seeded draws of 5 tokens over 64 ids: not all the same.
        assert len({tuple(c.response_ids) for c in group}) > 1
    assert setup.engine.generate([], params) == []


def test_seeded_sampling_is_reproducible(setup: SimpleNamespace) -> None:
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=11)

    def tokens(prompts: list[list[int]], p: SamplingParams) -> list[list[list[int]]]:
        return [[c.response_ids for c in g] for g in setup.engine.generate(prompts, p)]

    first = tokens(PROMPTS, params)
    assert tokens(PROMPTS, params) == first
    # The same request alone draws the same tokens as inside a larger batch.
    assert tokens(PROMPTS[:1], params) == first[:1]
    # The rest of the batch, told its offset, draws its prompts' tokens of the whole batch
    # (engines sharing a batch thereby agree with one engine); without it, other tokens.
    shifted = dataclasses.replace(params, first_prompt_index=1)
    assert tokens(PROMPTS[1:], shifted) == first[1:]
    assert tokens(PROMPTS[1:], params) != first[1:]
    other = tokens(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=12))
    assert other != first


def test_top_k_log_probs_are_of_the_truncated_distribution(setup: SimpleNamespace) -> None:
    """With top-k on, vLLM reports log-probs renormalised over the k kept tokens."""
    params = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=8, seed=4)
    completion = setup.engine.generate([PROMPTS[0]], params)[0][0]
    ids = PROMPTS[0] + completion.response_ids
    with torch.no_grad():
        logits = setup.model(torch.tensor([ids]), use_cache=False).logits[0] / 0.7
    steps = logits[len(PROMPTS[0]) - 1 : -1]
    kept = steps.masked_fill(steps < steps.topk(5, dim=-1).values[:, -1:], float("-inf"))
    targets = torch.tensor(completion.response_ids).unsqueeze(-1)
    expected = torch.log_softmax(kept, -1).gather(-1, targets).squeeze(-1).tolist()
    assert _max_diff(completion.log_probs, expected) < 1e-4
    full = _reference(setup.model, ids, len(PROMPTS[0]), 0.7)
    assert all(t > f for t, f in zip(completion.log_probs, full, strict=True))


def test_eos_from_checkpoint_stops_generation(setup: SimpleNamespace) -> None:
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    for completion in setup.engine.generate([EOS_PROMPT], params)[0]:
        assert completion.response_ids[-1] == setup.eos
        assert setup.eos not in completion.response_ids[:-1]
        assert completion.finish_reason == "stop"
        # Greedy log-probs are reported at T = 1.
        ids = EOS_PROMPT + completion.response_ids
        expected = _reference(setup.model, ids, len(EOS_PROMPT), 1.0)
        assert _max_diff(completion.log_probs, expected) < 1e-4


def test_stop_token_ids(setup: SimpleNamespace) -> None:
    prompt = PROMPTS[1]
    free = setup.engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8))
    free = free[0][0]
    assert free.finish_reason == ("stop" if free.response_ids[-1] == setup.eos else "length")
    assert len(free.response_ids) >= 3, "pick another prompt: EOS came too early"
    stop_at = next(k for k in range(1, len(free.response_ids)) if free.response_ids[k] != setup.eos)
    stop = free.response_ids[stop_at]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))
    stopped = setup.engine.generate([prompt], params)[0][0]
    first = free.response_ids.index(stop)
    assert stopped.response_ids == free.response_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.log_probs == pytest.approx(free.log_probs[: first + 1], abs=1e-6)


def test_score_matches_transformers(setup: SimpleNamespace) -> None:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (20,), generator=generator).tolist()
    prompt_len = 6
    # T = 1 after T = 0.7 also proves the temporary logit scale is undone.
    for temperature in (0.7, 1.0):
        scored = setup.engine.score(ids, prompt_len, temperature)
        assert len(scored) == len(ids) - prompt_len
        assert _max_diff(scored, _reference(setup.model, ids, prompt_len, temperature)) < 1e-4
    assert setup.engine.score(ids, len(ids), 1.0) == []
    with pytest.raises(ValueError):
        setup.engine.score(ids, 0, 1.0)


# Before any test that starts and shuts down another engine: an in-process vLLM
# engine's shutdown clears vLLM's global parallel state, which this module's engine
# (the setup fixture) still needs.
def test_multi_turn_turns_are_what_the_engine_draws_and_scores(setup: SimpleNamespace) -> None:
    """Token in, token out on vLLM: each turn of a multi-turn trajectory, environment
    tokens between, is the engine's own seeded draw for its context, scored alike; the
    prefix cache (serving each turn's repeated prefix) is on."""
    from tests.cpu.test_agent import check_turns_are_the_engines

    assert setup.engine._llm.llm_engine.vllm_config.cache_config.enable_prefix_caching

    check_turns_are_the_engines(setup.engine, seed=3, stop=setup.eos)


def test_update_weights_serves_new_model(setup: SimpleNamespace) -> None:
    engine = setup.engine
    block = engine._llm.llm_engine.vllm_config.cache_config.block_size
    # Longer than two KV blocks, so the prefix cache holds it after the first call.
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (2 * block + 3,), generator=generator).tolist()
    params = SamplingParams(n=1, temperature=0.7, max_new_tokens=6, seed=2)
    before = engine.generate([prompt], params)[0][0]
    ids = prompt + before.response_ids
    assert _max_diff(before.log_probs, _reference(setup.model, ids, len(prompt), 0.7)) < 1e-4

    new_model = _random_model(seed=1, eos=setup.eos)
    items = list(new_model.state_dict().items())
    buckets = [items[i : i + 3] for i in range(0, len(items), 3)]
    version = engine.weight_version + 1
    engine.sleep()  # no-ops on CPU; the engine must still serve afterwards
    engine.wake_up()
    engine.update_weights(iter(buckets), version=version)
    try:
        assert engine.weight_version == version
        after = engine.generate([prompt], params)[0][0]
        assert after.extra["weight_version"] == version
        assert after.weight_versions == (version, version)
        ids = prompt + after.response_ids
        assert _max_diff(after.log_probs, _reference(new_model, ids, len(prompt), 0.7)) < 1e-4
        # Old weights would be far off: the check above can fail.
        assert _max_diff(after.log_probs, _reference(setup.model, ids, len(prompt), 0.7)) > 1e-2
        scored = engine.score(ids, len(prompt), 0.7)
        assert _max_diff(scored, _reference(new_model, ids, len(prompt), 0.7)) < 1e-4
    finally:
        # Put the module's model back for the other tests.
        engine.update_weights([list(setup.model.state_dict().items())], version=version + 1)
    restored = engine.generate([prompt], params)[0][0]
    assert restored.response_ids == before.response_ids
    assert _max_diff(restored.log_probs, before.log_probs) < 1e-5


def test_a_set_streamed_bucket_by_bucket_loads_whole(setup: SimpleNamespace) -> None:
    """One tensor per bucket splits every fused layer (qkv, gate_up) across buckets: loaded
    by a call each, the layers come out wrong; streamed into one call, exactly right."""
    from vime.weights.update_stream import UpdateStream

    engine, version = setup.engine, setup.engine.weight_version
    prompt = [3, 9, 4, 17, 2, 30, 11]
    new_model = _random_model(seed=2, eos=setup.eos)
    items = list(new_model.state_dict().items())
    ids = [*prompt, 8, 1, 5, 12]

    def served_diff() -> float:
        scored = engine.score(ids, len(prompt), 1.0)
        return _max_diff(scored, _reference(new_model, ids, len(prompt), 1.0))

    try:
        for item in items:  # one tensor per call: q, k and v of a layer in different calls
            engine.update_weights([[item]], version)
        assert served_diff() > 1e-2
        stream = UpdateStream(lambda buckets: engine.update_weights(buckets, version + 1))
        for item in items:
            stream.put([item])
        stream.finish()
        assert engine.weight_version == version + 1
        assert served_diff() < 1e-4
    finally:
        engine.update_weights([list(setup.model.state_dict().items())], version)


def _step_hook(
    monkeypatch: pytest.MonkeyPatch, engine: VLLMEngine, at: int, action: Callable[[], None]
) -> None:
    """Run ``action`` once, at the end of engine step ``at`` (0: the first), inside the
    step: ``generate`` holds the engine's gate until it returns."""
    llm_engine = engine._llm.llm_engine
    step, taken = llm_engine.step, 0

    def hooked() -> list[Any]:
        nonlocal taken
        outputs = step()
        if taken == at:
            action()
        taken += 1
        return outputs

    monkeypatch.setattr(llm_engine, "step", hooked)


@torch.no_grad()
def _kept_cache_log_probs(old_model, new_model, c: Completion, switch: int) -> list[float]:
    """Log-probs of the response tokens after position ``switch``: the positions before it
    cached by ``old_model``, the rest run by ``new_model`` on that cache."""
    ids = torch.tensor([c.prompt_ids + c.response_ids])
    cache = old_model(input_ids=ids[:, :switch], use_cache=True).past_key_values
    logits = new_model(input_ids=ids[:, switch:-1], past_key_values=cache).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, ids[0, switch + 1 :, None]).squeeze(-1).tolist()


def test_weights_loaded_mid_generation_sample_the_tokens_after(
    setup: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load from another thread while ``generate`` runs lands between two engine steps:
    the requests go on, every token up to that step has the old model's log-prob, every
    later one the new model's on the KV cache the old one wrote (kept), and each records
    (the version before, the new one) -- or the version before twice if it had ended."""
    engine = setup.engine
    before = engine.weight_version
    version = before + 1
    new_model = _random_model(seed=3, eos=setup.eos)
    errors: list[BaseException] = []

    def load() -> None:
        try:
            engine.update_weights([list(new_model.state_dict().items())], version)
        except BaseException as err:  # re-raised by the test thread
            errors.append(err)

    loader = threading.Thread(target=load)

    def start_the_load() -> None:  # inside step 2: the load must wait for its end
        loader.start()
        while engine.gate.loads_waiting == 0:
            time.sleep(0.001)

    switch_after = 2  # steps 0 (prefill and the first token), 1 and 2 on the old weights
    _step_hook(monkeypatch, engine, switch_after, start_the_load)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    try:
        out = [c for group in engine.generate(PROMPTS, params) for c in group]
    finally:
        monkeypatch.undo()
        loader.join(timeout=60)
    try:
        assert not errors and not loader.is_alive()
        assert engine.weight_version == version
        k = switch_after + 1  # tokens 0..k-1 were sampled before the load
        long_ones = [c for c in out if len(c.response_ids) > k]
        assert long_ones, "no completion outlived the load; pick another seed"
        for c in out:
            assert c.weight_versions == ((before, version) if c in long_ones else (before, before))
        for c in long_ones:
            ids = c.prompt_ids + c.response_ids
            old = _reference(setup.model, ids, len(c.prompt_ids), 1.0)
            assert _max_diff(c.log_probs[:k], old[:k]) < 1e-4
            switch = len(c.prompt_ids) + k - 1
            kept = _kept_cache_log_probs(setup.model, new_model, c, switch)
            assert _max_diff(c.log_probs[k:], kept) < 1e-4
            assert _max_diff(c.log_probs[k:], old[k:]) > 1e-2  # the old model is told apart
    finally:
        engine.update_weights([list(setup.model.state_dict().items())], version + 1)


def test_a_failing_step_aborts_the_requests_left(
    setup: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error mid-generation leaves no request behind in vLLM's engine: the next
    ``generate`` draws what it would have drawn anyway."""
    engine = setup.engine
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=9)
    expected = engine.generate(PROMPTS, params)

    def fail() -> None:
        raise KeyboardInterrupt  # what Ctrl-C raises in the thread that steps

    _step_hook(monkeypatch, engine, 1, fail)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, params)
    monkeypatch.undo()
    assert not engine._llm.llm_engine.has_unfinished_requests()
    assert not engine._finished
    again = engine.generate(PROMPTS, params)
    tokens = [[c.response_ids for c in group] for group in again]
    assert tokens == [[c.response_ids for c in group] for group in expected]


def test_a_score_during_a_generation_waits_for_it(
    setup: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``score`` from another thread while ``generate`` runs (the asynchronous loop's
    probe) waits for that generation to end, then scores at its own temperature; the
    generation's tokens and log-probs are what it draws alone."""
    engine = setup.engine
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    alone = engine.generate(PROMPTS, params)
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (20,), generator=generator).tolist()
    scored: list[tuple[list[float], float]] = []
    errors: list[BaseException] = []

    def score() -> None:
        try:
            scored.append((engine.score(ids, 6, 0.7), time.monotonic()))
        except BaseException as err:  # re-raised by the test thread
            errors.append(err)

    scorer = threading.Thread(target=score)
    _step_hook(monkeypatch, engine, 1, scorer.start)
    try:
        shared = engine.generate(PROMPTS, params)
        generated_at = time.monotonic()
    finally:
        monkeypatch.undo()
        scorer.join(timeout=120)
    assert not errors and len(scored) == 1
    values, scored_at = scored[0]
    assert scored_at >= generated_at  # it waited for the generation
    assert _max_diff(values, _reference(setup.model, ids, 6, 0.7)) < 1e-4
    assert any(len(c.response_ids) > 2 for group in shared for c in group), "none in flight"
    for prompt, group, group_alone in zip(PROMPTS, shared, alone, strict=True):
        for c, c_alone in zip(group, group_alone, strict=True):
            assert c.response_ids == c_alone.response_ids
            expected = _reference(setup.model, prompt + c.response_ids, len(prompt), 1.0)
            assert _max_diff(c.log_probs, expected) < 1e-4
    assert not engine._llm.llm_engine.has_unfinished_requests() and not engine._finished


def test_prompt_logit_scale_wraps_the_v2_model_runner() -> None:
    """vLLM's V2 model runner (CUDA's default; the CPU build runs V1, which the tests
    above use) hands its prompt log-probs the logits function: the scale wraps it. The
    extension vLLM is told to load by name is this class."""
    from vime.rollout.engines.vllm_start import WORKER_EXTENSION
    from vime.rollout.engines.vllm_worker import VimeWorkerExtension

    assert f"{VimeWorkerExtension.__module__}.VimeWorkerExtension" == WORKER_EXTENSION

    calls: list[Any] = []

    class PromptLogprobsWorker:
        def compute_prompt_logprobs(self, logits_fn: Callable[[Any], Any], *args: Any) -> Any:
            calls.append(args)
            return logits_fn(torch.tensor([1.0, 2.0]))

    runner = SimpleNamespace(prompt_logprobs_worker=PromptLogprobsWorker())
    worker = SimpleNamespace(model_runner=runner)
    assert VimeWorkerExtension.vime_set_prompt_logit_scale(worker, 2.0) == 1.0
    compute = runner.prompt_logprobs_worker.compute_prompt_logprobs
    assert compute(lambda h: h + 1, "batch").tolist() == [4.0, 6.0]
    assert VimeWorkerExtension.vime_set_prompt_logit_scale(worker, 1.0) == 2.0
    assert compute(lambda h: h + 1, "batch").tolist() == [2.0, 3.0]
    assert calls == [("batch",), ("batch",)]
    with pytest.raises(RuntimeError, match="computes prompt log-probs in no method"):
        VimeWorkerExtension.vime_set_prompt_logit_scale(
            SimpleNamespace(model_runner=SimpleNamespace()), 2.0
        )


# A tensor-parallel engine in its own interpreter: its workers are spawned processes.
TP_ENGINE = r"""
import json, sys
from safetensors.torch import load_file
from vime.rollout.engines.vllm import VLLMEngine
from vime.weights.update_stream import UpdateStream

def main(old: str, new: str) -> None:
    engine = VLLMEngine(old, tensor_parallel_size=2, dtype="float32", max_model_len=64)
    stream = UpdateStream(lambda buckets: engine.update_weights(buckets, 3))
    for item in load_file(f"{new}/model.safetensors").items():
        stream.put([item])  # a tensor a bucket: every layer over several files
    stream.finish()
    ids = json.loads(sys.stdin.read())
    print(json.dumps({"in_process": engine._in_process, "version": engine.weight_version,
                      "scored": engine.score(ids, 3, 1.0)}))

if __name__ == "__main__":
    main(*sys.argv[1:])
"""


# vLLM-CPU binds each worker of a multi-worker engine to cores it is told.
CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CORES) < 2, reason="a CPU core for each of 2 workers")
def test_a_tensor_parallel_engine_takes_weights_through_files(tmp_path: Path) -> None:
    """TP=2 on the CPU: vLLM's workers run in processes of their own, so new weights reach
    them as safetensors files in a RAM-backed folder (the path every tensor-parallel
    engine takes on GPUs). A set streamed a tensor per bucket serves the new model."""
    config = tiny_qwen3_config(VOCAB)
    config.num_key_value_heads = 2  # KV heads split over the 2 ranks
    old = save_tiny(str(tmp_path / "old"), config, seed=0)
    new = save_tiny(str(tmp_path / "new"), config, seed=1)
    ids = [3, 17, 9, 40, 2, 51, 8]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"{CORES[0]}|{CORES[1]}"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", TP_ENGINE, old, new],
        input=json.dumps(ids),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["in_process"] is False and got["version"] == 3
    reference = AutoModelForCausalLM.from_pretrained(new).eval()
    assert _max_diff(got["scored"], _reference(reference, ids, 3, 1.0)) < 1e-4
    stale = AutoModelForCausalLM.from_pretrained(old).eval()
    assert _max_diff(got["scored"], _reference(stale, ids, 3, 1.0)) > 1e-2


def test_a_sleeping_engine_refuses_work_until_woken(setup: SimpleNamespace) -> None:
    """Sleep frees nothing on the CPU, yet the state is kept: a loop that syncs, scores
    or generates on a sleeping engine fails here as it would on a GPU (where vLLM's
    level-1 wake would put back the weights it offloaded, dropping newer ones loaded
    while asleep). Weights awake is enough to load weights; serving needs it all."""
    from vllm.v1.executor.abstract import SLEEP_TAGS

    from vime.rollout.types import MEMORY_TAGS

    # The parts woken one by one are vLLM's: a tag it had beyond these would stay asleep
    # after a staged wake, and its scheduler would never resume.
    assert set(MEMORY_TAGS) == set(SLEEP_TAGS)
    engine = setup.engine
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    before = engine.generate([PROMPTS[0]], params)[0][0]
    weights = [list(setup.model.state_dict().items())]
    version = engine.weight_version
    engine.sleep()
    try:
        for call in (
            lambda: engine.generate([PROMPTS[0]], params),
            lambda: engine.score(PROMPTS[1], 2, 1.0),
            lambda: engine.update_weights(weights, version),
        ):
            with pytest.raises(RuntimeError, match="asleep; call wake_up"):
                call()
        engine.wake_up(["weights"])
        engine.update_weights(weights, version + 1)
        assert engine.weight_version == version + 1
        with pytest.raises(RuntimeError, match="kv_cache asleep"):
            engine.generate([PROMPTS[0]], params)
    finally:
        engine.wake_up()
    again = engine.generate([PROMPTS[0]], params)[0][0]
    assert again.response_ids == before.response_ids


def test_engine_actor_starts_where_the_checkpoint_window_outgrows_the_kv_cache(
    tmp_path: Path,
) -> None:
    """Qwen3-0.6B's window is 40960 tokens; a model whose KV takes 64 KiB a token needs
    2.5 GiB for one such sequence, more than the CPU KV cache's 1 GiB, and vLLM refuses
    to start on its own window. Given the run's prompt + response length (as the
    trainer passes it) the engine starts with that context and serves."""
    from vime.ray.engines import EngineActor

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        max_position_embeddings=40960,
    )
    checkpoint = save_tiny(str(tmp_path / "wide"), config, seed=0)
    actor = EngineActor("vllm", checkpoint, EngineOptions(seed=0, max_model_len=64 + 8))
    llm = actor.engine._llm
    assert llm.llm_engine.vllm_config.model_config.max_model_len == 72
    out = actor.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert len(out[0][0].response_ids) >= 1


def test_update_weights_with_tied_embeddings(tmp_path: Path) -> None:
    """The embedded default ties lm_head to the embedding: after an update the output
    projection must use the new embedding too (vLLM's reload alone kept the old one)."""
    from vime.data.tasks import CHARSET
    from vime.models.embedded import write_embedded_checkpoint

    folder = write_embedded_checkpoint(str(tmp_path / "tied"), charset=CHARSET, seed=5)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    engine = VLLMEngine(folder, dtype="float32")
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.05 * torch.randn_like(model.lm_head.weight))
    engine.update_weights([list(model.state_dict().items())], version=3)
    ids = [2, 10, 11, 12, 13, 14, 15, 16]
    got = engine.score(ids, 3, 1.0)
    assert _max_diff(got, _reference(model, ids, 3, 1.0)) < 1e-4
    assert engine.weight_version == 3


def test_engine_actor_openmp_sleeps_when_idle(
    setup: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libgomp reads its wait policy when it loads: it must be in the actor's own
    environment from the start, and win over a spinning policy the driver passes on."""
    import ray

    from vime.ray.cluster import init_local_ray
    from vime.ray.engines import EngineGroup
    from vime.ray.placement import Layout, reserve

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # inherited by Ray's workers
    started = not ray.is_initialized()
    if started:
        job_env = {"env_vars": {"VIME_TEST_JOB_VAR": "kept"}}
        init_local_ray(
            num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=job_env
        )
    try:
        layout = Layout(
            num_train=1, num_engines=1, gpus_per_engine=1, colocate=False, use_gpu=False
        )
        group = EngineGroup(
            "vllm", str(setup.root / "model"), reserve(layout), EngineOptions(seed=0)
        )
        pid, _ = ray.get(group.actors[0].ready.remote())
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(
                item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item
            )
        assert environ["OMP_WAIT_POLICY"] == "PASSIVE"
        if started:  # the job's own variables (the trainer sets some) are merged, not dropped
            assert environ.get("VIME_TEST_JOB_VAR") == "kept"
        out = group.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=3))
        assert len(out[0][0].response_ids) >= 1
    finally:
        if started:
            ray.shutdown()
