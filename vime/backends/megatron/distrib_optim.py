"""megatron-core's distributed optimizer, for ``--megatron-use-distributed-optimizer``.

Where it fits: ``MegatronBackend`` builds a ``DistributedOptimizer`` here instead of its
torch ``AdamW`` when the flag is on, on the GPU and on the CPU alike (the CPU runs it
through ``shims``). It is megatron-core's own machinery end to end:

- ``DistributedDataParallel`` wraps the model: backward hooks add each parameter's
  gradient into one contiguous fp32 buffer (``param.main_grad`` are views of it), so a
  step's micro-batches accumulate in fp32 whatever the weights' dtype.
- The step's last backward reduce-scatters that buffer over the data-parallel group
  bucket by bucket, as backward fills the buckets (``overlap_grad_reduce``: the
  communication runs under the rest of the backward; each rank keeps the sum of its
  1/DP slice). Earlier micro-batches only accumulate: ``prepare_backward`` says which
  backward is the last, and megatron-core's pipeline schedules ask ``no_sync``.
  ``finalize_model_grads`` then waits for those reductions, sums the gradients that
  tensor-parallel ranks compute only partly (QK norms, sequence-parallel norms) over
  TP, and the tied embedding's two halves over the first and last pipeline stages.
  The sum, not the mean: the planner's global normalizers already make the DP sum the
  full-batch gradient, and ``calculate_per_token_loss`` (set by the actor) keeps the
  wrapper from dividing by the DP size.
- megatron-core's ``DistributedOptimizer`` keeps fp32 main weights and AdamW moments
  for this rank's slice only, steps them (torch ``AdamW`` where neither
  TransformerEngine nor Apex is installed, TE's fused Adam where it is) and
  all-gathers the updated weights into the model.

The update still goes through vime's chokepoint, ``optim.optimizer_step``: this class
is the optimizer it drives (``param_groups``, ``step``), ``grad_norm`` is megatron's
norm over every rank's slice, a non-finite one skips the step, and the clip acts on
``main_params`` (this rank's slice). Weight decay follows megatron-core's standard rule,
which is vime's (``optim.decays``; a test checks they agree).

Checkpoints: megatron-core's ``dp_reshardable`` format of the optimizer, beside
``GPTModel.sharded_state_dict()`` in the same ``dist_checkpointing`` folder: written in
parallel without gathering, and loadable at another data-parallel size but only at the
same tensor- and pipeline-parallel sizes (the actor refuses anything else by name).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from vime.backends.megatron.shims import apply_cpu_shims
from vime.backends.optim import AdamWSettings

# megatron-core's optimizer checkpoint format: one tensor per contiguous buffer slice,
# no gathers, re-split over a different DP size on load.
SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


class DistributedOptimizer:
    """megatron-core's DDP wrapper and distributed optimizer around one model chunk."""

    def __init__(
        self,
        model: torch.nn.Module,
        adamw: AdamWSettings,
        *,
        min_lr: float,
        clip_grad: float,
        params_dtype: torch.dtype,
    ) -> None:
        apply_cpu_shims()
        if not model.config.calculate_per_token_loss:
            raise ValueError(
                "the distributed optimizer sums gradients over DP: build the model with "
                "calculate_per_token_loss=True"
            )
        self.ddp = DistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                use_distributed_optimizer=True,
                overlap_grad_reduce=True,
                overlap_param_gather=False,
            ),
            model,
        )
        # megatron-core's pipeline schedules run every micro-batch but the last under this.
        model.config.no_sync_func = self.ddp.no_sync
        config = OptimizerConfig(
            optimizer="adam",
            lr=adamw.lr,
            min_lr=min_lr,
            weight_decay=adamw.weight_decay,
            adam_beta1=adamw.betas[0],
            adam_beta2=adamw.betas[1],
            adam_eps=adamw.eps,
            clip_grad=clip_grad,
            # bf16 weights get fp32 main weights; fp16 (which would need a loss scaler)
            # is not a --megatron-param-dtype.
            bf16=params_dtype == torch.bfloat16,
            params_dtype=params_dtype,
            use_distributed_optimizer=True,
        )
        self.optimizer = get_megatron_optimizer(config, [self.ddp])
        self._parts = list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))
        # megatron-core marks no-decay groups with wd_mult = 0 and leaves applying it to
        # its LR scheduler, which vime does not run (its LRSchedule sets the lr): without
        # this, AdamW would decay every group, norm weights included.
        for group in self.param_groups:
            group["weight_decay"] = adamw.weight_decay * group.get("wd_mult", 1.0)

    # ----- what optim.optimizer_step drives ----------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizers' groups (``optimizer_step`` sets their ``lr``)."""
        return [g for part in self._parts for g in part.optimizer.param_groups]

    @property
    def main_params(self) -> list[torch.nn.Parameter]:
        """This rank's fp32 main-weight slices: what AdamW updates and the clip scales."""
        return [p for part in self._parts for p in part.get_parameters()]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """AdamW's state of this rank's slices (what ``sleep`` parks with the rest)."""
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for part in self._parts:
            out.update(part.optimizer.state)
        return out

    def prepare_backward(self, last: bool) -> None:
        """Before a micro-batch's backward outside megatron-core's schedules: only the
        step's ``last`` one starts the reduce-scatters (``no_sync`` for the others)."""
        for group in self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups:
            group.is_last_microbatch = last

    def finish_grads(self) -> None:
        """After the step's last backward: reduce-scatter over DP, partial sums over TP and
        the tied embedding's halves over the pipeline ends (a collective)."""
        finalize_model_grads([self.ddp])

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the step's gradient, the same on every rank.

        Copies this rank's reduced slice into the main weights' ``.grad`` first
        (idempotent until the next backward), so a caller may ask twice.
        """
        self.optimizer.prepare_grads()
        return torch.tensor(float(self.optimizer.get_grad_norm()), dtype=torch.float32)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's slices, then the updated weights all-gathered into the model."""
        self.optimizer.step_with_ready_grads()

    def zero_grad(self) -> None:
        """Empty the gradient buffers and the main weights' ``.grad`` (after every step,
        taken or skipped)."""
        self.ddp.zero_grad_buffer()
        with warnings.catch_warnings():
            # fp32 main weights are views of the model's weights, and megatron-core's
            # zero_grad reads their .grad, which torch warns about on every step.
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor")
            self.optimizer.zero_grad()

    # ----- memory and checkpoints --------------------------------------------------------------

    def param_buffers(self) -> list[torch.Tensor]:
        """The DDP wrapper's contiguous weight buffers (the model's weights are views)."""
        return [b.param_data for b in self.ddp.buffers if b.param_data is not None]

    def grad_buffers(self) -> list[torch.Tensor]:
        """The DDP wrapper's contiguous fp32 gradient buffers (zeros between steps)."""
        return [b.grad_data for b in self.ddp.buffers]

    def sharded_state(self, model_state: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
        """megatron-core's sharded state dict of this rank's main weights, moments and step."""
        if is_loading:
            self._state_templates()
        return self.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=SHARDING
        )

    def _state_templates(self) -> None:
        """Give a never-stepped torch AdamW a state of the right shapes to load into.

        megatron-core reads the step from each parameter's state when the optimizer is
        torch's (its fallback without TransformerEngine or Apex) and its own state
        initializer writes the moments but no step, so a fresh process could not build
        the state dict to load. TE's fused Adam keeps the step in its groups instead.
        """
        for part in self._parts:
            inner = part.optimizer
            if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
                continue
            for group in inner.param_groups:
                for param in group["params"]:
                    if not inner.state[param]:
                        inner.state[param] = {
                            "step": torch.zeros((), dtype=torch.float32),
                            "exp_avg": torch.zeros_like(param),
                            "exp_avg_sq": torch.zeros_like(param),
                        }

    @torch.no_grad()  # fp32 main weights are views of the model's (trainable) weights
    def load_state(self, state: dict[str, Any]) -> None:
        """Take a state ``dist_checkpointing.load`` filled in from ``sharded_state``.

        With torch's AdamW megatron-core restores the step into every parameter's state
        from the groups, then overwrites it with the per-slice copy it loads beside the
        moments, which it never filled in: the step would restart at 0 and change the
        bias correction of every later update. So the groups' step is set again.
        """
        self.optimizer.load_state_dict(state)
        parts = [state] if len(self._parts) == 1 else [state[i] for i in range(len(self._parts))]
        for part, saved in zip(self._parts, parts, strict=True):
            inner = part.optimizer
            steps = {g["step"] for g in saved["optimizer"]["param_groups"] if "step" in g}
            if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or not steps:
                continue
            if len(steps) != 1:
                raise ValueError(f"optimizer groups disagree on the step: {sorted(steps)}")
            (step,) = steps
            for param_state in inner.state.values():
                param_state["step"] = torch.tensor(float(step), dtype=torch.float32)

    def reload_model_params(self) -> None:
        """Main weights := the model's (after the model's weights were loaded without an
        optimizer state: a never-stepped checkpoint)."""
        self.optimizer.reload_model_params()
