"""Pages of the docs site that are generated, never hand-copied: the spec, CLI and environment-variable references
(from the code) and the performance tables (from `docs/results/*.json`). `make docs` runs them;
tests/unit/test_docs.py checks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def page_main(prog: str, page: Path, render: Callable[[], str], argv: list[str] | None = None) -> int:
    """A generated page's command: write it, or with `--check` exit 1 (saying what to run) when it is stale."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    opts = parser.parse_args(argv)
    text = render()
    if opts.check:
        if (page.read_text() if page.exists() else "") != text:
            print(f"{page.relative_to(REPO)} is not current: run `make docs`", file=sys.stderr)
            return 1
        return 0
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    return 0
