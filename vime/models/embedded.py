"""The embedded default model: a tiny random Qwen3 with a character tokenizer, built in code.

Where it fits: ``vime-train`` with no flags has no checkpoint to point at, so it
calls :func:`write_embedded_checkpoint` once and then treats the folder like
any ``--hf-checkpoint``: the training backends and both rollout engines
(``hf``, ``vllm``) load it with their ordinary HF loaders, so the default run
exercises the same code paths as a real model.

The folder is a standard ``Qwen3ForCausalLM`` checkpoint in float32 with tied
embeddings (``config.json``, ``model.safetensors``, ``generation_config.json``)
plus a ``tokenizers`` character tokenizer saved as a fast tokenizer. The
vocabulary is ``<pad> <eos> <bos> <unk>`` (ids 0-3) followed by the charset in
order. Encoding with ``add_special_tokens=True`` (the default) prepends
``<bos>``: a fixed first token gives attention a place to rest, which helps a
model this small; ``add_special_tokens=False`` gives the bare characters.
Decoding with ``skip_special_tokens=True`` returns exactly the characters,
spaces included. A character outside the charset encodes as ``<unk>``.

Importing this module is light (torch, safetensors and tokenizers load only to
build the folder, and transformers not at all: the files are written as its
``save_pretrained`` writes them), so the flag parser can judge the default model's
architecture (:func:`architecture_fields`) before any process starts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
PAD_ID, EOS_ID, BOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))

# head_dim 32 is the smallest vLLM's CPU attention accepts; ~0.27 M parameters
# learns the built-in tasks in minutes on two cores.
DEFAULT_SHAPE: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
}

# Bump when the folder layout or the construction changes, so old folders are rebuilt.
_FORMAT_VERSION = 1
_MARKER = "vime_embedded.json"


def _charset_tokens(charset: str) -> list[str]:
    if not charset:
        raise ValueError(
            "charset is empty; pass the task's characters, e.g. vime.data.tasks.CHARSET"
        )
    # dict.fromkeys keeps first occurrences in order: a repeated character is harmless.
    return list(dict.fromkeys(charset))


def _fingerprint(chars: list[str], seed: int, shape: dict[str, int]) -> str:
    spec = {"format": _FORMAT_VERSION, "chars": chars, "seed": seed, "shape": shape}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _read_fingerprint(folder: Path) -> str | None:
    try:
        return json.loads((folder / _MARKER).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _backend_tokenizer(chars: list[str]) -> Any:
    """The ``tokenizers`` character tokenizer over ``chars`` (see the module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Every character is its own piece; [\s\S] also matches newlines, which "." would not.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins pieces with no separator, so spaces survive only as the space token.
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _tokenizer_config(max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens, for transformers' fast tokenizer class.
    "PreTrainedTokenizerFast" is the name every transformers release (and vLLM) resolves."""
    return {
        "backend": "tokenizers",
        "bos_token": "<bos>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "model_max_length": max_length,
        "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }


def build_tokenizer(
    charset: str, max_length: int = DEFAULT_SHAPE["max_position_embeddings"]
) -> Any:
    """A character-level fast tokenizer over ``charset`` (see the module docstring)."""
    from transformers import PreTrainedTokenizerFast

    config = _tokenizer_config(max_length)
    del config["backend"], config["tokenizer_class"]
    return PreTrainedTokenizerFast(
        tokenizer_object=_backend_tokenizer(_charset_tokens(charset)), **config
    )


def load_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """The tokenizer of an embedded checkpoint folder: what ``AutoTokenizer`` would load
    there, without the import of transformers' auto classes (seconds, and their models)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


# transformers' default for Qwen3 (initializer_range): the std of the weights' normal init.
_INIT_STD = 0.02


def _config(vocab_size: int, shape: dict[str, int], version: str) -> dict[str, Any]:
    """config.json: ``Qwen3Config(vocab_size=..., tie_word_embeddings=True, the special
    ids, dtype="float32", **shape)`` as transformers ``version`` (5.19) saves it."""
    layers = shape["num_hidden_layers"]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "dtype": "float32",
        "eos_token_id": EOS_ID,
        "head_dim": shape["head_dim"],
        "hidden_act": "silu",
        "hidden_size": shape["hidden_size"],
        "initializer_range": _INIT_STD,
        "intermediate_size": shape["intermediate_size"],
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": shape["max_position_embeddings"],
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": shape["num_attention_heads"],
        "num_hidden_layers": layers,
        "num_key_value_heads": shape["num_key_value_heads"],
        "pad_token_id": PAD_ID,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": True,
        "transformers_version": version,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def architecture_fields() -> dict[str, Any]:
    """The architecture fields of the default model's config.json (as ``vime-train``
    writes it with :data:`DEFAULT_SHAPE`), without torch or transformers.

    The vocabulary size is left out: it follows the task's charset, and no architecture
    rule depends on it.
    """
    return {"model_type": "qwen3", "tie_word_embeddings": True, **DEFAULT_SHAPE}


def _weights(vocab_size: int, shape: dict[str, int], seed: int) -> dict[str, Any]:
    """The weights, bit for bit those of ``AutoModelForCausalLM.from_config`` (transformers
    5.19) under ``torch.manual_seed(seed)``, without building the model.

    The random draws are made in that construction's order, on tensors of the same
    shapes: torch's default init of each module as it is built (the embedding's
    normal, each layer's linear layers' Kaiming uniform), which transformers then
    overwrites: the embedding and every linear layer ``normal(0, 0.02)`` in the same
    module order, the padding row zeroed. The head is tied to the embedding, so its own
    draws, which come last, are not made. Norm weights are ones. The caller's random
    stream is left where it was.
    """
    import torch

    hidden, ffn, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q_dim = shape["num_attention_heads"] * head_dim
    kv_dim = shape["num_key_value_heads"] * head_dim
    linears = {  # (out, in), in the order a Qwen3DecoderLayer builds them
        "self_attn.q_proj": (q_dim, hidden),
        "self_attn.k_proj": (kv_dim, hidden),
        "self_attn.v_proj": (kv_dim, hidden),
        "self_attn.o_proj": (hidden, q_dim),
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
    }
    layers = range(shape["num_hidden_layers"])
    weights: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.empty(vocab_size, hidden).normal_()  # nn.Embedding's own init
        for _ in layers:
            for rows, cols in linears.values():  # nn.Linear's: kaiming_uniform_(a=sqrt(5))
                bound = 1 / math.sqrt(cols)
                torch.empty(rows, cols).uniform_(-bound, bound)
        embed = torch.empty(vocab_size, hidden).normal_(0.0, _INIT_STD)
        embed[PAD_ID] = 0.0
        weights["model.embed_tokens.weight"] = embed
        for i in layers:
            for name, (rows, cols) in linears.items():
                weight = torch.empty(rows, cols).normal_(0.0, _INIT_STD)
                weights[f"model.layers.{i}.{name}.weight"] = weight
    norms = {
        "input_layernorm": hidden,
        "post_attention_layernorm": hidden,
        "self_attn.q_norm": head_dim,
        "self_attn.k_norm": head_dim,
    }
    for i in layers:
        for name, size in norms.items():
            weights[f"model.layers.{i}.{name}.weight"] = torch.ones(size)
    weights["model.norm.weight"] = torch.ones(hidden)
    return weights


def _write(folder: Path, chars: list[str], seed: int, shape: dict[str, int], fp: str) -> None:
    """The folder's files as transformers 5.19's ``save_pretrained`` of the model, its
    generation config and the fast tokenizer wrote them (byte for byte), with torch,
    safetensors and tokenizers alone: importing transformers' model classes to build a
    quarter-million-parameter model took seconds of every default run's start."""
    from safetensors.torch import save_file

    version = metadata.version("transformers")
    tokenizer = _backend_tokenizer(chars)
    vocab_size = tokenizer.get_vocab_size()
    weights = _weights(vocab_size, shape, seed)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})

    def dump(obj: dict[str, Any], path: Path, *, sort_keys: bool = True) -> None:
        path.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")

    dump(_config(vocab_size, shape, version), folder / "config.json")
    special = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    dump({**special, "transformers_version": version}, folder / "generation_config.json")
    tokenizer.save(str(folder / "tokenizer.json"))
    dump(_tokenizer_config(shape["max_position_embeddings"]), folder / "tokenizer_config.json")
    marker = {"fingerprint": fp, "charset": "".join(chars), "seed": seed, "shape": shape}
    dump(marker, folder / _MARKER, sort_keys=False)


