"""``FSDP2Backend``: one training rank's model under the ``fsdp2`` backend.

Where it fits: the registry names this class for ``--train-backend fsdp2``; a
``PolicyTrainActor`` holds it and composes the training step, loss, optimizer
chokepoint, reference swap, sleep/wake and checkpoint commit around it through the
``TrainBackend`` interface. Model placement is in ``model.py``, LoRA's adapters in
``lora.py``. This file holds what is particular to FSDP2: DTensor shards (their
norm, their full tensors for the weight source) and the DCP state that reshards.

World size 1 (without ``--fsdp-cpu-offload``) uses no ``fully_shard`` and no DTensor:
``plain.py`` loads the HF model as it is, and every DTensor branch here (``_local``,
``_full``, the norm's ``full_tensor``, ``release_gathered``) passes the plain tensors
through, so the step runs no FSDP2 code. In fp32 that is the sharded math at one rank,
bit for bit; DCP's checkpoints still load across any change of rank count.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
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
from vime.backends import compile as decoder_compile
from vime.backends import varlen_attention
from vime.backends.base import TrainSettings
from vime.backends.dropout import model_config
from vime.backends.fsdp2 import lora as fsdp_lora
from vime.backends.fsdp2 import model as fsdp_model
from vime.backends.fsdp2 import plain as fsdp_plain
from vime.backends.interface import (
    MicroBatchFn,
    SavedState,
    TrainBackend,
    WeightPurpose,
    hf_dtype,
    run_in_order,
)
from vime.backends.lm_head import fusable_head, row_log_probs
from vime.backends.lm_head_choice import fused_tail
from vime.backends.optim import adamw
from vime.sync_budget import host_only
from vime.weights.buckets import WeightEntry, iter_buckets, tensor_nbytes
from vime.weights.hf_files import LazyHFState
from vime.weights.lora import LoraSettings, merge, write_peft_folder


class FSDP2Backend(TrainBackend):
    """HF causal LM sharded with ``fully_shard`` over every training rank (one rank: plain)."""

    name = "fsdp2"

    def setup(self, settings: TrainSettings) -> None:
        self.settings = settings
        own = settings.backend  # vime.backends.fsdp2.flags.Fsdp2Settings
        self.rank, self.world, self.device = fsdp_model.init_distributed()
        if settings.hf_checkpoint is None:
            raise ValueError("the fsdp2 backend needs --hf-checkpoint DIR")
        param_dtype = vime_device.resolve_dtype(own.param_dtype, self.device)
        # The checkpoint's own config: its dtype is what engines and --save-hf receive. The
        # model's config cannot serve, it says float32 (the master weights it was built in).
        self.hf_config = AutoConfig.from_pretrained(settings.hf_checkpoint)
        attn = fsdp_model.resolve_attn_implementation(
            own.attn_implementation, self.device, param_dtype, self.hf_config
        )
        # Per-sample attention reads rows whose samples share their prompt (computed once).
        self.shares_prompts = attn == varlen_attention.HF_NAME
        # LoRA: adapters train, the base is frozen and, with them off, the KL reference.
        self.lora = settings.lora
        # A low-precision compute dtype also stores the frozen base (half the memory).
        self._base_dtype = param_dtype if param_dtype != torch.float32 else None
        self._engines_have_base = False  # an adapter-only sync sends the base first
        self._saved_tied = False  # a saved module shares its weight (set by inject)
        self.replicas = 1  # hybrid and no_shard: the replicas all-reduce gradients
        self.model = self._load_model(own, param_dtype, attn)
        if own.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.trained_params = self.params
        self.optimizer = adamw(self.model.named_parameters(), settings.adamw)
        # The fused log-prob tail needs a plain head; a LoRA-wrapped one keeps whole logits.
        self._fused_head = fused_tail(
            settings.lm_head_tail,
            self.device.type,
            fusable_head(self.model.get_output_embeddings(), self.hf_config),
        )

    def _load_model(self, own: Any, param_dtype: torch.dtype, attn: str) -> torch.nn.Module:
        """The model, plain at one rank (``plain.py``), else sharded over the mesh of
        ``--fsdp-mode``."""
        settings = self.settings
        adapt = decoder_compile.before_sharding(
            self._add_adapters if self.lora.enabled else None, settings.compile_decoder
        )
        # Dropout off in every RL forward unless --keep-dropout (vime.backends.dropout).
        config = model_config(self.hf_config, settings.keep_dropout)
        if fsdp_plain.uses_plain_model(self.world, own.cpu_offload):
            return fsdp_plain.load_plain_model(
                settings.hf_checkpoint,
                device=self.device,
                attn_implementation=attn,
                param_dtype=param_dtype,
                block_classes=own.block_classes,
                adapt=adapt,
                config=config,
            )
        mesh = fsdp_model.build_mesh(own.mode, self.world, own.shard_size, self.device)
        self.replicas = mesh.size(0) if mesh.ndim == 2 else 1
        return fsdp_model.load_sharded_model(
            settings.hf_checkpoint,
            mesh=mesh,
            device=self.device,
            attn_implementation=attn,
            shard_kwargs={
                "block_classes": own.block_classes,
                "param_dtype": param_dtype,
                "reduce_dtype": vime_device.resolve_dtype(own.reduce_dtype, self.device),
                "reshard_after_forward": own.reshard_after_forward,
                "cpu_offload": own.cpu_offload,
            },
            adapt=adapt,
            config=config,
        )

    def _add_adapters(self, model: torch.nn.Module) -> None:
        self._saved_tied = fsdp_lora.inject(model, self.lora, self.settings.seed)
        if self._base_dtype is not None:
            fsdp_lora.store_base(model, self._base_dtype)

    # ----- the TrainBackend interface ------------------------------------------------------

    def forward_backward(
        self,
        batch: Any,
        micro_batches: Sequence[tuple[int, ...]],
        consume: MicroBatchFn,
        *,
        backward: bool,
    ) -> None:
        # Adapter dropout belongs to the update's forward only: log-prob passes (pi_old,
        # the reference, the probe) score the policy the engines serve.
        if self.lora.enabled:
            fsdp_lora.set_dropout(self.model, backward)
        run_in_order(
            micro_batches,
            consume,
            backward=backward,
            pack=lambda indices: self._pack(batch, indices),
            logits=lambda packed: self.model(**packed.model_inputs()).logits,
            temperature=self.settings.temperature,
            before_backward=self._before_backward,
            log_probs=self._head_log_probs if self._fused_head else None,
        )
        if not backward:
            # A forward alone leaves gathered what stays so for backward (the last block,
            # the root): outside a pass, the model's parameters are its shards again, the
            # ones the optimizer steps and the weight source and checkpoints read.
            self.release_gathered()

    def _head_log_probs(self, packed: Any, with_entropy: bool) -> tuple[Any, Any]:
        """Only the loss positions' final hidden states ``[1, L, h]`` reach the LM head
        (``vime.backends.lm_head``)."""
        return row_log_probs(
            lambda: self.model(**packed.model_inputs()).logits,
            self.model.get_output_embeddings(),
            packed,
            temperature=self.settings.temperature,
            with_entropy=with_entropy,
            seq_dim=1,
        )

    def _pack(self, batch: Any, indices: tuple[int, ...]) -> Any:
        """The packed row on the device; for ``varlen_sdpa``, its attention layout too,
        built from the host row (the attention then reads nothing back)."""
        host = batch.pack(indices, share_prompts=self.shares_prompts)
        packed = host.to(self.device)
        if getattr(self.model.config, "_attn_implementation", None) == varlen_attention.HF_NAME:
            with host_only():
                layout = varlen_attention.layout_of_positions(host.position_ids, self.device)
            varlen_attention.attach_layout(packed.position_ids, layout)
        return packed

    def local_tensors(self) -> list[torch.Tensor]:
        return [_local(p) for p in self.params]

    def sleep_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # LoRA's frozen base: weights that ``params`` (the adapters) leave out.
        return [_local(p) for p in self.model.parameters() if not p.requires_grad], []

    def reference(self) -> AbstractContextManager[None] | None:
        # LoRA: the base, the adapters skipped, is the reference.
        return fsdp_lora.adapters_disabled(self.model) if self.lora.enabled else None

    def finish_grads(self) -> None:
        """Nothing left: FSDP2 reduce-scattered (and all-reduced) in backward; one rank
        has nothing to reduce."""

    def _before_backward(self, last: bool) -> None:
        # Each backward reduce-scatters within the shard group; FSDP2 keeps the partial
        # sums, so the all-reduce across replicas (the slow, often inter-node, one) runs
        # once per optimizer step instead of once per micro-batch. The partial sums cost
        # one more gradient shard (in the reduce dtype) for the length of the step.
        if self.replicas > 1:
            self.model.set_requires_all_reduce(last)

    def grad_norm(self) -> torch.Tensor:
        # FSDP reduce-scattered the gradients in backward: the norm of the DTensor shards
        # (one rank: of the plain gradients).
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # ----- weights out ---------------------------------------------------------------------

    def weight_buckets(
        self, bucket_bytes: int, purpose: WeightPurpose = "full"
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named weights in the checkpoint's dtype, one bucket materialized at a time
        (LoRA: each adapted layer's merge ``W + s·BA``).

        LoRA's ``sync``: the first sends the frozen base and the adapters, each later one
        the adapters alone (float32); the engines merge them (``vime.weights.lora``), unless
        ``--lora-merge-on-sync``. LoRA's ``export`` with the frozen base stored in the
        compute dtype (``store_base``): that copy is rounded, so the base is read back from
        the checkpoint, and every layer without an adapter is written bit for bit as the
        checkpoint has it.

        A collective: every rank must iterate it to the end (``full_tensor`` all-gathers).
        """
        if not self.lora.enabled:
            named = self.model.named_parameters()
            return iter_buckets((self._entry(name, p) for name, p in named), bucket_bytes)
        if purpose == "sync" and not self.lora.merge_on_sync:
            return self._adapter_sync(bucket_bytes)
        source = None
        if purpose == "export" and self._base_dtype is not None:
            source = LazyHFState(self.settings.hf_checkpoint)
        return iter_buckets(self._merged_entries(source), bucket_bytes)

    def _adapter_sync(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        named = list(self.model.named_parameters())
        # Adapters in fp32 (merged on the engine); saved modules as the weights they are.
        entries = [
            self._entry(n, p, torch.float32 if fsdp_lora.is_adapter(n) else None)
            for n, p in named
            if p.requires_grad
        ]
        if not self._engines_have_base:
            frozen = [
                self._entry(n, p)
                for n, p in named
                if not p.requires_grad and not fsdp_lora.is_original(n)
            ]
            entries = frozen + entries
        yield from iter_buckets(entries, bucket_bytes)
        self._engines_have_base = True

    def _entry(
        self,
        name: str,
        param: torch.Tensor,
        dtype: torch.dtype | None = None,
        full: Callable[[], torch.Tensor] | None = None,
    ) -> WeightEntry:
        """``param`` under its wire name, gathered (or ``full()``) and cast (the checkpoint's
        dtype) when its bucket is asked for."""
        dtype = dtype or hf_dtype(self.hf_config)
        full = full or (lambda p=param: _full(p))
        return WeightEntry(
            fsdp_lora.wire_name(name),
            tensor_nbytes(param.shape, dtype),
            # On the rank's device even when the shards are offloaded to the host: a
            # colocated engine opens the tensors through CUDA IPC.
            lambda: full().detach().to(self.device, dtype),
        )

    def _merged_entries(self, source: LazyHFState | None = None) -> Iterator[WeightEntry]:
        """Every weight under its HF name, each adapted layer merged (``W + s·B A``, fp32).
        With ``source`` (the checkpoint) a frozen base weight W is the checkpoint's own
        wherever it has it (``_base_weight``), not the copy stored in the compute dtype."""
        dtype, scale = hf_dtype(self.hf_config), self.lora.scale
        params = dict(self.model.named_parameters())
        for name, param in params.items():
            if fsdp_lora.is_adapter(name) or fsdp_lora.is_original(name):
                continue  # merged into its layer's weight; the reference's saved module
            base = self._base_weight(name, param, source)
            layer = name.removesuffix(".base_layer.weight")
            if layer == name:
                yield self._entry(name, param, full=base)
                continue
            a, b = (params[f"{layer}.{part}.default.weight"] for part in ("lora_A", "lora_B"))

            def merged(w: Any = base, a: Any = a, b: Any = b) -> torch.Tensor:
                a, b = _full(a), _full(b)  # collectives: every rank, in this order
                return merge(w(), a, b, scale, dtype).to(self.device)

            yield WeightEntry(fsdp_lora.wire_name(name), tensor_nbytes(param.shape, dtype), merged)

    def _base_weight(
        self, name: str, param: torch.Tensor, source: LazyHFState | None
    ) -> Callable[[], torch.Tensor]:
        """``param``'s full tensor, gathered (a collective); or, for a frozen weight that
        ``source`` holds in the same shape, read from it on rank 0, which alone writes an
        export (the other ranks get a placeholder of the shape). Every rank decides alike
        from the file headers, so the gathers stay in lock-step."""
        key = fsdp_lora.wire_name(name)
        held = source is not None and key in source and source.shape(key) == tuple(param.shape)
        if param.requires_grad or not held:
            return lambda: _full(param)
        if self.rank == 0:
            return lambda: source[key]
        return lambda: torch.empty(param.shape, dtype=torch.float32)

    def export_adapters(self, path: str) -> bool:
        """LoRA: a PEFT adapter folder for the base checkpoint. A collective: every rank
        gathers, rank 0 writes."""
        if not self.lora.enabled:
            return False
        # Every name of a shared copy: peft loads a tied head's copy under its own name.
        named = self.model.named_parameters(remove_duplicate=False)
        adapters = {
            fsdp_lora.wire_name(name): _full(p).detach().to("cpu", torch.float32)
            for name, p in named
            if p.requires_grad
        }
        if self.rank == 0:
            hf = self.settings.hf_checkpoint
            write_peft_folder(path, adapters, self.lora, hf, self._saved_tied)
        return True

    def release_gathered(self) -> None:
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                # A forward with no backward (log-probs) leaves the last block and the root
                # gathered (every group with --no-fsdp-reshard-after-forward): free them.
                module.reshard()

    # ----- checkpoints ---------------------------------------------------------------------

    def _state(self, with_optimizer: bool) -> dict[str, Any]:
        # LoRA: the adapters only; the frozen base is the --hf-checkpoint's.
        options = StateDictOptions(ignore_frozen_params=self.lora.enabled)
        state: dict[str, Any] = {"model": get_model_state_dict(self.model, options=options)}
        # A never-stepped AdamW has no state; asking DCP for it would fabricate a step.
        if with_optimizer:
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def save_state(self, folder: Path, with_optimizer: bool) -> None:
        dcp.save(self._state(with_optimizer), checkpoint_id=str(folder))

    def load_state(self, saved: SavedState) -> bool:
        """DCP stores every tensor by its global shape, so a checkpoint saved by a
        different number of ranks (or another ``--fsdp-mode``) is resharded on
        load. Per-rank RNG streams have no counterpart then: they are re-seeded
        from ``--seed``, the rollout id and the rank, and rank 0 says so.
        """
        folder, meta = saved.folder, saved.meta
        self._check_lora(folder, meta["extra"].get("lora"))
        state = self._state(saved.with_optimizer)
        self._read(state, folder, int(meta["world_size"]))
        options = StateDictOptions(ignore_frozen_params=self.lora.enabled, strict=False)
        set_model_state_dict(self.model, state["model"], options=options)
        if "optim" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        if int(meta["world_size"]) == self.world:
            return True
        _seed_all(self.settings.seed * 1_000_003 + saved.rollout_id * 1_009 + self.rank)
        if self.rank == 0:
            print(
                f"vime: {folder} was saved by {meta['world_size']} ranks and is loaded on "
                f"{self.world}: weights and optimizer resharded, RNG streams re-seeded",
                flush=True,
            )
        return False

    def _read(self, state: dict[str, Any], folder: Path, saved_world: int) -> None:
        """DCP's load of ``state`` from ``folder``, its failures told as what to do."""
        try:
            dcp.load(state, checkpoint_id=str(folder))
        except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
            # verify() checked every file's size, so what DCP cannot read is corrupt content.
            reason = _reason(e)
            if saved_world == self.world:
                raise checkpoint.CheckpointError(
                    f"{folder} could not be read ({reason}): a shard is corrupt though its "
                    f"size is right; write an earlier rollout id into {folder.parent}/"
                    f"{checkpoint.TRACKER}, or start over from an HF export"
                ) from e
            raise checkpoint.CheckpointError(
                f"{folder} was saved by {saved_world} ranks and could not be resharded onto "
                f"{self.world} ranks ({reason}); load it with {saved_world} ranks"
            ) from e

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"lora": _lora_fields(self.lora)}

    def _check_lora(self, folder: Any, saved: dict[str, Any] | None) -> None:
        """A checkpoint holds the adapters of one LoRA shape (or the full model): refuse
        to load it into another."""
        mine = _lora_fields(self.lora)
        saved = saved or _lora_fields(LoraSettings())
        if saved != mine:
            raise checkpoint.CheckpointError(
                f"{folder} was saved with LoRA {_describe_lora(saved)}, this run has "
                f"{_describe_lora(mine)}; resume with the same --lora-rank, --lora-alpha, "
                "--lora-target-modules and --lora-modules-to-save"
            )


def _lora_fields(settings: LoraSettings) -> dict[str, Any]:
    """What a checkpoint's adapters depend on (dropout and the sync mode do not count)."""
    if not settings.enabled:
        return {"rank": 0}
    fields: dict[str, Any] = {
        "rank": settings.rank,
        "alpha": settings.alpha,
        "target_modules": sorted(settings.target_modules),
    }
    if settings.modules_to_save:
        fields["modules_to_save"] = sorted(settings.modules_to_save)
    return fields


def _describe_lora(fields: dict[str, Any]) -> str:
    if not fields["rank"]:
        return "off"
    targets = ",".join(fields["target_modules"])
    saved = ",".join(fields.get("modules_to_save", ())) or "none"
    return f"rank {fields['rank']}, alpha {fields['alpha']:g}, targets {targets}, saved {saved}"


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
