"""HF config -> megatron-core ``TransformerConfig``, and HF <-> Megatron weights, per TP rank.

Where it fits: the megatron backend reads the same HF checkpoints as the fsdp2
backend. ``transformer_config_from_hf`` checks at start-up that the architecture
is one this backend reproduces exactly (Qwen2/2.5, Qwen3, Llama 3) and rejects
anything else with the reason; ``hf_to_megatron`` turns an HF state dict into one
tensor-parallel rank's megatron state dict when loading; ``megatron_to_hf`` (and
the per-parameter ``param_map`` / ``gather_hf`` it is built from, for streaming)
turns the ranks' shards back into HF names for the weight source and HF export.
The round trip is exact: only reshapes, concatenations and zero padding.

Megatron layout (local and TransformerEngine specs alike, per TP rank):

- ``linear_qkv``: per KV group g of this rank, ``[q heads of g; k_g; v_g]`` rows, so
  the rank holds groups ``[r * G / tp, (r + 1) * G / tp)``;
- ``linear_fc1``: ``[gate shard r; up shard r]`` rows (SwiGLU's two halves);
- ``linear_proj`` / ``linear_fc2``: row-parallel, split along the input dimension;
- word embeddings / output layer: vocab padded with zero rows to a multiple of
  ``128 * tp``, split along the vocab.

With the local spec (the only one on the CPU) the layer norms are separate
modules (``input_layernorm``, ``pre_mlp_layernorm``); TransformerEngine's spec
fuses them into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``,
which ``fused_norms=True`` produces instead. Those are also the names under which
megatron-core checkpoints the local spec's norms (its ``sharded_state_dict_keys_map``),
so either naming describes the same checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# The architecture rules are pure and live with the flags, so parsing runs them too.
from vime.backends.megatron.flags import check_architecture
from vime.backends.megatron.flags import num_kv_heads as _num_kv_heads

# megatron-core's default make_vocab_size_divisible_by; times TP so every rank's shard
# has the same size.
VOCAB_DIVISOR = 128
# HF state-dict entries that are derived buffers, not weights (older checkpoints).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)

Tensor = torch.Tensor


@dataclass(frozen=True)
class GPTExtra:
    """What a ``GPTModel`` needs beyond ``TransformerConfig`` (constructor arguments) and
    what conversion needs to know about the vocabulary."""

    model_type: str
    vocab_size: int  # the HF vocabulary: logits beyond it are padding
    padded_vocab_size: int
    max_sequence_length: int
    rotary_base: float
    rope_scaling: bool
    rope_scaling_factor: float
    tie_word_embeddings: bool
    tp: int
    # HF's Llama-family embeddings are nn.Embedding(..., padding_idx=config.pad_token_id):
    # that row is a constant of the lookup (no gradient through it). None: no such row.
    padding_idx: int | None = None

    def gpt_model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of megatron-core's ``GPTModel`` for this architecture."""
        return {
            "vocab_size": self.padded_vocab_size,
            "max_sequence_length": self.max_sequence_length,
            "position_embedding_type": "rope",
            "rotary_percent": 1.0,
            "rotary_base": self.rotary_base,
            "rope_scaling": self.rope_scaling,
            "rope_scaling_factor": self.rope_scaling_factor,
            "share_embeddings_and_output_weights": self.tie_word_embeddings,
        }


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``128 * tp``."""
    multiple = VOCAB_DIVISOR * tp
    return -(-vocab_size // multiple) * multiple


def _head_dim(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def gpt_extra(hf_config: Any, *, tp: int = 1) -> GPTExtra:
    """Check ``hf_config`` is an architecture this backend reproduces; return ``GPTExtra``.

    Raises ``ValueError`` naming the first unsupported feature.
    """
    rope = check_architecture(hf_config, tp)
    return GPTExtra(
        model_type=hf_config.model_type,
        vocab_size=int(hf_config.vocab_size),
        padded_vocab_size=padded_vocab_size(int(hf_config.vocab_size), tp),
        max_sequence_length=int(hf_config.max_position_embeddings),
        rotary_base=rope.base,
        rope_scaling=rope.scaling,
        rope_scaling_factor=rope.factor,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        tp=tp,
        padding_idx=_padding_idx(hf_config),
    )


def _padding_idx(hf_config: Any) -> int | None:
    """The embedding row HF's model holds out of the lookup's gradient, as its own
    ``nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id)`` does."""
    pad = getattr(hf_config, "pad_token_id", None)
    return None if pad is None else int(pad)


def transformer_config_from_hf(
    hf_config: Any, *, tp: int = 1, params_dtype: torch.dtype = torch.float32, **parallel: Any
) -> tuple[Any, GPTExtra]:
    """megatron-core ``TransformerConfig`` (and ``GPTExtra``) for a Qwen2/Qwen3/Llama config.

    ``parallel`` is passed to ``TransformerConfig`` last, so it can set (or override)
    any field: ``pipeline_model_parallel_size``, ``sequence_parallel``,
    ``recompute_granularity``, fusions on GPU, ...
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = gpt_extra(hf_config, tp=tp)
    fields: dict[str, Any] = {
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "num_attention_heads": hf_config.num_attention_heads,
        "num_query_groups": _num_kv_heads(hf_config),
        "kv_channels": _head_dim(hf_config),
        "ffn_hidden_size": hf_config.intermediate_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf_config.rms_norm_eps),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": extra.model_type == "qwen2",
        "qk_layernorm": extra.model_type == "qwen3",
        "hidden_dropout": 0.0,
        "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        "init_method_std": float(getattr(hf_config, "initializer_range", 0.02)),
        "attention_softmax_in_fp32": True,
        "tensor_model_parallel_size": tp,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        # Without CUDA, parameters can only be created on the host.
        "use_cpu_initialization": not torch.cuda.is_available(),
    }
    fields.update(parallel)
    return TransformerConfig(**fields), extra


