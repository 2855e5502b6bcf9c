"""LoRA adapters on the wire: their settings, the merge, and the engine side of a sync.

Where it fits: with ``--lora-rank R`` the trainer trains only low-rank adapters
(``vime.backends.fsdp2.lora``). A target linear layer ``y = x Wᵀ`` becomes

    y = x Wᵀ + s · (x Aᵀ) Bᵀ,   A: [R, in],  B: [out, R],  s = alpha / R,

and the weights an engine serves are the merge ``W' = W + s · B A`` (``merge``).
A sync either sends ``W'`` for every layer (``--lora-merge-on-sync``, and the
``disk`` transport, whose folder is a whole HF checkpoint), or sends the frozen
base ``W`` once and then only ``A`` and ``B``. On the engine one of two receivers
takes those: ``AdapterLoader`` hands an engine that serves LoRA itself (vLLM) the
base as weights and each sync's adapters as a PEFT folder, a new adapter version
in place of the last; ``AdapterMerger`` keeps the base and computes ``W'`` with the
same function the trainer's merged sync uses, so both give the engine the same
bits. On the wire an adapter is two tensors named after its layer,
``<layer>.lora_A.weight`` and ``<layer>.lora_B.weight`` (PEFT's saved names without
its ``base_model.model.`` prefix), in float32. A module trained in full beside them
(``--lora-modules-to-save``) travels under its own HF name at every sync, and the
merger keeps it as the base it is (an engine's own LoRA cannot serve it).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from vime.config.lora_flags import (
    DEFAULT_ALPHA,
    DEFAULT_DROPOUT,
    DEFAULT_MODULES_TO_SAVE,
    DEFAULT_RANK,
    DEFAULT_TARGETS,
)
from vime.rollout.engines.flags import DEFAULT_VLLM_LORA
from vime.weights.buckets import Bucket, WeightEntry, entries_from_state_dict, iter_buckets
from vime.weights.hf_export import staged_folder

A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSettings:
    """``--lora-*``: the adapters' shape and how a sync moves them (rank 0 is off); built
    from the flags by ``vime.config.train_settings.lora_settings``. Its defaults are the flags'
    (``vime.config.lora_flags``), so ``LoraSettings()`` is a run without LoRA."""

    rank: int = DEFAULT_RANK
    alpha: float = DEFAULT_ALPHA
    dropout: float = DEFAULT_DROPOUT
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    merge_on_sync: bool = False  # --lora-merge-on-sync, a switch: off unless given
    modules_to_save: tuple[str, ...] = DEFAULT_MODULES_TO_SAVE

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``s = alpha / R``: the adapter's output is scaled by it."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class EngineLora:
    """What an engine needs for adapter-only syncs: the adapters' settings, the bucket
    size merged weights are handed to the engine in, and whether an engine that serves
    LoRA itself loads the adapters as they are (``native``: ``on``, ``off``, or ``auto``:
    on where it computes on a GPU; on the CPU vLLM decodes 3x slower with its LoRA than
    with merged weights, bench/README.md)."""

    settings: LoraSettings
    bucket_bytes: int
    native: str = DEFAULT_VLLM_LORA

    @property
    def scale(self) -> float:
        return self.settings.scale


def engine_lora(
    settings: LoraSettings, bucket_bytes: int, transport: str, native: str = DEFAULT_VLLM_LORA
) -> EngineLora | None:
    """The engines' part of a LoRA run (None without LoRA). An engine's own LoRA serves
    adapters only: not where every sync is merged weights (``--lora-merge-on-sync``, the
    ``disk`` transport's checkpoint folder), nor beside modules trained in full."""
    if not settings.enabled:
        return None
    merged = settings.merge_on_sync or transport == "disk"
    if merged or settings.modules_to_save:
        native = "off"
    return EngineLora(settings, bucket_bytes, native)


def adapter_names(layer: str) -> tuple[str, str]:
    """The wire names of ``layer``'s A and B (``layer`` without ``.weight``)."""
    return layer + A_SUFFIX, layer + B_SUFFIX


def adapter_layer(name: str) -> str | None:
    """The layer an adapter tensor's wire name belongs to, or None for a base weight."""
    for suffix in (A_SUFFIX, B_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


@torch.no_grad()
def merge(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """``W + s · B A`` computed in float32, cast to ``dtype``.

    The trainer's merged sync and an engine's ``AdapterMerger`` both call this, on
    a base of the same values (float32 master weights hold exactly what the
    checkpoint's dtype held), so their results are bit for bit the same.
    """
    delta = (b.float() @ a.float()).mul_(scale)
    return delta.add_(base.float()).to(dtype)


class AdapterMerger:
    """The engine side of an adapter-only sync.

    ``expand`` takes one sync's buckets: base weights sent beside adapters (the
    first sync) replace the kept base; adapters are collected. Once the sync's last
    bucket is in, it yields the full merged weight set, so the engine's update sees
    what a merged sync would have sent. A sync with no adapter (merged weights)
    passes through and leaves the kept base alone.
    """

    def __init__(self, settings: EngineLora) -> None:
        self.settings = settings
        self.base: dict[str, torch.Tensor] = {}  # HF name -> the frozen weight, on the host

    def update(self, engine: Any, buckets: Iterable[Bucket], version: int) -> None:
        """One sync into ``engine``: the merged set, as its ``update_weights`` takes it."""
        engine.update_weights(self.expand(buckets), version)

    def expand(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        adapters: dict[str, torch.Tensor] = {}
        base: list[tuple[str, torch.Tensor]] = []
        for bucket in buckets:
            for name, tensor in bucket:
                if adapter_layer(name) is None:
                    base.append((name, tensor.detach().to("cpu")))
                else:
                    adapters[name] = tensor.detach().to("cpu", torch.float32)
        if not adapters:  # merged weights: served as they came, the kept base unchanged
            yield from iter_buckets(entries_from_state_dict(dict(base)), self.settings.bucket_bytes)
            return
        self.base.update(base)
        if not self.base:
            raise ValueError(
                "adapter-only weight sync before the engine received the base weights: "
                "the first sync of a run must send them"
            )
        layers = {adapter_layer(name) for name in adapters}
        unknown = sorted(layer for layer in layers if f"{layer}.weight" not in self.base)
        if unknown:
            raise ValueError(f"adapter for {unknown[0]!r}, which has no base weight here")
        yield from iter_buckets(self._merged(adapters), self.settings.bucket_bytes)

    def _merged(self, adapters: dict[str, torch.Tensor]) -> Iterator[WeightEntry]:
        scale = self.settings.scale
        for name, weight in self.base.items():
            a_name, b_name = adapter_names(name.removesuffix(".weight"))
            if a_name not in adapters:
                yield WeightEntry(name, weight.nbytes, lambda w=weight: w)
                continue
            a, b = adapters[a_name], adapters[b_name]
            yield WeightEntry(
                name,
                weight.nbytes,
                lambda w=weight, a=a, b=b: merge(w, a, b, scale, w.dtype),
            )


class AdapterEngine(Protocol):
    """An engine that serves a PEFT adapter on top of its weights (``EngineSpec.native_lora``)."""

    weight_version: int

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None: ...

    def load_adapter(self, folder: str | None, version: int) -> None: ...

    def one_load(self) -> AbstractContextManager[None]: ...


class AdapterLoader:
    """The engine side of an adapter-only sync, for an engine with LoRA of its own.

    ``update`` passes a sync's base weights (the first sync's, or merged ones) to the
    engine's ``update_weights`` as they stream by, and writes its adapters as a PEFT
    folder that the engine's ``load_adapter`` then serves, in place of the last: the
    weights stay the base, and each sync moves and loads the adapters alone. A sync of
    merged weights without adapters leaves the engine serving them bare. The folder
    lives only while the engine reads it (``load_adapter`` returns once it has): no
    adapter is left on disk, even by a process killed later. Base and adapter load as
    one (``one_load``), and the engine takes the new version with the adapter only: no
    request runs on the one without the other, or reports a version it did not sample.
    """

    def __init__(self, settings: EngineLora) -> None:
        self.settings = settings

    def update(self, engine: AdapterEngine, buckets: Iterable[Bucket], version: int) -> None:
        adapters: dict[str, torch.Tensor] = {}

        def base_weights() -> Iterator[Bucket]:
            for bucket in buckets:
                base = []
                for name, tensor in bucket:
                    if adapter_layer(name) is None:
                        base.append((name, tensor))
                    else:
                        adapters[name] = tensor.detach().to("cpu", torch.float32)
                if base:
                    yield base

        stream = base_weights()
        first = next(stream, None)  # the engine steps while the first bucket arrives
        if first is None and not adapters:
            raise ValueError("a weight sync brought the engine no weights and no adapters")
        with engine.one_load():
            if first is not None:  # under the version served until the adapter is in
                engine.update_weights(itertools.chain([first], stream), engine.weight_version)
            if not adapters:
                engine.load_adapter(None, version)
                return
            with tempfile.TemporaryDirectory(prefix="vime-lora-", dir=_ram_dir()) as root:
                folder = write_peft_folder(
                    Path(root) / "adapter", adapters, self.settings.settings, None
                )
                engine.load_adapter(str(folder), version)


def engine_receiver(
    settings: EngineLora, native_lora: bool, cuda: bool
) -> AdapterLoader | AdapterMerger:
    """The receiver of an engine's LoRA syncs: its own LoRA where it has one
    (``native_lora``) and ``settings.native`` says so (``auto``: on ``cuda``), else the
    merge."""
    wanted = settings.native == "on" or (settings.native == "auto" and cuda)
    return AdapterLoader(settings) if native_lora and wanted else AdapterMerger(settings)


def _ram_dir() -> str | None:
    """RAM-backed /dev/shm for the adapters' folders where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def peft_config(
    settings: LoraSettings, base_model: str | None = None, tied: bool = False
) -> object:
    """The ``peft.LoraConfig`` of ``settings`` (no bias training; the plain LoRA scale).
    ``tied``: a saved module's weight is tied to another module's, whose wrapper then
    shares the trained copy (peft's ``ensure_weight_tying``)."""
    from peft import LoraConfig

    return LoraConfig(
        ensure_weight_tying=tied,
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        modules_to_save=list(settings.modules_to_save) or None,
        bias="none",
        base_model_name_or_path=base_model,
    )


def write_peft_folder(
    path: str | os.PathLike[str],
    adapters: Mapping[str, torch.Tensor],
    settings: LoraSettings,
    base_model: str | None,
    tied: bool = False,
) -> Path:
    """Write ``adapters`` (wire names -> tensors) as a PEFT adapter folder at ``path``:
    ``adapter_config.json`` and ``adapter_model.safetensors``, what
    ``PeftModel.from_pretrained`` loads onto the base checkpoint. Written beside
    ``path`` and renamed into place once complete, so ``path`` is never half-written."""
    from safetensors.torch import save_file

    with staged_folder(path) as staging:
        peft_config(settings, base_model, tied).save_pretrained(str(staging))
        tensors = {PEFT_PREFIX + n: t.detach().to("cpu").contiguous() for n, t in adapters.items()}
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return Path(path).absolute()
