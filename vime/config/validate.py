"""Cross-flag validation and derived settings.

Where it fits: the second half of ``vime.config.parser.parse_args``. Each rule
raises ``ConfigError`` with one line that says what is wrong and how to fix it.
Derived settings (the data-parallel size, the global batch size when only the
number of steps is given) are filled in here, once, before the configuration is
frozen. The rules of one flag group live beside its flags and are called from here:
the algorithm's (``algo_flags.check_algorithm``, which also fills in the default KL
estimator and correction), LoRA's (``lora_flags.check_lora``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from vime.backends import registry
from vime.config.agent_checks import check_agent, check_environment
from vime.config.algo_flags import check_algorithm
from vime.config.flags import BUILTIN_DATA_PREFIX
from vime.config.lora_flags import check_lora
from vime.config.model_args import check_model_args_against_checkpoint
from vime.config.rollout_flags import DEFAULT_OVER_SAMPLING_FACTOR
from vime.data.reasoning_gym import is_gym_spec
from vime.data.verifiers_env import is_verifiers_spec
from vime.errors import ConfigError
from vime.rollout.engines import registry as engine_registry


def validate(args: argparse.Namespace, *, for_run: bool = False) -> None:
    """Check ``args`` in place and fill in derived settings; raise ``ConfigError``.

    ``for_run``: ``args`` configure a whole run (the CLI), which also needs prompts; a
    configuration for one part (a train actor in a test) need not name any.
    """
    args.data_parallel_size = registry.validator(args.train_backend)(args)
    check_environment(args)
    _check_paths(args)
    check_model_args_against_checkpoint(args)
    if for_run and args.prompt_data is None:
        raise ConfigError(
            "--prompt-data is required with --hf-checkpoint (a .jsonl or .parquet file, "
            "or builtin:<task>)"
        )
    _check_data(args)
    _check_placement(args)
    _check_engine(args)
    _check_batches(args)
    _check_sampling(args)
    _check_dynamic_sampling(args)
    check_algorithm(args)
    _check_warm_start(args)
    check_agent(args)
    _check_rewards(args)
    _check_optimizer(args)
    check_lora(args)
    _check_checkpointing(args)
    _check_logging(args)


def _check_paths(args: argparse.Namespace) -> None:
    if args.hf_checkpoint is not None and not os.path.isdir(args.hf_checkpoint):
        raise ConfigError(
            f"--hf-checkpoint {args.hf_checkpoint}: no such directory (give a local HF model "
            "folder with config.json and safetensors)"
        )
    for flag, path in (
        ("--prompt-data", args.prompt_data),
        ("--eval-prompt-data", args.eval_prompt_data),
    ):
        is_file_path = (
            path is not None
            and not path.startswith(BUILTIN_DATA_PREFIX)
            and not is_gym_spec(path)
            and not is_verifiers_spec(path)
        )
        if is_file_path and not os.path.isfile(path):
            raise ConfigError(
                f"{flag} {path}: no such file (or use builtin:<task> or reasoning-gym:<task>)"
            )
    # --load may name the --save folder before its first checkpoint exists (auto-resume).
    if args.load is not None and not os.path.isdir(args.load) and args.load != args.save:
        raise ConfigError(f"--load {args.load}: no such directory")


def _check_data(args: argparse.Namespace) -> None:
    train_task = None
    if args.prompt_data is not None:
        train_task = _check_builtin("--prompt-data", args.prompt_data)
    if args.eval_prompt_data is not None:
        eval_task = _check_builtin("--eval-prompt-data", args.eval_prompt_data)
        # Eval is scored with the training task's reward and correctness test.
        if train_task is not None and eval_task is not None and eval_task != train_task:
            raise ConfigError(
                f"--eval-prompt-data {args.eval_prompt_data} is another task than --prompt-data "
                f"{args.prompt_data} (eval is scored with the training task's reward); use "
                f"{_eval_of(args.prompt_data, train_task)}"
            )
    elif args.eval_interval is not None:
        raise ConfigError(
            f"--eval-interval {args.eval_interval} needs --eval-prompt-data (the held-out "
            "prompts to score)"
        )


def _check_builtin(flag: str, spec: str) -> str | None:
    """The task of a ``builtin:<task>[:eval]`` or ``reasoning-gym:<task>...`` spec (None
    for a file; a reasoning-gym task's name keeps its prefix), checked now so that a typo
    fails before any process starts (reasoning-gym is imported for it)."""
    from vime.data.prompts import parse_builtin_spec  # deferred: --help does without it

    if is_gym_spec(spec):
        from vime.data.reasoning_gym import PREFIX, check_spec

        try:
            return PREFIX + check_spec(spec).task
        except ConfigError as err:
            raise ConfigError(f"{flag} {err}") from None
    try:
        parsed = parse_builtin_spec(spec)
    except ConfigError as err:
        raise ConfigError(f"{flag} {spec}: {err}") from None
    return parsed[0].name if parsed else None


def _eval_of(train_spec: str, train_task: str) -> str:
    """The eval spec that goes with training on ``train_spec`` (task ``train_task``)."""
    if is_gym_spec(train_spec):
        from vime.data.reasoning_gym import parse_spec

        return parse_spec(train_spec).eval_spec()
    return f"{BUILTIN_DATA_PREFIX}{train_task}:eval"


def rollout_device_count(args: Any) -> int:
    """How many devices the rollout engines use in all: ``--rollout-num-gpus``, or by
    default every training device under ``--colocate`` and one engine's worth beside
    training otherwise. ConfigError when the engines cannot be laid out on them (also
    what ``vime.config.cluster_settings`` builds the layout's counts from)."""
    num_train = args.actor_num_nodes * args.actor_num_gpus_per_node
    per_engine = args.rollout_num_gpus_per_engine
    rollout_gpus = args.rollout_num_gpus or (num_train if args.colocate else per_engine)
    if rollout_gpus % per_engine != 0:
        raise ConfigError(
            f"--rollout-num-gpus {rollout_gpus} is not a multiple of "
            f"--rollout-num-gpus-per-engine {per_engine} (each engine takes that many)"
        )
    if args.colocate and rollout_gpus > num_train:
        raise ConfigError(
            f"--colocate puts the engines on the {num_train} training device(s) "
            f"(--actor-num-nodes x --actor-num-gpus-per-node); --rollout-num-gpus "
            f"{rollout_gpus} does not fit"
        )
    return rollout_gpus


def joins_cluster(args: Any) -> bool:
    """Whether the run joins a Ray cluster (``--ray-address`` or ``RAY_ADDRESS``).

    Its devices and packages are then the cluster's, not this driver's: a driver on a
    CPU-only head node still trains on the workers' GPUs. So what this machine has
    (CUDA, vLLM, TransformerEngine) is not checked while parsing; ``check_cluster_devices``
    checks the GPUs once Ray is joined, and the actors report a missing package by name.
    """
    return bool(args.ray_address or os.environ.get("RAY_ADDRESS"))


def check_cluster_devices(args: Any, has_gpus: bool, lacking: str) -> None:
    """``check_devices`` of the flags ``args``."""
    check_devices(
        args.weight_sync, args.rollout_num_gpus_per_engine, args.colocate, has_gpus, lacking
    )


def check_devices(
    weight_sync: str, gpus_per_engine: int, colocate: bool, has_gpus: bool, lacking: str
) -> None:
    """ConfigError when the flags do not fit the devices the run gets: flags that only
    work on GPUs on a machine or cluster without any (``lacking`` says where: "none is
    visible here", "the Ray cluster at ... has none"), and on GPUs an NCCL broadcast
    group that would hold two ranks on one GPU or no GPU at all."""
    if has_gpus:
        _check_gpu_broadcast(weight_sync, gpus_per_engine, colocate)
        return
    if weight_sync == "cuda-ipc":
        raise ConfigError(
            f"--weight-sync cuda-ipc needs CUDA GPUs, and {lacking}; use --weight-sync auto"
        )
    if gpus_per_engine > 1:
        raise ConfigError(
            f"--rollout-num-gpus-per-engine {gpus_per_engine} spreads each "
            f"engine over GPUs, and {lacking}; use --rollout-num-gpus-per-engine 1"
        )


def _check_gpu_broadcast(weight_sync: str, gpus_per_engine: int, colocate: bool) -> None:
    """The broadcast group's ranks are training rank 0 and each engine's actor, one GPU
    each: NCCL refuses two ranks on one device, and a tensor-parallel engine's actor
    holds none (vLLM's workers hold its GPUs)."""
    if weight_sync != "broadcast":
        return
    if colocate:
        raise ConfigError(
            "--weight-sync broadcast with --colocate on GPUs would put training rank 0 and "
            "an engine on one GPU in one NCCL group, which NCCL refuses; use --weight-sync "
            "auto (CUDA IPC)"
        )
    if gpus_per_engine > 1:
        raise ConfigError(
            "--weight-sync broadcast does not reach tensor-parallel engines on GPUs (vLLM's "
            "workers, not the engine's actor, hold their GPUs); use --weight-sync auto "
            "(object store)"
        )


def _check_placement(args: argparse.Namespace) -> None:
    """The device layout, checked before Ray starts."""
    rollout_device_count(args)
    tp, engine = args.rollout_num_gpus_per_engine, args.rollout_engine
    tp_engines = engine_registry.tensor_parallel_names()
    explicit = engine != engine_registry.AUTO
    if tp > 1 and explicit and not engine_registry.get_engine(engine).tensor_parallel:
        raise ConfigError(
            f"--rollout-num-gpus-per-engine {tp} needs the {tp_engines} engine (tensor "
            f"parallel); the {engine} engine runs on one device: use "
            f"--rollout-num-gpus-per-engine 1, or install {tp_engines}"
        )
    if args.weight_sync == "cuda-ipc" and (
        not args.colocate or args.rollout_num_gpus_per_engine != 1
    ):
        raise ConfigError(
            "--weight-sync cuda-ipc needs --colocate and --rollout-num-gpus-per-engine 1 "
            "(each engine opens the handles of the training rank on its GPU)"
        )
    if joins_cluster(args):
        return  # the cluster's devices and packages, checked once it is joined
    tensor_parallel = tp > 1
    # auto without an importable vLLM would pick the one-device hf engine
    if tensor_parallel and engine == engine_registry.AUTO:
        chosen, _ = engine_registry.resolve_engine(engine, importable=_import_error)
        if not engine_registry.get_engine(chosen).tensor_parallel:
            raise ConfigError(
                f"--rollout-num-gpus-per-engine {tp} needs the {tp_engines} engine (tensor "
                "parallel), which does not import here; use --rollout-num-gpus-per-engine 1, "
                f"or install {tp_engines}"
            )
    if args.weight_sync == "cuda-ipc" or tensor_parallel:
        from vime import device  # imports torch: only paid when the flags need GPUs

        check_cluster_devices(args, device.cuda_available(), "none is visible here")


def _check_engine(args: argparse.Namespace) -> None:
    """Every engine's own flags (all parse: ``auto`` may pick any engine), and an
    explicit ``--rollout-engine`` must import here, or the run would fail only once the
    engines start (``auto`` falls back to hf instead, and says why)."""
    for check_engine_flags in engine_registry.flag_validators():
        check_engine_flags(args)
    name = args.rollout_engine
    _check_async_engine(args)
    if name == engine_registry.AUTO or joins_cluster(args):
        return  # on a cluster the engine actors import it, and name what fails
    error = _import_error(name)
    if error is not None:
        fix = engine_registry.import_fix(name, error)
        fallback = engine_registry.FALLBACK_ENGINE
        raise ConfigError(
            f"--rollout-engine {name}: {error}; {fix}, or use --rollout-engine {fallback}"
        )


def _check_async_engine(args: argparse.Namespace) -> None:
    """``--max-staleness`` >= 1: the engines keep generating while training runs and new
    weights reach them mid-generation, so they need devices of their own and an engine
    that takes weights between decode steps."""
    if args.cpu_split == "on" and args.colocate:
        raise ConfigError(
            "--cpu-split on gives the engines CPU cores apart from training's, and "
            "--colocate puts them on training's; drop one of the two"
        )
    if args.max_staleness == 0:
        return
    if args.colocate:
        raise ConfigError(
            f"--max-staleness {args.max_staleness} keeps the engines generating while the "
            "trainer trains, and --colocate makes the two take turns on the same devices; "
            "drop --colocate or use --max-staleness 0"
        )
    name, auto = args.rollout_engine, args.rollout_engine == engine_registry.AUTO
    able = [s.name for s in engine_registry.ENGINES.values() if s.in_flight_updates]
    # The embedded model (no --hf-checkpoint) is the one thing that narrows auto's choice.
    may_run = engine_registry.auto_choices(args.hf_checkpoint is None) if auto else (name,)
    unable = [n for n in may_run if n not in able]
    if unable:
        chose = f"auto may choose {unable[0]}" if auto else f"--rollout-engine {name} does not yet"
        raise ConfigError(
            f"--max-staleness {args.max_staleness} needs an engine that takes new weights "
            f"while it generates, and {chose}; use "
            f"--rollout-engine {' or '.join(able)}, or --max-staleness 0"
        )


def _import_error(name: str) -> str | None:
    """``engine_registry.import_error`` (it imports the engine, vLLM: only called when the
    flags need it), with this process's environment put back afterwards: vLLM sets
    variables as it imports, and here, before Ray starts, they would reach every
    training rank."""
    saved = dict(os.environ)
    try:
        return engine_registry.import_error(name)
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update({k: v for k, v in saved.items() if os.environ.get(k) != v})


def _check_batches(args: argparse.Namespace) -> None:
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    steps, gbs = args.num_steps_per_rollout, args.global_batch_size
    if gbs is None:
        steps = steps or 1
        if samples % steps != 0:
            raise ConfigError(
                f"--num-steps-per-rollout {steps} does not divide the {samples} samples of a "
                f"rollout (--rollout-batch-size {args.rollout_batch_size} x "
                f"--n-samples-per-prompt {args.n_samples_per_prompt})"
            )
        gbs = samples // steps
    if samples % gbs != 0:
        raise ConfigError(
            f"--rollout-batch-size x --n-samples-per-prompt = {samples} must be a multiple of "
            f"--global-batch-size {gbs}"
        )
    if steps is not None and steps != samples // gbs:
        raise ConfigError(
            f"--num-steps-per-rollout {steps} disagrees with --global-batch-size {gbs}: "
            f"{samples} samples make {samples // gbs} steps; give only one of the two"
        )
    dp = args.data_parallel_size
    if gbs % dp != 0:
        raise ConfigError(
            f"--global-batch-size {gbs} must be a multiple of the data-parallel size {dp}"
        )
    args.global_batch_size = gbs
    args.num_steps_per_rollout = samples // gbs
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu is None:
        raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
    if args.max_tokens_per_gpu is not None and not args.use_dynamic_batch_size:
        raise ConfigError("--max-tokens-per-gpu only applies with --use-dynamic-batch-size")


def _check_sampling(args: argparse.Namespace) -> None:
    if not args.rollout_temperature > 0:
        raise ConfigError(
            f"--rollout-temperature must be > 0, got {args.rollout_temperature} "
            "(greedy decoding is not a policy to train on)"
        )
    if not 0 < args.rollout_top_p <= 1:
        raise ConfigError(f"--rollout-top-p must be in (0, 1], got {args.rollout_top_p}")
    if args.rollout_top_k != -1 and args.rollout_top_k < 1:
        raise ConfigError(f"--rollout-top-k must be -1 (off) or >= 1, got {args.rollout_top_k}")


def _check_dynamic_sampling(args: argparse.Namespace) -> None:
    factor = args.over_sampling_factor
    if not args.dynamic_sampling_filter:
        if factor is not None:
            raise ConfigError("--over-sampling-factor needs --dynamic-sampling-filter")
        return
    if factor is None:
        args.over_sampling_factor = DEFAULT_OVER_SAMPLING_FACTOR
    elif not (factor >= 1 and factor < float("inf")):
        raise ConfigError(
            f"--over-sampling-factor must be >= 1 (a round asks for at least the missing "
            f"groups), got {factor}"
        )


def _check_rewards(args: argparse.Namespace) -> None:
    """Pick the reward now (and import --custom-rm-path), so a broken one fails at start-up."""
    from vime.config.rollout_settings import check_rewards  # deferred: --help does without it

    check_rewards(args)


def _check_optimizer(args: argparse.Namespace) -> None:
    if not args.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min-lr must be in [0, --lr={args.lr}], got {args.min_lr}")
    if args.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be >= 0, got {args.weight_decay}")
    for flag, beta in (("--adam-beta1", args.adam_beta1), ("--adam-beta2", args.adam_beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(f"{flag} must be in [0, 1), got {beta}")
    if not args.adam_eps > 0:
        raise ConfigError(f"--adam-eps must be > 0, got {args.adam_eps}")
    if args.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0 (0 disables it), got {args.clip_grad}")


def _check_warm_start(args: argparse.Namespace) -> None:
    """``--sft-warmup-steps`` trains demonstrations, which only the built-in tasks give."""
    if not args.sft_warmup_steps:
        return
    from vime.data.prompts import builtin_task_of  # deferred: --help does without it

    if not (args.prompt_data and builtin_task_of(args.prompt_data)):
        raise ConfigError(
            "--sft-warmup-steps trains the demonstrations of a built-in task "
            "(--prompt-data builtin:NAME); drop it for other prompt data"
        )


def _check_checkpointing(args: argparse.Namespace) -> None:
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval needs --save DIR")
    if args.auto_resume and args.save is None:
        raise ConfigError("--auto-resume needs --save DIR (the checkpoints a restart resumes from)")
    if args.keep_last_checkpoints is not None and args.save is None:
        raise ConfigError("--keep-last-checkpoints needs --save DIR")


def _check_logging(args: argparse.Namespace) -> None:
    profiled = args.profile_rollouts
    if profiled and args.num_rollout is not None and profiled[-1] >= args.num_rollout:
        raise ConfigError(
            f"--profile-rollouts names rollout {profiled[-1]}, and the run has "
            f"{args.num_rollout} (ids 0-{args.num_rollout - 1}, as in metrics.jsonl)"
        )
