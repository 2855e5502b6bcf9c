"""Write a stream of weight buckets as a HF folder that ``from_pretrained`` loads.

Where it fits: ``--save-hf`` and ``TrainActor.export_hf`` feed the same
HF-named buckets the weight sync sends to rollout engines
(:mod:`vime.weights.buckets`) into :func:`save_hf_folder`, on one rank. The
result is what ``AutoModelForCausalLM.from_pretrained(path)`` (or vLLM) reads:
``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards plus
``model.safetensors.index.json``, then ``config.json`` and the tokenizer. A training
rank exports as its ``ExportSettings`` say.

Guarantees: shards are written as the stream arrives, so at most one shard's
worth of tensors is held; everything goes into a temporary sibling folder that
is renamed into place only once complete, so ``path`` is either absent, the
previous export, or the new complete one — never half-written.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ExportSettings:
    """How a training rank exports (``TrainActor.export_hf``): the buckets it gathers at a
    time (``--update-weight-buffer-size``) and the checkpoint whose tokenizer goes beside
    the weights (``--hf-checkpoint``; None: weights and config only)."""

    bucket_bytes: int
    tokenizer: str | None


def save_hf_folder(
    path: str | os.PathLike[str],
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    *,
    config: Any,
    tokenizer: Any | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``buckets`` (lists of ``(hf_name, tensor)``) as a HF model folder at ``path``.

    ``config`` is a transformers config (anything with ``save_pretrained``);
    it is not modified. ``tokenizer``, when given, is saved with its own
    ``save_pretrained``. ``dtype`` casts floating-point tensors (integer
    buffers keep theirs); the written ``config.json`` records the float dtype
    actually written, so ``dtype="auto"`` loading gives it back. With
    ``config.tie_word_embeddings`` an incoming ``lm_head.weight`` is dropped:
    transformers re-ties it to the input embeddings on load.

    A shard holds several tensors up to ``max_shard_bytes``; a larger tensor
    gets a shard of its own. An existing folder at ``path`` is replaced only
    after the new one is complete. Returns the final path.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    with staged_folder(path) as staging:
        tie = bool(getattr(config, "tie_word_embeddings", False))
        writer = _ShardWriter(staging, max_shard_bytes)
        for bucket in buckets:
            for name, tensor in bucket:
                if tie and name == TIED_HEAD:
                    continue
                writer.add(name, _prepare(tensor, dtype))
        writer.finish()
        _save_config(config, staging, writer.float_dtypes)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
    return Path(path).absolute()


@contextmanager
def staged_folder(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh folder to write ``path``'s contents into; renamed onto ``path`` when the
    block ends without error (an existing folder is replaced only then), removed when
    it raises."""
    final = Path(path).absolute()
    if final.exists() and not final.is_dir():
        raise FileExistsError(f"{final} exists and is not a directory")
    final.parent.mkdir(parents=True, exist_ok=True)
    # A sibling on the same filesystem, so the final rename is a cheap, atomic
    # directory rename; the dot keeps it out of `ls` and of glob-based loaders.
    staging = _fresh_sibling(final, "tmp")
    # Plain mkdir (not mkdtemp's 0700) so the export gets the usual umask
    # permissions: engines or users under another account must read it.
    staging.mkdir()
    try:
        yield staging
        _swap_into_place(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _prepare(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.to("cpu").contiguous()


class _ShardWriter:
    """Accumulates tensors up to one shard, flushes it under a temporary name,
    and gives shards their final ``-of-N`` names once N is known."""

    def __init__(self, folder: Path, max_shard_bytes: int) -> None:
        self.folder = folder
        self.max_shard_bytes = max_shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.storages: set[int] = set()
        self.shard_names: list[list[str]] = []  # tensor names per flushed shard
        self.seen: set[str] = set()
        self.total_bytes = 0
        self.float_dtypes: set[torch.dtype] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.seen:
            raise ValueError(f"weight {name!r} arrived twice")
        self.seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        # safetensors refuses two tensors sharing memory in one file (e.g. a
        # state_dict's tied weights kept untied by the config): copy the second.
        ptr = tensor.untyped_storage().data_ptr()
        if nbytes and ptr in self.storages:
            tensor = tensor.clone()
            ptr = tensor.untyped_storage().data_ptr()
        self.storages.add(ptr)
        self.current[name] = tensor
        self.current_bytes += nbytes
        self.total_bytes += nbytes
        if tensor.is_floating_point():
            self.float_dtypes.add(tensor.dtype)

    def _flush(self) -> None:
        index = len(self.shard_names)
        save_file(self.current, self.folder / _temp_name(index), metadata={"format": "pt"})
        self.shard_names.append(list(self.current))
        self.current, self.current_bytes, self.storages = {}, 0, set()

    def finish(self) -> None:
        if self.current:
            self._flush()
        count = len(self.shard_names)
        if count == 0:
            raise ValueError("no weights to export: the bucket stream was empty")
        if count == 1:
            os.replace(self.folder / _temp_name(0), self.folder / SINGLE_FILE)
            return
        weight_map: dict[str, str] = {}
        for index, names in enumerate(self.shard_names):
            final_name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / _temp_name(index), self.folder / final_name)
            weight_map.update(dict.fromkeys(names, final_name))
        index_doc = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / INDEX_FILE).write_text(json.dumps(index_doc, indent=2, sort_keys=True))


def _temp_name(index: int) -> str:
    return f".shard-{index:05d}.safetensors.partial"


def _save_config(config: Any, folder: Path, float_dtypes: set[torch.dtype]) -> None:
    # Record the dtype actually written: loaders with dtype="auto" trust the
    # config over the tensors, so a stale float32 would upcast a bf16 export.
    if len(float_dtypes) == 1:
        config = copy.deepcopy(config)
        config.dtype = next(iter(float_dtypes))
    config.save_pretrained(str(folder))


def _swap_into_place(staging: Path, final: Path) -> None:
    if not final.exists():
        os.replace(staging, final)
        return
    # rename(2) cannot replace a non-empty directory, so move the old one
    # aside first; it is deleted only after the new folder holds the name.
    old = _fresh_sibling(final, "old")
    os.replace(final, old)
    try:
        os.replace(staging, final)
    except BaseException:
        os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _fresh_sibling(final: Path, tag: str) -> Path:
    return final.with_name(f".{final.name}.{tag}-{uuid.uuid4().hex[:12]}")
