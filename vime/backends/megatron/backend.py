"""``MegatronBackend``: one training rank's model under the ``megatron`` backend.

Where it fits: the registry names this class for ``--train-backend megatron``; a
``PolicyTrainActor`` holds it through the ``TrainBackend`` interface exactly as it
holds ``FSDP2Backend``. The model is megatron-core's ``GPTModel`` (``model.py``), each
rank's stage loaded from the HF checkpoint through ``convert.py`` (``stage_model.py``);
everything else is shared with the fsdp2 backend: the planner's micro-batches
(``vime.data``), the loss (``vime.algo.objective.micro_batch_loss``), the optimizer
chokepoint and LR schedule (``vime.backends.optim``), the checkpoint layout
(``vime.checkpoint``) and the weight source (``vime.weights.buckets``).

Parallelism: tensor parallel (TP) inside megatron-core's layers; data parallel
(DP) here, by summing each step's gradients over the DP group (the planner's
global normalizers make that sum the full-batch gradient), or in megatron-core's
DDP wrapper with the distributed optimizer. Sequence parallel
(``--megatron-sequence-parallel``) is megatron-core's, with rows padded to a
multiple of TP and the norms' partial gradients summed over TP here; activation
recompute is megatron-core's too (``model.recompute_fields``). Pipeline parallel (PP)
splits the layers into stages (``pipeline.py``) and runs each step's micro-batches
through megatron-core's 1F1B schedule; only the last stage computes the loss, and
its log-probs are broadcast to the other stages.

Optimizer: torch ``AdamW`` over the local (TP-sharded) parameters, decay groups as
fsdp2's (elementwise: the unsharded update). ``--megatron-use-distributed-optimizer``
switches to megatron-core's own DDP wrapper and ``DistributedOptimizer``
(``distrib_optim.py``): fp32 gradient buffers reduce-scattered over DP, fp32 main
weights and moments sharded over DP, updated weights all-gathered -- on the CPU too.

Precision: ``--megatron-param-dtype bfloat16`` (the default on GPU) builds the model
in bf16 and gives the optimizer fp32 main weights that also hold the gradients
(``main_params.py``, or megatron-core's own with the distributed optimizer); each
step re-rounds the bf16 weights from them. fp32 (the CPU default) trains the model's
own weights.

Checkpoints (megatron-core's ``dist_checkpointing``, ``checkpoint.py``) and the layer
implementations (local or TransformerEngine, ``model.py``): ``docs/architecture.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vime import device as vime_device
from vime.backends import compile as decoder_compile
from vime.backends.base import TrainSettings
from vime.backends.collectives import all_reduce_sum
from vime.backends.interface import (
    MicroBatchFn,
    SavedState,
    TrainBackend,
    WeightPurpose,
    hf_dtype,
    run_in_order,
)
from vime.backends.lm_head import row_log_probs
from vime.backends.lm_head_choice import fused_tail
from vime.backends.megatron import checkpoint as mcheckpoint
from vime.backends.megatron import convert, packed_rows, pipeline
from vime.backends.megatron import model as mmodel
from vime.backends.megatron.distrib_optim import DistributedOptimizer
from vime.backends.megatron.main_params import MainParams
from vime.backends.megatron.shims import apply_cpu_shims
from vime.backends.megatron.stage_model import load_stage_model
from vime.backends.megatron.vocab_parallel import VocabShard
from vime.backends.optim import adamw
from vime.data.micro_batch import full_vocab_token_stats, response_log_probs
from vime.weights.buckets import WeightEntry, iter_buckets, tensor_nbytes


class MegatronBackend(TrainBackend):
    """megatron-core ``GPTModel``: tensor and pipeline parallel inside, data parallel by
    gradient sum."""

    name = "megatron"

    def setup(self, settings: TrainSettings) -> None:
        self.settings = settings
        own = settings.backend  # vime.backends.megatron.flags.MegatronSettings
        if settings.hf_checkpoint is None:
            raise ValueError("the megatron backend needs --hf-checkpoint DIR")
        from transformers import AutoConfig

        apply_cpu_shims()
        self.tp = int(own.tp)
        self.pp = int(own.pp)
        self.loss_replicas = self.tp  # every TP rank of a replica computes the same loss
        # Sequence parallel splits each row's tokens over the TP ranks.
        self.row_multiple = self.tp if own.sequence_parallel else 1
        self.distributed = bool(own.distributed_optimizer)
        self.transformer_impl = own.transformer_impl
        # The local layers' attention reads rows whose samples share their prompt (computed
        # once); TransformerEngine's reads cu_seqlens alone, so its rows stay unshared.
        self.shares_prompts = self.transformer_impl == "local"
        self.fused_norms = mmodel.fuses_norms(self.transformer_impl)
        self.hf_config = AutoConfig.from_pretrained(settings.hf_checkpoint)
        if self.tp > 1:
            # megatron-core's tensor- and sequence-parallel linears issue their async
            # collectives just before the matmuls they should overlap; with one hardware
            # queue the GPU keeps that order. CUDA reads it when the context is made, so
            # it is set before anything here touches the device.
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        self._init_parallel()
        self.param_dtype = vime_device.resolve_dtype(own.param_dtype, self.device)
        self.model, self.hf_shapes = load_stage_model(
            settings,
            self.hf_config,
            self.stage,
            tp_rank=self.tp_rank,
            param_dtype=self.param_dtype,
            device=self.device,
        )
        if settings.compile_decoder:
            decoder_compile.compile_decoder(self.model)
        # Under TP each rank holds a vocabulary shard, which vocab_parallel reduces whole.
        self._fused_head = fused_tail(settings.lm_head_tail, self.device.type, self.tp == 1)
        vocab = int(self.hf_config.vocab_size)
        width = convert.padded_vocab_size(vocab, self.tp) // self.tp
        self.vocab_shard = VocabShard.of_this_rank(width, vocab)
        self._index_params()
        if self.distributed:
            self.optimizer = DistributedOptimizer(
                self.model,
                settings.adamw,
                min_lr=settings.lr_schedule.min_lr,
                clip_grad=settings.clip_grad,
                params_dtype=self.param_dtype,
            )
        else:
            self.optimizer = adamw(self.optimized, settings.adamw)

    def _init_parallel(self) -> None:
        """The process groups, this rank's place in them and its pipeline stage."""
        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        num_layers = int(self.hf_config.num_hidden_layers)
        split = {
            "first_stage_layers": self.settings.backend.first_stage_layers,
            "last_stage_layers": self.settings.backend.last_stage_layers,
        }
        pipeline.Stage(0, self.pp, num_layers, tied, **split)  # fail before any group is made
        mmodel.init_model_parallel(tp=self.tp, pp=self.pp, seed=self.settings.seed)
        from megatron.core import parallel_state as ps

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = vime_device.local_device()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_ranks = dist.get_process_group_ranks(self.dp_group)
        self._dp_rank = ps.get_data_parallel_rank()
        pp_rank = ps.get_pipeline_model_parallel_rank()
        self.stage = pipeline.Stage(pp_rank, self.pp, num_layers, tied, **split)
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        # The group whose ranks hold different parts of one replica's gradient.
        self.mp_group = ps.get_model_parallel_group() if self.pp > 1 else self.tp_group
        # Tied embeddings over several stages: the first stage's embedding and the last
        # stage's copy sum their gradients over this group.
        # (Middle stages hold neither and are not in it.)
        in_group = tied and self.pp > 1 and ps.is_rank_in_embedding_group()
        self.embedding_group = ps.get_embedding_group() if in_group else None

    def _index_params(self) -> None:
        """The trainable parameters, their HF maps, and the ones whose gradient needs more
        than the DP sum."""
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.global_maps = convert.param_map(self.hf_config, fused_norms=self.fused_norms)
        by_name = {pm.megatron: pm for pm in self.global_maps}
        missing = [n for n, _ in self.named_params if self.stage.global_name(n) not in by_name]
        if missing:
            raise ValueError(f"megatron parameters without an HF counterpart: {missing[:8]}")
        self.maps = {n: by_name[self.stage.global_name(n)] for n, _ in self.named_params}
        # bf16 weights: the gradients and the optimizer live on fp32 main copies (the
        # distributed optimizer keeps its own).
        half = self.param_dtype != torch.float32
        self.main = MainParams(self.params) if half and not self.distributed else None
        self.train_params = self.main.params if self.main else list(self.params)
        # What torch AdamW updates and checkpoints: (name, weight or its fp32 main copy).
        names = [n for n, _ in self.named_params]
        self.optimized = list(zip(names, self.train_params, strict=True))
        train = dict(self.optimized)
        self.embedding_pair = [
            train[n]
            for n, _ in self.named_params
            if self.embedding_group is not None
            and (n == pipeline.EMBEDDING or self.stage.is_tied_copy(n))
        ]
        # What the grad norm counts (each gradient once over the TP ranks and stages).
        self.norm_params = [
            train[n]
            for n, p in self.named_params
            if not self.stage.is_tied_copy(n)
            and (getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0)
        ]
        # Replicated parameters whose gradient each TP rank only partly computes: the QK
        # norms act on this rank's heads only, and under sequence parallel every norm sees
        # this rank's slice of the sequence only (megatron-core's finalize_model_grads sums
        # both over the TP group too).
        self.tp_partial = [
            train[n]
            for n, p in self.named_params
            if self.tp > 1
            and ("q_layernorm" in n or "k_layernorm" in n or getattr(p, "sequence_parallel", False))
        ]

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def trained_params(self) -> list[torch.Tensor]:
        return self.optimizer.main_params if self.distributed else self.train_params

    def sleep_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not self.distributed:
            return [], []
        # The gradient buffers are emptied after every step, taken or skipped (after_step).
        return self.optimizer.param_buffers(), self.optimizer.grad_buffers()

    # ----- forward and backward ------------------------------------------------------------

    def _loss_logits(self, output: torch.Tensor) -> torch.Tensor:
        """The last stage's logits as the loss reads them: the HF vocabulary without
        tensor parallelism, else this rank's vocabulary shard, never gathered (the
        reductions over the vocabulary run across the ranks: ``vocab_parallel``)."""
        return output if self.tp > 1 else output[..., : self.model.hf_vocab_size]

    def _token_stats(self) -> Any:
        """The reductions over the vocabulary: across the TP ranks' shards with TP."""
        return self.vocab_shard.token_stats if self.tp > 1 else full_vocab_token_stats

    def _pack(self, batch: Any, indices: tuple[int, ...]) -> Any:
        """The packed row on the device (``packed_rows.device_row``): under the local
        layers each shared prompt once, its attention layout attached."""
        host = batch.pack(
            indices, pad_to_multiple_of=self.row_multiple, share_prompts=self.shares_prompts
        )
        return packed_rows.device_row(host, self.device, self.shares_prompts)

    def forward_backward(
        self,
        batch: Any,
        micro_batches: Sequence[tuple[int, ...]],
        consume: MicroBatchFn,
        *,
        backward: bool,
    ) -> None:
        """Without pipelining, one micro-batch after another; with it, megatron-core's
        1F1B schedule (``_run_pipelined``)."""
        if self.pp > 1:
            self._run_pipelined(batch, micro_batches, consume, backward=backward)
            return
        run_in_order(
            micro_batches,
            consume,
            backward=backward,
            pack=lambda indices: self._pack(batch, indices),
            logits=lambda packed: self._loss_logits(mmodel.stage_forward(self.model, packed)),
            temperature=self.settings.temperature,
            token_stats=self._token_stats(),
            before_backward=self._before_backward,
            log_probs=self._head_log_probs if self._fused_head else None,
        )

    def _head_log_probs(self, packed: Any, with_entropy: bool) -> tuple[Any, Any]:
        """Without TP: only the loss positions' final hidden states ``[L, 1, h]`` reach the
        output layer (``vime.backends.lm_head``). Under TP each rank holds a vocabulary
        shard, and ``vocab_parallel`` reduces whole shard logits instead."""
        return row_log_probs(
            lambda: mmodel.stage_forward(self.model, packed),
            self.model.output_layer,
            packed,
            temperature=self.settings.temperature,
            with_entropy=with_entropy,
            seq_dim=0,
            vocab=self.model.hf_vocab_size,
        )

    def _run_pipelined(
        self,
        batch: Any,
        micro_batches: Sequence[tuple[int, ...]],
        consume: MicroBatchFn,
        *,
        backward: bool,
    ) -> None:
        """megatron-core's 1F1B schedule, ``consume`` running on the last stage only; a
        forward-only pass then sends the log-probs to the other stages of the replica,
        which ``consume`` them too."""
        items = [(indices, self._pack(batch, indices)) for indices in micro_batches]
        computed: list[torch.Tensor] = []

        def last_stage_loss(item: tuple, output: torch.Tensor) -> torch.Tensor:
            indices, packed = item
            logp, entropy = response_log_probs(
                self._loss_logits(output),
                packed,
                temperature=self.settings.temperature,
                with_entropy=backward,
                token_stats=self._token_stats(),
            )
            computed.append(logp.detach().cpu())
            loss = consume(indices, packed, logp, entropy)
            return logp.new_zeros(()) if loss is None else loss

        pipeline.run_schedule(
            self.model,
            items,
            lambda item: mmodel.stage_forward(self.model, item[1]),
            last_stage_loss,
            forward_only=not backward,
        )
        if backward:
            return
        box = [computed]
        dist.broadcast_object_list(box, src=self.pp_ranks[-1], group=self.pp_group)
        if not self.stage.is_last:
            for (indices, packed), logp in zip(items, box[0], strict=True):
                consume(indices, packed, logp, None)

    def local_tensors(self) -> list[torch.Tensor]:
        return self.params

    def _before_backward(self, last: bool) -> None:
        if self.distributed:
            self.optimizer.prepare_backward(last)

    def finish_grads(self) -> None:
        """Sum the step's gradient over the DP group, the partial QK-norm grads over TP,
        and tied embeddings' two halves over the first and last pipeline stages."""
        if self.distributed:
            self.optimizer.finish_grads()  # megatron-core's own finalize_model_grads
            return
        for param in self.train_params:
            if param.grad is None:  # e.g. a rank whose share was empty: still take part
                param.grad = torch.zeros_like(param)
        all_reduce_sum([p.grad for p in self.tp_partial], self.tp_group)
        all_reduce_sum([p.grad for p in self.embedding_pair], self.embedding_group)
        if self.dp_size > 1:
            all_reduce_sum([p.grad for p in self.train_params], self.dp_group)

    def after_step(self, skipped: bool) -> None:
        """bf16 weights re-rounded from their main copies, or the distributed optimizer's
        gradient buffers emptied (it has already gathered the updated weights into the
        model)."""
        if self.distributed:
            self.optimizer.zero_grad()
        elif self.main is not None and not skipped:
            self.main.to_model()

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients: TP shards and pipeline stages summed, TP-replicated
        params and the last stage's copy of tied embeddings counted once."""
        if self.distributed:
            return self.optimizer.grad_norm()
        grads = [p.grad for p in self.norm_params if p.grad is not None]
        # Each tensor's norm in float64 in one multi-tensor op (a loop launches four kernels
        # a parameter), squared back into the sum of squares.
        grads = grads or [torch.zeros(1, device=self.device)]  # none here: still a 0 to reduce
        norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
        total = torch.stack(norms).square().sum()
        if self.tp * self.pp > 1:
            dist.all_reduce(total, group=self.mp_group)
        return total.sqrt().float()

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
        """One lazy entry per HF tensor of the whole model, in ``convert.param_map`` order.

        The entries of one megatron parameter share a TP gather; with pipelining, each
        tensor is then broadcast from the stage that holds it to the other stages of the
        replica, so every rank yields every tensor. ``tensor_of(name, param)`` picks what
        is gathered: the weights for the weight source, or any tensor sharded like them
        (the tests gather AdamW moments so).
        """
        local_of = {
            self.stage.global_name(n): (n, p)
            for n, p in self.named_params
            if not self.stage.is_tied_copy(n)
        }
        for pm in self.global_maps:
            owner = self.stage.owner(pm.megatron)
            cache: dict[str, torch.Tensor] = {}

            def materialize(
                hf_name: str, pm: Any = pm, owner: int = owner, cache: dict = cache
            ) -> torch.Tensor:
                if owner == self.stage.rank:
                    if not cache:
                        name, param = local_of[pm.megatron]
                        cache.update(self._gather_hf(name, tensor_of(name, param)))
                    tensor = cache.pop(hf_name).to(dtype)
                else:
                    tensor = torch.empty(self.hf_shapes[hf_name], dtype=dtype, device=self.device)
                if self.pp > 1:
                    tensor = tensor.contiguous()
                    dist.broadcast(tensor, src=self.pp_ranks[owner], group=self.pp_group)
                return tensor

            for hf_name in pm.hf:
                yield WeightEntry(
                    hf_name,
                    tensor_nbytes(self.hf_shapes[hf_name], dtype),
                    lambda h=hf_name, m=materialize: m(h),
                )

    def weight_buckets(
        self, bucket_bytes: int, purpose: WeightPurpose = "full"
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named weights in the checkpoint's dtype, one bucket materialized at a time
        (for every ``purpose``).

        A collective over the TP group: every rank must iterate it to the end.
        """
        dtype = hf_dtype(self.hf_config)
        return iter_buckets(self._hf_entries(dtype, lambda _n, p: p), bucket_bytes)

    # ----- checkpoints ---------------------------------------------------------------------

    def save_state(self, folder: Path, with_optimizer: bool) -> None:
        """megatron-core's sharded state dict of the weights, AdamW moments and step."""
        state = mcheckpoint.sharded_state(
            self.model,
            self.optimized,
            self.optimizer,
            with_optimizer=with_optimizer,
            main_weights=self.main is not None,
        )
        mcheckpoint.save(state, folder, self.dp_group)

    def checkpoint_extra(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "param_dtype": str(self.param_dtype),
            "distributed_optimizer": self.distributed,
            "transformer_impl": self.transformer_impl,
        }

    def rng_state(self) -> dict[str, Any]:
        return {"megatron_tracker": mmodel.rng_tracker_states()}

    def set_rng_state(self, rng: dict[str, Any]) -> None:
        if "megatron_tracker" in rng:  # older checkpoints: streams stay as seeded
            mmodel.set_rng_tracker_states(rng["megatron_tracker"])

    def load_state(self, saved: SavedState) -> bool:
        """megatron-core's load, re-split onto this TP size; the RNG streams only where
        world size, TP and PP sizes match."""
        folder, meta = saved.folder, saved.meta
        mcheckpoint.check_resumable(folder, meta["extra"], self.checkpoint_extra())
        mcheckpoint.load(
            self.model,
            self.optimized,
            self.optimizer,
            folder,
            with_optimizer=saved.with_optimizer,
            main_weights=self.main is not None,
        )
        if not saved.with_optimizer:  # no optimizer state saved: main weights from the model
            if self.main is not None:
                self.main.from_model()
            elif self.distributed:
                self.optimizer.reload_model_params()
        layout = (meta["world_size"], meta["extra"].get("tp"), meta["extra"].get("pp", 1))
        if layout == (self.world, self.tp, self.pp):
            return True
        if self.rank == 0:
            print(
                f"vime: {folder} was saved with another layout; weights and optimizer re-split, "
                "RNG streams left as seeded",
                flush=True,
            )
        return False
