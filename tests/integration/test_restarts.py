"""Restarts of the control plane cost nothing: an agent or the whole dev stack stopped gracefully and started
again a few seconds later, mid-training. The run waits for its agents, relaunches on the same nodes and ends
with the digest of the undisturbed run: no node cordoned, no spare used, no pause."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import IncidentKind, RunResult

from .conftest import RUN_TIMEOUT_S, checkpointed, make_spec, wait_until

GAP_S = 3.0
"""Between stopping and starting again: long enough that a relaunch not waiting for the agent would miss it."""


async def _restarted(client: TrainguardClient, stack: DevStack, prefix: str, baseline: RunResult,
                     components: list[str] | None, kind: str) -> RunResult:
    spec = make_spec(prefix, every=10, step_time=0.25, spares=("node-2",))
    rid = await client.start_run(spec, workflow_id=f"it-{kind}-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=12))
    if components is None:
        await asyncio.to_thread(stack.down, lambda _line: None)
    else:
        await asyncio.to_thread(stack.stop, components, lambda _line: None)
    await asyncio.sleep(GAP_S)
    await asyncio.to_thread(stack.up, lambda _line: None)

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    status = (await client.status(rid)).status
    assert status.nodes == ["node-0", "node-1"] and status.spares == ["node-2"], result.incidents
    assert status.phase.value == "completed" and status.cordoned == []
    assert {n.node: n.cordoned for n in await client.nodes() if n.cordoned} == {}
    assert {i.kind for i in result.incidents} <= {IncidentKind.AGENT_RESTART}, result.incidents
    assert result.final_state_digest == baseline.final_state_digest
    return result


async def test_an_agent_restarted_mid_run_costs_no_node_and_no_spare(
        client: TrainguardClient, stack: DevStack, prefix: str, baseline: RunResult) -> None:
    result = await _restarted(client, stack, prefix, baseline, ["agent-node-1"], "agentrestart")
    [incident] = result.incidents
    assert incident.node == "node-1" and incident.recovery_s is not None


# The whole stack (Temporal, the store, the controller and every agent) down and up again: about 45 s, in
# `make test-slow`; the agent's restart above keeps the case in `make test`.
@pytest.mark.slow
async def test_the_whole_stack_restarted_mid_run_costs_no_node_and_no_spare(
        client: TrainguardClient, stack: DevStack, prefix: str, baseline: RunResult) -> None:
    await _restarted(client, stack, prefix, baseline, None, "stackrestart")
