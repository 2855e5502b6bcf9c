"""Folders the training ranks must see as the driver does, checked once at start-up.

Where it fits: ``vime.setup.actors.build_actors`` hands ``ActorSettings.rank_folders``
(``vime.config.settings``: the checkpoint folders, the exports, and the output folder
where the ranks read or write it) to ``RayTrainGroup.start_init``, which has every rank
check them before it initialises. The driver writes a marker holding a fresh token into each folder
(``write_markers``), every rank reads them back in its own process (``unseen``), and a
rank that cannot is refused with one line (``refusal``) naming the flag, the folder,
the rank and its node. On several nodes that is a folder on a node-local disk, or one
mounted differently there: without the check, a run would find out at its first save,
hours in, or lose a rank's shards.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Mapping, Sequence

from vime.errors import ConfigError

MARKER_PREFIX = ".vime-visible-"

# flag -> (marker path, the token it holds)
Markers = dict[str, tuple[str, str]]


def marker_folder(folder: str) -> str:
    """Where ``folder``'s marker goes: the folder, or while it does not exist yet (a save
    folder before the first save) its nearest existing parent, which the ranks will
    create it in."""
    path = os.path.abspath(folder)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def write_markers(folders: Sequence[tuple[str, str]]) -> Markers:
    """A marker in each ``(flag, folder)``'s ``marker_folder``; a folder the driver cannot
    write to (a read-only ``--load``) is left out, as is one inside a folder already
    marked."""
    markers: Markers = {}
    marked: list[str] = []
    token = secrets.token_hex(8)
    for flag, folder in folders:
        where = marker_folder(folder)
        if any(where == m or where.startswith(m + os.sep) for m in marked):
            continue
        path = os.path.join(where, MARKER_PREFIX + token)
        try:
            with open(path, "w") as marker:
                marker.write(token)
        except OSError:
            continue
        marked.append(where)
        markers[flag] = (path, token)
    return markers


def unseen(markers: Mapping[str, tuple[str, str]]) -> list[str]:
    """The flags whose marker this process cannot read back as written (run in a rank)."""
    missing = []
    for flag, (path, token) in markers.items():
        try:
            with open(path) as marker:
                seen = marker.read()
        except OSError:
            seen = None
        if seen != token:
            missing.append(flag)
    return missing


def remove_markers(markers: Mapping[str, tuple[str, str]]) -> None:
    for path, _ in markers.values():
        with contextlib.suppress(OSError):
            os.remove(path)


def refusal(flag: str, folder: str, rank: int, node: str) -> ConfigError:
    """The one line for training rank ``rank`` on ``node`` not seeing ``flag``'s ``folder``."""
    return ConfigError(
        f"{flag} {folder}: training rank {rank} on node {node} does not see the file the "
        "driver just wrote there; every training node must see this folder as the driver "
        "does (storage they all mount at the same path), or give a folder that is"
    )
