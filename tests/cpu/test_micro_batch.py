"""Packed rows have the documented layout, and packed log-probs equal unpacked ones.

Proves: ``pack_micro_batch`` lays out input ids, position ids restarting per
sample, int32 cu_seqlens, prompt/response lengths, loss masks and right padding
as documented, rejects bad input, and builds a dummy row for an empty
micro-batch; ``response_log_probs`` equals a per-token loop reference (with
temperature, masks, entropy). The key numeric check: on a tiny random Qwen3
model (fp32), log-probs, entropies and parameter gradients from ONE
packed forward -- with transformers' ``sdpa`` under its block mask and with
vime's ``varlen_sdpa`` -- equal those of per-sample unpacked ``sdpa`` forwards
within 1e-5, with padding present -- and only with ``use_cache=False``, which
``PackedBatch.model_inputs`` always passes (the test shows the silent
cross-sample attention without it). Shared prompts: the row holds each distinct
prompt once, responses continue its positions, the per-sample fields keep the
samples' order, and under ``varlen_sdpa`` its log-probs, entropies and gradients
equal the per-sample forwards' as the unshared row's do; an attention that takes
``cu_seqlens`` is refused such a row. Multi-turn loss masks (environment tokens inside
a response) keep their holes on the right tokens, shared prompts or not.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3_config
from transformers import Qwen3ForCausalLM

from vime.backends import varlen_attention
from vime.data.micro_batch import pack_micro_batch, response_log_probs

SAMPLES = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
PROMPTS = [2, 1, 4]


def test_layout_of_a_packed_row():
    batch = pack_micro_batch(SAMPLES, PROMPTS, [[1, 0, 1], [1, 1], [0, 1, 1]])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, *range(13, 20)]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]]
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == [0, 5, 8, 15]
    assert batch.prompt_lengths.tolist() == PROMPTS
    assert batch.response_lengths.tolist() == [3, 2, 3]
    assert batch.loss_mask.tolist() == [[1, 0, 1], [1, 1, 0], [0, 1, 1]]
    assert (batch.num_samples, batch.max_seqlen, batch.pad_length) == (3, 7, 0)
    assert batch.run_cu_seqlens().tolist() == [0, 5, 8, 15] and batch.max_run_length == 7
    assert batch.input_ids.dtype == batch.position_ids.dtype == torch.long


def test_layout_of_a_row_with_shared_prompts():
    samples = [[5, 6, 7, 8], [9, 1], [5, 6, 2, 3, 4], [5, 6, 7]]  # 0, 2 and 3 share [5, 6]
    batch = pack_micro_batch(samples, [2, 1, 2, 2], share_prompts=True, pad_to_multiple_of=4)
    assert batch.shares_prompts
    # A prompt's samples sit together: [5, 6] + responses of 0, 2, 3, then sample 1.
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 2, 3, 4, 7, 9, 1, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4, 2, 0, 1, 0, 1]]
    assert batch.response_starts.tolist() == [2, 9, 4, 7]
    assert batch.prompt_ends.tolist() == [1, 8, 1, 1]
    assert batch.response_lengths.tolist() == [2, 1, 3, 1] and batch.pad_length == 2
    with pytest.raises(ValueError, match="share_prompts=False"):
        batch.run_cu_seqlens()
    alone = pack_micro_batch(samples[:2], [2, 1], share_prompts=True)
    assert not alone.shares_prompts  # nothing to share: the ordinary row
    assert alone.input_ids.tolist() == [[5, 6, 7, 8, 9, 1]]


def test_default_loss_mask_and_padding():
    batch = pack_micro_batch(SAMPLES, PROMPTS, pad_to_multiple_of=8)
    assert batch.row_length == 16 and batch.pad_length == 1
    assert batch.input_ids[0, -1] == 0 and batch.position_ids[0, -1] == 0
    assert batch.cu_seqlens.tolist() == [0, 5, 8, 15]  # padding is not a sample
    assert batch.run_cu_seqlens().tolist() == [0, 5, 8, 15, 16]  # ... but is a run
    assert batch.run_cu_seqlens().dtype == torch.int32
    assert batch.loss_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    longer = pack_micro_batch([[1, 2, 3]], [1], pad_to_multiple_of=8)
    assert longer.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]


def test_empty_micro_batch_is_a_dummy_row_with_a_gradient_path():
    batch = pack_micro_batch([], [], pad_to_multiple_of=4)
    assert batch.num_samples == 0 and batch.row_length == 4 and batch.pad_length == 4
    assert batch.cu_seqlens.tolist() == [0] and tuple(batch.loss_mask.shape) == (0, 0)
    assert batch.run_cu_seqlens().tolist() == [0, 4] and batch.max_run_length == 4
    logits = torch.randn(1, 4, 9, requires_grad=True)
    logp, ent = response_log_probs(logits, batch, with_entropy=True)
    assert logp.shape == ent.shape == (0, 0)
    (logp.sum() + ent.sum()).backward()  # the zero-weight backward a filler rank runs
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([[1, 2]], [0]), "prompt_length"),
        (([[1, 2]], [3]), "prompt_length"),
        (([[1, 2]], [1, 1]), "prompt_lengths"),
        (([[1, 2, 3]], [1], [[1]]), "loss mask has 1"),
        (([[1, 2, 3]], [1], [[1, 2]]), "0/1"),
        (([[1, 2, 3]], [1], None, 0), "pad_to_multiple_of"),
    ],
)
def test_bad_input_raises(args, match):
    with pytest.raises(ValueError, match=match):
        pack_micro_batch(*args)


def test_log_probs_match_a_per_token_loop():
    batch = pack_micro_batch(SAMPLES, PROMPTS, [[1, 0, 1], [1, 1], [0, 1, 1]], 4)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch.row_length, 23, generator=gen, dtype=torch.float64)
    temp = 0.7
    logp, ent = response_log_probs(logits.unsqueeze(0), batch, temperature=temp, with_entropy=True)
    logp2d, none = response_log_probs(logits, batch, temperature=temp)
    assert none is None and torch.equal(logp, logp2d)
    start = 0
    for i, ids in enumerate(SAMPLES):
        for t in range(len(ids) - PROMPTS[i]):
            pos = start + PROMPTS[i] + t
            dist = torch.log_softmax(logits[pos - 1] / temp, -1)
            on = bool(batch.loss_mask[i, t])
            want_ent = -(dist.exp() * dist).sum()
            assert logp[i, t].item() == pytest.approx(dist[ids[pos - start]].item() if on else 0.0)
            assert ent[i, t].item() == pytest.approx(want_ent.item() if on else 0.0)
        start += len(ids)
    assert logp[1, 2] == 0 and ent[1, 2] == 0  # past the end of sample 1's response


def test_rejects_mismatched_logits():
    batch = pack_micro_batch(SAMPLES, PROMPTS)
    with pytest.raises(ValueError, match="do not match"):
        response_log_probs(torch.randn(batch.row_length + 1, 5), batch)
    with pytest.raises(ValueError, match="batch dim 1"):
        response_log_probs(torch.randn(2, batch.row_length, 5), batch)
    with pytest.raises(ValueError, match="temperature"):
        response_log_probs(torch.randn(batch.row_length, 5), batch, temperature=0.0)


# --- the key numeric check on a real transformers model ---------------------------------------


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = tiny_qwen3_config(64)
    return Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").float().eval()


@pytest.fixture(scope="module", params=["sdpa", varlen_attention.HF_NAME])
def packed_model(request, model):
    """``model``'s weights under each attention implementation a packed row can take."""
    varlen_attention.register_hf()
    twin = Qwen3ForCausalLM._from_config(tiny_qwen3_config(64), attn_implementation=request.param)
    twin.load_state_dict(model.state_dict())
    assert twin.config._attn_implementation == request.param
    return twin.float().eval()


