"""The checkpoint layout and its crash-safe commit protocol (vime.checkpoint).

Proves that metadata and the caller's extra state round-trip; that the tracker
is replaced only once the named folder is complete under its final name; that
a crash injected before every filesystem mutation of a commit (new id and
re-save of the same id) still leaves the last complete checkpoint loadable and
the next save succeeds; that re-saving an id replaces its content; that
--keep-last-checkpoints prunes only older folders; that every kind of broken
folder is reported with its name; that ``resume_point`` starts a missing, empty or
crashed-first-save folder from scratch but refuses a checkpoint folder itself or
checkpoints whose tracker is lost; that a writer SIGKILLed at random moments
always leaves ``latest()`` naming a verified checkpoint with intact content;
and that the RNG helpers make the next random draws identical after a restore.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from vime import checkpoint as ck


def _content(rollout_id: int, name: str, size: int) -> bytes:
    block = hashlib.sha256(f"{rollout_id}:{name}".encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def _save(save_dir: Path, rollout_id: int, sizes=None, keep_last=None, tag: int = 0) -> Path:
    """One save by a single-rank job; file content derives from (rollout_id, tag)."""
    sizes = sizes or {"model/shard_0.bin": 1000, "optim.bin": 300}
    partial = ck.begin_save(save_dir, rollout_id, is_rank0=True)
    for name, size in sizes.items():
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        (partial / name).write_bytes(_content(rollout_id * 1000 + tag, name, size))
    extra = {"step": rollout_id * 10, "data_pos": [rollout_id, tag]}
    return ck.commit_save(
        save_dir, rollout_id, backend="fsdp2", world_size=2, extra=extra, keep_last=keep_last
    )


def _final_ids(save_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in save_dir.glob("iter_*"))


def test_round_trip_metadata_and_extra(tmp_path: Path) -> None:
    assert ck.latest(tmp_path / "nothing") is None
    assert ck.latest(tmp_path) is None
    path = _save(tmp_path, 5)
    assert path == ck.iteration_dir(tmp_path, 5) == tmp_path / "iter_0000005"
    assert ck.latest(tmp_path) == 5
    assert (tmp_path / ck.TRACKER).read_text() == "5"
    meta = ck.verify(path)
    assert meta["rollout_id"] == 5 and meta["backend"] == "fsdp2" and meta["world_size"] == 2
    assert meta["extra"] == {"step": 50, "data_pos": [5, 0]}
    assert meta["files"] == [
        {"path": "model/shard_0.bin", "size": 1000},
        {"path": "optim.bin", "size": 300},
    ]
    assert ck.load_metadata(path) == meta
    assert not ck.partial_dir(tmp_path, 5).exists()


def test_begin_save_clears_stale_partials_only_on_rank0(tmp_path: Path) -> None:
    stale = ck.partial_dir(tmp_path, 7)
    stale.mkdir(parents=True)
    (stale / "junk").write_bytes(b"x" * 10)
    # Non-zero ranks compute the same path and touch nothing.
    assert ck.begin_save(tmp_path, 7, is_rank0=False) == stale
    assert (stale / "junk").exists()
    assert ck.begin_save(tmp_path, 7, is_rank0=True) == stale
    assert stale.is_dir() and not any(stale.iterdir())


def test_tracker_is_replaced_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 1)
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        if Path(dst).name == ck.TRACKER:
            # At this instant the new folder must be complete under its final name.
            seen.append(ck.verify(ck.iteration_dir(tmp_path, 2))["rollout_id"])
            assert not ck.partial_dir(tmp_path, 2).exists()
            assert (tmp_path / ck.TRACKER).read_text() == "1"
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    _save(tmp_path, 2)
    assert seen == [2]
    assert ck.latest(tmp_path) == 2


class _Crash(Exception):
    pass


@pytest.mark.parametrize("resave", [False, True], ids=["new-id", "same-id"])
def test_crash_before_each_step_of_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resave: bool
) -> None:
    """Die before the k-th rename/replace/rmtree of a commit, for every k."""
    target = 2 if resave else 3
    for k in range(50):
        save = tmp_path / f"k{k}"
        _save(save, 1)
        _save(save, 2)
        calls = [0]

        def crashing(real, k=k, calls=calls):
            def wrapper(*args, **kwargs):
                calls[0] += 1
                if calls[0] > k:
                    raise _Crash
                return real(*args, **kwargs)

            return wrapper

        with monkeypatch.context() as m:
            m.setattr(os, "rename", crashing(os.rename))
            m.setattr(os, "replace", crashing(os.replace))
            m.setattr(shutil, "rmtree", crashing(shutil.rmtree))
            partial = ck.begin_save(save, target, is_rank0=True)
            (partial / "w.bin").write_bytes(_content(target, "new", 4096))
            try:
                ck.commit_save(save, target, backend="megatron", world_size=1, extra={"k": k})
                finished = True
            except _Crash:
                finished = False
        rid = ck.latest(save)
        assert rid in ({2} if resave else {2, 3}), (k, rid)
        meta = ck.verify(ck.iteration_dir(save, rid))
        if meta["extra"] == {"k": k}:  # the new save became visible
            assert (ck.iteration_dir(save, rid) / "w.bin").read_bytes() == _content(
                target, "new", 4096
            )
        else:
            assert meta["extra"] == {"step": rid * 10, "data_pos": [rid, 0]}
        # The next save after the crash must work and leave no debris.
        _save(save, 4, keep_last=2)
        assert ck.latest(save) == 4
        assert _final_ids(save)[-1] == 4 and len(_final_ids(save)) == 2
        assert not [p for p in save.iterdir() if p.name.startswith(".iter_")]
        if finished:
            assert k >= (4 if resave else 2)  # every step of the protocol was crashed
            break
    else:
        pytest.fail("commit never finished")


def test_resave_same_id_replaces_content(tmp_path: Path) -> None:
    _save(tmp_path, 3, sizes={"a.bin": 100, "b.bin": 200}, tag=1)
    _save(tmp_path, 3, sizes={"a.bin": 150}, tag=2)
    path = ck.iteration_dir(tmp_path, 3)
    meta = ck.verify(path)
    assert meta["files"] == [{"path": "a.bin", "size": 150}]
    assert meta["extra"]["data_pos"] == [3, 2]
    assert (path / "a.bin").read_bytes() == _content(3002, "a.bin", 150)
    assert not (path / "b.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", ck.TRACKER]


def test_keep_last_prunes_older_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        _save(tmp_path, 0, keep_last=0)
    for rid in range(1, 6):
        _save(tmp_path, rid, keep_last=2)
        assert _final_ids(tmp_path) == list(range(max(1, rid - 1), rid + 1))
    # Resumed from further back (tracker moved back to 3 by re-saving it): newer
    # folders from the abandoned future are left alone, older ones pruned.
    for rid in range(1, 4):
        _save(tmp_path, rid)
    _save(tmp_path, 3, keep_last=1)
    assert _final_ids(tmp_path) == [3, 4, 5]
    assert ck.latest(tmp_path) == 3
    _save(tmp_path, 6, keep_last=1)
    assert _final_ids(tmp_path) == [6]


def test_verify_errors_name_the_folder(tmp_path: Path) -> None:
    def broken(rid: int, how) -> Path:
        path = _save(tmp_path, rid)
        how(path)
        return path

    cases = {
        "does not exist": tmp_path / "iter_0000099",
        "partial": ck.begin_save(tmp_path, 98, is_rank0=True),
        "partial ": broken(1, lambda p: (p / ck.METADATA).unlink()),
        "invalid": broken(2, lambda p: (p / ck.METADATA).write_text('{"format_version": 1,')),
        "invalid ": broken(3, lambda p: (p / ck.METADATA).write_text('{"files": []}')),
        "lacks optim.bin": broken(4, lambda p: (p / "optim.bin").unlink()),
        "has 999 bytes, expected 1000": broken(
            5, lambda p: os.truncate(p / "model" / "shard_0.bin", 999)
        ),
        "holds rollout 6": broken(6, lambda p: p.rename(tmp_path / "iter_0000060")).parent
        / "iter_0000060",
    }
    for expected, path in cases.items():
        with pytest.raises(ck.CheckpointError) as info:
            ck.verify(path)
        message = str(info.value)
        assert expected.strip() in message and str(path) in message, message
        assert "\n" not in message


def test_tracker_errors_name_tracker_and_folder(tmp_path: Path) -> None:
    _save(tmp_path, 4)
    shutil.rmtree(ck.iteration_dir(tmp_path, 4))
    with pytest.raises(ck.CheckpointError) as info:
        ck.latest(tmp_path)
    assert str(tmp_path / ck.TRACKER) in str(info.value)
    assert str(ck.iteration_dir(tmp_path, 4)) in str(info.value)
    (tmp_path / ck.TRACKER).write_text("release")
    with pytest.raises(ck.CheckpointError, match="release"):
        ck.latest(tmp_path)


def test_resume_point_starts_fresh_only_where_nothing_was_committed(tmp_path: Path) -> None:
    assert ck.resume_point(tmp_path / "missing") is None
    assert ck.resume_point(tmp_path) is None  # empty: the first run of a resumable job
    ck.begin_save(tmp_path, 0, is_rank0=True)  # a first save that crashed before its commit
    assert ck.resume_point(tmp_path) is None
    _save(tmp_path, 3)
    _save(tmp_path, 4)
    assert ck.resume_point(tmp_path) == 4
    for folder in (ck.iteration_dir(tmp_path, 4), tmp_path / "iter_0000009"):
        with pytest.raises(ck.CheckpointError) as info:
            ck.resume_point(folder)
        assert f"--load {folder} names a checkpoint folder itself" in str(info.value)
        assert f"(--load {tmp_path})" in str(info.value)
    (tmp_path / ck.TRACKER).unlink()
    with pytest.raises(ck.CheckpointError) as info:
        ck.resume_point(tmp_path)
    message = str(info.value)
    assert f"--load {tmp_path} holds iter_0000003, iter_0000004 but no {ck.TRACKER}" in message
    assert "\n" not in message


# A writer that saves forever: ids base, base, base+1, base+1, ... (every other
# save re-saves an id), three files of 1 MiB written in 64 KiB chunks.
_WRITER = """
import hashlib, itertools, sys
from vime import checkpoint as ck
save = sys.argv[1]
base = ck.latest(save) or 0
for i in itertools.count():
    rid = base + i // 2
    partial = ck.begin_save(save, rid, is_rank0=True)
    for name in ("model/shard_0.bin", "model/shard_1.bin", "optim.bin"):
        (partial / name).parent.mkdir(exist_ok=True)
        block = hashlib.sha256(f"{rid}:{name}".encode()).digest() * 2048
        with open(partial / name, "wb") as f:
            for _ in range(16):
                f.write(block)
    ck.commit_save(save, rid, backend="fsdp2", world_size=1, extra={"rid": rid}, keep_last=2)
