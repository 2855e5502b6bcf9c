"""``docs/architecture.md`` names only what exists.

Proves that every file and folder the page names -- the layout tree, and each
path-like name in backticks (``config/parser.py``, ``tests/cpu``,
``scripts/models/*.sh``) -- exists in the repository, that every ``vime.``
dotted name is a module or something a module defines, and that every
``Class.attribute`` of a vime class is defined beside that class. The page is a
map of the code; renaming or removing a module without fixing the map fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
TOP = {"vime", "tests", "scripts", "bench", "docs", ".ci", ".buildkite"}
EXTENSIONS = (".py", ".sh", ".md", ".yml", ".toml")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
NAME = re.compile(r"[\w.*/-]+")
SOURCES = {path: path.read_text(encoding="utf-8") for path in (ROOT / "vime").rglob("*.py")}


def _exists(name: str, *bases: Path) -> bool:
    name = name.rstrip("/")
    return any(next(base.glob(name), None) is not None for base in bases)


def _is_path(name: str) -> bool:
    return name.endswith(("/", *EXTENSIONS)) or ("/" in name and name.split("/", 1)[0] in TOP)


def _layout() -> list[str]:
    """The layout block's lines, its four-space indent removed."""
    text = DOC.read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("\n\n", 2)[1]
    return [line[4:] for line in block.splitlines() if line.strip()]


def test_layout_names_only_what_exists() -> None:
    missing = []
    parents: list[tuple[int, Path]] = []  # (indent, folder) of the open entries
    current = ROOT
    for line in _layout():
        indent = len(line) - len(line.lstrip())
        words = line.split()
        if indent < 20:  # an entry; deeper lines continue the last entry's description
            while parents and parents[-1][0] >= indent:
                parents.pop()
            base = parents[-1][1] if parents else ROOT
            entry, words = words[0], words[1:]
            if not _exists(entry, base):
                missing.append(f"{entry} (in {base.relative_to(ROOT)}/)")
            current = base / entry.rstrip("/") if entry.endswith("/") else base
            if entry.endswith("/"):
                parents.append((indent, current))
        for word in words:  # files named in a description: beside the entry, or from the root
            word = word.strip(",;:()")
            if _is_path(word) and NAME.fullmatch(word) and not _exists(word, current, ROOT):
                missing.append(f"{word} (described under {current.relative_to(ROOT)}/)")
    assert not missing, "docs/architecture.md names what does not exist:\n" + "\n".join(missing)


def _spans() -> list[str]:
    text = FENCE.sub("", DOC.read_text(encoding="utf-8"))
    return re.findall(r"`([^`\n]+)`", text)


def _defined(name: str, source: str) -> bool:
    return bool(
        re.search(rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]", source, re.M)
    )


def _imported(name: str, source: str) -> bool:
    """``name`` is imported into the module (a package re-exporting it)."""
    return bool(re.search(rf"^from [\w.]+ import (\([^)]*|[^\n]*)\b{name}\b", source, re.M))


def test_named_paths_exist() -> None:
    bases = (ROOT, ROOT / "vime", ROOT / "tests" / "cpu")
    missing = []
    for span in _spans():
        if not (_is_path(span) and NAME.fullmatch(span)):
            continue
        if "/" not in span.rstrip("/"):  # a bare file name: anywhere in the package or tests
            found = any(p.name == span.rstrip("/") for p in ROOT.glob(f"**/{span.rstrip('/')}"))
        else:
            found = _exists(span, *bases)
        if not found:
            missing.append(span)
    assert not missing, "docs/architecture.md names missing paths: " + ", ".join(missing)


def test_named_modules_and_attributes_exist() -> None:
    missing = []
    for span in _spans():
        if re.fullmatch(r"vime(\.\w+)+", span):
            parts = span.split(".")
            for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
                stem = ROOT.joinpath(*parts[:cut])
                module = stem / "__init__.py" if stem.is_dir() else stem.with_suffix(".py")
                if module.is_file():
                    break
            else:
                missing.append(span)
                continue
            rest = parts[cut:]
            source = module.read_text(encoding="utf-8")
            if rest and not (_defined(rest[0], source) or _imported(rest[0], source)):
                missing.append(span)
        elif re.fullmatch(r"[A-Z]\w+\.\w+", span):
            cls, attr = span.split(".")
            homes = [src for src in SOURCES.values() if _defined(cls, src)]
            if homes and not any(_defined(attr, src) for src in homes):
                missing.append(span)
    assert not missing, "docs/architecture.md names undefined things: " + ", ".join(missing)
