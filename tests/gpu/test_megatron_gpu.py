"""The megatron backend against the fsdp2 backend on one CUDA device, Qwen3-0.6B-shaped.

Proves, on a randomly initialised model with Qwen3-0.6B's shape (28 layers,
hidden 1024, 16 query / 8 KV heads of 128, tied 151936-token vocabulary) and
the same planned rollout: ``MegatronBackend`` (NCCL, megatron-core local layers,
fp32) and ``FSDP2Backend`` (NCCL, fp32 parameters and compute) give the same
per-token log-probs, the same step-0 loss and the same gradient norm within
fp32 GPU tolerances, and a non-zero gradient. TF32 is switched off so both run
true fp32 matmuls. The same again in bf16 (megatron: bf16 weights with fp32 main
weights; fsdp2: bf16 compute over fp32 shards, fp32 reduction) within bf16
tolerances. In fp32, one AdamW step on those gradients leaves the same weights in HF
names (within what sign noise on near-zero gradients allows, see the test). On CUDA
no CPU shim is in effect. And megatron's packed rows in THD format (vime's per-sample
attention) give the logits of the same row under a block-diagonal mask (megatron-core's dense
attention), in fp32. Skipped without CUDA (``conftest.py``).

Also megatron-core's distributed optimizer in bf16 on the GPU: the plain run's
step-0 loss and grad norm, a step, and a sleep / wake round trip of its buffers.

And, where ``transformer_engine`` imports, ``--megatron-transformer-impl
transformer_engine`` in bf16: TransformerEngine's layers really built (TE's core
attention over the THD rows, norms fused into the linears), per-token log-probs, loss
and a non-zero grad norm within bf16 tolerances of the local layers' bf16 run, and a
weight source that yields the same HF names, shapes, dtypes and bits as the local
actor's (the fused norm names map back to the same HF tensors). Skipped, with the
reason, where TE is not installed; the worker then builds no TE actor.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from vime.config.train_settings import train_settings
from vime.weights.transports import free_port

pytestmark = pytest.mark.gpu

# fp32 on both sides, different kernels (sdpa over the row under a block mask vs
# megatron's per-sample attention, different GEMM tilings): each op is exact to ~1e-6
# relative, 28 residual blocks compound that to ~1e-4 on the logits. A log-prob over a
# 151936 vocabulary is ~ -12, so 2e-3 absolute is ~20 such errors; a packing, RoPE or
# conversion bug moves log-probs by > 0.1.
LOGP_ATOL = 2e-3
NORM_RTOL = 1e-3
# bf16 keeps 8 mantissa bits (2e-3 relative per rounding), and the two backends round
# in different places (megatron stores bf16 weights, norms included; fsdp2 casts fp32
# shards per use): over 28 blocks the logits differ by ~1e-2 relative, a log-prob by a
# few 1e-2 on average. A packing, RoPE or conversion bug moves most tokens by > 0.5.
BF16_LOGP_MEAN_ATOL = 5e-2
BF16_RTOL = 5e-2
# TransformerEngine's layers against the local ones, both bf16 over the same bf16
# weights: the roundings sit in different places (TE normalizes inside its fused
# norm + GEMM kernel and rounds once, the local layers round the norm's output and
# then GEMM; TE's THD attention is flash / cuDNN with an fp32 online softmax, the local
# one torch SDPA per sample; other GEMM tilings). Each is ~2e-3 relative, so over 28
# blocks the same bound as between the two backends in bf16; a THD boundary, RoPE or
# norm-placement bug moves most log-probs by > 0.5.
TE_LOGP_MEAN_ATOL = BF16_LOGP_MEAN_ATOL
TE_RTOL = BF16_RTOL
TE_IMPL = ("--megatron-transformer-impl", "transformer_engine")
LR = 1e-6  # small, so one step keeps the other checks' numbers at the checkpoint's


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_0p6b_shape")
    # Stored in bf16 (half the disk); both backends upcast the same values to fp32.
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    # Norms away from their init value (ones), so a norm loaded into another norm's
    # place (the fused TE names, say) changes the numbers.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    return str(path)


def _args(hf: str, backend: str, dtype: str, *extra: str):
    from vime.config import parse_args

    flags = ["--fsdp-param-dtype", dtype, "--fsdp-reduce-dtype", "float32"]
    flags += ["--attn-implementation", "sdpa"]
    if backend == "megatron":
        flags = ["--megatron-tensor-parallel-size", "1", "--megatron-param-dtype", dtype]
    return parse_args(
        [
            *("--train-backend", backend, "--hf-checkpoint", hf),
            *("--actor-num-gpus-per-node", "1"),
            *("--rollout-batch-size", "4", "--n-samples-per-prompt", "2"),
            *("--global-batch-size", "8", "--micro-batch-size", "2", "--lr", str(LR)),
            *("--entropy-coef", "0.01"),
            *flags,
            *extra,
        ]
    )


def _schedule():
    from vime.data.batch import RolloutBatch, schedule

    rng = random.Random(0)
    tokens, prompts, masks = [], [], []
    for _ in range(8):
        p, r = rng.randint(16, 64), rng.randint(16, 128)
        tokens.append([rng.randrange(151936) for _ in range(p + r)])
        prompts.append(p)
        masks.append([1] * r)
    adv = [rng.gauss(0, 1) for _ in range(8)]
    batch = RolloutBatch(tokens=tokens, prompt_lengths=prompts, loss_masks=masks, advantages=adv)
    return schedule(batch, global_batch_size=8, dp_size=1, micro_batch_size=2)


def _step0(actor, *, update: bool = False) -> dict:
    """Step 0's log-probs, loss and grad norm; with ``update``, also the optimizer step
    taken on those gradients and the weights after it (``_post_step``)."""
    from vime.algo.metrics import MetricAccumulator

    sched = _schedule()
    logp = actor.compute_log_probs(sched, "actor")
    metrics = MetricAccumulator()
    loss = float(actor.backward_step(sched, 0, metrics, old=logp))
    norm = float(actor.backend.grad_norm())
    result = {"logp": logp, "loss": loss, "grad_norm": norm}
    if update:
        result["skipped"] = actor._optimizer_step(8).skipped
        result["post_step"] = _post_step(actor)
    else:
        for param in actor.trained_params:
            param.grad = None
    return result


def _post_step(actor) -> dict[str, torch.Tensor]:
    """The weight source after a step, in HF names, as fp32 host tensors.

    Exported in fp32, not the checkpoint's bf16: one step at ``LR`` moves a weight near 1
    (the norms) by far less than a bf16 step there, so in bf16 it would not show."""
    actor.backend.hf_config.dtype = torch.float32
    return {
        name: tensor.detach().float().cpu()
        for bucket in actor.weight_buckets(1 << 28)
        for name, tensor in bucket
    }


def _update_agreement(mega: dict[str, torch.Tensor], fsdp: dict[str, torch.Tensor], hf: str):
    """Per HF name: the largest difference between the two backends' weights after one
    AdamW step and the largest update either made, from the checkpoint's weights."""
    from safetensors.torch import load_file

    initial = {}
    for file in sorted(Path(hf).glob("*.safetensors")):
        initial.update({k: v.float() for k, v in load_file(file).items()})
    initial.setdefault("lm_head.weight", initial["model.embed_tokens.weight"])  # tied
    out = {}
    for name, weight in fsdp.items():
        start = initial[name]
        out[name] = {
            "diff": float((mega[name] - weight).abs().max()),
            "moved": float((weight - start).abs().max()),
            "moved_mega": float((mega[name] - start).abs().max()),
            "far": float(((mega[name] - weight).abs() > LR / 2).float().mean()),
        }
    return sorted(mega) == sorted(fsdp), out


