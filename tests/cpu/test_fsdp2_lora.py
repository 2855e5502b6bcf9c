"""LoRA on the fsdp2 backend, on real gloo process groups (CPU, fp32, tiny random Qwen3).

Proves: only the adapters are trainable and only they have AdamW state; no host copy
of the reference is kept; the adapters' gradient on two ranks equals autograd through
a LoRA forward written here by hand (``W + s·B A`` from the gathered A and B, KL against
the base, entropy); the reference (adapters off) gives the base model's log-probs bit for
bit after training moved the actor; an adapter-only sync (base once, then A and B alone)
leaves an engine with the same weights, bit for bit, and the same log-probs as a merged
full sync; the PEFT export loads with ``peft`` onto the base checkpoint and reproduces
the trainer's logits, and the merged export with transformers alone; dp=1 and dp=2
agree; save -> new processes -> load -> continue equals the uninterrupted run bitwise;
a checkpoint of another LoRA shape is refused; a target that names no linear layer
lists the ones that exist. With --lora-modules-to-save norm every norm trains in full
beside the adapters, travels at every sync under its own name, is the original in the
reference, and the same sync, reference and export checks hold, also for a tied head's
embedding (one trained copy serves both); an unknown module lists those that exist.
With bf16 compute on an fp32 checkpoint the base is stored in bf16, yet the merged
export writes every layer without an adapter bit for bit as the checkpoint has it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from actor_harness import VOCAB, actor_args, full_tensor, make_batch, make_schedule, spawn
from tiny_models import save_tiny, tiny_qwen3_config

from vime.config.train_settings import train_settings
from vime.data.batch import RolloutBatch

RANK, ALPHA = 4, 8.0
LORA = ("--lora-rank", str(RANK), "--lora-alpha", str(ALPHA))
SAVED = ("--lora-modules-to-save", "norm")
# The norms "norm" names (peft matches name ends): 4 in each of 2 blocks, and the final one.
SAVED_NORMS = 4 * 2 + 1
BUCKET = 1 << 14


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3"), tiny_qwen3_config(VOCAB), seed=0)


def _buckets(buckets) -> list[list[tuple[str, torch.Tensor]]]:
    return [[(n, t.detach().clone()) for n, t in bucket] for bucket in buckets]


def _flat(buckets) -> dict[str, torch.Tensor]:
    return {n: t for bucket in buckets for n, t in bucket}


def _adapters(actor) -> dict[str, torch.Tensor]:
    from vime.backends.fsdp2.lora import wire_name

    return {
        wire_name(n): full_tensor(p).detach().clone()
        for n, p in actor.backend.model.named_parameters()
        if p.requires_grad
    }


def _job(rank: int, world: int, scenario: str, args, *extra) -> dict:
    from vime.backends.policy_actor import make_actor

    actor = make_actor("fsdp2")
    start = actor.init(train_settings(args))
    return SCENARIOS[scenario](actor, args, start, *extra)


def scenario_steps(actor, args, start):
    """Shapes of the trainable set; then rollout 0 trained, rollout 1's gradient, syncs
    and exports."""
    import torch.distributed as dist

    from vime.algo.metrics import MetricAccumulator

    names = {id(p): n for n, p in actor.backend.model.named_parameters()}
    out: dict = {"trainable": sorted(names[id(p)] for p in actor.backend.params)}
    out["ref_copies"] = actor.ref_shards
    sched0 = make_schedule(args, 0, actor.world)
    out["ref_at_start"] = _gathered(actor.compute_log_probs(sched0, "actor"))
    first_sync = _buckets(actor.sync_buckets(BUCKET))
    out["first_sync"], out["merged0"] = first_sync, _flat(_buckets(actor.weight_buckets(BUCKET)))
    actor.train(sched0)
    out["optimizer_state"] = sorted(names[id(p)] for p in actor.optimizer.state)
    out["second_sync"] = _buckets(actor.sync_buckets(BUCKET))
    out["merged1"] = _flat(_buckets(actor.weight_buckets(BUCKET)))
    # Rollout 1's step-0 gradient, with the trained adapters (B is no longer 0).
    out["adapters"] = _adapters(actor)
    sched1 = make_schedule(args, 1, actor.world)
    ref = actor.compute_log_probs(sched1, "ref")
    own = actor.compute_log_probs(sched1, "actor")
    out["ref_after"] = _gathered(actor.compute_log_probs(sched0, "ref"))
    out["actor_after"] = _gathered(actor.compute_log_probs(sched0, "actor"))
    actor.backward_step(sched1, 0, MetricAccumulator(), ref=ref, old=own)
    out["grads"] = {
        n: p.grad.full_tensor().clone()
        for n, p in actor.backend.model.named_parameters()
        if p.grad is not None
    }
    dist.barrier()
    actor.export_hf(args.save_hf)
    actor.export_hf(args.save_hf_merged, merged=True)
    with torch.no_grad():
        row = sched1.batch.pack(next(iter(sched1.plan.steps[0].for_rank(0))))
        out["row"] = row
        out["logits"] = actor.backend.model(**row.model_inputs()).logits
    return out


def _gathered(per_sample: dict) -> dict:
    import torch.distributed as dist

    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, per_sample)
    return {k: v for part in views for k, v in part.items()}


def scenario_train(actor, args, start, count: int = 2):
    metrics = [
        actor.train(make_schedule(args, rid, actor.world)) for rid in range(start, start + count)
    ]
    if args.save:
        actor.save(start + count - 1)
    return {"adapters": _adapters(actor), "metrics": metrics, "start": start}


def scenario_refused(actor, args, start, other_args):
    """A second actor, another LoRA shape, loading this run's checkpoint."""
    from vime.backends.policy_actor import make_actor
    from vime.checkpoint import CheckpointError

    actor.save(0)
    try:
        make_actor("fsdp2").init(train_settings(other_args))
    except CheckpointError as err:
        return {"error": str(err)}
    return {"error": None}


