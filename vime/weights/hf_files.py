"""Reading an HF folder's weights: ``LazyHFState``, each tensor read only when asked for.

Where it fits: the megatron backend converts a checkpoint through it one tensor at a
time (``vime.backends.megatron.convert``); the fsdp2 backend's merged LoRA export reads
the frozen base back from it in the checkpoint's own precision.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch


class LazyHFState(Mapping[str, torch.Tensor]):
    """The tensors of an HF folder's ``*.safetensors`` files, each read from disk only when
    asked for (and not kept): a rank converts its own pipeline stage's tensors one at a
    time instead of holding the whole checkpoint in host memory, as every rank of a node
    would otherwise do at once."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        self._file: dict[str, str] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    self._file[key] = str(file)
                    self._shape[key] = tuple(handle.get_slice(key).get_shape())

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._file[key], framework="pt") as handle:
            return handle.get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._file  # Mapping's own would read the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape, read from the file header (no data read)."""
        return self._shape[key]