def write_embedded_checkpoint(
    path: str | os.PathLike[str], *, charset: str, seed: int = 1234, **shape_overrides: int
) -> str:
    """Write (or reuse) the embedded model's HF folder at ``path``; return its path.

    ``shape_overrides`` replace entries of :data:`DEFAULT_SHAPE`. Same charset,
    seed and shape give bitwise-identical weights. If ``path`` already holds an
    embedded checkpoint with the same fingerprint it is reused untouched; one
    with another fingerprint is replaced. The folder is built next to ``path``
    and renamed into place, so a reader never sees a half-written checkpoint.
    """
    unknown = sorted(set(shape_overrides) - set(DEFAULT_SHAPE))
    if unknown:
        raise ValueError(
            f"unknown embedded-model size option(s) {unknown}; choose from {sorted(DEFAULT_SHAPE)}"
        )
    shape = {**DEFAULT_SHAPE, **{k: int(v) for k, v in shape_overrides.items()}}
    chars = _charset_tokens(charset)
    fp = _fingerprint(chars, seed, shape)
    target = Path(path)
    if target.exists():
        existing = _read_fingerprint(target)
        if existing == fp:
            return str(target)
        if existing is None:
            raise FileExistsError(
                f"{target} exists and is not an embedded vime checkpoint; "
                "remove it or choose another path"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write(tmp, chars, seed, shape, fp)
        if target.exists():
            # A stale embedded checkpoint (other charset/seed/shape): move it aside first,
            # so the swap itself is two renames.
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its folder is as good as ours if it matches.
            if _read_fingerprint(target) != fp:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
