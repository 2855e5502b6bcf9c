"""fsdp2 and megatron are the same run on sampled data, through the path ``vime-train`` takes.

Proves, per seeded random case (``alignment_cases.draw``: a tiny Qwen3 / Qwen2 / Llama,
tied or not, GQA, head_dim != hidden / heads, a character tokenizer whose special ids
the random model samples; a run's loss, advantage and batching flags, multi-turn
samples with environment tokens): ``Run`` -> ``RayTrainGroup`` -> actors, one rollout
from the hf engine, trained for one or more optimizer steps by each backend, gives the
same rollout, the same loss, grad norm and every ``train/*`` metric, the same
weights after the steps, at the tolerances of ``test_backend_losses.py``, and the same
forwarded rows (a group's shared prompt once). The fixed CI seeds together cover every
drawn family, and their batches really hold special ids, EOS-ended and length-cut
responses, non-zero advantages and rows that share a prompt. A new algorithm flag or an
HF config field the megatron backend reads that no case draws (or excludes, with the
reason) fails the guard tests. ``VIME_ALIGN_SEED=N pytest ... -k replay`` replays seed N.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

import pytest
from alignment_cases import (
    DRAWN_FLAGS,
    DRAWN_MODEL_FIELDS,
    EOS_ID,
    EXCLUDED_FLAGS,
    EXCLUDED_MODEL_FIELDS,
    SPECIAL_IDS,
    Case,
    argv,
    case_flags,
    draw,
    write_case,
)

pytest.importorskip("megatron.core")

import ray

from vime.config import algo_flags, parse_args
from vime.ray.cluster import init_local_ray
from vime.setup.run import build_run
from vime.trainer import Run

# Seeds CI runs, chosen so that together they cover every family (test_ci_seeds_cover_...).
CI_SEEDS = (417, 571, 1937, 2629)
REPLAY = "VIME_ALIGN_SEED={seed} python -m pytest tests/cpu/test_alignment_sampled.py -k replay"
# test_backend_losses.py's tolerances.
REL, ABS, WEIGHT_ABS = 1e-5, 1e-7, 5e-5
HOOKS = str(Path(__file__).with_name("alignment_cases.py"))
MEGATRON_DIR = Path(__file__).parents[2] / "vime" / "backends" / "megatron"


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for every run of the module (``Run`` joins it): started once."""
    started = not ray.is_initialized()
    if started:
        init_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _release(run: Run) -> None:
    """What ``vime.trainer.run`` does after training, but Ray stays up for the next run."""
    run.close("done")
    for actor in [*run.train_group.workers, *run.engines.actors]:
        ray.kill(actor)
    ray.util.remove_placement_group(run.parts.actors.placement.group)


def _record_rows(worker) -> None:
    """Run in a train worker (``__ray_call__``; pickled by value, as nested): from now on
    its backend keeps each row it forwards as (length, length of the row unshared)."""

    def start(worker) -> None:
        backend = worker.actor.backend
        real, backend.recorded_rows = backend._pack, []

        def pack(batch, indices):
            packed = real(batch, indices)
            backend.recorded_rows.append((packed.row_length, batch.pack(indices).row_length))
            return packed

        backend._pack = pack

    ray.get(worker.__ray_call__.remote(start))


def _train(case: Case, paths: dict[str, str], backend: str, folder: Path) -> dict:
    """One rollout of ``case`` trained by ``backend``: its metrics, the weights after, the
    sampled batch (the manager's data position put back, so the step draws it again), and
    the rows the backend forwarded (``_record_rows``)."""
    from safetensors.torch import load_file

    run = Run(
        build_run(parse_args(argv(case, paths, backend, str(folder / backend)), for_run=True))
    )
    try:
        position = run.manager.state_dict()
        batch, _ = run.manager.generate(0)
        run.manager.load_state_dict(position)
        (worker,) = run.train_group.workers
        _record_rows(worker)
        metrics = run.step(0)
        rows = ray.get(worker.__ray_call__.remote(lambda w: w.actor.backend.recorded_rows))
        run.train_group.export_hf(str(folder / backend / "hf"))
    finally:
        _release(run)
    weights = load_file(str(folder / backend / "hf" / "model.safetensors"))
    return {"metrics": metrics, "weights": weights, "batch": batch, "rows": rows}