def scenario_bf16(actor, args, start):
    """Storage dtypes, the log-probs at start, and (LoRA) the reference after a step. The
    LoRA actor's first forward is the reference's (adapters off), as in a run's first
    train step: FSDP2 must still see the adapters as the parameters that train."""
    sched = make_schedule(args, 0, actor.world)
    out: dict = {"dtypes": {n: p.dtype for n, p in actor.backend.model.named_parameters()}}
    if actor.backend.lora.enabled:
        out["ref_start"] = _gathered(actor.compute_log_probs(sched, "ref"))
    out["start"] = _gathered(actor.compute_log_probs(sched, "actor"))
    if actor.backend.lora.enabled:
        out["metrics"] = actor.train(sched)
        out["ref_after"] = _gathered(actor.compute_log_probs(sched, "ref"))
        out["first_sync"] = {n: t.dtype for b in actor.sync_buckets(BUCKET) for n, t in b}
    if args.save_hf_merged:
        actor.export_hf(args.save_hf_merged, merged=True)
        out["adapters"] = _adapters(actor)
    return out


SCENARIOS = {
    "steps": scenario_steps,
    "train": scenario_train,
    "refused": scenario_refused,
    "bf16": scenario_bf16,
}


def _steps(hf_dir: str, tmp: Path, *extra: str) -> dict:
    exports = ("--save-hf", str(tmp / "peft"), "--save-hf-merged", str(tmp / "full"))
    args = actor_args(hf_dir, 2, *LORA, *exports, *extra)
    got = spawn(_job, 2, tmp, "steps", args)
    got["args"], got["tmp"], got["hf"] = args, tmp, hf_dir
    return got


@pytest.fixture(scope="module")
def steps(hf_dir, tmp_path_factory) -> dict:
    return _steps(hf_dir, tmp_path_factory.mktemp("lora_steps"))


@pytest.fixture(scope="module")
def saved_steps(hf_dir, tmp_path_factory) -> dict:
    """The same steps with every norm trained in full beside the adapters."""
    return _steps(hf_dir, tmp_path_factory.mktemp("lora_saved"), *SAVED)


