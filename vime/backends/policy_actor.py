"""``PolicyTrainActor``: the backend-neutral half of a training rank.

Where it fits: ``FSDP2Actor`` and ``MegatronActor`` both subclass it. Everything
that must be the same in both backends for their runs to be one run lives here,
once: the optimizer and LR schedule set-up, the reference-model swap, the
log-prob pass at training geometry, the micro-batch loop over
``vime.algo.objective.micro_batch_loss``, the optimizer-step chokepoint with its
counters, the metric reduction, ``sleep``/``wake_up`` (GPU memory parked on the
host through ``vime.device.HostStash``), the HF export and the checkpoint commit.

A backend supplies only what differs: how a packed row becomes logits
(``_logits``; a backend that splits the model over ranks replaces the micro-batch
loop itself, ``_run_micro_batches``), which tensors hold this rank's share of the weights
(``_local_tensors``), how the global gradient norm is computed (``grad_norm``),
what must happen to gradients before and after backward (``_before_backward``,
``_finish_grads``: megatron sums
data-parallel and partial tensor-parallel grads there; FSDP2 has already
reduce-scattered), what to free before sleeping (``_release_gathered``: FSDP2's
gathered groups), its HF-named weight source (``weight_buckets``) and its
checkpoint state (``_state`` / ``_load``).
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vime import checkpoint
from vime import device as vime_device
from vime.algo.metrics import MetricAccumulator
from vime.algo.objective import Normalizers, micro_batch_loss
from vime.backends.base import TRAIN_MEMORY_TAGS, TrainActor, train_tags
from vime.backends.optim import LRSchedule, StepResult, optimizer_step, param_groups
from vime.config.settings import loss_settings
from vime.data.batch import TrainSchedule, pad_rows
from vime.data.micro_batch import response_log_probs
from vime.device import HostStash
from vime.weights.hf_export import save_hf_folder

PerSample = dict[int, torch.Tensor]
# (sample indices, packed micro-batch, log-probs, entropy or None) -> the micro-batch's loss
MicroBatchFn = Callable[[tuple[int, ...], Any, torch.Tensor, Any], Any]


class PolicyTrainActor(TrainActor):
    """A training rank that optimizes ``vime.algo``'s loss on the planner's micro-batches.

    Subclasses set ``args``, ``rank``, ``world``, ``device``, ``params`` and
    ``hf_config`` in ``init`` and then call ``_setup_training``.
    """

    backend_name: str = ""  # recorded in checkpoints; a load checks it
    # Ranks of one data-parallel replica that compute the same loss share (tensor parallel).
    loss_replicas: int = 1
    # Packed rows are right-padded to a multiple of this many tokens (sequence parallel).
    row_multiple: int = 1
    # Samples of one prompt share its tokens in a row (vime.data.micro_batch): only for an
    # attention that reads such rows (varlen_sdpa), set in init.
    shares_prompts: bool = False
    # The model itself can compute as the KL reference (LoRA: adapters off), set in init
    # before _setup_training: no host copy of the initial weights is kept then.
    reference_in_model: bool = False

    # ----- backend hooks -------------------------------------------------------------------

    @abc.abstractmethod
    def _logits(self, packed: Any) -> torch.Tensor:
        """``[B, T, vocab]`` logits of a packed micro-batch (full vocabulary)."""

    @abc.abstractmethod
    def _local_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold this rank's share of ``params``, in ``params`` order."""

    @abc.abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the step's gradient (the same number on every rank)."""

    def _weight_buffers(self) -> list[torch.Tensor]:
        """A backend's own buffers that hold weights (``sleep`` parks them with them)."""
        return []

    def _scratch_buffers(self) -> list[torch.Tensor]:
        """A backend's own gradient buffers, all zeros between steps (``sleep`` frees them)."""
        return []

    def _release_gathered(self) -> None:
        """Free full-weight copies a forward may have left behind (before ``sleep``)."""

    def _before_backward(self, last: bool) -> None:
        """Called before each micro-batch's backward; ``last`` on the step's final one
        (every rank has as many micro-batches, so the ranks agree on which is last).
        Where a replica-wide gradient sum can wait for the step's end, it is skipped
        until ``last``: FSDP2's replica all-reduce in ``hybrid`` and ``no_shard``."""

    def _finish_grads(self) -> None:
        """Complete the step's gradient after every micro-batch's backward."""

    @abc.abstractmethod
    def _state(self) -> dict[str, Any]:
        """This rank's checkpoint state, in the form ``_write_state`` and ``_load`` use."""

    def _checkpoint_extra(self) -> dict[str, Any]:
        """Backend facts recorded in the checkpoint metadata (e.g. the TP size)."""
        return {}

    @property
    def trained_params(self) -> list[torch.Tensor]:
        """The tensors that hold the gradients and take the optimizer's updates: ``params``,
        or a backend's fp32 main copies of them (megatron's bf16 mixed precision)."""
        return self.params

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (the planner's rank)."""
        return self.rank

    # ----- set-up --------------------------------------------------------------------------

    def _setup_training(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
        """AdamW (Megatron's no-decay groups), the LR schedule, the loss and the counters."""
        args = self.args
        self.optimizer = self._make_optimizer(named_params)
        samples_per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
        self.lr_schedule = LRSchedule(
            lr=args.lr,
            min_lr=args.min_lr,
            decay_style=args.lr_decay_style,
            warmup_samples=args.lr_warmup_samples,
            total_samples=(args.num_rollout or 1) * samples_per_rollout,
        )
        self.loss_config = loss_settings(args)
        self.samples_consumed = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self._asleep: dict[str, HostStash] = {}  # TRAIN_MEMORY_TAGS part -> its stash
        # The reference model is the initial weights, kept as host copies of this rank's shards
        # (unless the model computes as its reference by itself).
        copies = args.use_kl_loss and not self.reference_in_model
        self.ref_shards = self._host_copies() if copies else None

    def _make_optimizer(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> Any:
        """AdamW over ``named_params`` in Megatron's decay groups (a backend may bring its
        own optimizer: it must offer ``param_groups``, ``step`` and ``state``)."""
        args = self.args
        return torch.optim.AdamW(
            param_groups(named_params, args.weight_decay),
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            # torch picks the per-tensor loop on the CPU: a dozen ops a parameter, each
            # through DTensor dispatch. Multi-tensor ops are ~5x faster there.
            foreach=True,
        )

    def _start_rollout(self) -> int:
        """The rollout id to start from: 0, or the one after ``--load``'s newest checkpoint.

        Every rank must find the same one (else some would load, a collective, while
        the others started afresh and waited elsewhere)."""
        if not self.args.load:
            return 0
        point = checkpoint.resume_point(self.args.load)
        views = self._gather(point)
        checkpoint.check_shared("--load", self.args.load, views, "newest checkpoints")
        return 0 if point is None else self._load(self.args.load) + 1

    def _gather(self, value: Any) -> list[Any]:
        """``value`` from every rank, in rank order (a collective)."""
        views: list[Any] = [None] * self.world
        dist.all_gather_object(views, value)
        return views

    # ----- forward -------------------------------------------------------------------------

    def _host_copies(self) -> list[torch.Tensor]:
        # Pinned next to a GPU, so the reference swap's copies are DMA transfers.
        pin = vime_device.is_cuda(self.device)
        return [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t.detach())
            for t in self._local_tensors()
        ]

    def _exchange(self, held: list[torch.Tensor]) -> None:
        """Swap this rank's weights with ``held`` (host tensors of the same shapes), bit
        for bit: afterwards the weights hold what ``held`` held, and ``held`` the weights.

        One tensor at a time through a device copy, so a swap and its swap back cost no
        host memory beyond ``held`` itself and no allocation but one shard's device copy.
        """
        with torch.no_grad():
            for local, value in zip(self._local_tensors(), held, strict=True):
                staged = local.detach().clone()
                local.copy_(value)
                value.copy_(staged)

    @contextmanager
    def _as_reference(self) -> Iterator[None]:
        """Inside the block the model computes as the KL reference: the initial weights
        swapped in from their host copies, and swapped back out after."""
        if self.ref_shards is None:
            raise ValueError("no reference model: KL loss is off")
        self._exchange(self.ref_shards)  # the reference in; the actor parked in its place
        try:
            yield
        finally:
            self._exchange(self.ref_shards)

    def _pack(self, batch: Any, indices: tuple[int, ...]) -> Any:
        return batch.pack(
            indices, pad_to_multiple_of=self.row_multiple, share_prompts=self.shares_prompts
        ).to(self.device)

    def _log_probs(
        self, logits: torch.Tensor, packed: Any, *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token response log-probs (and entropy) of a packed micro-batch's logits."""
        # No .float() here: response_log_probs upcasts only the response rows it picks,
        # never a whole [L, V] row of bf16 logits.
        return response_log_probs(
            logits,
            packed,
            temperature=self.args.rollout_temperature,
            with_entropy=with_entropy,
        )

    def _run_micro_batches(
        self,
        batch: Any,
        micro_batches: Sequence[tuple[int, ...]],
        consume: MicroBatchFn,
        *,
        backward: bool,
    ) -> None:
        """Forward each micro-batch in order and hand its log-probs to ``consume``.

        ``consume(indices, packed, logp, entropy)`` returns the micro-batch's loss,
        which is backpropagated when ``backward`` (entropy is computed only then). A
        backend that splits the model over ranks (megatron's pipeline) replaces this
        with a schedule that calls ``consume`` only where the logits are.
        """
        for position, indices in enumerate(micro_batches):
            packed = self._pack(batch, indices)
            logp, entropy = self._log_probs(self._logits(packed), packed, with_entropy=backward)
            loss = consume(indices, packed, logp, entropy)
            if backward:
                self._before_backward(last=position == len(micro_batches) - 1)
                loss.backward()

    @torch.no_grad()
    def compute_log_probs(self, schedule: TrainSchedule, which: str) -> PerSample:
        """This DP rank's response log-probs under ``which`` ("actor" or "ref"), per sample
        index, at the micro-batch geometry ``train`` uses."""
        if which not in ("actor", "ref"):
            raise ValueError(f"which must be 'actor' or 'ref', got {which!r}")
        self._check_awake("weights")  # a forward: gradients and optimizer state may sleep
        if which == "ref" and not self.args.use_kl_loss:
            raise ValueError("no reference model: KL loss is off")
        out: PerSample = {}

        def record(indices: tuple[int, ...], packed: Any, logp: torch.Tensor, _: Any) -> None:
            for row, i in enumerate(indices):
                out[i] = logp[row, : int(packed.response_lengths[row])].cpu()

        with self._as_reference() if which == "ref" else nullcontext():
            for micro_batches in schedule.plan.for_rank(self.dp_rank):
                self._run_micro_batches(schedule.batch, micro_batches, record, backward=False)
        return out

    # ----- train ---------------------------------------------------------------------------

    def train(self, schedule: TrainSchedule) -> dict[str, float]:
        """Every optimizer step of one rollout; metrics reduced over micro-batches and ranks."""
        self._check_awake()
        plan = schedule.plan
        ref = self.compute_log_probs(schedule, "ref") if self.loss_config.use_kl else None
        # pi_old is the proximal policy (decoupled PPO): these weights, before the update.
        # One update per rollout: the update's own forward is on exactly them, whatever the
        # samples' age (--max-staleness), so no second pass (ratio == 1). Several: recomputed.
        old = self.compute_log_probs(schedule, "actor") if plan.num_steps > 1 else None
        metrics = MetricAccumulator()
        skipped = 0
        for step_index in range(plan.num_steps):
            step_loss = self.backward_step(schedule, step_index, metrics, ref=ref, old=old)
            result = self._optimizer_step(len(plan.steps[step_index].sample_indices))
            skipped += int(result.skipped)
            # The step loss is the sum of the DP replicas' shares (each counted once, not once
            # per TP rank); grad norm and lr are global, so each rank adds 1/world of them.
            share = 1.0 / self.world
            metrics.add("loss", step_loss / self.loss_replicas, share)
            # The mean over the steps taken: a skipped step's norm is not finite and must not
            # count as a 0 (with every step skipped the metric is NaN, not 0).
            taken = 0.0 if result.skipped else share
            metrics.add("grad_norm", taken * result.grad_norm if taken else 0.0, taken)
            metrics.add("lr", share * result.lr, share)
        # Per-micro-batch metrics are (sum, weight) pairs, so TP copies cancel in the mean;
        # pipeline stages without the loss have none of them. A metric nothing measured
        # (every sample's reward failed, every step skipped) is NaN, written as null, so
        # every rollout's line has the same keys.
        means = metrics.all_reduce().means(empty=math.nan)
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

        Leaves the step's full gradient (summed over DP ranks) in ``.grad``; returns
        this rank's share of the step loss. ``train`` follows it with the optimizer
        step; tests call it alone to compare gradients.
        """
        batch = schedule.batch
        step = schedule.plan.steps[step_index]
        norm = Normalizers(step.num_tokens, step.num_samples)
        step_loss = 0.0

        def loss_of(
            indices: tuple[int, ...], packed: Any, logp: torch.Tensor, entropy: Any
        ) -> torch.Tensor:
            nonlocal step_loss
            width = logp.shape[1]
            rollout_logp = batch.rollout_log_probs_of(indices, width)
            loss, micro_metrics = micro_batch_loss(
                logp,
                packed.loss_mask,
                batch.advantages_of(indices).to(self.device),
                norm,
                self.loss_config,
                old_logp=self._rows(old, indices, width),
                ref_logp=self._rows(ref, indices, width),
                rollout_logp=None if rollout_logp is None else rollout_logp.to(self.device),
                entropy=entropy,
            )
            step_loss += float(loss.detach())
            metrics.merge(micro_metrics)
            return loss

        self._run_micro_batches(batch, step.for_rank(self.dp_rank), loss_of, backward=True)
        self._finish_grads()
        return step_loss

    def _rows(
        self, values: PerSample | None, indices: tuple[int, ...], width: int
    ) -> torch.Tensor | None:
        """``[B, width]`` of per-sample log-probs, zero-padded, on the device; None passes."""
        if values is None:
            return None
        return pad_rows([values[i] for i in indices], width).to(self.device)

    def _optimizer_step(self, num_samples: int) -> StepResult:
        lr = self.lr_schedule(self.samples_consumed + num_samples)
        result = optimizer_step(
            self.optimizer,
            self.trained_params,
            self.grad_norm(),
            clip_grad=self.args.clip_grad,
            lr=lr,
        )
        self.samples_consumed += num_samples
        if result.skipped:
            self.skipped_steps += 1
            if self.rank == 0:
                print(f"vime: non-finite grad norm {result.grad_norm}; step skipped", flush=True)
        else:
            self.optimizer_steps += 1
        return result

    # ----- accelerator memory --------------------------------------------------------------

    def sleep(self, tags: Sequence[str] | None = None) -> None:
        """Free this rank's accelerator memory while the rollout engine has the GPU: the
        ``TRAIN_MEMORY_TAGS`` parts named in ``tags``, or all.

        ``train_state`` is what only training reads: gradients, main weights, optimizer
        state, gradient buffers; ``weights`` the weight shards the forward and the weight
        source read (parking ``train_state`` alone frees what a weight sync does not
        need). Their storages are emptied in place, so the optimizer and the model keep
        valid references; a gradient buffer, all zeros between steps, is freed without a
        host copy and comes back zeroed. Tensors already on the host (e.g.
        ``--fsdp-cpu-offload``) stay where they are, so on CPU nothing moves; the parts
        asleep are tracked on every device, and training refuses to run until
        ``wake_up``.
        """
        parts = [part for part in train_tags(tags) if part not in self._asleep]
        if not parts:
            return
        self._release_gathered()
        plans = self._park_plans()
        for part in parts:
            keep, scratch = plans[part]
            self._asleep[part] = HostStash(
                (t for t in keep if self._parks_on(t.device)),
                (t for t in scratch if self._parks_on(t.device)),
            )
        vime_device.empty_cache()

    # What sleep frees: accelerator memory (a test parks host tensors the same way).
    _parks_on = staticmethod(vime_device.is_cuda)

    def _park_plans(self) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per ``TRAIN_MEMORY_TAGS`` part, the tensors ``sleep`` copies to the host and the
        scratch ones it only frees, each the plain tensor that owns its storage (a
        DTensor's is not its own); a storage is in one part only."""

        def ptr(t: torch.Tensor) -> int:
            return t.untyped_storage().data_ptr()

        weights = [*self._local_tensors(), *self._weight_buffers()]
        taken = {ptr(t) for t in weights}
        scratch = [t for t in self._scratch_buffers() if ptr(t) not in taken]
        taken |= {ptr(t) for t in scratch}  # views of a scratch buffer are not copied
        state = [_storage(p) for p in self.trained_params]
        state += [_storage(p.grad) for p in self.trained_params if p.grad is not None]
        for values in self.optimizer.state.values():
            state += [_storage(v) for v in values.values() if isinstance(v, torch.Tensor)]
        state = [t for t in state if ptr(t) not in taken]
        return {"weights": (weights, []), "train_state": (state, scratch)}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Put back, bit for bit, the parts ``sleep`` parked that ``tags`` names (all for
        None)."""
        for part in train_tags(tags):
            stash = self._asleep.pop(part, None)
            if stash is not None:
                stash.restore()

    def _check_awake(self, *parts: str) -> None:
        asleep = sorted(set(parts or TRAIN_MEMORY_TAGS) & set(self._asleep))
        if asleep:
            raise RuntimeError(
                f"{type(self).__name__}: {' and '.join(asleep)} asleep; call wake_up() first"
            )

    # ----- weights out ---------------------------------------------------------------------

    def _hf_dtype(self) -> torch.dtype:
        """The dtype the HF checkpoint declares (what engines and exports receive)."""
        dtype = getattr(self.hf_config, "dtype", None) or torch.float32
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype

    def _export_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full weights ``export_hf`` writes (a collective): ``weight_buckets``, unless a
        backend holds some in less than the checkpoint's precision."""
        return self.weight_buckets(bucket_bytes)

    def export_hf(self, path: str, merged: bool = False) -> None:
        """Write the model at ``path`` as an HF folder (``merged``: always the full
        weights, even where a backend exports less, such as LoRA's adapter folder)."""
        buckets = self._export_buckets(self.args.update_weight_buffer_size)
        if self.rank != 0:
            for _ in buckets:  # take part in the gathers; rank 0 writes
                pass
            return
        tokenizer = None
        if self.args.hf_checkpoint:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(self.args.hf_checkpoint)
            except (OSError, ValueError):
                tokenizer = None  # a checkpoint without a tokenizer exports weights only
        save_hf_folder(path, buckets, config=self.hf_config, tokenizer=tokenizer)

    # ----- checkpoints ---------------------------------------------------------------------

    def _write_state(self, folder: Path) -> None:
        """Write this rank's share of ``_state`` into ``folder`` (a collective over every
        rank): ``torch.distributed.checkpoint`` unless a backend writes its own format."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(folder))

    def save(self, rollout_id: int, extra: dict[str, Any] | None = None) -> None:
        self._check_awake()
        save_dir = self.args.save
        partial = checkpoint.begin_save(save_dir, rollout_id, is_rank0=self.rank == 0)
        dist.barrier()
        # Every rank writes into the folder rank 0 just made: on a node-local disk the
        # other nodes' ranks would not see it (and their shards would be lost).
        views = self._gather("there" if os.path.isdir(partial) else "missing")
        checkpoint.check_shared("--save", save_dir, views, "partial checkpoint folders")
        self._write_state(partial)
        rng = {**checkpoint.rng_state(), **self._backend_rng_state()}
        torch.save(rng, os.path.join(partial, f"rng_rank{self.rank}.pt"))
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
                backend=self.backend_name,
                world_size=self.world,
                extra={"counters": counters, **self._checkpoint_extra(), **(extra or {})},
                keep_last=self.args.keep_last_checkpoints,
            )
        dist.barrier()

    @abc.abstractmethod
    def _load(self, load_dir: str) -> int:
        """Restore the newest checkpoint under ``load_dir``; return its rollout id."""

    def _open_checkpoint(self, load_dir: str) -> tuple[int, Any, dict[str, Any]]:
        """The newest checkpoint's rollout id, folder and verified metadata; restores the
        step counters. A checkpoint of another backend is refused (its layout differs)."""
        rollout_id = checkpoint.latest(load_dir)
        folder = checkpoint.iteration_dir(load_dir, rollout_id)
        meta = checkpoint.verify(folder)
        if meta.get("backend") != self.backend_name:
            raise checkpoint.CheckpointError(
                f"{folder} was saved by the {meta.get('backend')!r} backend; the "
                f"{self.backend_name} backend loads only its own checkpoints (start from an "
                "HF export instead: --save-hf, then --hf-checkpoint)"
            )
        counters = meta["extra"]["counters"]
        self.samples_consumed = counters["samples_consumed"]
        self.optimizer_steps = counters["optimizer_steps"]
        self.skipped_steps = counters["skipped_steps"]
        self.loaded_extra = meta["extra"]
        return rollout_id, folder, meta

    def _backend_rng_state(self) -> dict[str, Any]:
        """Random streams the backend keeps outside the process generators (saved beside
        them in ``rng_rank{r}.pt``, handed back to ``_set_backend_rng_state`` on load)."""
        return {}

    def _set_backend_rng_state(self, rng: dict[str, Any]) -> None:
        """Restore what ``_backend_rng_state`` saved."""

    def _restore_rng(self, folder: Any) -> None:
        rng = torch.load(os.path.join(folder, f"rng_rank{self.rank}.pt"), weights_only=False)
        checkpoint.set_rng_state(rng)
        self._set_backend_rng_state(rng)


def _storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the storage: a DTensor's local shard, else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