def _mismatches(fsdp: dict, mega: dict) -> list[str]:
    """Every disagreement between the two backends' outcomes, one line each."""
    out = []
    if fsdp["rows"] != mega["rows"]:  # each backend forwards each shared prompt once
        out.append(f"rows (length, unshared): fsdp2 {fsdp['rows']} megatron {mega['rows']}")
    a, b = fsdp["batch"], mega["batch"]
    fields = ("tokens", "loss_masks", "advantages", "rollout_log_probs")
    if any(getattr(a, f) != getattr(b, f) for f in fields):
        out.append("the two runs sampled different batches")
    fm, mm = fsdp["metrics"], mega["metrics"]
    keys = sorted(k for k in fm if k.startswith("train/"))
    if keys != sorted(k for k in mm if k.startswith("train/")):
        out.append(f"train/* keys differ: {sorted(set(keys) ^ {k for k in mm if 'train/' in k})}")
    for key in keys:
        want, got = fm[key], mm.get(key, math.nan)
        if got != pytest.approx(want, rel=REL, abs=0 if key == "train/grad_norm" else ABS):
            out.append(f"{key}: fsdp2 {want!r} megatron {got!r}")
    for key in sorted(k for k in fm if k.startswith("rollout/") and not k.endswith("_s")):
        if fm[key] != mm.get(key):
            out.append(f"{key}: fsdp2 {fm[key]!r} megatron {mm.get(key)!r}")
    for name, weight in fsdp["weights"].items():
        diff = float((mega["weights"][name] - weight).abs().max())
        if diff > WEIGHT_ABS:
            out.append(f"weight {name}: max |fsdp2 - megatron| {diff:.3g}")
    return out


def batch_facts(case: Case, batch) -> dict[str, bool]:
    """What the sampled batch holds: special ids among the model's tokens (mask 1), a
    response ended by EOS, one cut at the length cap, a mask hole, a non-zero advantage."""
    cap = int(case.flags[case.flags.index("--rollout-max-response-len") + 1])
    facts = dict.fromkeys(("special", "eos", "cut", "hole", "advantage"), False)
    for tokens, start, mask, adv in zip(
        batch.tokens, batch.prompt_lengths, batch.loss_masks, batch.advantages, strict=True
    ):
        model = [t for t, m in zip(tokens[start:], mask, strict=True) if m]
        facts["special"] |= any(t in SPECIAL_IDS for t in model[:-1])
        facts["eos"] |= EOS_ID in model
        facts["cut"] |= len(tokens) - start >= cap and EOS_ID not in model
        facts["hole"] |= 0 in mask[mask.index(1) :] if 1 in mask else False
        facts["advantage"] |= adv != 0
    return facts


_OUTCOMES: dict[int, dict] = {}


def _outcome(seed: int, tmp_path_factory) -> dict:
    """Seed ``seed`` trained by both backends (once per session)."""
    from safetensors.torch import load_file

    if seed not in _OUTCOMES:
        case = draw(seed)
        folder = tmp_path_factory.mktemp(f"align{seed}")
        paths = write_case(case, folder)
        fsdp = _train(case, paths, "fsdp2", folder)
        mega = _train(case, paths, "megatron", folder)
        initial = load_file(str(Path(paths["model"]) / "model.safetensors"))
        moved = max(float((fsdp["weights"][n] - w).abs().max()) for n, w in initial.items())
        _OUTCOMES[seed] = {"case": case, "fsdp2": fsdp, "megatron": mega, "moved": moved}
    return _OUTCOMES[seed]


