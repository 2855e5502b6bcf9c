"""--rm-type math: final-answer extraction and equivalence.

Proves that the last ``\\boxed{}`` wins (nested braces kept whole, a truncated
one skipped), that without one the last number is taken (negative, thousands
commas, decimals, fractions; a subtraction's minus is not a sign), that
equivalent answers compare equal (0.5 == 1/2 == \\frac{1}{2}, trailing zeros,
commas, ``$`` and spaces) while different ones do not, and that a response
with no answer scores 0.

It also proves the rules for real model outputs: with ``<think>`` only the text
after the last ``</think>`` counts, and a response cut off inside a think block
(or with nothing after it) has no answer; an ``Answer: ...`` line (also
``**Answer:**``, ``Final answer:``) is preferred to the last number but not to a
``\\boxed{}``; percent, currency, ``\\text{}`` wrappers and units, degrees,
thousands separators, a ``x =`` prefix, ``\\left``/``\\right``, frac/sqrt
shorthand and a parenthesised choice letter are normalized away on both sides,
while wrong numbers and tuples like ``(1,2)`` still score 0; and that a
list/tuple label matches when any element does.
"""

from __future__ import annotations

import pytest

from vime.rollout.math_answer import answers_equal, extract_answer, math_reward


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (r"so \boxed{3} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{ {a}+\{b\} } is 7", r"{a}+\{b\}"),
        (r"answer \boxed{5}, and \boxed{6", "5"),  # the cut-off second box is skipped
        (r"\fbox{42}", "42"),
        ("first 3 then -3", "-3"),
        ("total: 1,234 apples", "1,234"),
        ("12,3456", "3456"),
        ("about 0.5.", "0.5"),
        ("it is 3/4 of it", "3/4"),
        ("5-3", "3"),
        ("x = -7", "-7"),
        ("(2)-1", "1"),
        ("The answer is 42.", "42"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("0.5", "1/2"),
        (r"\frac{1}{2}", "0.5"),
        (r"$\dfrac{3}{4}$", "0.75"),
        ("3.50", "3.5"),
        ("1,234", "1234"),
        (" $42$ ", "42"),
        ("42.", "42"),
        ("-3", "-3.0"),
        ("x + 1", "x+1"),
    ],
)
def test_equal_answers(a: str, b: str) -> None:
    assert answers_equal(a, b)
    assert answers_equal(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [("0.5", "0.6"), ("1/3", "0.333"), ("-3", "3"), ("1,234", "1235"), ("x", "y"), ("1/0", "1")],
)
def test_different_answers(a: str, b: str) -> None:
    assert not answers_equal(a, b)


def test_math_reward_refuses_a_missing_label() -> None:
    with pytest.raises(ValueError, match="needs a label"):
        math_reward(r"\boxed{None}", None)


