r"""Final-answer extraction and comparison for ``--rm-type math``.

Where it fits: ``vime.rollout.rewards`` scores a math sample with
:func:`math_reward`: 1.0 when the model's final answer equals the label, else
0.0. Pure string functions: no torch, no I/O. The rules, in order:

1. **Answer text** (:func:`answer_text`). A response with think tags
   (Qwen3-style ``<think>reasoning</think>answer``) answers only in the text
   after its last ``</think>``; a ``</think>`` without ``<think>`` counts too
   (chat templates that put ``<think>`` in the prompt). A response cut off
   inside a think block -- ``<think>`` with no ``</think>`` after it -- has
   given no answer and scores 0, whatever numbers its reasoning wrote, and so
   does a response with nothing after its ``</think>``. A response without
   think tags is all answer text.
2. **Final answer** (:func:`extract_answer`), from the answer text, first that
   exists: the last non-empty ``\boxed{...}`` or ``\fbox{...}`` (nested braces
   kept whole, a box cut off before its closing brace skipped); else the last
   explicit final-answer line -- a line starting ``Answer:``, ``Final answer:``,
   ``The final answer is:`` (case-insensitive, markdown such as
   ``**Answer:**`` allowed), whose answer is the rest of that line (a number
   followed by plain words -- units -- is that number); else the
   last number (negative, thousands commas, decimals or a simple fraction:
   ``-3``, ``1,234``, ``0.5``, ``3/4``). No answer scores 0.
3. **Label** (:func:`math_reward`): the label itself, or the last ``\boxed{}``
   or the text after ``####`` (GSM8K solutions) in it. A list or tuple label
   (verl-style data) matches when any element does. A None label -- or an
   empty list -- is a ValueError: there is nothing to compare with.
4. **Normalization** of both sides (:func:`normalize_answer`): ``$``/``\$``,
   ``%``/``\%`` and degrees (``^\circ``, ``^{\circ}``, ``°``) removed;
   ``\left``/``\right`` and LaTeX spacing (``\,`` ``\!`` ``\;`` ``\quad``)
   removed; a leading single-variable assignment dropped (``x = 5`` -> ``5``,
   ``\theta = 30`` -> ``30``); unit words in ``\text{}``/``\mathrm{}`` after a
   number dropped (``10\text{ cm}`` -> ``10``); other ``\text{}``,
   ``\textbf{}``, ``\mathrm{}`` ... wrappers replaced by their content;
   ``\dfrac``/``\tfrac`` -> ``\frac`` and brace-less arguments braced
   (``\frac12`` -> ``\frac{1}{2}``, ``\sqrt3`` -> ``\sqrt{3}``); then
   ``\frac{a}{b}`` -> ``a/b`` (non-atomic parts parenthesized:
   ``(x+1)/2``); ``1{,}000`` and a whole answer ``1,000`` -> ``1000`` (commas in
   a tuple such as ``(1, 2)`` or ``1,2`` are kept); a lone parenthesized letter
   ``(A)`` -> ``A``; a trailing period and all whitespace removed.
5. **Comparison** (:func:`answers_equal`): when both normalized answers parse
   as rational numbers they are equal when the values are
   (``0.5 == 1/2 == \frac{1}{2}``, ``3.50 == 3.5``); otherwise when the texts
   are identical.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")

# A line such as "Answer: 5", "**Answer:** 5", "**Final Answer**: 5",
# "The final answer is: 5"; group 1 is the rest of the line.
_ANSWER_LINE = re.compile(
    r"^[ \t>#*_-]*(?:the[ \t]+)?(?:final[ \t]+)?answer(?:[ \t]+is)?[ \t]*[*_]*[ \t]*:(.*)$",
    re.IGNORECASE | re.MULTILINE,
)

# A minus sign is a sign only where it cannot be a subtraction ("5-3" is 5 and
# 3); thousands groups must be exactly three digits ("12,3456" is two numbers).
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?"
    r"(?:(?:\d{1,3}(?:,\d{3}(?!\d))+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/\d+)?"
)

_DOLLAR_PERCENT = re.compile(r"\\?[$%]")
_DEGREES = re.compile(r"(?:\{\})?\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![A-Za-z])")
_SPACING = re.compile(r"\\[,!;: ]|\\q?quad(?![A-Za-z])|\\left(?![A-Za-z])|\\right(?![A-Za-z])")
_ASSIGNMENT = re.compile(r"^(?:[A-Za-z]|\\[A-Za-z]+)\s*=\s*([^=]+)$")
_WRAPPER = r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox)"
_UNWRAP = re.compile(_WRAPPER + r"\s*\{([^{}]*)\}")
# A plain numeral: sign, digits with any commas, decimals.
_NUMERAL = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_NUMBER_WITH_UNIT = re.compile(
    r"^(" + _NUMERAL + r"|-?\\frac\{[^{}]*\}\{[^{}]*\})\s*"
    r"(?:" + _WRAPPER + r"\s*\{\s*[A-Za-z][A-Za-z ./]*\}\s*(?:\^\s*\{?\s*\d\s*\}?)?\s*)+$"
)
_ANY_FRAC = re.compile(r"\\[dt]frac(?![A-Za-z])")
_ARG = r"\{[^{}]*\}|\\[A-Za-z]+|[0-9A-Za-z]"
_FRAC_SHORTHAND = re.compile(rf"\\frac\s*({_ARG})\s*({_ARG})")
_SQRT_SHORTHAND = re.compile(r"\\sqrt\s*([0-9A-Za-z])")
_FRAC = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_ATOM = re.compile(r"-?[0-9A-Za-z.]+")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_CHOICE = re.compile(r"\(([A-Za-z])\)")
_PLAIN_UNITS = re.compile(r"^\$?(" + _NUMERAL + r")\s+[A-Za-z][A-Za-z .]*$")


def answer_text(response: str) -> str | None:
    """The part of ``response`` that may hold the answer; None while still thinking.

    With think tags only the text after the last ``</think>`` counts; a
    ``<think>`` with no ``</think>`` after it is a response cut off mid-thought.
    """
    close = response.rfind(_THINK_CLOSE)
    opened = response.rfind(_THINK_OPEN)
    if opened > close:
        return None
    if close == -1:
        return response
    return response[close + len(_THINK_CLOSE) :]


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


def _answer_lines(text: str) -> list[str]:
    lines = []
    for match in _ANSWER_LINE.finditer(text):
        value = match.group(1).strip(" \t*").rstrip(".").strip(" \t*")
        units = _PLAIN_UNITS.match(value)  # "5 apples", "18 dollars an hour": the number
        if units:
            value = units.group(1)
        if value:
            lines.append(value)
    return lines


def extract_answer(text: str) -> str | None:
    """The final answer in ``text`` (rules 1 and 2 of the module docstring).

    The last ``\\boxed{...}``, else the last ``Answer: ...`` line, else the last
    number, all taken from :func:`answer_text`. None when there is none (or the
    response stopped inside a think block).
    """
    body = answer_text(text)
    if body is None:
        return None
    boxed = [box.strip() for box in _boxed_contents(body)]
    boxed = [box for box in boxed if box]
    if boxed:
        return boxed[-1]
    lines = _answer_lines(body)
    if lines:
        return lines[-1]
    numbers = _NUMBER.findall(body)
    return numbers[-1] if numbers else None


def _braced(arg: str) -> str:
    return arg if arg.startswith("{") else "{" + arg + "}"


def _frac_to_slash(match: re.Match) -> str:
    parts = []
    for part in match.groups():
        part = "".join(part.split())
        parts.append(part if _ATOM.fullmatch(part) else f"({part})")
    slash = "/".join(parts)
    # "2\frac{1}{2}" must not become "21/2".
    before = match.string[: match.start()].rstrip()
    return f"({slash})" if before[-1:].isalnum() else slash


def normalize_answer(text: str) -> str:
    """``text`` in the canonical form compared by :func:`answers_equal` (rule 4)."""
    s = _DOLLAR_PERCENT.sub("", text)
    s = _DEGREES.sub("", s)
    s = _SPACING.sub(" ", s)
    s = s.replace("{,}", ",").strip().rstrip(".").strip()
    s = _ANY_FRAC.sub(r"\\frac", s)
    s = _SQRT_SHORTHAND.sub(r"\\sqrt{\1}", s)
    s = _FRAC_SHORTHAND.sub(lambda m: rf"\frac{_braced(m[1])}{_braced(m[2])}", s)
    assignment = _ASSIGNMENT.match(s)
    if assignment:
        s = assignment.group(1).strip()
    unit = _NUMBER_WITH_UNIT.match(s)
    if unit:
        s = unit.group(1)
    while True:
        unwrapped = _UNWRAP.sub(r"\1", s)
        if unwrapped == s:
            break
        s = unwrapped
    s = _FRAC.sub(_frac_to_slash, s)
    s = "".join(s.split()).rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    choice = _CHOICE.fullmatch(s)
    if choice:
        s = choice.group(1)
    return s


def _as_number(text: str) -> Fraction | None:
    # Fraction parses "-3", "0.50", "1e-3" and "3/4" exactly, so equal values
    # compare equal without float rounding.
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def answers_equal(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` are the same answer (rules 4 and 5).

    Both are normalized by :func:`normalize_answer`; then numerically equal when
    both parse as rationals, otherwise equal as text.
    """
    na, nb = normalize_answer(a), normalize_answer(b)
    va, vb = _as_number(na), _as_number(nb)
    if va is not None and vb is not None:
        return va == vb
    return na == nb


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
    ``#### answer`` holds it, or a list/tuple of such (any may match). A
    response with no answer at all scores 0.0 (see the module docstring). A None
    label, or a list with no element, is a ValueError: there is nothing to
    compare with (not the text "None").
    """
    labels = list(label) if isinstance(label, list | tuple) else [label]
    golds = [_gold_answer(item) for item in labels if item is not None]
    if not golds:
        raise ValueError(f"math_reward needs a label to compare the answer with; got {label!r}")
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    return 1.0 if any(answers_equal(predicted, gold) for gold in golds) else 0.0