def check_seed(seed: int, tmp_path_factory) -> None:
    got = _outcome(seed, tmp_path_factory)
    case, fsdp = got["case"], got["fsdp2"]
    wrong = _mismatches(fsdp, got["megatron"])
    facts = batch_facts(case, fsdp["batch"])
    if not facts["advantage"]:
        wrong.append("every advantage is 0: the step trains nothing")
    if not fsdp["metrics"]["train/grad_norm"] > 0:
        wrong.append(f"fsdp2's grad norm is {fsdp['metrics']['train/grad_norm']}")
    if not got["moved"] > 0:
        wrong.append("the weights did not move")
    if not got["megatron"]["rows"]:
        wrong.append("no forwarded row was recorded")
    header = f"{case.describe()}\nreplay: {REPLAY.format(seed=seed)}"
    assert not wrong, header + "\n" + "\n".join(wrong)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_backends_agree_on_a_sampled_rollout(seed: int, local_ray, tmp_path_factory) -> None:
    """Seed ``seed``'s case: same rollout, loss, grad norm, train/* metrics and weights."""
    check_seed(seed, tmp_path_factory)


def test_replay(local_ray, tmp_path_factory) -> None:
    """The seed in VIME_ALIGN_SEED, as a failing seed's line says to replay it."""
    seed = os.environ.get("VIME_ALIGN_SEED")
    if seed is None:
        pytest.skip("set VIME_ALIGN_SEED to replay a seed")
    check_seed(int(seed), tmp_path_factory)


def _families(case: Case) -> set[str]:
    m, f = case.model, case.flags
    out = {m["model_type"], "tied" if m["tie_word_embeddings"] else "untied"}
    heads, kv = m["num_attention_heads"], m["num_key_value_heads"]
    out.add(f"gqa-{heads // kv}")
    out |= {"gqa"} if heads > kv else {"mha"}
    if m["head_dim"] * heads != m["hidden_size"]:
        out.add("head_dim!=hidden/heads")
    if m["pad_token_id"] is not None:
        out.add("pad_token_id")
        if m["model_type"] == "qwen3" and m["tie_word_embeddings"]:
            out.add("issue-30-model")  # a tied Qwen3 whose pad row is zero, no gradient
    if case.multiturn:
        out.add("multiturn")
    n = int(f[f.index("--n-samples-per-prompt") + 1])
    total = n * int(f[f.index("--rollout-batch-size") + 1])
    if n > 1:
        out.add("shared-prompts")
    if int(f[f.index("--global-batch-size") + 1]) < total:
        out.add("several-steps")
    for flag, value in zip(f, [*f[1:], ""], strict=True):
        if flag.startswith("--"):
            out.add(flag if value.startswith("--") or not value else f"{flag}={value}")
            out.add(flag)
    return out


def _required_families() -> set[str]:
    req = {"qwen3", "qwen2", "llama", "tied", "untied", "gqa-2", "gqa-4", "mha"}
    req |= {"head_dim!=hidden/heads"}
    req |= {"pad_token_id", "issue-30-model", "multiturn", "shared-prompts", "several-steps"}
    req |= {f"--advantage-estimator={e}" for e in algo_flags.ADVANTAGE_ESTIMATORS}
    req |= {f"--kl-loss-type={k}" for k in algo_flags.KL_TYPES}
    req |= {f"--loss-agg-mode={m}" for m in algo_flags.AGGREGATION_MODES}
    req |= {f"--tis-level={v}" for v in algo_flags.CORRECTION_LEVELS}
    req |= {f"--tis-mode={v}" for v in algo_flags.CORRECTION_MODES}
    req |= {"--policy-loss-level=sequence", *DRAWN_FLAGS}
    req |= {f"--lm-head-tail={t}" for t in ("logits", "fused")}
    return req


