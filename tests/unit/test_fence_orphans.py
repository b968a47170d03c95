"""A node agent stops ranks its run no longer counts on (after a partition heals), and only then: never
while the run cannot be asked."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.models import LaunchRanksInput
from activities.rank_records import RankBook
from trainguard.models import RunStatus
from trainguard.procs import start_time
from workers.node_agent import check_orphans, node_ranks

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class FakeRun:
    """What the agent asks the run's workflow: describe (is it running) and the status query."""

    def __init__(self, status: WorkflowExecutionStatus = WorkflowExecutionStatus.RUNNING,
                 answer: RunStatus | None = None, unreachable: bool = False) -> None:
        self.status, self.answer, self.unreachable = status, answer, unreachable

    async def describe(self) -> Any:
        if self.unreachable:
            raise RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")
        return SimpleNamespace(status=self.status)

    async def query(self, name: str, result_type: type) -> RunStatus:
        assert name == "status" and self.answer is not None
        return self.answer


class FakeClient:
    def __init__(self, run: FakeRun) -> None:
        self.run = run

    def get_workflow_handle(self, workflow_id: str) -> FakeRun:
        assert workflow_id == "wf"
        return self.run


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[RankBook, int]]:
    ranks = node_ranks("node-p", tmp_path, "127.0.0.1", tmp_path)
    launched = await ranks.launch.launch_ranks(LaunchRanksInput(
        workflow_id="wf", chain_id="c", attempt=2, node="node-p", node_rank=1, num_nodes=2, ranks_per_node=1,
        entrypoint=SLEEPER))
    yield ranks.book, launched.pids[0]
    await ranks.book.stop_all(grace_s=0.5)


@pytest.mark.parametrize("run", [
    FakeRun(WorkflowExecutionStatus.COMPLETED),
    FakeRun(answer=RunStatus(nodes=["node-0", "node-2"], attempt=3)),  # replaced by a spare
    FakeRun(answer=RunStatus(nodes=["node-0", "node-p"], attempt=3)),  # relaunched without telling us
], ids=["run-ended", "node-replaced", "newer-attempt"])
async def test_ranks_the_run_moved_on_from_are_stopped(agent: tuple[RankBook, int], run: FakeRun) -> None:
    ranks, pid = agent
    assert await check_orphans(FakeClient(run), ranks, idle_s=0.0) == 1
    assert start_time(pid) is None


@pytest.mark.parametrize("run", [
    FakeRun(unreachable=True),  # still cut off, or Temporal is down: never stop training for that
    FakeRun(answer=RunStatus(nodes=["node-0", "node-p"], attempt=2)),  # the run still counts on them
], ids=["cannot-ask", "still-current"])
async def test_ranks_are_kept_unless_the_run_says_otherwise(agent: tuple[RankBook, int], run: FakeRun) -> None:
    ranks, pid = agent
    assert await check_orphans(FakeClient(run), ranks, idle_s=0.0) == 0
    assert start_time(pid) is not None


async def test_watched_ranks_are_not_asked_about(agent: tuple[RankBook, int]) -> None:
    ranks, pid = agent
    assert await check_orphans(FakeClient(FakeRun(WorkflowExecutionStatus.COMPLETED)), ranks, idle_s=30.0) == 0
    assert start_time(pid) is not None
