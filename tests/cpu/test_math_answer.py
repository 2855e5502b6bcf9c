"""--rm-type math: math-verify's verdict, and the few rules vime keeps around it.

Proves that real model answers score as they should through ``math_reward`` (the last
``\\boxed{}`` wins, a truncated one skipped; without one an ``Answer:`` line or the
last number; equal values in any form -- 0.5, 1/2, \\frac{1}{2}, percent, currency,
units, degrees, thousands separators, ``x =``, choice letters, and mathematics
math-verify adds: radicals, powers, sets, intervals, equations -- while wrong numbers
and a tuple against a thousands number score 0), that a list/tuple label matches when
any element does, and that a None or empty label is refused.

Each rule vime keeps on top of math-verify (think tags, the last box, a period in the
box, markdown bold, a choice letter on an answer line, ``°``, GSM8K ``####``) has a
case here on which math-verify alone is wrong and ``math_reward`` right: the test
fails both if the rule is removed and if math-verify learns the case (then the rule
can go). And that math-verify runs from any thread, bounds a runaway answer with its
own timeout (0.0), and that a checker past its hard deadline is killed, the sample
failing with ``MathVerifyError``, and the next check starts a new one.
"""

from __future__ import annotations

import threading

import pytest

from vime.rollout.math_answer import final_answer, math_reward
from vime.rollout.math_checker import MathVerifyError, MathVerifyProcess, check


@pytest.mark.parametrize(
    ("response", "label"),
    [
        (r"so \boxed{3} then \boxed{\frac{1}{2}}", "0.5"),
        (r"answer \boxed{5}, and \boxed{6", "5"),  # the cut-off second box is skipped
        (r"\fbox{42}", "42"),
        ("first 3 then -3", "-3"),
        ("total: 1,234 apples", "1234"),
        ("about 0.5.", "1/2"),
        ("it is 3/4 of it", "0.75"),
        ("The answer is 42.", "42"),
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{$\dfrac{3}{4}$}", "0.75"),
        (r"\boxed{3.50}", "3.5"),
        (r"\boxed{ $42$ }", "42"),
        (r"\boxed{-3}", "-3.0"),
        (r"\boxed{x + 1}", "x+1"),
        (r"\boxed{50\%}", "50"),
        (r"\boxed{50%}", "50"),
        (r"\boxed{\$18.90}", "18.90"),
        (r"\boxed{\$1,000}", "1000"),
        (r"\boxed{10\text{ cm}}", "10"),
        (r"\boxed{10 \mathrm{cm}^2}", "10"),
        (r"\boxed{x = 5}", "5"),
        (r"\boxed{\theta = 30^{\circ}}", "30"),
        (r"\boxed{90^\circ}", "90"),
        (r"\boxed{1{,}000}", "1000"),
        (r"\boxed{1,000,000}", "1000000"),
        (r"\boxed{\frac12}", "1/2"),
        (r"\boxed{\frac{1}2}", "0.5"),
        (r"\boxed{\dfrac{3}{4}}", r"\frac34"),
        (r"\boxed{\tfrac{1}{2}}", "1/2"),
        (r"\boxed{-\frac{1}{2}}", "-0.5"),
        (r"\boxed{2\sqrt{3}}", r"2\sqrt3"),
        (r"\boxed{\frac{\sqrt3}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{\text{(A)}}", "A"),
        (r"\boxed{(B)}", r"\text{B}"),
        (r"\boxed{\textbf{C}}", "(C)"),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)"),
        (r"\boxed{(1, 2)}", "(1,2)"),
        (r"\boxed{\frac{x+1}{2}}", "(x+1)/2"),
        # what math-verify adds: equal as mathematics, not as text
        (r"\boxed{\sqrt{12}}", r"2\sqrt{3}"),
        (r"\boxed{(x+1)^2}", "x^2+2x+1"),
        (r"\boxed{2^{10}}", "1024"),
        (r"\boxed{\{1, 2, 3\}}", r"\{3,2,1\}"),
        (r"\boxed{x \in [1, 5)}", "[1,5)"),
        (r"\boxed{y = 2x + 1}", "y=1+2x"),
        # an answer line, also in markdown, beats the last number but not a box
        ("Answer: 34\nCheck: 12 + 22 = 34, 5 steps", "34"),
        ("**Answer:** $18.90$\n(that took 3 steps)", "18.90"),
        ("**Answer**: 7 \n\n1 more thing", "7"),
        ("Final answer: x = 5.\nI used 2 tricks", "5"),
        ("The final answer is: 10\\text{ cm}\nin 2 steps", "10"),
        ("Answer: 12\nso \\boxed{34}", "34"),
        ("Answer:\nit is 34", "34"),
        ("Answer: 5 apples", "5"),
        ("Answer: $18 dollars an hour.", "18"),
        # hand-written before math-verify scored this 0 (the line was not a lone number)
        ("Answer: First we compute 3+4 = 7", "7"),
        ("so it costs $18.90 in total", "18.90"),
        # think blocks closed: the answer after the last </think>
        ("<think>maybe 12</think>\nso 34", "34"),
        ("<think>a</think><think>b 12</think> 34", "34"),
        ("planning 12</think> 34", "34"),  # the template put <think> in the prompt
        # labels: GSM8K, boxed, numeric, lists, normalized
        ("the answer is 72", "She pays 8 * 9 = <<8*9=72>>72.\n#### 72"),
        ("it is 9", r"so \boxed{9}"),
        ("I think it is 1,234", 1234),
        (r"\boxed{72}", ["72"]),
        (r"\boxed{72}", ("71", "72")),
        (r"\boxed{0.5}", [r"\frac{1}{2}"]),
        (r"\boxed{72}", [72]),
        (r"\boxed{72}", [None, "72"]),
        (r"\boxed{50}", r"50\%"),
        (r"\boxed{10}", r"10\text{ cm}"),
        (r"\boxed{5}", "x=5"),
        (r"\boxed{1000}", "1{,}000"),
        (r"\boxed{90}", "90\u00b0"),
        (r"\boxed{A}", r"\text{(A)}"),
    ],
)
def test_right_answers_score_1(response: str, label: object) -> None:
    assert math_reward(response, label) == 1.0