def _thd_against_block_mask(actor) -> dict:
    """Max |logit difference| of one packed row (3 samples and padding) forwarded in THD
    format and under a block mask, and the logits' scale."""
    from vime.backends.megatron import model as mmodel
    from vime.data.micro_batch import pack_micro_batch

    batch = _schedule().batch
    packed = pack_micro_batch(batch.tokens[:3], batch.prompt_lengths[:3], pad_to_multiple_of=64)
    packed = packed.to(actor.device)
    with torch.no_grad():
        thd = mmodel.packed_logits(actor.backend.model, packed)
        block = mmodel.full_vocab_logits(
            actor.backend.model, mmodel.block_mask_forward(actor.backend.model, packed)
        )
    return {"diff": float((thd - block).abs().max()), "scale": float(block.abs().max())}


def _weight_source(actor) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(HF name, shape, dtype, digest of the bytes) of every tensor ``weight_buckets``
    yields, in order: compared across actors without keeping 0.6 B weights twice."""
    out = []
    for bucket in actor.weight_buckets(1 << 28):
        for name, tensor in bucket:
            data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy()
            out.append(
                (name, tuple(tensor.shape), str(tensor.dtype), hashlib.sha1(data).hexdigest())
            )
    return out


def _transformer_engine_run(hf: str) -> dict:
    """Step 0 and the weight source of a bf16 megatron actor on TE's layers; the error
    itself if building or running it fails (so the other results still get written)."""
    from vime.backends.policy_actor import make_actor

    try:
        actor = make_actor("megatron")
        actor.init(train_settings(_args(hf, "megatron", "bfloat16", *TE_IMPL)))
        result = _step0(actor)
        result["modules"] = sorted({type(m).__name__ for m in actor.backend.model.modules()})
        result["weights"] = _weight_source(actor)
        del actor
    except Exception:
        return {"error": traceback.format_exc()}
    finally:
        torch.cuda.empty_cache()
    return result


def _distributed_step(actor) -> dict:
    """Step 0 through megatron-core's distributed optimizer, the optimizer step, then a
    sleep / wake round trip: bytes freed on the GPU, weights back bitwise."""
    from vime.algo.metrics import MetricAccumulator

    sched = _schedule()
    logp = actor.compute_log_probs(sched, "actor")
    loss = float(actor.backward_step(sched, 0, MetricAccumulator(), old=logp))
    result = actor._optimizer_step(8)
    before = [p.detach().clone() for p in actor.backend.params]
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    actor.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_before
    actor.wake_up()
    bitwise = all(torch.equal(a, b) for a, b in zip(before, actor.backend.params, strict=True))
    return {
        "logp": logp,
        "loss": loss,
        "grad_norm": result.grad_norm,
        "skipped": result.skipped,
        "freed": freed,
        "wake_bitwise": bitwise,
    }


def _worker(rank: int, port: int, hf: str, out: str) -> None:
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from vime.backends.megatron import shims
    from vime.backends.policy_actor import make_actor

    results = {}
    for dtype in ("float32", "bfloat16"):
        for backend in ("megatron", "fsdp2"):
            actor = make_actor(backend)
            actor.init(train_settings(_args(hf, backend, dtype)))
            key = backend if dtype == "float32" else f"{backend}-bf16"
            results[key] = _step0(actor, update=dtype == "float32")
            results[key]["device"] = str(actor.device)
            if key == "megatron":
                results["thd"] = _thd_against_block_mask(actor)
                # On CUDA megatron-core runs unpatched: no CPU shim may be in effect.
                results["shims"] = {
                    "applied": shims.shims_applied(),
                    "current_device": torch.cuda.current_device(),
                    "cuda_synchronize": torch.cuda.synchronize.__module__,
                }
            if key == "fsdp2":  # both fp32 steps taken: compare, keep only the figures
                mega_post = results["megatron"].pop("post_step")
                same_names, results["update"] = _update_agreement(
                    mega_post, results["fsdp2"].pop("post_step"), hf
                )
                results["update_names_match"] = same_names
                del mega_post
            if key == "megatron-bf16":
                results[key]["weights"] = _weight_source(actor)
            del actor
            torch.cuda.empty_cache()
    actor = make_actor("megatron")
    actor.init(
        train_settings(_args(hf, "megatron", "bfloat16", "--megatron-use-distributed-optimizer"))
    )
    results["megatron-bf16-distopt"] = _distributed_step(actor)
    del actor
    torch.cuda.empty_cache()
    # Last, so that a TE failure cannot disturb the runs above; none without TE.
    if importlib.util.find_spec("transformer_engine") is not None:
        results["megatron-te-bf16"] = _transformer_engine_run(hf)
    torch.save(results, out)
    os._exit(0)  # skip NCCL/megatron teardown: the results are written


@pytest.fixture(scope="module")
def got(hf_dir, tmp_path_factory) -> dict:
    out = str(Path(tmp_path_factory.mktemp("megatron_gpu")) / "result.pt")
    mp.spawn(_worker, args=(free_port(), hf_dir, out), nprocs=1)
    return torch.load(out, weights_only=False)


def test_both_backends_ran_on_the_gpu(got) -> None:
    assert got["megatron"]["device"].startswith("cuda")
    assert got["fsdp2"]["device"].startswith("cuda")


def test_log_probs_agree(got) -> None:
    fsdp, mega = got["fsdp2"]["logp"], got["megatron"]["logp"]
    assert sorted(fsdp) == sorted(mega) == list(range(8))
    for i, logp in fsdp.items():
        torch.testing.assert_close(mega[i], logp, rtol=0, atol=LOGP_ATOL)


def test_loss_and_grad_norm_agree(got) -> None:
    fsdp, mega = got["fsdp2"], got["megatron"]
    assert fsdp["grad_norm"] > 1e-3, "zero gradient: the comparison would prove nothing"
    assert mega["grad_norm"] == pytest.approx(fsdp["grad_norm"], rel=NORM_RTOL)
    assert mega["loss"] == pytest.approx(fsdp["loss"], rel=NORM_RTOL, abs=1e-5)


def test_weights_after_one_adamw_step_agree(got) -> None:
    """One fp32 AdamW step on the same gradients, compared in HF names. Adam's first
    step moves each weight by lr x g / (|g| + eps), about lr in size whatever g is, so
    the two backends' weights agree to fp32 rounding except where a gradient element is
    so close to zero that kernel noise flips its sign: there the two updates can differ
    by up to 2 lr. Hence at most 2 lr plus rounding anywhere, and more than lr/2 on at
    most 1 % of the elements; a wrong learning rate, decay group or HF name moves a
    whole tensor by lr or more."""
    assert not got["megatron"]["skipped"] and not got["fsdp2"]["skipped"]
    assert got["update_names_match"]
    for name, figures in got["update"].items():
        assert figures["moved"] > LR / 2, f"{name}: fsdp2 never updated it"
        assert figures["moved_mega"] > LR / 2, f"{name}: megatron never updated it"
        assert figures["diff"] <= 2 * LR + 1e-6, (name, figures)
        assert figures["far"] <= 0.01, (name, figures)


def test_shims_are_off_on_the_gpu(got) -> None:
    """The CPU shims patch megatron-core only without CUDA; here none may be in effect."""
    assert got["shims"]["applied"] is False
    assert got["shims"]["cuda_synchronize"].startswith("torch.cuda")


def test_thd_rows_match_the_block_mask(got) -> None:
    # Same weights, same row, two attention kernels: fp32 op noise (~1e-6 relative)
    # over 28 blocks, as above; a boundary or RoPE error moves logits by O(scale).
    assert got["thd"]["scale"] > 1e-3
    assert got["thd"]["diff"] <= 1e-3 * got["thd"]["scale"]


def test_bf16_backends_agree(got) -> None:
    fsdp, mega = got["fsdp2-bf16"], got["megatron-bf16"]
    diffs = torch.cat([(mega["logp"][i] - logp).abs() for i, logp in fsdp["logp"].items()])
    assert float(diffs.mean()) < BF16_LOGP_MEAN_ATOL
    assert fsdp["grad_norm"] > 1e-3
    assert mega["grad_norm"] == pytest.approx(fsdp["grad_norm"], rel=BF16_RTOL)
    assert mega["loss"] == pytest.approx(fsdp["loss"], rel=BF16_RTOL, abs=1e-4)
    # and bf16 is close to fp32, on each backend
    assert mega["grad_norm"] == pytest.approx(got["megatron"]["grad_norm"], rel=BF16_RTOL)


def test_distributed_optimizer_on_the_gpu(got) -> None:
    """megatron-core's DDP wrapper and DistributedOptimizer (bf16 weights, fp32 gradient
    buffer): the same step-0 loss and grad norm as the plain bf16 run (both accumulate
    the same bf16 gradients in fp32; only summation order differs), a step taken, and
    sleep frees at least the bf16 weights and the fp32 gradient buffer (0.6 B x 6 bytes)
    and wake restores the weights bitwise."""
    dist_opt, plain = got["megatron-bf16-distopt"], got["megatron-bf16"]
    assert dist_opt["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-3)
    assert dist_opt["loss"] == pytest.approx(plain["loss"], rel=1e-3, abs=1e-5)
    assert not dist_opt["skipped"]
    assert dist_opt["freed"] > 3e9, dist_opt["freed"]
    assert dist_opt["wake_bitwise"]


def _te(got) -> dict:
    if "megatron-te-bf16" not in got:
        pytest.skip("transformer_engine is not importable here: no TE actor was built")
    te = got["megatron-te-bf16"]
    assert "error" not in te, te.get("error")
    return te


def test_transformer_engine_layers_match_the_local_layers(got) -> None:
    te, local = _te(got), got["megatron-bf16"]
    # TE really ran: its core attention and fused norm + linear, not vime's local layers.
    assert {"TEDotProductAttention", "TELayerNormColumnParallelLinear"} <= set(te["modules"])
    assert "PackedDotProductAttention" not in te["modules"]
    assert sorted(te["logp"]) == sorted(local["logp"]) == list(range(8))
    diffs = torch.cat([(te["logp"][i] - logp).abs() for i, logp in local["logp"].items()])
    assert float(diffs.mean()) < TE_LOGP_MEAN_ATOL
    assert te["grad_norm"] > 1e-3, "zero gradient: the comparison would prove nothing"
    assert te["grad_norm"] == pytest.approx(local["grad_norm"], rel=TE_RTOL)
    assert te["loss"] == pytest.approx(local["loss"], rel=TE_RTOL, abs=1e-4)


def test_transformer_engine_weight_source_matches_the_local_one(got) -> None:
    """Loaded from the same checkpoint and not stepped: the same HF tensors out, bit for
    bit, through TE's fused norm names as through the local ones."""
    te, local = _te(got), got["megatron-bf16"]
    # The embedding (tied: no lm_head), the final norm, and 11 tensors per layer.
    assert len(local["weights"]) == 2 + 11 * 28
    assert te["weights"] == local["weights"]
