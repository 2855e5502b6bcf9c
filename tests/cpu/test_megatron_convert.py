"""HF <-> Megatron conversion and the megatron ``GPTModel`` against transformers (CPU, fp32).

Proves: the weight round trip HF -> TP shards -> HF is exact for Qwen3 (QK norm,
head_dim != hidden/heads), Qwen2 (q/k/v bias), Llama tied and untied, Llama 3.1 RoPE
scaling, at TP=1 and TP=2, in the local layers' names and in TransformerEngine's
(``fused_norms``: the layer norms inside ``linear_qkv`` / ``linear_fc1``), with the
fused QKV laid out per KV group as specified;
unsupported architectures and options are rejected with the reason; and the key
alignment: the same HF weights in megatron-core's ``GPTModel`` give per-token
log-probs (and logits) equal to the HF model's, sample by sample, on one packed
row of 3 samples plus padding -- at TP=1 in this process and at TP=2 in two gloo
processes (vocab-parallel logits gathered), where the real TP=2 model's own
shards also convert back to the HF weights. The row goes in megatron-core's THD
format (``PackedSeqParams``, vime's per-run core attention); the same row as one
sequence under a block-diagonal mask (megatron-core's dense attention) gives the
same logits and parameter gradients. With the pad id inside a response, every
parameter gradient equals HF's (its embedding's ``padding_idx`` row gets none through
the lookup). A pipeline stage reads from disk only the HF tensors its own parameters
come from.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from actor_harness import start_ranks
from tiny_models import LLAMA31_ROPE, tiny_llama_config, tiny_qwen3_config
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

pytest.importorskip("megatron.core")

from vime.backends.megatron import convert, packed_rows
from vime.backends.megatron import model as mmodel
from vime.data.micro_batch import pack_micro_batch, response_log_probs
from vime.weights.hf_files import LazyHFState
from vime.weights.transports import free_port

# Not a multiple of 128: the vocab padding is exercised (128 rows at TP=1, 256 at TP=2).
VOCAB = 100
# Two KV groups of two query heads each, so the per-group QKV layout matters.
GQA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3": lambda: Qwen3Config(vocab_size=VOCAB, head_dim=32, **GQA),
    "qwen3-tiny-mqa": lambda: tiny_qwen3_config(VOCAB),
    "qwen2-bias": lambda: Qwen2Config(vocab_size=VOCAB, **GQA),
    "llama-untied": lambda: LlamaConfig(vocab_size=VOCAB, **GQA),
    "llama-tied": lambda: LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, **GQA),
    "llama-tiny-tied-mqa": lambda: tiny_llama_config(VOCAB, tie=True),
    "llama31-rope": lambda: LlamaConfig(
        vocab_size=VOCAB, rope_parameters=LLAMA31_ROPE, max_position_embeddings=16384, **GQA
    ),
}
TP2_CONFIGS = ("qwen3", "qwen2-bias", "llama-tied")

SAMPLES = ([5, 9, 13, 2, 77, 31, 8], [41, 3, 3, 60, 12, 99, 1, 0, 56, 23, 7, 18], [64, 10, 4, 90])
PROMPT_LENGTHS = (3, 5, 2)


def _hf_model(config: PretrainedConfig) -> torch.nn.Module:
    """A random HF model whose norms and biases are not at their init values (ones,
    zeros), so a misplaced norm or bias changes the numbers."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


def _expected_hf(state: dict[str, torch.Tensor], config: PretrainedConfig) -> dict:
    # HF checkpoints of tied models store no lm_head.weight; megatron_to_hf returns none.
    tied = config.tie_word_embeddings
    return {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}


def _packed():
    return pack_micro_batch([list(s) for s in SAMPLES], list(PROMPT_LENGTHS), pad_to_multiple_of=16)


