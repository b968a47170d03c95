"""Restarts of the control plane cost nothing (issue 28): the controller, every agent, Temporal, SeaweedFS, each
alone and all together, stopped gracefully and started again after a gap of 0, 5 or 30 s, mid-training or
mid-commit. The run waits for what it needs, relaunches on the same nodes if it must and ends by itself with the
digest of the undisturbed run: no node cordoned, no spare used, no pause."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from infra import harness
from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import IncidentKind, RunResult
from trainguard.protocol import RunLayout

from .conftest import RUN_TIMEOUT_S, NODES, checkpointed, make_spec, wait_until

GAP_S = 3.0
"""The agent's restart: between stopping and starting again, long enough that a relaunch not waiting for the
agent would miss it."""

LATE_GAP_S = 14.0
"""An agent back after its run's launching watches timed out waiting for it (`NODE_SCHEDULE_TO_START`, 10 s)
but within the check that asks it (10 s more): the restart matrix saw 13 s at load 16."""

BIG_HIDDEN = 1536
"""The mid-commit cases' trainer width: shards of about 30 MB a rank (weights and Adam's moments), so
uploading a checkpoint takes a while the restart can land in."""

BUCKET = "trainguard"


async def _finished_undisturbed(client: TrainguardClient, rid: str, baseline: RunResult,
                                allowed: frozenset[IncidentKind] = frozenset({IncidentKind.AGENT_RESTART})) -> RunResult:
    """The run ends by itself as if nothing happened: its nodes and spare kept, nothing cordoned, no pause, no
    incident but the `allowed` kinds."""
    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    status = (await client.status(rid)).status
    assert status.nodes == ["node-0", "node-1"] and status.spares == ["node-2"], result.incidents
    assert status.phase.value == "completed" and status.cordoned == []
    assert {n.node: n.cordoned for n in await client.nodes() if n.cordoned} == {}
    assert {i.kind for i in result.incidents} <= allowed, result.incidents
    assert result.final_state_digest == baseline.final_state_digest
    return result


# Slow (make test-slow): `make test` stays under 15 minutes on 2 cores; the chaos soak kills the same component.
@pytest.mark.slow
async def test_an_agent_restarted_mid_run_costs_no_node_and_no_spare(
        client: TrainguardClient, stack: DevStack, prefix: str, baseline: RunResult) -> None:
    spec = make_spec(prefix, every=10, step_time=0.25, spares=("node-2",))
    rid = await client.start_run(spec, workflow_id=f"it-agentrestart-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=12))
    await asyncio.to_thread(stack.stop, ["agent-node-1"], lambda _line: None)
    await asyncio.sleep(GAP_S)
    await asyncio.to_thread(stack.up, lambda _line: None)
    result = await _finished_undisturbed(client, rid, baseline)
    [incident] = result.incidents
    assert incident.node == "node-1" and incident.recovery_s is not None


@pytest.mark.parametrize("gap_s", [pytest.param(GAP_S, id="back-in-3s"),
                                   pytest.param(LATE_GAP_S, id="back-in-14s", marks=pytest.mark.slow)])
async def test_an_agent_killed_as_its_run_launches_costs_no_node_and_no_spare(
        client: TrainguardClient, stack: DevStack, prefix: str, baseline: RunResult, gap_s: float) -> None:
    """The 60-minute soak's case: an agent SIGKILLed in its run's first second, as the launching watches start,
    and started again 3 s later; or 14 s later, as on a loaded machine, past its launching watch's 10 s
    schedule-to-start. Its watch times out on its heartbeat (maybe before its first one) or is never started;
    its node is asked, answers, and is watched (or launches) again: the run keeps its nodes and its spare. Its
    ranks may not survive an agent killed as it starts them: a crash, relaunched on the same nodes, is allowed."""
    spec = make_spec(prefix, every=10, step_time=0.25, spares=("node-2",))
    rid = await client.start_run(spec, workflow_id=f"it-launchkill-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: v.status.phase.value in ("launching", "running"), timeout_s=60)
    pid = stack.status()["agent-node-1"]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(gap_s)
    await asyncio.to_thread(stack.up, lambda _line: None)
    await _finished_undisturbed(client, rid, baseline,
                                allowed=frozenset({IncidentKind.AGENT_RESTART, IncidentKind.CRASH}))


# ------------------------------------------------------------------------------------- the restart matrix
TARGETS: dict[str, list[str] | None] = {
    "controller": ["controller"],
    "agents": [f"agent-{n}" for n in NODES],
    "temporal": ["temporal"],
    "seaweedfs": ["s3"],
    "all": None,  # `dev down`: every agent, the controller, the store, Temporal
}


@dataclass(frozen=True)
class Case:
    target: str
    gap_s: int
    moment: str
    """mid-training (a checkpoint committed, training on) or mid-commit (a checkpoint saved on the nodes,
    its manifest not yet in the store)."""

    @property
    def id(self) -> str:
        return f"{self.target}-gap{self.gap_s}-{self.moment}"


FAST_CASE = Case("controller", 0, "mid-training")
"""The one matrix case in `make test` (about 20 s); the agent's restart and its kill at launch above are the
others."""
CASES = [Case(t, g, m) for t in TARGETS for g in (0, 5, 30) for m in ("mid-training", "mid-commit")]


def _param(case: Case) -> Any:
    return pytest.param(case, id=case.id, marks=() if case == FAST_CASE else (pytest.mark.slow,))


class BigBaseline:
    """The mid-commit cases' job with no fault, run once, by the first case that needs it."""

    def __init__(self) -> None:
        self.result: RunResult | None = None

    async def get(self, client: TrainguardClient) -> RunResult:
        if self.result is None:
            spec = make_spec(f"bigbase-{uuid.uuid4().hex[:6]}", every=10, hidden=BIG_HIDDEN)
            run_id = await client.start_run(spec, workflow_id=f"it-bigbase-{uuid.uuid4().hex[:6]}")
            self.result = await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
        return self.result


