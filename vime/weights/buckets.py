"""Size-bounded, lazily materialized buckets of HF-named weights.

Where it fits: the backend-independent half of the weight-transfer source.
A backend describes its weights as :class:`WeightEntry` items — the HF name,
the byte size *of the tensor it will produce*, and a thunk that produces it
(FSDP2: ``param.full_tensor()``; Megatron: gather the tensor-parallel shards
and convert to the HF layout). :func:`iter_buckets` groups them into lists of
``(hf_name, tensor)`` no larger than ``--update-weight-buffer-size`` bytes,
which is what every transport and rollout engine's ``update_weights``
consumes, and what :func:`vime.weights.hf_export.save_hf_folder` writes for
``--save-hf``.

Sizes are declared up front so a bucket boundary is decided *before* a tensor
is gathered: at most one bucket of full tensors is alive at a time, and the
thunks of bucket k+1 run only when the consumer asks for bucket k+1. The
thunks are called in input order, so collective gathers (which every rank must
issue in the same order) stay in lock-step across ranks.

Kept free of transformers (and of any backend) on purpose: it is imported on
every training rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple

import torch

Bucket = list[tuple[str, torch.Tensor]]


class WeightEntry(NamedTuple):
    """One weight, described before it exists.

    A plain ``(name, nbytes, materialize)`` tuple is accepted wherever an
    entry is, since this is a named tuple.
    """

    name: str
    nbytes: int
    materialize: Callable[[], torch.Tensor]


def tensor_nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    """Bytes a contiguous tensor of ``shape`` and ``dtype`` occupies."""
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel * dtype.itemsize


def entries_from_state_dict(
    state_dict: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None
) -> Iterator[WeightEntry]:
    """Entries over already-materialized tensors (an unsharded model, tests).

    With ``dtype``, floating-point tensors are cast when materialized (and
    their declared size is that of the cast tensor); others keep their dtype.
    """
    for name, tensor in state_dict.items():
        out_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        yield WeightEntry(
            name,
            tensor_nbytes(tensor.shape, out_dtype),
            # Bind through defaults: a closure over the loop variables would
            # see only the last tensor by the time it is called.
            lambda t=tensor, d=out_dtype: t.detach().to(d),
        )


def iter_buckets(
    entries: Iterable[WeightEntry | tuple[str, int, Callable[[], torch.Tensor]]],
    bucket_bytes: int,
) -> Iterator[Bucket]:
    """Group ``entries`` into buckets of at most ``bucket_bytes`` declared bytes.

    Order is preserved and every entry appears exactly once. An entry larger
    than the budget travels alone in its own bucket. A bucket's thunks are
    called only when that bucket is requested, after the previous bucket was
    handed out, and the generator keeps no reference to a bucket it has
    yielded, so the consumer alone decides when its memory is freed.

    Raises ``ValueError`` for a non-positive budget, a negative size, or a
    thunk whose tensor's size differs from the declared one (a wrong
    declaration would silently break the memory bound).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    pending: list[WeightEntry] = []
    pending_bytes = 0
    for raw in entries:
        entry = WeightEntry(*raw)
        if entry.nbytes < 0:
            raise ValueError(f"{entry.name}: negative size {entry.nbytes}")
        if pending and pending_bytes + entry.nbytes > bucket_bytes:
            bucket = _materialize(pending)
            pending, pending_bytes = [], 0
            yield bucket
            # Drop our reference before the next thunk runs: otherwise the
            # bucket just consumed would stay alive while the next one is built.
            del bucket
        pending.append(entry)
        pending_bytes += entry.nbytes
    if pending:
        yield _materialize(pending)


def _materialize(entries: list[WeightEntry]) -> Bucket:
    bucket: Bucket = []
    for entry in entries:
        tensor = entry.materialize()
        actual = tensor.numel() * tensor.element_size()
        if actual != entry.nbytes:
            raise ValueError(
                f"{entry.name}: declared {entry.nbytes} bytes but materialized "
                f"{actual} ({tuple(tensor.shape)}, {tensor.dtype})"
            )
        bucket.append((entry.name, tensor))
    return bucket


def bucket_nbytes(bucket: Bucket) -> int:
    """Total bytes of the tensors in ``bucket``."""
    return sum(t.numel() * t.element_size() for _, t in bucket)


def bucket_metadata(bucket: Bucket) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(name, dtype, shape)`` per tensor: what a transport sends ahead of the
    bytes so the receiver can allocate, and verify what arrived."""
    return [(name, t.dtype, tuple(t.shape)) for name, t in bucket]
