"""``--megatron-transformer-impl``: the opt-in TransformerEngine layers, as far as a CPU shows.

Proves: the flag defaults to ``local``; ``transformer_engine`` without CUDA or
without the ``transformer_engine`` package ends ``vime-train`` with one error line
(exit 2) that names what is missing and the way back (``local``), and the check
names exactly the missing parts when either one is there; the TE block builder
refuses with one such error instead of failing inside megatron-core; the names
``convert.param_map(fused_norms=True)`` gives TE's fused norms are exactly the
checkpoint keys megatron-core writes for the local layers' norms (its
``sharded_state_dict_keys_map``, in the spec and in a real model's sharded state
dict), for Qwen3 with QK norms, Qwen2 with q/k/v biases and Llama; the TE layers
take TE's fused RoPE; and a checkpoint
saved under one impl is refused under the other with a clear error. The TE layers
themselves run only in ``tests/gpu/test_megatron_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import SHAPE, tiny_llama_config, tiny_qwen3_config
from transformers import PretrainedConfig, Qwen2Config

pytest.importorskip("megatron.core")

from megatron.core.models.gpt import gpt_layer_specs

from vime.backends.megatron import convert, flags
from vime.backends.megatron import model as mmodel
from vime.config import parse_args
from vime.errors import ConfigError

TE_FLAG = ("--train-backend", "megatron", "--megatron-transformer-impl", "transformer_engine")
HAVE_CUDA = torch.cuda.is_available()
HAVE_TE_PACKAGE = importlib.util.find_spec("transformer_engine") is not None


def _vime_train(*args: str) -> subprocess.CompletedProcess[str]:
    # The installed console script, as a user runs it.
    script = Path(sys.executable).with_name("vime-train")
    if not script.exists():
        script = Path(shutil.which("vime-train") or "vime-train")
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=60)


# ----- the flag ----------------------------------------------------------------------------


def test_default_is_the_local_layers() -> None:
    args = parse_args(["--train-backend", "megatron"])
    assert args.megatron_transformer_impl == "local"


@pytest.mark.skipif(HAVE_CUDA and HAVE_TE_PACKAGE, reason="CUDA and TransformerEngine are here")
def test_transformer_engine_refused_while_parsing_where_it_cannot_run() -> None:
    result = _vime_train("--dry-run", *TE_FLAG)
    assert result.returncode == 2, result
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith(
        "vime-train: error: --megatron-transformer-impl transformer_engine needs"
    )
    assert line.endswith("use --megatron-transformer-impl local")
    assert ("transformer_engine package" in line) == (not HAVE_TE_PACKAGE)
    assert ("CUDA" in line) == (not HAVE_CUDA)


@pytest.mark.parametrize(
    ("te", "cuda", "missing"),
    [
        (True, True, None),
        (False, True, "the transformer_engine package (not installed here)"),
        (True, False, "a CUDA GPU (none is visible here)"),
        (
            False,
            False,
            "the transformer_engine package (not installed here) and a CUDA GPU "
            "(none is visible here)",
        ),
    ],
)
def test_the_check_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, te: bool, cuda: bool, missing: str | None
) -> None:
    """Each half of the check on its own, whatever this machine has; with both halves
    there the flag parses."""
    from vime import device

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        if name == "transformer_engine":
            return object() if te else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(device, "cuda_available", lambda: cuda)
    assert flags.transformer_engine_missing() == missing
    if missing is None:
        assert parse_args(list(TE_FLAG)).megatron_transformer_impl == "transformer_engine"
    else:
        with pytest.raises(ConfigError, match=re.escape(missing)):
            parse_args(list(TE_FLAG))


# ----- the TE block spec -------------------------------------------------------------------

CONFIGS = {
    "qwen3-qk-norm": lambda: tiny_qwen3_config(100),
    "qwen2-bias": lambda: Qwen2Config(vocab_size=100, **SHAPE),
    "llama": lambda: tiny_llama_config(100),
}


@pytest.mark.skipif(gpt_layer_specs.HAVE_TE, reason="TransformerEngine works here")
def test_te_builder_refuses_where_te_cannot_run() -> None:
    config = CONFIGS["qwen3-qk-norm"]()
    tcfg, _ = convert.transformer_config_from_hf(config)
    with pytest.raises(RuntimeError) as err:
        mmodel.build_gpt_model(config, tcfg, transformer_impl="transformer_engine")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("TransformerEngine layers need ")
    assert message.endswith("(--megatron-transformer-impl local)")
    missing = flags.transformer_engine_missing()  # what the parse-time check says, too
    assert (missing or "a transformer_engine that megatron-core can import") in message


def test_unknown_impl_refused_and_which_impl_fuses_norms() -> None:
    config = CONFIGS["llama"]()
    tcfg, _ = convert.transformer_config_from_hf(config)
    with pytest.raises(ValueError, match="unknown transformer impl 'te'; choose from local, "):
        mmodel.build_gpt_model(config, tcfg, transformer_impl="te")
    assert not mmodel.fuses_norms("local") and mmodel.fuses_norms("transformer_engine")
    assert set(mmodel.BLOCK_SPECS) == set(flags.TRANSFORMER_IMPLS)


# ----- TE's names are the local layers' checkpoint keys ------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.\d+\.")


def _apply_keys_map(name: str, keys_map: dict[str, str]) -> str:
    """``name`` with the first matching layer-relative prefix of ``keys_map`` replaced, as
    megatron-core's ``TransformerLayer.sharded_state_dict`` does."""
    layer = _LAYER.match(name)
    if layer is None:
        return name
    rest = name[layer.end() :]
    for old, new in keys_map.items():
        if rest.startswith(old):
            return layer.group(0) + new + rest[len(old) :]
    return name


