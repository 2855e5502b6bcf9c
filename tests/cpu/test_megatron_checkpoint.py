"""What a megatron checkpoint can resume as (``megatron/checkpoint.py::check_resumable``).

Proves: a checkpoint resumes only under the weight dtype and layer implementation that
wrote it (older checkpoints without the field count as the local layers); a stepped
optimizer state resumes only with the optimizer that wrote it, and a distributed-
optimizer state only at its TP and PP size (any DP size); a never-stepped checkpoint,
which holds no optimizer state, loads under either optimizer. Each refusal names the
flag to change. The round trips themselves are ``test_megatron_actor.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from vime.backends.megatron.checkpoint import check_resumable
from vime.checkpoint import CheckpointError

RUN = {
    "tp": 2,
    "pp": 1,
    "param_dtype": "torch.bfloat16",
    "distributed_optimizer": True,
    "transformer_impl": "local",
}
FOLDER = Path("ckpt/iter_0000003")


def _saved(steps: int = 4, **fields) -> dict:
    return {**RUN, "counters": {"optimizer_steps": steps}, **fields}


def test_the_same_layout_resumes() -> None:
    check_resumable(FOLDER, _saved(), RUN)
    check_resumable(FOLDER, _saved(), {**RUN, "tp": 2})  # DP is not recorded: any DP


@pytest.mark.parametrize(
    ("saved", "run", "fragment"),
    [
        (_saved(param_dtype="torch.float32"), RUN, "--megatron-param-dtype"),
        (_saved(transformer_impl="transformer_engine"), RUN, "--megatron-transformer-impl"),
        (
            {k: v for k, v in _saved().items() if k != "transformer_impl"},
            {**RUN, "transformer_impl": "transformer_engine"},
            "saved with --megatron-transformer-impl local",
        ),
        (_saved(distributed_optimizer=False), RUN, "without --megatron-use-distributed"),
        (_saved(), {**RUN, "distributed_optimizer": False}, "with --megatron-use-distributed"),
        (_saved(), {**RUN, "tp": 1}, "saved at TP=2, PP=1; it loads at another DP size"),
        (_saved(pp=2), RUN, "saved at TP=2, PP=2"),
    ],
)
def test_what_cannot_resume_is_refused_by_name(saved: dict, run: dict, fragment: str) -> None:
    with pytest.raises(CheckpointError, match=fragment) as err:
        check_resumable(FOLDER, saved, run)
    assert str(FOLDER) in str(err.value) and "\n" not in str(err.value)


def test_a_never_stepped_checkpoint_loads_under_either_optimizer() -> None:
    fresh = _saved(steps=0)
    check_resumable(FOLDER, fresh, {**RUN, "distributed_optimizer": False})
    check_resumable(FOLDER, fresh, {**RUN, "tp": 1})
    with pytest.raises(CheckpointError, match="--megatron-param-dtype"):  # weights still count
        check_resumable(FOLDER, fresh, {**RUN, "param_dtype": "torch.float32"})
