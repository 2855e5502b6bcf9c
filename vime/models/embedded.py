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

Importing this module is light (torch and transformers load only to build the
folder), so the flag parser can judge the default model's architecture
(:func:`architecture_fields`) before any process starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
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


def build_tokenizer(
    charset: str, max_length: int = DEFAULT_SHAPE["max_position_embeddings"]
) -> Any:
    """A character-level fast tokenizer over ``charset`` (see the module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *_charset_tokens(charset)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Every character is its own piece; [\s\S] also matches newlines, which "." would not.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins pieces with no separator, so spaces survive only as the space token.
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )


def build_config(vocab_size: int, **shape: int) -> Any:
    """The ``Qwen3Config`` of the embedded model (float32, tied embeddings)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
        **shape,
    )


def architecture_fields() -> dict[str, Any]:
    """The architecture fields of the default model's config.json (``build_config`` with
    :data:`DEFAULT_SHAPE`, as ``vime-train`` writes it), without torch or transformers.

    The vocabulary size is left out: it follows the task's charset, and no architecture
    rule depends on it.
    """
    return {"model_type": "qwen3", "tie_word_embeddings": True, **DEFAULT_SHAPE}


def _write(folder: Path, chars: list[str], seed: int, shape: dict[str, int], fp: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    charset = "".join(chars)
    tokenizer = build_tokenizer(charset, shape["max_position_embeddings"])
    config = build_config(len(tokenizer), **shape)
    # fork_rng: building the default model must not shift the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # "PreTrainedTokenizerFast" is the name every transformers release (and vLLM) resolves.
    tok_config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    marker = {"fingerprint": fp, "charset": charset, "seed": seed, "shape": shape}
    (folder / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")


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
