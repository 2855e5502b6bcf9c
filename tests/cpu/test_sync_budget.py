"""A training step syncs the host with the device at most twice per optimizer step.

Proves: ``vime.sync_budget.SyncCounter`` counts what would sync on CUDA (``.item()``,
``float``/``bool`` of a tensor, ``.tolist()``, ``nonzero``, boolean-mask indexing,
``unique``, a blocking copy through ``vime.device``) and skips what runs on the host by
design (``host_only``, a non-blocking ``to_device``), so it is shown able to fail; and
one rollout of each backend's real ``train`` (world size 1, KL on, two optimizer steps)
on a sampled-like batch, counted as the trainer runs it, stays within the budget of
issue 32: no sync inside the micro-batch loop (per packed row), at most two per
optimizer step (the grad norm's finiteness, the metrics' one read). The step runs the
GPU's log-prob tail, ``--lm-head-tail fused``, shown taken: the LM head's own matmul
sees no row. ``record`` prints where every counted sync came from.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from actor_harness import actor_args, counted_train, spawn

from vime import device
from vime.sync_budget import SyncCounter, host_only

ROW_BUDGET = 0
STEP_BUDGET = 2


def test_counter_counts_what_would_sync() -> None:
    t = torch.arange(6.0)
    with SyncCounter() as counter:
        t.sum().item()
        float(t.max())
        bool(t[1] > 0)
        t.tolist()
        t[t > 2]
        torch.unique(t)
        t.nonzero()
        device.to_host(t)
    kinds = counter.counts["other"]
    assert kinds == {
        "item": 3,
        "tolist": 1,
        "bool index": 1,
        "unique": 1,
        "nonzero": 1,
        "d2h copy": 1,
    }, kinds


def test_counter_skips_host_work_and_async_copies() -> None:
    t = torch.arange(6.0)
    with SyncCounter() as counter, counter.phase("row"):
        with host_only():
            t[t > 2].tolist()
        device.to_device(t, "cpu")
        (t * 2).sum()
    assert counter.total("row") == 0 and counter.total("other") == 0


def _count_job(rank: int, world: int, backend: str, args) -> dict:
    counter = SyncCounter()
    got = counted_train(backend, args, world, counter, forward_phase="rows")
    return {
        "rows": got["rows"]["rows"],
        "head_rows": got["head_rows"],
        "steps": got["steps"],
        "row_syncs": counter.total("rows"),
        "step_syncs": counter.total("other"),
        "sites": sorted(counter.sites.items()),
    }


def record(backend: str, got: dict) -> None:
    print(
        f"{backend}: {got['row_syncs']} syncs over {got['rows']} packed rows, "
        f"{got['step_syncs']} over {got['steps']} optimizer steps"
    )
    for (kind, site), n in got["sites"]:
        print(f"  {n:4d} {kind:12s} {site}")


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_train_step_holds_the_sync_budget(backend: str, gqa_hf_dir, tmp_path: Path) -> None:
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    args = actor_args(gqa_hf_dir, 1, "--lm-head-tail", "fused", backend=backend)
    got = spawn(_count_job, 1, tmp_path, backend, args)
    record(backend, got)
    assert got["steps"] == 2 and got["rows"] > 0
    assert got["head_rows"] == 0, "the fused tail was not taken"
    assert got["row_syncs"] <= ROW_BUDGET * got["rows"], got["sites"]
    assert got["step_syncs"] <= STEP_BUDGET * got["steps"], got["sites"]