def _grouped_samples(seed: int):
    """Two prompts with three responses each, and one sample of its own."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(0, 64, (n,), generator=gen).tolist()

    ids, prompts = [], []
    for p, responses in ((4, [3, 1, 5]), (2, [2, 4, 1])):
        prompt = rand(p)
        ids += [prompt + rand(r) for r in responses]
        prompts += [p] * len(responses)
    return [*ids, rand(6)], [*prompts, 3]


@pytest.mark.parametrize("seed", [4, 5])
def test_shared_prompts_equal_per_sample_forwards(model, seed):
    varlen_attention.register_hf()
    twin = Qwen3ForCausalLM._from_config(
        tiny_qwen3_config(64), attn_implementation=varlen_attention.HF_NAME
    )
    twin.load_state_dict(model.state_dict())
    twin.float().eval()
    ids, prompts = _grouped_samples(seed)
    # Interleave the groups, as a planner may: a prompt is shared wherever its samples sit.
    order = [0, 3, 6, 1, 4, 2, 5]
    ids, prompts = [ids[i] for i in order], [prompts[i] for i in order]
    batch = pack_micro_batch(ids, prompts, pad_to_multiple_of=8, share_prompts=True)
    assert batch.shares_prompts and batch.row_length < sum(map(len, ids))
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(seed))
    logits = twin(**batch.model_inputs()).logits
    logp, ent = response_log_probs(logits, batch, temperature=0.8, with_entropy=True)
    shared = torch.autograd.grad((weights * (logp + 0.1 * ent)).sum(), list(twin.parameters()))
    want_logp, want_ent = _unpacked(model, ids, prompts, 0.8)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)
    unpacked = torch.autograd.grad(
        (weights * (want_logp + 0.1 * want_ent)).sum(), list(model.parameters())
    )
    for got, want in zip(shared, unpacked, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _random_samples(seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = [9, 4, 13, 6]
    prompts = [3, 1, 5, 2]
    ids = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in lengths]
    return ids, prompts


def _unpacked(model, ids, prompts, temperature):
    """Reference: every sample forwarded alone, no packing involved."""
    logps, ents = [], []
    for tokens, p in zip(ids, prompts, strict=True):
        single = pack_micro_batch([tokens], [p])
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits
        lp, ent = response_log_probs(logits, single, temperature=temperature, with_entropy=True)
        logps.append(lp[0])
        ents.append(ent[0])
    pad = torch.nn.utils.rnn.pad_sequence
    return pad(logps, batch_first=True), pad(ents, batch_first=True)


def test_packed_forward_equals_unpacked_forward(model, packed_model):
    ids, prompts = _random_samples(0)
    batch = pack_micro_batch(ids, prompts, pad_to_multiple_of=12)
    assert batch.pad_length > 0
    with torch.no_grad():
        logits = packed_model(**batch.model_inputs()).logits
        logp, ent = response_log_probs(logits, batch, temperature=0.8, with_entropy=True)
        want_logp, want_ent = _unpacked(model, ids, prompts, 0.8)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)


def test_packing_needs_use_cache_false(model):
    # The pitfall model_inputs() guards against: with a KV cache (the default in
    # eval mode), transformers ignores the position_ids restarts and the packed
    # samples attend to each other -- silently wrong log-probs, no error.
    ids, prompts = _random_samples(1)
    batch = pack_micro_batch(ids, prompts)
    assert batch.model_inputs()["use_cache"] is False
    with torch.no_grad():
        cached = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        logp, _ = response_log_probs(cached, batch)
        want, _ = _unpacked(model, ids, prompts, 1.0)
    assert (logp - want).abs().max() > 1e-2


def test_gradient_through_packed_log_probs_equals_per_sample_gradient(model, packed_model):
    ids, prompts = _random_samples(2)
    batch = pack_micro_batch(ids, prompts, pad_to_multiple_of=10)
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(3))
    params = [p for p in model.parameters() if p.requires_grad]
    packed_params = [p for p in packed_model.parameters() if p.requires_grad]

    logits = packed_model(**batch.model_inputs()).logits
    logp, ent = response_log_probs(logits, batch, with_entropy=True)
    packed = torch.autograd.grad((weights * (logp + 0.1 * ent)).sum(), packed_params)

    want_logp, want_ent = _unpacked(model, ids, prompts, 1.0)
    unpacked = torch.autograd.grad((weights * (want_logp + 0.1 * want_ent)).sum(), params)
    for got, want in zip(packed, unpacked, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# Multi-turn loss masks for _grouped_samples' responses (3, 1, 5; 2, 4, 1; 3 tokens):
# environment tokens (0) inside the responses, a response ending on them, one all 0.
TURN_MASKS = [[1, 0, 1], [1], [1, 0, 0, 1, 1], [0, 1], [1, 0, 1, 0], [0], [1, 1, 0]]


@pytest.mark.parametrize("share_prompts", [False, True])
def test_mask_holes_stay_at_their_tokens(model, share_prompts):
    """Interior zeros of multi-turn loss masks land on the same response tokens after
    packing (with or without shared prompts): the packed mask is each sample's mask, and
    a packed forward's log-probs and entropies are the per-sample forward's at mask-1
    tokens and exactly 0 at mask-0 ones."""
    varlen_attention.register_hf()
    twin = Qwen3ForCausalLM._from_config(
        tiny_qwen3_config(64), attn_implementation=varlen_attention.HF_NAME
    )
    twin.load_state_dict(model.state_dict())
    twin.float().eval()
    ids, prompts = _grouped_samples(6)
    order = [0, 3, 6, 1, 4, 2, 5]  # groups interleaved, as a planner may place them
    ids, prompts = [ids[i] for i in order], [prompts[i] for i in order]
    masks = [TURN_MASKS[i] for i in order]
    batch = pack_micro_batch(ids, prompts, masks, pad_to_multiple_of=8, share_prompts=share_prompts)
    assert batch.shares_prompts == share_prompts
    width = batch.loss_mask.shape[1]
    assert batch.loss_mask.tolist() == [m + [0] * (width - len(m)) for m in masks]
    for i, (tokens, p) in enumerate(zip(ids, prompts, strict=True)):
        start = int(batch.response_starts[i])  # the response sits there, env tokens too
        assert batch.input_ids[0, start : start + len(tokens) - p].tolist() == tokens[p:]
        assert int(batch.input_ids[0, batch.prompt_ends[i]]) == tokens[p - 1]
    with torch.no_grad():
        logits = twin(**batch.model_inputs()).logits
        logp, ent = response_log_probs(logits, batch, temperature=0.8, with_entropy=True)
        want_logp, want_ent = _unpacked(model, ids, prompts, 0.8)
    mask = batch.loss_mask
    assert bool((want_logp[mask == 0] != 0).any())  # the zeros below come from the mask
    torch.testing.assert_close(logp, want_logp * mask, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, want_ent * mask, rtol=0, atol=1e-5)
    assert bool((logp[mask == 0] == 0).all()) and bool((ent[mask == 0] == 0).all())
