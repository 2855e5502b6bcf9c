"""megatron backend modes on real gloo process groups: activation recompute and sleep/wake.

Proves, with two CPU processes at TP=2 and a tiny random Qwen3:
``--megatron-recompute-granularity selective`` and ``full``, and
``--megatron-sequence-parallel`` (rows padded to a multiple of TP, activations
split along the sequence, norm gradients summed over TP), give the same step-0
gradient as ``none`` on every rank's shard (in practice bit for bit; the gradient
is checked to be non-zero) while really recomputing -- core attention runs twice
per micro-batch under ``selective``, and the whole transformer layer twice under
``full``; and ``sleep``/``wake_up`` leave a CPU run untouched (same storages, same
values), and what ``sleep`` parks on a GPU parks and comes back bit for bit here,
after which the step is unchanged.
"""

from __future__ import annotations

import pytest
import torch
from actor_harness import VOCAB, actor_args, make_batch, spawn
from tiny_models import save_tiny, tiny_qwen3_config

pytest.importorskip("megatron.core")

from vime.algo.metrics import MetricAccumulator
from vime.config.train_settings import train_settings
from vime.data.batch import schedule

GRANULARITIES = ("none", "selective", "full")
MODES = {g: ("--megatron-recompute-granularity", g) for g in GRANULARITIES}
MODES["sequence_parallel"] = ("--megatron-sequence-parallel",)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    config = tiny_qwen3_config(VOCAB, pad=0)  # the batches hold id 0: padding_idx runs
    config.num_key_value_heads = 2  # TP=2 splits the attention: one KV group per rank
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3_kv2"), config, seed=0)


def _counter(counts: dict[str, int], key: str):
    def hook(*_: object) -> None:
        counts[key] += 1

    return hook


def _step0(actor, args) -> dict:
    """Step-0 gradient (this rank's shards) and forward calls per micro-batch in backward."""
    sched = schedule(
        make_batch(0), global_batch_size=4, dp_size=actor.backend.dp_size, micro_batch_size=2
    )
    ref = actor.compute_log_probs(sched, "ref")
    layer = actor.backend.model.decoder.layers[0]
    counts = {"layer": 0, "core_attention": 0}
    tokens_in: list[int] = []  # sequence length of each hidden state entering layer 0
    handles = [
        layer.register_forward_pre_hook(
            lambda _m, a, k: tokens_in.append(k["hidden_states"].shape[0]), with_kwargs=True
        ),
        layer.register_forward_hook(_counter(counts, "layer")),
        layer.self_attention.core_attention.register_forward_hook(
            _counter(counts, "core_attention")
        ),
    ]
    actor.backward_step(sched, 0, MetricAccumulator(), ref=ref)
    for handle in handles:
        handle.remove()
    micro_batches = len(list(sched.plan.steps[0].for_rank(actor.dp_rank)))
    grads = {n: p.grad.clone() for n, p in actor.backend.named_params}
    for param in actor.backend.params:
        param.grad = None
    return {
        "grads": grads,
        "grad_norm": float(
            torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
        ),
        "calls": {k: v / micro_batches for k, v in counts.items()},
        "tokens_in": tokens_in,
    }


def job_modes(rank: int, world: int, hf: str) -> dict:
    from vime.backends.policy_actor import make_actor

    results: dict = {}
    for mode, flags in MODES.items():
        args = actor_args(hf, world, *flags, backend="megatron", tp=2)
        actor = make_actor("megatron")
        actor.init(train_settings(args))
        results[mode] = _step0(actor, args)
        results[mode]["row_multiple"] = actor.backend.row_multiple
        results[mode]["seq_parallel_params"] = sum(
            bool(getattr(p, "sequence_parallel", False)) for p in actor.backend.params
        )
        if mode == "none":
            before = [(p.data_ptr(), p.detach().clone()) for p in actor.backend.params]
            actor.sleep()
            actor.wake_up()
            results["sleep_untouched"] = all(
                p.data_ptr() == ptr and torch.equal(p, value)
                for (ptr, value), p in zip(before, actor.backend.params, strict=True)
            )
            # sleep as on a GPU, made to park these host tensors: every weight leaves, then
            # comes back with wake_up.
            actor._parks_on = lambda device: True
            actor.sleep()
            results["stash_freed"] = all(
                p.untyped_storage().nbytes() == 0 for p in actor.backend.params
            )
            actor.wake_up()
            del actor._parks_on
            results["stash_restored"] = all(
                torch.equal(p, value)
                for (_, value), p in zip(before, actor.backend.params, strict=True)
            )
            results["after_sleep"] = _step0(actor, args)
    return results


@pytest.fixture(scope="module")
def modes(hf_dir, tmp_path_factory) -> dict:
    return spawn(job_modes, 2, tmp_path_factory.mktemp("megatron_modes"), hf_dir)


@pytest.mark.parametrize("mode", ["selective", "full", "sequence_parallel"])
def test_mode_gives_the_same_gradient(modes, mode) -> None:
    base, other = modes["none"], modes[mode]
    assert base["grad_norm"] > 1e-3, "zero gradient: the comparison would prove nothing"
    assert sorted(other["grads"]) == sorted(base["grads"])
    for name, grad in base["grads"].items():
        torch.testing.assert_close(other["grads"][name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_recompute_really_recomputes(modes) -> None:
    assert modes["none"]["calls"] == {"layer": 1, "core_attention": 1}
    assert modes["selective"]["calls"] == {"layer": 1, "core_attention": 2}
    assert modes["full"]["calls"] == {"layer": 2, "core_attention": 2}


def test_sequence_parallel_splits_rows_and_sums_norm_grads(modes) -> None:
    """Rows are padded to a multiple of TP; every norm weight is marked for the TP sum
    (2 layers x input, pre-MLP, Q and K norms, plus the final norm); off by default."""
    assert modes["sequence_parallel"]["row_multiple"] == 2
    assert modes["sequence_parallel"]["seq_parallel_params"] == 2 * 4 + 1
    assert modes["none"]["row_multiple"] == 1 and modes["none"]["seq_parallel_params"] == 0
    # Each rank's layers see half of every (even-padded) row.
    whole, split = modes["none"]["tokens_in"], modes["sequence_parallel"]["tokens_in"]
    assert whole and len(split) == len(whole)
    assert split == [(n + n % 2) // 2 for n in whole], (whole, split)


def test_sleep_and_wake_are_noops_on_cpu(modes) -> None:
    """Also: what sleep parks on a GPU, parked on the CPU, frees every weight and puts it
    back bit for bit (the step after it is unchanged)."""
    assert modes["sleep_untouched"], "sleep/wake_up moved or changed a parameter on CPU"
    assert modes["stash_freed"], "a weight kept its memory in the stash"
    assert modes["stash_restored"], "the stash round trip changed a weight"
    for name, grad in modes["none"]["grads"].items():
        assert torch.equal(modes["after_sleep"]["grads"][name], grad), name
