"""Log-probs and entropy over logits split across tensor-parallel ranks by vocabulary.

Where it fits: with tensor parallelism megatron-core's output layer leaves each
rank the logits of its own slice of the (padded) vocabulary, ``[L, V/TP]``.
Gathering them gives every rank ``[L, V]`` (for a 150k vocabulary and 8k-token
rows, 5 GB in fp32 per rank) only to reduce each row to two numbers. Instead the
megatron actor hands ``VocabShard.token_stats`` to
``vime.data.micro_batch.response_log_probs``, which picks the response rows of
the shard, and the reductions over the vocabulary run across the ranks:

    m      = max over all ranks of the row maxima (a constant shift, no gradient)
    S      = Σ_ranks Σ_j exp(z_j − m)              lse = m + log S
    log p  = z_target − lse                         (z_target from the rank holding it)
    H      = lse − Σ_ranks Σ_j exp(z_j − m) z_j / S

Each sum goes through megatron-core's ``reduce_from_tensor_model_parallel_region``
(all-reduce forward, identity backward: every rank computes the same loss from
the same sums, so each backpropagates into its own slice). Columns of the padded
vocabulary past the HF vocabulary are excluded, as the gathered path drops them.
The result equals the full-vocabulary computation up to the order of the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region


@dataclass(frozen=True)
class VocabShard:
    """This rank's columns ``[start, start + width)`` of a vocabulary padded past ``vocab_size``."""

    start: int
    width: int
    vocab_size: int

    @classmethod
    def of_this_rank(cls, shard_width: int, vocab_size: int) -> VocabShard:
        rank = parallel_state.get_tensor_model_parallel_rank()
        return cls(start=rank * shard_width, width=shard_width, vocab_size=vocab_size)

    def token_stats(
        self, logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``response_log_probs``'s ``token_stats`` for ``[N, width]`` shard logits."""
        if logits.shape[-1] != self.width:
            raise ValueError(f"logits of {logits.shape[-1]} columns for a shard of {self.width}")
        # Columns of this shard inside the HF vocabulary: a tiny vocabulary padded for TP
        # can leave a rank none, and that rank still joins every collective below.
        real = min(max(self.vocab_size - self.start, 0), self.width)
        logits = logits[..., :real]
        row_max = logits.new_full(logits.shape[:-1], -torch.inf)
        if real:
            row_max = logits.detach().amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=_tp_group())
        shifted = torch.exp(logits - row_max.unsqueeze(-1))
        total = reduce_from_tensor_model_parallel_region(shifted.sum(dim=-1))
        lse = row_max + torch.log(total)
        mine = torch.zeros_like(lse)
        if real:
            local = targets - self.start
            here = (local >= 0) & (local < real)
            picked = logits.gather(-1, local.clamp(0, real - 1).unsqueeze(-1)).squeeze(-1)
            mine = torch.where(here, picked, mine)
        token_logp = reduce_from_tensor_model_parallel_region(mine) - lse
        if not with_entropy:
            return token_logp, None
        weighted = reduce_from_tensor_model_parallel_region((shifted * logits).sum(dim=-1))
        return token_logp, lse - weighted / total


def _tp_group() -> dist.ProcessGroup:
    return parallel_state.get_tensor_model_parallel_group()
