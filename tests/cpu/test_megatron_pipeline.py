"""``vime.backends.megatron.pipeline``: which stage holds what, and the schedule's guard.

Proves: layers are split into equal consecutive runs and renumbered between a
stage's local names and the model's global (HF-convertible) names; the embeddings
belong to the first stage and the final norm and output layer to the last; the last
stage's copy of tied embeddings maps to the embedding and is recognised as a copy
(only with tying and more than one stage); a layer count the stage count does not
divide is an error naming the flag, at start-up and already when the flags are
parsed (exit code 2 before any process starts); ``run_schedule`` refuses a model
whose config would rescale vime's loss. The schedule itself runs in
``test_megatron_actor.py`` (PP=2 against fsdp2) and ``test_megatron_shims.py``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from actor_harness import actor_args

pytest.importorskip("megatron.core")

from vime.backends.megatron.pipeline import EMBEDDING, TIED_COPY, Stage, run_schedule
from vime.config.errors import ConfigError


def test_layers_split_into_equal_runs_and_renumbered() -> None:
    stages = [Stage(rank, 4, 8, tied=False) for rank in range(4)]
    assert [s.first_layer for s in stages] == [0, 2, 4, 6]
    assert [s.layers_per_stage for s in stages] == [2] * 4
    third = stages[2]
    assert third.global_name("decoder.layers.1.mlp.linear_fc1.weight") == (
        "decoder.layers.5.mlp.linear_fc1.weight"
    )
    assert third.global_name("decoder.layers.0.self_attention.linear_qkv.weight") == (
        "decoder.layers.4.self_attention.linear_qkv.weight"
    )
    # Every global layer is owned by exactly the stage whose local names map onto it.
    for index in range(8):
        name = f"decoder.layers.{index}.input_layernorm.weight"
        owner = stages[0].owner(name)
        local = f"decoder.layers.{index - stages[owner].first_layer}.input_layernorm.weight"
        assert stages[owner].global_name(local) == name


def test_embeddings_first_head_last() -> None:
    stage = Stage(1, 3, 6, tied=False)
    assert stage.owner(EMBEDDING) == 0
    assert stage.owner("decoder.final_layernorm.weight") == 2
    assert stage.owner("output_layer.weight") == 2
    assert (Stage(0, 3, 6, False).is_first, Stage(2, 3, 6, False).is_last) == (True, True)
    assert not stage.is_first and not stage.is_last


def test_tied_copy_maps_to_the_embedding() -> None:
    last = Stage(1, 2, 2, tied=True)
    assert last.global_name(TIED_COPY) == EMBEDDING
    assert last.is_tied_copy(TIED_COPY)
    assert not Stage(1, 2, 2, tied=False).is_tied_copy(TIED_COPY)
    assert Stage(1, 2, 2, tied=False).global_name(TIED_COPY) == TIED_COPY
    # One stage: megatron-core shares the embedding itself; there is no copy.
    assert not Stage(0, 1, 2, tied=True).is_tied_copy(TIED_COPY)


def test_stage_count_must_divide_layers() -> None:
    with pytest.raises(ValueError, match="pipeline-parallel size 3 must divide the model's 4"):
        Stage(0, 3, 4, tied=False)


def test_parse_time_layer_check(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    with pytest.raises(ConfigError, match="pipeline-parallel-size 3 does not divide the 4"):
        actor_args(str(tmp_path), 3, backend="megatron", pp=3)
    args = actor_args(str(tmp_path), 4, backend="megatron", pp=2, tp=2)
    assert args.megatron_pipeline_parallel_size == 2


def test_schedule_refuses_a_rescaling_config() -> None:
    model = SimpleNamespace(
        config=SimpleNamespace(variable_seq_lengths=True, calculate_per_token_loss=False)
    )
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        run_schedule(model, [], lambda _: None, lambda *_: None, forward_only=True)
