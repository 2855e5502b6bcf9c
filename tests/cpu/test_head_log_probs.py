"""head_log_probs equals the unfused LM head -> full-vocabulary log-softmax, chunk by chunk.

Proves: for random shapes from seeds (vocabularies a chunk does not divide, fewer
rows than a chunk, one row per chunk, temperatures), the log-probs, the entropies
and the gradients w.r.t. hidden states and head weight equal the reference --
``hidden @ W.T``, upcast, tempered, ``full_vocab_token_stats`` -- to float32
rounding (float64: 1e-12); a tied head (the embedding is the head) gets the sum of
both gradients; zero upstream gradients (zero advantages, masked positions) give
exactly zero; entropy not asked for is not computed and not differentiable; empty
input still backpropagates; a row of only -inf logits has entropy 0 and no NaN
gradient; gradcheck passes in float64; bf16 inputs compute in
float32; and autograd saves no ``[n, V]`` tensor.
"""

from __future__ import annotations

import pytest
import torch

from vime.algo.head_log_probs import default_chunk_rows, head_log_probs
from vime.data.micro_batch import full_vocab_token_stats


def _reference(hidden, weight, targets, temperature, with_entropy):
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32))
    return full_vocab_token_stats(logits / temperature, targets, with_entropy)


def _case(seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (), generator=gen))
    h = int(torch.randint(2, 24, (), generator=gen))
    vocab = int(torch.randint(2, 300, (), generator=gen))
    chunk = int(torch.randint(1, 2 * n + 2, (), generator=gen))
    temperature = float(torch.empty(()).uniform_(0.3, 2.0, generator=gen))
    hidden = torch.randn(n, h, generator=gen, dtype=dtype)
    weight = torch.randn(vocab, h, generator=gen, dtype=dtype) / h**0.5
    targets = torch.randint(0, vocab, (n,), generator=gen)
    g_logp = torch.randn(n, generator=gen, dtype=dtype)
    g_ent = torch.randn(n, generator=gen, dtype=dtype)
    return hidden, weight, targets, chunk, temperature, g_logp, g_ent


def _grads(fn, hidden, weight, g_logp, g_ent, with_entropy):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    logp, entropy = fn(hidden, weight)
    loss = (logp * g_logp).sum() + ((entropy * g_ent).sum() if with_entropy else 0)
    return (logp, entropy, *torch.autograd.grad(loss, (hidden, weight)))


def _compare(seed: int, dtype: torch.dtype, with_entropy: bool, tol: float) -> None:
    hidden, weight, targets, chunk, tau, g_logp, g_ent = _case(seed, dtype)
    runs = [
        _grads(fn, hidden, weight, g_logp, g_ent, with_entropy)
        for fn in (
            lambda x, w: head_log_probs(
                x, w, targets, temperature=tau, with_entropy=with_entropy, chunk_size=chunk
            ),
            lambda x, w: _reference(x, w, targets, tau, with_entropy),
        )
    ]
    for a, b in zip(*runs, strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("with_entropy", [False, True])
def test_matches_unfused_reference(seed, with_entropy):
    _compare(seed, torch.float32, with_entropy, 1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_float64_is_exact(seed):
    _compare(100 + seed, torch.float64, True, 1e-12)


def test_fewer_rows_than_a_chunk_and_one_row_per_chunk_agree():
    hidden, weight, targets, _, tau, g_logp, g_ent = _case(7)
    runs = [
        _grads(
            lambda x, w, c=c: head_log_probs(
                x, w, targets, temperature=tau, with_entropy=True, chunk_size=c
            ),
            hidden,
            weight,
            g_logp,
            g_ent,
            True,
        )
        for c in (1, hidden.shape[0] + 5)
    ]
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_tied_head_gets_the_embedding_and_head_gradients():
    gen = torch.Generator().manual_seed(3)
    vocab, h = 37, 8
    emb = torch.nn.Embedding(vocab, h)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(vocab, h, generator=gen))
    ids = torch.randint(0, vocab, (11,), generator=gen)
    targets = torch.randint(0, vocab, (11,), generator=gen)
    coef = torch.randn(11, generator=gen)

    def grad(fn):
        emb.weight.grad = None
        hidden = torch.tanh(emb(ids))
        logp, entropy = fn(hidden, emb.weight)
        ((logp * coef).sum() - 0.1 * entropy.sum()).backward()
        return emb.weight.grad.clone()

    got = grad(lambda x, w: head_log_probs(x, w, targets, with_entropy=True, chunk_size=4))
    want = grad(lambda x, w: _reference(x, w, targets, 1.0, True))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_zero_and_missing_upstream_gradients():
    hidden, weight, targets, chunk, tau, _, _ = _case(5)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    logp, entropy = head_log_probs(
        hidden, weight, targets, temperature=tau, with_entropy=True, chunk_size=chunk
    )
    # Zero advantages / masked positions: the loss reads the log-probs times zero.
    g_h, g_w = torch.autograd.grad((logp * 0).sum() + entropy.detach().sum(), (hidden, weight))
    assert not g_h.any() and not g_w.any()
    # Entropy not asked for: None, and log-probs alone backpropagate.
    logp, none = head_log_probs(hidden, weight, targets, chunk_size=chunk)
    assert none is None
    g_h, _ = torch.autograd.grad(logp.sum(), (hidden, weight))
    assert torch.isfinite(g_h).all()


def test_empty_rows_still_backpropagate():
    weight = torch.randn(9, 4, requires_grad=True)
    hidden = torch.randn(0, 4, requires_grad=True)
    logp, entropy = head_log_probs(
        hidden, weight, torch.zeros(0, dtype=torch.long), with_entropy=True
    )
    assert logp.shape == entropy.shape == (0,)
    (logp.sum() + entropy.sum()).backward()
    assert weight.grad is not None and not weight.grad.any()


def test_all_minus_inf_logits_row_has_zero_entropy_and_gradient():
    """A row whose logits are all -inf has entropy 0 in the fused tail too, and the
    entropy's gradient there is 0, not NaN; the other rows are unchanged."""
    weight = torch.tensor([[1.0], [2.0], [3.0]])
    hidden = torch.tensor([[0.5], [-float("inf")]], requires_grad=True)
    _, entropy = head_log_probs(hidden, weight, torch.tensor([0, 1]), with_entropy=True)
    entropy.sum().backward()
    assert entropy[1] == 0 and hidden.grad[1] == 0
    _, want = _reference(hidden.detach()[:1], weight, torch.tensor([0]), 1.0, True)
    torch.testing.assert_close(entropy[:1], want)
    assert torch.isfinite(hidden.grad).all()


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(7, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.tensor([0, 6, 3, 3, 1])

    def fn(x, w):
        logp, entropy = head_log_probs(
            x, w, targets, temperature=0.7, with_entropy=True, chunk_size=2
        )
        return logp, entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_bf16_computes_in_float32():
    hidden, weight, targets, chunk, _, _, _ = _case(9)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    logp, entropy = head_log_probs(hidden, weight, targets, with_entropy=True, chunk_size=chunk)
    want_logp, want_entropy = _reference(hidden, weight, targets, 1.0, True)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)


def test_autograd_saves_no_full_logits():
    n, h, vocab = 64, 8, 500
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(vocab, h, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head_log_probs(hidden, weight, targets, with_entropy=True, chunk_size=8)
    assert saved and all(s.numel() <= max(n * h, vocab * h) for s in saved), saved


def test_default_chunk_bounds_the_buffer():
    assert default_chunk_rows(151_936) * 151_936 <= 1 << 26
    assert default_chunk_rows(1) == 1 << 26
