"""The weight-transfer source's bucketing: what every transport relies on.

Proves that ``iter_buckets`` delivers every weight exactly once and in order;
that each bucket stays within the byte budget unless it holds one oversize
tensor alone; that it is lazy — a bucket's tensors are materialized only when
that bucket is requested, after the previous one was handed out, and the
generator keeps no reference to a consumed bucket; that declared sizes are
enforced; and the edge cases (empty input, budget below every tensor,
zero-size tensors). Also ``bucket_metadata`` and the state-dict adapter.
"""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch

from vime.weights.buckets import (
    WeightEntry,
    bucket_metadata,
    bucket_nbytes,
    entries_from_state_dict,
    iter_buckets,
    tensor_nbytes,
)


def _recording_entries(sizes: list[int], log: list[str]) -> list[WeightEntry]:
    """fp32 vectors of ``sizes`` elements whose thunks append their name to ``log``."""

    def make(name: str, numel: int):
        def materialize() -> torch.Tensor:
            log.append(name)
            return torch.full((numel,), float(len(log)))

        return materialize

    return [WeightEntry(f"w{i}", n * 4, make(f"w{i}", n)) for i, n in enumerate(sizes)]


def _names(buckets: list[list[tuple[str, torch.Tensor]]]) -> list[list[str]]:
    return [[name for name, _ in bucket] for bucket in buckets]


@pytest.mark.parametrize("budget", [1, 16, 40, 64, 100, 10_000])
def test_every_tensor_once_in_order_and_within_budget(budget: int) -> None:
    sizes = [3, 5, 1, 10, 2, 2, 7, 0, 4, 30, 1]
    buckets = list(iter_buckets(_recording_entries(sizes, []), budget))
    flat = [name for names in _names(buckets) for name in names]
    assert flat == [f"w{i}" for i in range(len(sizes))]
    for bucket in buckets:
        assert bucket, "no empty buckets"
        assert bucket_nbytes(bucket) <= budget or len(bucket) == 1
    # Greedy: a bucket closes only when the next tensor would not fit.
    for this, nxt in itertools.pairwise(buckets):
        assert bucket_nbytes(this) + bucket_nbytes(nxt[:1]) > budget


def test_exact_grouping() -> None:
    # 4-byte elements: sizes 12, 20, 4, 40, 8, 8 bytes under a 32-byte budget.
    buckets = list(iter_buckets(_recording_entries([3, 5, 1, 10, 2, 2], []), 32))
    assert _names(buckets) == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5"]]


def test_oversize_tensor_travels_alone() -> None:
    buckets = list(iter_buckets(_recording_entries([1, 100, 1], []), 16))
    assert _names(buckets) == [["w0"], ["w1"], ["w2"]]
    assert bucket_nbytes(buckets[1]) == 400


def test_materializes_one_bucket_at_a_time() -> None:
    log: list[str] = []
    gen = iter_buckets(_recording_entries([2, 2, 2, 2, 2], log), 16)
    assert log == [], "creating the iterator must not materialize anything"
    first = next(gen)
    assert _names([first]) == [["w0", "w1"]]
    assert log == ["w0", "w1"], "bucket 1 must not be touched while bucket 0 is out"
    second = next(gen)
    assert _names([second]) == [["w2", "w3"]]
    assert log == ["w0", "w1", "w2", "w3"]
    assert [name for name, _ in next(gen)] == ["w4"]
    assert log == ["w0", "w1", "w2", "w3", "w4"]
    with pytest.raises(StopIteration):
        next(gen)


def test_consumed_bucket_is_freed_before_the_next_is_built() -> None:
    refs: list[weakref.ref] = []
    alive_when_built: list[int] = []

    def make(i: int):
        def materialize() -> torch.Tensor:
            # Count tensors of *earlier* buckets still alive right now.
            alive_when_built.append(sum(ref() is not None for ref in refs[: i - i % 2]))
            tensor = torch.zeros(4)
            refs.append(weakref.ref(tensor))
            return tensor

        return materialize

    entries = [WeightEntry(f"w{i}", 16, make(i)) for i in range(6)]
    for bucket in iter_buckets(entries, 32):  # two tensors per bucket
        assert len(bucket) == 2
        del bucket  # the consumer lets go; nothing else may hold it
        gc.collect()
    assert alive_when_built == [0] * 6


def test_empty_input() -> None:
    assert list(iter_buckets([], 1024)) == []


def test_budget_smaller_than_every_tensor() -> None:
    buckets = list(iter_buckets(_recording_entries([4, 5, 6], []), 1))
    assert _names(buckets) == [["w0"], ["w1"], ["w2"]]


def test_zero_size_tensors() -> None:
    entries = [
        WeightEntry("a", 0, lambda: torch.empty(0)),
        WeightEntry("b", 16, lambda: torch.ones(4)),
        WeightEntry("c", 0, lambda: torch.empty(0, 3)),
        WeightEntry("d", 16, lambda: torch.ones(4)),
    ]
    # Zero-byte tensors always fit: they ride along with their neighbours.
    assert _names(list(iter_buckets(entries, 16))) == [["a", "b", "c"], ["d"]]
    only_empty = [WeightEntry(n, 0, lambda: torch.empty(0)) for n in "xyz"]
    assert _names(list(iter_buckets(only_empty, 1))) == [["x", "y", "z"]]


def test_plain_tuples_are_entries() -> None:
    buckets = list(iter_buckets([("a", 8, lambda: torch.ones(2))], 8))
    assert _names(buckets) == [["a"]]


def test_declared_size_is_enforced() -> None:
    lying = [WeightEntry("w", 4, lambda: torch.ones(2))]
    with pytest.raises(ValueError, match="declared 4 bytes"):
        list(iter_buckets(lying, 64))


@pytest.mark.parametrize("budget", [0, -5])
def test_non_positive_budget_rejected(budget: int) -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets([], budget))


def test_bucket_metadata() -> None:
    bucket = [("a", torch.zeros(2, 3)), ("b", torch.zeros(5, dtype=torch.bfloat16))]
    assert bucket_metadata(bucket) == [("a", torch.float32, (2, 3)), ("b", torch.bfloat16, (5,))]
    assert bucket_nbytes(bucket) == 2 * 3 * 4 + 5 * 2


def test_entries_from_state_dict_casts_floats_only() -> None:
    state = {"w": torch.randn(3, 4), "steps": torch.arange(5)}
    entries = list(entries_from_state_dict(state, dtype=torch.bfloat16))
    assert [(e.name, e.nbytes) for e in entries] == [("w", 24), ("steps", 40)]
    (bucket,) = iter_buckets(entries, 1 << 20)
    assert bucket_metadata(bucket) == [("w", torch.bfloat16, (3, 4)), ("steps", torch.int64, (5,))]
    assert torch.equal(bucket[0][1], state["w"].to(torch.bfloat16))
    assert tensor_nbytes((3, 4), torch.float16) == 24
