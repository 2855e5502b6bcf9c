"""``FSDP2Actor``: one training rank of the ``fsdp2`` backend.

Where it fits: the registry names this class for ``--train-backend fsdp2``;
the loop drives it through the ``TrainActor`` contract. Model placement is in
``model.py``; the loss is ``vime.algo.objective`` and the micro-batches come
from ``vime.data`` — this file only sequences them: forward a packed row,
log-probs, loss, backward, and the optimizer-step chokepoint.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from vime import checkpoint
from vime import device as vime_device
from vime.algo import load_function, policy_loss
from vime.algo.metrics import MetricAccumulator
from vime.algo.objective import LossConfig, Normalizers, micro_batch_loss
from vime.backends.base import TrainActor
from vime.backends.fsdp2 import model as fsdp_model
from vime.backends.optim import LRSchedule, optimizer_step, param_groups
from vime.data.batch import TrainSchedule, pad_rows
from vime.data.micro_batch import response_log_probs
from vime.device import HostStash
from vime.weights.buckets import WeightEntry, iter_buckets, tensor_nbytes
from vime.weights.hf_export import save_hf_folder

PerSample = dict[int, torch.Tensor]


class FSDP2Actor(TrainActor):
    """HF causal LM sharded with ``fully_shard`` over every training rank."""

    def init(self, args: Any) -> int:
        self.args = args
        self.rank, self.world, self.device = fsdp_model.init_distributed()
        mesh = fsdp_model.build_mesh(args.fsdp_mode, self.world, args.fsdp_shard_size, self.device)
        if args.hf_checkpoint is None:
            raise ValueError("the fsdp2 backend needs --hf-checkpoint DIR")
        param_dtype = fsdp_model.resolve_param_dtype(args.fsdp_param_dtype, self.device)
        self.model = fsdp_model.load_sharded_model(
            args.hf_checkpoint,
            mesh=mesh,
            device=self.device,
            attn_implementation=fsdp_model.resolve_attn_implementation(
                args.attn_implementation, self.device, param_dtype
            ),
            shard_kwargs={
                "block_classes": args.fsdp_block_classes,
                "param_dtype": param_dtype,
                "reduce_dtype": fsdp_model.resolve_param_dtype(args.fsdp_reduce_dtype, self.device),
                "reshard_after_forward": args.fsdp_reshard_after_forward,
                "cpu_offload": args.fsdp_cpu_offload,
            },
        )
        if args.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model.named_parameters(), args.weight_decay),
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
        )
        samples_per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
        self.lr_schedule = LRSchedule(
            lr=args.lr,
            min_lr=args.min_lr,
            decay_style=args.lr_decay_style,
            warmup_samples=args.lr_warmup_samples,
            total_samples=(args.num_rollout or 1) * samples_per_rollout,
        )
        loss_fn = policy_loss
        if args.custom_loss_function_path:
            loss_fn = load_function(args.custom_loss_function_path, expected=policy_loss)
        self.loss_config = LossConfig.from_args(args, loss_fn)
        self.samples_consumed = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self._stash: HostStash | None = None
        # The reference model is the initial weights, kept as host copies of this rank's shards.
        self.ref_shards = self._local_shards(copy_to="cpu") if args.use_kl_loss else None
        if args.load and checkpoint.latest(args.load) is not None:
            return self._load(args.load) + 1
        return 0

    # ----- forward -------------------------------------------------------------------------

    def _local_shards(self, copy_to: str) -> list[torch.Tensor]:
        return [_local(p).detach().to(copy_to, copy=True) for p in self.params]

    def _swap_in(self, shards: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for param, shard in zip(self.params, shards, strict=True):
                _local(param).copy_(shard)

    def _forward(self, batch: Any, indices: tuple[int, ...]) -> tuple[Any, torch.Tensor, Any]:
        packed = batch.pack(indices).to(self.device)
        logits = self.model(**packed.model_inputs()).logits
        logp, entropy = response_log_probs(
            logits.float(), packed, temperature=self.args.rollout_temperature, with_entropy=True
        )
        return packed, logp, entropy

    @torch.no_grad()
    def compute_log_probs(self, schedule: TrainSchedule, which: str) -> PerSample:
        """This rank's response log-probs under ``which`` ("actor" or "ref"), per sample index,
        computed at the micro-batch geometry ``train`` uses."""
        if which not in ("actor", "ref"):
            raise ValueError(f"which must be 'actor' or 'ref', got {which!r}")
        if which == "ref":
            if self.ref_shards is None:
                raise ValueError("no reference model: KL loss is off")
            actor_shards = self._local_shards(copy_to="cpu")
            self._swap_in(self.ref_shards)
        out: PerSample = {}
        try:
            for micro_batches in schedule.plan.for_rank(self.dp_rank):
                for indices in micro_batches:
                    packed, logp, _ = self._forward(schedule.batch, indices)
                    for row, i in enumerate(indices):
                        out[i] = logp[row, : int(packed.response_lengths[row])].cpu()
        finally:
            if which == "ref":
                self._swap_in(actor_shards)
        return out

    @property
    def dp_rank(self) -> int:
        return self.rank

    # ----- train ---------------------------------------------------------------------------

    def train(self, schedule: TrainSchedule) -> dict[str, float]:
        """Every optimizer step of one rollout; metrics reduced over micro-batches and ranks."""
        plan = schedule.plan
        ref = self.compute_log_probs(schedule, "ref") if self.loss_config.use_kl else None
        # One update per rollout: pi_old is the current policy, so no recomputation (ratio == 1).
        old = self.compute_log_probs(schedule, "actor") if plan.num_steps > 1 else None
        metrics = MetricAccumulator()
        skipped = 0
        for step_index in range(plan.num_steps):
            step_loss = self.backward_step(schedule, step_index, metrics, ref=ref, old=old)
            result = self._optimizer_step(len(plan.steps[step_index].sample_indices))
            skipped += int(result.skipped)
            # Per step: the loss is the sum of the ranks' shares; grad norm and lr are already
            # global, so each rank contributes 1/world of them. Means are then over steps.
            share = 1.0 / self.world
            metrics.add("loss", step_loss, share)
            metrics.add("grad_norm", share * (0.0 if result.skipped else result.grad_norm), share)
            metrics.add("lr", share * result.lr, share)
        names, packed_metrics = metrics.to_tensor()
        dist.all_reduce(packed_metrics)
        means = MetricAccumulator.from_tensor(names, packed_metrics).means()
        out = {f"train/{name}": value for name, value in means.items()}
        out["train/skipped_steps"] = float(skipped)
        return out

    def backward_step(
        self,
        schedule: TrainSchedule,
        step_index: int,
        metrics: MetricAccumulator,
        *,
        ref: PerSample | None = None,
        old: PerSample | None = None,
    ) -> float:
        """Forward + backward every micro-batch of one optimizer step on this rank.

        Leaves the step's gradient (summed over ranks) in ``.grad``; returns this
        rank's share of the step loss. ``train`` follows it with the optimizer step;
        tests call it alone to compare gradients.
        """
        batch = schedule.batch
        step = schedule.plan.steps[step_index]
        norm = Normalizers(step.num_tokens, step.num_samples, step.max_response_len)
        step_loss = 0.0
        for indices in step.for_rank(self.dp_rank):
            packed, logp, entropy = self._forward(batch, indices)
            width = logp.shape[1]
            loss, micro_metrics = micro_batch_loss(
                logp,
                packed.loss_mask,
                batch.advantages_of(indices).to(self.device),
                norm,
                self.loss_config,
                old_logp=_gather(old, indices, width, self.device),
                ref_logp=_gather(ref, indices, width, self.device),
                rollout_logp=_to(batch.rollout_log_probs_of(indices, width), self.device),
                entropy=entropy,
            )
            loss.backward()
            step_loss += float(loss.detach())
            metrics.merge(micro_metrics)
        return step_loss

    def _optimizer_step(self, num_samples: int) -> Any:
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        lr = self.lr_schedule(self.samples_consumed + num_samples)
        result = optimizer_step(
            self.optimizer, self.params, norm, clip_grad=self.args.clip_grad, lr=lr
        )
        self.samples_consumed += num_samples
        if result.skipped:
            self.skipped_steps += 1
            if self.rank == 0:
                print(f"vime: non-finite grad norm {result.grad_norm}; step skipped", flush=True)
        else:
            self.optimizer_steps += 1
        return result

    # ----- weights out ---------------------------------------------------------------------

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named weights in the checkpoint's dtype, one bucket materialized at a time.

        A collective: every rank must iterate it to the end (``full_tensor`` all-gathers).
        """
        dtype = getattr(self.model.config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        entries = (
            WeightEntry(
                name,
                tensor_nbytes(param.shape, dtype),
                lambda p=param: _full(p).detach().to(dtype),
            )
            for name, param in self.model.named_parameters()
        )
        return iter_buckets(entries, bucket_bytes)

    def export_hf(self, path: str) -> None:
        buckets = self.weight_buckets(self.args.update_weight_buffer_size)
        if self.rank != 0:
            for _ in buckets:  # take part in the all-gathers; rank 0 writes
                pass
            return
        tokenizer = None
        if self.args.hf_checkpoint:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(self.args.hf_checkpoint)
            except (OSError, ValueError):
                tokenizer = None  # a checkpoint without a tokenizer exports weights only
        save_hf_folder(path, buckets, config=self.model.config, tokenizer=tokenizer)

    # ----- accelerator memory --------------------------------------------------------------

    def sleep(self) -> None:
        """Free this rank's accelerator memory while the rollout engine has the GPU.

        The parameter shards, any gradients and the optimizer state that live on
        the GPU go to host memory (their storages are emptied in place, so the
        optimizer and FSDP keep valid references), and the allocator cache is
        returned; what ``--fsdp-cpu-offload`` keeps on the host stays there. On
        CPU nothing lives on an accelerator, so this is a no-op. Nothing may run
        on the model until ``wake_up``.
        """
        if self._stash is not None:
            return
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                # With --no-fsdp-reshard-after-forward a forward with no backward (log-probs)
                # leaves the groups gathered; free those full copies too.
                module.reshard()
        tensors = [_local(p) for p in self.params]
        tensors += [_local(p.grad) for p in self.params if p.grad is not None]
        for state in self.optimizer.state.values():
            tensors += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
        self._stash = HostStash(t for t in tensors if vime_device.is_cuda(t.device))
        vime_device.empty_cache()

    def wake_up(self) -> None:
        """Put back, bit for bit, what ``sleep`` moved to the host (no-op on CPU)."""
        if self._stash is not None:
            self._stash.restore()
            self._stash = None

    # ----- checkpoints ---------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        # A never-stepped AdamW has no state; asking DCP for it would fabricate a step.
        if self.optimizer_steps > 0:
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def save(self, rollout_id: int, extra: dict[str, Any] | None = None) -> None:
        save_dir = self.args.save
        partial = checkpoint.begin_save(save_dir, rollout_id, is_rank0=self.rank == 0)
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=str(partial))
        torch.save(checkpoint.rng_state(), os.path.join(partial, f"rng_rank{self.rank}.pt"))
        dist.barrier()
        if self.rank == 0:
            counters = {
                "samples_consumed": self.samples_consumed,
                "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps,
            }
            checkpoint.commit_save(
                save_dir,
                rollout_id,
                backend="fsdp2",
                world_size=self.world,
                extra={"counters": counters, **(extra or {})},
                keep_last=self.args.keep_last_checkpoints,
            )
        dist.barrier()

    def _load(self, load_dir: str) -> int:
        """Restore the newest checkpoint under ``load_dir``; return its rollout id.

        DCP stores every tensor by its global shape, so a checkpoint saved by a
        different number of ranks (or another ``--fsdp-mode``) is resharded on
        load. Per-rank RNG streams have no counterpart then: they are re-seeded
        from ``--seed``, the rollout id and the rank, and rank 0 says so.
        """
        rollout_id = checkpoint.latest(load_dir)
        folder = checkpoint.iteration_dir(load_dir, rollout_id)
        meta = checkpoint.verify(folder)
        saved_world = int(meta["world_size"])
        counters = meta["extra"]["counters"]
        self.samples_consumed = counters["samples_consumed"]
        self.optimizer_steps = counters["optimizer_steps"]
        self.skipped_steps = counters["skipped_steps"]
        state = self._state()
        try:
            dcp.load(state, checkpoint_id=str(folder))
        except Exception as e:
            if saved_world == self.world:
                raise
            raise checkpoint.CheckpointError(
                f"{folder} was saved by {saved_world} ranks and could not be resharded onto "
                f"{self.world} ranks ({type(e).__name__}); load it with {saved_world} ranks"
            ) from e
        set_model_state_dict(self.model, state["model"])
        if "optim" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        if saved_world == self.world:
            rng = torch.load(os.path.join(folder, f"rng_rank{self.rank}.pt"), weights_only=False)
            checkpoint.set_rng_state(rng)
        else:
            _seed_all(self.args.seed * 1_000_003 + rollout_id * 1_009 + self.rank)
            if self.rank == 0:
                print(
                    f"vime: {folder} was saved by {saved_world} ranks and is loaded on "
                    f"{self.world}: weights and optimizer resharded, RNG streams re-seeded",
                    flush=True,
                )
        self.loaded_extra = meta["extra"]
        return rollout_id


def _seed_all(seed: int) -> None:
    """Seed python, numpy and torch (every device) generators from one number."""
    import numpy as np

    seed %= 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _gather(
    values: PerSample | None, indices: tuple[int, ...], width: int, device: torch.device
) -> torch.Tensor | None:
    """``[B, width]`` of this rank's per-sample log-probs, zero-padded; None passes through."""
    return None if values is None else pad_rows([values[i] for i in indices], width).to(device)
