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
from trainguard.models import Action, Incident, IncidentKind, RunResult
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


# ~80 s with its fault-free run: `make test-slow`. In `make test`, the two-replica test below takes the same path
# on the real stack (fingerprints through the store, the committer's comparison, the rollback, the cordon, the
# fault-free digest); tests/unit/test_sdc_decisions.py tables the majority's verdict.
@pytest.mark.slow
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


async def test_with_two_replicas_a_one_off_flip_is_told_apart_by_the_replay_and_cordoned(
        client: TrainguardClient, baseline: RunResult, stack: DevStack, prefix: str) -> None:
    # Two nodes of one DDP rank each: two replicas, so a difference is a tie. The run rolls back, and its replay
    # (the fault-free run) tells them apart: node-1's loss went wrong a step before node-0's, or node-0's state is
    # the one the replay reaches. node-1 is named, cordoned and replaced, with no second fault needed. The step
    # time changes how long the job takes, not its state: it ends as the session's fault-free baseline did.
    rid = await client.start_run(make_spec(prefix, spares=("node-2",), step_time=0.1),
                                 workflow_id=run_id("tie-once"))
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=20))
    await client.inject_fault(rid, "bitflip", "node-1")
    try:
        result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
        status = (await client.status(rid)).status
    finally:
        await client.uncordon("node-1")
    tie, named = [i for i in result.incidents if i.kind is IncidentKind.SILENT_DATA_CORRUPTION]
    assert tie.node is None and tie.action is Action.RESTART and "no majority" in tie.cause, tie
    assert (named.node, named.rank, named.action) == ("node-1", 1, Action.REPLACE_NODE), named
    assert "node-1 computes wrong" in named.cause and named.attempt == tie.attempt + 1, named
    assert status.cordoned == ["node-1"] and status.nodes == ["node-0", "node-2"]
    assert result.final_state_digest == baseline.final_state_digest


def named_after_a_tie(incidents: list[Incident], node: str) -> Incident:
    """A sick GPU's ties, as the run tells them apart: its replay settles it (the replay's own flip came after the
    step it is compared at), or the fault comes back, the node is set aside, and not seen since. Either way the
    last incident names `node`."""
    tie, *between, named = [i for i in incidents if i.kind is IncidentKind.SILENT_DATA_CORRUPTION]
    assert tie.node is None and tie.action is Action.RESTART and "no majority" in tie.cause, tie
    if between:
        [swapped] = between
        assert (swapped.node, swapped.action) == (node, Action.REPLACE_NODE) and "to tell which" in swapped.cause
        assert (named.node, named.action, named.decision) == (node, Action.REPORT, f"{node} cordoned"), named
    else:
        assert (named.node, named.action) == (node, Action.REPLACE_NODE), named
    assert f"{node} computes wrong" in named.cause, named
    return named


# ~40 s: `make test-slow`; the one-off tie above takes the same first path in `make test`, and
# tests/unit/test_sdc_decisions.py tables the path of a tie that comes back.
@pytest.mark.slow
async def test_with_two_replicas_a_sick_gpu_is_told_apart_and_cordoned(
        client: TrainguardClient, baseline: RunResult, stack: DevStack, prefix: str) -> None:
    # node-1's GPU is sick: it flips a bit in every attempt, the replay's included.
    rid = await client.start_run(make_spec(prefix, spares=("node-2",), step_time=0.1),
                                 workflow_id=run_id("tie"))
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=20))
    await client.inject_fault(rid, "bitflip", "node-1", recurring=True)
    try:
        result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
        status = (await client.status(rid)).status
    finally:
        await client.uncordon("node-1")
        await restart_agent(stack, "node-1")  # a fresh agent: its GPU is well again
    named_after_a_tie(result.incidents, "node-1")
    assert status.cordoned == ["node-1"] and status.nodes == ["node-0", "node-2"]
    assert result.final_state_digest == baseline.final_state_digest


# ~40 s: `make test-slow`; the workflow unit tests (tests/unit/test_sdc_decisions.py) keep the numerical fault's
# decisions in `make test`.
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


