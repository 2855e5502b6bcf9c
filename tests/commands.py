"""How a test starts ``vime-train``: as a user does, through the console script."""

from __future__ import annotations

import sys
from pathlib import Path


def vime_train_command() -> list[str]:
    """The ``vime-train`` beside this Python (the installed console script), or
    ``python -m vime.cli`` where the package is on the path but not installed."""
    script = Path(sys.executable).with_name("vime-train")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vime.cli"]