@pytest.mark.parametrize(
    ("response", "label"),
    [
        ("we get 3", "-3"),
        ("no idea", "3"),
        ("", "3"),
        ("5-3", "-3"),  # a subtraction, not the number -3
        (r"\boxed{0.6}", "0.5"),
        (r"\boxed{1/3}", "0.333"),
        (r"\boxed{1,234}", "1235"),
        (r"\boxed{x}", "y"),
        (r"\boxed{51\%}", "50"),
        (r"\boxed{\$18.91}", "18.90"),
        (r"\boxed{11\text{ cm}}", "10"),
        (r"\boxed{x = 6}", "5"),
        (r"\boxed{1{,}001}", "1000"),
        (r"\boxed{\frac13}", "1/2"),
        (r"\boxed{3\sqrt{2}}", r"2\sqrt3"),
        (r"\boxed{\sqrt{12}}", r"3\sqrt{2}"),
        (r"\boxed{\text{(B)}}", "A"),
        # a tuple is not a thousands number
        (r"\boxed{1,2}", "12"),
        (r"\boxed{(1,2)}", "12"),
        (r"\boxed{(1,2)}", "(1,3)"),
        (r"\boxed{12,3456}", "123456"),
        (r"\boxed{2\frac{1}{2}}", "21/2"),
        (r"\boxed{\frac{x+1}{2}}", "x+1/2"),
        # the answer line wins over a later number
        ("Answer: 12\nbut 34 was the other one", "34"),
        # list labels: no element matches; the text of a list is no list
        (r"\boxed{72}", ["71", "73"]),
        (r"\boxed{72}", "['72', '73']"),
    ],
)
def test_wrong_answers_score_0(response: str, label: object) -> None:
    assert math_reward(response, label) == 0.0


