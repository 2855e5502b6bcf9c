r"""The answer pairs of ``bench/math_verify_agreement.py``: (response, label, truth) by form.

Where it fits: every answer form that ``tests/cpu/test_math_answer.py`` and
``tests/cpu/test_rewards.py`` name, built from seeded random numbers, each case a right
answer or a wrong one. ``truth`` is set by how the case is built (the label is the value
the response gives, or a different one), never by a checker. A few forms are vime's
documented rules rather than mathematics (the think-tag forms, an ``Answer:`` line
winning over a later number): their names say so with a ``rule:`` prefix. The forms
named ``more:`` go past what the tests name, to answers equal as mathematics but not
as text (sets, intervals, equations, powers, radicals).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class Case:
    form: str
    response: str
    label: Any
    truth: bool


Pairs = list[tuple[str, Any, bool]]
_FORMS: dict[str, Callable[[random.Random], Pairs]] = {}


def _form(name: str) -> Callable:
    def register(fn: Callable[[random.Random], Pairs]) -> Callable:
        _FORMS[name] = fn
        return fn

    return register


def _n(rng: random.Random, lo: int = 2, hi: int = 999) -> int:
    return rng.randint(lo, hi)


def _other(rng: random.Random, n: int) -> int:
    return n + rng.choice([-3, -2, -1, 1, 2, 3, 10])


@_form("boxed integer")
def _boxed(rng: random.Random) -> Pairs:
    n = _n(rng)
    text = rf"So the total is \boxed{{{n}}}."
    return [(text, str(n), True), (text, str(_other(rng, n)), False)]


@_form("last boxed wins")
def _last_boxed(rng: random.Random) -> Pairs:
    a, b = _n(rng), _n(rng, 1000, 1999)
    text = rf"first \boxed{{{a}}} then, checking again, \boxed{{{b}}}"
    return [(text, str(b), True), (text, str(a), False)]


@_form("boxed cut off")
def _cut_box(rng: random.Random) -> Pairs:
    a, b = _n(rng), _n(rng, 1000, 1999)
    text = rf"answer \boxed{{{a}}}, and \boxed{{{b}"
    return [(text, str(a), True), (text, str(b), False)]


@_form("fbox / nested braces")
def _fbox(rng: random.Random) -> Pairs:
    p, q = _n(rng, 1, 9), _n(rng, 11, 19)
    text = rf"\fbox{{\frac{{{p}}}{{{q}}}}}"
    return [(text, f"{p}/{q}", True), (text, f"{p}/{q + 1}", False)]


@_form("last number")
def _last_number(rng: random.Random) -> Pairs:
    a, b = _n(rng), _n(rng, 1000, 1999)
    text = f"first {a} then we get {b}"
    return [(text, str(b), True), (text, str(a), False)]


@_form("negative number")
def _negative(rng: random.Random) -> Pairs:
    n = _n(rng)
    text = f"so we get -{n}"
    return [(text, f"-{n}", True), (text, str(n), False)]


@_form("thousands comma")
def _thousands(rng: random.Random) -> Pairs:
    n = _n(rng, 1000, 999999)
    text = f"I think it is {n:,} apples"
    return [(text, str(n), True), (text, n, True), (text, str(n + 1), False)]


@_form("decimal")
def _decimal(rng: random.Random) -> Pairs:
    n = rng.randint(1, 99) / 4
    text = f"about {n}."
    return [(text, str(Fraction(n)), True), (text, f"{n + 0.25}", False)]


@_form("slash fraction")
def _slash(rng: random.Random) -> Pairs:
    p, q = _n(rng, 1, 9), rng.choice([2, 4, 5, 8])
    text = f"it is {p}/{q} of it"
    return [(text, str(p / q), True), (text, str(p / q + 0.1), False)]


@_form("subtraction is not a sign")
def _subtraction(rng: random.Random) -> Pairs:
    a, b = _n(rng, 10, 99), _n(rng, 1, 9)
    return [(f"{a}-{b}", f"-{b}", False), (f"({a})-{b}", f"-{b}", False)]


@_form("equal values")
def _equal_values(rng: random.Random) -> Pairs:
    n = _n(rng, 1, 99)
    q = Fraction(n, 4)
    pairs = [
        (rf"\boxed{{{float(q)}}}", f"{q.numerator}/{q.denominator}", True),
        (rf"\boxed{{\frac{{{q.numerator}}}{{{q.denominator}}}}}", str(float(q)), True),
        (rf"\boxed{{\dfrac{{{q.numerator}}}{{{q.denominator}}}}}", str(float(q)), True),
        (rf"\boxed{{{n}.50}}", f"{n}.5", True),
        (f"so $ {n} $ ", str(n), True),
        (rf"\boxed{{-{n}}}", f"-{n}.0", True),
        (rf"\boxed{{{float(q)}}}", str(float(q) + 0.25), False),
    ]
    return [rng.choice(pairs[:-1]), pairs[-1]]


@_form("near value (1/3 vs 0.333)")
def _near(rng: random.Random) -> Pairs:
    q = rng.choice([3, 7, 9, 11])
    approx = f"{1 / q:.3f}"
    return [(rf"\boxed{{1/{q}}}", approx, False), (rf"\boxed{{{approx}}}", f"1/{q}", False)]


@_form("percent")
def _percent(rng: random.Random) -> Pairs:
    n = _n(rng, 1, 99)
    sign = rng.choice([r"\%", "%"])
    text = rf"\boxed{{{n}{sign}}}"
    return [(text, str(n), True), (text, str(n + 1), False)]


@_form("currency")
def _currency(rng: random.Random) -> Pairs:
    cents = rng.randint(100, 99999)
    money = f"{cents // 100}.{cents % 100:02d}"
    big = _n(rng, 1000, 99999)
    return [
        (rf"\boxed{{\${money}}}", money, True),
        (rf"\boxed{{\${big:,}}}", str(big), True),
        (rf"so it costs ${money} in total", money, True),
        (rf"\boxed{{\${money}}}", f"{cents // 100}.{(cents + 1) % 100:02d}", False),
    ]


@_form("units in text")
def _units(rng: random.Random) -> Pairs:
    n = _n(rng, 1, 500)
    unit = rng.choice([r"\text{ cm}", r"\mathrm{cm}^2", r"\text{ meters}", r"\,\text{kg}"])
    text = rf"\boxed{{{n}{unit}}}"
    return [(text, str(n), True), (text, str(n + 1), False)]


@_form("degrees")
def _degrees(rng: random.Random) -> Pairs:
    n = _n(rng, 1, 359)
    deg = rng.choice([r"^\circ", r"^{\circ}", "\u00b0"])
    text = rf"\boxed{{{n}{deg}}}"
    return [(text, str(n), True), (text, str(n + 1), False)]


@_form("assignment x = n")
def _assignment(rng: random.Random) -> Pairs:
    n = _n(rng, 1, 99)
    var = rng.choice(["x", "y", r"\theta"])
    text = rf"\boxed{{{var} = {n}}}"
    return [(text, str(n), True), (text, str(n + 1), False), (r"\boxed{5}", "x=5", True)]


@_form("latex thousands")
def _latex_thousands(rng: random.Random) -> Pairs:
    k = _n(rng, 1, 999)
    return [
        (rf"\boxed{{{k}{{,}}000}}", str(k * 1000), True),
        (rf"\boxed{{{k},000,000}}", str(k * 1_000_000), True),
        (rf"\boxed{{{k}{{,}}001}}", str(k * 1000), False),
    ]


@_form("frac shorthand")
def _frac_shorthand(rng: random.Random) -> Pairs:
    p, q = _n(rng, 1, 9), _n(rng, 2, 9)
    value = f"{p}/{q}"
    return [
        (rf"\boxed{{\frac{p}{q}}}", value, True),
        (rf"\boxed{{\frac{{{p}}}{q}}}", value, True),
        (rf"\boxed{{\tfrac{{{p}}}{{{q}}}}}", rf"\frac{p}{q}", True),
        (rf"\boxed{{-\frac{{{p}}}{{{q}}}}}", f"-{value}", True),
        (rf"\boxed{{\frac{{{p}}}{{{q + 1}}}}}", value, False),
    ]


@_form("sqrt")
def _sqrt(rng: random.Random) -> Pairs:
    a, b = rng.choice([(2, 3), (3, 2), (2, 5), (5, 2), (3, 7)])
    return [
        (rf"\boxed{{{a}\sqrt{{{b}}}}}", rf"{a}\sqrt{b}", True),
        (rf"\boxed{{\frac{{\sqrt{b}}}{{{a}}}}}", rf"\frac{{\sqrt{{{b}}}}}{{{a}}}", True),
        (rf"\boxed{{{b}\sqrt{{{a}}}}}", rf"{a}\sqrt{b}", False),
    ]


@_form("choice letter")
def _choice(rng: random.Random) -> Pairs:
    right, wrong = rng.sample("ABCDE", 2)
    shape = rng.choice([r"\text{(X)}", "(X)", r"\textbf{X}", r"\text{X}"])
    label = rng.choice(["X", "(X)", r"\text{X}", r"\text{(X)}"])
    text = rf"\boxed{{{shape.replace('X', right)}}}"
    return [(text, label.replace("X", right), True), (text, label.replace("X", wrong), False)]


@_form("tuple")
def _tuple(rng: random.Random) -> Pairs:
    a, b = _n(rng, 1, 9), _n(rng, 1, 9)
    return [
        (rf"\boxed{{\left( {a}, {b} \right)}}", f"({a},{b})", True),
        (rf"\boxed{{({a}, {b})}}", f"({a},{b})", True),
        (rf"\boxed{{({a},{b})}}", f"({a},{b + 1})", False),
        (rf"\boxed{{{a},{b}}}", f"{a}{b}", False),  # a tuple is not a thousands number
        (rf"\boxed{{({a},{b})}}", f"{a}{b}", False),
        (rf"\boxed{{{a}{b},3456}}", f"{a}{b}3456", False),
    ]


@_form("symbolic")
def _symbolic(rng: random.Random) -> Pairs:
    n = _n(rng, 1, 9)
    return [
        (rf"\boxed{{\frac{{x+{n}}}{{2}}}}", f"(x+{n})/2", True),
        (rf"\boxed{{\frac{{x+{n}}}{{2}}}}", f"x+{n}/2", False),
        (rf"\boxed{{x + {n}}}", f"x+{n}", True),
        (rf"\boxed{{x + {n}}}", f"y+{n}", False),
        (rf"\boxed{{2\frac{{1}}{{{n + 1}}}}}", f"21/{n + 1}", False),
        (rf"\boxed{{x \rightarrow {n}}}", rf"x\rightarrow {n}", True),
        (rf"\boxed{{x \rightarrow {n}}}", f"x arrow {n}", False),
    ]


@_form("rule: think closed")
def _think(rng: random.Random) -> Pairs:
    a, b = _n(rng), _n(rng, 1000, 1999)
    shape = rng.choice(
        [
            f"<think>maybe {a}</think>The answer is \\boxed{{{b}}}",
            f"<think>maybe {a}</think>\nso {b}",
            f"<think>x</think><think>y {a}</think> {b}",
            f"planning {a}</think> {b}",  # the template put <think> in the prompt
            f"<think>so the answer is \\boxed{{{a}}}?</think> No: {b}",
        ]
    )
    return [(shape, str(b), True), (shape, str(a), False)]


@_form("rule: think unfinished")
def _think_cut(rng: random.Random) -> Pairs:
    a, b = _n(rng), _n(rng)
    return [
        (rf"<think> the answer is \boxed{{{a}}}... wait let me recheck {b}", str(a), False),
        (f"<think> the answer is {a}", str(a), False),
        (f"<think>so answer {a} maybe</think>\n\n  ", str(a), False),
        (f"<think>x</think> {a} <think> recheck {a}", str(a), False),
    ]


@_form("answer line")
def _answer_line(rng: random.Random) -> Pairs:
    n, steps = _n(rng), _n(rng, 2, 9)
    head = rng.choice(
        [
            *("Answer:", "**Answer:**", "**Answer**:", "Final answer:", "FINAL ANSWER:"),
            *("The final answer is:", "  > answer:"),
        ]
    )
    text = f"{head} {n}\nCheck: that took {steps} steps"
    return [(text, str(n), True), (text, str(steps), False)]


@_form("answer line vs boxed")
def _answer_vs_boxed(rng: random.Random) -> Pairs:
    a, b = _n(rng), _n(rng, 1000, 1999)
    text = f"Answer: {a}\nso \\boxed{{{b}}}"
    return [(text, str(b), True), (text, str(a), False)]


@_form("answer line with units")
def _answer_units(rng: random.Random) -> Pairs:
    n = _n(rng, 1, 99)
    return [
        (f"Answer: {n} apples", str(n), True),
        (f"Answer: ${n} dollars an hour.", str(n), True),
        (f"Final answer: x = {n}.\nI used 2 tricks", str(n), True),
        ("The final answer is: 10\\text{ cm}\nin 2 steps", "10", True),
        (f"Answer:\nit is {n}", str(n), True),
        (f"Answer: {n} apples", str(n + 1), False),
    ]


@_form("answer in markdown bold")
def _bold(rng: random.Random) -> Pairs:
    n, steps = _n(rng), _n(rng, 2, 9)
    shape = rng.choice(
        [
            "Answer: **{n}**\nin {s} steps",
            "**Answer:** **{n}**\nin {s} steps",
            "**Final answer: {n}**\nin {s} steps",
            "Answer: **x = {n}**.\nin {s} steps",
        ]
    )
    text = shape.format(n=n, s=steps)
    return [(text, str(n), True), (text, str(steps), False)]


@_form("choice letter on answer line")
def _choice_line(rng: random.Random) -> Pairs:
    right, wrong = rng.sample("ABCDE", 2)
    head = rng.choice(["FINAL ANSWER:", "Answer:", "**Answer:**", "The final answer is"])
    shape = rng.choice(["({x})", "{x}", "**({x})**", "({x})."])
    text = f"{head} {shape.format(x=right)}\nin 3 steps"
    return [(text, right, True), (text, wrong, False)]


@_form("boxed with a period")
def _boxed_period(rng: random.Random) -> Pairs:
    n = _n(rng)
    text = rf"so \boxed{{{n}.}}"
    return [(text, str(n), True), (text, str(n + 1), False)]


@_form("rule: answer line then number")
def _answer_then_number(rng: random.Random) -> Pairs:
    a, b = _n(rng), _n(rng, 1000, 1999)
    return [(f"Answer: {a}\nbut {b} was the other one", str(b), False)]


@_form("answer line holding a sentence")
def _answer_sentence(rng: random.Random) -> Pairs:
    a, b = _n(rng, 1, 9), _n(rng, 1, 9)
    text = f"Answer: First we compute {a}+{b} = {a + b}"
    return [(text, str(a + b), True), (text, str(a + b + 1), False)]


@_form("GSM8K #### label")
def _gsm8k(rng: random.Random) -> Pairs:
    a, b = _n(rng, 2, 30), _n(rng, 2, 30)
    label = f"She pays {a} * {b} = <<{a}*{b}={a * b}>>{a * b}.\n#### {a * b}"
    wrong = f"She pays {a} * {b} = {a * b + 1}.\n#### {a * b + 1}"
    # A worked solution that says "the answer is" before its last step.
    worded = f"The answer is {a} + {b} = {a + b} a day, for 2 days {2 * (a + b)}."
    text = f"the answer is {a * b}"
    return [
        (text, label, True),
        (text, wrong, False),
        (f"so {2 * (a + b)}", f"{worded}\n#### {2 * (a + b)}", True),
    ]


@_form("boxed label")
def _boxed_label(rng: random.Random) -> Pairs:
    n = _n(rng)
    return [
        (f"it is {n}", rf"so \boxed{{{n}}}", True),
        (f"it is {n}", rf"\boxed{{{n + 1}}}", False),
    ]


@_form("list label")
def _list_label(rng: random.Random) -> Pairs:
    n = _n(rng)
    text = rf"\boxed{{{n}}}"
    return [
        (text, [str(n)], True),
        (text, (str(n - 1), str(n)), True),
        (text, [n], True),
        (text, [None, str(n)], True),
        (r"\boxed{0.5}", [r"\frac{1}{2}"], True),
        (text, [str(n - 1), str(n + 1)], False),
        (text, str([str(n), str(n + 1)]), False),  # the text of a list is no list
    ]


@_form("label normalized")
def _label_normalized(rng: random.Random) -> Pairs:
    n = _n(rng, 1, 99)
    return [
        (rf"\boxed{{{n}}}", rf"{n}\%", True),
        (rf"\boxed{{{n}}}", rf"{n}\text{{ cm}}", True),
        (rf"\boxed{{{n}}}", f"x={n}", True),
        (rf"\boxed{{{n}000}}", rf"{n}{{,}}000", True),
        (r"\boxed{A}", r"\text{(A)}", True),
        (rf"\boxed{{{n + 1}}}", rf"{n}\%", False),
    ]


@_form("no answer")
def _no_answer(rng: random.Random) -> Pairs:
    n = _n(rng)
    return [("no idea", str(n), False), ("", str(n), False)]


@_form("more: equivalent expressions")
def _expressions(rng: random.Random) -> Pairs:
    a, b = rng.choice([(2, 3), (3, 2), (2, 5), (5, 3), (3, 7)])
    n, k = _n(rng, 1, 9), _n(rng, 2, 9)
    return [
        (rf"\boxed{{\frac{{\sqrt{{{b}}}}}{{{a}}}}}", rf"\frac{{1}}{{{a}}}\sqrt{{{b}}}", True),
        (rf"\boxed{{\sqrt{{{a * a * b}}}}}", rf"{a}\sqrt{{{b}}}", True),
        (rf"\boxed{{\sqrt{{{a * a * b}}}}}", rf"{b}\sqrt{{{a}}}", False),
        (rf"\boxed{{(x+{n})^2}}", f"x^2+{2 * n}x+{n * n}", True),
        (rf"\boxed{{(x+{n})^2}}", f"x^2+{n}x+{n * n}", False),
        (rf"\boxed{{\frac{{{k}\pi}}{{2}}}}", rf"{k}\pi/2", True),
        (rf"\boxed{{2^{{{k}}}}}", str(2**k), True),
        (rf"\boxed{{2^{{{k}}}}}", str(2**k + 1), False),
        (rf"\boxed{{{n}.5 \times 10^{{{k}}}}}", str(int((n + 0.5) * 10**k)), True),
        (rf"\boxed{{\sqrt{{{b}}}/{a}}}", rf"\frac{{\sqrt{b}}}{{{a}}}", True),
        (rf"\boxed{{e^{{{k}}}}}", f"e^{k}", True),
        (rf"\boxed{{\log_2 {2**k}}}", str(k), True),
        (rf"\boxed{{{n}+{k}i}}", f"{k}i+{n}", True),
        (rf"\boxed{{{n}+{k}i}}", f"{k}+{n}i", n == k),
    ]


@_form("more: sets, intervals, equations")
def _sets(rng: random.Random) -> Pairs:
    a, b, c = rng.sample(range(1, 20), 3)
    lo, hi = sorted((a, b))
    return [
        (rf"\boxed{{\{{{a}, {b}, {c}\}}}}", rf"\{{{c},{b},{a}\}}", True),
        (rf"\boxed{{\{{{a}, {b}\}}}}", rf"\{{{a},{b},{c}\}}", False),
        (rf"\boxed{{[{lo}, {hi})}}", f"[{lo},{hi})", True),
        (rf"\boxed{{({lo}, {hi})}}", f"[{lo},{hi}]", False),
        (rf"\boxed{{x \in [{lo}, {hi})}}", f"[{lo},{hi})", True),
        (rf"\boxed{{{a}, {b}}}", f"{b}, {a}", True),
        (rf"\boxed{{x = {a} \text{{ or }} x = {b}}}", f"{a}, {b}", True),
        (rf"\boxed{{y = {a}x + {b}}}", f"y={b}+{a}x", True),
        (rf"\boxed{{y = {a}x + {b}}}", f"y={a}x+{b + 1}", False),
        (
            rf"\boxed{{\begin{{pmatrix}} {a} \\ {b} \end{{pmatrix}}}}",
            rf"\begin{{pmatrix}}{a}\\{b}\end{{pmatrix}}",
            True,
        ),
    ]


def build_cases(per_form: int, seed: int = 0) -> list[Case]:
    """``per_form`` draws of every form, from one seeded generator."""
    rng = random.Random(seed)
    cases = []
    for form, make in _FORMS.items():
        for _ in range(per_form):
            cases += [Case(form, r, label, truth) for r, label, truth in make(rng)]
    return cases