"""


def test_sigkill_at_random_moments_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(1234)
    repo = Path(ck.__file__).resolve().parents[1]
    previous = None
    for _ in range(15):
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], cwd=repo)
        time.sleep(rng.uniform(0.1, 0.7))
        writer.send_signal(signal.SIGKILL)
        assert writer.wait() == -signal.SIGKILL, "writer died on its own"
        rid = ck.latest(tmp_path)
        if rid is None:
            assert previous is None
            continue
        assert previous is None or rid >= previous
        path = ck.iteration_dir(tmp_path, rid)
        meta = ck.verify(path)
        assert meta["extra"] == {"rid": rid}
        assert len(meta["files"]) == 3
        for entry in meta["files"]:
            assert entry["size"] == 1 << 20
            assert (path / entry["path"]).read_bytes() == _content(rid, entry["path"], 1 << 20)
        # Pruning kept up: at most keep_last plus one not yet pruned.
        assert len(_final_ids(tmp_path)) <= 3
        previous = rid
    assert previous is not None and previous >= 5, f"too few commits: {previous}"


def test_rng_state_round_trip_gives_identical_draws() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leaves a cached gaussian inside numpy's state
    buffer = io.BytesIO()
    torch.save(ck.rng_state(), buffer)

    def draws() -> tuple:
        return (
            random.random(),
            random.getrandbits(64),
            np.random.normal(),
            np.random.rand(3).tolist(),
            torch.rand(4).tolist(),
            torch.randint(0, 1 << 30, (2,)).tolist(),
        )

    first = draws()
    draws()
    buffer.seek(0)
    ck.set_rng_state(torch.load(buffer, weights_only=True))
    assert draws() == first


def test_check_shared_names_each_ranks_view_and_the_fix() -> None:
    """Equal views pass; differing ones raise one line with every rank's view."""
    ck.check_shared("--load", "/ckpt", [3, 3, 3], "newest checkpoints")
    with pytest.raises(ck.CheckpointError) as err:
        ck.check_shared("--load", "/ckpt", [3, None], "newest checkpoints")
    message = str(err.value)
    assert message.startswith("--load /ckpt: the ranks see different newest checkpoints")
    assert "rank 0: 3, rank 1: None" in message
    assert "every training node shares" in message and "\n" not in message