@pytest.fixture(scope="module")
def tied_steps(tmp_path_factory) -> dict:
    """A tied head: its embedding trained in full (one copy serves both) with the norms."""
    tmp = tmp_path_factory.mktemp("lora_tied")
    hf = save_tiny(tmp / "model", tiny_qwen3_config(VOCAB, tie=True), seed=0)
    return _steps(hf, tmp, "--lora-modules-to-save", "embed_tokens,norm")


@pytest.fixture(params=["steps", "saved_steps", "tied_steps"])
def any_steps(request) -> dict:
    return request.getfixturevalue(request.param)


def test_only_adapters_train_and_hold_optimizer_state(steps) -> None:
    trainable = steps["trainable"]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # Every linear projection of both decoder blocks: 7 layers x 2 blocks x (A, B).
    assert len(trainable) == 7 * 2 * 2
    assert steps["optimizer_state"] == trainable
    assert steps["ref_copies"] is None, "LoRA keeps no host copy of the reference"


def _merged_weight(base, a, b) -> torch.Tensor:
    return base + (ALPHA / RANK) * b @ a


def test_adapter_gradient_equals_a_hand_written_lora_forward(steps, hf_dir) -> None:
    from transformers import AutoModelForCausalLM

    args = steps["args"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    base = {n: p.detach() for n, p in model.named_parameters()}
    leaves = {n: t.clone().requires_grad_(True) for n, t in steps["adapters"].items()}
    assert float(steps["adapters"]["model.layers.0.mlp.up_proj.lora_B.weight"].abs().max()) > 0

    def weights() -> dict[str, torch.Tensor]:
        out = dict(base)
        for name in leaves:
            if name.endswith(".lora_A.weight"):
                layer = name.removesuffix(".lora_A.weight")
                a, b = leaves[name], leaves[f"{layer}.lora_B.weight"]
                out[f"{layer}.weight"] = _merged_weight(base[f"{layer}.weight"], a, b)
        return out

    batch = make_batch(1)
    step0 = make_schedule(args, 1, 2).plan.steps[0].sample_indices
    loss = _loss(model, weights(), base, batch, step0, args)
    loss.backward()
    norm = torch.sqrt(sum((t.grad**2).sum() for t in leaves.values()))
    assert norm > 1e-3, "the gradient is zero: the comparison would prove nothing"
    from vime.backends.fsdp2.lora import wire_name

    grads = {wire_name(n): g for n, g in steps["grads"].items()}
    assert grads.keys() == leaves.keys()
    for name, leaf in leaves.items():
        torch.testing.assert_close(grads[name], leaf.grad, rtol=1e-4, atol=1e-6)


def _loss(model, weights, base, batch: RolloutBatch, indices, args) -> torch.Tensor:
    """GRPO at ratio 1 + k3 KL against the base + entropy, per sample, unpacked."""
    from torch.func import functional_call

    total_tokens = sum(sum(batch.loss_masks[i]) for i in indices)
    loss = torch.zeros(())
    for i in indices:
        ids = torch.tensor([batch.tokens[i]])
        p = batch.prompt_lengths[i]

        def logprobs(params, ids=ids, p=p):
            logits = functional_call(model, params, (ids,), {"use_cache": False}).logits[0]
            return torch.log_softmax(logits[p - 1 : -1].float(), dim=-1)

        full = logprobs(weights)
        logp = full.gather(1, ids[0, p:, None])[:, 0]
        with torch.no_grad():
            ref_logp = logprobs(base).gather(1, ids[0, p:, None])[:, 0]
        entropy = -(full.exp() * full).sum(-1)
        pg = -batch.advantages[i] * torch.exp(logp - logp.detach())
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        per_token = pg + args.kl_loss_coef * kl - args.entropy_coef * entropy
        mask = torch.tensor(batch.loss_masks[i], dtype=torch.float32)
        loss = loss + (per_token * mask).sum()
    return loss / total_tokens


def test_saved_modules_train_and_travel_under_their_own_names(saved_steps) -> None:
    trainable = saved_steps["trainable"]
    copies = [n for n in trainable if ".modules_to_save.default." in n]
    assert len(copies) == SAVED_NORMS and len(trainable) == 28 + SAVED_NORMS
    assert saved_steps["optimizer_state"] == trainable
    second = {n for b in saved_steps["second_sync"] for n, _ in b}
    norms = {n for n in second if ".lora_" not in n}
    assert len(norms) == SAVED_NORMS and all(n.endswith("norm.weight") for n in norms)
    moved = (
        saved_steps["merged1"]["model.norm.weight"] - saved_steps["merged0"]["model.norm.weight"]
    )
    assert float(moved.abs().max()) > 1e-4, "the final norm did not train"


def test_a_tied_embedding_trains_as_one_copy(tied_steps) -> None:
    """The embedding of a tied head: one trained copy, the head's too; it moved."""
    copies = [n for n in tied_steps["trainable"] if ".modules_to_save.default." in n]
    assert "model.embed_tokens.modules_to_save.default.weight" in copies
    assert len(copies) == SAVED_NORMS + 1, copies
    second = {n for b in tied_steps["second_sync"] for n, _ in b}
    assert "model.embed_tokens.weight" in second
    before, after = (tied_steps[k]["model.embed_tokens.weight"] for k in ("merged0", "merged1"))
    assert float((after - before).abs().max()) > 1e-4, "the embedding did not train"


def test_an_unknown_module_to_save_lists_the_modules(hf_dir) -> None:
    from transformers import AutoModelForCausalLM

    from vime.backends.fsdp2.lora import inject
    from vime.errors import ConfigError
    from vime.weights.lora import LoraSettings

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    with pytest.raises(ConfigError) as err:
        inject(model, LoraSettings(rank=2, modules_to_save=("layernorm_x",)), seed=0)
    assert "layernorm_x names no module" in str(err.value)
    assert "input_layernorm, k_norm, k_proj, lm_head, norm, o_proj" in str(err.value)


def test_reference_is_the_base_bit_for_bit(any_steps) -> None:
    """Adapters (and saved modules) off after training: exactly the log-probs the
    untrained model gave, while the trained actor's have moved."""
    steps = any_steps
    start, ref, actor = steps["ref_at_start"], steps["ref_after"], steps["actor_after"]
    assert start.keys() == ref.keys() == actor.keys() and len(ref) == 8
    for i in ref:
        assert torch.equal(ref[i], start[i]), i
    moved = max(float((actor[i] - ref[i]).abs().max()) for i in ref)
    assert moved > 1e-4, f"training did not move the actor ({moved})"


def test_adapter_only_sync_serves_what_a_merged_sync_does(any_steps) -> None:
    """Two engines through the engine actor's own update path: one gets the base and the
    adapters, then the adapters alone (and saved modules; streamed bucket by bucket), the
    other the merged weights each time. Same tensors, same log-probs, bit for bit."""
    from vime.ray.engines import EngineActor
    from vime.rollout.engines.registry import EngineOptions
    from vime.weights.lora import EngineLora, LoraSettings

    steps = any_steps
    hf_dir = steps["hf"]
    first, second = steps["first_sync"], steps["second_sync"]
    first_names = {n for b in first for n, _ in b}
    second_names = {n for b in second for n, _ in b}
    saved = ("norm.weight", "embed_tokens.weight")
    assert second_names and all(".lora_" in n or n.endswith(saved) for n in second_names)
    assert first_names == second_names | set(steps["merged0"]), "base once, beside the adapters"
    sent = sum(t.numel() * t.element_size() for b in second for _, t in b)
    full = sum(t.numel() * t.element_size() for t in steps["merged1"].values())
    assert sent < full / 2, (sent, full)

    lora_options = EngineOptions(lora=EngineLora(LoraSettings(RANK, ALPHA), BUCKET))
    lora = EngineActor("hf", hf_dir, lora_options)
    plain = EngineActor("hf", hf_dir, EngineOptions())
    tokens = make_batch(1).tokens[0]
    for version, (buckets, merged) in enumerate(
        [(first, steps["merged0"]), (second, steps["merged1"])], start=1
    ):
        if version == 1:
            lora.load_weights(buckets, version)
        else:
            for bucket in buckets:
                lora.stream_bucket(lambda bucket=bucket: bucket)
            lora.finish_update(version)
        plain.load_weights([list(merged.items())], version)
        served = dict(lora.engine.model.state_dict())
        for name, tensor in merged.items():
            assert torch.equal(served[name], tensor), (version, name)
        assert lora.score(tokens, 2, 1.0) == plain.score(tokens, 2, 1.0)
    assert not torch.equal(
        steps["merged1"]["model.layers.0.mlp.up_proj.weight"],
        steps["merged0"]["model.layers.0.mlp.up_proj.weight"],
    )


def test_peft_export_loads_onto_the_base_and_reproduces_the_logits(any_steps) -> None:
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    steps = any_steps
    hf_dir = steps["hf"]
    peft_dir = steps["tmp"] / "peft"
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(peft_dir))
    merged = AutoModelForCausalLM.from_pretrained(steps["tmp"] / "full", dtype=torch.float32)
    inputs = steps["row"].model_inputs()
    with torch.no_grad():
        assert float(steps["logits"].abs().max()) > 1e-2
        torch.testing.assert_close(model(**inputs).logits, steps["logits"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(**inputs).logits, steps["logits"], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def four_rollouts(hf_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("lora_four")
    return spawn(_job, 2, tmp, "train", actor_args(hf_dir, 2, *LORA), 4)


def test_dp1_equals_dp2(hf_dir, four_rollouts, tmp_path) -> None:
    one = spawn(_job, 1, tmp_path, "train", actor_args(hf_dir, 1, *LORA), 4)
    assert one["metrics"][3]["train/kl_loss"] > 0, "the reference never differed"
    for name, w in one["adapters"].items():
        torch.testing.assert_close(four_rollouts["adapters"][name], w, rtol=1e-4, atol=1e-5)
    for key in ("train/loss", "train/grad_norm", "train/kl_loss"):
        got, want = four_rollouts["metrics"][3][key], one["metrics"][3][key]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-7)


def test_resume_equals_uninterrupted(hf_dir, four_rollouts, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    first = spawn(_job, 2, tmp_path, "train", actor_args(hf_dir, 2, *LORA, "--save", ckpt))
    resumed = spawn(_job, 2, tmp_path, "train", actor_args(hf_dir, 2, *LORA, "--load", ckpt))
    assert resumed["start"] == 2
    assert first["metrics"] + resumed["metrics"] == four_rollouts["metrics"]
    for name, weight in four_rollouts["adapters"].items():
        assert torch.equal(resumed["adapters"][name], weight), name
    # The adapters and their optimizer state: no base weight is in the checkpoint.
    from torch.distributed.checkpoint import FileSystemReader

    from vime.checkpoint import iteration_dir

    keys = FileSystemReader(iteration_dir(ckpt, 1)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 28 and all(".lora_" in k for k in model_keys), model_keys


def test_a_checkpoint_of_another_lora_shape_is_refused(hf_dir, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    Path(ckpt).mkdir()  # --load must name a folder when the flags are parsed
    other = actor_args(hf_dir, 2, "--lora-rank", "2", "--load", ckpt)
    got = spawn(_job, 2, tmp_path, "refused", actor_args(hf_dir, 2, *LORA, "--save", ckpt), other)
    assert got["error"] and "rank 4" in got["error"] and "rank 2" in got["error"], got
    assert "--lora-rank" in got["error"]


BF16 = ("--fsdp-param-dtype", "bfloat16")


@pytest.fixture(scope="module")
def bf16_lora(hf_dir, tmp_path_factory) -> dict:
    """A LoRA actor computing in bf16 on the fp32 checkpoint: one step, then the merged
    export (under ``"merged"``)."""
    tmp = tmp_path_factory.mktemp("lora_bf16")
    args = actor_args(hf_dir, 2, *LORA, *BF16, "--save-hf-merged", str(tmp / "merged"))
    return {**spawn(_job, 2, tmp, "bf16", args), "merged": tmp / "merged"}


def test_bf16_compute_stores_the_base_in_bf16_and_computes_as_before(
    hf_dir, bf16_lora, tmp_path
) -> None:
    """With bf16 compute the frozen base is stored in bf16 (adapters stay fp32), and the
    LoRA actor's log-probs, at start and as the reference after a step, are bit for bit
    those of a full-weight actor whose fp32 master weights are cast for each forward."""
    lora = bf16_lora
    full = spawn(_job, 2, tmp_path, "bf16", actor_args(hf_dir, 2, *BF16))
    adapters = {n: d for n, d in lora["dtypes"].items() if ".lora_" in n}
    base = {n: d for n, d in lora["dtypes"].items() if ".lora_" not in n}
    assert len(adapters) == 28 and set(adapters.values()) == {torch.float32}
    assert set(base.values()) == {torch.bfloat16}
    assert set(full["dtypes"].values()) == {torch.float32}
    assert lora["metrics"]["train/grad_norm"] > 0
    for i, want in full["start"].items():
        assert torch.equal(lora["start"][i], want), i
        assert torch.equal(lora["ref_start"][i], want), i
        assert torch.equal(lora["ref_after"][i], want), i
    # The base travels in the dtype the engines load (the checkpoint's), adapters in fp32.
    sync = lora["first_sync"]
    assert {d for n, d in sync.items() if ".lora_" in n} == {torch.float32}


def test_merged_export_keeps_the_fp32_base_bit_exact_under_bf16_compute(hf_dir, bf16_lora) -> None:
    """The merged export of a bf16-compute run on an fp32 checkpoint writes every layer
    without an adapter bit for bit as the checkpoint has it, and each adapted one as
    ``W + s·B A`` merged in fp32 from the checkpoint's W, not from the bf16-stored base."""
    from safetensors.torch import load_file

    from vime.weights.lora import merge

    source = load_file(str(Path(hf_dir) / "model.safetensors"))
    written = load_file(str(bf16_lora["merged"] / "model.safetensors"))
    assert set(written) == set(source)
    adapters = bf16_lora["adapters"]
    adapted = {n.removesuffix(".lora_A.weight") for n in adapters if n.endswith(".lora_A.weight")}
    assert len(adapted) == 14
    untouched = [n for n in source if n.removesuffix(".weight") not in adapted]
    assert len(untouched) == len(source) - 14 and "model.embed_tokens.weight" in untouched
    rounded = [n for n in untouched if not torch.equal(source[n].bfloat16().float(), source[n])]
    assert rounded  # the check below can tell the bf16-stored base from the checkpoint's
    for name in untouched:
        assert written[name].dtype == torch.float32, name
        assert torch.equal(written[name], source[name]), name
    scale = ALPHA / RANK
    for layer in adapted:
        a, b = adapters[f"{layer}.lora_A.weight"], adapters[f"{layer}.lora_B.weight"]
        want = merge(source[f"{layer}.weight"], a, b, scale, torch.float32)
        assert torch.equal(written[f"{layer}.weight"], want), layer


def test_a_target_matching_no_linear_layer_lists_them(hf_dir) -> None:
    from transformers import AutoModelForCausalLM

    from vime.backends.fsdp2.lora import inject
    from vime.errors import ConfigError
    from vime.weights.lora import LoraSettings

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    with pytest.raises(ConfigError) as err:
        inject(model, LoraSettings(rank=2, target_modules=("q_proj", "qkv")), seed=0)
    message = str(err.value)
    assert "qkv" in message and "q_proj" not in message.split(";")[0]
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in message
