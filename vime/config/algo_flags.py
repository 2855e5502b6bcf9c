"""The algorithm flag group and its checks: advantages, the policy loss and its clip,
the KL and entropy terms, the rollout correction, batching.

Where it fits: ``vime.config.flags`` adds this group to every parser, in its ``GROUPS``
order; ``vime.config.validate`` calls ``check_algorithm`` (the batching flags are
checked there, against the data-parallel size) and ``vime.config.train_settings.loss_settings``
turns the flags into ``vime.algo.objective.LossConfig``, whose fields have no
defaults of their own. The defaults filled in once the flags are parsed are named
here, once. Choices that mirror ``vime.algo`` are spelled out so that ``--help`` needs
no torch import; a test keeps them equal. Argparse only, like every flag module.
"""

from __future__ import annotations

import argparse

from vime.config.flag_types import given_flags, positive_int
from vime.errors import ConfigError

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
POLICY_LOSS_LEVELS = ("token", "sequence")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_MODES = ("truncate", "mask")
# Filled in once the flags are parsed (check_algorithm), where the flag is left out and
# the setting applies: the KL estimator with --use-kl-loss, the correction's with --use-tis.
DEFAULT_KL_TYPE = "low_var_kl"
DEFAULT_TIS_LEVEL = "token"
DEFAULT_TIS_MODE = "truncate"
DEFAULT_TIS_CLIP = 2.0


def _advantages(p: argparse._ArgumentGroup) -> None:
    """Advantages, and the custom advantage and loss functions."""
    p.add_argument(
        "--advantage-estimator",
        choices=ADVANTAGE_ESTIMATORS,
        default="grpo",
        help="how a group's rewards become advantages (formulas: vime.algo.advantages)",
    )
    p.add_argument(
        "--custom-advantage-function-path",
        default=None,
        metavar="MODULE:FN",
        help="replaces the advantage estimator; same signature as vime.algo.compute_advantages",
    )
    p.add_argument(
        "--custom-loss-function-path",
        default=None,
        metavar="MODULE:FN",
        help="replaces the policy loss; same signature as vime.algo.policy_loss",
    )


def _policy_clip(p: argparse._ArgumentGroup) -> None:
    """The policy loss's clipping and level."""
    p.add_argument("--eps-clip", type=float, default=0.2, help="PPO clip: ratio >= 1 - eps")
    p.add_argument(
        "--eps-clip-high",
        type=float,
        default=None,
        help="upper PPO clip: ratio <= 1 + eps_high (default --eps-clip)",
    )
    p.add_argument(
        "--eps-clip-c",
        type=float,
        default=None,
        help="dual-clip bound (> 1) for negative advantages; off by default",
    )
    p.add_argument(
        "--policy-loss-level",
        choices=POLICY_LOSS_LEVELS,
        default="token",
        help="token (PPO/GRPO) or sequence (GSPO) importance ratios",
    )


def _penalties(p: argparse._ArgumentGroup) -> None:
    """KL and entropy terms, and how token losses aggregate."""
    p.add_argument(
        "--use-kl-loss",
        action="store_true",
        help="add a KL penalty against the reference (initial) model",
    )
    p.add_argument("--kl-loss-coef", type=float, default=0.0, help="weight of the KL penalty")
    p.add_argument(
        "--kl-loss-type",
        choices=KL_TYPES,
        default=None,
        help=f"KL estimator (default {DEFAULT_KL_TYPE} when --use-kl-loss)",
    )
    p.add_argument("--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus")
    p.add_argument(
        "--loss-agg-mode",
        choices=AGGREGATION_MODES,
        default="token-mean",
        help="how per-token losses become one number",
    )
    p.add_argument(
        "--loss-agg-norm-len",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="the constant length seq-mean-token-sum-norm (Dr. GRPO) divides by, with the "
        "number of sequences (default --rollout-max-response-len)",
    )


def _correction(p: argparse._ArgumentGroup) -> None:
    """The rollout correction (truncated importance sampling)."""
    p.add_argument(
        "--use-tis",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rollout correction: weight each token's policy loss by exp(old - rollout "
        "log-prob), truncated or masked (--tis-level, --tis-mode, --tis-clip, --tis-clip-low); "
        "default: on with --max-staleness >= 1 (decoupled PPO's behaviour weight), else off; "
        "--no-use-tis trains an asynchronous run uncorrected",
    )
    p.add_argument(
        "--tis-level",
        choices=CORRECTION_LEVELS,
        default=None,
        help="token: a weight per token; sequence: the product of a sequence's token "
        "weights (as verl, slime and TRL), for all its tokens; geometric: their geometric "
        f"mean, for all its tokens (default {DEFAULT_TIS_LEVEL})",
    )
    p.add_argument(
        "--tis-mode",
        choices=CORRECTION_MODES,
        default=None,
        help="truncate: weights above --tis-clip are cut to it; mask: tokens (sequences) whose "
        "weight is outside [--tis-clip-low, --tis-clip] leave the loss "
        f"(default {DEFAULT_TIS_MODE})",
    )
    p.add_argument(
        "--tis-clip",
        type=float,
        default=None,
        metavar="HIGH",
        help=f"upper bound of the rollout-correction weight (default {DEFAULT_TIS_CLIP})",
    )
    p.add_argument(
        "--tis-clip-low",
        type=float,
        default=None,
        metavar="LOW",
        help="lower bound of the weight in --tis-mode mask (default 1 / --tis-clip)",
    )


