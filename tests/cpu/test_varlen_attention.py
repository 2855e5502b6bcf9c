"""``vime.backends.varlen_attention``: causal attention per sample of a packed row.

Proves: ``packed_causal_attention`` equals an independent reference -- each sample
forwarded alone through ``scaled_dot_product_attention(is_causal=True)`` -- in its
output and in the gradients of queries, keys and values, for rows mixing short and
long samples (several length buckets), a one-token sample, a row of one sample, and
grouped-query attention; samples batched together stay isolated (a NaN in one
sample reaches neither the others' outputs nor their gradients); the layout
groups samples by power-of-two length, so no sample is padded to more than twice
its length; the sample boundaries follow transformers' packed-sequence rule; and
malformed input is refused with a message -- also by the transformers entry
point, which names the fix for a model with sliding windows or a forward without
``position_ids``. The row as the varlen kernels take it (query runs, keys gathered
per run with the shared prompt first) computes the buckets' attention under the
kernels' bottom-right causal rule, and ``choose_kernel`` keeps the CPU (and fp32)
on the buckets for every combination of installed kernels. The HF-model level (packed logits and
gradients against per-sample forwards) is in ``test_micro_batch.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vime.backends.varlen_attention import (
    FLASH_ATTN,
    SDPA_BUCKETS,
    TORCH_VARLEN,
    _hf_attention,
    choose_kernel,
    kernels_used,
    layout_of_positions,
    packed_causal_attention,
    row_layout,
    varlen_rows,
)


def _reference(q, k, v, lengths, scale):
    """Every sample alone: [H, L, D] inputs -> [L, H, D]."""
    outs, start = [], 0
    for n in lengths:
        part = slice(start, start + n)
        out = F.scaled_dot_product_attention(
            q[:, part], k[:, part], v[:, part], is_causal=True, scale=scale, enable_gqa=True
        )
        outs.append(out.transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("lengths", "kv_heads"),
    [
        ([5, 1, 17, 3, 64, 9, 33, 2], 4),
        ([5, 1, 17, 3, 64, 9, 33, 2], 2),
        ([40], 4),
        ([1, 1, 1], 1),
    ],
    ids=["mixed", "mixed-gqa", "one-sample", "single-tokens-mqa"],
)
def test_equals_each_sample_alone(lengths, kv_heads):
    gen = torch.Generator().manual_seed(len(lengths) + kv_heads)
    total, heads, dim = sum(lengths), 4, 16

    def leaf(h):
        return torch.randn(h, total, dim, generator=gen, dtype=torch.float64).requires_grad_()

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    weights = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    got = packed_causal_attention(q, k, v, row_layout(lengths), scale=0.3)
    want = _reference(q, k, v, lengths, 0.3)
    assert got.shape == (total, heads, dim)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grads = torch.autograd.grad((weights * got).sum(), (q, k, v))
    want_grads = torch.autograd.grad((weights * want).sum(), (q, k, v))
    for name, g, w in zip("qkv", grads, want_grads, strict=True):
        # One-token samples attend only to themselves: their output is v, q and k get 0.
        assert w.abs().max() > 0 or (max(lengths) == 1 and name != "v")
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_samples_are_isolated():
    # A NaN in one sample's values stays in that sample, forward and backward, although
    # samples of similar length share one padded batch.
    lengths = [3, 4, 7]
    q, k, v = (torch.randn(2, 14, 8, requires_grad=True) for _ in range(3))
    poisoned = v.detach().clone()
    poisoned[:, 3] = float("nan")  # first token of sample 1
    out = packed_causal_attention(q, k, poisoned.requires_grad_(), row_layout(lengths))
    assert torch.isfinite(out[:3]).all() and torch.isfinite(out[7:]).all()
    assert torch.isnan(out[3:7]).all()
    (grad,) = torch.autograd.grad(out[:3].sum() + out[7:].sum(), poisoned)
    assert torch.isfinite(grad).all() and (grad[:, 3:7] == 0).all()


def test_layout_buckets_bound_the_padding():
    lengths = [1, 2, 3, 4, 5, 8, 9, 16, 17, 100]
    layout = row_layout(lengths)
    assert layout.length == sum(lengths)
    covered = []
    for index, keep in layout.buckets:
        width = index.shape[1]
        real = torch.zeros(index.numel(), dtype=torch.long).index_fill(0, keep, 1)
        assert (width <= 2 * real.view(index.shape).sum(1)).all() or width == 1
        covered += index.flatten()[keep].tolist()
    assert sorted(covered) == list(range(sum(lengths)))
    assert torch.equal(torch.tensor(covered)[layout.order], torch.arange(sum(lengths)))
    assert len(layout.buckets) == 7  # 1 | 2 | 3-4 | 5-8 | 9-16 | 17-32 | 65-128 (33-64 empty)
    with pytest.raises(ValueError, match=">= 1 token"):
        row_layout([3, 0])
    with pytest.raises(ValueError, match=">= 1 token"):
        row_layout([])


def _samples(layout):
    """Each sample's row indices (its shared prefix included), in row order of its tokens."""
    seqs = []
    for index, keep in layout.buckets:
        mask = torch.zeros(index.numel(), dtype=torch.bool).index_fill(0, keep, True)
        for row, owned in zip(index.tolist(), mask.view(index.shape).tolist(), strict=True):
            last = max(j for j, o in enumerate(owned) if o)
            seqs.append(row[: last + 1])
    return sorted(seqs, key=lambda seq: seq[-1])


