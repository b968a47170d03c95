"""mkdocs hooks (mkdocs.yml `hooks:`): docs/performance.md's tables from the committed `docs/results/*.json`
(`make bench-publish` copies them from `.bench/`), and `.bench`'s pictures, where this machine has them,
published under `bench/` in the site."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # mkdocs loads this file by path: let it import the repo's packages
    sys.path.insert(0, str(REPO))

from infra.docgen import performance  # noqa: E402


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for picture in performance.pictures():
        files.append(File.generated(config, f"bench/{picture.name}", abs_src_path=str(picture)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != "performance.md":
        return markdown
    text = performance.render_page(markdown)
    shown = [p.name for p in performance.pictures()]
    if shown:
        text += "\n\n## Pictures of the last run\n\n" + "\n\n".join(
            f"![{name}](bench/{name})" for name in shown) + "\n"
    return text
