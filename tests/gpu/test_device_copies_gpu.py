"""The device seam's copies on a CUDA device: pinned, asynchronous, counted where they block.

Proves: ``vime.device.to_device`` moves a host tensor through pinned memory with
``non_blocking`` (the values arrive, and ``SyncCounter`` counts no sync for it), a
packed row moved with ``PackedBatch.to`` lands whole on the device without a counted
sync, ``to_host`` counts one, and a plain blocking ``.to("cuda")`` made outside the
seam is caught by the counter's device-crossing check. Skipped without CUDA
(``conftest.py``).
"""

from __future__ import annotations

import torch

from vime import device
from vime.data.micro_batch import pack_micro_batch
from vime.sync_budget import SyncCounter


def test_to_device_is_pinned_and_asynchronous() -> None:
    cuda = torch.device("cuda", 0)
    host = torch.arange(1 << 16, dtype=torch.float32)
    assert device.pinned(host).is_pinned()
    with SyncCounter() as counter:
        moved = device.to_device(host, cuda)
        row = pack_micro_batch([[1, 2, 3, 4], [5, 6, 7]], [2, 1]).to(cuda)
    assert counter.total("other") == 0, counter.sites
    assert moved.device == cuda and torch.equal(moved.cpu(), host)
    assert row.input_ids.device == cuda and row.loss_samples.device == cuda


def test_blocking_copies_are_counted() -> None:
    with SyncCounter() as counter:
        device.to_host(torch.ones(3, device="cuda"))
        torch.ones(3).to("cuda")
    assert counter.counts["other"] == {"d2h copy": 1, "copy": 1}, counter.counts