@pytest.fixture(scope="module")
def big_baseline() -> BigBaseline:
    return BigBaseline()


def _committing_step(stack: DevStack, rid: str, prefix: str, s3: Any) -> int | None:
    """A step saved on a node whose manifest is not yet in the store: a commit in flight."""
    layout = RunLayout.of(harness.nodes_dir(stack.home) / "node-0", rid)
    saved = sorted(int(p.name.removeprefix("step-")) for p in layout.checkpoint_dir.glob("step-*")
                   if p.name.removeprefix("step-").isdigit())
    if not saved:
        return None
    try:
        s3.head_object(Bucket=BUCKET, Key=f"{prefix}/{rid}/step-{saved[-1]:08d}/manifest.json")
        return None
    except Exception:  # noqa: BLE001 - a 404: not committed yet
        return saved[-1]


async def _wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = await asyncio.to_thread(predicate)
        if found:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not seen within {timeout_s}s")


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
async def test_a_restart_costs_nothing(client: TrainguardClient, stack: DevStack, prefix: str,
                                       baseline: RunResult, big_baseline: BigBaseline, case: Case) -> None:
    mid_commit = case.moment == "mid-commit"
    expected = await big_baseline.get(client) if mid_commit else baseline
    for node in await client.nodes():  # a case failed before this one may have cordoned it: start clean
        if node.cordoned:
            await client.uncordon(node.node)
    spec = make_spec(prefix, every=10, step_time=0.25, spares=("node-2",),
                     **({"hidden": BIG_HIDDEN} if mid_commit else {}))
    rid = await client.start_run(spec, workflow_id=f"it-restart-{case.id}-{uuid.uuid4().hex[:6]}")
    try:
        await _restart_and_finish(client, stack, prefix, rid, case, expected)
    finally:
        with contextlib.suppress(Exception):  # failed: free its nodes for the next case
            if await client.running(rid):
                await client.abort(rid, "the test is over")


async def _restart_and_finish(client: TrainguardClient, stack: DevStack, prefix: str, rid: str, case: Case,
                              expected: RunResult) -> None:
    mid_commit = case.moment == "mid-commit"
    if mid_commit:
        # Past the first commit, so the restart lands in a commit with one before it to resume from.
        await wait_until(client, rid, lambda v: v.status.latest_checkpoint is not None)
        s3 = stack.s3()
        await _wait_for(lambda: (_committing_step(stack, rid, prefix, s3) or 0) > 10, 120, "a commit in flight")
    else:
        await wait_until(client, rid, lambda v: checkpointed(v, min_step=12))

    components = TARGETS[case.target]
    if components is None:
        await asyncio.to_thread(stack.down, lambda _line: None)
    else:
        await asyncio.to_thread(stack.stop, components, lambda _line: None)
    await asyncio.sleep(case.gap_s)
    await asyncio.to_thread(stack.up, lambda _line: None)

    await _finished_undisturbed(client, rid, expected)
