"""Checkpoint folder layout and its crash-safe commit protocol.

Both training backends save through this module: it hands them a folder, they
write their tensors into it (fsdp2 with torch.distributed.checkpoint, megatron
with dist_checkpointing), and it commits the folder so that a process killed at
any moment leaves the last complete checkpoint loadable. Layout::

    SAVE_DIR/iter_0000005/                       one complete checkpoint
    SAVE_DIR/iter_0000005/vime_checkpoint.json   metadata, written at commit
    SAVE_DIR/latest_checkpointed_iteration.txt   the tracker: "5", written last

Protocol: every rank calls ``begin_save`` (rank 0 clears leftovers of crashed
saves), the caller barriers, every rank writes into ``.iter_N.partial``, the
caller barriers, rank 0 calls ``commit_save``: metadata with file sizes, fsync,
rename to ``iter_N``, fsync, atomic tracker replace, prune. The tracker thus
only ever names a folder that is already complete under its final name.
Assumes one writing job per SAVE_DIR, on a filesystem every rank sees. A training
rank's folders and pruning come in its ``CheckpointSettings``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "vime_checkpoint.json"
_FINAL_RE = re.compile(r"iter_(\d{7,})")
# Hidden names of in-flight folders: a save being written, the previous copy of
# a re-saved id while it is replaced, a pruned folder while it is deleted.
_HIDDEN_RE = re.compile(r"\.iter_(\d{7,})\.(partial|old|trash)")


class CheckpointError(ValueError):
    """A checkpoint folder or tracker is missing, unfinished or corrupt."""


@dataclass(frozen=True)
class CheckpointSettings:
    """Where a training rank saves and resumes: ``--save``, ``--load`` (None: not at all)
    and ``--keep-last-checkpoints`` (None: keep every one)."""

    save: str | None
    load: str | None
    keep_last: int | None


def iteration_dir(save_dir: str | os.PathLike, rollout_id: int) -> Path:
    """The final folder of ``rollout_id``: ``SAVE_DIR/iter_{rollout_id:07d}``."""
    return Path(save_dir) / f"iter_{rollout_id:07d}"


def _hidden(save_dir: str | os.PathLike, rollout_id: int, kind: str) -> Path:
    return Path(save_dir) / f".iter_{rollout_id:07d}.{kind}"


def partial_dir(save_dir: str | os.PathLike, rollout_id: int) -> Path:
    """Where a save of ``rollout_id`` is written before its commit (same on every rank)."""
    return _hidden(save_dir, rollout_id, "partial")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        # Some filesystems refuse fsync on a directory (EINVAL); the rename
        # itself is still atomic there, only its durability is up to the fs.
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def _restore_aside(save_dir: Path, rollout_id: int) -> None:
    """Undo a re-save killed between moving the old copy aside and renaming the new in."""
    final, aside = iteration_dir(save_dir, rollout_id), _hidden(save_dir, rollout_id, "old")
    if not final.exists() and aside.is_dir():
        # Failing means another rank restored it first; the caller re-checks `final`.
        with contextlib.suppress(OSError):
            os.rename(aside, final)


def begin_save(save_dir: str | os.PathLike, rollout_id: int, *, is_rank0: bool) -> Path:
    """Start a save of ``rollout_id`` and return the partial folder to write into.

    Call on every rank. Rank 0 clears what crashed saves left behind (partial
    and half-deleted folders; a set-aside copy is restored or dropped) and
    creates an empty partial folder; other ranks only compute the path, so the
    caller must barrier before any rank writes into it.
    """
    save_dir = Path(save_dir)
    partial = partial_dir(save_dir, rollout_id)
    if not is_rank0:
        return partial
    save_dir.mkdir(parents=True, exist_ok=True)
    for entry in sorted(save_dir.iterdir()):
        match = _HIDDEN_RE.fullmatch(entry.name)
        if match is None or not entry.is_dir():
            continue
        if match[2] == "old":
            _restore_aside(save_dir, int(match[1]))
        if entry.exists():
            shutil.rmtree(entry)
    partial.mkdir()
    return partial


def _list_files(folder: Path) -> list[dict[str, Any]]:
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / METADATA)
    return [{"path": p.relative_to(folder).as_posix(), "size": p.stat().st_size} for p in paths]


def commit_save(
    save_dir: str | os.PathLike,
    rollout_id: int,
    *,
    backend: str,
    world_size: int,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Commit the partial folder of ``rollout_id`` and return its final path (rank 0 only).

    Call after every rank has finished writing (the caller barriers). ``extra``
    is JSON-serialisable training state (step counters, data position) that
    ``load_metadata`` returns under ``"extra"``. With ``keep_last=N`` the N
    newest checkpoints up to this one are kept and older ones deleted.
    """
    save_dir = Path(save_dir)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    partial = partial_dir(save_dir, rollout_id)
    final = iteration_dir(save_dir, rollout_id)
    aside = _hidden(save_dir, rollout_id, "old")
    if not partial.is_dir():
        raise CheckpointError(f"{partial}: no partial checkpoint to commit (begin_save not run?)")
    files = _list_files(partial)
    metadata = {
        "format_version": FORMAT_VERSION,
        "rollout_id": rollout_id,
        "backend": backend,
        "world_size": world_size,
        "saved_at": time.time(),
        "extra": extra or {},
        "files": files,
    }
    text = json.dumps(metadata, indent=1)  # fails on unserialisable extra before any I/O
    (partial / METADATA).write_text(text)
    # Everything must be on disk before the rename makes the folder "complete".
    _fsync_folder(partial, files)

    # Re-saving an id: the old copy stays complete under `aside` until the new
    # one has its name; latest() and begin_save() put it back if we die between.
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(partial, final)
    _fsync_path(save_dir)
    _write_tracker(save_dir, rollout_id)

    if aside.exists():
        shutil.rmtree(aside)
    if keep_last is not None:
        _prune(save_dir, rollout_id, keep_last)
    return final


