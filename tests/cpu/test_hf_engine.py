"""The HF rollout engine samples what it says it samples, with the trainer's log-probs.

Proves: every sampled token's log-prob equals a teacher-forced forward within
1e-5 in fp32 -- the engine's own ``score``, the trainer's packed
``response_log_probs`` and a plain per-sample forward -- for a batch of
prompts of different lengths (left padding) whose rows stop at different
steps; with top-k/top-p, tokens come from the filtered set and their log-probs
are those of the renormalised filtered distribution (as vLLM reports them); a
seed fixes the completions whatever the batch composition, ``max_batch_size``
or ``max_batch_tokens``, and a batch generated in several requests, each
naming its offset in ``first_prompt_index``, draws exactly the tokens of one
request (what lets several engines share a batch); finished rows that ride
along in the batch and are then dropped change nothing; the counter-based
uniforms are murmur3 exactly (published vectors, int64 tensors never
overflowing), uniform (mean, variance, histogram, 53 bits), uncorrelated
between neighbouring rows, steps and seeds, and a row's own whatever else is
computed with it; draws follow the model's distribution (chi-square); by
default a whole rollout is one batch; greedy equals argmax decoding; stop
tokens and ``max_new_tokens`` end completions with the right reason;
``update_weights`` makes the engine serve exactly the new model and advances
``weight_version``, and rejects unknown names, wrong shapes and incomplete
sets; weights loaded from another thread mid-generation land between two decode
steps, the later tokens sampled by them (on the KV cache kept), each completion
naming both versions; a sleeping engine refuses all work, on the CPU too.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.cpu.tiny_models import save_tiny, tiny_qwen3_config
from vime.data.micro_batch import pack_micro_batch, response_log_probs
from vime.rollout.engines import hf_cache, hf_sampling
from vime.rollout.engines.hf import HFEngine
from vime.rollout.engines.hf_sampling import row_keys, uniforms
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
    # Rows a batch: 1, 5 (batches cut inside a prompt's samples), and 4 from a token budget
    # (the longest prompt, 9, + 8 new tokens = 17 positions a row).
    for kwargs in ({"max_batch_size": 1}, {"max_batch_size": 5}, {"max_batch_tokens": 4 * 17}):
        other = HFEngine(checkpoint, **kwargs)
        assert other.rows_per_batch(PROMPTS, params) == kwargs.get("max_batch_size", 4)
        assert_same_draws(other.generate(PROMPTS, params), first)
    # A prompt's completions do not depend on the prompts after it, nor on their order.
    assert_same_draws(engine.generate(PROMPTS[:2], params), first[:2])
    responses = [c.response_ids for c in flat(first)]
    assert len({tuple(r) for r in responses}) > len(PROMPTS)  # samples of a prompt differ
    other = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=12))
    assert [c.response_ids for c in flat(other)] != responses


def test_a_split_batch_draws_what_the_whole_batch_draws(engine, checkpoint) -> None:
    """Seeds follow whole-batch prompt indices: each part of a split batch, told its
    offset, samples exactly its prompts' completions of the unsplit batch, whatever the
    parts' engines batch by; without the offset a part samples others (so the offset is
    what makes them agree)."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=21)
    whole = engine.generate(PROMPTS, params)
    head = engine.generate(PROMPTS[:1], params)
    tail = engine.generate(PROMPTS[1:], dataclasses.replace(params, first_prompt_index=1))
    assert_same_draws(head + tail, whole)
    # Three parts over engines that batch differently (as several engines of a run would).
    small = HFEngine(checkpoint, max_batch_size=3)
    parts = [
        small.generate(PROMPTS[:2], params),
        engine.generate(PROMPTS[2:3], dataclasses.replace(params, first_prompt_index=2)),
        small.generate(PROMPTS[3:], dataclasses.replace(params, first_prompt_index=3)),
    ]
    assert_same_draws([g for part in parts for g in part], whole)
    unshifted = engine.generate(PROMPTS[1:], params)
    assert [c.response_ids for c in flat(unshifted)] != [c.response_ids for c in flat(whole[1:])]


