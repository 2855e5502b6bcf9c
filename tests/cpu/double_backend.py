"""A test-double training backend: a plain HF model in one process, no sharding at all.

Where it fits: ``test_backend_contract`` registers it in ``vime.backends.registry``
under the name ``double``, as a real backend is registered, and drives it through
the one ``PolicyTrainActor`` with the shared actor tests. It implements only the
``TrainBackend`` interface (``vime.backends.interface``), which is what a third
backend's author has to write: a forward over packed micro-batches, the local
tensors, the gradient norm, the HF-named weights and the checkpoint state.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vime.backends.base import TrainSettings
from vime.backends.interface import (
    MicroBatchFn,
    SavedState,
    TrainBackend,
    WeightPurpose,
    hf_dtype,
    run_in_order,
)
from vime.backends.optim import adamw
from vime.weights.buckets import WeightEntry, iter_buckets, tensor_nbytes


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The double has no flags of its own."""


def validate(args: Any) -> int:
    """One process: data-parallel size 1."""
    return 1


def settings(args: Any) -> None:
    """No settings of its own: ``TrainSettings`` holds all it reads."""
    return None


class DoubleBackend(TrainBackend):
    """``AutoModelForCausalLM`` on the host, trained whole by one rank."""

    name = "double"

    def setup(self, settings: TrainSettings) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if not dist.is_initialized():  # the actor's collectives need a group, of one here
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.rank, self.world, self.device = 0, 1, torch.device("cpu")
        self.temperature = settings.temperature
        self.hf_config = AutoConfig.from_pretrained(settings.hf_checkpoint)
        self.model = AutoModelForCausalLM.from_pretrained(
            settings.hf_checkpoint, dtype=torch.float32, attn_implementation="eager"
        )
        # Storages of their own: the loader's may map the file read-only, and sleep empties
        # storages in place.
        with torch.no_grad():
            for param in self.model.parameters():
                param.data = param.data.clone()
        self.trained_params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.model.named_parameters(), settings.adamw)

    def forward_backward(
        self,
        batch: Any,
        micro_batches: Sequence[tuple[int, ...]],
        consume: MicroBatchFn,
        *,
        backward: bool,
    ) -> None:
        run_in_order(
            micro_batches,
            consume,
            backward=backward,
            pack=lambda indices: batch.pack(indices),
            logits=lambda packed: self.model(**packed.model_inputs()).logits,
            temperature=self.temperature,
        )

    def local_tensors(self) -> list[torch.Tensor]:
        return self.trained_params

    def grad_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.trained_params if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads)

    def finish_grads(self) -> None:
        """One rank: its gradient is the whole one."""

    def weight_buckets(
        self, bucket_bytes: int, purpose: WeightPurpose = "full"
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        dtype = hf_dtype(self.hf_config)
        entries = (
            WeightEntry(name, tensor_nbytes(p.shape, dtype), lambda p=p: p.detach().to(dtype))
            for name, p in self.model.named_parameters()
        )
        return iter_buckets(entries, bucket_bytes)

    def save_state(self, folder: Path, with_optimizer: bool) -> None:
        state = {"model": self.model.state_dict()}
        if with_optimizer:
            state["optim"] = self.optimizer.state_dict()
        torch.save(state, folder / "double.pt")

    def load_state(self, saved: SavedState) -> bool:
        state = torch.load(saved.folder / "double.pt", weights_only=True)
        self.model.load_state_dict(state["model"])
        if "optim" in state:
            self.optimizer.load_state_dict(state["optim"])
        return True
