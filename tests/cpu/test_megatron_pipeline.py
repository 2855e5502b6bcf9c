"""``vime.backends.megatron.pipeline``: which stage holds what, and the schedule's guard.

Proves: layers are split into equal consecutive runs -- or, with the first and/or
last stage's count given, those on the end stages and equal runs between
(megatron-core's own ``get_num_layers_to_build`` agrees stage by stage) -- and
renumbered between a stage's local names and the model's global (HF-convertible)
names; the embeddings
belong to the first stage and the final norm and output layer to the last; the last
stage's copy of tied embeddings maps to the embedding and is recognised as a copy
(only with tying and more than one stage); a split that cannot be made (a stage
count that does not divide the layers, end-stage counts that leave an uneven or
empty rest, or are given without pipelining) is an error naming the flags, at
start-up and already when the flags are parsed (exit code 2 before any process
starts); ``run_schedule`` refuses a model
whose config would rescale vime's loss. The schedule itself runs in
``test_megatron_actor.py`` (PP=2 against fsdp2) and ``test_megatron_shims.py``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from actor_harness import actor_args

pytest.importorskip("megatron.core")

from vime.backends.megatron.flags import stage_layer_counts
from vime.backends.megatron.pipeline import EMBEDDING, TIED_COPY, Stage, run_schedule
from vime.errors import ConfigError


def test_layers_split_into_equal_runs_and_renumbered() -> None:
    stages = [Stage(rank, 4, 8, tied=False) for rank in range(4)]
    assert [s.first_layer for s in stages] == [0, 2, 4, 6]
    assert stages[0].layer_counts == (2,) * 4
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


@pytest.mark.parametrize(
    ("layers", "stages", "first", "last", "counts"),
    [
        (28, 3, 10, None, (10, 9, 9)),
        (28, 3, None, 8, (10, 10, 8)),
        (28, 4, 4, 6, (4, 9, 9, 6)),
        (4, 2, 1, None, (1, 3)),
        (4, 2, 1, 3, (1, 3)),
        (8, 4, None, None, (2, 2, 2, 2)),
    ],
)
def test_uneven_split_matches_megatron_core(layers, stages, first, last, counts) -> None:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    assert stage_layer_counts(layers, stages, first, last) == counts
    config = SimpleNamespace(
        pipeline_model_parallel_layout=None,
        num_layers=layers,
        pipeline_model_parallel_size=stages,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
        virtual_pipeline_model_parallel_size=None,
    )
    assert tuple(get_num_layers_to_build(config, pp_rank=r) for r in range(stages)) == counts
    all_stages = [Stage(r, stages, layers, False, first, last) for r in range(stages)]
    for index in range(layers):
        name = f"decoder.layers.{index}.mlp.linear_fc2.weight"
        owner = all_stages[0].owner(name)
        start = all_stages[owner].first_layer
        assert start <= index < start + counts[owner]
        local = f"decoder.layers.{index - start}.mlp.linear_fc2.weight"
        assert all_stages[owner].global_name(local) == name


@pytest.mark.parametrize(
    ("layers", "stages", "first", "last", "message"),
    [
        (4, 3, None, None, "the model's 4 layers do not split evenly over 3"),
        (28, 3, 9, None, "19 layers left do not split evenly over 2"),
        (4, 3, 2, 2, "0 layers left do not split evenly over 1"),
        (4, 2, 1, 2, "must add up to the model's 4"),
        (4, 2, 0, None, "first-pipeline-num-layers must be >= 1"),
        (4, 1, None, 2, "last-pipeline-num-layers needs --megatron-pipeline-parallel-size > 1"),
    ],
)
def test_impossible_splits_are_refused(layers, stages, first, last, message) -> None:
    with pytest.raises(ValueError, match=message):
        stage_layer_counts(layers, stages, first, last)


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
    with pytest.raises(ValueError, match="the model's 4 layers do not split evenly over 3"):
        Stage(0, 3, 4, tied=False)


def test_parse_time_layer_check(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    with pytest.raises(ConfigError, match="4 layers do not split evenly over 3 pipeline stage"):
        actor_args(str(tmp_path), 3, backend="megatron", pp=3)
    first = "--megatron-decoder-first-pipeline-num-layers"
    with pytest.raises(ConfigError, match="3 layers left do not split evenly over 2"):
        actor_args(str(tmp_path), 3, first, "1", backend="megatron", pp=3)
    with pytest.raises(ConfigError, match="needs --megatron-pipeline-parallel-size > 1"):
        actor_args(str(tmp_path), 1, first, "2", backend="megatron")
    args = actor_args(str(tmp_path), 4, backend="megatron", pp=2, tp=2)
    assert args.megatron_pipeline_parallel_size == 2
    args = actor_args(str(tmp_path), 2, first, "1", backend="megatron", pp=2)
    assert args.megatron_decoder_first_pipeline_num_layers == 1


def test_schedule_refuses_a_rescaling_config() -> None:
    model = SimpleNamespace(
        config=SimpleNamespace(variable_seq_lengths=True, calculate_per_token_loss=False)
    )
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        run_schedule(model, [], lambda _: None, lambda *_: None, forward_only=True)
