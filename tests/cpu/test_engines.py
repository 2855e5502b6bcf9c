"""``vime.ray.engines``: the engine choice and how prompts are split over engines.

Proves that ``--rollout-engine auto`` picks vLLM exactly when it can be imported
and says why, that an explicit choice is kept, and that the prompt split gives
every engine a contiguous chunk, sizes differing by at most one, covering every
prompt once.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest

from vime.ray import engines
from vime.ray.engines import _split, resolve_engine


@pytest.mark.parametrize("have_vllm", [True, False])
def test_auto_picks_vllm_when_importable(monkeypatch: pytest.MonkeyPatch, have_vllm) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args):
        if name == "vllm":
            return object() if have_vllm else None
        return real(name, *args)

    monkeypatch.setattr(engines.importlib.util, "find_spec", find_spec)
    kind, reason = resolve_engine("auto")
    assert kind == ("vllm" if have_vllm else "hf")
    assert reason == ("auto: vllm is importable" if have_vllm else "auto: vllm is not installed")
    assert resolve_engine("hf") == ("hf", "--rollout-engine hf")
    assert resolve_engine("vllm") == ("vllm", "--rollout-engine vllm")


@pytest.mark.parametrize(("n", "parts"), [(0, 1), (7, 1), (7, 3), (8, 4), (3, 5)])
def test_split_is_contiguous_and_balanced(n: int, parts: int) -> None:
    chunks = _split(n, parts)
    assert len(chunks) == parts
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    sizes = [stop - start for start, stop in chunks]
    assert max(sizes) - min(sizes) <= 1
