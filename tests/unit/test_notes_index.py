"""Every design note in the package is in docs/design.md's index, under the file that holds it.

A note is a block that opens with a line of its own, ``[Note: title]`` (in a docstring or after
``#``); code refers to it as ``See [Note: title]``, wrapped over lines where a sentence runs on.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# Lint, not behaviour: these read the source text (see tests/unit/test_layout.py).
pytestmark = pytest.mark.lint

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "fsdp"
DEFINITION = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]\n]+)\]\s*$", re.MULTILINE)
REFERENCE = re.compile(r"\[Note:\s+([^\]]+?)\]", re.DOTALL)
INDEX_ROW = re.compile(r"^\| `\[Note: ([^\]]+)\]` — .* \| `(fsdp/[\w/]+\.py)` \|$", re.MULTILINE)


def _text_without_comment_marks(path: Path) -> str:
    """The file's text with each line's leading ``#`` removed, so a reference wrapped in a comment reads whole."""
    return "\n".join(re.sub(r"^\s*#", "", line) for line in path.read_text().splitlines())


def _definitions() -> dict[str, list[str]]:
    """Note title -> the files (``fsdp/pkg/x.py``) whose text opens a note of that title."""
    found: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for title in DEFINITION.findall(path.read_text()):
            found.setdefault(title, []).append(str(path.relative_to(ROOT)))
    return found


def _references() -> dict[str, set[str]]:
    """Note title (whitespace collapsed) -> the files that name it."""
    found: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for title in REFERENCE.findall(_text_without_comment_marks(path)):
            found.setdefault(" ".join(title.split()), set()).add(str(path.relative_to(ROOT)))
    return found


def _index() -> dict[str, str]:
    """Note title -> the file the index of docs/design.md names for it."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Design notes (index)", 1)[1].split("\n## ", 1)[0]
    rows = INDEX_ROW.findall(section)
    index = dict(rows)
    assert len(index) == len(rows), "a note is listed twice in the index of docs/design.md"
    return index


def test_every_note_is_defined_once() -> None:
    twice = {title: files for title, files in _definitions().items() if len(files) > 1}
    assert not twice, f"notes opened more than once: {twice}"


def test_every_note_is_in_the_index_under_its_file() -> None:
    index = _index()
    for title, (where, *_) in _definitions().items():
        assert title in index, f"[Note: {title}] ({where}) is missing from the index in docs/design.md"
        assert index[title] == where, (
            f"the index of docs/design.md places [Note: {title}] in {index[title]}, not {where}"
        )


def test_every_indexed_note_exists() -> None:
    defined = _definitions()
    stale = {title: where for title, where in _index().items() if title not in defined}
    assert not stale, f"the index of docs/design.md lists notes that no file opens: {stale}"


def test_every_reference_names_a_note() -> None:
    defined = _definitions()
    dangling = {title: sorted(files) for title, files in _references().items() if title not in defined}
    assert not dangling, f"references to notes that no file opens: {dangling}"
