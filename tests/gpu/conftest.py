"""Skip every test under tests/gpu where CUDA is absent (CI and the CPU dev box).

Collection still imports the modules, so they must import cleanly on a CPU-only
machine: keep CUDA work inside the tests, never at module level.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)