def test_boundaries_follow_position_restarts():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 0, 1]])
    starts = [0, 3, 5, 6, 10]
    lengths = [3, 2, 1, 4, 2]
    expected = [list(range(a, a + n)) for a, n in zip(starts, lengths, strict=True)]
    assert _samples(layout_of_positions(positions)) == expected
    # A row that does not start at 0 is still one sample (transformers' rule is "does
    # not follow its predecessor", not "is 0").
    assert _samples(layout_of_positions(torch.tensor([[4, 5, 6]]))) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="one packed row"):
        layout_of_positions(torch.zeros(2, 5, dtype=torch.long))


def test_shared_prompt_runs_attend_to_their_prefix():
    # prompt of 3 + response of 2 | response at 3.. (2) | response at 3.. (1) | next sample
    positions = torch.tensor([[0, 1, 2, 3, 4, 3, 4, 3, 0, 1]])
    layout = layout_of_positions(positions)
    assert _samples(layout) == [
        [0, 1, 2, 3, 4],
        [0, 1, 2, 5, 6],
        [0, 1, 2, 7],
        [8, 9],
    ]
    # Each token's output comes from the one sample that owns it.
    assert torch.equal(torch.sort(layout.order).values, torch.arange(10))
    with pytest.raises(ValueError, match="past the end of the run it continues"):
        layout_of_positions(torch.tensor([[0, 1, 5]]))


def test_shared_prompts_equal_each_sample_alone():
    """Attention over a shared row == each (prompt + response) forwarded alone, in the
    outputs of every token and in the gradients (the prompt's summed over its samples)."""
    gen = torch.Generator().manual_seed(7)
    heads, dim = 2, 8
    prompt, responses, other = 4, [3, 1, 2], 5
    total = prompt + sum(responses) + other
    positions = [*range(prompt + responses[0])]
    for r in responses[1:]:
        positions += range(prompt, prompt + r)
    positions += range(other)
    layout = layout_of_positions(torch.tensor([positions]))

    def leaf():
        return torch.randn(heads, total, dim, generator=gen, dtype=torch.float64).requires_grad_()

    q, k, v = leaf(), leaf(), leaf()
    out = packed_causal_attention(q, k, v, layout)
    probe = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * probe).sum(), (q, k, v))
    # The reference: unshared samples, each a contiguous prompt + response, then summed.
    seqs = _samples(layout)
    ref_out = torch.zeros_like(out)
    ref_loss = 0
    for seq in seqs:
        idx = torch.tensor(seq)
        o = F.scaled_dot_product_attention(q[:, idx], k[:, idx], v[:, idx], is_causal=True)
        o = o.transpose(0, 1)
        # The shared prompt's outputs come from its first sample only.
        keep = [j for j, t in enumerate(seq) if t not in seqs[0][:prompt] or seq is seqs[0]]
        ref_out[idx[keep]] = o[keep].detach()
        ref_loss = ref_loss + (o[keep] * probe[idx[keep]]).sum()
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    torch.testing.assert_close(out, ref_out)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_mismatched_lengths_are_refused():
    q = torch.randn(2, 6, 8)
    with pytest.raises(ValueError, match="one length"):
        packed_causal_attention(q, q[:, :5], q[:, :5], row_layout([6]))
    with pytest.raises(ValueError, match="one length"):
        packed_causal_attention(q, q, q, row_layout([2, 3]))


