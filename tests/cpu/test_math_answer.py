"""--rm-type math: final-answer extraction and equivalence.

Proves that the last ``\\boxed{}`` wins (nested braces kept whole, a truncated
one skipped), that without one the last number is taken (negative, thousands
commas, decimals, fractions; a subtraction's minus is not a sign), that
equivalent answers compare equal (0.5 == 1/2 == \\frac{1}{2}, trailing zeros,
commas, ``$`` and spaces) while different ones do not, and that a response
with no answer scores 0.
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
