"""Dependencies run one way: `trainguard/` (what users import) needs neither `activities` nor `workflows`;
`activities/` never imports `workflows`; `workflows/` imports from `activities` only its models. Checked on
the source of every module (every import statement, also those inside functions), so a wrong import fails
here before it makes the public package pull in worker code."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "trainguard": ("activities", "workflows"),
    "activities": ("workflows",),
}
"""Package -> the top-level packages none of its modules may import."""

WORKFLOWS_MAY_IMPORT = ("activities.models", "activities.pace_models", "activities.parking_models", "activities.names",
                        "activities.fingerprint_models", "activities.lighthouse_models")
"""The only `activities` modules a workflow imports: models and the activity names, never an activity's implementation."""


def imports_of(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative imports resolved against its package."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            if "." not in module:  # `from activities import ranks` imports the module `activities.ranks`
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def violations(path: Path, package: str, root: Path = REPO) -> list[str]:
    where = path.relative_to(root)
    bad = []
    for line, module in imports_of(path, root):
        top = module.split(".")[0]
        if top in FORBIDDEN.get(package, ()):
            bad.append(f"{where}:{line}: imports {module}")
        if package == "workflows" and top == "activities" and module != "activities" \
                and not module.startswith(WORKFLOWS_MAY_IMPORT):
            bad.append(f"{where}:{line}: imports {module} (an activity's implementation)")
    return bad


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def test_every_module_imports_only_down_the_layers() -> None:
    found = [bad for package in ("trainguard", "activities", "workflows") for path in _modules(package)
             for bad in violations(path, package)]
    assert found == [], "\n".join(found)


def test_the_check_sees_every_kind_of_wrong_import(tmp_path: Path) -> None:
    cases = {
        "trainguard": "def f():\n    from activities.nodes import pool_nodes\n",
        "activities": "import workflows.node_pool\n",
        "workflows": "from activities.scheduler import SchedulerAction\n",
    }
    for package, source in cases.items():
        probe = tmp_path / package / "probe.py"
        probe.parent.mkdir()
        probe.write_text(source)
        assert violations(probe, package, tmp_path), f"{package}: {source!r} not caught"
    relative = tmp_path / "activities" / "relative.py"
    relative.write_text("from ..workflows import node_pool\n")
    assert violations(relative, "activities", tmp_path)
    fine = tmp_path / "workflows" / "fine.py"
    fine.write_text("from activities.models import WatchEvent\nfrom trainguard.models import Phase\n")
    assert violations(fine, "workflows", tmp_path) == []