@torch.no_grad()
def _hf_reference(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits [n, V], response log-probs [r]) of each sample forwarded alone."""
    out = []
    for ids, prompt in zip(SAMPLES, PROMPT_LENGTHS, strict=True):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
        logp, _ = response_log_probs(logits, pack_micro_batch([list(ids)], [prompt]))
        out.append((logits[0], logp[0]))
    return out


def _assert_matches_hf(logits: torch.Tensor, reference: list) -> None:
    packed = _packed()
    assert logits.shape == (1, packed.row_length, VOCAB)
    logp, _ = response_log_probs(logits, packed)
    for i, (ref_logits, ref_logp) in enumerate(reference):
        start, end = int(packed.cu_seqlens[i]), int(packed.cu_seqlens[i + 1])
        torch.testing.assert_close(logits[0, start:end], ref_logits, rtol=0, atol=1e-5)
        r = int(packed.response_lengths[i])
        torch.testing.assert_close(logp[i, :r], ref_logp[:r], rtol=0, atol=1e-5)


# ----- conversion --------------------------------------------------------------------------


def test_a_stage_reads_only_its_own_tensors_from_disk(tmp_path: Path) -> None:
    """What a pipeline stage loads: ``LazyHFState`` gives the saved tensors and their shapes
    (shapes from the file headers), reading a tensor only when asked for; converting
    ``only`` a stage's megatron names equals those entries of the whole conversion and
    reads no other tensor; a name nothing maps to is refused."""
    config = CONFIGS["qwen3"]()
    model = _hf_model(config)
    model.save_pretrained(tmp_path, max_shard_size="200KB")  # several files, as real ones
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    lazy = LazyHFState(str(tmp_path))
    state = model.state_dict()
    assert set(lazy) == set(state) - {"lm_head.weight"} or set(lazy) == set(state)
    for name in lazy:
        assert lazy.shape(name) == tuple(state[name].shape), name
        assert torch.equal(lazy[name], state[name]), name
    whole = convert.hf_to_megatron(lazy, config, 1, 2)
    stage = {n for n in whole if n.startswith("decoder.layers.1.")}
    reads: list[str] = []

    class Counting(LazyHFState):
        def __getitem__(self, key: str) -> torch.Tensor:
            reads.append(key)
            return super().__getitem__(key)

    part = convert.hf_to_megatron(Counting(str(tmp_path)), config, 1, 2, only=stage)
    assert sorted(part) == sorted(stage)
    for name in stage:
        assert torch.equal(part[name], whole[name]), name
    assert reads and all(key.startswith("model.layers.1.") for key in reads), reads
    with pytest.raises(ValueError, match="no HF tensors map to"):
        convert.hf_to_megatron(lazy, config, only={"decoder.layers.99.nothing"})


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fused_norms", [False, True], ids=["local-names", "te-names"])
def test_round_trip_exact(name: str, tp: int, fused_norms: bool) -> None:
    config = CONFIGS[name]()
    if config.num_key_value_heads % tp:
        pytest.skip("KV heads not divisible by TP (rejection is tested separately)")
    state = _hf_model(config).state_dict()
    shards = [
        convert.hf_to_megatron(state, config, r, tp, fused_norms=fused_norms) for r in range(tp)
    ]
    names = [pm.megatron for pm in convert.param_map(config, fused_norms=fused_norms)]
    assert list(shards[0]) == names
    fused = [n for n in names if n.endswith("layer_norm_weight")]
    assert len(fused) == (2 * config.num_hidden_layers if fused_norms else 0)
    extra = convert.gpt_extra(config, tp=tp)
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] == extra.padded_vocab_size // tp
    assert extra.padded_vocab_size % (128 * tp) == 0
    back = convert.megatron_to_hf(shards, config, fused_norms=fused_norms)
    expected = _expected_hf(state, config)
    assert sorted(back) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(back[key], value), key


def test_fused_qkv_and_fc1_layout() -> None:
    """Per TP rank: for each of its KV groups [q heads of the group; k; v], and
    [gate shard; up shard] -- checked on labelled rows, independently of the inverse."""
    config = CONFIGS["qwen2-bias"]()
    heads, groups, hd = 4, 2, 16
    state = {k: v.clone() for k, v in _hf_model(config).state_dict().items()}
    attn = "model.layers.0.self_attn."
    state[attn + "q_proj.bias"] = torch.arange(heads * hd, dtype=torch.float32)
    state[attn + "k_proj.bias"] = 1000 + torch.arange(groups * hd, dtype=torch.float32)
    state[attn + "v_proj.bias"] = 2000 + torch.arange(groups * hd, dtype=torch.float32)
    mlp = "model.layers.0.mlp."
    state[mlp + "gate_proj.weight"] = torch.arange(96.0)[:, None].expand(96, 64).clone()
    state[mlp + "up_proj.weight"] = 500 + torch.arange(96.0)[:, None].expand(96, 64).clone()
    per_group = heads // groups * hd
    for rank in range(2):  # TP=2: one KV group per rank
        shard = convert.hf_to_megatron(state, config, rank, 2)
        bias = shard["decoder.layers.0.self_attention.linear_qkv.bias"]
        q = torch.arange(rank * per_group, (rank + 1) * per_group, dtype=torch.float32)
        k = 1000 + torch.arange(rank * hd, (rank + 1) * hd, dtype=torch.float32)
        assert torch.equal(bias, torch.cat([q, k, k + 1000]))
        fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"][:, 0]
        gate = torch.arange(rank * 48, (rank + 1) * 48, dtype=torch.float32)
        assert torch.equal(fc1, torch.cat([gate, gate + 500]))


@pytest.mark.parametrize(
    ("make", "tp", "reason"),
    [
        (lambda: Qwen3MoeConfig(vocab_size=VOCAB), 1, "model_type 'qwen3_moe'"),
        (
            lambda: Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0),
            1,
            "sliding-window",
        ),
        (
            lambda: LlamaConfig(
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
                original_max_position_embeddings=2048,
                max_position_embeddings=8192,
            ),
            1,
            "rope scaling type 'yarn'",
        ),
        (
            lambda: LlamaConfig(
                rope_parameters={**LLAMA31_ROPE, "low_freq_factor": 2.0},
                max_position_embeddings=16384,
            ),
            1,
            "llama3 rope scaling",
        ),
        (lambda: LlamaConfig(attention_bias=True), 1, "attention_bias"),
        (lambda: LlamaConfig(mlp_bias=True), 1, "mlp_bias"),
        (lambda: LlamaConfig(hidden_act="gelu"), 1, "hidden_act 'gelu'"),
        (lambda: LlamaConfig(partial_rotary_factor=0.5), 1, "partial rotary embeddings"),
        (lambda: Qwen3Config(vocab_size=VOCAB, **GQA), 4, "tensor-parallel size 4"),
    ],
)
def test_unsupported_rejected(make: Callable[[], PretrainedConfig], tp: int, reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("(", r"\(")):
        convert.transformer_config_from_hf(make(), tp=tp)


def test_state_dict_must_match_config() -> None:
    config = CONFIGS["qwen3"]()
    state = dict(_hf_model(config).state_dict())
    del state["model.layers.1.self_attn.q_norm.weight"]
    with pytest.raises(ValueError, match=r"missing.*q_norm"):
        convert.hf_to_megatron(state, config)


def test_transformer_config_fields() -> None:
    tcfg, extra = convert.transformer_config_from_hf(CONFIGS["qwen3"](), tp=2)
    assert (tcfg.num_query_groups, tcfg.kv_channels, tcfg.ffn_hidden_size) == (2, 32, 96)
    assert tcfg.qk_layernorm and not tcfg.add_qkv_bias and tcfg.gated_linear_unit
    assert tcfg.normalization == "RMSNorm" and tcfg.tensor_model_parallel_size == 2
    assert (extra.vocab_size, extra.padded_vocab_size) == (VOCAB, 256)
    tcfg, extra = convert.transformer_config_from_hf(CONFIGS["llama31-rope"]())
    assert extra.rope_scaling and extra.rope_scaling_factor == 8.0
    assert extra.rotary_base == 500000.0 and not tcfg.qk_layernorm


# ----- the megatron model against transformers --------------------------------------------


def test_block_causal_mask() -> None:
    mask = mmodel.block_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    allowed = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, ~allowed[None, None])


def test_rotary_follows_position_ids(megatron_world: None) -> None:
    config = CONFIGS["qwen3"]()
    tcfg, _ = convert.transformer_config_from_hf(config)
    model = mmodel.build_gpt_model(config, tcfg)
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    out = model._preprocess(torch.zeros_like(positions), positions)
    table = model.rotary_pos_emb(5)  # [S, 1, 1, D] for positions 0..S-1
    assert torch.equal(out[1], table[positions[0]])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_log_probs_match_hf(name: str, megatron_world: None) -> None:
    config = CONFIGS[name]()
    hf = _hf_model(config)
    tcfg, _ = convert.transformer_config_from_hf(config)
    model = mmodel.build_gpt_model(config, tcfg)
    mmodel.load_megatron_state(model, convert.hf_to_megatron(hf.state_dict(), config))
    model.eval()
    with torch.no_grad():
        logits = mmodel.packed_logits(model, _packed())
    _assert_matches_hf(logits, _hf_reference(hf))


def test_thd_rows_match_the_block_mask(megatron_world: None) -> None:
    config = CONFIGS["qwen3"]()
    tcfg, _ = convert.transformer_config_from_hf(config)
    model = mmodel.build_gpt_model(config, tcfg)
    cores = [m for m in model.modules() if isinstance(m, mmodel.DotProductAttention)]
    assert len(cores) == config.num_hidden_layers
    assert all(isinstance(m, mmodel.PackedDotProductAttention) for m in cores)
    packed = _packed()
    assert packed.pad_length > 0
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(1, packed.row_length, 1, generator=torch.Generator().manual_seed(0))
    results = []
    for forward in (mmodel.stage_forward, mmodel.block_mask_forward):
        logits = forward(model, packed)
        grads = torch.autograd.grad((weights * logits).sum(), params)
        results.append((logits.detach(), grads))
    (thd, thd_grads), (block, block_grads) = results
    torch.testing.assert_close(thd, block, rtol=0, atol=1e-5)
    for got, want in zip(thd_grads, block_grads, strict=True):
        scale = want.abs().max()  # fp32 summation order: ~1e-7 of each tensor's scale
        assert (got - want).abs().max() <= 2e-6 * scale
    assert max(g.abs().max() for g in block_grads) > 1e-3


def test_shared_prompt_rows_match_unshared_rows(megatron_world: None) -> None:
    """A row holding each shared prompt once (``packed_rows.device_row``) gives the local
    layers' log-probs and gradients of the unshared row, in fewer tokens; a shared row
    without its layout, or for TransformerEngine's layers, is refused."""
    config = CONFIGS["qwen3"]()
    tcfg, _ = convert.transformer_config_from_hf(config)
    model = mmodel.build_gpt_model(config, tcfg)
    prompt, other = [5, 9, 13, 2], [64, 10]
    ids = [
        [*prompt, 77, 31, 8],
        [64, 10, 4, 90],
        [*prompt, 3],
        [*prompt, 60, 12, 99, 1],
        [*other, 7],
    ]
    prompts = [4, 2, 4, 4, 2]
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for share in (False, True):
        host = pack_micro_batch(ids, prompts, pad_to_multiple_of=8, share_prompts=share)
        packed = packed_rows.device_row(host, torch.device("cpu"), local_attention=True)
        logp, _ = response_log_probs(mmodel.packed_logits(model, packed), packed)
        weights = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp)
        grads = torch.autograd.grad((weights * logp).sum(), params)
        results.append((host.row_length, logp.detach(), grads))
    (plain_length, plain, plain_grads), (shared_length, shared, shared_grads) = results
    assert shared_length < plain_length
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    for got, want in zip(shared_grads, plain_grads, strict=True):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-7
    host = pack_micro_batch(ids, prompts, share_prompts=True)
    with pytest.raises(ValueError, match="share_prompts=False"):
        mmodel.packed_seq_params(host)
    with pytest.raises(ValueError, match="TransformerEngine"):
        packed_rows.device_row(host, torch.device("cpu"), local_attention=False)


