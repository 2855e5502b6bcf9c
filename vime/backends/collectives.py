"""Collectives over many tensors at once, for the training backends.

Where it fits: ``MegatronBackend`` sums each step's gradients over its data-parallel
group here (without the distributed optimizer: megatron-core's DDP wrapper buckets
its own). One all-reduce per parameter is a few hundred collectives a step, each paying
NCCL's launch and latency; packed into flat buffers of a few tens of megabytes it is a
handful, at the same bandwidth.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from vime.weights.buckets import WeightEntry, iter_buckets

DEFAULT_BUCKET_BYTES = 64 << 20


def flat_buckets(
    tensors: Sequence[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[torch.Tensor]]:
    """``tensors`` in groups of one dtype and device, in order within each, each group at
    most ``bucket_bytes`` unless a single tensor is larger (it is a group of its own):
    ``iter_buckets``' rule, applied per dtype and device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same_kind in by_kind.values():
        entries = (
            WeightEntry(str(i), tensor.numel() * tensor.element_size(), lambda t=tensor: t)
            for i, tensor in enumerate(same_kind)
        )
        for bucket in iter_buckets(entries, bucket_bytes):
            yield [tensor for _, tensor in bucket]


@torch.no_grad()
def all_reduce_sum(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Sum every tensor over ``group`` in place, one all-reduce per flat bucket (a
    collective: every rank passes tensors of the same shapes, dtypes and order)."""
    for bucket in flat_buckets(tensors, bucket_bytes):
        if len(bucket) == 1:
            dist.all_reduce(bucket[0], group=group)
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        parts = flat.split([t.numel() for t in bucket])
        torch._foreach_copy_(bucket, [p.view_as(t) for p, t in zip(parts, bucket, strict=True)])
