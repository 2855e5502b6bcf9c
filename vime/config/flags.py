"""The common flags of ``vime-train``, declared once, by group.

Where it fits: ``vime.config.parser`` builds the parser from these groups (the rollout
and agent groups in ``vime.config.rollout_flags``, the algorithm's in ``algo_flags``,
LoRA's in ``lora_flags``) plus the selected backend's own flags
(``vime.backends.registry``); cross-flag rules live in ``vime.config.validate``.

Names follow what slime / verl users type. On a CPU machine the "gpus" counts
are numbers of processes.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from vime.config.algo_flags import add_algorithm_flags
from vime.config.flag_types import non_negative_int, positive_int
from vime.config.lora_flags import add_lora_flags
from vime.config.rollout_flags import add_agent_flags, add_rollout_flags

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def _cluster(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--actor-num-nodes", type=positive_int, default=1, help="nodes running training ranks"
    )
    p.add_argument(
        "--actor-num-gpus-per-node",
        type=positive_int,
        default=1,
        help="training ranks per node (GPUs; processes on a CPU machine)",
    )
    p.add_argument(
        "--rollout-num-gpus",
        type=positive_int,
        default=None,
        help="GPUs for rollout engines in total (default: one engine's worth; "
        "with --colocate the training GPUs are shared)",
    )
    p.add_argument(
        "--rollout-num-gpus-per-engine",
        type=positive_int,
        default=1,
        help="GPUs per rollout engine (its tensor-parallel size)",
    )
    p.add_argument(
        "--colocate",
        action="store_true",
        help="training and rollout share devices, sleeping in turn",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster instead of starting a local one (also read from RAY_ADDRESS)",
    )


def _prompt_sources(p: argparse._ArgumentGroup) -> None:
    """The model, the prompts and the held-out prompts."""
    p.add_argument(
        "--hf-checkpoint",
        default=None,
        metavar="DIR",
        help="local HF model folder (config, safetensors, tokenizer); "
        "default: the embedded tiny model",
    )
    p.add_argument(
        "--keep-dropout",
        action="store_true",
        help="keep the checkpoint's dropout in the RL forwards (log-probs, reference, "
        "update); by default every dropout probability of its config is set to 0",
    )
    p.add_argument(
        "--prompt-data",
        default=None,
        metavar="FILE",
        help="jsonl or parquet prompts, or builtin:<task>",
    )
    p.add_argument(
        "--eval-prompt-data",
        default=None,
        metavar="FILE",
        help="held-out prompts scored without training",
    )
    p.add_argument(
        "--eval-interval",
        type=positive_int,
        default=None,
        help="score --eval-prompt-data every K rollouts (and at the end)",
    )
    p.add_argument(
        "--eval-n-samples-per-prompt",
        type=positive_int,
        default=1,
        help="completions per eval prompt (pass@1 is their mean correctness)",
    )
    p.add_argument(
        "--eval-temperature",
        type=float,
        default=0.0,
        help="eval sampling temperature; 0 is greedy",
    )


def _prompt_fields(p: argparse._ArgumentGroup) -> None:
    """A data row's fields, and how long the data feeds the run."""
    p.add_argument("--input-key", default="prompt", help="prompt field of a data row")
    p.add_argument("--label-key", default="label", help="label field of a data row")
    p.add_argument("--metadata-key", default="metadata", help="metadata field of a data row")
    p.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="wrap prompts in the tokenizer's chat template",
    )
    p.add_argument(
        "--num-rollout",
        type=positive_int,
        default=None,
        help="rollouts to run, which the data must feed (default: as many as --num-epoch "
        "passes feed, at --rollout-batch-size x --over-sampling-factor prompts each)",
    )
    p.add_argument("--num-epoch", type=positive_int, default=1, help="passes over the prompts")
    p.add_argument(
        "--seed", type=int, default=1234, help="seeds data order, sampling and model init"
    )


def _data(p: argparse._ArgumentGroup) -> None:
    _prompt_sources(p)
    _prompt_fields(p)


