"""``vime-train --max-staleness 1`` on GPUs: the engine on a GPU of its own, NCCL broadcast.

Proves, where two CUDA devices exist (skipped otherwise, and without CUDA by the
conftest): an asynchronous run with a training rank on one GPU and an hf engine on
another, new weights broadcast over NCCL while the engine generates, trains every
rollout on samples at most one version old, the engine serving each new version with
the probe's log-probs within bf16 rounding of the trainer's.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.commands import vime_train_command
from tests.gpu.test_vllm_gpu import LOGP_ATOL, ROOT, _embedded_bf16


def test_asynchronous_run_broadcasts_to_an_engine_on_its_own_gpu(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices: one to train on, one for the engine")
    checkpoint = _embedded_bf16(tmp_path / "model")
    command = vime_train_command()
    out = tmp_path / "out"
    flags = [
        *("--hf-checkpoint", checkpoint, "--prompt-data", "builtin:reverse"),
        *("--max-staleness", "1", "--rollout-engine", "hf", "--weight-sync", "broadcast"),
        *("--num-rollout", "4", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4"),
        *("--rollout-max-prompt-len", "64", "--rollout-max-response-len", "8"),
        *("--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024", "--lr", "3e-4"),
        *("--seed", "7", "--output-dir", str(out)),
    ]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(
        [*command, *flags], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert row["async/staleness_max"] <= 1
        assert row["weights/version"] == row["rollout_id"] + 1
        assert row["weights/probe_logprob_abs_diff"] < LOGP_ATOL, row