# ----- tensor parallel = 2 ------------------------------------------------------------------


def _tp2_worker(rank: int, port: int, names: tuple[str, ...], states: Path, out: Path) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    mmodel.init_model_parallel(tp=2, seed=1234)
    try:
        for name in names:
            config = CONFIGS[name]()
            state = torch.load(states / f"{name}.pt")
            tcfg, _ = convert.transformer_config_from_hf(config, tp=2)
            model = mmodel.build_gpt_model(config, tcfg)
            mmodel.load_megatron_state(model, convert.hf_to_megatron(state, config, rank, 2))
            model.eval()
            with torch.no_grad():
                logits = mmodel.packed_logits(model, _packed())
            own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
            torch.save({"logits": logits, "state": own}, out / f"{name}.{rank}.pt")
    finally:
        mmodel.destroy_model_parallel()


def test_tensor_parallel_2_matches_hf(tmp_path: Path) -> None:
    references = {}
    for name in TP2_CONFIGS:
        config = CONFIGS[name]()
        hf = _hf_model(config)
        torch.save(hf.state_dict(), tmp_path / f"{name}.pt")
        references[name] = (config, hf.state_dict(), _hf_reference(hf))
    start_ranks(_tp2_worker, (free_port(), TP2_CONFIGS, tmp_path, tmp_path), 2)
    for name, (config, state, reference) in references.items():
        results = [torch.load(tmp_path / f"{name}.{r}.pt") for r in range(2)]
        for result in results:  # every rank sees the full (gathered) vocabulary
            _assert_matches_hf(result["logits"], reference)
        back = convert.megatron_to_hf([r["state"] for r in results], config)
        expected = _expected_hf(state, config)
        assert sorted(back) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(back[key], value), (name, key)


