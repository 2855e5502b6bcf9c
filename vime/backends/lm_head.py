"""Run a model's forward with its LM head diverted to the fused log-prob tail.

Where it fits: both training backends (fsdp2's HF model, megatron's ``GPTModel``
without tensor or pipeline parallelism) forward a packed row through the whole
model, final norm included, but the loss reads only the loss positions'
log-probs (``vime.data.micro_batch.loss_targets``: response tokens under
``loss_mask``; prompt positions are never read). ``row_log_probs`` hooks the
head module: before it runs, the final hidden states of those positions and the
head's weight go to ``vime.algo.head_log_probs`` (a chunk of rows at a time), and
the head itself projects a zero-length sequence, so no ``[L, V]`` (nor ``[N, V]``)
logits exist. The ``[N, 2]`` (log-prob, entropy) columns then leave as the head's
output, i.e. as the model's output: wrappers such as FSDP2 hold the head's weight
unsharded inside the forward and re-gather it from the hooks they put on the
model's outputs before the backward reaches the head -- as for the head's own matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vime.algo.head_log_probs import head_log_probs
from vime.data.micro_batch import PackedBatch, loss_targets, per_sample_values


def row_log_probs(
    forward: Callable[[], torch.Tensor],
    head: torch.nn.Module,
    packed: PackedBatch,
    *,
    temperature: float,
    with_entropy: bool,
    seq_dim: int,
    vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_log_probs`` of a packed row without its logits: per-sample log-probs
    ``[B, T]`` (and entropies) of the model that ``forward()`` runs.

    ``forward`` returns the model's output tensor -- what ``head``'s output becomes (HF:
    ``.logits``; megatron: ``[1, S, V]`` from ``[S, 1, V]``); ``seq_dim`` is the sequence
    dim of the head's input. The weight is the head's own (or the ``weight=`` its caller
    passes: megatron's tied embedding), cut to the first ``vocab`` rows when given (a
    padded vocabulary). ``head`` must run exactly once in ``forward``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    sample, step, before, targets = loss_targets(packed)
    stash: list[tuple[torch.Tensor, torch.Tensor]] = []

    def divert(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        weight = kwargs.get("weight")
        weight = module.weight if weight is None else weight
        stash.append((args[0], weight if vocab is None else weight[:vocab]))
        return (args[0].narrow(seq_dim, 0, 0), *args[1:]), kwargs

    def replace(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        hidden, weight = stash.pop()
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, before)
        logp, entropy = head_log_probs(
            rows, weight, targets, temperature=temperature, with_entropy=with_entropy
        )
        # The head's layout, [1, N, 2] or [N, 1, 2], as a fresh tensor (FSDP2 warns on views).
        pair = (logp, logp if entropy is None else entropy)
        columns = torch.stack([v.unsqueeze(1 - seq_dim) for v in pair], dim=-1)
        return (columns, *output[1:]) if isinstance(output, tuple) else columns

    hooks = [
        head.register_forward_pre_hook(divert, with_kwargs=True),
        head.register_forward_hook(replace, with_kwargs=True),
    ]
    try:
        columns = forward().reshape(-1, 2)
    finally:
        for hook in hooks:
            hook.remove()
    if columns.shape[0] != before.shape[0] or stash:
        raise RuntimeError("the LM head must run exactly once in the forward")
    entropy = columns[:, 1] if with_entropy else None
    return per_sample_values(packed, sample, step, columns[:, 0], entropy)


def fusable_head(head: Any, hf_config: Any = None) -> bool:
    """A bias-free ``nn.Linear`` (not an adapter's wrapper) whose output the model uses as
    is (no final logit soft-capping): what ``row_log_probs`` can stand in for."""
    if getattr(hf_config, "final_logit_softcapping", None) is not None:
        return False
    return type(head) is torch.nn.Linear and head.bias is None
