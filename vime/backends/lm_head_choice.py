"""Which log-prob tail a training forward takes: ``--lm-head-tail``.

Where it fits: both backends ask ``fused_tail`` once, at build time. ``fused`` sends
only the loss positions' hidden states through ``vime.backends.lm_head`` (chunked, no
``[tokens, vocab]`` logits: what a 152k vocabulary needs on a GPU); ``logits`` computes
whole logits and gathers the loss positions; ``auto`` is fused on CUDA and logits on
the CPU, whose small vocabularies gain nothing from it and whose results stay those of
the logits path bit for bit. Kept apart from ``lm_head`` so the flag parser imports
no torch.
"""

from __future__ import annotations

LM_HEAD_TAILS = ("auto", "fused", "logits")


def fused_tail(choice: str, device_type: str, fusable: bool) -> bool:
    """Whether the fused tail runs: ``choice`` is ``--lm-head-tail``, ``device_type`` the
    rank's (``"cuda"``, ``"cpu"``), ``fusable`` whether the model's head allows it (a plain
    bias-free linear, no logit soft-capping, no tensor-parallel vocabulary shards)."""
    if choice not in LM_HEAD_TAILS:
        raise ValueError(f"--lm-head-tail must be one of {LM_HEAD_TAILS}, got {choice!r}")
    wanted = choice == "fused" or (choice == "auto" and device_type == "cuda")
    return wanted and fusable
