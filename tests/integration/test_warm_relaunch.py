"""Warm relaunch on the real stack: after a crash, the next attempt's ranks are processes each node agent had
parked ahead of need (started before the crash, torch already imported), and the run ends bit-identical to
the `baseline`; after a GPU fault the spare that takes the node's place is warm too (it parked for the run once
the run knew its script parks); a script that never calls `tg.standby()` is never parked and relaunches cold.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from trainguard import protocol
from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import Action, IncidentKind, RunResult
from trainguard.procs import start_time
from trainguard.protocol import RunLayout

from .conftest import RUN_TIMEOUT_S, checkpointed, live_rank_pids, make_spec, restart_agent, wait_until

NODES = ("node-0", "node-1")


def _record(stack: DevStack, node: str, run_id: str) -> protocol.AttemptFile:
    record = protocol.read_attempt_file(RunLayout.of(stack.home / "nodes" / node, run_id).ranks_file)
    assert record is not None
    return record


def _waiting(stack: DevStack, node: str, run_id: str) -> set[int]:
    """The pids of the run's processes parked on `node` that wait in `standby()` for a role."""
    layout = RunLayout.of(stack.home / "nodes" / node, run_id)
    marks = [protocol.StandbyMark.read(p) for p in layout.parked_dir.glob("*.mark.json")]
    ranks_file = RunLayout.of(stack.home / "nodes" / node, run_id).ranks_file
    if not ranks_file.exists():
        return set()  # a spare before the run asked it to park
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


@pytest.mark.slow  # ~40 s quiet, 67 s at load 15; the unit tests (agent, workflow) cover the spare's parts
async def test_a_gpu_faults_spare_takes_the_node_with_processes_it_parked_ahead(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    rid = f"it-warmspare-{uuid.uuid4().hex[:6]}"
    log = stack.log_dir / "agent-node-2.log"
    log_from = log.stat().st_size if log.exists() else 0
    await client.start_run(make_spec(prefix, spares=("node-2",), step_time=0.5), workflow_id=rid)
    await wait_until(client, rid, checkpointed)
    nodes = (*NODES, "node-2")
    await wait_until(client, rid, lambda _view: all(_waiting(stack, n, rid) for n in nodes), timeout_s=60)
    parked = {n: _waiting(stack, n, rid) for n in nodes}
    await client.inject_fault(rid, "gpu", "node-1")
    try:
        result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    finally:
        await restart_agent(stack, "node-1")  # a repaired node: the injected XID is gone
    [gpu] = result.incidents
    assert (gpu.kind, gpu.node, gpu.action) == (IncidentKind.GPU_UNHEALTHY, "node-1", Action.REPLACE_NODE), gpu
    assert (await client.status(rid)).status.nodes == ["node-0", "node-2"]
    for node in ("node-0", "node-2"):  # the spare's rank too: a process it started before the fault
        [rank] = _record(stack, node, rid).ranks
        assert rank.pid in parked[node], (node, rank, parked)
    assert "1 from parked processes" in log.read_bytes()[log_from:].decode(errors="replace")
    assert result.final_state_digest == baseline.final_state_digest
    assert live_rank_pids(stack) == []
    assert not [pid for pids in parked.values() for pid in pids if start_time(pid) is not None], "nothing parked left"


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
