"""A training step launches no more kernels per layer per packed row than its ceiling.

Proves: ``vime.launch_budget.LaunchCounter`` counts the ops that would launch a kernel on
CUDA and skips views, allocations and host-only work, so it is shown able to fail; and
one rollout of each backend's real ``train`` (world size 1, KL on, two optimizer steps),
counted as the trainer runs it, launches per layer per packed row at most a recorded
ceiling times what the naive padded HF step (``bench/train_step.py``) launches on the
same rows of the same model, and per optimizer step at most its own ceiling. The
ceilings are today's figures plus a little headroom (bench/README.md): a change that
adds launches fails here. ``record`` prints the figures and the most launched ops.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from actor_harness import VOCAB, actor_args, counted_train, make_batch, spawn
from tiny_models import tiny_qwen3_config

from vime.launch_budget import LaunchCounter
from vime.sync_budget import host_only

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import train_step as bench

# Launches per layer per packed row as a multiple of the naive padded step's, and per
# optimizer step outside the rows (the clip, AdamW, the grad norm, the metrics, the KL
# reference's weight swap): measured 2026-12-05, fsdp2 1.54 and 110.5, megatron 1.51 and
# 95.5 (168.5 before its grad norm became one multi-tensor op); the naive step 185.2 a
# layer a row and 17 a step.
ROW_RATIO_CEILING = {"fsdp2": 1.60, "megatron": 1.60}
STEP_CEILING = {"fsdp2": 120, "megatron": 105}


def test_counter_counts_kernels_not_views() -> None:
    t = torch.arange(6.0)
    with LaunchCounter() as counter:
        t.view(2, 3).t().unsqueeze(0).squeeze(0)
        t.expand(2, 6)
        t[1:], t[2], t.detach(), t.split(2)
        t.reshape(3, 2).permute(1, 0)
        torch.empty(3)
        with host_only():
            t * 3
        with counter.phase("row"):
            t * 2
            t.clone().add_(1)
            torch._foreach_mul_([t.clone(), t.clone()], 2)
    assert counter.total("other") == 0, counter.counts
    assert counter.counts["row"] == {"mul": 1, "clone": 3, "add_": 1, "_foreach_mul_": 1}


def _count_job(rank: int, world: int, backend: str, args) -> dict:
    # The forward-only log-prob passes (KL reference, old policy) apart: the naive step
    # has none.
    counter = LaunchCounter()
    got = counted_train(backend, args, world, counter, forward_phase="log-probs")
    figures = _figures(counter, got["rows"]["rows"], got["steps"])
    return {**figures, "rollout": got["rollout"], "log_prob_launches": counter.total("log-probs")}


def _figures(counter: LaunchCounter, rows: int, steps: int) -> dict:
    return {
        "rows": rows,
        "steps": steps,
        "row_launches": counter.total("rows"),
        "step_launches": counter.total("other"),
        "top_rows": counter.top("rows"),
        "top_steps": counter.top("other"),
    }


def _naive(gqa_hf_dir: str, args, rollout: int) -> dict:
    """The naive padded step on ``rollout``'s samples in rows of as many as the actor's,
    as many updates as its plan has (the same model, one warm-up rollout first)."""
    model, opt = bench.naive_model(gqa_hf_dir, torch.device("cpu"), args.lr)
    per_step = args.global_batch_size // args.micro_batch_size
    counted = {}
    for rollout_id in (rollout - 1, rollout):
        batch = make_batch(rollout_id)
        rows = bench.naive_micro_batches(batch, args.micro_batch_size, torch.device("cpu"))
        n_loss_tokens = sum(sum(m) for m in batch.loss_masks)
        with LaunchCounter() as counter:
            for i, row in enumerate(rows):
                with counter.phase("rows"):
                    bench.naive_row(model, row, n_loss_tokens)
                if (i + 1) % per_step == 0:
                    bench.naive_update(model, opt)
        counted = _figures(counter, len(rows), len(rows) // per_step)
    return counted


def record(name: str, got: dict, layers: int, naive: dict | None = None) -> float:
    """Print ``got``'s figures; return its launches per layer per row over the naive's."""
    per_row = got["row_launches"] / got["rows"] / layers
    ratio = per_row / (naive["row_launches"] / naive["rows"] / layers) if naive else 1.0
    print(
        f"{name}: {per_row:.1f} launches per layer per packed row ({got['rows']} rows, "
        f"ratio to naive {ratio:.2f}), {got['step_launches'] / got['steps']:.1f} per "
        f"optimizer step ({got['steps']} steps)"
    )
    if "log_prob_launches" in got:
        print(f"  forward-only log-prob passes: {got['log_prob_launches']} launches")
    print("  rows:", ", ".join(f"{op} {n}" for op, n in got["top_rows"]))
    print("  steps:", ", ".join(f"{op} {n}" for op, n in got["top_steps"]))
    return ratio


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_train_step_holds_the_launch_budget(backend: str, gqa_hf_dir, tmp_path: Path) -> None:
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    args = actor_args(gqa_hf_dir, 1, backend=backend)
    layers = tiny_qwen3_config(VOCAB).num_hidden_layers
    got = spawn(_count_job, 1, tmp_path, backend, args)
    naive = _naive(gqa_hf_dir, args, got["rollout"])
    record("naive HF (padded)", naive, layers)
    ratio = record(backend, got, layers, naive)
    assert got["steps"] == naive["steps"] == 2 and got["rows"] == naive["rows"] > 0
    assert ratio <= ROW_RATIO_CEILING[backend], got["top_rows"]
    assert got["step_launches"] / got["steps"] <= STEP_CEILING[backend], got["top_steps"]
