"""``PolicyTrainActor``: one training rank, composed around a ``TrainBackend``.

Where it fits: the Ray train group makes one per rank (``policy_actor.make_actor``) and
the loop drives it through the ``TrainActor`` contract. It holds the rank's backend
(``vime.backends.interface``: the model, its optimizer and process groups) and keeps
everything that must be the same in every backend for their runs to be one run, once:
the LR schedule, the reference-model swap, the log-prob pass at training geometry,
the micro-batch loss (``vime.algo.objective.micro_batch_loss``), the optimizer-step
chokepoint with its counters, the metric reduction, ``sleep``/``wake_up`` (GPU memory
parked on the host through ``vime.device.HostStash``), the HF export and the
checkpoint commit. It is never subclassed: a backend is a ``TrainBackend``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, final

import torch
import torch.distributed as dist

from vime import checkpoint
from vime import device as vime_device
from vime.algo.metrics import MetricAccumulator
from vime.algo.objective import Normalizers, micro_batch_loss
from vime.backends.base import TRAIN_MEMORY_TAGS, TrainActor, TrainSettings, train_tags
from vime.backends.interface import SavedState, TrainBackend
from vime.backends.optim import StepResult, optimizer_step
from vime.backends.registry import backend_class
from vime.data.batch import TrainSchedule
from vime.device import HostStash
from vime.weights.hf_export import save_hf_folder

PerSample = dict[int, torch.Tensor]


@final
class PolicyTrainActor(TrainActor):
    """A training rank that optimizes ``vime.algo``'s loss on the planner's micro-batches,
    with ``backend`` computing them."""

    def __init__(self, backend: TrainBackend) -> None:
        self.backend = backend

    # The backend's place in the run, read where the actor needs it.
    rank = property(lambda self: self.backend.rank)
    world = property(lambda self: self.backend.world)
    device = property(lambda self: self.backend.device)
    dp_rank = property(lambda self: self.backend.dp_rank)
    optimizer = property(lambda self: self.backend.optimizer)
    trained_params = property(lambda self: self.backend.trained_params)

    # ----- set-up --------------------------------------------------------------------------

    def init(self, settings: TrainSettings) -> int:
        """Set up the backend, then the LR schedule, the loss and the counters; load
        ``--load``'s newest checkpoint if there is one."""
        self.settings = settings
        self.backend.setup(settings)
        self.lr_schedule = settings.lr_schedule
        self.loss_config = settings.loss
        self.samples_consumed = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self._asleep: dict[str, HostStash] = {}  # TRAIN_MEMORY_TAGS part -> its stash
        # The reference model is the initial weights, kept as host copies of this rank's shards
        # (unless the model computes as its reference by itself).
        copies = settings.loss.use_kl and self.backend.reference() is None
        self.ref_shards = self._host_copies() if copies else None
        return self._start_rollout()

    def _start_rollout(self) -> int:
        """The rollout id to start from: 0, or the one after ``--load``'s newest checkpoint.

        Every rank must find the same one (else some would load, a collective, while
        the others started afresh and waited elsewhere)."""
        load = self.settings.checkpoint.load
        if not load:
            return 0
        point = checkpoint.resume_point(load)
        views = self._gather(point)
        checkpoint.check_shared("--load", load, views, "newest checkpoints")
        return 0 if point is None else self._load(load) + 1

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
            for t in self.backend.local_tensors()
        ]

    def _exchange(self, held: list[torch.Tensor]) -> None:
        """Swap this rank's weights with ``held`` (host tensors of the same shapes), bit
        for bit: afterwards the weights hold what ``held`` held, and ``held`` the weights.

        One tensor at a time through a device copy, so a swap and its swap back cost no
        host memory beyond ``held`` itself and no allocation but one shard's device copy.
        """
        # A forward may have left gathered weights (FSDP2 without resharding after forward),
        # and the next forward would compute with those instead of the swapped-in values.
        self.backend.release_gathered()
        with torch.no_grad():
            for local, value in zip(self.backend.local_tensors(), held, strict=True):
                staged = local.detach().clone()
                local.copy_(value)
                value.copy_(staged)

    @contextmanager
    def _as_reference(self) -> Iterator[None]:
        """Inside the block the model computes as the KL reference: by itself where the
        backend can (LoRA), else the initial weights swapped in from their host copies,
        and swapped back out after."""
        own = self.backend.reference()
        if own is not None:
            with own:
                yield
            return
        if self.ref_shards is None:
            raise ValueError("no reference model: KL loss is off")
        self._exchange(self.ref_shards)  # the reference in; the actor parked in its place
        try:
            yield
        finally:
            self._exchange(self.ref_shards)

    @torch.no_grad()
    def compute_log_probs(
        self, schedule: TrainSchedule, which: str, *, on_host: bool = True
    ) -> PerSample:
        """This DP rank's response log-probs under ``which`` ("actor" or "ref"), per sample
        index, at the micro-batch geometry ``train`` uses; read back to the host, or left
        on the device (``on_host=False``, as ``train`` reads them: each sample's response
        length comes from the host batch, so then nothing is read back)."""
        if which not in ("actor", "ref"):
            raise ValueError(f"which must be 'actor' or 'ref', got {which!r}")
        self._check_awake("weights")  # a forward: gradients and optimizer state may sleep
        if which == "ref" and not self.settings.loss.use_kl:
            raise ValueError("no reference model: KL loss is off")
        batch = schedule.batch
        out: PerSample = {}

        def record(indices: tuple[int, ...], packed: Any, logp: torch.Tensor, _: Any) -> None:
            for row, i in enumerate(indices):
                out[i] = logp[row, : len(batch.tokens[i]) - batch.prompt_lengths[i]]

        with self._as_reference() if which == "ref" else nullcontext():
            for micro_batches in schedule.plan.for_rank(self.dp_rank):
                self.backend.forward_backward(batch, micro_batches, record, backward=False)
        if on_host:
            return {i: vime_device.to_host(logp) for i, logp in out.items()}
        return out

    # ----- train ---------------------------------------------------------------------------

    def train(self, schedule: TrainSchedule) -> dict[str, float]:
        """Every optimizer step of one rollout; metrics reduced over micro-batches and ranks."""
        self._check_awake()
        plan = schedule.plan
        use_kl = self.loss_config.use_kl
        ref = self.compute_log_probs(schedule, "ref", on_host=False) if use_kl else None
        # pi_old is the proximal policy (decoupled PPO): these weights, before the update.
        # One update per rollout: the update's own forward is on exactly them, whatever the
        # samples' age (--max-staleness), so no second pass (ratio == 1). Several: recomputed.
        old = (
            self.compute_log_probs(schedule, "actor", on_host=False) if plan.num_steps > 1 else None
        )
        metrics = MetricAccumulator()
        skipped = 0
        for step_index in range(plan.num_steps):
            step_loss = self.backward_step(schedule, step_index, metrics, ref=ref, old=old)
            result = self._optimizer_step(len(plan.steps[step_index].sample_indices))
            skipped += int(result.skipped)
            # The step loss is the sum of the DP replicas' shares (each counted once, not once
            # per TP rank); grad norm and lr are global, so each rank adds 1/world of them.
            share = 1.0 / self.world
            metrics.add("loss", step_loss / self.backend.loss_replicas, share)
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
    ) -> torch.Tensor:
        """Forward + backward every micro-batch of one optimizer step on this rank.

        Leaves the step's full gradient (summed over DP ranks) in ``.grad``; returns
        this rank's share of the step loss, a float64 scalar on the device (summed
        there, in float64 as Python floats would be, so nothing is read back).
        ``train`` follows it with the optimizer step; tests call it alone to compare
        gradients.
        """
        batch = schedule.batch
        step = schedule.plan.steps[step_index]
        norm = Normalizers(step.num_tokens, step.num_samples)
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        # A warm start's demonstrations have no behaviour policy to correct for.
        loss_config = (
            replace(self.loss_config, correction=None) if batch.demonstrations else self.loss_config
        )

        def loss_of(
            indices: tuple[int, ...], packed: Any, logp: torch.Tensor, entropy: Any
        ) -> torch.Tensor:
            nonlocal step_loss
            width = logp.shape[1]
            rollout_logp = batch.rollout_log_probs_of(indices, width)
            loss, micro_metrics = micro_batch_loss(
                logp,
                packed.loss_mask,
                vime_device.to_device(batch.advantages_of(indices), self.device),
                norm,
                loss_config,
                old_logp=self._rows(old, indices, width),
                ref_logp=self._rows(ref, indices, width),
                rollout_logp=None
                if rollout_logp is None
                else vime_device.to_device(rollout_logp, self.device),
                entropy=entropy,
            )
            step_loss = step_loss + loss.detach().to(torch.float64)
            metrics.merge(micro_metrics)
            return loss

        self.backend.forward_backward(batch, step.for_rank(self.dp_rank), loss_of, backward=True)
        self.backend.finish_grads()
        return step_loss

    def _rows(
        self, values: PerSample | None, indices: tuple[int, ...], width: int
    ) -> torch.Tensor | None:
        """``[B, width]`` of per-sample log-probs (on the device), zero-padded; None passes."""
        if values is None:
            return None
        rows = [values[i] for i in indices]
        if not rows:
            return torch.zeros(0, width, dtype=torch.float32, device=self.device)
        padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        return torch.nn.functional.pad(padded, (0, width - padded.shape[1]))

    def _optimizer_step(self, num_samples: int) -> StepResult:
        lr = self.lr_schedule(self.samples_consumed + num_samples)
        result = optimizer_step(
            self.optimizer,
            self.trained_params,
            self.backend.grad_norm(),
            clip_grad=self.settings.clip_grad,
            lr=lr,
        )
        self.samples_consumed += num_samples
        if result.skipped:
            self.skipped_steps += 1
            if self.rank == 0:
                print(f"vime: non-finite grad norm {result.grad_norm}; step skipped", flush=True)
        else:
            self.optimizer_steps += 1
        self.backend.after_step(result.skipped)
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
        self.backend.release_gathered()
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

        own_weights, own_scratch = self.backend.sleep_buffers()
        weights = [*self.backend.local_tensors(), *own_weights]
        taken = {ptr(t) for t in weights}
        scratch = [t for t in own_scratch if ptr(t) not in taken]
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

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named weights in the checkpoint's dtype, one bucket materialized at a time.

        A collective: every rank must iterate it to the end.
        """
        self._check_awake("weights")
        return self.backend.weight_buckets(bucket_bytes)

    def sync_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """What a weight sync sends: the full weights, or less where the backend sends less
        (LoRA: the adapters, after the base once)."""
        self._check_awake("weights")
        return self.backend.weight_buckets(bucket_bytes, "sync")

    def export_hf(self, path: str, merged: bool = False) -> None:
        """Write the model at ``path`` as an HF folder (``merged``: always the full
        weights, even where a backend exports less, such as LoRA's adapter folder)."""
        if not merged and self.backend.export_adapters(path):
            return
        self._check_awake("weights")
        export = self.settings.export
        buckets = self.backend.weight_buckets(export.bucket_bytes, "export")
        if self.rank != 0:
            for _ in buckets:  # take part in the gathers; rank 0 writes
                pass
            return
        tokenizer = None
        if export.tokenizer:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(export.tokenizer)
            except (OSError, ValueError):
                tokenizer = None  # a checkpoint without a tokenizer exports weights only
        save_hf_folder(path, buckets, config=self.backend.hf_config, tokenizer=tokenizer)

    # ----- checkpoints ---------------------------------------------------------------------

    def save(self, rollout_id: int, extra: dict[str, Any] | None = None) -> None:
        self._check_awake()
        save_dir = self.settings.checkpoint.save
        partial = checkpoint.begin_save(save_dir, rollout_id, is_rank0=self.rank == 0)
        dist.barrier()
        # Every rank writes into the folder rank 0 just made: on a node-local disk the
        # other nodes' ranks would not see it (and their shards would be lost).
        views = self._gather("there" if os.path.isdir(partial) else "missing")
        checkpoint.check_shared("--save", save_dir, views, "partial checkpoint folders")
        self.backend.save_state(Path(partial), with_optimizer=self.optimizer_steps > 0)
        rng = {**checkpoint.rng_state(), **self.backend.rng_state()}
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
                backend=self.backend.name,
                world_size=self.world,
                extra={"counters": counters, **self.backend.checkpoint_extra(), **(extra or {})},
                keep_last=self.settings.checkpoint.keep_last,
            )
        dist.barrier()

    def _load(self, load_dir: str) -> int:
        """Restore the newest checkpoint under ``load_dir``; return its rollout id."""
        rollout_id, folder, meta = self._open_checkpoint(load_dir)
        saved = SavedState(Path(folder), rollout_id, meta, with_optimizer=self.optimizer_steps > 0)
        if self.backend.load_state(saved):
            rng = torch.load(os.path.join(folder, f"rng_rank{self.rank}.pt"), weights_only=False)
            checkpoint.set_rng_state(rng)
            self.backend.set_rng_state(rng)
        return rollout_id

    def _open_checkpoint(self, load_dir: str) -> tuple[int, Any, dict[str, Any]]:
        """The newest checkpoint's rollout id, folder and verified metadata; restores the
        step counters. A checkpoint of another backend is refused (its layout differs)."""
        rollout_id = checkpoint.latest(load_dir)
        folder = checkpoint.iteration_dir(load_dir, rollout_id)
        meta = checkpoint.verify(folder)
        name = self.backend.name
        if meta.get("backend") != name:
            raise checkpoint.CheckpointError(
                f"{folder} was saved by the {meta.get('backend')!r} backend; the "
                f"{name} backend loads only its own checkpoints (start from an "
                "HF export instead: --save-hf, then --hf-checkpoint)"
            )
        counters = meta["extra"]["counters"]
        self.samples_consumed = counters["samples_consumed"]
        self.optimizer_steps = counters["optimizer_steps"]
        self.skipped_steps = counters["skipped_steps"]
        self.loaded_extra = meta["extra"]
        return rollout_id, folder, meta


def _storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the storage: a DTensor's local shard, else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def make_actor(name: str) -> PolicyTrainActor:
    """A training rank of backend ``name`` (``vime.backends.registry``), not yet
    initialized (imports the backend)."""
    return PolicyTrainActor(backend_class(name)())
