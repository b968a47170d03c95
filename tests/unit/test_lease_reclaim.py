"""A closed run's lease goes back to the pool when a lease finds it in the way (issue 27 item 7): a terminated
run never releases its nodes, and every later run waited for them until it failed "leased to ..."."""

from __future__ import annotations

from datetime import datetime, UTC
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.nodes import (RECLAIM_AFTER_CLOSED_S, RECLAIM_RECHECK_S, RECLAIM_RUNS_PER_LEASE, LeaseReclaimer,
                              lessees_to_check, reclaimable)
from trainguard.models import AcquireNodesResult, NodeRequest
from workers.node_agent import ORPHAN_CHECK_INTERVAL_S, ORPHAN_IDLE_S

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("running", "closed_at", "expected"),
    [
        pytest.param(True, None, False, id="running"),
        pytest.param(False, NOW - RECLAIM_AFTER_CLOSED_S, True, id="closed-long-enough"),
        pytest.param(False, NOW - 5.0, False, id="closed-just-now-its-ranks-may-still-run"),
        pytest.param(False, None, True, id="gone-from-temporal"),
    ],
)
def test_which_lessees_lose_their_nodes(running: bool, closed_at: float | None, expected: bool) -> None:
    assert reclaimable(running, closed_at, NOW) is expected


def test_a_closed_runs_ranks_are_fenced_by_their_agents_before_its_nodes_are_leased_again() -> None:
    assert RECLAIM_AFTER_CLOSED_S > ORPHAN_IDLE_S + ORPHAN_CHECK_INTERVAL_S


def test_lessees_are_looked_at_bounded_and_not_on_every_ask() -> None:
    busy = ["me", "a", "a", "b", "", *(f"r{i}" for i in range(40))]
    checked = {"b": NOW - RECLAIM_RECHECK_S / 2, "r0": NOW - RECLAIM_RECHECK_S}
    due = lessees_to_check(busy, "me", checked, NOW)
    assert due[:2] == ["a", "r0"] and "b" not in due and "me" not in due
    assert len(due) == RECLAIM_RUNS_PER_LEASE


class Handle:
    def __init__(self, state: Any) -> None:
        self.state = state

    async def describe(self) -> Any:
        if isinstance(self.state, Exception):
            raise self.state
        status, closed_at = self.state
        return SimpleNamespace(status=status, close_time=closed_at and datetime.fromtimestamp(closed_at, UTC))


class Client:
    def __init__(self, runs: dict[str, Any]) -> None:
        self.runs, self.described = runs, []

    def get_workflow_handle(self, workflow_id: str) -> Handle:
        self.described.append(workflow_id)
        return Handle(self.runs[workflow_id])


async def test_only_closed_lessees_are_released_and_each_looked_at_once_per_recheck() -> None:
    long_ago = NOW - 2 * RECLAIM_AFTER_CLOSED_S
    client = Client({
        "terminated": (WorkflowExecutionStatus.TERMINATED, long_ago),
        "failed": (WorkflowExecutionStatus.FAILED, long_ago),
        "just-cancelled": (WorkflowExecutionStatus.CANCELED, NOW - 1),
        "live": (WorkflowExecutionStatus.RUNNING, None),
        "gone": RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b""),
        "unreachable": RPCError("unavailable", RPCStatusCode.UNAVAILABLE, b""),
    })
    released: list[str] = []

    async def release(request: NodeRequest) -> list[str]:
        released.append(request.run_id or "")
        return [f"{request.run_id}-node"]

    now = [NOW]
    reclaimer = LeaseReclaimer(client, release, clock=lambda: now[0])  # type: ignore[arg-type]
    lease = AcquireNodesResult(granted=False, busy={f"n{i}": run for i, run in enumerate(client.runs)})

    freed = await reclaimer.reclaim(lease, "me")
    assert released == ["terminated", "failed", "gone"] and freed == [f"{r}-node" for r in released]

    client.described.clear()
    assert await reclaimer.reclaim(lease, "me") == [] and client.described == []  # the next ask, 2 s later
    now[0] += RECLAIM_AFTER_CLOSED_S  # past the recheck, and the cancelled run's ranks are fenced by now
    await reclaimer.reclaim(lease.model_copy(update={"busy": {"n2": "just-cancelled", "n3": "live"}}), "me")
    assert released[3:] == ["just-cancelled"]
