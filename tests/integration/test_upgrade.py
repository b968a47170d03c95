"""Controller upgrades with worker versioning (docs/operations/upgrades.md).

`test_a_run_finishes_on_its_build_while_new_runs_start_on_the_promoted_one`: the default way, on a private
dev stack of its own. Build A is this checkout, versioned by default (its id derived from the workflow code);
build B is a copy of it with a changed `TrainingRun`, started beside it as a controller of its own and promoted
with the one command (`trainguard controller promote`, run from B's code). A run started on A finishes on A;
the next run starts and finishes on B, with A stopped.

`test_an_upgrade_keeps_runs_on_their_build_and_moves_the_pool`: what that command does, step by step. Two
controller builds run in this process (`build_worker` with `TRAINGUARD_BUILD_ID` v1, then v2) on the real
`trainguard` task queue of a dev server of this test's own. The operator's steps are run with the `temporal`
CLI, as typed:

    temporal worker deployment set-current-version --deployment-name trainguard-controller --build-id v2 --yes
    temporal workflow list --query "TemporalWorkerDeploymentVersion = 'trainguard-controller:v1' AND ExecutionStatus = 'Running'"
    temporal workflow update-options --workflow-id trainguard-node-pool --versioning-override-behavior auto_upgrade

Which build ran what is read from the histories (each `WorkflowTaskCompleted` names the worker's deployment
version), not from the server's bookkeeping alone. No node agent or torch is needed: a run that waits for an
unregistered node keeps taking workflow tasks (every 2 s) until its reserve timeout, and a bad spec fails at
its first task.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import VersioningBehavior
from temporalio.api.workflowservice.v1 import DescribeWorkflowExecutionRequest
from temporalio.client import Client, WorkflowFailureError
from temporalio.worker import Worker

from activities.nodes import pool_handle, register_node
from infra import harness
from trainguard import TASK_QUEUE, WORKFLOW_TYPE, node_task_queue
from trainguard.client import TrainguardClient
from trainguard.connect import connect
from trainguard.devstack import DevStack
from trainguard.ports import Ports, free_port_base
from trainguard.settings import Settings
from trainguard.versioning import CODE_PACKAGES, current_build, derived_build_id, poller_build, running_on
from workers.controller import build_worker
from trainguard import POOL_WORKFLOW_ID

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TEMPORAL = str(Path(sys.executable).parent / "temporal")
DEPLOYMENT = "trainguard-controller"
ON_V1 = f"TemporalWorkerDeploymentVersion = '{DEPLOYMENT}:v1' AND ExecutionStatus = 'Running'"
"""The operator's query for what still runs on the old build (the attribute's value is `deployment:build`)."""
BAD_SPEC = {"nodes": []}
WAITING_NODE = "node-upgrade"
"""A node with an 'agent' (a poller on its queue) that never registers in the pool: the run waits for it."""
RESERVE_TIMEOUT_S = 12
ROUTING_S = 15.0
"""Bound on how long a new current version (or an override) takes to reach the task routing: ~0-3 s here."""


NODES = ("node-0", "node-1")
RUN_TIMEOUT_S = 120


@activity.defn(name="noop")
async def _noop() -> None:  # the fake node agent's only activity: it only has to poll the node's queue
    return None


class _Server:
    """`temporal server start-dev` on free ports, in memory, stopped by PID."""

    def __init__(self) -> None:
        self.home = REPO / ".pytest-stack" / f"upgrade-{uuid.uuid4().hex[:8]}"
        self.ports = Ports.from_base(free_port_base(28500, num_nodes=0))
        self.address = f"127.0.0.1:{self.ports.temporal}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.home.mkdir(parents=True)
        ports = self.ports
        with (self.home / "temporal.log").open("ab") as log:
            self.proc = subprocess.Popen([
                TEMPORAL, "server", "start-dev", "--ip", "127.0.0.1", "--port", str(ports.temporal),
                "--ui-port", str(ports.ui), "--http-port", str(ports.http), "--metrics-port", str(ports.server_metrics),
                "--ui-disable-news-fetch", "--log-level", "warn",
            ], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        shutil.rmtree(self.home, ignore_errors=True)

    async def cli(self, *args: str) -> str:
        """The operator's command, in a thread: the controllers in this process keep polling meanwhile."""
        done = await asyncio.to_thread(subprocess.run, [TEMPORAL, *args, "--address", self.address],
                                       capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, f"temporal {' '.join(args)}: {done.stderr or done.stdout}"
        return done.stdout


@pytest.fixture
async def server() -> AsyncIterator[tuple[_Server, Client]]:
    private = _Server()
    try:
        private.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                client = await connect(Settings.from_env({"TRAINGUARD_TEMPORAL_ADDRESS": private.address}))
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        yield private, client
    finally:
        private.stop()


async def _versioning(client: Client, workflow_id: str) -> tuple[str, int, int]:
    """(build the execution is on, its behavior, the override's behavior) as the server describes it."""
    described = await client.workflow_service.describe_workflow_execution(DescribeWorkflowExecutionRequest(
        namespace=client.namespace, execution=WorkflowExecution(workflow_id=workflow_id)))
    info = described.workflow_execution_info.versioning_info
    return info.deployment_version.build_id, info.behavior, info.versioning_override.behavior


async def _task_builds(client: Client, workflow_id: str) -> list[str]:
    """The build of the worker that completed each workflow task of the execution, in order."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return [event.workflow_task_completed_event_attributes.deployment_version.build_id or "unversioned"
            for event in history.events if event.HasField("workflow_task_completed_event_attributes")]


async def _running_on_v1(server: _Server) -> set[str]:
    out = await server.cli("workflow", "list", "--query", ON_V1, "--output", "json")
    return {row["execution"]["workflowId"] for row in _json_rows(out)}


def _json_rows(out: str) -> list[dict[str, Any]]:
    out = out.strip()
    if not out:
        return []
    try:
        parsed = json.loads(out)
        return parsed if isinstance(parsed, list) else [parsed]
    except json.JSONDecodeError:  # one object per line
        return [json.loads(line) for line in out.splitlines() if line.strip()]


async def _set_current(server: _Server, build_id: str) -> None:
    """The operator's step. Refused until the build's workers have polled: retried for that long only."""
    deadline = time.monotonic() + ROUTING_S
    while True:
        try:
            await server.cli("worker", "deployment", "set-current-version", "--deployment-name", DEPLOYMENT,
                       "--build-id", build_id, "--yes")
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def _start_controller(stack: AsyncExitStack, client: Client, build_id: str) -> None:
    settings = Settings.from_env({"TRAINGUARD_BUILD_ID": build_id})
    await stack.enter_async_context(build_worker(client, task_queue=TASK_QUEUE, settings=settings))


async def test_an_upgrade_keeps_runs_on_their_build_and_moves_the_pool(server: tuple[_Server, Client]) -> None:
    private, client = server
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(Worker(client, task_queue=node_task_queue(WAITING_NODE), activities=[_noop]))

        # The first versioned build: nothing runs until it is made current (new runs go to unversioned workers).
        await _start_controller(stack, client, "v1")
        early = await client.start_workflow(WORKFLOW_TYPE, BAD_SPEC, id="early", task_queue=TASK_QUEUE)
        await asyncio.sleep(1.0)
        assert await _task_builds(client, "early") == []
        await _set_current(private, "v1")
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(early.result(), ROUTING_S)
        assert getattr(failed.value.cause, "type", None) == "InvalidSpec"
        assert await _task_builds(client, "early") == ["v1"]

        # The pool and a run, both started on v1, are pinned there.
        await pool_handle(client)
        await register_node(client, "node-a", "127.0.0.1", True)
        spec = {"entrypoint": ["python", "train.py"], "nodes": [WAITING_NODE], "reserve_timeout_s": RESERVE_TIMEOUT_S}
        old = await client.start_workflow(WORKFLOW_TYPE, spec, id="old-run", task_queue=TASK_QUEUE)
        await _wait(lambda: _task_builds(client, "old-run"), lambda builds: len(builds) >= 2)
        for workflow_id in ("old-run", POOL_WORKFLOW_ID):
            assert await _versioning(client, workflow_id) == ("v1", VersioningBehavior.VERSIONING_BEHAVIOR_PINNED, 0)

        # The upgrade: v2 polls, then becomes current. New runs go to v2; the old run and the pool stay on v1.
        await _start_controller(stack, client, "v2")
        await _set_current(private, "v2")
        before = len(await _task_builds(client, "old-run"))
        new = await client.start_workflow(WORKFLOW_TYPE, BAD_SPEC, id="new-run", task_queue=TASK_QUEUE)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(new.result(), ROUTING_S)
        assert await _task_builds(client, "new-run") == ["v2"]
        assert (await _versioning(client, "new-run"))[0] == "v2"
        await register_node(client, "node-b", "127.0.0.1", True)
        assert (await _task_builds(client, POOL_WORKFLOW_ID))[-1] == "v1"  # pinned: not moved by itself
        assert await _running_on_v1(private) == {"old-run", POOL_WORKFLOW_ID}

        # The operator moves the pool: its next workflow task runs on v2.
        await private.cli("workflow", "update-options", "--workflow-id", POOL_WORKFLOW_ID,
                    "--versioning-override-behavior", "auto_upgrade")

        async def pool_builds_after_a_register() -> list[str]:
            await register_node(client, f"node-{uuid.uuid4().hex[:4]}", "127.0.0.1", True)
            return await _task_builds(client, POOL_WORKFLOW_ID)

        await _wait(pool_builds_after_a_register, lambda builds: builds[-1] == "v2")
        build, _, override = await _versioning(client, POOL_WORKFLOW_ID)
        assert (build, override) == ("v2", VersioningBehavior.VERSIONING_BEHAVIOR_AUTO_UPGRADE)
        assert await _running_on_v1(private) == {"old-run"}

        # The old run keeps taking tasks on v1 (its pool leases now served by v2) until it ends there.
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(old.result(), RESERVE_TIMEOUT_S + ROUTING_S)
        assert getattr(failed.value.cause, "type", None) == "NodesUnavailable"
        builds = await _task_builds(client, "old-run")
        assert len(builds) > before and set(builds) == {"v1"}, builds
        assert await _running_on_v1(private) == set()  # v1 has nothing left to run: its workers may stop


async def _wait(probe: Any, done: Any, timeout_s: float = ROUTING_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"not reached within {timeout_s}s: {value}"
        await asyncio.sleep(0.3)


# ------------------------------------------------------------------------------ the default way, end to end
@pytest.fixture
def versioned_stack() -> Iterator[DevStack]:
    """A dev stack of this test's own: its controller (build A) is made current by `up`, with nothing set."""
    home = REPO / ".pytest-stack" / f"versions-{uuid.uuid4().hex[:8]}"
    with harness.PrivateStack(home, NODES, 27900, keep_logs=harness.kept_logs_dir(home)) as dev:
        yield dev


def _build_b(dest: Path) -> Path:
    """This checkout's code with a harmless change to `TrainingRun`: another build of the same workflows."""
    for package in CODE_PACKAGES:
        shutil.copytree(REPO / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    source = dest / "workflows" / "training_run.py"
    text = source.read_text()
    assert "class TrainingRun" in text
    source.write_text(text.replace("class TrainingRun", "# build B: TrainingRun changed\nclass TrainingRun", 1))
    return dest


async def _task_builds_of_run(client: TrainguardClient, workflow_id: str) -> set[str]:
    """The builds that completed the workflow tasks of the run and of its node groups' child workflows."""
    return {event.workflow_task_completed_event_attributes.deployment_version.build_id or "unversioned"
            for history in await client.histories(workflow_id) for event in history.events
            if event.HasField("workflow_task_completed_event_attributes")}


# A whole versioned stack for one run: `make test-slow`. test_an_upgrade_keeps_runs_on_their_build_and_moves_the_pool
# keeps the upgrade's rules (pinned runs, the promoted build, the pool moving) in `make test`.
@pytest.mark.slow
async def test_a_run_finishes_on_its_build_while_new_runs_start_on_the_promoted_one(
        versioned_stack: DevStack, tmp_path: Path) -> None:
    stack = versioned_stack
    client = await TrainguardClient.connect()
    deployment = Settings.from_env().deployment
    build_a = derived_build_id()
    assert (await current_build(client.client, deployment))[0] == build_a  # a first deploy: no run waits

    # Build B starts beside A. It polls, and takes nothing: a later build never makes itself current.
    code_b = _build_b(tmp_path / "build-b")
    build_b = derived_build_id(code_b)
    assert build_b != build_a
    env_b = {**stack.worker_env(), "TRAINGUARD_MANIFEST_KEY": stack.manifest_key()}
    with (tmp_path / "controller-b.log").open("ab") as log:
        controller_b = subprocess.Popen([sys.executable, "-m", "workers.controller"], cwd=code_b, env=env_b,
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
    try:
        await _wait(lambda: poller_build(client.client, f"{controller_b.pid}@"), lambda seen: seen[0],
                    timeout_s=60)
        assert (await poller_build(client.client, f"{controller_b.pid}@")) == (True, build_b)
        assert (await current_build(client.client, deployment))[0] == build_a

        old = await client.start_run(harness.make_spec(f"old-{uuid.uuid4().hex[:6]}", steps=80, nodes=("node-0",)),
                                     workflow_id=f"old-{uuid.uuid4().hex[:6]}")
        await _wait(lambda: running_on(client.client, deployment, build_a), lambda ids: old in ids)

        # The one command, run from B's code: B is current, the pool moves, the old run is named.
        promoted = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "trainguard.cli", "controller", "promote"], cwd=code_b,
            env={**os.environ, **stack.client_env()}, capture_output=True, text=True, timeout=60, check=False)
        assert promoted.returncode == 0, promoted.stderr
        assert f"{build_b} is current (was {build_a})" in promoted.stdout, promoted.stdout
        assert f"still running on {build_a}" in promoted.stdout and old in promoted.stdout, promoted.stdout
        assert (await client.status(old)).execution_status == "RUNNING"  # promoted while the old run ran

        new = await client.start_run(harness.make_spec(f"new-{uuid.uuid4().hex[:6]}", nodes=("node-1",)),
                                     workflow_id=f"new-{uuid.uuid4().hex[:6]}")
        old_result = await asyncio.wait_for(client.result(old), RUN_TIMEOUT_S)
        assert old_result.steps_completed == 80
        assert await _task_builds_of_run(client, old) == {build_a}  # the run and its node groups, all on A

        # A has nothing left to run: it stops, and B alone finishes the new run.
        assert await running_on(client.client, deployment, build_a) == []
        await asyncio.to_thread(stack.stop, ["controller"], lambda _line: None)
        new_result = await asyncio.wait_for(client.result(new), RUN_TIMEOUT_S)
        assert new_result.steps_completed == 60
        assert await _task_builds_of_run(client, new) == {build_b}
        assert (await _task_builds(client.client, POOL_WORKFLOW_ID))[-1] == build_b
    finally:
        if controller_b.poll() is None:
            os.killpg(controller_b.pid, signal.SIGTERM)
            try:
                controller_b.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(controller_b.pid, signal.SIGKILL)
                controller_b.wait(5)
