"""The megatron backend's CPU shims, each exercised through the megatron-core call it covers.

Proves: ``apply_cpu_shims`` is idempotent; RoPE's ``get_emb`` runs (``current_device``);
``dist_checkpointing`` saves and loads (``torch.cuda.synchronize``); the RNG tracker
seeds named CPU streams, forks them without disturbing the default stream, replays
dropout exactly under megatron's activation recomputation, and a real ``GPTModel``
with attention dropout trains reproducibly; the attention softmax builds its causal
mask on the CPU; megatron's grad-norm and clip functions give torch's numbers;
megatron's 1F1B pipeline schedule runs (its token counter) and gives a plain loop's
gradient; tied embeddings over two pipeline stages are copied to the last stage on
the host; megatron-core's ``DistributedOptimizer`` builds over bf16 CPU parameters
(its ``device='cuda'`` scalars and CUDA type-name checks), and CPU tensors report
their own type name again once it is built. Each
test fails (raises on a CUDA call, or gets different numbers) if its shim stops
working. Skipped where CUDA exists: the shims are then off by design.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims are off with CUDA"),
    pytest.mark.usefixtures("megatron_world"),
]

from megatron.core import tensor_parallel  # noqa: E402

from vime.backends.megatron import model as mmodel  # noqa: E402
from vime.backends.megatron import shims  # noqa: E402


def test_apply_is_idempotent() -> None:
    assert shims.apply_cpu_shims() is True
    patched = (torch.cuda.current_device, torch.cuda.synchronize)
    assert shims.apply_cpu_shims() is True
    assert (torch.cuda.current_device, torch.cuda.synchronize) == patched
    assert shims.shims_applied()


def test_current_device_rotary_embedding() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    emb = rope.get_emb(5)  # moves inv_freq to torch.cuda.current_device()
    assert emb.device.type == "cpu" and emb.shape == (5, 1, 1, 8)
    assert torch.equal(emb[0], torch.zeros(1, 1, 8))


def test_synchronize_dist_checkpointing(tmp_path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    weight = torch.arange(6.0).reshape(2, 3)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, str(tmp_path))
    target = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}
    loaded = dist_checkpointing.load(target, str(tmp_path))
    assert torch.equal(loaded["w"], weight)


def test_rng_tracker_named_streams() -> None:
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    outer = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    with tracker.fork():
        second = torch.rand(4)
    # The default stream is untouched; the named one advances between forks.
    assert torch.equal(torch.get_rng_state(), outer)
    assert not torch.equal(first, second)
    # Model-parallel stream = seed + 2718 + tp_rank, the same number megatron uses on GPU.
    expected = torch.Generator().manual_seed(7 + 2718)
    assert torch.equal(first, torch.rand(4, generator=expected))
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    with tracker.fork():
        assert torch.equal(torch.rand(4), first)


def test_rng_replayed_under_activation_recomputation() -> None:
    weight = torch.randn(64, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return F.dropout(x * weight, p=0.5, training=True)

    x = torch.randn(64, requires_grad=True)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    plain = block(x)
    plain.sum().backward()
    plain_grad = weight.grad.clone()
    weight.grad = None
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    # Recomputes ``block`` in backward after restoring the RNG states saved in forward.
    recomputed = tensor_parallel.checkpoint(block, False, x)
    recomputed.sum().backward()
    assert torch.equal(recomputed, plain)
    assert torch.equal(weight.grad, plain_grad)


def test_gpt_model_with_attention_dropout_trains_reproducibly() -> None:
    from tiny_models import tiny_qwen3_config

    from vime.backends.megatron.convert import transformer_config_from_hf

    config = tiny_qwen3_config(vocab_size=32)
    config.attention_dropout = 0.5
    tcfg, _ = transformer_config_from_hf(config)
    torch.manual_seed(0)
    model = mmodel.build_gpt_model(config, tcfg)
    model.train()
    ids = torch.randint(0, 32, (1, 12))
    positions = torch.arange(12).unsqueeze(0)

    def loss() -> torch.Tensor:
        # attention_mask=None: the softmax builds its own causal mask.
        return model(ids, positions, None).float().logsumexp(-1).mean()

    tensor_parallel.model_parallel_cuda_manual_seed(3)
    first = loss()
    first.backward()
    again = loss()
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    replay = loss()
    assert not torch.equal(first, again)  # dropout is live and drawn from the tracker
    assert torch.equal(first, replay)


def test_default_causal_mask_on_cpu() -> None:
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )
    probs = softmax(torch.zeros(1, 1, 3, 3), None)
    expected = torch.tensor([[1, 0, 0], [1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3]])
    torch.testing.assert_close(probs[0, 0], expected)


def test_grad_norm_and_clip() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    # The optimizer module imported the functions by name: it must see the CPU ones.
    assert moptimizer.get_grad_norm_fp32 is clip_grads.get_grad_norm_fp32
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in params]
    expected = float(torch.nn.utils.get_total_norm(grads))
    norm = clip_grads.get_grad_norm_fp32(grads)
    assert norm == pytest.approx(expected, rel=1e-6)
    inf_norm = clip_grads.get_grad_norm_fp32(grads, norm_type=float("inf"))
    assert inf_norm == pytest.approx(max(float(g.abs().max()) for g in grads))
    before = [g.clone() for g in grads]
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=norm / 2, total_norm=norm)
    for g, b in zip(grads, before, strict=True):
        torch.testing.assert_close(g, b * (norm / 2) / (norm + 1e-6))
    assert clip_grads.get_grad_norm_fp32(grads) == pytest.approx(norm / 2, rel=1e-5)


def test_pipeline_schedule_counts_tokens_on_cpu() -> None:
    """megatron-core's non-interleaved 1F1B schedule (one stage here) allocates its token
    counter with ``device="cuda"``; with the shim it runs and leaves the same gradient as
    a plain loop over the micro-batches."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving as one_f_one_b,
    )
    from tiny_models import tiny_qwen3_config

    from vime.backends.megatron.convert import transformer_config_from_hf

    assert shims._TorchWithCpuFactories.zeros([], device="cuda").device.type == "cpu"
    config = tiny_qwen3_config(vocab_size=32)
    tcfg, _ = transformer_config_from_hf(
        config,
        variable_seq_lengths=True,
        calculate_per_token_loss=True,
        moe_token_dispatcher_type="alltoall",
    )
    torch.manual_seed(0)
    model = mmodel.build_gpt_model(config, tcfg)
    rows = [torch.randint(0, 32, (1, n)) for n in (5, 9, 7)]

    def loss_of(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().logsumexp(-1).mean()

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)

    for ids in rows:
        loss_of(ids, forward(ids)).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    data = iter(rows)

    def forward_step(iterator, _model):
        ids = next(iterator)
        return forward(ids), lambda out: (loss_of(ids, out), torch.ones((), dtype=torch.int), {})

    one_f_one_b(
        forward_step_func=forward_step,
        data_iterator=data,
        model=model,
        num_microbatches=len(rows),
        seq_length=1,
        micro_batch_size=1,
    )
    for expected, param in zip(plain, model.parameters(), strict=True):
        torch.testing.assert_close(param.grad, expected, rtol=1e-6, atol=1e-7)


