"""Two-phase parsing of the ``vime-train`` command line.

Phase one reads only ``--train-backend``; phase two parses the common flags
(``vime.config.flags``) plus that backend's own flags (from the registry), then
validates across flags (``vime.config.validate``). The result is a read-only
``Config``: configuration, never runtime state.

Every error is a ``ConfigError`` whose message is one line: the CLI prints it
and exits non-zero. Unknown flags are explained: a flag of another backend
names that backend; anything else gets the nearest known flag.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence

from vime.backends import registry
from vime.config.flags import (
    EMBEDDED_DEFAULTS,
    add_common_flags,
    apply_embedded_eval_defaults,
    apply_embedded_task_defaults,
    apply_gym_eval_default,
)
from vime.config.validate import validate
from vime.errors import ConfigError

PROG = "vime-train"


class Config(argparse.Namespace):
    """The parsed, validated flags. Read-only: live state belongs to the objects that own it."""

    def freeze(self) -> Config:
        object.__setattr__(self, "_frozen", True)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"Config is read-only; cannot set {name!r}")
        super().__setattr__(name, value)

    def replace(self, **changes: object) -> Config:
        """A frozen copy with ``changes`` (settings resolved at start-up, e.g. run length)."""
        unknown = sorted(set(changes) - set(vars(self)))
        if unknown:
            raise AttributeError(f"Config has no setting(s) {unknown}")
        values = {k: v for k, v in vars(self).items() if k != "_frozen"}
        return Config(**{**values, **changes}).freeze()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (raised, not printed) and no prefix matching."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(allow_abbrev=False, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def _backend_epilog() -> str:
    lines = ["backends (--train-backend NAME --help lists that backend's own flags):"]
    lines += [f"  {spec.name:<10} {spec.summary}" for spec in registry.BACKENDS.values()]
    return "\n".join(lines)


def build_parser(backend: str | None) -> argparse.ArgumentParser:
    """The full parser: common flags, plus ``backend``'s flags when one is given."""
    parser = _Parser(
        prog=PROG,
        usage=f"{PROG} [--train-backend NAME] [--flag VALUE ...]",
        description="GRPO-family RL post-training: rollout -> reward -> advantage -> train -> "
        "weight sync.",
        epilog=_backend_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--train-backend",
        choices=registry.backend_names(),
        default=registry.DEFAULT_BACKEND,
        help=f"training backend (default {registry.DEFAULT_BACKEND})",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the flags, print what would run, and stop",
    )
    add_common_flags(parser)
    if backend is not None:
        registry.flag_adder(backend)(parser)
    return parser


def _pre_parse_backend(argv: Sequence[str]) -> str | None:
    """Phase one: the backend named on the command line, or None if not given."""
    pre = _Parser(add_help=False)
    pre.add_argument("--train-backend", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.train_backend is not None:
        try:
            registry.get_backend(known.train_backend)
        except registry.UnknownBackendError as err:
            raise ConfigError(str(err)) from None
    return known.train_backend


def _names_checkpoint(argv: Sequence[str]) -> bool:
    return any(tok == "--hf-checkpoint" or tok.startswith("--hf-checkpoint=") for tok in argv)


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [opt for action in parser._actions for opt in action.option_strings]


def _owner_of(flag: str, selected: str) -> str | None:
    """The other backend that declares ``flag``, if any."""
    for name in registry.backend_names():
        if name == selected:
            continue
        scratch = argparse.ArgumentParser(add_help=False)
        registry.flag_adder(name)(scratch)
        if flag in _option_strings(scratch):
            return name
    return None


def _explain_unknown(unknown: list[str], backend: str, parser: argparse.ArgumentParser) -> str:
    flags = [tok for tok in unknown if tok.startswith("-")]
    if not flags:
        return f"unexpected argument {unknown[0]!r} (every setting is a --flag)"
    flag = flags[0].split("=", 1)[0]
    owner = _owner_of(flag, backend)
    if owner is not None:
        return (
            f"{flag} belongs to the {owner} backend; add --train-backend {owner} "
            f"(this run uses {backend})"
        )
    close = difflib.get_close_matches(flag, _option_strings(parser), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"see {PROG} --help"
    return f"unknown flag {flag}; {hint}"


def parse_args(argv: Sequence[str], *, for_run: bool = False) -> Config:
    """Parse and validate ``argv`` (without the program name) into a frozen ``Config``.

    ``for_run``: the flags configure a whole run, as ``vime-train``'s do, so what only
    a run needs (its prompts) is required too; without it the result may configure one
    part, such as a train actor. Raises ``ConfigError`` (one-line message) on any bad
    input; ``--help`` exits through argparse as usual.
    """
    argv = list(argv)
    named = _pre_parse_backend(argv)
    backend = named or registry.DEFAULT_BACKEND
    wants_help = any(tok in ("-h", "--help") for tok in argv)
    # Plain --help shows the common flags only; naming a backend adds its flags.
    parser = build_parser(named if wants_help else backend)
    embedded = not _names_checkpoint(argv)
    if embedded:
        # No model given: the embedded default (tiny model, built-in task) with settings
        # that make it learn on a laptop; every one of them can still be overridden.
        parser.set_defaults(**EMBEDDED_DEFAULTS)
    namespace, unknown = parser.parse_known_args(argv, namespace=Config())
    if unknown:
        raise ConfigError(_explain_unknown(unknown, backend, parser))
    apply_gym_eval_default(namespace)
    if embedded:
        apply_embedded_eval_defaults(namespace)
        apply_embedded_task_defaults(namespace, parser, argv)
    validate(namespace, for_run=for_run)
    return namespace.freeze()