def test_math_reward() -> None:
    assert math_reward(r"... so the result is \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("I think it is 1,234", 1234) == 1.0  # a numeric label works too
    assert math_reward("we get -3", "-3") == 1.0
    assert math_reward("we get 3", "-3") == 0.0
    assert math_reward("no idea", "3") == 0.0
    assert math_reward("the answer is 72", "She pays 8 * 9 = 72.\n#### 72") == 1.0
    assert math_reward("it is 9", r"so \boxed{9}") == 1.0


# ---------------------------------------------------------------- real model outputs


@pytest.mark.parametrize(
    ("response", "label"),
    [
        (r"\boxed{50\%}", "50"),
        (r"\boxed{50%}", "50"),
        (r"\boxed{\$18.90}", "18.90"),
        (r"\boxed{\$1,000}", "1000"),
        (r"\boxed{10\text{ cm}}", "10"),
        (r"\boxed{10 \mathrm{cm}^2}", "10"),
        (r"\boxed{x = 5}", "5"),
        (r"\boxed{\theta = 30^{\circ}}", "30"),
        (r"\boxed{90^\circ}", "90"),
        ("\\boxed{90\u00b0}", "90"),
        (r"\boxed{1{,}000}", "1000"),
        (r"\boxed{1,000,000}", "1000000"),
        (r"\boxed{\frac12}", "1/2"),
        (r"\boxed{\frac{1}2}", "0.5"),
        (r"\boxed{\dfrac{3}{4}}", r"\frac34"),
        (r"\boxed{\tfrac{1}{2}}", "1/2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces inside \boxed
        (r"\fbox{\frac{1}{2}}", "0.5"),
        (r"\boxed{-\frac{1}{2}}", "-0.5"),
        (r"\boxed{2\sqrt{3}}", r"2\sqrt3"),
        (r"\boxed{\frac{\sqrt3}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{\text{(A)}}", "A"),
        (r"\boxed{(B)}", r"\text{B}"),
        (r"\boxed{\textbf{C}}", "(C)"),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)"),
        (r"\boxed{(1, 2)}", "(1,2)"),
        (r"\boxed{x \rightarrow 1}", r"x\rightarrow 1"),  # \right only as a whole word
        (r"\boxed{\frac{x+1}{2}}", "(x+1)/2"),
        # think blocks: only the text after the last </think> is the answer text
        ("<think>maybe 12</think>The answer is \\boxed{34}", "34"),
        ("<think>maybe 12</think>\nso 34", "34"),
        ("<think>a</think><think>b 12</think> 34", "34"),
        ("the prompt opened <think>; it is 12</think> 34", "34"),
        ("planning 12</think> 34", "34"),  # the template put <think> in the prompt
        # an explicit final-answer line beats the last number, not a \boxed{}
        ("Answer: 34\nCheck: 12 + 22 = 34, 5 steps", "34"),
        ("**Answer:** $18.90$\n(that took 3 steps)", "18.90"),
        ("**Answer**: 7 \n\n1 more thing", "7"),
        ("Final answer: x = 5.\nI used 2 tricks", "5"),
        ("FINAL ANSWER: (A)\nin 3 steps", "A"),
        ("The final answer is: 10\\text{ cm}\nin 2 steps", "10"),
        ("Answer: 12\nso \\boxed{34}", "34"),
        ("Answer:\nit is 34", "34"),  # an empty answer line falls back to the last number
        # the last-number fallback still works
        ("so it costs $18.90 in total", "18.90"),
        ("I think it is 1,234", "1234"),
        # list / tuple labels: any element
        (r"\boxed{72}", ["72"]),
        (r"\boxed{72}", ("71", "72")),
        (r"\boxed{0.5}", [r"\frac{1}{2}"]),
        (r"\boxed{72}", [72]),
        (r"\boxed{72}", [None, "72"]),
        # the label is normalized too
        ("\\boxed{50}", r"50\%"),
        ("\\boxed{10}", r"10\text{ cm}"),
        ("\\boxed{5}", "x=5"),
        ("\\boxed{1000}", "1{,}000"),
        ("\\boxed{A}", r"\text{(A)}"),
        ("Answer: 5 apples", "5"),
        ("Answer: $18 dollars an hour.", "18"),
    ],
)
def test_real_model_answers_score_1(response: str, label: object) -> None:
    assert math_reward(response, label) == 1.0


@pytest.mark.parametrize(
    ("response", "label"),
    [
        (r"\boxed{51\%}", "50"),
        (r"\boxed{\$18.91}", "18.90"),
        (r"\boxed{11\text{ cm}}", "10"),
        (r"\boxed{x = 6}", "5"),
        (r"\boxed{1{,}001}", "1000"),
        (r"\boxed{\frac13}", "1/2"),
        (r"\boxed{3\sqrt{2}}", r"2\sqrt3"),
        (r"\boxed{\text{(B)}}", "A"),
        # a tuple is not a thousands number
        (r"\boxed{1,2}", "12"),
        (r"\boxed{(1,2)}", "12"),
        (r"\boxed{(1, 2)}", "(12)"),
        (r"\boxed{(1,2)}", "(1,3)"),
        (r"\boxed{12,3456}", "123456"),
        # \frac{x+1}{2} is not x+1/2, 2\frac{1}{2} is not 21/2, \rightarrow is not \right
        (r"\boxed{2\frac{1}{2}}", "21/2"),
        (r"\boxed{x \rightarrow 1}", "x arrow 1"),
        (r"\boxed{\frac{x+1}{2}}", "x+1/2"),
        # a think block never closed: the reasoning never finished, no answer
        (r"<think> the answer is \boxed{34}... wait let me recheck 12", "34"),
        ("<think> the answer is 34", "34"),
        # a think block with nothing after it: no answer
        ("<think>so answer 34 maybe</think>", "34"),
        ("<think>so answer 34 maybe</think>\n\n  ", "34"),
        # a second think block opened after the last close and never closed
        ("<think>a</think> 34 <think> recheck 34", "34"),
        # the answer line wins over a later (correct-looking) number
        ("Answer: 12\nbut 34 was the other one", "34"),
        ("Answer: First we compute 3+4 = 7", "7"),  # a sentence is not a number with units
        # list labels: no element matches, or none at all
        (r"\boxed{72}", ["71", "73"]),
        (r"\boxed{72}", "['72', '73']"),
    ],
)
def test_wrong_or_unfinished_answers_score_0(response: str, label: object) -> None:
    assert math_reward(response, label) == 0.0


@pytest.mark.parametrize("label", [[], (), [None]])
def test_math_reward_refuses_an_empty_list_label(label: object) -> None:
    with pytest.raises(ValueError, match="needs a label"):
        math_reward(r"\boxed{None}", label)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<think>12</think> so 34", "34"),
        ("<think>12", None),
        ("<think>12</think>", None),
        ("Answer: **x = 5**.\nin 3 steps", "x = 5"),
        ("**Final Answer:** 7\n8", "7"),
        ("  > answer: 9\n10", "9"),
        ("Answered: 3\n4", "4"),  # not an answer line: falls back to the last number
        ("Answer the question: 3\n4", "4"),
    ],
)
def test_extract_answer_think_and_answer_lines(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer
