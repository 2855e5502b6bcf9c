"""The HF rollout engine samples what it says it samples, with the trainer's log-probs.

Proves: every sampled token's log-prob equals a teacher-forced forward within
1e-5 in fp32 -- the engine's own ``score``, the trainer's packed
``response_log_probs`` and a plain per-sample forward -- for a batch of
prompts of different lengths (left padding) whose rows stop at different
steps; with top-k/top-p, tokens come from the filtered set and their log-probs
are those of the renormalised filtered distribution (as vLLM reports them); a
seed fixes the completions whatever the batch composition or ``max_batch_size``,
and a batch generated in two requests, the second naming its offset in
``first_prompt_index``, draws exactly the tokens of one request (what lets
several engines share a batch); greedy equals argmax decoding; stop tokens and
``max_new_tokens`` end completions with the right reason; ``update_weights``
makes the engine serve exactly the new model and advances ``weight_version``,
and rejects unknown names, wrong shapes and incomplete sets; a sleeping engine
refuses all work, on the CPU too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.cpu.tiny_models import save_tiny, tiny_qwen3_config
from vime.data.micro_batch import pack_micro_batch, response_log_probs
from vime.rollout.hf_engine import HFEngine
from vime.rollout.types import Completion, SamplingParams

EOS = 1
# Lengths 1..9: the batch is left-padded by up to 8 tokens.
PROMPTS = [[5, 9, 14, 3, 22, 7, 30, 2, 11], [17], [4, 4, 8], [40, 2, 33, 12, 6, 19]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Matmuls this small gain nothing from threads, and on shared cores threads stall each
    other many-fold; restored afterwards so other test modules keep their setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = tiny_qwen3_config(vocab_size=48, tie=True)
    # A wide init makes next-token distributions peaked, so log-prob checks are sharp.
    config.initializer_range = 0.3
    config.eos_token_id, config.pad_token_id = EOS, 0
    return save_tiny(str(tmp_path_factory.mktemp("hf_engine") / "model"), config, seed=7)


@pytest.fixture(scope="module")
def engine(checkpoint: str) -> HFEngine:
    return HFEngine(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


def flat(groups: list[list[Completion]]) -> list[Completion]:
    return [c for group in groups for c in group]


def assert_same_draws(got: list[list[Completion]], expected: list[list[Completion]]) -> None:
    """Same tokens and reasons; log-probs equal up to float rounding (BLAS sums depend on
    the batch shape, so only an identical batch gives bitwise-identical numbers)."""
    assert [[(c.response_ids, c.finish_reason) for c in g] for g in got] == [
        [(c.response_ids, c.finish_reason) for c in g] for g in expected
    ]
    for a, b in zip(flat(got), flat(expected), strict=True):
        torch.testing.assert_close(
            torch.tensor(a.log_probs), torch.tensor(b.log_probs), rtol=0, atol=1e-5
        )


@torch.no_grad()
def trainer_log_probs(model: torch.nn.Module, completions: list[Completion], temperature: float):
    """What the trainer computes: one packed row, ``use_cache=False``, response log-probs."""
    batch = pack_micro_batch(
        [c.prompt_ids + c.response_ids for c in completions],
        [len(c.prompt_ids) for c in completions],
    )
    logits = model(**batch.model_inputs()).logits
    log_probs, _ = response_log_probs(logits, batch, temperature=temperature)
    return [log_probs[i, : len(c.response_ids)] for i, c in enumerate(completions)]


@torch.no_grad()
def plain_log_probs(model: torch.nn.Module, c: Completion, temperature: float) -> torch.Tensor:
    ids = torch.tensor([c.prompt_ids + c.response_ids])
    logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)[len(c.prompt_ids) - 1 : -1]
    return logp.gather(-1, ids[0, len(c.prompt_ids) :, None]).squeeze(-1)


def assert_log_probs_match(engine, reference, completions, temperature) -> None:
    trainer = trainer_log_probs(reference, completions, temperature)
    for c, from_trainer in zip(completions, trainer, strict=True):
        got = torch.tensor(c.log_probs)
        assert len(c.log_probs) == len(c.response_ids) > 0
        scored = engine.score(c.prompt_ids + c.response_ids, len(c.prompt_ids), temperature)
        torch.testing.assert_close(got, torch.tensor(scored), rtol=0, atol=1e-5)
        torch.testing.assert_close(got, from_trainer, rtol=0, atol=1e-5)
        torch.testing.assert_close(
            got, plain_log_probs(reference, c, temperature), rtol=0, atol=1e-5
        )


def test_sampled_log_probs_match_teacher_forcing_with_left_padding(engine, reference) -> None:
    # Stop tokens make rows finish at different steps, so the batch shrinks mid-decode.
    params = SamplingParams(
        n=3, temperature=0.8, max_new_tokens=10, stop_token_ids=(20, 21), seed=1
    )
    groups = engine.generate(PROMPTS, params)
    assert [len(g) for g in groups] == [3] * len(PROMPTS)
    completions = flat(groups)
    assert all(c.prompt_ids == PROMPTS[i // 3] for i, c in enumerate(completions))
    reasons = {c.finish_reason for c in completions}
    assert reasons == {"stop", "length"}, reasons
    assert_log_probs_match(engine, reference, completions, temperature=0.8)


@torch.no_grad()
def truncated_log_probs(
    model: torch.nn.Module, c: Completion, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Each response token's log-prob under the distribution it was drawn from: softmax
    at ``temperature`` over the top-k tokens, then over the smallest most-likely set of
    those whose mass reaches ``top_p``, renormalised (written here apart from the engine's
    ``filter_logits``)."""
    ids = torch.tensor([c.prompt_ids + c.response_ids])
    steps = model(input_ids=ids).logits[0].float()[len(c.prompt_ids) - 1 : -1] / temperature
    out = []
    for logits, token in zip(steps, c.response_ids, strict=True):
        order = logits.argsort(descending=True)[:top_k]
        probs = torch.softmax(logits[order], dim=-1)
        mass, keep = 0.0, 0
        while mass < top_p and keep < len(order):
            mass += float(probs[keep])
            keep += 1
        kept = order[:keep].tolist()
        assert token in kept, "drawn from outside the filtered set"
        out.append(torch.log_softmax(logits[order[:keep]], dim=-1)[kept.index(token)])
    return torch.stack(out)


