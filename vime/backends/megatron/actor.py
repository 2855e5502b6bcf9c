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
global normalizers make that sum the full-batch gradient). Sequence parallel
(``--megatron-sequence-parallel``) is megatron-core's, with rows padded to a
multiple of TP and the norms' partial gradients summed over TP here; activation
recompute is megatron-core's too (``recompute_fields``). Pipeline parallel and
the distributed optimizer are not built yet and are rejected when the flags are
parsed (``flags.py``).

Optimizer: torch ``AdamW`` over the local (TP-sharded) parameters with the same
decay groups as fsdp2 (megatron-core's optimizer needs CUDA). AdamW is
elementwise, so sharded AdamW is the same update as unsharded AdamW.

Checkpoints: megatron-core's own ``dist_checkpointing`` (``checkpoint.py``), in
the folder ``vime.checkpoint`` hands out and commits (``iter_N`` + tracker, written
atomically by ``PolicyTrainActor.save``). Each rank saves its TP shard as
``GPTModel.sharded_state_dict()`` describes it -- megatron-core knows its own
layouts (fused QKV per query group, swiglu ``fc1`` halves, vocab padding) -- with
the AdamW moments sharded like their parameters and the step as common state. No
rank gathers full tensors, the checkpoint is megatron-core's own format, and its
global layout does not depend on the TP size: a load at another TP size is
megatron-core's re-split, bitwise for every real (non-padding) row. RNG streams are
restored only when world size and TP size match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vime import device as vime_device
from vime.backends.megatron import checkpoint as mcheckpoint
from vime.backends.megatron import convert
from vime.backends.megatron import model as mmodel
from vime.backends.megatron.shims import apply_cpu_shims
from vime.backends.policy_actor import PolicyTrainActor
from vime.weights.buckets import WeightEntry, iter_buckets, tensor_nbytes


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


def recompute_fields(granularity: str) -> dict[str, Any]:
    """``TransformerConfig`` fields of ``--megatron-recompute-granularity``.

    ``selective`` recomputes core attention (megatron-core's default module: the
    ``L x L`` scores are the large, cheap activations); ``full`` recomputes every
    transformer layer from its input, one layer per checkpointed unit.
    """
    if granularity == "selective":
        return {"recompute_granularity": "selective"}
    if granularity == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    return {}


class MegatronActor(PolicyTrainActor):
    """megatron-core ``GPTModel``, tensor parallel inside, data parallel by gradient sum."""

    backend_name = "megatron"

    def init(self, args: Any) -> int:
        self.args = args
        if args.hf_checkpoint is None:
            raise ValueError("the megatron backend needs --hf-checkpoint DIR")
        from transformers import AutoConfig

        apply_cpu_shims()
        self.tp = int(args.megatron_tensor_parallel_size)
        self.loss_replicas = self.tp  # every TP rank of a replica computes the same loss
        sequence_parallel = bool(args.megatron_sequence_parallel)
        # Sequence parallel splits each row's tokens over the TP ranks.
        self.row_multiple = self.tp if sequence_parallel else 1
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
            self.hf_config,
            tp=self.tp,
            params_dtype=torch.float32,
            sequence_parallel=sequence_parallel,
            **recompute_fields(args.megatron_recompute_granularity),
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
        # norms act on this rank's heads only, and under sequence parallel every norm sees
        # this rank's slice of the sequence only (megatron-core's finalize_model_grads sums
        # both over the TP group too).
        self.tp_partial = [
            p
            for n, p in self.named_params
            if self.tp > 1
            and ("q_layernorm" in n or "k_layernorm" in n or getattr(p, "sequence_parallel", False))
        ]
        self._setup_training(self.named_params)
        return self._start_rollout()

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    # ----- backend hooks -------------------------------------------------------------------

    def _logits(self, packed: Any) -> torch.Tensor:
        return mmodel.packed_logits(self.model, packed)

    def _local_tensors(self) -> list[torch.Tensor]:
        return self.params

    def _finish_grads(self) -> None:
        """Sum the step's gradient over the DP group, and the partial QK-norm grads over TP."""
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
        """One lazy entry per HF tensor; the entries of one megatron parameter share a gather.

        ``tensor_of(name, param)`` picks what is gathered: the weights for the weight
        source, or any tensor sharded like them (the tests gather AdamW moments so).
        """
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

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named weights in the checkpoint's dtype, one bucket materialized at a time.

        A collective over the TP group: every rank must iterate it to the end.
        """
        return iter_buckets(self._hf_entries(self._hf_dtype(), lambda _n, p: p), bucket_bytes)

    # ----- checkpoints ---------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """megatron-core's sharded state dict of the weights, AdamW moments and step."""
        return mcheckpoint.sharded_state(
            self.model, self.named_params, self.optimizer, with_optimizer=self.optimizer_steps > 0
        )

    def _write_state(self, folder: Path) -> None:
        mcheckpoint.save(self._state(), folder)

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {"tp": self.tp}

    def _load(self, load_dir: str) -> int:
        """Restore the newest checkpoint under ``load_dir``; return its rollout id."""
        rollout_id, folder, meta = self._open_checkpoint(load_dir)
        mcheckpoint.load(
            self.model,
            self.named_params,
            self.optimizer,
            folder,
            with_optimizer=self.optimizer_steps > 0,
        )
        if int(meta["world_size"]) == self.world and meta["extra"].get("tp") == self.tp:
            self._restore_rng(folder)
        elif self.rank == 0:
            print(
                f"vime: {folder} was saved with another layout; weights and optimizer re-split, "
                "RNG streams left as seeded",
                flush=True,
            )
        return rollout_id
