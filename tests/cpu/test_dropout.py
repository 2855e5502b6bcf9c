"""RL forwards run without the checkpoint's dropout unless --keep-dropout, in both backends.

Proves, on a tiny random Qwen3 whose config.json has attention_dropout 0.5 (CPU, gloo,
one rank), for fsdp2 and megatron alike: by default the log-prob pass gives the same
numbers twice, equal to those of the same weights saved without dropout, and one
training step (KL on: π_old, reference and update forwards) ends on the same weights
as theirs, so no forward of the step drops anything; with --keep-dropout two log-prob
passes differ, so the flag reaches the model. The checkpoint's own config (what engines
and HF exports get) keeps its dropout; ``without_dropout`` zeroes every dropout field of a
config, nested ones too, in a copy.
"""

from __future__ import annotations

import pytest
import torch
from actor_harness import VOCAB, actor_args, make_schedule, spawn
from tiny_models import save_tiny, tiny_qwen3_config

from vime.backends.dropout import without_dropout
from vime.config.train_settings import train_settings

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The same random weights (one seed) saved with and without attention dropout."""
    out = {}
    for name, p in (("dropout", 0.5), ("plain", 0.0)):
        config = tiny_qwen3_config(VOCAB)
        config.attention_dropout = p
        out[name] = save_tiny(tmp_path_factory.mktemp(f"tiny_qwen3_{name}"), config, seed=3)
    return out


def _job(rank: int, world: int, backend: str, args) -> dict:
    from vime.backends.policy_actor import make_actor

    actor = make_actor(backend)
    actor.init(train_settings(args))
    sched = make_schedule(args, 0, world)
    first = actor.compute_log_probs(sched, "actor")
    second = actor.compute_log_probs(sched, "actor")
    actor.train(sched)
    after = {n: t.clone() for bucket in actor.weight_buckets(1 << 16) for n, t in bucket}
    kept = actor.backend.hf_config.attention_dropout
    return {"first": first, "second": second, "after": after, "config_dropout": kept}


def _run(backend: str, hf: str, tmp_path, *extra: str) -> dict:
    return spawn(_job, 1, tmp_path, backend, actor_args(hf, 1, *extra, backend=backend))


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_rl_forwards_drop_nothing_unless_asked(backend, checkpoints, tmp_path) -> None:
    """Default: deterministic log-probs equal to the no-dropout model's and the same
    update; --keep-dropout: the checkpoint's attention dropout is live again."""
    default = _run(backend, checkpoints["dropout"], tmp_path)
    plain = _run(backend, checkpoints["plain"], tmp_path)
    for i, logp in default["first"].items():
        assert torch.equal(logp, default["second"][i]), i
        assert torch.equal(logp, plain["first"][i]), i
    for name, weight in plain["after"].items():
        assert torch.equal(default["after"][name], weight), name
    assert default["config_dropout"] == 0.5  # what engines and exports receive
    kept = _run(backend, checkpoints["dropout"], tmp_path, "--keep-dropout")
    moved = max(float((kept["first"][i] - kept["second"][i]).abs().max()) for i in kept["first"])
    assert moved > 1e-3, moved


def test_without_dropout_zeroes_every_dropout_field_in_a_copy() -> None:
    """Every ``*dropout*`` / ``*_pdrop`` number, in the config and a nested sub-config, is
    0 in the copy; other fields and the original config are unchanged."""
    from transformers import GPT2Config, PretrainedConfig

    config = GPT2Config(resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3, n_layer=3)
    config.summary_first_dropout = 0.4
    config.text_config = tiny_qwen3_config(VOCAB)
    config.text_config.attention_dropout = 0.5
    out = without_dropout(config)
    fields = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout")
    assert [getattr(out, f) for f in fields] == [0.0] * 4
    assert out.text_config.attention_dropout == 0.0
    assert out.n_layer == 3 and out.text_config.hidden_size == 64
    assert [getattr(config, f) for f in fields] == [0.1, 0.2, 0.3, 0.4]
    assert config.text_config.attention_dropout == 0.5
    assert isinstance(out, PretrainedConfig)
