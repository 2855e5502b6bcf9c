"""``vime-train --lora-rank`` end to end (two fsdp2 ranks, the embedded model, Ray).

Proves, on real processes: a LoRA run with the KL term syncs the base and the adapters
once, then the adapters alone (each later sync moves a fraction of the first's bytes,
measured on the engine), and the engines still score the probe as the trainer does:
colocated through the gloo broadcast streamed a tensor a bucket into the hf engine,
which merges them, with the tied embedding and the norms trained in full beside them
(``--lora-modules-to-save``), on the run that ``test_trainer``'s colocated broadcast
test checks too (conftest's ``colocated_broadcast_run``: one start of ``vime-train``
fewer); asynchronously (``--max-staleness 1``) through the object store into vLLM,
which serves each sync's adapters with its own LoRA (``--vllm-lora on``; by default
only with CUDA). The reference (the base) differs from the trained actor; ``--save-hf``
writes a PEFT adapter folder and ``--save-hf-merged`` a whole model that transformers
loads; ``--lora-merge-on-sync`` sends the whole model every time, here on the
multi-turn tool task through the disk transport with dynamic sampling.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.cpu.test_trainer import _metrics, _train

LORA = ["--lora-rank", "4", "--use-kl-loss", "--kl-loss-coef", "0.1", "--num-rollout", "3"]


def _check_adapter_sync(rows: list[dict]) -> None:
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    first, *later = [r["perf/weight_sync_bytes"] for r in rows]
    assert all(0 < b < first / 2 for b in later), (first, later)
    for r in rows:
        assert r["weights/probe_logprob_abs_diff"] < 1e-4
    assert rows[-1]["train/kl_loss"] > 0, "the base (reference) never differed from the actor"


def test_adapter_only_sync_over_broadcast_and_the_exports(
    colocated_broadcast_run: SimpleNamespace,
) -> None:
    """Colocated, over the gloo broadcast into the hf engine (which merges the adapters),
    the tied embedding and the norms trained in full beside them: the adapter syncs, and
    both HF exports."""
    from transformers import AutoModelForCausalLM

    run = colocated_broadcast_run
    _check_adapter_sync(run.rows)
    assert "LoRA syncs reach the engines as adapters merged on the engine" in run.stdout
    # The embedded default's export (--save-hf) is the adapter folder for its base.
    assert sorted(p.name for p in (run.out / "model").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert AutoModelForCausalLM.from_pretrained(run.root / "merged") is not None


def test_adapter_only_sync_into_vllm(tmp_path: Path) -> None:
    """Where vLLM imports (always under CI): vLLM serves the adapters itself."""
    pytest.importorskip("vllm")
    out = tmp_path / "o"
    flags = ["--rollout-engine", "vllm", "--max-staleness", "1", "--vllm-lora", "on"]
    result = _train(*LORA, *flags, "--output-dir", str(out), cwd=tmp_path)
    _check_adapter_sync(_metrics(out))
    assert "LoRA syncs reach the engines as adapters the engine serves itself" in result.stdout


def test_merge_on_sync_sends_the_whole_model(tmp_path: Path) -> None:
    out = tmp_path / "o"
    flags = ["--lora-rank", "4", "--num-rollout", "2", "--lora-merge-on-sync"]
    flags += ["--prompt-data", "builtin:lookup", "--rollout-batch-size", "4", "--max-turns", "2"]
    flags += ["--weight-sync", "disk", "--dynamic-sampling-filter"]
    _train(*flags, "--output-dir", str(out), cwd=tmp_path)
    rows = _metrics(out)
    assert rows[0]["perf/weight_sync_bytes"] == rows[1]["perf/weight_sync_bytes"] > 0
    assert all(r["weights/probe_logprob_abs_diff"] < 1e-4 for r in rows)
    assert all("agent/turns_mean" in r for r in rows)