def test_transformers_entry_point_refusals():
    q = torch.randn(1, 2, 6, 8)
    positions = torch.arange(6)[None]
    with pytest.raises(ValueError, match="no sliding window; use --attn-implementation sdpa"):
        _hf_attention(None, q, q, q, None, sliding_window=4, position_ids=positions)
    with pytest.raises(ValueError, match="needs the row's position_ids"):
        _hf_attention(None, q, q, q, None)
    out, weights = _hf_attention(None, q, q, q, None, position_ids=positions)
    assert out.shape == (1, 6, 2, 8) and weights is None


def _kernel_reference(q, k, v, runs, scale):
    """What a varlen kernel computes from ``runs`` (its contract, spelt in sdpa): run i's
    queries ``q[cu_q[i]:cu_q[i+1]]`` see its keys ``k[cu_k[i]:cu_k[i+1]]`` up to its own
    position, the causal mask aligned to the bottom right. ``[L, H, D]`` in and out."""
    outs = []
    for i in range(runs.cu_q.shape[0] - 1):
        qs = slice(int(runs.cu_q[i]), int(runs.cu_q[i + 1]))
        ks = slice(int(runs.cu_k[i]), int(runs.cu_k[i + 1]))
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        seen = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        qi, ki, vi = (t.transpose(0, 1) for t in (q[qs], k[ks], v[ks]))
        out = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=seen, scale=scale, enable_gqa=True
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def _shared_row(groups):
    """Positions of a packed row of ``groups`` [(prompt, [responses...]), ...] shared as the
    packer lays it out, then 3 padding tokens."""
    positions = []
    for prompt, responses in groups:
        positions += range(prompt + responses[0])
        for r in responses[1:]:
            positions += range(prompt, prompt + r)
    return torch.tensor([[*positions, 0, 1, 2]])


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_runs_compute_the_buckets_attention(kv_heads):
    """The row as the varlen kernels take it (``RowLayout.varlen``: query runs, keys
    gathered per run with the shared prompt first) gives the buckets' output and
    gradients within 1e-5 in fp32, on random rows with shared prompts."""
    gen = torch.Generator().manual_seed(kv_heads)
    groups = [(5, [3, 1, 7]), (2, [9]), (11, [2, 4]), (1, [1, 1])]
    positions = _shared_row(groups)
    layout = layout_of_positions(positions)
    total, heads, dim = positions.shape[1], 4, 16
    runs = layout.varlen
    assert runs.kv_index is not None and int(runs.cu_q[-1]) == total
    assert runs.max_k == 11 + 4 and runs.max_q == 11 + 2

    def leaf(h):
        return torch.randn(h, total, dim, generator=gen).requires_grad_()

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    probe = torch.randn(total, heads, dim, generator=gen)
    got = _kernel_reference(*varlen_rows(q, k, v, layout), runs, 0.3)
    want = packed_causal_attention(q, k, v, layout, scale=0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    grads = torch.autograd.grad((probe * got).sum(), (q, k, v))
    want_grads = torch.autograd.grad((probe * want).sum(), (q, k, v))
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    # An unshared row needs no gather: the kernels read the row's own keys.
    assert row_layout([3, 5, 1]).varlen.kv_index is None


HALF = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dropout", [False, True])
def test_kernel_choice_over_every_combination(device_type, dtype, dropout):
    """The flash kernels only on CUDA in 16 bits, torch's first unless dropout asks for
    flash-attn's; the sdpa buckets everywhere else, whatever is installed."""
    for installed in ((), (TORCH_VARLEN,), (FLASH_ATTN,), (TORCH_VARLEN, FLASH_ATTN)):
        got = choose_kernel(device_type, frozenset(installed), dtype, dropout)
        if device_type != "cuda" or dtype not in HALF:
            want = SDPA_BUCKETS
        elif TORCH_VARLEN in installed and not dropout:
            want = TORCH_VARLEN
        else:
            want = FLASH_ATTN if FLASH_ATTN in installed else SDPA_BUCKETS
        assert got == want, (installed, got)


def test_cpu_runs_the_buckets_and_says_so(capsys):
    """On this machine (the CPU) packed attention runs the sdpa buckets, whatever torch
    offers, and names its kernel once."""
    q = torch.randn(2, 6, 8)
    packed_causal_attention(q, q, q, row_layout([2, 4]))
    packed_causal_attention(q, q, q, row_layout([6]))
    assert SDPA_BUCKETS in kernels_used()
    assert capsys.readouterr().out.count("attention kernel sdpa_buckets (cpu, torch.float32)") <= 1