def test_ci_seeds_cover_every_family() -> None:
    """The CI seeds' cases together draw every model feature, flag and flag value that
    matters (each advantage estimator, KL type, aggregation mode, correction level and
    mode, GSPO, multi-turn, several steps, tied and untied, GQA, qk-norm or not, the
    whole-logits and the fused log-prob tail)."""
    drawn = set().union(*(_families(draw(s)) for s in CI_SEEDS))
    assert not _required_families() - drawn, sorted(_required_families() - drawn)


def test_ci_batches_hold_special_ids_eos_and_cut_responses(local_ray, tmp_path_factory) -> None:
    """The CI seeds' sampled batches (as trained) hold special ids among the model's own
    tokens, responses ended by EOS and responses cut at the cap, mask holes, and non-zero
    advantages, and megatron's rows hold a shared prompt once: what the alignment checks
    are meant to see."""
    facts = []
    for seed in CI_SEEDS:
        got = _outcome(seed, tmp_path_factory)
        facts.append(batch_facts(draw(seed), got["fsdp2"]["batch"]))
        facts[-1]["shared"] = any(n < unshared for n, unshared in got["megatron"]["rows"])
    missing = [k for k in facts[0] if not any(f[k] for f in facts)]
    assert not missing, (missing, facts)


def test_every_algorithm_flag_is_drawn_or_excluded(tmp_path: Path) -> None:
    """A new algorithm flag fails here until the generator draws it or excludes it with a
    reason; and every drawn flag is drawn by some seed."""
    parser = argparse.ArgumentParser()
    algo_flags.add_algorithm_flags(parser)
    names = {opt for action in parser._actions for opt in action.option_strings}
    names -= {"-h", "--help"}
    assert names == DRAWN_FLAGS | EXCLUDED_FLAGS, sorted(names ^ (DRAWN_FLAGS | EXCLUDED_FLAGS))
    assert not DRAWN_FLAGS & EXCLUDED_FLAGS
    seen = set().union(*(_families(draw(s)) for s in range(200)))
    assert seen >= DRAWN_FLAGS, sorted(DRAWN_FLAGS - seen)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')
    for seed in range(200):  # every drawn case's flags pass the parser's rules
        data = ["--prompt-data", str(prompts), "--custom-rm-path", f"{HOOKS}:reward"]
        parse_args([*case_flags(draw(seed)), *data])


def megatron_config_reads() -> set[str]:
    """The HF config fields the megatron backend's code reads (``hf_config.x``,
    ``getattr(hf_config, "x", ...)``), from its source."""
    attribute = re.compile(r"hf_config\.([a-z_][a-z0-9_]*)")
    getattr_ = re.compile(r"getattr\(\s*(?:self\.)?hf_config\s*,\s*[\"']([a-z_][a-z0-9_]*)[\"']")
    sources = [p.read_text() for p in MEGATRON_DIR.glob("*.py")]
    return {m for s in sources for pattern in (attribute, getattr_) for m in pattern.findall(s)}


def test_every_model_field_megatron_reads_is_drawn_or_excluded() -> None:
    """A field the megatron backend starts reading from the HF config fails here until the
    generator draws it (or excludes it with a reason); each drawn field varies by seed."""
    reads = megatron_config_reads()
    assert {"vocab_size", "tie_word_embeddings", "num_key_value_heads"} <= reads  # it parses
    known = DRAWN_MODEL_FIELDS | EXCLUDED_MODEL_FIELDS
    assert reads <= known, sorted(reads - known)
    assert not DRAWN_MODEL_FIELDS & EXCLUDED_MODEL_FIELDS
    values: dict[str, set[str]] = {name: set() for name in DRAWN_MODEL_FIELDS}
    for seed in range(200):
        model = draw(seed).model
        model["rope_theta"] = model["rope_parameters"]["rope_theta"]
        for name in DRAWN_MODEL_FIELDS:
            values[name].add(repr(model.get(name, "<missing>")))
    constant = {name: v for name, v in values.items() if len(v) < 2}
    assert not constant, constant  # each drawn field takes several values