# ---------------------------------------------------------------- vime's rules


@pytest.mark.parametrize(
    ("response", "label", "right"),
    [
        # 1. think tags: only after the last </think>; none while a block is open
        (r"<think>so the answer is \boxed{12}?</think> No: 34", "34", True),
        (r"<think> the answer is \boxed{34}... wait let me recheck 12", "34", False),
        ("<think> the answer is 34", "34", False),
        ("<think>so answer 34 maybe</think>\n\n  ", "34", False),
        ("<think>a</think> 34 <think> recheck 34", "34", False),
        # 2. the last box alone, and without the period that closes it
        (r"first \boxed{518} then, checking again, \boxed{1142}", "1142", True),
        (r"so \boxed{42.}", "42", True),
        # 3. markdown bold, and a choice letter on the answer line
        ("Answer: **828**\nin 9 steps", "828", True),
        ("Answer: **828**\nin 9 steps", "9", False),
        ("**Final answer: 779**\nin 9 steps", "779", True),
        ("FINAL ANSWER: (A)\nin 3 steps", "A", True),
        ("The final answer is (C).\nin 3 steps", "C", True),
        # 4. degrees written with the sign
        ("\\boxed{90\u00b0}", "90", True),
        # 5. a GSM8K label: its answer is after ####
        ("so 80", "The answer is 10 + 30 = 40 a day, for 2 days 80.\n#### 80", True),
    ],
)
def test_each_kept_rule_fixes_math_verify(response: str, label: str, right: bool) -> None:
    """math-verify alone (``check``: parse and verify, nothing of vime's) is wrong here."""
    assert check(response, [label]) is not right
    assert math_reward(response, label) == float(right)


@pytest.mark.parametrize(
    ("response", "text"),
    [
        ("<think>12</think> so 34", " so 34"),
        ("<think>12", None),
        ("<think>12</think>", None),
        (r"\boxed{3} and \fbox{ 4. }", r"\boxed{4}"),
        (r"\boxed{} so 5", r"\boxed{} so 5"),  # an empty box is no answer
        ("Answer: **x = 5**.\nin 3 steps", "Answer: x = 5.\nin 3 steps"),
        ("**Answer:** (B)\nin 3 steps", r"\boxed{B}"),
        ("2**3 = 8", "2**3 = 8"),  # a lone ** is no markdown
        (r"\boxed{1, 2, ...}", r"\boxed{1, 2, ...}"),  # an ellipsis stays
    ],
)
def test_final_answer(response: str, text: str | None) -> None:
    assert final_answer(response) == text


@pytest.mark.parametrize("label", [None, [], (), [None]])
def test_math_reward_refuses_a_missing_label(label: object) -> None:
    with pytest.raises(ValueError, match="needs a label"):
        math_reward(r"\boxed{None}", label)


# ---------------------------------------------------------------- the checker's process


def test_math_reward_from_another_thread() -> None:
    """math-verify's signal timeouts fail outside a main thread; its process has one."""
    results: list[float] = []
    worker = threading.Thread(target=lambda: results.append(math_reward(r"\boxed{0.5}", "1/2")))
    worker.start()
    worker.join(timeout=120)
    assert results == [1.0]


def test_a_runaway_answer_times_out_then_the_deadline_kills() -> None:
    tower = r"\boxed{9^{9^{9^{9}}}}"
    checker = MathVerifyProcess(timeout_s=1)
    try:
        assert checker.equal(tower, ["1"]) is False  # math-verify's own timeout: not equal
    finally:
        checker.close()
    checker = MathVerifyProcess(timeout_s=60, deadline_s=1.0)
    try:
        with pytest.raises(MathVerifyError, match="no answer within 1 s"):
            checker.equal(tower, ["1"])
        assert checker.equal(r"\boxed{2}", ["2"]) is True  # a new process
    finally:
        checker.close()
