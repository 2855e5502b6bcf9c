"""Where the vLLM engine writes a weight set for workers in other processes.

Proves, without vLLM: ``reload_dir`` picks the RAM-backed folder when it holds the
checkpoint's weights with room to spare, and the system's temporary folder (None)
when it does not (a container's 64 MB ``/dev/shm`` against a multi-GB model) or when
the folder does not exist.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vime.rollout.engines.vllm import reload_dir


def test_ram_folder_only_when_the_weights_fit(tmp_path: Path) -> None:
    shm, checkpoint = tmp_path / "shm", tmp_path / "model"
    shm.mkdir()
    checkpoint.mkdir()
    small = checkpoint / "model.safetensors"
    small.write_bytes(b"\0" * 1024)
    assert reload_dir(str(checkpoint), str(shm)) == str(shm)
    # A sparse file as large as twice the free space: no bytes written, the size counts.
    free = shutil.disk_usage(shm).free
    with open(checkpoint / "model-00002-of-00002.safetensors", "wb") as f:
        f.truncate(2 * free)
    assert reload_dir(str(checkpoint), str(shm)) is None
    assert reload_dir(str(checkpoint), str(tmp_path / "absent")) is None
    os.remove(checkpoint / "model-00002-of-00002.safetensors")
    assert reload_dir(str(checkpoint), str(shm)) == str(shm)