def _optimizer(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--lr", type=float, default=1e-6, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=0.0, help="floor of the decayed learning rate")
    p.add_argument(
        "--lr-decay-style",
        choices=LR_DECAY_STYLES,
        default="constant",
        help="learning-rate decay from --lr to --min-lr over the run, after the warmup",
    )
    p.add_argument(
        "--lr-warmup-samples",
        type=non_negative_int,
        default=0,
        help="linear warmup length, in samples (so batch size changes keep it)",
    )
    p.add_argument(
        "--weight-decay",
        type=float,
        default=0.0,
        help="AdamW decay; biases and 1-D norm weights are never decayed",
    )
    p.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW's beta1")
    p.add_argument("--adam-beta2", type=float, default=0.98, help="AdamW's beta2")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW's epsilon")
    p.add_argument(
        "--clip-grad", type=float, default=1.0, help="global grad-norm clip; 0 disables clipping"
    )


def _checkpoint(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="checkpoint folder (iter_N/); saved after the last rollout, and every "
        "--save-interval rollouts when given",
    )
    p.add_argument(
        "--load",
        default=None,
        metavar="DIR",
        help="resume from the latest checkpoint here (may equal --save before the first save)",
    )
    p.add_argument(
        "--save-interval",
        type=positive_int,
        default=None,
        help="save every K rollouts (and at the end)",
    )
    p.add_argument(
        "--keep-last-checkpoints",
        type=positive_int,
        default=None,
        help="delete older iter_N folders beyond the last N",
    )
    p.add_argument(
        "--save-hf",
        default=None,
        metavar="DIR",
        help="write the final model as an HF folder (safetensors); with --lora-rank, a "
        "PEFT adapter folder for the base checkpoint",
    )
    p.add_argument(
        "--save-hf-merged",
        default=None,
        metavar="DIR",
        help="write the final model as a full HF folder, LoRA adapters merged in",
    )


def rollout_ids(text: str) -> tuple[int, ...]:
    """``"1"``, ``"2,5"``, ``"3-4"``, ``"1,3-5"``: the sorted rollout ids named."""
    ids: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give rollout ids (from 0) as N, A,B or A-B"
            ) from None
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(f"{text!r}: {part.strip()} is not a range of ids >= 0")
        ids.update(range(first, last + 1))
    return tuple(sorted(ids))


def _logging(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--output-dir",
        default=None,
        metavar="DIR",
        help="metrics.jsonl, plots, events (default runs/<timestamp>)",
    )
    p.add_argument("--use-tensorboard", action="store_true", help="write TensorBoard events")
    p.add_argument("--use-wandb", action="store_true", help="log to Weights & Biases")
    p.add_argument("--wandb-project", default="vime", help="W&B project name")
    p.add_argument(
        "--profile-rollouts",
        type=rollout_ids,
        default=(),
        metavar="IDS",
        help="write OUTPUT_DIR/trace.json (Perfetto / chrome://tracing) of these rollouts: "
        "ids as in metrics.jsonl (from 0), e.g. 1, 2,5 or 3-4",
    )


def _model(p: argparse._ArgumentGroup) -> None:
    # Megatron-style architecture flags, as scripts/models/*.sh spell them. Both backends
    # read the architecture from the checkpoint's config.json; these are checked against it.
    p.add_argument("--num-layers", type=positive_int, default=None, help="decoder layers")
    p.add_argument("--hidden-size", type=positive_int, default=None, help="model width")
    p.add_argument(
        "--ffn-hidden-size", type=positive_int, default=None, help="MLP intermediate size"
    )
    p.add_argument("--num-attention-heads", type=positive_int, default=None, help="query heads")
    p.add_argument(
        "--num-query-groups", type=positive_int, default=None, help="key/value heads (GQA)"
    )
    p.add_argument("--kv-channels", type=positive_int, default=None, help="head dimension")
    p.add_argument("--vocab-size", type=positive_int, default=None, help="vocabulary size")
    p.add_argument("--rotary-base", type=float, default=None, help="RoPE base (theta)")
    p.add_argument("--norm-epsilon", type=float, default=None, help="RMSNorm epsilon")
    # --no-...: a recipe states both ways, so a tied checkpoint under an untied recipe
    # (or the reverse) fails at start-up too.
    p.add_argument(
        "--qk-layernorm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="RMSNorm on queries and keys (Qwen3)",
    )
    p.add_argument(
        "--untie-embeddings-and-output-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the output layer has weights of its own, not the input embedding's",
    )


