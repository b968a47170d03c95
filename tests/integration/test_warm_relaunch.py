"""Warm relaunch on the real stack: after a crash, the next attempt's ranks are processes each node agent had
parked ahead of need (started before the crash, torch already imported), and the run ends bit-identical to
the `baseline`; a script that never calls `tg.standby()` is never parked and relaunches cold, as before.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from trainguard import protocol
from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import IncidentKind, RunResult
from trainguard.protocol import RunLayout

from .conftest import RUN_TIMEOUT_S, checkpointed, live_rank_pids, make_spec, wait_until

NODES = ("node-0", "node-1")


def _record(stack: DevStack, node: str, run_id: str) -> protocol.AttemptFile:
    record = protocol.read_attempt_file(RunLayout.of(stack.home / "nodes" / node, run_id).ranks_file)
    assert record is not None
    return record


def _waiting(stack: DevStack, node: str, run_id: str) -> set[int]:
    """The pids of the run's processes parked on `node` that wait in `standby()` for a role."""
    layout = RunLayout.of(stack.home / "nodes" / node, run_id)
    marks = [protocol.StandbyMark.read(p) for p in layout.parked_dir.glob("*.mark.json")]
    recorded = {p.pid for p in _record(stack, node, run_id).parked}
    return {m.pid for m in marks if m is not None and m.parked and m.pid in recorded}


async def test_a_crash_relaunch_is_served_by_parked_processes(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    rid = f"it-warm-{uuid.uuid4().hex[:6]}"
    # The baseline's job, slower per step (a sleep: the final state is the same), so there is time to park.
    await client.start_run(make_spec(prefix, step_time=0.3), workflow_id=rid)
    await wait_until(client, rid, checkpointed)
    await wait_until(client, rid, lambda _view: all(_waiting(stack, n, rid) for n in NODES), timeout_s=60)
    parked = {n: _waiting(stack, n, rid) for n in NODES}
    await client.inject_fault(rid, "crash", "node-1")

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    [crash] = result.incidents
    assert crash.kind is IncidentKind.CRASH and crash.node == "node-1", result.incidents
    assert result.attempts == 2
    for node in NODES:  # every rank of attempt 2 is a process started before the crash
        [rank] = _record(stack, node, rid).ranks
        assert rank.pid in parked[node], (node, rank, parked)
    assert result.final_state_digest == baseline.final_state_digest
    assert live_rank_pids(stack) == []  # the parked processes went with the finished run


@pytest.mark.slow  # ~25 s; tests/unit/test_parked_ranks.py keeps a script without standby unparked
async def test_a_script_without_standby_relaunches_cold(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    rid = f"it-cold-{uuid.uuid4().hex[:6]}"
    spec = make_spec(prefix)
    spec["entrypoint"].append("--no-standby")
    await client.start_run(spec, workflow_id=rid)
    await wait_until(client, rid, checkpointed)
    before = {n: {p.pid for p in _record(stack, n, rid).ranks} for n in NODES}
    await client.inject_fault(rid, "crash", "node-1")

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    [crash] = result.incidents
    assert crash.kind is IncidentKind.CRASH and result.attempts == 2, result.incidents
    for node in NODES:
        layout = RunLayout.of(stack.home / "nodes" / node, rid)
        assert not list(layout.parked_dir.glob("park-*")), node  # nothing was ever started ahead of need
        assert not layout.standby_mark(1).exists() and not layout.standby_mark(2).exists()
        assert not {p.pid for p in _record(stack, node, rid).ranks} & before[node]  # started anew
    assert result.final_state_digest == baseline.final_state_digest
