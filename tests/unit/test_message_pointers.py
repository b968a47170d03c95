"""No dangling pointers: every docs page, docs anchor, README section and `make` target that the code points users
at (in its messages, help and docstrings) exists. A spec with `HF_TOKEN` once pointed to "README: Security model",
which did not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("trainguard", "activities", "workflows", "workers", "examples")
"""What users run and copy; its messages and help are what they read."""

DOC = re.compile(r"\bdocs/(?P<page>[A-Za-z0-9_./-]+\.md)(?:#(?P<anchor>[A-Za-z0-9_-]+))?")
README_SECTION = re.compile(r"\bREADME(?:'s|:)\s+(?P<section>[A-Z][A-Za-z0-9 -]*?)(?:\s+section\b|[\"'`).,;:]|$)",
                            re.MULTILINE)
MAKE_TARGET = re.compile(r"`make (?P<target>[a-z][a-z0-9-]*)")


def _slug(heading: str) -> str:
    """The anchor mkdocs gives a heading (Python-Markdown's toc `slugify`)."""
    text = re.sub(r"\s*\{#[^}]*\}\s*$", "", heading)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)]


def dangling(text: str, repo: Path = REPO) -> list[str]:
    """The pointers in `text` to nothing: docs pages or anchors, README sections, make targets."""
    found = []
    for match in DOC.finditer(text):
        page = repo / "docs" / match["page"]
        if not page.is_file():
            found.append(f"{match[0]}: no such page")
        elif match["anchor"] and match["anchor"] not in {_slug(h) for h in _headings(page)}:
            found.append(f"{match[0]}: no such heading in docs/{match['page']}")
    readme = {h.lower() for h in _headings(repo / "README.md")}
    for match in README_SECTION.finditer(text):
        if match["section"].strip().lower() not in readme:
            found.append(f"README section {match['section'].strip()!r}: the README has no such heading")
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (repo / "Makefile").read_text(), re.MULTILINE))
    found += [f"make {m['target']}: no such Makefile target" for m in MAKE_TARGET.finditer(text)
              if m["target"] not in targets]
    return found


def _source_files() -> list[Path]:
    return sorted(p for folder in SOURCES for p in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_pointer_in_the_code_leads_somewhere(path: Path) -> None:
    assert dangling(path.read_text()) == []


def test_a_dangling_pointer_is_found() -> None:
    """The negative control: the check above would see each kind of dangling pointer."""
    text = ('"give it to the workers (README: Security model)" '
            "docs/nowhere.md docs/operations/security.md#no-such-heading `make no-such-target` "
            "docs/operations/security.md `make test` README: Installing.")

    assert dangling(text) == [
        "docs/nowhere.md: no such page",
        "docs/operations/security.md#no-such-heading: no such heading in docs/operations/security.md",
        "README section 'Security model': the README has no such heading",
        "make no-such-target: no such Makefile target",
    ]
