"""The harness the tests, benchmarks and soak share (`infra.harness`): its environment scope, its spec, and the
two ways it finds a stack's ranks (the agents' records, /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import harness
from trainguard import protocol
from trainguard.procs import start_time
from trainguard.spec import parse_spec


def test_scoped_environ_sets_removes_and_puts_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TG_HARNESS_KEPT", "old")
    monkeypatch.delenv("TG_HARNESS_NEW", raising=False)
    with pytest.raises(RuntimeError), harness.scoped_environ({"TG_HARNESS_KEPT": None, "TG_HARNESS_NEW": "x"}):
        assert "TG_HARNESS_KEPT" not in os.environ and os.environ["TG_HARNESS_NEW"] == "x"
        raise RuntimeError("the block fails: the variables are put back all the same")
    assert os.environ["TG_HARNESS_KEPT"] == "old" and "TG_HARNESS_NEW" not in os.environ


def test_make_spec_is_a_spec_the_workflow_accepts() -> None:
    spec = parse_spec(harness.make_spec("p", steps=30, every=10, spares=("node-2",), min_nodes=1))
    assert (spec.checkpoint.every_steps, spec.spare_nodes, spec.min_nodes) == (10, ["node-2"], 1)
    assert spec.entrypoint[:2] == ["python", "examples/train.py"]


def _sleeper(env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, **env}, start_new_session=True)
    for _ in range(200):  # until its start time is readable
        if start_time(proc.pid):
            break
        time.sleep(0.01)
    return proc


def test_ranks_are_found_by_their_environment_and_by_the_agents_records(tmp_path: Path) -> None:
    home = tmp_path / "stack"
    layout = protocol.RunLayout.of(home / "nodes" / "node-1", "run-x")
    rank = _sleeper({protocol.ENV_CHECKPOINT_DIR: str(layout.checkpoint_dir), protocol.ENV_WORKFLOW_ID: "run-x",
                     protocol.ENV_NODE: "node-1", protocol.ENV_ATTEMPT: "3", "RANK": "1"})
    stranger = _sleeper({protocol.ENV_CHECKPOINT_DIR: str(tmp_path / "elsewhere" / "checkpoints")})
    try:
        found = harness.scan_ranks(home)
        assert [(p.pid, p.workflow_id, p.node, p.attempt, p.rank) for p in found] == [
            (rank.pid, "run-x", "node-1", 3, 1)]

        layout.root.mkdir(parents=True)
        protocol.AttemptFile(workflow_id="run-x", attempt=3, master_addr="127.0.0.1", master_port=1, start_step=0,
                             launched_at=0.0, ranks=[protocol.ProcessEntry(rank.pid, start_time(rank.pid), 1),
                                                     protocol.ProcessEntry(stranger.pid, "0", 0)],
                             ).write(layout.ranks_file)
        assert harness.live_rank_pids(home) == [rank.pid]  # the stranger's start time is not the recorded one

        harness.kill_ranks(found)
        assert rank.wait(timeout=10) == -9
        assert harness.scan_ranks(home) == [] and stranger.poll() is None
    finally:
        for proc in (rank, stranger):
            proc.kill()
            proc.wait()
