"""Argument types the flag groups share (argparse only)."""

from __future__ import annotations

import argparse
from typing import Any


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def given_flags(args: Any, *dests: str) -> list[str]:
    """The flags (``--dest-name``) among ``dests`` that hold a value on ``args``, in
    order: what a check names when flags that exclude each other were given together."""
    return ["--" + dest.replace("_", "-") for dest in dests if getattr(args, dest) is not None]