# ----- weights ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamMap:
    """One megatron parameter, the HF tensors it is made of, and how TP splits it.

    ``kind``: ``replicated`` (norms), ``qkv``, ``fc1`` (gate/up), ``row`` (split along
    dim 1) or ``vocab`` (padded, split along dim 0).
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str


def param_map(hf_config: Any, *, fused_norms: bool = False) -> list[ParamMap]:
    """Every megatron parameter of the model in ``hf_config`` with its HF sources.

    ``fused_norms`` names the layer norms as TransformerEngine's spec does (inside
    ``linear_qkv`` / ``linear_fc1``) instead of the local spec's separate modules.
    """
    extra = gpt_extra(hf_config)
    maps = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(hf_config.num_hidden_layers):
        hf = f"model.layers.{i}."
        mg = f"decoder.layers.{i}."
        attn = mg + "self_attention."
        qkv = tuple(f"{hf}self_attn.{p}_proj.weight" for p in "qkv")
        input_norm = (
            attn + "linear_qkv.layer_norm_weight" if fused_norms else mg + "input_layernorm.weight"
        )
        mlp_norm = (
            mg + "mlp.linear_fc1.layer_norm_weight"
            if fused_norms
            else mg + "pre_mlp_layernorm.weight"
        )
        maps += [
            ParamMap(input_norm, (hf + "input_layernorm.weight",), "replicated"),
            ParamMap(attn + "linear_qkv.weight", qkv, "qkv"),
        ]
        if extra.model_type == "qwen2":
            bias = tuple(f"{hf}self_attn.{p}_proj.bias" for p in "qkv")
            maps.append(ParamMap(attn + "linear_qkv.bias", bias, "qkv"))
        if extra.model_type == "qwen3":
            maps += [
                ParamMap(
                    attn + "q_layernorm.weight", (hf + "self_attn.q_norm.weight",), "replicated"
                ),
                ParamMap(
                    attn + "k_layernorm.weight", (hf + "self_attn.k_norm.weight",), "replicated"
                ),
            ]
        maps += [
            ParamMap(attn + "linear_proj.weight", (hf + "self_attn.o_proj.weight",), "row"),
            ParamMap(mlp_norm, (hf + "post_attention_layernorm.weight",), "replicated"),
            ParamMap(
                mg + "mlp.linear_fc1.weight",
                (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                "fc1",
            ),
            ParamMap(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row"),
        ]
    maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not extra.tie_word_embeddings:
        maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), "vocab"))
    return maps


def _qkv_groups(hf_config: Any) -> tuple[int, int, int]:
    """(KV groups G, query heads per group, head_dim)."""
    groups = _num_kv_heads(hf_config)
    return groups, hf_config.num_attention_heads // groups, _head_dim(hf_config)


def _shard_one(
    pm: ParamMap, tensors: Sequence[Tensor], hf_config: Any, rank: int, tp: int
) -> Tensor:
    if pm.kind == "replicated":
        return tensors[0].clone()
    if pm.kind == "row":
        return tensors[0].chunk(tp, dim=1)[rank].clone()
    if pm.kind == "vocab":
        full = tensors[0]
        padded = padded_vocab_size(full.shape[0], tp)
        pad = full.new_zeros((padded - full.shape[0], *full.shape[1:]))
        return torch.cat([full, pad]).chunk(tp, dim=0)[rank].clone()
    if pm.kind == "fc1":
        gate, up = (t.chunk(tp, dim=0)[rank] for t in tensors)
        return torch.cat([gate, up])
    if pm.kind == "qkv":
        groups, per_group, head_dim = _qkv_groups(hf_config)
        q, k, v = tensors
        tail = tuple(q.shape[1:])  # (hidden,) for weights, () for biases
        fused = torch.cat(
            [
                q.reshape(groups, per_group * head_dim, *tail),
                k.reshape(groups, head_dim, *tail),
                v.reshape(groups, head_dim, *tail),
            ],
            dim=1,
        )
        return fused.chunk(tp, dim=0)[rank].reshape(-1, *tail).clone()
    raise AssertionError(pm.kind)


def gather_hf(pm: ParamMap, shards: Sequence[Tensor], hf_config: Any) -> list[tuple[str, Tensor]]:
    """The HF tensors of one megatron parameter from its shards on every TP rank (in order)."""
    if pm.kind == "replicated":
        return [(pm.hf[0], shards[0].clone())]
    if pm.kind == "row":
        return [(pm.hf[0], torch.cat(list(shards), dim=1))]
    if pm.kind == "vocab":
        return [(pm.hf[0], torch.cat(list(shards), dim=0)[: int(hf_config.vocab_size)].clone())]
    if pm.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves])
        up = torch.cat([h[1] for h in halves])
        return [(pm.hf[0], gate), (pm.hf[1], up)]
    if pm.kind == "qkv":
        _, per_group, head_dim = _qkv_groups(hf_config)
        tail = tuple(shards[0].shape[1:])
        fused = torch.cat([s.reshape(-1, (per_group + 2) * head_dim, *tail) for s in shards])
        q, k, v = fused.split([per_group * head_dim, head_dim, head_dim], dim=1)
        return [(name, t.reshape(-1, *tail)) for name, t in zip(pm.hf, (q, k, v), strict=True)]
    raise AssertionError(pm.kind)


def _check_hf_keys(state_dict: Mapping[str, Tensor], maps: Iterable[ParamMap], tied: bool) -> None:
    expected = {name for pm in maps for name in pm.hf}
    present = {k for k in state_dict if not k.endswith(IGNORED_HF_SUFFIXES)}
    if tied:
        # HF state dicts of tied models may list lm_head.weight (the same tensor).
        present.discard("lm_head.weight")
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise ValueError(
            f"HF state dict does not match the config: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )


def hf_to_megatron(
    state_dict: Mapping[str, Tensor],
    hf_config: Any,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    fused_norms: bool = False,
    only: Collection[str] | None = None,
) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s megatron state dict from a full HF one, in the local spec's
    names (TransformerEngine's with ``fused_norms``); with ``only``, just those megatron
    names (a pipeline stage's), the other HF tensors never read."""
    gpt_extra(hf_config, tp=tp_size)  # rejects what cannot be split or reproduced
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside tensor-parallel size {tp_size}")
    maps = param_map(hf_config, fused_norms=fused_norms)
    _check_hf_keys(state_dict, maps, bool(getattr(hf_config, "tie_word_embeddings", False)))
    if only is not None:
        unknown = sorted(set(only) - {pm.megatron for pm in maps})
        if unknown:
            raise ValueError(f"no HF tensors map to {unknown[:8]}")
        maps = [pm for pm in maps if pm.megatron in only]
    return {
        pm.megatron: _shard_one(pm, [state_dict[n] for n in pm.hf], hf_config, tp_rank, tp_size)
        for pm in maps
    }


def megatron_to_hf(
    shards: Sequence[Mapping[str, Tensor]], hf_config: Any, *, fused_norms: bool = False
) -> dict[str, Tensor]:
    """The full HF state dict from every TP rank's megatron state dict (``shards[r]`` of
    rank r). Tied models get no ``lm_head.weight``, as HF checkpoints store them."""
    if not shards:
        raise ValueError("need the state dict of at least one tensor-parallel rank")
    gpt_extra(hf_config, tp=len(shards))
    out: dict[str, Tensor] = {}
    for pm in param_map(hf_config, fused_norms=fused_norms):
        out.update(gather_hf(pm, [s[pm.megatron] for s in shards], hf_config))
    return out
