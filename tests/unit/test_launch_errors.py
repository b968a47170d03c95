"""Whose fault a failed launch is. Whatever a spec names (its working_dir, entrypoint, env) is never the node's
fault: the launch fails as a non-retryable `BadSpec` and the run cordons no node. What the node lacks (file
descriptors, memory) is raised as it is, retried, then the node's. What a rank writes into its own folders (a
`step-latest` symlink) is skipped, never an error."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from activities.launch_errors import classify_launch_error, spec_values, working_dir
from activities.rank_launch import drop_uncommitted_shards
from activities.rank_watch import RankWatch
from trainguard.error_types import ErrorType
from trainguard.protocol import RunLayout, rank_of_name, shard_meta_name, step_dir_name, step_of_dir_name


@pytest.mark.parametrize(("error", "expected"), [
    (OSError(errno.ENAMETOOLONG, "File name too long"), ErrorType.BAD_SPEC),  # a 300-character folder name
    (ValueError("embedded null byte"), ErrorType.BAD_SPEC),
    (UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates not allowed"), ErrorType.BAD_SPEC),
    (FileNotFoundError(errno.ENOENT, "No such file or directory"), ErrorType.BAD_SPEC),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory"), ErrorType.BAD_SPEC),
    (PermissionError(errno.EACCES, "Permission denied"), ErrorType.BAD_SPEC),
    (OSError(errno.E2BIG, "Argument list too long"), ErrorType.BAD_SPEC),
    (OSError(errno.ENOEXEC, "Exec format error"), ErrorType.BAD_SPEC),
    (ApplicationError("stale", type=ErrorType.STALE_ATTEMPT, non_retryable=True), ErrorType.STALE_ATTEMPT),
    (ApplicationError("no", type=ErrorType.ENTRYPOINT_NOT_ALLOWED, non_retryable=True),
     ErrorType.ENTRYPOINT_NOT_ALLOWED),
    # The node's: retried, then held against the node.
    (OSError(errno.EMFILE, "Too many open files"), None),
    (OSError(errno.ENOMEM, "Cannot allocate memory"), None),
    (BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), None),  # fork: process limit
    (OSError(errno.ENOSPC, "No space left on device"), None),
    (RuntimeError("can't start new thread"), None),
    (ApplicationError("code dir gone", type=ErrorType.NODE_UNAVAILABLE), None),
], ids=lambda case: case if isinstance(case, (str, type(None))) else type(case).__name__)
def test_a_launch_error_is_the_specs_only_when_the_spec_caused_it(error: BaseException,
                                                                  expected: ErrorType | None) -> None:
    assert classify_launch_error(error) == expected


@pytest.mark.parametrize(("make", "reason"), [
    (lambda tmp: str(tmp / ("x" * 300)), "is unusable here (File name too long)"),
    (lambda tmp: f"{tmp}/a\x00b", "does not exist"),
    (lambda tmp: str(tmp / "missing"), "does not exist"),
    (lambda tmp: str(tmp / "file.txt"), "is not a directory"),
    (lambda tmp: str(tmp / "locked" / "inside"), "is unusable here (Permission denied)"),
], ids=["name-too-long", "nul-byte", "missing", "not-a-dir", "permission"])
def test_a_working_dir_the_node_cannot_use_is_a_bad_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         make, reason: str) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "file.txt").write_text("not a folder")
    is_dir = Path.is_dir

    def locked(path: Path) -> bool:  # a folder the agent may not search (as root, chmod 0 would not stop it)
        if path.parent.name == "locked":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return is_dir(path)

    monkeypatch.setattr(Path, "is_dir", locked)
    with pytest.raises(ApplicationError) as refused:
        working_dir(make(tmp_path), tmp_path, "node-a")

    assert refused.value.type == ErrorType.BAD_SPEC and refused.value.non_retryable
    assert refused.value.message.startswith("working_dir ") and reason in refused.value.message
    assert len(refused.value.message) < 400, "a 300-character path is shown shortened"


def test_the_agents_own_code_dir_is_the_nodes_to_mend(tmp_path: Path) -> None:
    assert working_dir(None, tmp_path, "node-a") == tmp_path
    assert working_dir(str(tmp_path), tmp_path / "gone", "node-a") == tmp_path

    with pytest.raises(ApplicationError) as missing:
        working_dir(None, tmp_path / "gone", "node-a")
    assert missing.value.type == ErrorType.NODE_UNAVAILABLE and not missing.value.non_retryable
    assert classify_launch_error(missing.value) is None


def test_spec_values_names_the_field_and_lets_the_nodes_errors_through() -> None:
    with pytest.raises(ApplicationError) as refused, spec_values("entrypoint.0", "node-a"):
        raise OSError(errno.ENAMETOOLONG, "File name too long", "x" * 300)
    assert refused.value.type == ErrorType.BAD_SPEC and refused.value.non_retryable
    assert refused.value.message == "entrypoint.0: File name too long (node node-a)"

    node_fault = OSError(errno.EMFILE, "Too many open files")
    with pytest.raises(OSError) as raised, spec_values("entrypoint.0", "node-a"):
        raise node_fault
    assert raised.value is node_fault


@pytest.mark.parametrize(("name", "step"), [
    (step_dir_name(12), 12), ("step-latest", None), ("step-", None), ("step-12.tmp", None), ("step-١٢", None),
    ("steps-12", None), ("rank-00001", None),
])
def test_only_a_step_folders_own_name_is_a_step(name: str, step: int | None) -> None:
    assert step_of_dir_name(name) == step


def test_only_a_rank_files_own_stem_is_a_rank() -> None:
    assert [rank_of_name(s) for s in ("rank-00003", "rank-best", "rank-", "ranks-1")] == [3, None, None, None]


def _checkpoints_with_a_ranks_own_junk(tmp_path: Path) -> RunLayout:
    layout = RunLayout.of(tmp_path, "wf")
    for step in (10, 20):
        layout.local_step_dir(step).mkdir(parents=True)
        (layout.local_step_dir(step) / shard_meta_name(0)).write_text("{}")
    (layout.local_step_dir(20) / "rank-best.json").write_text("{}")
    (layout.checkpoint_dir / "step-latest").symlink_to(layout.local_step_dir(20))
    (layout.checkpoint_dir / "step-notes.txt").write_text("the rank's own")
    return layout


def test_a_launch_drops_newer_steps_and_leaves_the_ranks_own_entries(tmp_path: Path) -> None:
    layout = _checkpoints_with_a_ranks_own_junk(tmp_path)

    drop_uncommitted_shards(layout, restore_step=10)

    assert sorted(p.name for p in layout.checkpoint_dir.iterdir()) == [
        step_dir_name(10), "step-latest", "step-notes.txt"]


def test_the_watch_counts_saved_steps_past_the_ranks_own_entries(tmp_path: Path) -> None:
    layout = _checkpoints_with_a_ranks_own_junk(tmp_path)

    assert RankWatch._saved_steps(layout) == {10: {0}, 20: {0}}
