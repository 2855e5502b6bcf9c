"""bf16 megatron training with fp32 main weights (``vime/backends/megatron/main_params.py``).

Proves: gradients of the bf16 model accumulate in fp32 on the main weights (the sum
of two backward passes, exactly, with nothing left on the model); updates too small
for bf16 survive in the main weight and reach the model once they add up; and, for
the real actor on gloo (CPU bf16 matmuls): ``--megatron-param-dtype bfloat16`` trains
every weight in bf16 (norms too), keeps each one exactly the rounding of its fp32
main weight, lands within bf16 error of the fp32 run on loss and gradient norm, and
resumes bitwise from a checkpoint (which must therefore hold the main weights, not
only the bf16 ones); a bf16 checkpoint is refused by an fp32 run with a clear error.
(bf16 with the distributed optimizer: ``test_megatron_actor.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from actor_harness import VOCAB, actor_args, make_batch, spawn
from tiny_models import save_tiny, tiny_qwen3_config

pytest.importorskip("megatron.core")

from vime.backends.megatron.main_params import MainParams
from vime.config.train_settings import train_settings


def test_gradients_accumulate_in_fp32() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16, dtype=torch.bfloat16)
    main = MainParams(list(layer.parameters()))
    grads = []
    for seed in (1, 2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)).bfloat16()
        plain = torch.nn.Linear(16, 16, dtype=torch.bfloat16)
        plain.load_state_dict(layer.state_dict())
        plain(x).float().square().sum().backward()
        grads.append([p.grad.float() for p in plain.parameters()])
        layer(x).float().square().sum().backward()
    per_param = zip(*grads, strict=True)
    for model, fp32, (g1, g2) in zip(layer.parameters(), main.params, per_param, strict=True):
        assert model.grad is None
        assert fp32.grad.dtype == torch.float32
        assert torch.equal(fp32.grad, g1 + g2)


def test_small_updates_survive_in_the_main_weight() -> None:
    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    main = MainParams([weight])
    step = 5e-4  # bf16 spacing just below 1.0 is 2**-8 ~ 3.9e-3: half of it is ~1.95e-3
    for _ in range(3):
        with torch.no_grad():
            main.params[0] -= step
        main.to_model()
        assert torch.equal(weight, torch.ones(4, dtype=torch.bfloat16))  # rounds back to 1
    with torch.no_grad():
        main.params[0] -= 2 * step  # 2.5e-3 in all: past half a spacing
    main.to_model()
    assert torch.equal(weight.float(), torch.full((4,), 1 - 2**-8))
    assert torch.allclose(main.params[0], torch.full((4,), 1 - 5 * step))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    config = tiny_qwen3_config(VOCAB)
    config.num_key_value_heads = 2
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3_bf16"), config, seed=0)


def _job(rank: int, world: int, args, rollouts: int, save_at: int | None) -> dict:
    import torch.distributed as dist

    from vime.backends.policy_actor import make_actor
    from vime.data.batch import schedule

    actor = make_actor("megatron")
    start = actor.init(train_settings(args))
    metrics = []
    for rollout_id in range(start, start + rollouts):
        sched = schedule(
            make_batch(rollout_id),
            global_batch_size=args.global_batch_size,
            dp_size=actor.backend.dp_size,
            micro_batch_size=args.micro_batch_size,
        )
        metrics.append(actor.train(sched))
        if rollout_id == save_at:
            actor.save(rollout_id)
    main = actor.backend.main.params if actor.backend.main is not None else actor.backend.params
    weights = {n: t.clone() for b in actor.weight_buckets(1 << 16) for n, t in b}
    rounded = all(
        torch.equal(m.to(p.dtype), p.detach())
        for m, p in zip(main, actor.backend.params, strict=True)
    )
    dist.barrier()
    return {
        "start": start,
        "metrics": metrics,
        "weights": weights,
        "dtypes": sorted({str(p.dtype) for p in actor.backend.params}),
        "rounded": rounded,
    }


def _run(hf: str, world: int, tmp_path: Path, *flags: str, rollouts: int = 2, save_at=None):
    args = actor_args(hf, world, "--num-rollout", "4", *flags, backend="megatron")
    return spawn(_job, world, tmp_path, args, rollouts, save_at)


BF16 = ("--megatron-param-dtype", "bfloat16")


def test_bf16_training_tracks_fp32_and_resumes_bitwise(hf_dir, tmp_path) -> None:
    fp32 = _run(hf_dir, 1, tmp_path, "--megatron-param-dtype", "float32")
    whole = _run(hf_dir, 1, tmp_path, *BF16, rollouts=4)
    assert whole["dtypes"] == ["torch.bfloat16"] and whole["rounded"]
    assert fp32["dtypes"] == ["torch.float32"]
    # bf16 keeps 8 mantissa bits: relative error ~4e-3 per op, a few percent after a
    # forward/backward and a step; a wrong scale or a lost gradient is far outside.
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        for got, want in zip(whole["metrics"][:2], fp32["metrics"], strict=True):
            assert got[key] == pytest.approx(want[key], rel=5e-2), key
    ckpt = str(tmp_path / "ckpt")
    _run(hf_dir, 1, tmp_path, *BF16, "--save", ckpt, save_at=1)
    resumed = _run(hf_dir, 1, tmp_path, *BF16, "--load", ckpt)
    assert resumed["start"] == 2 and resumed["rounded"]
    assert resumed["metrics"] == whole["metrics"][2:]
    for name, weight in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name


def test_fp32_run_refuses_a_bf16_checkpoint(tmp_path) -> None:
    from vime import checkpoint
    from vime.backends.policy_actor import make_actor

    counters = {"samples_consumed": 8, "optimizer_steps": 2, "skipped_steps": 0}
    checkpoint.begin_save(tmp_path, 1, is_rank0=True)
    checkpoint.commit_save(
        tmp_path,
        1,
        backend="megatron",
        world_size=1,
        extra={"counters": counters, "tp": 1, "pp": 1, "param_dtype": "torch.bfloat16"},
    )
    actor = make_actor("megatron")
    (
        actor.backend.tp,
        actor.backend.pp,
        actor.backend.distributed,
        actor.backend.transformer_impl,
    ) = 1, 1, False, "local"
    actor.backend.param_dtype = torch.float32
    with pytest.raises(checkpoint.CheckpointError, match="same --megatron-param-dtype"):
        actor._load(str(tmp_path))
