"""MetricAccumulator: means weighted by tokens/samples, across micro-batches and ranks.

Proves: token- and sample-weighted means match hand-computed values; ragged
micro-batches give exactly the means of one big batch (where a plain mean of
per-micro-batch means would not); two simulated ranks' ``to_tensor`` summed
(what an ``all_reduce(SUM)`` does) and rebuilt with ``from_tensor`` give the
global means; ``merge`` is the same as adding everything to one accumulator;
zero-weight names are omitted; NaN at masked positions is ignored; a maximum ignores
masked positions, merges by max and is omitted when nothing was measured; ``all_reduce``
over two real gloo ranks that hold different names (a pipeline stage without the loss)
sums each name over the ranks that have it and takes each maximum over them.
"""

from __future__ import annotations

import math

import pytest
import torch

from vime.algo.metrics import MetricAccumulator


def _batch(seed: int, b: int, t: int):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(b, t, generator=gen)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    return values, mask


def _fill(acc: MetricAccumulator, values: torch.Tensor, mask: torch.Tensor) -> None:
    acc.add_tokens("clipfrac", values, mask)
    acc.add_samples("reward", values[:, 0])
    acc.add_samples("weighted", values[:, 1], weights=mask.sum(1))


def test_hand_computed_means():
    acc = MetricAccumulator()
    acc.add_tokens(
        "kl", torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]])
    )
    acc.add_samples("reward", torch.tensor([1.0, 0.0, 0.0, 1.0]))
    acc.add_samples("len_weighted", torch.tensor([1.0, 4.0]), weights=torch.tensor([3.0, 1.0]))
    acc.add("loss", 6.0, 4)
    acc.add("loss", torch.tensor(2.0), torch.tensor(4.0))
    assert acc.means() == pytest.approx(
        {"kl": 7 / 3, "reward": 0.5, "len_weighted": 7 / 4, "loss": 1.0}, rel=1e-12
    )


def test_ragged_micro_batches_equal_one_big_batch():
    values, mask = _batch(seed=0, b=7, t=9)
    whole = MetricAccumulator()
    _fill(whole, values, mask)

    micro = MetricAccumulator()
    naive = []
    for start in range(0, 7, 3):  # micro-batches of 3, 3, 1 rows
        v, m = values[start : start + 3], mask[start : start + 3]
        _fill(micro, v, m)
        naive.append(((v * m).sum() / m.sum()).item())

    assert micro.means() == pytest.approx(whole.means(), rel=1e-12)
    true_mean = ((values * mask).sum() / mask.sum()).item()
    assert whole.means()["clipfrac"] == pytest.approx(true_mean, rel=1e-6)
    # the bug this class exists to avoid: a mean of micro-batch means is off
    assert abs(sum(naive) / len(naive) - true_mean) > 1e-3


def test_two_ranks_sum_of_tensors_gives_global_means():
    values, mask = _batch(seed=1, b=10, t=6)
    whole = MetricAccumulator()
    _fill(whole, values, mask)

    ranks = [MetricAccumulator(), MetricAccumulator()]
    for acc, rows in zip(ranks, [slice(0, 7), slice(7, 10)], strict=True):  # uneven split
        for start in range(rows.start, rows.stop, 2):
            end = min(start + 2, rows.stop)
            _fill(acc, values[start:end], mask[start:end])
    packed = [acc.to_tensor() for acc in ranks]
    names = packed[0][0]
    assert names == packed[1][0] == sorted(names)
    assert packed[0][1].dtype == torch.float64 and packed[0][1].shape == (2 * len(names),)

    reduced = packed[0][1] + packed[1][1]  # what all_reduce(SUM) leaves on every rank
    glob = MetricAccumulator.from_tensor(names, reduced)
    assert glob.means() == pytest.approx(whole.means(), rel=1e-12)


def test_tensor_layout_is_sums_then_weights():
    acc = MetricAccumulator()
    acc.add("b", 3.0, 2.0)
    acc.add("a", 10.0, 4.0)
    names, t = acc.to_tensor()
    assert names == ["a", "b"]
    assert t.tolist() == [10.0, 3.0, 4.0, 2.0]
    with pytest.raises(ValueError, match=r"expected a 1-D tensor of 2·2 values; got shape \(3,\)"):
        MetricAccumulator.from_tensor(names, t[:3])