def _tied_stages_job(rank: int, world: int) -> dict:
    from tiny_models import tiny_llama_config

    from vime.backends.megatron.convert import transformer_config_from_hf

    mmodel.init_model_parallel(tp=1, pp=2, seed=5)
    config = tiny_llama_config(vocab_size=32, tie=True)
    tcfg, _ = transformer_config_from_hf(config, pipeline_model_parallel_size=2)
    torch.manual_seed(rank)  # the two stages initialise different random embeddings
    model = mmodel.build_gpt_model(config, tcfg, pre_process=rank == 0, post_process=rank == 1)
    weight = model.shared_embedding_or_output_weight().detach().clone()
    others = [torch.empty_like(weight) for _ in range(world)]
    torch.distributed.all_gather(others, weight)
    return {"stages": others, "device": str(weight.device)}


def test_tied_embeddings_copied_to_the_last_stage(tmp_path) -> None:
    """With tied embeddings over two pipeline stages, ``setup_embeddings_and_output_layer``
    moves the last stage's copy to ``.cuda()`` before all-reducing it from the first; with
    the shim the copy stays on the host and equals the first stage's embeddings."""
    from actor_harness import spawn

    got = spawn(_tied_stages_job, 2, tmp_path)
    first, last = got["stages"]
    assert got["device"] == "cpu"
    assert first.abs().sum() > 0
    assert torch.equal(first, last)


def test_distributed_optimizer_builds_over_cpu_bf16_params() -> None:
    """Without the optimizer shims ``MixedPrecisionOptimizer.__init__`` raises "Torch not
    compiled with CUDA enabled" and ``_build_model_and_main_param_groups`` a TypeError."""
    from tiny_models import tiny_qwen3_config

    from vime.backends.megatron.convert import transformer_config_from_hf
    from vime.backends.megatron.distrib_optim import DistributedOptimizer
    from vime.backends.optim import AdamWSettings

    config = tiny_qwen3_config(vocab_size=32)
    tcfg, _ = transformer_config_from_hf(
        config, params_dtype=torch.bfloat16, calculate_per_token_loss=True
    )
    model = mmodel.build_gpt_model(config, tcfg)
    adamw = AdamWSettings(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    optimizer = DistributedOptimizer(
        model, adamw, min_lr=0.0, clip_grad=1.0, params_dtype=torch.bfloat16
    )
    mains = optimizer.main_params
    assert mains and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in mains)
    assert sum(p.numel() for p in mains) == sum(p.numel() for p in model.parameters())
    # The CUDA type names were only for the constructors.
    assert torch.ones(1).type() == "torch.FloatTensor"
    assert next(model.parameters()).type() == "torch.BFloat16Tensor"