def test_top_k_top_p_log_probs_are_of_the_filtered_distribution(engine, reference) -> None:
    """With top-k / top-p on, tokens come from the filtered set and their log-probs are
    those of the renormalised filtered distribution (what vLLM reports too), which is
    above the full-vocabulary log-prob the trainer computes."""
    params = SamplingParams(n=4, temperature=1.5, top_k=3, top_p=0.9, max_new_tokens=8, seed=2)
    completions = flat(engine.generate(PROMPTS, params))
    full = trainer_log_probs(reference, completions, temperature=1.5)
    truncated = 0
    for c, trainer in zip(completions, full, strict=True):
        expected = truncated_log_probs(reference, c, 1.5, top_k=3, top_p=0.9)
        got = torch.tensor(c.log_probs)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        assert bool((got >= trainer - 1e-5).all())
        truncated += int((got > trainer + 1e-3).sum())
    assert truncated > 0, "the filter never removed any mass: the test proves nothing"
    # top_k=1 leaves one candidate: the draw is the greedy token, with probability 1.
    greedy = flat(engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6)))
    top1 = flat(
        engine.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_new_tokens=6))
    )
    assert [c.response_ids for c in top1] == [c.response_ids for c in greedy]
    assert all(lp == 0.0 for c in top1 for lp in c.log_probs)
    # Unfiltered sampling is unchanged: the full-vocabulary log-prob, as the trainer's.
    plain = flat(engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.5, seed=2)))
    assert_log_probs_match(engine, reference, plain, temperature=1.5)


def test_seed_fixes_completions_whatever_the_batching(engine, checkpoint) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=11)
    first = engine.generate(PROMPTS, params)
    assert engine.generate(PROMPTS, params) == first
    for size in (1, 5):
        assert_same_draws(
            HFEngine(checkpoint, max_batch_size=size).generate(PROMPTS, params), first
        )
    # A prompt's completions do not depend on the prompts after it.
    assert_same_draws(engine.generate(PROMPTS[:2], params), first[:2])
    responses = [c.response_ids for c in flat(first)]
    assert len({tuple(r) for r in responses}) > len(PROMPTS)  # samples of a prompt differ
    other = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=12))
    assert [c.response_ids for c in flat(other)] != responses


