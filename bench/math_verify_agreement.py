r"""math-verify against vime's ``--rm-type math`` scorer, on answers whose truth is known.

Where it fits: the measurement behind ``--rm-type math`` (bench/README.md). The cases
(``bench/math_cases.py``) cover every answer form the math tests name, right and wrong,
their truth set by how each is built. Each case is scored by two checkers:

- **vime**: ``vime.rollout.math_answer.math_reward``, what ``--rm-type math`` runs.
- **math-verify** alone, as its documentation uses it: ``parse(response)`` with the
  default extraction (LaTeX, then plain expressions), the gold ``parse("$label$")`` (as
  its README writes a gold; a label with a ``\boxed{}`` is parsed as it is), and
  ``verify(gold, answer)``; a list label matches when any element does. Nothing else:
  no think tags, no GSM8K ``####``, no choice between boxes.

Printed: per form, the cases, each checker's accuracy against the truth, how often the
two agree, then every case where they disagree, and the wall time per case of each.
math-verify runs here in the main thread with its own (signal) timeouts, 5 s each.

    PYTHONPATH=. python bench/math_verify_agreement.py               # bench/README.md
    PYTHONPATH=. python bench/math_verify_agreement.py --smoke       # tiny, for the tests
    PYTHONPATH=. python bench/math_verify_agreement.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from math_cases import Case, build_cases

from vime.rollout.math_answer import math_reward

Scorer = Callable[[str, Any], float]


def math_verify_reward(response: str, label: Any) -> float:
    """math-verify's verdict (see the module docstring), 1.0 or 0.0."""
    from math_verify import parse, verify

    answer = parse(response)
    for item in label if isinstance(label, list | tuple) else [label]:
        if item is None:
            continue
        text = str(item)
        gold = parse(text if "\\boxed" in text else f"${text}$")
        if verify(gold, answer):
            return 1.0
    return 0.0


def _score(scorer: Scorer, cases: list[Case]) -> tuple[list[bool], float]:
    verdicts, start = [], time.perf_counter()
    for case in cases:
        verdicts.append(scorer(case.response, case.label) == 1.0)
    return verdicts, time.perf_counter() - start


def _rows(cases: list[Case], vime: list[bool], mv: list[bool]) -> list[dict]:
    rows: dict[str, dict] = {}
    for case, v, m in zip(cases, vime, mv, strict=True):
        row = rows.setdefault(
            case.form, {"form": case.form, "n": 0, "vime": 0, "mv": 0, "agree": 0}
        )
        row["n"] += 1
        row["vime"] += v == case.truth
        row["mv"] += m == case.truth
        row["agree"] += v == m
    return list(rows.values())


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.0f}%" if k < n else "100%"


def _print_table(rows: list[dict]) -> None:
    print("| form | n | vime right | math-verify right | agree |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in [*rows, _total(rows)]:
        n = r["n"]
        print(
            f"| {r['form']} | {n} | {_pct(r['vime'], n)} | {_pct(r['mv'], n)} "
            f"| {_pct(r['agree'], n)} |"
        )


def _total(rows: list[dict]) -> dict:
    total = {"form": "**all**", "n": 0, "vime": 0, "mv": 0, "agree": 0}
    for r in rows:
        for key in ("n", "vime", "mv", "agree"):
            total[key] += r[key]
    return total


def _disagreements(cases: list[Case], vime: list[bool], mv: list[bool]) -> list[dict]:
    seen, out = set(), []
    for case, v, m in zip(cases, vime, mv, strict=True):
        if v == m:
            continue
        # One line per distinct shape: the numbers vary, the behaviour does not.
        masked = re.sub(r"\b[A-E]\b", "X", re.sub(r"\d+", "9", case.response))
        shape = (case.form, masked, v)
        if shape in seen:
            continue
        seen.add(shape)
        out.append(
            {"form": case.form, "response": case.response, "label": repr(case.label)}
            | {"truth": case.truth, "vime": v, "math_verify": m}
        )
    return out


def _versions() -> dict[str, str]:
    names = ("math-verify", "latex2sympy2_extended", "sympy", "antlr4-python3-runtime")
    return {name: metadata.version(name) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-form", type=int, default=10, help="draws of every form")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="one draw of every form")
    parser.add_argument("--json", help="also write the table and disagreements to this file")
    args = parser.parse_args(argv)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    cases = build_cases(1 if args.smoke else args.per_form, args.seed)
    mv, mv_s = _score(math_verify_reward, cases)
    vime, vime_s = _score(math_reward, cases)
    rows = _rows(cases, vime, mv)
    print(f"math answer agreement: {len(cases)} cases, {len(rows)} forms, seed {args.seed}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in _versions().items()))
    _print_table(rows)
    disagree = _disagreements(cases, vime, mv)
    print(f"\ndisagreements ({len(disagree)} distinct shapes):")
    for d in disagree:
        print(
            f"  [{d['form']}] {d['response']!r} label {d['label']}: truth {d['truth']}, "
            f"vime {d['vime']}, math-verify {d['math_verify']}"
        )
    per_case = {"vime_ms": 1000 * vime_s / len(cases), "math_verify_ms": 1000 * mv_s / len(cases)}
    print(
        f"\nwall time per case: vime {per_case['vime_ms']:.2f} ms, "
        f"math-verify {per_case['math_verify_ms']:.2f} ms"
    )
    if args.json:
        figures = {"cases": len(cases), "rows": rows, "disagreements": disagree}
        figures |= {"versions": _versions(), "per_case": per_case}
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
