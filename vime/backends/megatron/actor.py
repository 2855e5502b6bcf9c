"""``MegatronActor``: one training rank of the ``megatron`` backend.

Where it fits: the registry names this class for ``--train-backend megatron``;
the loop drives it through the ``TrainActor`` contract exactly as it drives
``FSDP2Actor``. The model is megatron-core's ``GPTModel`` (``model.py``) loaded
from the HF checkpoint through ``convert.py``; everything else is shared with the
fsdp2 backend: the planner's micro-batches (``vime.data``), the loss
(``vime.algo.objective.micro_batch_loss``), the optimizer chokepoint and LR
schedule (``vime.backends.optim``), the checkpoint layout (``vime.checkpoint``)
and the weight source (``vime.weights.buckets``).

Parallelism: tensor parallel (TP) inside megatron-core's layers; data parallel
(DP) here, by summing each step's gradients over the DP group (the planner's
global normalizers make that sum the full-batch gradient). Pipeline parallel is
not built yet and is rejected at start-up.

Optimizer: torch ``AdamW`` over the local (TP-sharded) parameters with the same
decay groups as fsdp2 (megatron-core's optimizer needs CUDA). AdamW is
elementwise, so sharded AdamW is the same update as unsharded AdamW.

Checkpoints: ``torch.distributed.checkpoint`` of the weights and AdamW moments
gathered to HF names and layout (the TP shards are converted back exactly, the
vocab padding dropped), so a checkpoint does not depend on the TP size it was
saved with and is re-split on load.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from vime import checkpoint
from vime import device as vime_device
from vime.algo import load_function, policy_loss
from vime.algo.metrics import MetricAccumulator
from vime.algo.objective import LossConfig, Normalizers, micro_batch_loss
from vime.backends.base import TrainActor
from vime.backends.megatron import convert
from vime.backends.megatron import model as mmodel
from vime.backends.megatron.shims import apply_cpu_shims
from vime.backends.optim import LRSchedule, optimizer_step, param_groups
from vime.data.batch import TrainSchedule, pad_rows
from vime.data.micro_batch import response_log_probs
from vime.weights.buckets import WeightEntry, iter_buckets, tensor_nbytes
from vime.weights.hf_export import save_hf_folder

PerSample = dict[int, torch.Tensor]
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def read_hf_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of an HF folder."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def _check_flags(args: Any) -> None:
    """Reject the megatron flags this backend accepts but does not run yet."""
    if args.megatron_pipeline_parallel_size != 1:
        raise ValueError(
            "megatron backend: --megatron-pipeline-parallel-size > 1 is not supported yet "
            "(use tensor and data parallelism)"
        )
    if args.megatron_sequence_parallel:
        raise ValueError("megatron backend: --megatron-sequence-parallel is not supported yet")
    if args.megatron_use_distributed_optimizer:
        raise ValueError(
            "megatron backend: --megatron-use-distributed-optimizer is not supported yet "
            "(torch AdamW keeps the optimizer state of this rank's TP shard)"
        )
    if args.megatron_recompute_granularity != "none":
        raise ValueError("megatron backend: --megatron-recompute-granularity is not supported yet")


class MegatronActor(TrainActor):
    """megatron-core ``GPTModel``, tensor parallel inside, data parallel by gradient sum."""

    def init(self, args: Any) -> int:
        self.args = args
        if args.hf_checkpoint is None:
            raise ValueError("the megatron backend needs --hf-checkpoint DIR")
        _check_flags(args)
        from transformers import AutoConfig

        apply_cpu_shims()
        self.tp = int(args.megatron_tensor_parallel_size)
        mmodel.init_model_parallel(tp=self.tp, pp=1, seed=args.seed)
        from megatron.core import parallel_state as ps

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = vime_device.local_device()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self._dp_rank = ps.get_data_parallel_rank()
        self.hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
        tcfg, _ = convert.transformer_config_from_hf(
            self.hf_config, tp=self.tp, params_dtype=torch.float32
        )
        self.model = mmodel.build_gpt_model(self.hf_config, tcfg)
        # Every rank reads the checkpoint and keeps its TP shard (fine on the host).
        hf_state = read_hf_state(args.hf_checkpoint)
        mmodel.load_megatron_state(
            self.model, convert.hf_to_megatron(hf_state, self.hf_config, self.tp_rank, self.tp)
        )
        del hf_state
        self.model.train()
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.maps = {pm.megatron: pm for pm in convert.param_map(self.hf_config)}
        missing = [n for n, _ in self.named_params if n not in self.maps]
        if missing:
            raise ValueError(f"megatron parameters without an HF counterpart: {missing[:8]}")
        # Replicated parameters whose gradient each TP rank only partly computes: the QK
        # norms act on this rank's heads only (megatron-core's finalize_model_grads sums
        # them over the TP group too).
        self.tp_partial = [
            p
            for n, p in self.named_params
            if self.tp > 1 and ("q_layernorm" in n or "k_layernorm" in n)
        ]
        self.optimizer = torch.optim.AdamW(
            param_groups(self.named_params, args.weight_decay),
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
        # The reference model is the initial weights, kept as host copies of this rank's shards.
        self.ref_shards = self._local_copies() if args.use_kl_loss else None
        if args.load and checkpoint.latest(args.load) is not None:
            return self._load(args.load) + 1
        return 0

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    # ----- forward -------------------------------------------------------------------------

    def _local_copies(self) -> list[torch.Tensor]:
        return [p.detach().to("cpu", copy=True) for p in self.params]

    def _swap_in(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for param, value in zip(self.params, tensors, strict=True):
                param.copy_(value)

    def _forward(self, batch: Any, indices: tuple[int, ...]) -> tuple[Any, torch.Tensor, Any]:
        packed = batch.pack(indices).to(self.device)
        logits = mmodel.packed_logits(self.model, packed)
        logp, entropy = response_log_probs(
            logits.float(), packed, temperature=self.args.rollout_temperature, with_entropy=True
        )
        return packed, logp, entropy

    @torch.no_grad()
    def compute_log_probs(self, schedule: TrainSchedule, which: str) -> PerSample:
        """This DP rank's response log-probs under ``which`` ("actor" or "ref"), per sample
        index, at the micro-batch geometry ``train`` uses (every TP rank returns the same)."""
        if which not in ("actor", "ref"):
            raise ValueError(f"which must be 'actor' or 'ref', got {which!r}")
        if which == "ref":
            if self.ref_shards is None:
                raise ValueError("no reference model: KL loss is off")
            actor_copies = self._local_copies()
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
                self._swap_in(actor_copies)
        return out

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
            # Every TP rank of a DP group computed the same loss share: count it once.
            # Grad norm and lr are global, so each rank contributes 1/world of them.
            share = 1.0 / self.world
            metrics.add("loss", step_loss / self.tp, share)
            metrics.add("grad_norm", share * (0.0 if result.skipped else result.grad_norm), share)
            metrics.add("lr", share * result.lr, share)
        names, packed_metrics = metrics.to_tensor()
        # Per-micro-batch metrics are (sum, weight) pairs: the TP copies cancel in the mean.
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

        Leaves the step's full gradient (summed over DP ranks) in ``.grad``; returns
        this DP rank's share of the step loss.
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
        self._reduce_grads()
        return step_loss

    def _reduce_grads(self) -> None:
        for param in self.params:
            if param.grad is None:  # e.g. a rank whose share was empty: still take part
                param.grad = torch.zeros_like(param)
        for param in self.tp_partial:
            dist.all_reduce(param.grad, group=self.tp_group)
        if self.dp_size > 1:
            for param in self.params:
                dist.all_reduce(param.grad, group=self.dp_group)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients: TP shards summed, TP-replicated params once."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for param in self.params:
            if param.grad is None:
                continue
            if getattr(param, "tensor_model_parallel", False) or self.tp_rank == 0:
                total += param.grad.detach().double().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(total, group=self.tp_group)
        return total.sqrt().float()

    def _optimizer_step(self, num_samples: int) -> Any:
        norm = self.grad_norm()
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

    def _gather_hf(self, name: str, local: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of megatron parameter ``name`` from every TP rank's ``local`` shard.

        A collective over the TP group when TP > 1.
        """
        local = local.detach().contiguous()
        if self.tp > 1:
            shards = [torch.empty_like(local) for _ in range(self.tp)]
            dist.all_gather(shards, local, group=self.tp_group)
        else:
            shards = [local]
        return convert.gather_hf(self.maps[name], shards, self.hf_config)

    def _hf_entries(
        self, dtype: torch.dtype, tensor_of: Callable[[str, torch.Tensor], torch.Tensor]
    ) -> Iterator[WeightEntry]:
        """One lazy entry per HF tensor; the entries of one megatron parameter share a gather."""
        for name, param in self.named_params:
            local = tensor_of(name, param)
            # Shapes from a gather of meta tensors: sizes are known before any communication.
            meta = [torch.empty(local.shape, dtype=dtype, device="meta")] * self.tp
            shapes = convert.gather_hf(self.maps[name], meta, self.hf_config)
            cache: dict[str, torch.Tensor] = {}

            def materialize(
                hf_name: str, name: str = name, local: torch.Tensor = local, cache: dict = cache
            ) -> torch.Tensor:
                if not cache:
                    cache.update(self._gather_hf(name, local))
                return cache.pop(hf_name).to(dtype)

            for hf_name, shape_of in shapes:
                yield WeightEntry(
                    hf_name,
                    tensor_nbytes(shape_of.shape, dtype),
                    lambda h=hf_name, m=materialize: m(h),
                )

    def _hf_dtype(self) -> torch.dtype:
        dtype = getattr(self.hf_config, "dtype", None) or torch.float32
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named weights in the checkpoint's dtype, one bucket materialized at a time.

        A collective over the TP group: every rank must iterate it to the end.
        """
        return iter_buckets(self._hf_entries(self._hf_dtype(), lambda _n, p: p), bucket_bytes)

    def export_hf(self, path: str) -> None:
        buckets = self.weight_buckets(self.args.update_weight_buffer_size)
        if self.rank != 0:
            for _ in buckets:  # take part in the TP gathers; rank 0 writes
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

    def _full(self, tensor_of: Callable[[str, torch.Tensor], torch.Tensor]) -> dict:
        return {
            hf_name: tensor
            for name, param in self.named_params
            for hf_name, tensor in self._gather_hf(name, tensor_of(name, param))
        }

    def _state(self) -> dict[str, Any]:
        """Weights and AdamW moments in HF names and layout (full tensors, TP-independent)."""
        state: dict[str, Any] = {"model": self._full(lambda _n, p: p)}
        # A never-stepped AdamW has no state to save.
        if self.optimizer_steps > 0:
            for moment in ADAM_MOMENTS:
                state[moment] = self._full(lambda _n, p, m=moment: self.optimizer.state[p][m])
            state["adam_step"] = self.optimizer.state[self.params[0]]["step"].clone()
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
                backend="megatron",
                world_size=self.world,
                extra={"counters": counters, "tp": self.tp, **(extra or {})},
                keep_last=self.args.keep_last_checkpoints,
            )
        dist.barrier()

    def _load(self, load_dir: str) -> int:
        """Restore the newest checkpoint under ``load_dir``; return its rollout id."""
        rollout_id = checkpoint.latest(load_dir)
        folder = checkpoint.iteration_dir(load_dir, rollout_id)
        meta = checkpoint.verify(folder)
        if meta.get("backend") != "megatron":
            raise checkpoint.CheckpointError(
                f"{folder} was saved by the {meta.get('backend')!r} backend; the megatron "
                "backend loads only its own checkpoints (start from an HF export instead)"
            )
        counters = meta["extra"]["counters"]
        self.samples_consumed = counters["samples_consumed"]
        self.optimizer_steps = counters["optimizer_steps"]
        self.skipped_steps = counters["skipped_steps"]
        if self.optimizer_steps > 0:  # templates for the moments (any values, right shapes)
            for p in self.params:
                self.optimizer.state[p] = {m: torch.zeros_like(p) for m in ADAM_MOMENTS}
                self.optimizer.state[p]["step"] = torch.zeros((), dtype=torch.float32)
        state = self._state()
        dcp.load(state, checkpoint_id=str(folder))

        def shard(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return convert.hf_to_megatron(full, self.hf_config, self.tp_rank, self.tp)

        mmodel.load_megatron_state(self.model, shard(state["model"]))
        if self.optimizer_steps > 0:
            moments = {m: shard(state[m]) for m in ADAM_MOMENTS}
            for name, p in self.named_params:
                self.optimizer.state[p] = {
                    "step": state["adam_step"].clone(),
                    **{m: moments[m][name].clone() for m in ADAM_MOMENTS},
                }
        if int(meta["world_size"]) == self.world and meta["extra"].get("tp") == self.tp:
            rng = torch.load(os.path.join(folder, f"rng_rank{self.rank}.pt"), weights_only=False)
            checkpoint.set_rng_state(rng)
        elif self.rank == 0:
            print(
                f"vime: {folder} was saved with another layout; weights and optimizer re-split, "
                "RNG streams left as seeded",
                flush=True,
            )
        self.loaded_extra = meta["extra"]
        return rollout_id


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _gather(
    values: PerSample | None, indices: tuple[int, ...], width: int, device: torch.device
) -> torch.Tensor | None:
    """``[B, width]`` of this rank's per-sample log-probs, zero-padded; None passes through."""
    return None if values is None else pad_rows([values[i] for i in indices], width).to(device)
