"""The start-up check that the ranks see the run's folders (``vime.ray.folders``).

Proves that the driver's markers go into each folder, or into the nearest existing
parent of one not made yet, once per folder (a folder inside one already marked is
left out); that a rank reading them back names the flags whose marker it cannot read
or reads with another token; that the refusal is one line naming flag, folder, rank
and node; and which folders a run's ranks are checked on (``rank_folders``).
The multi-node case, with a node that really sees a folder differently, is
``test_multinode.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

from vime.config import parse_args
from vime.config.settings import rank_folders
from vime.ray import folders


def test_markers_are_written_read_back_and_removed(tmp_path: Path) -> None:
    out, later = tmp_path / "out", tmp_path / "ckpt" / "deeper"
    out.mkdir()
    markers = folders.write_markers(
        [("--output-dir", str(out)), ("--save-hf", str(out / "hf")), ("--save", str(later))]
    )
    assert set(markers) == {"--output-dir", "--save"}  # --save-hf lies inside the output
    assert Path(markers["--output-dir"][0]).parent == out
    assert Path(markers["--save"][0]).parent == tmp_path  # ckpt/ does not exist yet
    assert folders.unseen(markers) == []
    Path(markers["--save"][0]).write_text("another run's token")
    os.remove(markers["--output-dir"][0])
    assert folders.unseen(markers) == ["--output-dir", "--save"]
    folders.remove_markers(markers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_refusal_is_one_line_naming_what_and_where() -> None:
    message = str(folders.refusal("--save", "/ckpt", 2, "10.0.0.7 (Ray node abc)"))
    assert message.startswith("--save /ckpt: training rank 2 on node 10.0.0.7 (Ray node abc)")
    assert "\n" not in message


def test_which_folders_the_ranks_are_checked_on(tmp_path: Path) -> None:
    out = tmp_path / "out"
    base = ["--output-dir", str(out)]
    assert rank_folders(parse_args(base)) == ()  # the metrics are the driver's alone
    assert rank_folders(parse_args([*base, "--save", "ck"])) == (("--save", "ck"),)
    embedded = parse_args(base).replace(hf_checkpoint=str(out / "model"))
    assert rank_folders(embedded) == (("--output-dir", str(out)),)
    disk = parse_args([*base, "--weight-sync", "disk", "--load", str(tmp_path)])
    assert rank_folders(disk) == (("--output-dir", str(out)), ("--load", str(tmp_path)))
