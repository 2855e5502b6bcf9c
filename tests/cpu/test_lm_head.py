"""row_log_probs: a packed row's log-probs with the LM head diverted equal whole logits'.

Proves: on a toy model (embedding -> tanh -> head) over packed rows (a loss mask
with holes, shared prompts, a temperature), the diverted head gives the same
per-sample log-probs, entropies and gradients as ``response_log_probs`` of the
model's whole logits, in HF's layout (``[1, L, h]``, the head's own weight) and in
megatron's (``[L, 1, h]``, a ``(logits, bias)`` output, a tied ``weight=`` passed
by the caller, a padded vocabulary cut to the real one); the head's own matmul sees
zero rows; and a forward that skips the head is refused.
"""

from __future__ import annotations

import pytest
import torch

from vime.backends.lm_head import fusable_head, row_log_probs
from vime.data.micro_batch import pack_micro_batch, response_log_probs

VOCAB, PADDED, H = 23, 28, 6


class _Toy(torch.nn.Module):
    def __init__(self, megatron: bool) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.megatron = megatron
        self.embed = torch.nn.Embedding(PADDED, H)
        self.head = torch.nn.Linear(H, PADDED, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(PADDED, H, generator=gen))
            self.head.weight.copy_(torch.randn(PADDED, H, generator=gen))
        if megatron:  # a tied head called with weight=, returning (logits, bias)
            self.head.forward = lambda x, weight=None: (x @ weight.t(), None)
        self.seen_rows: list[int] = []  # rows of hidden states the head's matmul received
        self.head.register_forward_hook(
            lambda m, args, out: self.seen_rows.append(args[0].shape[1 - megatron])
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.embed(ids))  # [1, L, h]
        if not self.megatron:
            return self.head(hidden)[..., :VOCAB]
        out, _ = self.head(hidden.transpose(0, 1), weight=self.embed.weight)  # [L, 1, V]
        return out.transpose(0, 1)[..., :VOCAB]


def _packed():
    samples = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    return pack_micro_batch(
        samples, [3, 3, 2], [[1, 0, 1], [1, 1], [1, 1, 0, 1, 1]], share_prompts=True
    )


def _run(model, packed, fused, with_entropy):
    model.zero_grad()
    if fused:
        logp, entropy = row_log_probs(
            lambda: model(packed.input_ids),
            model.head,
            packed,
            temperature=0.8,
            with_entropy=with_entropy,
            seq_dim=0 if model.megatron else 1,
            vocab=VOCAB,
        )
    else:
        logp, entropy = response_log_probs(
            model(packed.input_ids), packed, temperature=0.8, with_entropy=with_entropy
        )
    loss = (logp * torch.arange(logp.numel()).view_as(logp)).sum()
    if with_entropy:
        loss = loss - 0.3 * entropy.sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logp.detach(), None if entropy is None else entropy.detach(), grads


@pytest.mark.parametrize("megatron", [False, True])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_diverted_head_matches_whole_logits(megatron, with_entropy):
    model, packed = _Toy(megatron), _packed()
    got = _run(model, packed, True, with_entropy)
    assert model.seen_rows == [0]
    want = _run(model, packed, False, with_entropy)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    if with_entropy:
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    else:
        assert got[1] is None
    assert len(got[2]) == len(want[2])
    for a, b in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_forward_without_the_head_is_refused():
    model, packed = _Toy(False), _packed()
    with pytest.raises(RuntimeError, match="exactly once"):
        row_log_probs(
            lambda: model.embed(packed.input_ids),
            model.head,
            packed,
            temperature=1.0,
            with_entropy=False,
            seq_dim=1,
        )


def test_fusable_head():
    assert fusable_head(torch.nn.Linear(2, 3, bias=False))
    assert not fusable_head(torch.nn.Linear(2, 3))
    assert not fusable_head(
        torch.nn.Linear(2, 3, bias=False), type("C", (), {"final_logit_softcapping": 30.0})
    )
