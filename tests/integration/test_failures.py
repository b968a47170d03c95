"""Every failure class from the field, injected through the node agents into live runs on the real stack.

Each recovered run must end bit-identical to the same job run without a fault (the `baseline`).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import Action, IncidentKind, Phase, RunResult

from .conftest import RUN_TIMEOUT_S, checkpointed, live_rank_pids, make_spec, restart_agent, wait_until


def run_id(kind: str) -> str:
    return f"it-{kind}-{uuid.uuid4().hex[:6]}"


# `make test-slow`; the workflow unit test of a persistent straggler keeps the decision in `make test`.
@pytest.mark.slow
async def test_straggler_is_reported_then_replaced_by_a_spare_when_it_persists(
    client: TrainguardClient, baseline: RunResult, prefix: str
) -> None:
    spec = make_spec(prefix, every=10, spares=("node-2",), health={"hang_floor_s": 5.0, "straggler_windows": 2})
    rid = await client.start_run(spec, workflow_id=run_id("straggler"))
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=12))
    await client.inject_fault(rid, "slow", "node-1", slow_duty=0.8)

    try:
        result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    finally:
        await client.uncordon("node-1")  # the operator has looked at the slow node
    stragglers = [i for i in result.incidents if i.kind is IncidentKind.STRAGGLER]
    assert [i.action for i in stragglers] == [Action.REPORT, Action.REPLACE_NODE], result.incidents
    assert {(i.node, i.rank) for i in stragglers} == {("node-1", 1)}
    status = (await client.status(rid)).status
    assert status.nodes == ["node-0", "node-2"]
    assert result.final_state_digest == baseline.final_state_digest


# `make test-slow`; the workflow unit tests of node faults (gpu among them) keep the decision in `make test`.
@pytest.mark.slow
async def test_gpu_fault_cordons_the_node_and_a_spare_takes_over(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    rid = await client.start_run(make_spec(prefix, spares=("node-2",)), workflow_id=run_id("gpu"))
    await wait_until(client, rid, checkpointed)
    await client.inject_fault(rid, "gpu", "node-1")
    try:
        result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    finally:
        await restart_agent(stack, "node-1")  # a repaired node: the injected XID is gone
    gpu = [i for i in result.incidents if i.kind is IncidentKind.GPU_UNHEALTHY]
    assert gpu and gpu[0].node == "node-1" and gpu[0].action is Action.REPLACE_NODE
    assert "XID" in gpu[0].detail
    assert gpu[0].detection_s is not None and gpu[0].detection_s < 5
    assert (await client.status(rid)).status.cordoned == ["node-1"]
    # The spare restored rank 1's shard from node-1 itself (its disk is fine, its GPU is not): the peer
    # tier, verified against the manifest; node-0 read its own copy.
    assert gpu[0].restore_tier == "local+peer", gpu[0]
    assert result.final_state_digest == baseline.final_state_digest


# `make test-slow`; the workflow unit test of a lost node without a spare keeps the pause in `make test`.
@pytest.mark.slow
async def test_lost_node_without_spare_pauses_for_an_operator_then_resumes(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    rid = await client.start_run(make_spec(prefix), workflow_id=run_id("nodedown"))
    await wait_until(client, rid, checkpointed)
    await client.inject_fault(rid, "node-down", "node-1")
    try:
        view = await wait_until(client, rid, lambda v: v.status.phase is Phase.PAUSED, timeout_s=60)
        assert "no spare" in (view.status.reason or "")
    finally:
        await restart_agent(stack, "node-1")  # the operator brings the node back
    await client.resume(rid, reason="node-1 rebooted")

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    lost = [i for i in result.incidents if i.kind is IncidentKind.NODE_UNRESPONSIVE]
    assert lost and lost[0].node == "node-1" and lost[0].action is Action.PAUSE
    assert result.final_state_digest == baseline.final_state_digest


# About a minute: `make test-slow` (the shrink and grow-back decisions have workflow unit tests, and the
# sharded-state runs shrink and grow back real FSDP2 ranks).
@pytest.mark.slow
async def test_lost_node_without_spare_shrinks_to_min_nodes_then_grows_back_when_it_returns(
    client: TrainguardClient, prefix: str, stack: DevStack
) -> None:
    spec = make_spec(prefix, steps=100, every=10, step_time=0.2, min_nodes=1)
    rid = await client.start_run(spec, workflow_id=run_id("shrink"))
    await wait_until(client, rid, checkpointed)
    await client.inject_fault(rid, "node-down", "node-1")
    try:
        shrunk = await wait_until(client, rid, lambda v: v.status.world_size == 1 and v.live_step > 0, timeout_s=90)
        assert (shrunk.status.nodes, shrunk.status.cordoned) == (["node-0"], ["node-1"])
        await restart_agent(stack, "node-1")  # the repaired node registers healthy: the pool has it again
        result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    finally:
        await client.uncordon("node-1")  # whatever happened, later tests need the node
    lost = [i for i in result.incidents if i.kind is IncidentKind.NODE_UNRESPONSIVE]
    assert [(i.node, i.action) for i in lost] == [("node-1", Action.SHRINK)], result.incidents
    assert lost[0].detection_s is not None and lost[0].resumed_step is not None
    status = (await client.status(rid)).status
    assert (status.nodes, status.world_size, status.cordoned) == (["node-0", "node-1"], 2, [])
    # Down to one rank (shard 0 of the two-rank checkpoint), then back to two at a checkpoint boundary
    # (rank 1 restoring the one-rank checkpoint's shard); the job finished on both nodes.
    assert result.attempts == 3
    assert result.steps_completed == 100
    assert result.final_checkpoint is not None
    assert (result.final_checkpoint.step, result.final_checkpoint.world_size) == (100, 2)
    assert live_rank_pids(stack) == []


# `make test-slow`: tests/integration/test_checkpoints.py keeps every kind of damage in `make test`.
@pytest.mark.slow
async def test_chaos_corrupt_checkpoint_from_the_cli_makes_the_restore_fall_back(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    rid = await client.start_run(make_spec(prefix, every=30, step_time=0.2), workflow_id=run_id("corrupt"))
    view = await wait_until(client, rid, checkpointed)
    assert view.status.latest_checkpoint is not None
    trainguard = str(Path(sys.executable).parent / "trainguard")
    env = {**os.environ, "TRAINGUARD_TEMPORAL_ADDRESS": stack.config.temporal_address}
    chaos = subprocess.run([trainguard, "chaos", "corrupt-checkpoint", "--run", rid, "--node", "node-1"],
                           capture_output=True, text=True, timeout=60, env=env)
    assert chaos.returncode == 0, chaos.stderr
    corrupted = int(chaos.stdout.split("checkpoint step ")[1].split()[0])  # "...rank 1's shard of checkpoint step 20"
    assert "rank 1's shard" in chaos.stdout
    await client.inject_fault(rid, "crash", "node-0")

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    kinds = [i.kind for i in result.incidents]
    assert kinds[:2] == [IncidentKind.CRASH, IncidentKind.CHECKPOINT_CORRUPT], result.incidents
    assert f"step {corrupted}" in result.incidents[1].detail and "sha256" in result.incidents[1].detail
    assert result.incidents[0].resumed_step is not None and result.incidents[0].resumed_step < corrupted
    assert result.final_state_digest == baseline.final_state_digest


# `make test-slow`: a timing case on top of the crash recoveries `make test` runs on the real stack.
@pytest.mark.slow
async def test_second_crash_while_recovering_from_the_first(
    client: TrainguardClient, baseline: RunResult, prefix: str
) -> None:
    rid = await client.start_run(make_spec(prefix), workflow_id=run_id("double"))
    await wait_until(client, rid, checkpointed)
    await client.inject_fault(rid, "crash", "node-1")
    # Attempt 2 is launched and its ranks are starting (importing torch, restoring): crash one again.
    await wait_until(client, rid, lambda v: v.status.attempt == 2 and v.status.phase is Phase.RUNNING)
    await client.inject_fault(rid, "crash", "node-0")

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    crashes = [i for i in result.incidents if i.kind is IncidentKind.CRASH]
    assert [(i.node, i.attempt) for i in crashes[:2]] == [("node-1", 1), ("node-0", 2)], result.incidents
    assert result.attempts >= 3
    assert result.final_state_digest == baseline.final_state_digest


async def test_operator_pause_and_resume_from_the_temporal_cli(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    rid = await client.start_run(make_spec(prefix), workflow_id=run_id("pause"))
    await wait_until(client, rid, checkpointed)
    temporal = str(Path(sys.executable).parent / "temporal")
    subprocess.run([temporal, "workflow", "update", "execute", "--workflow-id", rid, "--name", "pause",
                    "--input", '{"reason": "maintenance"}', "--address", stack.config.temporal_address],
                   check=True, capture_output=True, timeout=30)
    view = await wait_until(client, rid, lambda v: v.status.phase is Phase.PAUSED, timeout_s=60)
    assert view.rank_steps == {}  # no rank runs while paused
    await client.resume(rid)

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert result.incidents == []
    assert result.final_state_digest == baseline.final_state_digest