def test_finished_rows_ride_along_and_drop_without_changing_draws(
    engine, checkpoint, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a third of the vocabulary stopping, rows finish at many different steps: they
    ride along, then leave the batch and its cache together (the batch shrinks mid-decode),
    and every completion is the one a batch of that row alone draws."""
    drops: list[int] = []
    select = hf_cache.ReservedLayer.batch_select_indices

    def counted(layer, indices):
        drops.append(len(indices))
        return select(layer, indices)

    monkeypatch.setattr(hf_cache.ReservedLayer, "batch_select_indices", counted)
    params = SamplingParams(
        n=6, temperature=1.0, max_new_tokens=12, stop_token_ids=tuple(range(20, 36)), seed=8
    )
    batched = engine.generate(PROMPTS, params)
    assert drops and min(drops) < len(PROMPTS) * params.n, "no row was ever dropped"
    completions = flat(batched)
    assert len({len(c.response_ids) for c in completions}) >= 3
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    assert_same_draws(HFEngine(checkpoint, max_batch_size=1).generate(PROMPTS, params), batched)
    assert_log_probs_match(engine, reference, completions, temperature=1.0)


def murmur3_32(data: bytes, seed: int) -> int:
    """MurmurHash3 x86_32 of whole 32-bit words, in plain Python integers (unbounded, so
    nothing can overflow): the reference the engine's tensor arithmetic must equal."""
    m = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & m

    h = seed
    for i in range(0, len(data), 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = rotl((k * 0xCC9E2D51) & m, 15) * 0x1B873593 & m
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & m
    h ^= len(data)
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & m
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_uniform_hash_is_murmur3_on_int64_tensors_without_overflow() -> None:
    # Published MurmurHash3_x86_32 vectors.
    assert murmur3_32(b"", 1) == 0x514E28B7
    assert murmur3_32(b"\x00\x00\x00\x00", 0) == 0x2362F9DE
    assert murmur3_32(b"\xff\xff\xff\xff", 0) == 0x76293B50
    assert murmur3_32(b"test", 0) == 0xBA6BD213
    assert murmur3_32(b"\x21\x43\x65\x87", 0x5082EDEE) == 0x2362F9DE
    # The engine's blocks on int64 tensors, for words and seeds spanning all 32 bits
    # (products up to 2**64 would wrap in int64; the 16-bit halves never get there).
    gen = torch.Generator().manual_seed(0)
    words = torch.cat(
        [
            torch.tensor([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]),
            torch.randint(0, 2**32, (59,), generator=gen),
        ]
    )
    seeds = words.flip(0)
    absorb, fmix = hf_sampling._absorb, hf_sampling._fmix32
    h = fmix(absorb(absorb(seeds, words), words.roll(1)) ^ 8)
    expected = [
        murmur3_32(w.to_bytes(4, "little") + v.to_bytes(4, "little"), s)
        for w, v, s in zip(words.tolist(), words.roll(1).tolist(), seeds.tolist(), strict=True)
    ]
    assert h.tolist() == expected


def test_uniforms_are_uniform_independent_and_row_local() -> None:
    rows, steps = 4096, 64
    prompt, sample = torch.arange(rows) // 8, torch.arange(rows) % 8
    u = uniforms(row_keys(123, prompt, sample), 0, steps)
    n = u.numel()
    assert u.shape == (rows, steps) and u.dtype == torch.float64
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # Moments within 6 standard errors: mean 1/2 (var 1/12), variance 1/12 (var 1/180).
    assert abs(float(u.mean()) - 0.5) < 6 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 6 * math.sqrt(1 / 180 / n)
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)
    chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 63 + 6 * math.sqrt(2 * 63), chi2
    # 53 random bits: u * 2**53 is an integer, and its lowest bit is a fair coin.
    scaled = u * 2.0**53
    assert torch.equal(scaled, scaled.floor())
    assert abs(float((scaled.long() & 1).double().mean()) - 0.5) < 6 * math.sqrt(0.25 / n)

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])

    # Neighbouring samples, neighbouring prompts and consecutive steps are uncorrelated.
    bound = 6 / math.sqrt(n)
    assert abs(corr(u[:-1], u[1:])) < bound
    assert abs(corr(u[:-8], u[8:])) < bound
    assert abs(corr(u[:, :-1], u[:, 1:])) < bound
    assert len({tuple(r) for r in u[:, :2].tolist()}) == rows  # no two rows alike
    other_seed = uniforms(row_keys(124, prompt, sample), 0, steps)
    assert abs(corr(u, other_seed)) < bound and not bool((u == other_seed).any())
    # A row's uniforms are its own: the same for any subset or order of rows computed
    # with it, and for any window of steps.
    pick = torch.randperm(rows, generator=torch.Generator().manual_seed(0))[:100]
    assert torch.equal(uniforms(row_keys(123, prompt[pick], sample[pick]), 0, steps), u[pick])
    assert torch.equal(uniforms(row_keys(123, prompt, sample), 10, 20), u[:, 10:30])
    # A seed counts modulo 2**64 (so -1 is 2**64 - 1); a prompt index past 32 bits is
    # taken whole, not truncated.
    big = [2**32 + 5, 5]
    keys = row_keys(2**64 + 123, torch.tensor(big), torch.tensor([0, 0]))
    assert keys[1].tolist() == row_keys(123, torch.tensor([5]), torch.tensor([0]))[0].tolist()
    assert keys[0].tolist() != keys[1].tolist()
    assert (
        row_keys(-1, prompt[:4], sample[:4]).tolist()
        == row_keys(2**64 - 1, prompt[:4], sample[:4]).tolist()
    )


