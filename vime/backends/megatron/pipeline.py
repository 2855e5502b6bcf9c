"""Pipeline parallelism for the megatron backend: what each stage holds, and the schedule.

Where it fits: ``MegatronBackend`` with ``--megatron-pipeline-parallel-size`` P > 1.
The decoder layers are split into P consecutive runs, one per pipeline stage: equal
runs, or ``--megatron-decoder-first/last-pipeline-num-layers`` on the end stages and
equal runs between (``flags.stage_layer_counts``, megatron-core's uneven rule, for
end stages that also carry the embeddings and the loss). The first stage also
holds the word embeddings, the last the final norm and the output layer.
``Stage`` says which megatron parameter lives where and translates between a
stage's own (local) parameter names and the model's global ones, which is what HF
conversion (``convert.param_map``) and the weight source are written in.
``run_schedule`` drives the planner's micro-batches through megatron-core's
non-interleaved 1F1B schedule: each stage forwards what it
received, the last stage turns its logits into vime's loss, and gradients flow
back through megatron-core's point-to-point sends (gloo on the CPU, NCCL on GPU).

Tied embeddings: with P > 1 the last stage cannot reach the first stage's word
embeddings, so megatron-core gives it its own copy as ``output_layer.weight``. The
copy is loaded from the same HF tensor, its gradient is summed with the
embedding's over megatron's embedding group after every backward (the actor does
this), and the two receive the same AdamW update, so they never drift. The weight
source and the gradient norm count the copy once: on the first stage.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from vime.backends.megatron.flags import stage_layer_counts

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
EMBEDDING = "embedding.word_embeddings.weight"
TIED_COPY = "output_layer.weight"

Item = TypeVar("Item")


@dataclass(frozen=True)
class Stage:
    """Pipeline stage ``rank`` of ``size`` over a model of ``num_layers`` decoder layers,
    ``first_stage_layers`` / ``last_stage_layers`` on the end stages when given."""

    rank: int
    size: int
    num_layers: int
    tied: bool  # word embeddings double as the output layer
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    # Global index of each stage's first layer, then num_layers.
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        counts = stage_layer_counts(
            self.num_layers, self.size, self.first_stage_layers, self.last_stage_layers
        )
        object.__setattr__(self, "_starts", tuple(itertools.accumulate(counts, initial=0)))

    @property
    def layer_counts(self) -> tuple[int, ...]:
        """Decoder layers held by each stage, in stage order."""
        return tuple(b - a for a, b in itertools.pairwise(self._starts))

    @property
    def first_layer(self) -> int:
        return self._starts[self.rank]

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owner(self, name: str) -> int:
        """The stage that holds (and, for the tied copy, exports) global parameter ``name``."""
        layer = _LAYER.match(name)
        if layer:
            # The last stage whose first layer is at or before this one.
            return bisect.bisect_right(self._starts, int(layer.group(1))) - 1
        if name.startswith("embedding."):
            return 0
        return self.size - 1  # decoder.final_layernorm, output_layer

    def global_name(self, local: str) -> str:
        """The model-wide name of this stage's parameter ``local``.

        Layers are renumbered by the stage's offset; the last stage's copy of tied
        embeddings is the embedding itself.
        """
        if self.tied and local == TIED_COPY:
            return EMBEDDING
        layer = _LAYER.match(local)
        if layer is None:
            return local
        index = int(layer.group(1)) + self.first_layer
        return f"decoder.layers.{index}.{local[layer.end() :]}"

    def is_tied_copy(self, local: str) -> bool:
        """Whether ``local`` is the last stage's copy of the first stage's embeddings."""
        return self.tied and self.size > 1 and local == TIED_COPY


def run_schedule(
    model: torch.nn.Module,
    items: Sequence[Item],
    stage_forward: Callable[[Item], torch.Tensor],
    last_stage_loss: Callable[[Item, torch.Tensor], torch.Tensor],
    *,
    forward_only: bool,
) -> None:
    """Run ``items`` (one per micro-batch, the same list on every stage) through
    megatron-core's 1F1B pipeline schedule.

    ``stage_forward(item)`` runs this stage's part of the model; the schedule has
    already handed it the previous stage's activations (``set_input_tensor``). On
    the last stage ``last_stage_loss(item, output)`` is the micro-batch's loss; it is
    backpropagated as it is, unscaled (``calculate_per_token_loss``: vime's loss
    already carries the step's global normalizers), unless ``forward_only``.
    Activation shapes travel with the activations (``variable_seq_lengths``), since
    packed rows differ in length. Gradients are left in ``.grad``; nothing is reduced
    across stages or replicas here.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = model.config
    if not (config.variable_seq_lengths and config.calculate_per_token_loss):
        raise ValueError(
            "the pipelined model needs variable_seq_lengths and calculate_per_token_loss "
            "in its TransformerConfig (see MegatronBackend)"
        )
    one_token = torch.ones((), dtype=torch.int)

    def forward_step(data_iterator: Any, _model: Any) -> tuple[torch.Tensor, Callable]:
        item = next(data_iterator)
        output = stage_forward(item)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            return last_stage_loss(item, output), one_token, {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(items),
        model=model,
        num_microbatches=len(items),
        # Ignored under variable_seq_lengths: each activation's shape is sent before it.
        seq_length=1,
        micro_batch_size=1,
        forward_only=forward_only,
    )
