"""Fixtures shared by the CPU test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    """A one-process gloo world with megatron's parallel state (TP=1) around the module."""
    from vime.backends.megatron import model as mmodel
    from vime.weights.transports import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    mmodel.init_model_parallel(tp=1, seed=1234)
    yield
    mmodel.destroy_model_parallel()
