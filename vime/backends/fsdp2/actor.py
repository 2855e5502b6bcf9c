"""``FSDP2Actor``: one training rank of the ``fsdp2`` backend.

Where it fits: the registry names this class for ``--train-backend fsdp2``;
the loop drives it through the ``TrainActor`` contract. Model placement is in
``model.py``; the training step, loss, optimizer chokepoint, reference swap and
checkpoint commit are the backend-neutral ``PolicyTrainActor``. This file holds
what is particular to FSDP2: DTensor shards (their norm, their host copies, their
full tensors for the weight source), sleep/wake, and the DCP state that reshards.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from vime import checkpoint
from vime import device as vime_device
from vime.backends import varlen_attention
from vime.backends.fsdp2 import model as fsdp_model
from vime.backends.policy_actor import PolicyTrainActor
from vime.weights.buckets import WeightEntry, iter_buckets, tensor_nbytes


class FSDP2Actor(PolicyTrainActor):
    """HF causal LM sharded with ``fully_shard`` over every training rank."""

    backend_name = "fsdp2"

    def init(self, args: Any) -> int:
        self.args = args
        self.rank, self.world, self.device = fsdp_model.init_distributed()
        mesh = fsdp_model.build_mesh(args.fsdp_mode, self.world, args.fsdp_shard_size, self.device)
        # hybrid and no_shard: (replicas, shard) mesh; the replicas all-reduce gradients.
        self.replicas = mesh.size(0) if mesh.ndim == 2 else 1
        if args.hf_checkpoint is None:
            raise ValueError("the fsdp2 backend needs --hf-checkpoint DIR")
        param_dtype = vime_device.resolve_dtype(args.fsdp_param_dtype, self.device)
        # The checkpoint's own config: its dtype is what engines and --save-hf receive. The
        # model's config cannot serve, it says float32 (the master weights it was built in).
        self.hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
        attn = fsdp_model.resolve_attn_implementation(
            args.attn_implementation, self.device, param_dtype, self.hf_config
        )
        # Per-sample attention reads rows whose samples share their prompt (computed once).
        self.shares_prompts = attn == varlen_attention.HF_NAME
        self.model = fsdp_model.load_sharded_model(
            args.hf_checkpoint,
            mesh=mesh,
            device=self.device,
            attn_implementation=attn,
            shard_kwargs={
                "block_classes": args.fsdp_block_classes,
                "param_dtype": param_dtype,
                "reduce_dtype": vime_device.resolve_dtype(args.fsdp_reduce_dtype, self.device),
                "reshard_after_forward": args.fsdp_reshard_after_forward,
                "cpu_offload": args.fsdp_cpu_offload,
            },
        )
        if args.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._setup_training(list(self.model.named_parameters()))
        return self._start_rollout()

    # ----- backend hooks -------------------------------------------------------------------

    def _logits(self, packed: Any) -> torch.Tensor:
        return self.model(**packed.model_inputs()).logits

    def _local_tensors(self) -> list[torch.Tensor]:
        return [_local(p) for p in self.params]

    def _before_backward(self, last: bool) -> None:
        # Each backward reduce-scatters within the shard group; FSDP2 keeps the partial
        # sums, so the all-reduce across replicas (the slow, often inter-node, one) runs
        # once per optimizer step instead of once per micro-batch. The partial sums cost
        # one more gradient shard (in the reduce dtype) for the length of the step.
        if self.replicas > 1:
            self.model.set_requires_all_reduce(last)

    def grad_norm(self) -> torch.Tensor:
        # FSDP reduce-scattered the gradients in backward: the norm of the DTensor shards.
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # ----- weights out ---------------------------------------------------------------------

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named weights in the checkpoint's dtype, one bucket materialized at a time.

        A collective: every rank must iterate it to the end (``full_tensor`` all-gathers).
        """
        self._check_awake("weights")
        dtype = self._hf_dtype()
        entries = (
            WeightEntry(
                name,
                tensor_nbytes(param.shape, dtype),
                # On the rank's device even when the shards are offloaded to the host: a
                # colocated engine opens the tensors through CUDA IPC.
                lambda p=param: _full(p).detach().to(self.device, dtype),
            )
            for name, param in self.model.named_parameters()
        )
        return iter_buckets(entries, bucket_bytes)

    def _release_gathered(self) -> None:
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                # With --no-fsdp-reshard-after-forward a forward with no backward (log-probs)
                # leaves the groups gathered; free those full copies too.
                module.reshard()

    def _exchange(self, held: list[torch.Tensor]) -> None:
        # With --no-fsdp-reshard-after-forward a log-prob forward leaves its weights
        # gathered, and the next forward would compute with those copies instead of the
        # values swapped into the shards: drop them first.
        self._release_gathered()
        super()._exchange(held)

    # ----- checkpoints ---------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        # A never-stepped AdamW has no state; asking DCP for it would fabricate a step.
        if self.optimizer_steps > 0:
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def _load(self, load_dir: str) -> int:
        """Restore the newest checkpoint under ``load_dir``; return its rollout id.

        DCP stores every tensor by its global shape, so a checkpoint saved by a
        different number of ranks (or another ``--fsdp-mode``) is resharded on
        load. Per-rank RNG streams have no counterpart then: they are re-seeded
        from ``--seed``, the rollout id and the rank, and rank 0 says so.
        """
        rollout_id, folder, meta = self._open_checkpoint(load_dir)
        saved_world = int(meta["world_size"])
        state = self._state()
        try:
            dcp.load(state, checkpoint_id=str(folder))
        except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
            # verify() checked every file's size, so what DCP cannot read is corrupt content.
            reason = _reason(e)
            if saved_world == self.world:
                raise checkpoint.CheckpointError(
                    f"{folder} could not be read ({reason}): a shard is corrupt though its "
                    f"size is right; write an earlier rollout id into {load_dir}/"
                    f"{checkpoint.TRACKER}, or start over from an HF export"
                ) from e
            raise checkpoint.CheckpointError(
                f"{folder} was saved by {saved_world} ranks and could not be resharded onto "
                f"{self.world} ranks ({reason}); load it with {saved_world} ranks"
            ) from e
        set_model_state_dict(self.model, state["model"])
        if "optim" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        if saved_world == self.world:
            self._restore_rng(folder)
        else:
            _seed_all(self.args.seed * 1_000_003 + rollout_id * 1_009 + self.rank)
            if self.rank == 0:
                print(
                    f"vime: {folder} was saved by {saved_world} ranks and is loaded on "
                    f"{self.world}: weights and optimizer resharded, RNG streams re-seeded",
                    flush=True,
                )
        return rollout_id


def _seed_all(seed: int) -> None:
    """Seed python, numpy and torch (every device) generators from one number."""
    import numpy as np

    seed %= 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _reason(error: BaseException) -> str:
    """Which rank failed and with what error type. DCP's own message is a list of ranks and
    full tracebacks, and an unreadable shard's suggests ``weights_only=False``, no fix
    here; the full chain stays on the raised error's ``__cause__``."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (inner, _trace) = min(error.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {type(inner).__name__}"
    return type(error).__name__


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param
