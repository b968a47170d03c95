"""One real stack per test session: Temporal dev server, SeaweedFS, a controller and three node agents.

It lives under `.pytest-stack/` (git-ignored) on its own ports, so it never meets a developer's
`trainguard dev up`, and is stopped at the end with a check that nothing it started is still running.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from infra import harness
from trainguard.client import RunView, TrainguardClient
from trainguard.models import RunResult
from trainguard.devstack import DevStack

REPO = Path(__file__).resolve().parents[2]
NODES = ("node-0", "node-1", "node-2")
NODE_LABELS = {"node-0": {"zone": "a"}, "node-1": {"zone": "a"}, "node-2": {"zone": "b"}}
"""What the stack's agents register with (`--label`), for specs that choose nodes by `node_selector`."""
RUN_TIMEOUT_S = 240


HISTORIES = REPO / "tests" / "histories"
CHILD_HISTORY_KINDS = ("it-base", "it-crash", "it-nodedown", "it-hang", "it-can")
"""Runs whose node-group watches are recorded too: a finish, a crash, a lost node, a hang, a continue-as-new."""


async def _record_histories(address: str) -> None:
    """`TRAINGUARD_RECORD_HISTORIES=1 make integration` refreshes the histories the replay test runs: one
    closed run per kind of test (its workflow id without the random suffix), and the node pool."""
    from temporalio.client import Client

    client = await Client.connect(address)
    HISTORIES.mkdir(exist_ok=True)
    seen: set[str] = set()
    async for execution in client.list_workflows("WorkflowType = 'TrainingRun' AND ExecutionStatus != 'Running'"):
        kind = execution.id.rsplit("-", 1)[0] if execution.id.startswith("it-") else None
        if kind and kind not in seen:
            seen.add(kind)
            history = await client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history()
            (HISTORIES / f"{kind}.json").write_text(history.to_json())
    # The node groups' child workflows: one of each call kind, and the watches of a few kinds of run.
    async for execution in client.list_workflows(
            "WorkflowType IN ('NodeCalls', 'NodeGroupWatch') AND ExecutionStatus != 'Running'"):
        run_id, _, child = execution.id.partition("/")
        kind = run_id.rsplit("-", 1)[0] if run_id.startswith("it-") else None
        name = (f"calls-{child.split('-', 1)[0]}" if execution.workflow_type == "NodeCalls"
                else f"watch-{kind}" if kind in CHILD_HISTORY_KINDS else None)
        if kind and name and name not in seen:
            seen.add(name)
            history = await client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history()
            (HISTORIES / f"{name}.json").write_text(history.to_json())
    pool = await client.get_workflow_handle("trainguard-node-pool").fetch_history()
    (HISTORIES / "node-pool.json").write_text(pool.to_json())


@pytest.fixture(scope="session")
def stack() -> Iterator[DevStack]:
    home = REPO / ".pytest-stack" / uuid.uuid4().hex[:8]
    private = harness.PrivateStack(home, NODES, 27100, keep_logs=harness.kept_logs_dir(home), labels=NODE_LABELS)
    with private as dev:
        yield dev
        if os.environ.get("TRAINGUARD_RECORD_HISTORIES"):
            asyncio.run(_record_histories(private.config.temporal_address))
    leftover_socks = [s.name for port in private.config.ports.weed_grpc_ports()
                      for s in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]
    assert not private.leftovers, f"processes survived dev down: {private.leftovers}"
    assert not leftover_socks, f"files left in /tmp: {leftover_socks}"


@asynccontextmanager
async def own_stack(name: str, nodes: tuple[str, ...], port_start: int, **flags: Any) -> AsyncIterator[DevStack]:
    """A stack of a test module's own (`flags`: `PrivateStack`'s, e.g. `tls=True`), stopped after it with nothing
    left running; the session stack keeps the client's address (this one's clients are given theirs:
    `client_env`)."""
    home = REPO / ".pytest-stack" / f"{name}-{uuid.uuid4().hex[:8]}"
    private = harness.PrivateStack(home, nodes, port_start,
                                   env={harness.ADDRESS_ENV: os.environ.get(harness.ADDRESS_ENV)},
                                   keep_logs=harness.kept_logs_dir(home), **flags)
    try:
        yield await asyncio.to_thread(private.start)
    finally:
        await asyncio.to_thread(private.stop)
    assert not private.leftovers, f"processes survived dev down: {private.leftovers}"


@pytest.fixture(scope="session")
async def client(stack: DevStack) -> AsyncIterator[TrainguardClient]:
    yield await TrainguardClient.connect()


make_spec = harness.make_spec
"""A small run of the example trainer (see `infra.harness.make_spec`)."""


@pytest.fixture
def prefix() -> str:
    """Each test gets its own bucket prefix."""
    return f"test-{uuid.uuid4().hex[:10]}"


def live_rank_pids(stack: DevStack) -> list[int]:
    """Rank processes the node agents recorded that are still alive."""
    return harness.live_rank_pids(stack.home)


async def wait_until(client: TrainguardClient, run_id: str, predicate: Callable[[RunView], bool],
                     timeout_s: float = 120) -> RunView:
    """Poll the run's status until `predicate` holds; fail if the run ends first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = await client.status(run_id)
        if predicate(view):
            return view
        assert view.execution_status == "RUNNING", f"{run_id} ended early: {view.status.reason}"
        await asyncio.sleep(0.2)
    raise AssertionError(f"condition not reached within {timeout_s}s for {run_id}")


async def activity_failures(client: TrainguardClient, workflow_id: str) -> list[str]:
    """Every activity attempt of the run that failed or timed out, as `name: message`: what a failed
    assertion about the run's outcome prints, so a CI failure says why without the stack's logs."""
    found: list[str] = []
    for history in await client.histories(workflow_id):  # the run's and its node groups'
        names: dict[int, str] = {}
        for event in history.events:
            if event.HasField("activity_task_scheduled_event_attributes"):
                names[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
            for field in ("activity_task_failed_event_attributes", "activity_task_timed_out_event_attributes"):
                if event.HasField(field):
                    attributes = getattr(event, field)
                    found.append(f"{names.get(attributes.scheduled_event_id, '?')}: {attributes.failure.message}")
    return found


def checkpointed(view: RunView, min_step: int = 25) -> bool:
    """A checkpoint is committed and training has moved past it: a fault now must resume from it."""
    return view.status.phase.value == "running" and view.status.latest_checkpoint is not None \
        and view.live_step >= min_step


async def restart_agent(stack: DevStack, node: str) -> None:
    """Stop a node's agent (if it still runs) and start a fresh one, as an operator would."""
    await asyncio.to_thread(stack.restart, f"agent-{node}", lambda _line: None)


@pytest.fixture(scope="session")
async def baseline(client: TrainguardClient, stack: DevStack) -> RunResult:
    """The small job with no fault: every recovered run of the same job must end identical to it."""
    run_id = await client.start_run(make_spec(f"baseline-{uuid.uuid4().hex[:6]}"),
                                    workflow_id=f"it-base-{uuid.uuid4().hex[:8]}")
    return await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)


def history_text(history: Any) -> str:
    """A history as JSON with every payload's data decoded next to it: payloads are base64 in the JSON, so a
    plain search of it finds no secret whether or not one is there."""
    raw = history.to_json()
    decoded: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("data"), str) and "metadata" in node:
                decoded.append(base64.b64decode(node["data"]).decode(errors="replace"))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(raw))
    return raw + "\n".join(decoded)