@torch.no_grad()
def test_draws_follow_the_model_distribution(engine, reference) -> None:
    """4000 first tokens of one prompt against the model's softmax at T = 1.5: a
    chi-square over the tokens expected at least 5 times (the rest pooled)."""
    prompt, n, temperature = PROMPTS[2], 4000, 1.5
    params = SamplingParams(n=n, temperature=temperature, max_new_tokens=1, seed=9)
    drawn = Counter(c.response_ids[0] for c in engine.generate([prompt], params)[0])
    probs = torch.softmax(
        reference(input_ids=torch.tensor([prompt])).logits[0, -1] / temperature, -1
    )
    expected = (probs.double() * n).tolist()
    common = [t for t, e in enumerate(expected) if e >= 5]
    rest_expected = n - sum(expected[t] for t in common)
    rest_drawn = n - sum(drawn[t] for t in common)
    chi2 = sum((drawn[t] - expected[t]) ** 2 / expected[t] for t in common)
    if rest_expected >= 5:
        chi2 += (rest_drawn - rest_expected) ** 2 / rest_expected
    df = len(common) - (0 if rest_expected >= 5 else 1)
    assert len(common) >= 5  # a real distribution, not a near-greedy one
    assert chi2 < df + 6 * math.sqrt(2 * df), (chi2, df)


