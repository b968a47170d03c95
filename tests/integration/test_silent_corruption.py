"""Training that computes wrong without crashing, on the real stack: the quickstart's shape (two nodes of two DDP
ranks, a spare), a bit flipped in one rank's parameters and a NaN loss, each rolled back to a checkpoint before it
and ending bit-identical to the same job run without a fault."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import Action, IncidentKind, RunResult
from trainguard.numerics import DEFAULT_FINGERPRINT_EVERY_STEPS

from .conftest import RUN_TIMEOUT_S, checkpointed, make_spec, restart_agent, wait_until

STEPS = 240
"""About 12 s of steps at 0.05 s: a fault injected after the first commit is found long before the end."""


def quickstart(prefix: str) -> dict[str, object]:
    return make_spec(prefix, steps=STEPS, every=20, ranks_per_node=2, spares=("node-2",))


def run_id(kind: str) -> str:
    return f"it-{kind}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
async def fault_free(client: TrainguardClient) -> RunResult:
    """The same job with no fault: its digest is what every recovered run must end with."""
    rid = await client.start_run(quickstart(f"sdc-base-{uuid.uuid4().hex[:6]}"), workflow_id=run_id("sdc-base"))
    return await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)


async def test_chaos_bitflip_on_node_1_is_found_cordoned_and_rolled_back_to_the_fault_free_digest(
        client: TrainguardClient, fault_free: RunResult, stack: DevStack, prefix: str) -> None:
    rid = await client.start_run(quickstart(prefix), workflow_id=run_id("bitflip"))
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=30))
    # As a user types it: through the CLI, the run's workflow and node-1's agent to its first rank.
    trainguard = str(Path(sys.executable).with_name("trainguard"))
    chaos = subprocess.run([trainguard, "chaos", "bitflip", "--run", rid, "--node", "node-1"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert chaos.returncode == 0, chaos.stderr
    try:
        result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
        status = (await client.status(rid)).status
    finally:
        await client.uncordon("node-1")
        await restart_agent(stack, "node-1")
    corrupt = [i for i in result.incidents if i.kind is IncidentKind.SILENT_DATA_CORRUPTION]
    assert len(corrupt) == 1, result.incidents
    incident = corrupt[0]
    assert (incident.node, incident.rank, incident.action) == ("node-1", 2, Action.REPLACE_NODE), incident
    assert status.cordoned == ["node-1"] and "node-2" in status.nodes
    # Found within two fingerprint intervals of the flip, the step the rank's helper printed when it flipped.
    log = (await client.rank_log(rid, node="node-1", rank=2, attempt=incident.attempt)).text
    flipped = int(re.search(r"flipped a bit at step (\d+)", log).group(1))  # type: ignore[union-attr]
    found = int(re.search(r"at step (\d+)", incident.cause).group(1))  # type: ignore[union-attr]
    assert flipped < found <= flipped + 2 * DEFAULT_FINGERPRINT_EVERY_STEPS, (flipped, incident.cause)
    assert incident.detection_s is not None and incident.detection_s < 10
    assert incident.resumed_step is not None and incident.resumed_step <= flipped
    assert result.final_state_digest == fault_free.final_state_digest


# ~40 s: `make test-slow`; the bitflip test above keeps the quickstart's Done-when in `make test`, and the workflow
# unit tests (tests/unit/test_sdc_decisions.py) keep the numerical fault's decisions there.
@pytest.mark.slow
async def test_chaos_nan_is_a_numerical_fault_rolled_back_to_the_fault_free_digest(
        client: TrainguardClient, fault_free: RunResult, prefix: str) -> None:
    rid = await client.start_run(quickstart(prefix), workflow_id=run_id("nan"))
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=30))
    await client.inject_fault(rid, "nan", "node-1")
    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    numerical = [i for i in result.incidents if i.kind is IncidentKind.NUMERICAL_FAULT]
    assert len(numerical) == 1, result.incidents
    incident = numerical[0]
    assert (incident.node, incident.rank, incident.action) == ("node-1", 2, Action.RESTART), incident
    assert "loss is nan" in incident.detail
    assert incident.bad_step is not None and incident.resumed_step is not None
    assert incident.resumed_step < incident.bad_step
    assert (await client.status(rid)).status.cordoned == []  # a numerical fault blames no hardware
    assert result.final_state_digest == fault_free.final_state_digest
