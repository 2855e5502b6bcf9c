"""megatron-core's distributed optimizer as vime drives it (``megatron/distrib_optim.py``).

Proves, in one gloo process on a tiny Qwen3 ``GPTModel``: its AdamW groups decay
exactly what ``optim.decays`` says (norm weights and biases not, every matrix yes) --
megatron-core leaves applying ``wd_mult`` to a scheduler vime does not run; one step
through vime's chokepoint (``optim.optimizer_step``: megatron's grad norm, clip, AdamW,
weights gathered back) equals torch ``AdamW`` on a copy of the same weights and
gradients, in fp32 to 1e-6 with the clip active and at the lr the step is given (not
the one the optimizer was built with); the gradient buffers are empty after
the step; a model built without ``calculate_per_token_loss`` (whose DDP wrapper would
average over DP instead of summing) is refused. The multi-rank behaviour (DP, TP,
bf16, checkpoints) is ``test_megatron_actor.py::test_distributed_optimizer*``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from tiny_models import tiny_qwen3_config

from vime.backends.megatron import model as mmodel
from vime.backends.megatron.convert import transformer_config_from_hf
from vime.backends.megatron.distrib_optim import DistributedOptimizer
from vime.backends.optim import AdamWSettings, decays, optimizer_step
from vime.data.micro_batch import pack_micro_batch

pytestmark = pytest.mark.usefixtures("megatron_world")

ARGS = SimpleNamespace(
    lr=1e-2, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8
)
ADAMW = AdamWSettings(
    lr=ARGS.lr,
    weight_decay=ARGS.weight_decay,
    betas=(ARGS.adam_beta1, ARGS.adam_beta2),
    eps=ARGS.adam_eps,
)


def _optimizer(model: torch.nn.Module, dtype: torch.dtype) -> DistributedOptimizer:
    return DistributedOptimizer(model, ADAMW, min_lr=ARGS.min_lr, clip_grad=1.0, params_dtype=dtype)


def _model(dtype: torch.dtype = torch.float32, *, per_token: bool = True) -> torch.nn.Module:
    config = tiny_qwen3_config(vocab_size=64)
    tcfg, _ = transformer_config_from_hf(
        config, params_dtype=dtype, calculate_per_token_loss=per_token
    )
    torch.manual_seed(0)
    return mmodel.build_gpt_model(config, tcfg)


def _backward(model: torch.nn.Module) -> None:
    packed = pack_micro_batch([[1, 5, 9, 2, 7], [3, 3, 8]], [2, 1], pad_to_multiple_of=8)
    logits = mmodel.stage_forward(model, packed).float()
    (logits.logsumexp(-1).mean() * 50).backward()  # large enough that the clip acts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decay_groups_follow_vimes_rule(dtype: torch.dtype) -> None:
    model = _model(dtype)
    optimizer = _optimizer(model, dtype)
    (part,) = optimizer._parts
    decayed = set()
    for name, param in model.named_parameters():
        index, _ = part.model_param_group_index_map[param]
        group = part.optimizer.param_groups[index]
        assert group["weight_decay"] == (ARGS.weight_decay if decays(name, param) else 0.0), name
        decayed.add(decays(name, param))
    assert decayed == {True, False}  # both kinds are present, so the check means something


def test_a_step_equals_torch_adamw() -> None:
    model = _model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = _optimizer(model, torch.float32)
    _backward(model)
    optimizer.finish_grads()
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    expected_norm = float(torch.nn.utils.get_total_norm(list(grads.values())))
    assert expected_norm > 1.0  # the clip really scales this step

    # Not the lr it was built with: the schedule's lr must reach megatron's inner groups.
    lr = ARGS.lr / 4
    result = optimizer_step(
        optimizer, optimizer.main_params, optimizer.grad_norm(), clip_grad=1.0, lr=lr
    )
    optimizer.zero_grad()
    assert not result.skipped
    assert result.grad_norm == pytest.approx(expected_norm, rel=1e-6)

    # The same update by torch's AdamW on copies of the weights and gradients.
    names = list(initial)
    ref = {n: torch.nn.Parameter(initial[n].clone()) for n in names}
    groups = [
        {"params": [ref[n] for n in names if decays(n, ref[n])], "weight_decay": ARGS.weight_decay},
        {"params": [ref[n] for n in names if not decays(n, ref[n])], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(
        groups, lr=lr, betas=(ARGS.adam_beta1, ARGS.adam_beta2), eps=ARGS.adam_eps
    )
    for n in names:
        ref[n].grad = grads[n] * (1.0 / (expected_norm + 1e-6))
    adamw.step()
    for name, param in model.named_parameters():
        assert not torch.equal(param, initial[name]), f"{name} did not move"
        torch.testing.assert_close(param.detach(), ref[name].detach(), rtol=0, atol=1e-6)
    for param in model.parameters():
        assert not param.main_grad.any(), "gradient buffer not emptied after the step"


def test_model_must_sum_gradients() -> None:
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        _optimizer(_model(per_token=False), torch.float32)