def test_the_default_batch_is_the_whole_request(engine, checkpoint) -> None:
    """The embedded default's rollout shape (64 prompts of 6 tokens x 8, 8 new tokens) is
    one batch; a token budget or a row cap cuts it."""
    prompts = [[3 + k % 20] * 6 for k in range(64)]
    params = SamplingParams(n=8, max_new_tokens=8)
    assert engine.rows_per_batch(prompts, params) >= 64 * 8
    assert HFEngine(checkpoint, max_batch_tokens=100 * 14).rows_per_batch(prompts, params) == 100
    capped = HFEngine(checkpoint, max_batch_tokens=100 * 14, max_batch_size=7)
    assert capped.rows_per_batch(prompts, params) == 7
    with pytest.raises(ValueError, match="max_batch_tokens"):
        HFEngine(checkpoint, max_batch_tokens=0)


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
    # A stop id the model cannot emit changes nothing.
    far = SamplingParams(n=4, max_new_tokens=3, seed=5, stop_token_ids=(10_000,))
    assert flat(engine.generate(PROMPTS, far)) == sampled
    empty = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=0))
    assert empty == [[Completion(PROMPTS[0], [], [], "length")]]


@torch.no_grad()
def perturbed(checkpoint: str, seed: int) -> torch.nn.Module:
    """The checkpoint's model with every weight moved by N(0, 0.1²) noise."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def test_update_weights_serves_the_new_model(checkpoint: str) -> None:
    engine = HFEngine(checkpoint)
    new_model = perturbed(checkpoint, seed=0)
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


def test_weights_loaded_mid_generation_sample_the_tokens_after(checkpoint: str) -> None:
    """A load from another thread while ``generate`` runs lands between two decode steps:
    the rows go on, every token up to that step has the old model's log-prob, every later
    one the new model's on the KV cache the old one wrote, and each records (0, 5)."""
    engine = HFEngine(checkpoint)
    new_model = perturbed(checkpoint, seed=1)
    named = [(n, t.clone()) for n, t in new_model.state_dict().items()]
    switch_after = 2  # forwards 0 (prefill), 1, 2 run on the old weights
    forwards = 0
    loader = threading.Thread(target=engine.update_weights, args=([named], 5))

    def hook(module, args, output) -> None:
        nonlocal forwards
        if forwards == switch_after:  # still inside forward 2's step: the load must wait
            loader.start()
            while engine.gate.loads_waiting == 0:
                threading.Event().wait(0.001)
        forwards += 1

    handle = engine.model.register_forward_hook(hook)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    try:
        out = flat(engine.generate(PROMPTS, params))
    finally:
        handle.remove()
        loader.join(timeout=30)
    assert engine.weight_version == 5
    old_model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    long_ones = [c for c in out if len(c.response_ids) > switch_after + 1]
    assert long_ones, "no completion outlived the switch; pick another seed"
    for c in out:
        assert c.weight_versions == ((0, 5) if c in long_ones else (0, 0))
    k = switch_after + 1  # tokens 0..k-1 were sampled before the load
    for c, old in zip(long_ones, trainer_log_probs(old_model, long_ones, 1.0), strict=True):
        got = torch.tensor(c.log_probs)
        torch.testing.assert_close(got[:k], old[:k], rtol=0, atol=1e-5)
        # Later tokens: the new weights reading the KV cache the old ones wrote (kept).
        kept = kept_cache_log_probs(old_model, new_model, c, len(c.prompt_ids) + k - 1)
        torch.testing.assert_close(got[k:], kept, rtol=0, atol=1e-5)
        assert (got[k:] - old[k:]).abs().max() > 1e-3  # the old model alone is told apart


@torch.no_grad()
def kept_cache_log_probs(old_model, new_model, c: Completion, switch: int) -> torch.Tensor:
    """Log-probs of the response tokens after position ``switch``: positions before it
    cached by ``old_model``, the rest run by ``new_model`` on that cache."""
    ids = torch.tensor([c.prompt_ids + c.response_ids])
    cache = old_model(input_ids=ids[:, :switch], use_cache=True).past_key_values
    logits = new_model(input_ids=ids[:, switch:-1], past_key_values=cache).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, ids[0, switch + 1 :, None]).squeeze(-1)


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
    again = flat(engine.generate(PROMPTS, params))
    assert [dataclasses.replace(c, weight_versions=None) for c in again] == [
        dataclasses.replace(c, weight_versions=None) for c in before
    ]
