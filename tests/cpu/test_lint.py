"""Repository hygiene that CI must enforce through the one test command.

Proves that ``ruff check`` and ``ruff format --check`` are clean over the whole
tree, and that ``.ci/run`` runs exactly the README's test command (the rule of
two set-up commands: what a user types is what CI runs).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_ruff_clean(command: list[str]) -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed; it comes with the [dev] extra")
    result = subprocess.run([ruff, *command], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README quick start has no bash block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def test_readme_quick_start_has_exactly_two_commands() -> None:
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("vime-train")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _quick_start_commands()[1] in [line.strip() for line in ci]