def test_a_split_batch_draws_what_the_whole_batch_draws(engine) -> None:
    """Seeds follow whole-batch prompt indices: the second part of a split batch, told its
    offset, samples exactly its prompts' completions of the unsplit batch; without the
    offset it samples others (so the offset is what makes the two agree)."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=21)
    whole = engine.generate(PROMPTS, params)
    head = engine.generate(PROMPTS[:1], params)
    tail = engine.generate(PROMPTS[1:], dataclasses.replace(params, first_prompt_index=1))
    assert_same_draws(head + tail, whole)
    unshifted = engine.generate(PROMPTS[1:], params)
    assert [c.response_ids for c in flat(unshifted)] != [c.response_ids for c in flat(whole[1:])]


@torch.no_grad()
def test_greedy_equals_argmax_decoding(engine, reference) -> None:
    groups = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=9))
    for prompt, (a, b) in zip(PROMPTS, groups, strict=True):
        assert a.response_ids == b.response_ids
        ids = list(prompt)
        for _ in range(9):
            nxt = int(reference(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == EOS:
                break
        assert a.response_ids == ids[len(prompt) :]
        assert a.finish_reason == ("stop" if ids[-1] == EOS else "length")
    assert_log_probs_match(engine, reference, flat(groups), temperature=1.0)


def test_stop_tokens_and_max_new_tokens(engine) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=9)
    full = [g[0].response_ids for g in engine.generate(PROMPTS, greedy)]
    # Stopping on each prompt's third greedy token cuts it there, stop token kept.
    stops = tuple(r[2] for r in full)
    cut = engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=9, stop_token_ids=stops)
    )
    for r, (c,) in zip(full, cut, strict=True):
        first_stop = next(k for k, t in enumerate(r) if t in stops)
        assert c.response_ids == r[: first_stop + 1]
        assert c.finish_reason == "stop" and len(c.log_probs) == len(c.response_ids)

    sampled = flat(engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=3, seed=5)))
    for c in sampled:
        assert len(c.response_ids) <= 3
        ended_by_eos = c.response_ids[-1] == EOS
        assert c.finish_reason == ("stop" if ended_by_eos else "length")
        assert ended_by_eos or len(c.response_ids) == 3
        assert EOS not in c.response_ids[:-1]
    empty = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=0))
    assert empty == [[Completion(PROMPTS[0], [], [], "length")]]


def test_update_weights_serves_the_new_model(checkpoint: str) -> None:
    engine = HFEngine(checkpoint)
    new_model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    # HF names as a trainer sends them: tied embeddings under lm_head only, in small buckets.
    named = [(n, t) for n, t in new_model.state_dict().items() if n != "model.embed_tokens.weight"]
    assert any(n == "lm_head.weight" for n, _ in named)
    buckets = [named[k : k + 5] for k in range(0, len(named), 5)]

    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    before = flat(engine.generate(PROMPTS, params))
    engine.update_weights(iter(buckets), version=7)
    assert engine.weight_version == 7
    after = flat(engine.generate(PROMPTS, params))
    assert [c.log_probs for c in after] != [c.log_probs for c in before]
    assert_log_probs_match(engine, new_model, after, temperature=1.0)
    old_model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    stale = trainer_log_probs(old_model, after, 1.0)
    assert (
        max((torch.tensor(c.log_probs) - s).abs().max() for c, s in zip(after, stale, strict=True))
        > 1e-2
    )


def test_update_weights_rejects_bad_sets(checkpoint: str) -> None:
    engine = HFEngine(checkpoint)
    state = engine.model.state_dict()
    good = [(n, t.clone()) for n, t in state.items()]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.bogus"):
        engine.update_weights([[*good, ("model.layers.0.mlp.bogus", torch.zeros(1))]], version=1)
    with pytest.raises(ValueError, match=r"model.norm.weight.*shape \(3,\)"):
        engine.update_weights([[("model.norm.weight", torch.zeros(3))]], version=1)
    with pytest.raises(ValueError, match="not sent"):
        engine.update_weights([good[:3]], version=1)
    assert engine.weight_version == 0
    engine.update_weights([good], version=2)
    assert engine.weight_version == 2


def test_rejects_unusable_requests(engine) -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[3], []], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[3, 480]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[3]], SamplingParams(top_p=0.0))


def test_a_sleeping_engine_refuses_work_on_cpu_too(checkpoint: str) -> None:
    """Sleep frees nothing on the CPU, but the engine still refuses to generate, score or
    load weights until woken (as on CUDA, where its weights are on the host): a loop that
    syncs or evaluates a sleeping engine fails here, not first on a GPU. Waking the KV
    cache alone does not wake it (it keeps none); a full wake serves as before."""
    engine = HFEngine(checkpoint)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=4)
    before = flat(engine.generate(PROMPTS, params))
    weights = [list(engine.model.state_dict().items())]
    engine.sleep()
    engine.sleep()  # idempotent
    for call in (
        lambda: engine.generate(PROMPTS, params),
        lambda: engine.score([3, 4, 5], 1, 1.0),
        lambda: engine.update_weights(weights, version=1),
    ):
        with pytest.raises(RuntimeError, match="asleep; call wake_up"):
            call()
    engine.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="asleep"):
        engine.score([3, 4, 5], 1, 1.0)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        engine.wake_up(["everything"])
    engine.wake_up()
    engine.update_weights(weights, version=1)
    assert engine.weight_version == 1
    assert flat(engine.generate(PROMPTS, params)) == before
