"""The embedded default checkpoint is a real, loadable, reproducible HF model folder.

Proves: transformers loads the folder as a float32 tied-embedding Qwen3 whose
special-token ids agree across config, generation config and tokenizer; the
same seed gives bitwise-identical weights and another seed different ones, and the
files, written without transformers, are those transformers' own construction
(``from_config`` under the seed) and ``save_pretrained`` write; the
character tokenizer round-trips any text over the charset (spaces included)
one token per character; rewriting is idempotent, a changed spec replaces the
folder atomically, and a foreign folder is never overwritten. The light
``architecture_fields`` (what the megatron flags judge at parse time) agree with
the written config.json, and the megatron architecture rules give them the same
verdict as the transformers config the actor loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from vime.backends.megatron.flags import check_architecture
from vime.models import write_embedded_checkpoint
from vime.models.embedded import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    architecture_fields,
    build_tokenizer,
    load_tokenizer,
)

CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 =+"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_embedded_checkpoint(tmp_path_factory.mktemp("emb") / "model", charset=CHARSET)


def test_loads_in_transformers_with_consistent_special_tokens(folder: str) -> None:
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.head_dim >= 32  # vLLM's CPU attention
    tokenizer = AutoTokenizer.from_pretrained(folder)
    gen = GenerationConfig.from_pretrained(folder)
    assert config.vocab_size == len(tokenizer) == len(CHARSET) + 4
    assert config.eos_token_id == gen.eos_token_id == tokenizer.eos_token_id == EOS_ID
    assert config.pad_token_id == gen.pad_token_id == tokenizer.pad_token_id == PAD_ID
    assert tokenizer.bos_token_id == BOS_ID and tokenizer.unk_token_id == UNK_ID

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    n_params = sum(p.numel() for p in model.parameters())
    assert 200_000 <= n_params <= 500_000, n_params
    ids = torch.tensor([tokenizer("12+3=")["input_ids"]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, 6, config.vocab_size)
    assert torch.isfinite(logits).all()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path, folder: str) -> None:
    again = write_embedded_checkpoint(tmp_path / "again", charset=CHARSET)
    other = write_embedded_checkpoint(tmp_path / "other", charset=CHARSET, seed=99)
    ref, same, diff = (load_file(f"{p}/model.safetensors") for p in (folder, again, other))
    assert ref.keys() == same.keys() == diff.keys()
    assert all(torch.equal(ref[k], same[k]) for k in ref)
    assert not torch.equal(ref["model.embed_tokens.weight"], diff["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("seed", "shape"),
    [(1234, {}), (99, {}), (5, {"num_hidden_layers": 2, "num_key_value_heads": 1})],
)
def test_files_are_transformers_own_model_and_tokenizer_saved(
    tmp_path: Path, seed: int, shape: dict[str, int]
) -> None:
    """The writer uses no transformers, yet writes what transformers' own construction
    and ``save_pretrained`` write: ``from_config`` of the config under the seed (the
    writer's weights bit for bit, and its config.json, generation_config.json and
    tokenizer files byte for byte)."""
    path = Path(write_embedded_checkpoint(tmp_path / "m", charset=CHARSET, seed=seed, **shape))
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(tmp_path / "hf")
    build_tokenizer(CHARSET, config.max_position_embeddings).save_pretrained(tmp_path / "hf")
    written, built = load_file(path / "model.safetensors"), model.state_dict()
    assert set(written) == set(built) - {"lm_head.weight"}  # tied: saved once
    assert all(torch.equal(written[k], built[k]) for k in written)
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (path / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    # The one change the old writer made too: the class named as every release resolves it.
    saved = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert json.loads((path / "tokenizer_config.json").read_text()) == {
        **saved,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def test_load_tokenizer_is_what_auto_tokenizer_loads(folder: str) -> None:
    auto, light = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    assert type(light) is type(auto) and light.init_kwargs == auto.init_kwargs
    assert light("ab 12")["input_ids"] == auto("ab 12")["input_ids"]


def test_writing_does_not_move_the_callers_random_stream(tmp_path: Path) -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    write_embedded_checkpoint(tmp_path / "m", charset="ab", num_hidden_layers=1)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_round_trips_charset_text_with_spaces(folder: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [CHARSET, "  12 + 30 =42  ", " ", "a  b", "zz=9+0 "]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == BOS_ID and len(ids) == len(text) + 1, (text, ids)
        assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode([*ids, EOS_ID, PAD_ID], skip_special_tokens=True) == text
    # One id per character, distinct and in charset order after the four special tokens.
    assert tokenizer.encode(CHARSET, add_special_tokens=False) == list(range(4, 4 + len(CHARSET)))
    assert tokenizer.encode("a\n?", add_special_tokens=False) == [4, UNK_ID, UNK_ID]


def test_rewrite_is_idempotent_and_a_changed_spec_replaces(tmp_path: Path) -> None:
    target = tmp_path / "model"
    assert write_embedded_checkpoint(target, charset="abc ", num_hidden_layers=1) == str(target)
    (target / "sentinel").write_text("kept")
    write_embedded_checkpoint(target, charset="abc ", num_hidden_layers=1)
    assert (target / "sentinel").read_text() == "kept"  # reused, not rewritten

    write_embedded_checkpoint(target, charset="abcd ", num_hidden_layers=1)
    assert not (target / "sentinel").exists()
    assert json.loads((target / "config.json").read_text())["vocab_size"] == 4 + 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp folders left


def test_refuses_a_foreign_folder_and_unknown_size_options(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("do not delete")
    with pytest.raises(FileExistsError, match="not an embedded vime checkpoint"):
        write_embedded_checkpoint(foreign, charset="ab")
    assert (foreign / "notes.txt").read_text() == "do not delete"
    with pytest.raises(ValueError, match="hidden_sizes"):
        write_embedded_checkpoint(tmp_path / "x", charset="ab", hidden_sizes=32)
    with pytest.raises(ValueError, match="charset is empty"):
        write_embedded_checkpoint(tmp_path / "y", charset="")


def test_size_overrides_take_effect(tmp_path: Path) -> None:
    path = write_embedded_checkpoint(tmp_path / "m", charset="ab", num_hidden_layers=2)
    assert AutoConfig.from_pretrained(path).num_hidden_layers == 2


def test_light_architecture_fields_match_the_written_config(folder: str) -> None:
    """The parse-time stand-in for the default model's config.json is that file's content,
    and the megatron rules judge both alike for every TP size (so the parser refuses
    exactly the splits the actor would)."""
    written = json.loads((Path(folder) / "config.json").read_text())
    fields = architecture_fields()
    assert {k: written[k] for k in fields} == fields
    loaded = AutoConfig.from_pretrained(folder)

    def verdict(config: object, tp: int) -> str:
        try:
            check_architecture(config, tp)
        except ValueError as err:
            return str(err)
        return "ok"

    verdicts = [verdict(SimpleNamespace(**fields), tp) for tp in (1, 2, 3, 4)]
    assert verdicts == [verdict(loaded, tp) for tp in (1, 2, 3, 4)]
    assert verdicts[:2] == ["ok", "ok"] and "must divide the 2 KV heads" in verdicts[3]