# What ``vime-train`` with no --hf-checkpoint runs: a tiny Qwen3-shaped model built in code
# with a character tokenizer, learning string reversal on the CPU (see README). Measured
# settings: larger learning rates collapse onto a constant answer within seconds.
EMBEDDED_DEFAULTS = {
    "prompt_data": "builtin:reverse",
    "rollout_batch_size": 64,
    "n_samples_per_prompt": 8,
    "rollout_max_prompt_len": 64,
    "rollout_max_response_len": 8,
    "num_rollout": 400,
    "num_epoch": 1000,
    "lr": 3e-4,
    "use_dynamic_batch_size": True,
    # The whole rollout (512 samples of <= 72 tokens) in one row: attention is per
    # sample (varlen_sdpa), so a longer row costs nothing, and one forward and backward
    # a step spend least on per-call overhead; its 64 prompts are computed once each.
    "max_tokens_per_gpu": 36864,
}
EMBEDDED_EVAL_INTERVAL = 20
BUILTIN_DATA_PREFIX = "builtin:"


def apply_embedded_eval_defaults(args: argparse.Namespace) -> None:
    """The embedded default's held-out prompts, once the flags are parsed: the eval split
    of the built-in task it trains on, scored every ``EMBEDDED_EVAL_INTERVAL`` rollouts.

    Eval is scored with the training data's reward, so a fixed default (another task's
    eval split) would be scored wrongly; a user's own prompt file gets no eval set unless
    ``--eval-prompt-data`` names one.
    """
    from vime.data.prompts import builtin_task_of  # deferred: --help does without it

    task = builtin_task_of(args.prompt_data) if args.prompt_data else None
    if args.eval_prompt_data is None and task:
        args.eval_prompt_data = f"{BUILTIN_DATA_PREFIX}{task}:eval"
    if args.eval_prompt_data is not None and args.eval_interval is None:
        args.eval_interval = EMBEDDED_EVAL_INTERVAL


def apply_embedded_task_defaults(
    args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]
) -> None:
    """A built-in task's own settings for the embedded run (a tool task's trajectories
    need a larger token budget and more rollouts), each unless its flag was given."""
    from vime.data.prompts import builtin_task_of  # deferred: --help does without it
    from vime.data.tasks import TASKS

    name = builtin_task_of(args.prompt_data) if args.prompt_data else None
    if name not in TASKS:  # an unknown name is refused, with the flag, later
        return
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    for dest, value in getattr(TASKS[name], "embedded_defaults", ()):
        flags = next(a.option_strings for a in parser._actions if a.dest == dest)
        if not given & set(flags):
            setattr(args, dest, value)


GROUPS = (
    ("cluster", "placement of training ranks and rollout engines", _cluster),
    ("rollout", "generation and reward", add_rollout_flags),
    ("agent", "multi-turn rollouts: tools, custom generation", add_agent_flags),
    ("data", "model, prompts and their fields", _data),
    ("model", "architecture flags (MODEL_ARGS), checked against --hf-checkpoint", _model),
    ("algorithm", "advantages, policy loss, KL, batching", add_algorithm_flags),
    ("optimizer", "AdamW and the learning-rate schedule", _optimizer),
    ("lora", "low-rank adapters, trained in place of every weight", add_lora_flags),
    ("checkpoint", "save, resume and export", _checkpoint),
    ("logging", "metrics and output", _logging),
)


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """Add every common flag to ``parser``, one argument group per topic."""
    for title, description, add in GROUPS:
        add(parser.add_argument_group(title, description))
