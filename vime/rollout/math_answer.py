"""Final-answer extraction and comparison for ``--rm-type math``.

Where it fits: ``vime.rollout.rewards`` scores a math sample with
:func:`math_reward`: the model's final answer (the last ``\\boxed{...}``, else
the last number it wrote) against the label, equal when both are the same
rational number (``0.5 == 1/2 == \\frac{1}{2}``, ``1,234 == 1234``,
``3.50 == 3.5``) or, when either is not a number, the same text once spaces and
``$`` are removed. Pure string functions: no torch, no I/O.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")

# A minus sign is a sign only where it cannot be a subtraction ("5-3" is 5 and
# 3); thousands groups must be exactly three digits ("12,3456" is two numbers).
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?"
    r"(?:(?:\d{1,3}(?:,\d{3}(?!\d))+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/\d+)?"
)
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_SPACING = re.compile(r"\\[,!;: ]|\\left|\\right")


def _boxed_contents(text: str) -> list[str]:
    """Every balanced ``\\boxed{...}`` body, in order (nested braces kept whole)."""
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found.append(text[start:i])
                    break
    return found


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: the last ``\\boxed{...}``, else the last number.

    Numbers may be negative, use thousands commas, decimals or a simple
    fraction (``-3``, ``1,234``, ``0.5``, ``3/4``). None when there is neither.
    A ``\\boxed{`` cut off before its closing brace (a truncated response) is
    skipped.
    """
    boxed = [body.strip() for body in _boxed_contents(text)]
    boxed = [body for body in boxed if body]
    if boxed:
        return boxed[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalize(text: str) -> str:
    s = text.strip().strip("$").strip()
    s = _LATEX_SPACING.sub("", s)
    s = _FRAC.sub(r"\1/\2", s)
    s = s.rstrip(".").strip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


def _as_number(text: str) -> Fraction | None:
    # Fraction parses "-3", "0.50", "1e-3" and "3/4" exactly, so equal values
    # compare equal without float rounding.
    try:
        return Fraction(text.replace(" ", ""))
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def answers_equal(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` are the same answer.

    Numerically equal when both parse as rationals (after removing ``$``,
    surrounding spaces, a trailing period, thousands commas and turning
    ``\\frac{p}{q}`` into ``p/q``); otherwise equal as text with all whitespace
    removed.
    """
    na, nb = _normalize(a), _normalize(b)
    va, vb = _as_number(na), _as_number(nb)
    if va is not None and vb is not None:
        return va == vb
    return "".join(na.split()) == "".join(nb.split())


def _gold_answer(label: Any) -> str:
    text = str(label)
    boxed = _boxed_contents(text)
    if boxed:
        return boxed[-1]
    # GSM8K-style labels carry their worked solution before "#### answer".
    if "####" in text:
        return text.rsplit("####", 1)[1]
    return text


def math_reward(response: str, label: Any) -> float:
    """1.0 when the final answer of ``response`` equals ``label``, else 0.0.

    ``label`` is the answer itself, or a text whose last ``\\boxed{}`` or
    ``#### answer`` holds it. A response with no answer at all scores 0.0. A None
    label is a ValueError: there is nothing to compare with (not the text "None").
    """
    if label is None:
        raise ValueError("math_reward needs a label to compare the answer with; got None")
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    return 1.0 if answers_equal(predicted, _gold_answer(label)) else 0.0