def _fsync_folder(folder: Path, files: list[dict[str, Any]]) -> None:
    """fsync the listed ``files``, the metadata file, then every folder bottom-up."""
    for entry in [*files, {"path": METADATA}]:
        _fsync_path(folder / entry["path"])
    for root, _dirs, _names in os.walk(folder, topdown=False):
        _fsync_path(Path(root))


def _write_tracker(save_dir: Path, rollout_id: int) -> None:
    """Point the tracker at ``rollout_id``: write a temporary file, fsync it, replace the
    tracker atomically, fsync the folder, so a reader sees the old id or the new one."""
    tracker, tmp = save_dir / TRACKER, save_dir / f".{TRACKER}.tmp"
    with open(tmp, "w") as f:
        f.write(str(rollout_id))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker)
    _fsync_path(save_dir)


def _prune(save_dir: Path, committed: int, keep_last: int) -> None:
    """Delete checkpoints older than the ``keep_last`` newest up to ``committed``.

    Folders with a higher id (left by a run that was resumed from further
    back) are not ours to judge and stay.
    """
    older = sorted(
        (int(m[1]) for e in save_dir.iterdir() if (m := _FINAL_RE.fullmatch(e.name))),
        reverse=True,
    )
    older = [rid for rid in older if rid < committed]
    for rid in older[keep_last - 1 :]:
        # Renamed first so a kill mid-delete leaves no half folder under a final name.
        trash = _hidden(save_dir, rid, "trash")
        os.rename(iteration_dir(save_dir, rid), trash)
        shutil.rmtree(trash)


def latest(save_dir: str | os.PathLike) -> int | None:
    """The rollout id the tracker names, or None when there is none (a fresh run).

    Raises CheckpointError when the tracker is unreadable or names a folder
    that does not exist. Repairs the one crash window of a re-save (the old
    copy set aside, the new one not yet renamed in) by restoring the old copy.
    """
    save_dir = Path(save_dir)
    tracker = save_dir / TRACKER
    try:
        text = tracker.read_text()
    except FileNotFoundError:
        return None
    try:
        rollout_id = int(text.strip())
    except ValueError:
        raise CheckpointError(f"tracker {tracker} holds {text[:40]!r}, not a rollout id") from None
    final = iteration_dir(save_dir, rollout_id)
    _restore_aside(save_dir, rollout_id)
    if not final.is_dir():
        raise CheckpointError(f"tracker {tracker} names {final}, which does not exist")
    return rollout_id


