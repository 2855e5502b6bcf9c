"""LoRA adapters on the wire: their settings, the merge, and the engine side of a sync.

Where it fits: with ``--lora-rank R`` the trainer trains only low-rank adapters
(``vime.backends.fsdp2.lora``). A target linear layer ``y = x Wᵀ`` becomes

    y = x Wᵀ + s · (x Aᵀ) Bᵀ,   A: [R, in],  B: [out, R],  s = alpha / R,

and the weights an engine serves are the merge ``W' = W + s · B A`` (``merge``).
A sync either sends ``W'`` for every layer (``--lora-merge-on-sync``, and the
``disk`` transport, whose folder is a whole HF checkpoint), or sends the frozen
base ``W`` once and then only ``A`` and ``B``: an ``AdapterMerger`` on the engine
keeps the base and computes ``W'`` there with the same function, so both paths
give the engine the same bits. On the wire an adapter is two tensors named after
its layer, ``<layer>.lora_A.weight`` and ``<layer>.lora_B.weight`` (PEFT's saved
names without its ``base_model.model.`` prefix), in float32. A module trained in
full beside them (``--lora-modules-to-save``) travels under its own HF name at every
sync, and the merger keeps it as the base it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vime.config.lora_flags import DEFAULT_ALPHA, DEFAULT_TARGETS
from vime.weights.buckets import Bucket, WeightEntry, entries_from_state_dict, iter_buckets

A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"


@dataclass(frozen=True)
class LoraSettings:
    """``--lora-*``: the adapters' shape and how a sync moves them (rank 0 is off)."""

    rank: int = 0
    alpha: float = DEFAULT_ALPHA
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    merge_on_sync: bool = False
    modules_to_save: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args: Any) -> LoraSettings:
        return cls(
            rank=args.lora_rank,
            alpha=args.lora_alpha,
            dropout=args.lora_dropout,
            target_modules=tuple(args.lora_target_modules),
            merge_on_sync=args.lora_merge_on_sync,
            modules_to_save=tuple(args.lora_modules_to_save),
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``s = alpha / R``: the adapter's output is scaled by it."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class EngineLora:
    """What an engine needs to merge adapter-only syncs: the scale and the bucket size
    its merged weights are handed to the engine in."""

    scale: float
    bucket_bytes: int


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