def test_merge_equals_single_accumulator():
    v1, m1 = _batch(seed=2, b=4, t=5)
    v2, m2 = _batch(seed=3, b=2, t=5)
    one, a, b = MetricAccumulator(), MetricAccumulator(), MetricAccumulator()
    _fill(one, v1, m1)
    _fill(one, v2, m2)
    _fill(a, v1, m1)
    _fill(b, v2, m2)
    assert a.merge(b) is a
    assert a.means() == pytest.approx(one.means(), rel=1e-12)


def test_zero_weight_name_is_omitted_but_kept_for_reduction():
    acc = MetricAccumulator()
    acc.add_tokens("dual_clipfrac", torch.ones(2, 3), torch.zeros(2, 3))
    acc.add_samples("reward", torch.tensor([2.0]))
    assert acc.means() == {"reward": 2.0}
    # the name still travels, so every rank packs the same layout
    assert acc.to_tensor()[0] == ["dual_clipfrac", "reward"]
    assert MetricAccumulator().means() == {}
    assert MetricAccumulator().to_tensor()[1].numel() == 0


def test_zero_weight_name_can_be_given_a_value():
    """``means(empty=...)``: a registered name nothing measured keeps its key (the train
    metrics of a rollout whose every reward failed still have every key)."""
    acc = MetricAccumulator()
    acc.add_tokens("entropy", torch.ones(2, 3), torch.zeros(2, 3))
    acc.add_samples("reward", torch.tensor([2.0]))
    means = acc.means(empty=math.nan)
    assert sorted(means) == ["entropy", "reward"]
    assert math.isnan(means["entropy"]) and means["reward"] == 2.0


def test_nan_at_masked_positions_is_ignored():
    acc = MetricAccumulator()
    values = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    acc.add_tokens("x", values, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    assert acc.means() == {"x": 2.0}


def test_values_are_detached_and_shapes_checked():
    acc = MetricAccumulator()
    v = torch.ones(2, 2, requires_grad=True)
    acc.add_tokens("x", v * 2, torch.ones(2, 2))
    assert not acc.to_tensor()[1].requires_grad
    with pytest.raises(ValueError, match=r"values and mask shapes differ: \(2, 2\) vs \(2, 3\)"):
        acc.add_tokens("x", v, torch.ones(2, 3))
    with pytest.raises(ValueError, match="values and weights sizes differ: 2 vs 3"):
        acc.add_samples("y", torch.ones(2), weights=torch.ones(3))


def test_maximum_over_masked_values_and_merges():
    acc = MetricAccumulator()
    values = torch.tensor([[1.0, 9.0], [3.0, float("nan")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    acc.add_max("top", values, mask)  # 9 and NaN sit at masked positions
    assert acc.means() == {"top": 3.0}
    other = MetricAccumulator()
    other.add_max("top", torch.tensor([[5.0]]), torch.ones(1, 1))
    other.add_max("none", torch.tensor([[5.0]]), torch.zeros(1, 1))
    acc.merge(other)
    assert acc.means() == {"top": 5.0}  # "none" measured nothing
    assert acc.means(empty=math.nan)["none"] != acc.means(empty=math.nan)["none"]
    assert acc.names() == []  # maxima are not in the summed layout


def _all_reduce_job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    acc = MetricAccumulator()
    acc.add("loss", 1.0 + rank, 0.5)
    acc.add_max("ratio_max", torch.tensor([[3.0 - 2 * rank]]), torch.ones(1, 1))
    if rank == 1:  # only the last pipeline stage computes the loss's metrics
        acc.add_samples("entropy", torch.tensor([2.0, 4.0]))
        acc.add_max("weight_max", torch.tensor([[7.0]]), torch.ones(1, 1))
    before = acc.means()
    reduced = acc.all_reduce()
    return {"means": reduced.means(), "unchanged": acc.means() == before}


def test_all_reduce_over_ranks_with_different_names(tmp_path) -> None:
    from actor_harness import spawn

    got = spawn(_all_reduce_job, 2, tmp_path)
    expected = {"loss": (1.0 + 2.0) / 1.0, "entropy": 3.0, "ratio_max": 3.0, "weight_max": 7.0}
    assert got["means"] == pytest.approx(expected)
    assert got["unchanged"]
