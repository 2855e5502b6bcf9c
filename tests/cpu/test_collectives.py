"""``vime.backends.collectives``: many tensors summed over a group in a few flat buckets.

Proves that ``flat_buckets`` keeps each tensor exactly once, in order, in groups of one
dtype no larger than the limit (a larger tensor alone), and that ``all_reduce_sum`` on
three real gloo ranks leaves every tensor -- float32, bfloat16, int64, a transposed
(non-contiguous) view, one over the bucket limit -- holding exactly the sum over the
ranks, as one all-reduce per tensor would.
"""

from __future__ import annotations

import torch
from actor_harness import spawn

from vime.backends.collectives import all_reduce_sum, flat_buckets


def _tensors(scale: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    # Small integers: every sum is exact in each dtype, whatever the reduction order.
    ints = [torch.randint(-8, 8, shape) for shape in [(5, 3), (7,), (64, 4), (2, 2, 2), (3,)]]
    tensors = [
        (ints[0] * scale).float(),
        (ints[1] * scale).to(torch.bfloat16),
        (ints[2] * scale).float(),  # 1 KiB: over the 512-byte limit, a bucket of its own
        ints[3] * scale,  # int64
        (ints[0] * scale).float().t(),  # a transposed view
        (ints[4] * scale).to(torch.bfloat16),
    ]
    return tensors


def test_flat_buckets_group_by_dtype_in_order_under_the_limit() -> None:
    tensors = _tensors(1)
    buckets = list(flat_buckets(tensors, bucket_bytes=512))
    flat = [t for bucket in buckets for t in bucket]
    assert sorted(map(id, flat)) == sorted(map(id, tensors))
    for bucket in buckets:
        assert len({(t.dtype, t.device) for t in bucket}) == 1
        nbytes = sum(t.numel() * t.element_size() for t in bucket)
        assert nbytes <= 512 or len(bucket) == 1
        positions = [next(i for i, t in enumerate(tensors) if t is b) for b in bucket]
        assert positions == sorted(positions)
    assert any(len(b) == 1 and b[0] is tensors[2] for b in buckets)  # the large one alone
    assert len(list(flat_buckets(tensors))) == 3  # one per dtype under the default limit


def _sum_job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    tensors = _tensors(rank + 1)
    all_reduce_sum(tensors, None, bucket_bytes=512)
    return {"got": tensors}


def test_all_reduce_sum_equals_the_per_tensor_sums(tmp_path) -> None:
    got = spawn(_sum_job, 3, tmp_path)["got"]
    expected = _tensors(1 + 2 + 3)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(g, e)
