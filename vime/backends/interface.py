"""``TrainBackend``: the narrow interface a training backend implements.

Where it fits: ``vime.backends.registry`` names one ``TrainBackend`` class per
``--train-backend``; ``PolicyTrainActor`` (``policy_actor.py``) holds one instance
per training rank and composes everything backend-neutral around it: the optimizer
step and its counters, the train and log-prob loops over the planner's
micro-batches, the reference swap, sleep/wake through ``vime.device.HostStash``,
the checkpoint commit and the HF export. A backend is only what differs: how a
packed micro-batch runs forward (and backward), which tensors hold this rank's
weights, the gradient's norm and completion, the HF-named weights and the state
a checkpoint holds. It never sees the actor, and nothing here is private.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from vime.data.micro_batch import TokenStats, full_vocab_token_stats, response_log_probs

if TYPE_CHECKING:
    from vime.backends.base import TrainSettings

# (sample indices, packed micro-batch, log-probs, entropy or None) -> the micro-batch's loss
MicroBatchFn = Callable[[tuple[int, ...], Any, torch.Tensor, Any], Any]
# (packed micro-batch, with entropy) -> per-sample log-probs [B, T] and entropy or None
LogProbsFn = Callable[[Any, bool], tuple[torch.Tensor, torch.Tensor | None]]
# Which weights ``weight_buckets`` yields: the full model, what a weight sync sends (LoRA:
# the adapters, after the base once), or what an HF export writes.
WeightPurpose = Literal["full", "sync", "export"]


@dataclass(frozen=True)
class SavedState:
    """A verified checkpoint folder, as ``TrainBackend.load_state`` receives it."""

    folder: Path
    rollout_id: int
    meta: dict[str, Any]  # vime.checkpoint's metadata; ``extra`` holds ``checkpoint_extra``
    with_optimizer: bool  # it holds optimizer state (the run had taken a step)


class TrainBackend(abc.ABC):
    """One training rank's model, optimizer and process groups, as the actor needs them.

    ``setup`` sets the attributes below; the abstract methods are the interface, the
    others have the defaults of a backend that needs nothing more.
    """

    name: str = ""  # recorded in checkpoints; a load checks it
    rank: int
    world: int
    device: torch.device
    hf_config: Any  # the checkpoint's transformers config (its dtype: what exports hold)
    optimizer: Any  # offers ``param_groups``, ``step`` and ``state``
    # The tensors that hold the gradients and take the optimizer's updates: the weights, or
    # a backend's fp32 main copies of them (bf16 mixed precision).
    trained_params: list[torch.Tensor]
    # Ranks of one data-parallel replica that compute the same loss share (tensor parallel).
    loss_replicas: int = 1

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (the planner's rank)."""
        return self.rank

    # ----- the interface -------------------------------------------------------------------

    @abc.abstractmethod
    def setup(self, settings: TrainSettings) -> None:
        """Join the process groups, build the model and its optimizer (no checkpoint load);
        ``settings.backend`` is the backend's own part (its flag module's ``settings``)."""

    @abc.abstractmethod
    def forward_backward(
        self,
        batch: Any,
        micro_batches: Sequence[tuple[int, ...]],
        consume: MicroBatchFn,
        *,
        backward: bool,
    ) -> None:
        """Forward each micro-batch of ``batch`` in order and hand its log-probs to ``consume``.

        ``consume(indices, packed, logp, entropy)`` returns the micro-batch's loss, which is
        backpropagated when ``backward`` (entropy is computed only then). A backend that
        splits the model over ranks calls ``consume`` only where the logits are.
        """

    @abc.abstractmethod
    def local_tensors(self) -> list[torch.Tensor]:
        """The plain tensors that hold this rank's share of the trained weights."""

    @abc.abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the step's gradient (the same number on every rank)."""

    @abc.abstractmethod
    def finish_grads(self) -> None:
        """Complete the step's gradient after every micro-batch's backward (e.g. the sum
        over data-parallel ranks)."""

    @abc.abstractmethod
    def weight_buckets(
        self, bucket_bytes: int, purpose: WeightPurpose = "full"
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named weights in lists under ``bucket_bytes`` (a collective: every rank
        iterates to the end)."""

    @abc.abstractmethod
    def save_state(self, folder: Path, with_optimizer: bool) -> None:
        """Write this rank's share of the weights (and optimizer state) into ``folder``."""

    @abc.abstractmethod
    def load_state(self, saved: SavedState) -> bool:
        """Restore what ``save_state`` wrote; True when the RNG streams saved beside it
        belong to this layout (the actor restores them), False when they were re-seeded."""

    # ----- what only some backends need ----------------------------------------------------

    def after_step(self, skipped: bool) -> None:  # noqa: B027 - a no-op default
        """After each optimizer step, taken or ``skipped`` (e.g. re-round bf16 weights)."""

    def reference(self) -> AbstractContextManager[None] | None:
        """A block in which the model computes as the KL reference by itself (LoRA: the
        adapters off), or None: the actor swaps in host copies of the initial weights."""
        return None

    def sleep_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The backend's own buffers ``sleep`` handles beyond weights and optimizer state:
        ones that hold weights (parked), and gradient buffers, zero between steps (freed)."""
        return [], []

    def release_gathered(self) -> None:  # noqa: B027 - a no-op default
        """Free full-weight copies a forward may have left (before a sleep or a swap)."""

    def export_adapters(self, path: str) -> bool:
        """Write an adapter folder at ``path`` if the model trains adapters; False when it
        has none (the actor writes the full model then)."""
        return False

    def checkpoint_extra(self) -> dict[str, Any]:
        """Backend facts recorded in the checkpoint metadata (e.g. the TP size)."""
        return {}

    def rng_state(self) -> dict[str, Any]:
        """Random streams kept outside the process generators (saved beside them)."""
        return {}

    def set_rng_state(self, rng: dict[str, Any]) -> None:  # noqa: B027 - a no-op default
        """Restore what ``rng_state`` saved."""


def hf_dtype(hf_config: Any) -> torch.dtype:
    """The dtype an HF config declares (what engines and exports receive)."""
    dtype = getattr(hf_config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def run_in_order(
    micro_batches: Sequence[tuple[int, ...]],
    consume: MicroBatchFn,
    *,
    backward: bool,
    pack: Callable[[tuple[int, ...]], Any],
    logits: Callable[[Any], torch.Tensor],
    temperature: float,
    token_stats: TokenStats = full_vocab_token_stats,
    before_backward: Callable[[bool], None] | None = None,
    log_probs: LogProbsFn | None = None,
) -> None:
    """``TrainBackend.forward_backward`` for a model that computes whole logits on every
    rank: pack, forward, log-probs, ``consume``, backward, one micro-batch at a time.

    ``token_stats`` reduces over the vocabulary (a tensor-parallel shard's: across ranks);
    ``before_backward(last)`` runs before each backward, ``last`` on the final one (every
    rank has as many micro-batches, so the ranks agree on which is last).
    ``log_probs(packed, with_entropy)``, when given, replaces forward + log-probs (the
    fused head tail, ``vime.backends.lm_head``), and ``logits`` goes unused.
    """
    for position, indices in enumerate(micro_batches):
        packed = pack(indices)
        # No .float() here: response_log_probs upcasts only the response rows it picks,
        # never a whole [L, V] row of bf16 logits.
        if log_probs is not None:
            logp, entropy = log_probs(packed, backward)
        else:
            logp, entropy = response_log_probs(
                logits(packed),
                packed,
                temperature=temperature,
                with_entropy=backward,
                token_stats=token_stats,
            )
        loss = consume(indices, packed, logp, entropy)
        if backward:
            if before_backward is not None:
                before_backward(position == len(micro_batches) - 1)
            loss.backward()
