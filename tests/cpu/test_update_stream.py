"""An engine update fed over several calls is one update of the whole set.

Proves, for ``vime.weights.update_stream.UpdateStream`` driving a real ``HFEngine``:
a set streamed one tensor per ``put`` (every decoder layer split across calls) leaves
the engine holding exactly the new weights and serving the new version, through a
single ``update_weights`` call; ``put`` returns only once the update has finished
with the bucket (a sender may then reuse its memory); the engine's own error (an
unknown name, an incomplete set) comes out of the ``put`` or ``finish`` that meets it,
and an update that stops taking buckets is reported, never waited on for ever;
``abort`` ends the update and leaves the served version as it was. The same stream
into vLLM is in ``test_vllm_engine.py``, and through Ray and a gloo broadcast with
small buckets in ``test_trainer.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.cpu.tiny_models import save_tiny, tiny_qwen3_config
from vime.rollout.engines.hf import HFEngine
from vime.weights.update_stream import UpdateStream


@pytest.fixture
def engine(tmp_path) -> HFEngine:
    return HFEngine(save_tiny(str(tmp_path / "model"), tiny_qwen3_config(), seed=0))


def _new_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(seed)
    return list(AutoModelForCausalLM.from_config(tiny_qwen3_config()).state_dict().items())


def test_a_set_streamed_tensor_by_tensor_is_loaded_whole(engine: HFEngine) -> None:
    new = _new_weights(seed=1)
    calls = []

    def update(buckets):
        calls.append(threading.current_thread().name)
        engine.update_weights(buckets, version=5)

    stream = UpdateStream(update)
    for item in new:  # q, k and v of one layer in different puts
        stream.put([item])
    assert engine.weight_version == 0  # the set is complete only at finish
    stream.finish()
    assert engine.weight_version == 5
    assert calls == ["vime-weight-update"]  # one update call, on the stream's thread
    state = engine.model.state_dict()
    for name, tensor in new:
        assert torch.equal(state[name], tensor), name


def test_put_returns_once_the_update_is_done_with_the_bucket() -> None:
    seen: list[str] = []

    def update(buckets):
        for bucket in buckets:
            for name, _ in bucket:
                seen.append(name)

    stream = UpdateStream(update)
    for k in range(5):
        stream.put([(f"w{k}", torch.zeros(1))])
        assert seen == [f"w{i}" for i in range(k + 1)]
    stream.finish()


def test_the_engines_error_reaches_the_caller(engine: HFEngine) -> None:
    new = _new_weights(seed=2)
    stream = UpdateStream(lambda buckets: engine.update_weights(buckets, version=1))
    stream.put(new[:2])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.bogus' is not a tensor"):
        stream.put([("model.layers.0.bogus", torch.zeros(1))])
        stream.finish()  # where the error lands depends on timing; it lands
    assert engine.weight_version == 0

    incomplete = UpdateStream(lambda buckets: engine.update_weights(buckets, version=1))
    incomplete.put(new[:3])
    with pytest.raises(ValueError, match="not sent"):
        incomplete.finish()
    assert engine.weight_version == 0


def test_an_update_that_stops_taking_buckets_is_reported() -> None:
    def takes_one(buckets):
        next(iter(buckets))

    stream = UpdateStream(takes_one)
    with pytest.raises(RuntimeError, match="ended before it took every bucket"):
        stream.put([("a", torch.zeros(1))])  # it returned instead of asking for more


def test_abort_ends_the_update_and_keeps_the_version(engine: HFEngine) -> None:
    new = _new_weights(seed=3)
    stream = UpdateStream(lambda buckets: engine.update_weights(buckets, version=9))
    stream.put(new[:4])
    stream.abort()  # the sender failed half-way: the incomplete set is refused quietly
    assert engine.weight_version == 0
    stream.abort()  # idempotent
