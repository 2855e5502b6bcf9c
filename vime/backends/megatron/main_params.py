"""fp32 main weights for a megatron model trained in bf16 (``--megatron-param-dtype bfloat16``).

Where it fits: ``MegatronBackend`` builds its ``GPTModel`` with bf16 parameters, so
forward and backward run in bf16, and hands the optimizer these fp32 copies
instead -- Megatron's mixed precision. A bf16 weight has 8 bits of mantissa: an
AdamW update below 1/256 of the weight would round away if applied to it
directly, so the fp32 main weight takes every update and the bf16 weight is
re-rounded from it after each step. Gradients accumulate in fp32 too: each
parameter's gradient is added to its main weight's ``.grad`` as soon as autograd
has accumulated it (a post-accumulate-grad hook), so a step's micro-batches are
summed in fp32, not rounded to bf16 after each one; everything downstream (the
DP and TP sums, the norm, the clip, AdamW) sees fp32 ``.grad`` on the main weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class MainParams:
    """One fp32 main weight per model parameter, holding its gradient and its truth."""

    def __init__(self, model_params: list[torch.nn.Parameter]) -> None:
        self.model_params = model_params
        self.params = [torch.nn.Parameter(p.detach().float()) for p in model_params]
        self._hooks = [
            model.register_post_accumulate_grad_hook(self._accumulator(main))
            for model, main in zip(model_params, self.params, strict=True)
        ]

    @staticmethod
    def _accumulator(main: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
        def accumulate(model: torch.Tensor) -> None:
            # Later micro-batches add the bf16 gradient in one mixed-dtype kernel: the
            # same fp32 sum as widening it first (exact), without the copy.
            if main.grad is None:
                main.grad = model.grad.float()
            else:
                main.grad.add_(model.grad)
            model.grad = None

        return accumulate

    @torch.no_grad()
    def to_model(self) -> None:
        """Round every main weight into its model parameter (multi-tensor copies)."""
        torch._foreach_copy_(self.model_params, self.params)

    @torch.no_grad()
    def from_model(self) -> None:
        """Main weights := the model's parameters (after loading weights into the model)."""
        torch._foreach_copy_(self.params, self.model_params)
