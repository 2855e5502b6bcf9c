"""``vime.backends.megatron.vocab_parallel``: log-probs and entropy from vocabulary shards.

Proves, on two real gloo ranks with megatron-core's tensor-parallel groups, that
each rank's ``VocabShard.token_stats`` over its slice of a padded vocabulary gives
the full-vocabulary ``full_vocab_token_stats`` of the unpadded logits (fp64, 1e-12),
and that the gradient each rank gets for its slice is that slice of the full
gradient, padding columns zero -- with the target token on either rank, and for a
vocabulary so small that one rank's whole shard is padding.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from actor_harness import spawn

from vime.data.micro_batch import full_vocab_token_stats

ROWS = 6


def _job(rank: int, world: int, vocab: int, width: int) -> dict:
    from vime.backends.megatron import model as mmodel
    from vime.backends.megatron.vocab_parallel import VocabShard

    mmodel.init_model_parallel(tp=world, seed=3)
    gen = torch.Generator().manual_seed(11)
    full = 3 * torch.randn(ROWS, world * width, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (ROWS,), generator=gen)
    targets[0], targets[1] = 0, vocab - 1  # the first and the last real token
    weights = torch.randn(2, ROWS, generator=gen, dtype=torch.float64)

    shard = full[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
    logp, entropy = VocabShard.of_this_rank(width, vocab).token_stats(shard, targets, True)
    (weights[0] @ logp + weights[1] @ entropy).backward()
    only_logp, none = VocabShard.of_this_rank(width, vocab).token_stats(shard, targets, False)

    reference = full[:, :vocab].clone().requires_grad_(True)
    ref_logp, ref_entropy = full_vocab_token_stats(reference, targets, True)
    (weights[0] @ ref_logp + weights[1] @ ref_entropy).backward()
    ref_grad = torch.zeros_like(full)
    ref_grad[:, :vocab] = reference.grad
    return {
        "logp": (logp.detach(), ref_logp.detach()),
        "entropy": (entropy.detach(), ref_entropy.detach()),
        "only_logp": (only_logp.detach(), none),
        "grad": (shard.grad, ref_grad[:, rank * width : (rank + 1) * width]),
        "grad_of_rank_1": _gathered_grad(shard.grad, ref_grad, rank, width),
    }


def _gathered_grad(grad: torch.Tensor, ref: torch.Tensor, rank: int, width: int) -> float:
    """Rank 1's largest gradient error, read on rank 0 (a job returns rank 0's result)."""
    import torch.distributed as dist

    err = (grad - ref[:, rank * width : (rank + 1) * width]).abs().max().reshape(1)
    errors = [torch.zeros(1, dtype=err.dtype) for _ in range(dist.get_world_size())]
    dist.all_gather(errors, err)
    return float(errors[1])


@pytest.mark.parametrize(
    ("vocab", "width"),
    [(200, 128), (60, 128)],  # 60: rank 1's columns are all padding
    ids=["both-ranks-real", "one-rank-all-padding"],
)
def test_shard_stats_equal_the_full_vocabulary(tmp_path, vocab: int, width: int) -> None:
    got = spawn(_job, 2, tmp_path, vocab, width)
    for key in ("logp", "entropy"):
        value, reference = got[key]
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
    only_logp, none = got["only_logp"]
    assert none is None
    torch.testing.assert_close(only_logp, got["logp"][1], rtol=1e-12, atol=1e-12)
    grad, reference = got["grad"]
    torch.testing.assert_close(grad, reference, rtol=1e-12, atol=1e-12)
    assert float(reference.abs().max()) > 0  # the check above could fail
    assert got["grad_of_rank_1"] < 1e-12