def _batching(p: argparse._ArgumentGroup) -> None:
    """Optimizer steps per rollout and the micro-batches of each."""
    p.add_argument(
        "--global-batch-size",
        type=positive_int,
        default=None,
        help="samples per optimizer step (default: the whole rollout over --num-steps-per-rollout)",
    )
    p.add_argument(
        "--num-steps-per-rollout",
        type=positive_int,
        default=None,
        help="optimizer steps per rollout, on disjoint samples (default 1)",
    )
    p.add_argument(
        "--shuffle-updates",
        action="store_true",
        help="shuffle samples before splitting them into optimizer steps",
    )
    p.add_argument(
        "--micro-batch-size",
        type=positive_int,
        default=1,
        help="samples per packed row (without --use-dynamic-batch-size)",
    )
    p.add_argument(
        "--use-dynamic-batch-size",
        action="store_true",
        help="pack rows by tokens under --max-tokens-per-gpu",
    )
    p.add_argument(
        "--max-tokens-per-gpu",
        type=positive_int,
        default=None,
        help="token cap of one packed row with --use-dynamic-batch-size",
    )


def add_algorithm_flags(p: argparse._ArgumentGroup) -> None:
    """The algorithm group: advantages, the policy loss, its penalties and correction,
    and batching."""
    _advantages(p)
    _policy_clip(p)
    _penalties(p)
    _correction(p)
    _batching(p)


def check_algorithm(args: argparse.Namespace) -> None:
    """The loss flags' ranges and combinations, their defaults filled in, and the custom
    advantage and loss functions imported (``ConfigError``, one line)."""
    _check_loss(args)
    _check_custom_functions(args)


def _check_loss(args: argparse.Namespace) -> None:
    if not 0 < args.eps_clip < 1:
        raise ConfigError(f"--eps-clip must be in (0, 1), got {args.eps_clip}")
    if args.eps_clip_high is not None and not args.eps_clip_high > 0:
        raise ConfigError(f"--eps-clip-high must be > 0, got {args.eps_clip_high}")
    if args.eps_clip_c is not None and not args.eps_clip_c > 1:
        raise ConfigError(f"--eps-clip-c (dual clip) must be > 1, got {args.eps_clip_c}")
    _check_correction(args)
    if args.loss_agg_norm_len is not None and args.loss_agg_mode != "seq-mean-token-sum-norm":
        raise ConfigError(
            f"--loss-agg-norm-len applies only to --loss-agg-mode seq-mean-token-sum-norm "
            f"(this run uses {args.loss_agg_mode})"
        )
    if args.kl_loss_type is not None and not args.use_kl_loss:
        raise ConfigError(f"--kl-loss-type {args.kl_loss_type} needs --use-kl-loss")
    if args.kl_loss_coef < 0:
        raise ConfigError(f"--kl-loss-coef must be >= 0, got {args.kl_loss_coef}")
    if args.kl_loss_coef > 0 and not args.use_kl_loss:
        raise ConfigError(f"--kl-loss-coef {args.kl_loss_coef} needs --use-kl-loss")
    if args.use_kl_loss and args.kl_loss_type is None:
        args.kl_loss_type = DEFAULT_KL_TYPE
    if args.entropy_coef < 0:
        raise ConfigError(f"--entropy-coef must be >= 0, got {args.entropy_coef}")


def _check_correction(args: argparse.Namespace) -> None:
    """The rollout correction's flags: each needs --use-tis, and the bounds must make sense;
    the defaults (``DEFAULT_TIS_*``) are filled in once here.

    With ``--max-staleness`` >= 1 the correction is on unless ``--no-use-tis``: there its
    weight exp(π_old − engine log-prob) is decoupled PPO's behaviour correction
    π_prox / π_behav, which an asynchronous objective needs (samples of older weights).
    """
    if args.use_tis is None:
        args.use_tis = args.max_staleness > 0
    given = given_flags(args, "tis_level", "tis_mode", "tis_clip", "tis_clip_low")
    if not args.use_tis:
        if given:
            raise ConfigError(f"{given[0]} needs --use-tis (the rollout correction is off)")
        return
    args.tis_level = args.tis_level or DEFAULT_TIS_LEVEL
    args.tis_mode = args.tis_mode or DEFAULT_TIS_MODE
    args.tis_clip = DEFAULT_TIS_CLIP if args.tis_clip is None else args.tis_clip
    if not args.tis_clip > 0:
        raise ConfigError(f"--tis-clip must be > 0, got {args.tis_clip}")
    low = args.tis_clip_low
    if low is not None:
        if args.tis_mode != "mask":
            raise ConfigError(
                "--tis-clip-low applies only to --tis-mode mask (truncate only cuts weights "
                "above --tis-clip)"
            )
        if not 0 <= low < args.tis_clip:
            raise ConfigError(
                f"--tis-clip-low must be in [0, --tis-clip={args.tis_clip}), got {low}"
            )


def _check_custom_functions(args: argparse.Namespace) -> None:
    """Import user hooks now, so a typo fails at start-up rather than after the first rollout."""
    hooks = (
        (
            "--custom-advantage-function-path",
            args.custom_advantage_function_path,
            "compute_advantages",
        ),
        ("--custom-loss-function-path", args.custom_loss_function_path, "policy_loss"),
    )
    for flag, spec, builtin in hooks:
        if spec is None:
            continue
        import vime.algo  # torch is imported only when a hook is given

        try:
            vime.algo.load_function(spec, expected=getattr(vime.algo, builtin))
        except ValueError as err:
            raise ConfigError(f"{flag} {spec}: {err}") from None
