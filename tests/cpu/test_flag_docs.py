"""``docs/flags.md`` is the parser's own account of every flag.

Proves that the committed reference is exactly what ``vime.config.flag_docs``
generates from the parser (so a flag added, removed or reworded without
regenerating it fails here, with the command that regenerates it), that the
generator, like parsing, imports no torch, engine, backend library or Ray, that
every flag any backend's parser accepts has help text and a row in the
reference, and that the README links it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from vime.backends import registry
from vime.config import build_parser
from vime.config.flag_docs import COMMAND

ROOT = Path(__file__).resolve().parents[2]
FLAGS_DOC = ROOT / "docs" / "flags.md"

GENERATE = (
    "import sys\n"
    "from vime.config.flag_docs import render\n"
    "text = render()\n"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
    "('torch', 'transformers', 'megatron', 'vllm', 'ray', 'peft'))\n"
    "assert not heavy, heavy\n"
    "sys.stdout.write(text)\n"
)


def test_flags_doc_is_what_the_parser_generates() -> None:
    result = subprocess.run(
        [sys.executable, "-c", GENERATE], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    committed = FLAGS_DOC.read_text(encoding="utf-8") if FLAGS_DOC.exists() else ""
    assert committed == result.stdout, (
        f"docs/flags.md differs from the parser's flags; regenerate it: {COMMAND}"
    )


def _actions(backend: str) -> list[argparse.Action]:
    parser = build_parser(backend)
    return [
        a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


@pytest.mark.parametrize("backend", registry.backend_names())
def test_every_flag_has_help_and_a_row_in_the_reference(backend: str) -> None:
    documented = set()  # the flags of each row's first cell: `--flag X, --no-flag`
    for line in FLAGS_DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            cell = line[3:].split("` | ", 1)[0]
            documented.update(part.split(" ", 1)[0] for part in cell.split(", "))
    undocumented = []
    for action in _actions(backend):
        if not (action.help or "").strip():
            undocumented.append(f"{action.option_strings[0]}: no help text")
        for flag in action.option_strings:
            if flag not in documented:
                undocumented.append(f"{flag}: no row in docs/flags.md")
    assert not undocumented, f"regenerate with {COMMAND}:\n" + "\n".join(undocumented)


def test_readme_links_the_flag_reference() -> None:
    assert "(docs/flags.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
