"""The controller's build id (`trainguard.versioning`): derived from the workflow code when none is given, the
same for the same code wherever it lies, different when a workflow or what it imports changes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.settings import Settings
from trainguard.versioning import (CODE_ROOT, Promotion, controller_build_id, derived_build_id,
                                   workflow_code_files)


def _copy_code(dest: Path) -> Path:
    """The workflow code (and nothing else) of this checkout under `dest`, as a code root."""
    for path in workflow_code_files().values():
        target = dest / path.relative_to(CODE_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return dest


def _edit(root: Path, relative: str, old: str, new: str) -> None:
    path = root / relative
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_the_same_code_gives_the_same_id_wherever_it_lies(tmp_path: Path) -> None:
    here = derived_build_id()
    assert here.startswith("wf-") and len(here) == len("wf-") + 12
    assert derived_build_id(_copy_code(tmp_path / "elsewhere")) == here
    crlf = _copy_code(tmp_path / "crlf")  # a Windows checkout (autocrlf) is the same code
    path = crlf / "workflows" / "training_run.py"
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    assert derived_build_id(crlf) == here


def test_another_process_derives_the_same_id() -> None:
    """No dict order, hash seed or import state of one process in it: a fresh interpreter with another seed."""
    out = subprocess.run([sys.executable, "-c", "from trainguard.versioning import derived_build_id; "
                                                "print(derived_build_id())"],
                         capture_output=True, text=True, check=True, cwd=CODE_ROOT,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert out == derived_build_id()


@pytest.mark.parametrize(("relative", "old", "new"), [
    ("workflows/training_run.py", "class TrainingRun", "# a harmless change\nclass TrainingRun"),
    ("activities/models.py", "from __future__", "# a model the workflows decode\nfrom __future__"),
    ("trainguard/spec.py", "from __future__", "# the run spec\nfrom __future__"),
])
def test_a_change_to_the_workflows_or_what_they_import_gives_a_new_id(
        tmp_path: Path, relative: str, old: str, new: str) -> None:
    changed = _copy_code(tmp_path / "changed")
    _edit(changed, relative, old, new)
    assert derived_build_id(changed) != derived_build_id()


def test_code_the_workflows_do_not_import_is_not_in_the_id(tmp_path: Path) -> None:
    files = workflow_code_files()
    assert {"workflows.training_run", "activities.models", "trainguard.spec"} <= set(files)
    assert "workers.controller" not in files and "activities.checkpoint_store" not in files
    root = _copy_code(tmp_path / "root")
    (root / "workers").mkdir(exist_ok=True)
    (root / "workers" / "controller.py").write_text("# activity-side code: not replayed\n")
    assert derived_build_id(root) == derived_build_id()


def test_imports_for_type_checking_only_are_not_followed(tmp_path: Path) -> None:
    root = _copy_code(tmp_path / "root")
    (root / "workers").mkdir(exist_ok=True)
    (root / "workers" / "__init__.py").write_text("")
    (root / "workers" / "typing_only.py").write_text("x = 1\n")
    _edit(root, "workflows/goodput.py", "from __future__ import annotations\n",
          "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
          "if TYPE_CHECKING:\n    import workers.typing_only\n")
    assert "workers.typing_only" not in workflow_code_files(root)
    _edit(root, "workflows/goodput.py", "if TYPE_CHECKING:\n", "if True:\n")
    assert "workers.typing_only" in workflow_code_files(root)


def test_an_explicit_build_id_wins_and_unversioned_opts_out() -> None:
    assert controller_build_id(Settings.from_env({})) == derived_build_id()
    assert controller_build_id(Settings.from_env({"TRAINGUARD_BUILD_ID": "2026.12.1"})) == "2026.12.1"
    for opt_out in ("unversioned", "UNVERSIONED", " unversioned "):
        assert controller_build_id(Settings.from_env({"TRAINGUARD_BUILD_ID": opt_out})) is None


def test_a_root_without_workflows_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no workflows package"):
        derived_build_id(tmp_path)


def test_promote_says_what_still_runs_on_older_builds() -> None:
    lines = Promotion("trainguard-controller", "wf-b", "wf-a", True,
                      {"wf-a": ["run-1", "run-1/watch-0", "run-1/watch-1"]}).lines()
    assert lines[0].startswith("trainguard-controller: wf-b is current (was wf-a)")
    assert "moves to wf-b" in lines[1]
    assert lines[2] == ("still running on wf-a (keep its controller until they end): run-1 "
                        "(+2 node-group workflows)")
    drained = Promotion("trainguard-controller", "wf-b", None, False).lines()
    assert "was unversioned workers" in drained[0] and "not running" in drained[1]
    assert drained[2] == "nothing runs on another build: their controllers may stop"


def test_promote_refuses_with_versioning_off_before_connecting(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from trainguard import cli

    monkeypatch.setenv("TRAINGUARD_BUILD_ID", "unversioned")
    monkeypatch.setenv("TRAINGUARD_TEMPORAL_ADDRESS", "127.0.0.1:1")  # nothing listens: it must not be asked
    assert cli.main(["controller", "promote"]) == 2
    assert "versioning is off" in capsys.readouterr().err
