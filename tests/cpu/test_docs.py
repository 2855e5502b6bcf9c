"""The repository's documents stand alone: nothing points outside the repository.

Proves that no tracked file refers to the working notes kept beside the
repository (the sibling ``shared`` folder: its architecture page and background
notes), which a user who has only the repository cannot read, and that every
relative link in ``README.md`` and ``docs/*.md`` names a file (and, for a
markdown target, a heading) that exists in the repository.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Spelled in pieces so that this file does not match itself.
_SHARED = "shared"
FORBIDDEN = (f"../{_SHARED}", f"{_SHARED}/ARCHITECTURE", f"{_SHARED}/background")

# [text](target) and ![alt](target), the target up to whitespace or ")"; and reference
# definitions "[label]: target" at the start of a line.
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _tracked_files() -> list[Path]:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(
        [git, "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [ROOT / name for name in out.split("\0") if name]


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _links(text: str) -> list[str]:
    """The link targets of a markdown text, code blocks left out."""
    text = FENCE.sub("", text)
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, markup and punctuation
    dropped (an underscore inside a name, as in ``async_loop.py``, stays), spaces to
    hyphens."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def test_no_tracked_file_points_outside_the_repository() -> None:
    offenders = []
    for path in _tracked_files():
        if not path.is_file():
            continue  # deleted in the working tree, or a submodule
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        for number, line in enumerate(text.splitlines(), start=1):
            for needle in FORBIDDEN:
                if needle in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {needle}")
    assert not offenders, "references outside the repository:\n" + "\n".join(offenders)


def test_docs_exist_and_readme_links_them() -> None:
    assert (ROOT / "docs" / "architecture.md").is_file()
    assert "docs/architecture.md" in _links((ROOT / "README.md").read_text(encoding="utf-8"))


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in _links(doc.read_text(encoding="utf-8")):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / unquote(path_part)).resolve() if path_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)
