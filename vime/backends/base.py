"""The TrainActor contract: everything the loop may ask of a training backend.

Where it fits: ``vime.backends.registry`` names one subclass per backend; the
Ray train group creates one instance per training rank and the loop
(``vime.trainer``) calls only these methods, so the loop never knows which
backend runs. Both backends consume the planner's micro-batches
(``vime.data.packing``) and the loss in ``vime.algo``, and publish weights as
HF-named buckets, which is what lets them be checked against each other.

``TrainSettings`` is what a rank is given: ``vime.config.train_settings`` builds it
once from the flags on the driver, and the rank (the actor, its backend) reads no flag.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vime.algo.objective import LossConfig
    from vime.backends.optim import AdamWSettings, LRSchedule
    from vime.checkpoint import CheckpointSettings
    from vime.weights.hf_export import ExportSettings
    from vime.weights.lora import LoraSettings

# What ``sleep`` frees, by part: ``train_state`` (gradients, main weights, optimizer
# state: only training reads them) and ``weights`` (what the forward and the weight
# source read). A colocated weight sync runs with ``train_state`` asleep.
TRAIN_MEMORY_TAGS = ("train_state", "weights")


def train_tags(tags: Sequence[str] | None) -> list[str]:
    """The parts ``tags`` names, in ``TRAIN_MEMORY_TAGS`` order (all for None)."""
    if tags is None:
        return list(TRAIN_MEMORY_TAGS)
    unknown = sorted(set(tags) - set(TRAIN_MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown training memory parts {unknown}; use {TRAIN_MEMORY_TAGS}")
    return [t for t in TRAIN_MEMORY_TAGS if t in tags]


@dataclass(frozen=True)
class TrainSettings:
    """Everything one training rank needs, each part the settings of the component that
    takes it; ``backend`` is the backend's own (its flag module's ``settings``)."""

    hf_checkpoint: str | None  # the checkpoint folder the model is loaded from
    seed: int
    gpus_per_node: int  # the ranks of one node (LOCAL_RANK)
    # The rollout temperature: log-probs are computed at the one the engines sampled at.
    temperature: float
    keep_dropout: bool  # --keep-dropout (vime.backends.dropout)
    lr_schedule: LRSchedule
    clip_grad: float  # the global gradient-norm clip; 0: none
    adamw: AdamWSettings
    loss: LossConfig
    lora: LoraSettings
    checkpoint: CheckpointSettings
    export: ExportSettings
    backend: Any
    # --compile-decoder: torch.compile each decoder block (vime.backends.compile)
    compile_decoder: bool = False
    # --lm-head-tail: auto, fused or logits (vime.backends.lm_head_choice)
    lm_head_tail: str = "auto"


class TrainActor(abc.ABC):
    """One training rank of a backend."""

    @abc.abstractmethod
    def init(self, settings: TrainSettings) -> int:
        """Build model, optimizer and process groups; load ``settings.checkpoint.load``'s
        newest checkpoint if given.

        Returns the rollout id to start from (0, or the one after the loaded checkpoint).
        """

    @abc.abstractmethod
    def compute_log_probs(self, schedule: Any, which: str) -> Any:
        """Log-probs of the rollout's responses under ``which`` ("actor" or "ref"),
        at exactly the micro-batch geometry ``train`` will use."""

    @abc.abstractmethod
    def train(self, schedule: Any) -> dict[str, float]:
        """Run every optimizer step of one rollout; return globally reduced metrics."""

    @abc.abstractmethod
    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
        """Yield the full weights as lists of ``(hf_name, tensor)`` under ``bucket_bytes``."""

    def sync_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
        """What a weight sync sends (a collective, as ``weight_buckets``): the full
        weights, unless a backend sends less (LoRA: the adapters, after the base once)."""
        return self.weight_buckets(bucket_bytes)

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Write ``iter_{rollout_id:07d}`` atomically and then the tracker file."""

    @abc.abstractmethod
    def export_hf(self, path: str, merged: bool = False) -> None:
        """Write an HF folder (safetensors, config, tokenizer) of the current weights
        (LoRA: a PEFT adapter folder, unless ``merged`` asks for the full model)."""

    def sleep(self, tags: Sequence[str] | None = None) -> None:  # noqa: B027 - no-op default
        """Free accelerator memory between phases: the ``TRAIN_MEMORY_TAGS`` parts named,
        or all (nothing to free on CPU)."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:  # noqa: B027
        """Restore what ``sleep`` freed: the parts named, or all."""