# ------------------------------------------------------------------------------ a Hugging Face Llama, DDP and HSDP
def llama(prefix: str, entrypoint: list[str]) -> dict[str, object]:
    return {"entrypoint": entrypoint, "nodes": ["node-0", "node-1"], "spare_nodes": ["node-2"], "ranks_per_node": 2,
            "checkpoint": {"prefix": prefix, "every_steps": 10, "keep_last": 2},
            "health": {"hang_floor_s": 10.0}}


LLAMA_DDP = ["python", "examples/train_lm.py", "--parallel", "ddp", "--steps", "80", "--step-time", "0.1"]
HSDP = ["python", "examples/recipes/hsdp.py", "--step-time", "0.1"]


async def flipped_and_finished(client: TrainguardClient, stack: DevStack, prefix: str, entrypoint: list[str],
                               kind: str, recurring: bool = False) -> tuple[RunResult, RunResult]:
    """The job without a fault and the same job with a bit flipped on node-1's first rank after its first commit
    (`recurring`: and once in every later attempt on node-1, a sick GPU)."""
    base = await asyncio.wait_for(client.result(await client.start_run(
        llama(f"{prefix}-base", entrypoint), workflow_id=run_id(f"{kind}-base"))), RUN_TIMEOUT_S)
    rid = await client.start_run(llama(prefix, entrypoint), workflow_id=run_id(kind))
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=12), timeout_s=180)
    await client.inject_fault(rid, "bitflip", "node-1", recurring=recurring)
    try:
        return base, await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    finally:
        await client.uncordon("node-1")
        if recurring:
            await restart_agent(stack, "node-1")


# ~2 min each on 2 cores (a Llama's imports on 8 ranks): `make test-slow`.
@pytest.mark.slow
async def test_a_llama_under_ddp_flipped_on_node_1_is_named_and_rolled_back_to_its_fault_free_digest(
        client: TrainguardClient, stack: DevStack, prefix: str) -> None:
    base, result = await flipped_and_finished(client, stack, prefix, LLAMA_DDP, "llama-ddp")
    [incident] = [i for i in result.incidents if i.kind is IncidentKind.SILENT_DATA_CORRUPTION]
    assert (incident.node, incident.rank, incident.action) == ("node-1", 2, Action.REPLACE_NODE), incident
    assert result.final_state_digest == base.final_state_digest


@pytest.mark.slow
async def test_hsdp_compares_each_shard_across_its_two_replicas_and_rolls_back_to_the_fault_free_digest(
        client: TrainguardClient, stack: DevStack, prefix: str) -> None:
    # 2 replicas x 2 shards: node-0 holds replica 0 (ranks 0, 1), node-1 replica 1 (ranks 2, 3). A bit flipped in
    # rank 2's shard makes shard 0's two replicas differ; with two, no majority names one, so both are suspects.
    # The run rolls back, and its replay tells them apart: node-1 is named, cordoned and replaced.
    base, result = await flipped_and_finished(client, stack, prefix, HSDP, "hsdp")
    tie, named = [i for i in result.incidents if i.kind is IncidentKind.SILENT_DATA_CORRUPTION]
    assert "rank 0 (node-0), rank 2 (node-1)" in tie.cause and "shard 0/2" in tie.cause, tie
    assert tie.node is None and tie.action is Action.RESTART
    assert (named.node, named.rank, named.action) == ("node-1", 2, Action.REPLACE_NODE), named
    assert "node-1 computes wrong" in named.cause
    assert result.final_state_digest == base.final_state_digest


@pytest.mark.slow
async def test_hsdp_tells_a_sick_gpu_apart_and_cordons_it(client: TrainguardClient, stack: DevStack,
                                                          prefix: str) -> None:
    # node-1's GPU is sick: it flips a bit in every attempt, the replay's included.
    base, result = await flipped_and_finished(client, stack, prefix, HSDP, "hsdp-sick", recurring=True)
    named_after_a_tie(result.incidents, "node-1")
    assert result.final_state_digest == base.final_state_digest
