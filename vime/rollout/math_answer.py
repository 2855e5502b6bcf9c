r"""``--rm-type math``: is the model's final answer the label's? math-verify decides.

Where it fits: ``vime.rollout.rewards`` scores a math sample with :func:`math_reward`:
1.0 when the response's answer equals the label, else 0.0. The checker is math-verify
(HF's, used by TRL and open-r1; the ``agents`` extra), run by
``vime.rollout.math_checker``: it finds the answer in the text (a ``\boxed{}``, an
``Answer:`` line, the last number ...), parses both sides to sympy and compares them
as mathematics (``0.5 == \frac{1}{2}``, ``\sqrt{12} == 2\sqrt{3}``, ``\{1,2\} ==
\{2,1\}``, units, ``$``, ``\%`` and ``x =`` dropped). Without math-verify installed,
``--rm-type math`` is refused at start-up with the line to install it.

What stays hand-written here is only what math-verify gets wrong or cannot know,
measured by ``bench/math_verify_agreement.py`` (table in bench/README.md), each rule
with a test in ``tests/cpu/test_math_answer.py``:

1. **Think tags** (:func:`answer_text`). A response with think tags
   (Qwen3-style ``<think>reasoning</think>answer``) answers only in the text after its
   last ``</think>``; a ``</think>`` without ``<think>`` counts too (chat templates that
   put ``<think>`` in the prompt). A response cut off inside a think block --
   ``<think>`` with no ``</think>`` after it -- has given no answer and scores 0,
   whatever numbers its reasoning wrote, and so does one with nothing after its
   ``</think>``. math-verify would read the reasoning.
2. **The last box is the answer** (:func:`final_answer`). Of several ``\boxed{...}``
   or ``\fbox{...}`` only the last complete, non-empty one is checked; math-verify
   would take all of them as one set (``\boxed{3} ... \boxed{5}`` as ``{3, 5}``).
   A period closing the box's answer is dropped (``\boxed{42.}`` would not parse).
3. **Markdown**: bold around a value is dropped (``Answer: **5**`` and
   ``**Final answer: 7**`` would be read as whatever number came next), and a choice
   letter alone on the last answer line (``FINAL ANSWER: (A)``, ``Answer: B``) is
   that answer (math-verify finds letters only in a box).
4. **Degrees**: in an answer ``°`` is written ``^{\circ}``, the form math-verify
   drops there (``\boxed{90°}`` would not equal ``90``; a label ``90°`` does).
5. **Labels** (:func:`gold_answers`): a list or tuple label (verl-style data) matches
   when any element does; a GSM8K solution counts from its ``####`` on (math-verify
   would take an ``answer is`` in the worked solution). A None label -- or an empty
   list -- is a ValueError: there is nothing to compare with. (The checker reads a
   label as its README writes a gold, ``$label$``, unless it has its own ``\boxed{}``.)
"""

from __future__ import annotations

import re
import threading
from typing import Any

from vime.rollout.math_checker import MathVerifyProcess

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_DEGREE_SIGN = "\u00b0"
# Markdown bold around a value: "**5**", "**Final answer: 7**" (not "2**3").
_BOLD = re.compile(r"\*\*([^*\n]+?)\*\*")
# A period after a box's answer ("\boxed{42.}"), not an ellipsis ("1, 2, ...").
_BOX_PERIOD = re.compile(r"(?<=[\w}])\.\s*$")
# The last line "Answer: (B)" / "The final answer is C." / "**Answer:** (A)": a letter.
_CHOICE_LINE = re.compile(
    r"^[ \t>#*_-]*(?:the[ \t]+)?(?:final[ \t]+)?answer(?:[ \t]+is)?[ \t*_]*:?[ \t*_]*"
    r"\(?([A-Z])\)?[ \t*_.]*$",
    re.IGNORECASE | re.MULTILINE,
)
_checker: MathVerifyProcess | None = None
_checker_lock = threading.Lock()


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


def _degrees(text: str) -> str:
    return text.replace(_DEGREE_SIGN, "^{\\circ}")


def final_answer(response: str) -> str | None:
    """The text math-verify checks (rules 1-5 of the module docstring): the last
    non-empty box alone where there is one, else a choice letter on the last answer
    line, else all of :func:`answer_text` less markdown bold. None when the response
    has given no answer (cut off in a think block, or nothing after it)."""
    body = answer_text(response)
    if body is None or not body.strip():
        return None
    boxed = [box.strip() for box in _boxed_contents(body)]
    boxed = [box for box in boxed if box]
    if boxed:
        return _degrees(f"\\boxed{{{_BOX_PERIOD.sub('', boxed[-1])}}}")
    body = _BOLD.sub(r"\1", body)
    letters = [m.group(1) for m in _CHOICE_LINE.finditer(body)]
    if letters:
        return f"\\boxed{{{letters[-1]}}}"
    return _degrees(body)


def gold_answers(label: Any) -> list[str]:
    """The answers ``label`` accepts (rule 5); ValueError when it has none."""
    labels = list(label) if isinstance(label, list | tuple) else [label]
    golds = []
    for item in labels:
        if item is None:
            continue
        # GSM8K-style labels carry their worked solution before "#### answer".
        golds.append(str(item).rsplit("####", 1)[-1].strip())
    if not golds:
        raise ValueError(f"math_reward needs a label to compare the answer with; got {label!r}")
    return golds


def math_reward(response: str, label: Any) -> float:
    """1.0 when math-verify finds the final answer of ``response`` equal to ``label``.

    ``label`` is the answer itself, or a text whose ``\\boxed{}`` or ``#### answer``
    holds it, or a list/tuple of such (any may match). A response with no answer scores
    0.0. A None label, or a list with no element, is a ValueError: there is nothing to
    compare with (not the text "None"). The check itself runs in math-verify's process
    (``vime.rollout.math_checker``), which raises ``MathVerifyError`` when it gives no
    verdict in time.
    """
    golds = gold_answers(label)
    answer = final_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if _default_checker().equal(answer, golds) else 0.0


def _default_checker() -> MathVerifyProcess:
    global _checker
    with _checker_lock:
        if _checker is None:
            _checker = MathVerifyProcess()
        return _checker