def check_shared(flag: str, folder: str | os.PathLike, views: list[Any], what: str) -> None:
    """CheckpointError unless every rank's view of ``folder`` (``views[r]``, gathered from
    rank r) is the same: ranks on several nodes see different things there when the
    folder is not on a filesystem they all share. ``what`` names the view."""
    if all(view == views[0] for view in views):
        return
    seen = ", ".join(f"rank {r}: {view}" for r, view in enumerate(views))
    raise CheckpointError(
        f"{flag} {folder}: the ranks see different {what} ({seen}); it must be a folder "
        "every training node shares (a network filesystem)"
    )


def resume_point(load_dir: str | os.PathLike) -> int | None:
    """The rollout id ``--load`` resumes from, or None to start from scratch.

    None only when nothing was ever committed there: a missing or empty folder (or one
    holding nothing but a crashed first save) is the first run of a resumable job. A
    folder that holds checkpoints but no tracker, or that is itself a checkpoint, raises
    CheckpointError: starting over there would silently throw the training away.
    """
    load_dir = Path(load_dir)
    rollout_id = latest(load_dir)
    if rollout_id is not None:
        return rollout_id
    if _FINAL_RE.fullmatch(load_dir.name) or (load_dir / METADATA).is_file():
        raise CheckpointError(
            f"--load {load_dir} names a checkpoint folder itself; pass the folder that holds "
            f"it and {TRACKER} (--load {load_dir.parent})"
        )
    entries = load_dir.iterdir() if load_dir.is_dir() else ()
    found = sorted(e.name for e in entries if _FINAL_RE.fullmatch(e.name))
    if found:
        raise CheckpointError(
            f"--load {load_dir} holds {', '.join(found[-3:])} but no {TRACKER}; write the "
            f"rollout id to resume from into {load_dir / TRACKER}"
        )
    return None


def load_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint folder's metadata without checking its files (see ``verify``)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if _HIDDEN_RE.fullmatch(path.name) or not (path / METADATA).is_file():
        raise CheckpointError(f"checkpoint folder {path} is partial: its save never committed")
    try:
        metadata = json.loads((path / METADATA).read_text())
        version, files = metadata["format_version"], metadata["files"]
        sizes = {entry["path"]: int(entry["size"]) for entry in files}
        rollout_id = int(metadata["rollout_id"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint folder {path} has invalid {METADATA}: {e}") from None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint folder {path} has format {version}, not {FORMAT_VERSION}"
        )
    match = _FINAL_RE.fullmatch(path.name)
    if match and int(match[1]) != rollout_id:
        raise CheckpointError(f"checkpoint folder {path} holds rollout {rollout_id}")
    metadata["files"] = [{"path": p, "size": s} for p, s in sizes.items()]
    return metadata


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Check that a checkpoint folder is complete and return its metadata.

    Raises CheckpointError naming the folder when it is missing, partial, has
    missing or invalid metadata, or a listed file is missing or has the wrong size.
    """
    path = Path(path)
    metadata = load_metadata(path)
    for entry in metadata["files"]:
        file = path / entry["path"]
        if not file.is_file():
            raise CheckpointError(f"checkpoint folder {path} lacks {entry['path']}")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint folder {path}: {entry['path']} has {size} bytes,"
                f" expected {entry['size']}"
            )
    return metadata


def rng_state() -> dict[str, Any]:
    """This process's random generators: python, numpy, torch CPU, and CUDA when present.

    Plain containers and tensors only, so ``torch.load(weights_only=True)`` reads it back.
    """
    import numpy as np
    import torch

    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            **np_state,
            "state": {**np_state["state"], "key": np_state["state"]["key"].tolist()},
        },
        "torch": torch.get_rng_state(),
    }
    from vime import device as vime_device

    cuda = vime_device.cuda_rng_states()
    if cuda is not None:
        state["cuda"] = cuda
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore generators captured by ``rng_state`` (CUDA only when both sides have it)."""
    import numpy as np
    import torch

    version, internal, rest = state["python"]
    random.setstate((version, tuple(internal), rest))
    np_state = state["numpy"]
    key = np.asarray(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state({**np_state, "state": {**np_state["state"], "key": key}})
    torch.set_rng_state(state["torch"])
    from vime import device as vime_device

    vime_device.set_cuda_rng_states(state.get("cuda"))