def test_te_layers_take_the_fused_rope_kernel() -> None:
    """TE's layers apply RoPE with TE's fused kernel (a THD row at once, not megatron-core's
    loop over its samples); the local layers keep megatron-core's defaults."""
    from vime.backends.megatron.model import kernel_fields

    assert kernel_fields("transformer_engine") == {"apply_rope_fusion": True}
    assert kernel_fields("local") == {}
    with pytest.raises(ValueError, match="unknown transformer impl"):
        kernel_fields("apex")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_norm_names_are_the_local_checkpoint_keys(name: str, megatron_world: None) -> None:
    config: PretrainedConfig = CONFIGS[name]()
    tcfg, _ = convert.transformer_config_from_hf(config)
    local = convert.param_map(config)
    fused = convert.param_map(config, fused_norms=True)
    # Same HF sources in the same order: only megatron names may differ.
    assert [(pm.hf, pm.kind) for pm in local] == [(pm.hf, pm.kind) for pm in fused]
    renamed = {a.megatron: b.megatron for a, b in zip(local, fused, strict=True) if a != b}
    norms = ("input_layernorm.weight", "pre_mlp_layernorm.weight")
    assert len(renamed) == 2 * config.num_hidden_layers
    assert all(old.endswith(norms) for old in renamed)

    # The spec: megatron-core's map, carried by vime's local block spec.
    spec = mmodel.local_block_spec(tcfg)
    keys_map = spec.layer_specs[0].submodules.sharded_state_dict_keys_map
    assert keys_map, "megatron-core's local spec no longer maps its norm names"
    assert [_apply_keys_map(pm.megatron, keys_map) for pm in local] == [pm.megatron for pm in fused]

    # A real local model: the key each parameter is checkpointed under is its fused name
    # (layers are stacked along a leading axis, so the layer index leaves the key).
    model = mmodel.build_gpt_model(config, tcfg)
    sharded = {
        k: v.key for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")
    }
    assert sorted(sharded) == sorted(pm.megatron for pm in local)
    for a, b in zip(local, fused, strict=True):
        assert sharded[a.megatron] == _LAYER.sub("decoder.layers.", b.megatron), a.megatron


# ----- checkpoints -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("saved", "running"), [("transformer_engine", "local"), (None, "transformer_engine")]
)
def test_checkpoint_of_the_other_impl_refused(
    tmp_path: Path, saved: str | None, running: str
) -> None:
    """A checkpoint without the field is an older one, of the local layers."""
    from vime import checkpoint
    from vime.backends.policy_actor import make_actor

    counters = {"samples_consumed": 8, "optimizer_steps": 2, "skipped_steps": 0}
    extra = {"counters": counters, "tp": 1, "pp": 1, "param_dtype": str(torch.float32)}
    if saved is not None:
        extra["transformer_impl"] = saved
    checkpoint.begin_save(tmp_path, 1, is_rank0=True)
    checkpoint.commit_save(tmp_path, 1, backend="megatron", world_size=1, extra=extra)
    actor = make_actor("megatron")
    actor.backend.tp, actor.backend.pp, actor.backend.distributed = 1, 1, False
    actor.backend.param_dtype = torch.float32
    actor.backend.transformer_impl = running
    impl = saved or "local"
    with pytest.raises(
        checkpoint.CheckpointError, match=f"saved with --megatron-transformer-impl {impl}; resume"
    ):
        actor._load(str(tmp_path))
