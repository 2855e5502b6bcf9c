"""entropy_from_logits is the softmax entropy, stays finite at extreme logits, bounds memory.

Proves: values and gradients equal a naive softmax entropy for any chunk size
(including chunks that do not divide the rows) and any leading shape; it stays
exact where the naive formula turns NaN (probabilities underflowing at huge
logit gaps, 1e4 offsets, -inf entries); a row of only -inf has entropy and
gradient 0; gradcheck passes in float64; bf16 is
upcast; a large-vocabulary input works; and autograd saves only the logits and
per-row vectors -- never a [T, V] softmax.
"""

from __future__ import annotations

import pytest
import torch

from vime.algo.entropy import entropy_from_logits


def _naive(logits: torch.Tensor) -> torch.Tensor:
    p = logits.softmax(-1)
    return -(p * p.log()).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
def test_matches_naive_values_and_gradients(chunk_size):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 7, 50, generator=gen, dtype=torch.float64)).requires_grad_(True)
    weights = torch.randn(2, 7, generator=gen, dtype=torch.float64)
    got = entropy_from_logits(logits, chunk_size=chunk_size)
    assert got.shape == (2, 7)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    want = _naive(logits)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


def test_gradcheck_float64():
    logits = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_size=2), (logits,))


def test_one_dimensional_input_gives_a_scalar():
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0])
    got = entropy_from_logits(logits)
    assert got.shape == ()
    torch.testing.assert_close(got, torch.log(torch.tensor(4.0)))


def test_stable_where_probabilities_underflow():
    # exp(-1e4) underflows to 0, and the naive 0 * log 0 is NaN; the true entropy is 0.
    logits = torch.tensor([[0.0, 1e4, 1e4 - 1.0], [0.0, -1e4, -2e4]], requires_grad=True)
    assert torch.isnan(_naive(logits.detach())).any()
    got = entropy_from_logits(logits)
    got.sum().backward()
    two_way = _naive(torch.tensor([1.0, 0.0], dtype=torch.float64)).float()
    torch.testing.assert_close(got.detach(), torch.stack([two_way, torch.tensor(0.0)]))
    assert torch.isfinite(logits.grad).all()


def test_offset_by_1e4_matches_float64_reference():
    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(6, 300, generator=gen) + 1e4).requires_grad_(True)
    got = entropy_from_logits(logits, chunk_size=4)
    (grad,) = torch.autograd.grad(got.sum(), logits)
    ref_in = logits.detach().double().requires_grad_(True)
    ref = _naive(ref_in)
    (ref_grad,) = torch.autograd.grad(ref.sum(), ref_in)
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)


def test_minus_inf_entries_contribute_nothing():
    logits = torch.tensor([[1.0, -float("inf"), 2.0, -float("inf")]], requires_grad=True)
    got = entropy_from_logits(logits)
    got.sum().backward()
    torch.testing.assert_close(got, _naive(torch.tensor([[1.0, 2.0]])))
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 1] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_minus_inf_row_has_zero_entropy_and_gradient(dtype):
    """A fully masked row (every logit -inf) has entropy 0 and gradient 0, not NaN, and
    leaves the other rows of its chunk exact."""
    logits = torch.tensor([[1.0, 2.0, 0.5], [-float("inf")] * 3], dtype=dtype)
    logits.requires_grad_(True)
    got = entropy_from_logits(logits)
    got.sum().backward()
    assert got[1] == 0 and torch.equal(logits.grad[1], torch.zeros_like(logits.grad[1]))
    assert torch.isfinite(logits.grad).all()
    torch.testing.assert_close(got[0], _naive(logits.detach()[:1].float())[0])


def test_bfloat16_is_upcast():
    logits = torch.randn(4, 33).to(torch.bfloat16).requires_grad_(True)
    got = entropy_from_logits(logits)
    got.sum().backward()
    assert got.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, _naive(logits.detach().float()), rtol=1e-5, atol=1e-5)


def test_large_vocabulary_and_saved_tensors_stay_small():
    rows, vocab = 48, 50_000
    logits = torch.randn(rows, vocab, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = entropy_from_logits(logits, chunk_size=16)
    # Only the logits themselves (no copy) and per-row vectors are kept for backward.
    assert all(shape == (rows,) or ptr == logits.data_ptr() for shape, ptr in saved)
    assert sum(shape == (rows, vocab) for shape, _ in saved) == 1
    (grad,) = torch.autograd.grad(got.sum(), logits)
    ref_in = logits.detach().requires_grad_(True)
    ref = _naive(ref_in)
    (ref_grad,) = torch.autograd.grad(ref.sum(), ref_in)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-8)


def test_rejects_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(torch.zeros(2, 3), chunk_size=0)