@pytest.mark.parametrize("name", ["qwen3", "llama-tied"])
def test_gradients_match_hf_where_the_row_holds_the_pad_id(name: str, megatron_world: None) -> None:
    """With the pad id inside a response (as a sampled one may hold it), every parameter's
    gradient equals HF's: the pad row gets none through the lookup (HF's padding_idx; its
    zero vector would otherwise meet RMSNorm's 1/sqrt(eps)), a tied head still trains it."""
    config = CONFIGS[name]()
    config.pad_token_id = 0
    assert any(0 in s[p:] for s, p in zip(SAMPLES, PROMPT_LENGTHS, strict=True))
    hf = _hf_model(config).float()
    with torch.no_grad():
        hf.get_input_embeddings().weight[0].zero_()  # as HF initialises the padding row
    tcfg, _ = convert.transformer_config_from_hf(config)
    model = mmodel.build_gpt_model(config, tcfg)
    mmodel.load_megatron_state(model, convert.hf_to_megatron(hf.state_dict(), config))
    model.eval()
    pairs = zip(SAMPLES, PROMPT_LENGTHS, strict=True)
    weights = [torch.linspace(-1.0, 1.0, len(s) - p) for s, p in pairs]

    hf.zero_grad()
    for ids, prompt, w in zip(SAMPLES, PROMPT_LENGTHS, weights, strict=True):
        logits = hf(input_ids=torch.tensor([ids]), use_cache=False).logits
        logp, _ = response_log_probs(logits, pack_micro_batch([list(ids)], [prompt]))
        (w * logp[0, : len(w)]).sum().backward()
    want = {k: p.grad for k, p in hf.named_parameters()}

    packed = _packed()
    logp, _ = response_log_probs(mmodel.packed_logits(model, packed), packed)
    sum((w * logp[i, : len(w)]).sum() for i, w in enumerate(weights)).backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    got = convert.megatron_to_hf([grads], config)

    embed = "model.embed_tokens.weight"
    if config.tie_word_embeddings:  # the head's own gradient reaches the pad row
        assert want[embed][0].abs().max() > 1e-4
    for key, expected in want.items():
        if key not in got:
            continue  # a tied head's gradient is the embedding's
        scale = expected.abs().max()
        assert (got[key] - expected).abs().max() <= 1e-4 * scale + 1e-7, key
    assert max(g.abs().max() for g in want.values()) > 1e-3
