"""``--lm-head-tail``: which log-prob tail a backend takes.

Proves the choice over every (flag, device, head) combination: ``fused`` and ``auto``
on CUDA take the fused tail wherever the head allows it, ``logits`` and ``auto`` on the
CPU never do, and an unknown choice is refused. That the flag reaches a backend is
shown by ``test_sync_budget`` (the head's own matmul sees no row under ``fused``).
"""

from __future__ import annotations

import itertools

import pytest

from vime.backends.lm_head_choice import LM_HEAD_TAILS, fused_tail
from vime.config import parse_args


@pytest.mark.parametrize(
    ("choice", "device", "fusable"),
    list(itertools.product(LM_HEAD_TAILS, ("cpu", "cuda"), (True, False))),
)
def test_fused_tail_choice(choice: str, device: str, fusable: bool) -> None:
    wanted = {"fused": True, "logits": False, "auto": device == "cuda"}[choice]
    assert fused_tail(choice, device, fusable) is (wanted and fusable)


def test_unknown_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="--lm-head-tail"):
        fused_tail("whole", "cpu", True)


def test_the_flag_defaults_to_auto_and_reaches_the_settings() -> None:
    from vime.config.train_settings import train_settings

    assert parse_args([]).lm_head_tail == "auto"
    args = parse_args(["--lm-head-tail", "fused"])
    assert train_settings(args).lm_head_tail == "fused"
