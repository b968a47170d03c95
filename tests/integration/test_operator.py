"""What an operator meets first: a failing script's own traceback as the run's reason, and errors that say
what happened (issue 17)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.errors import describe_error
from trainguard.models import Action, IncidentKind

from .conftest import REPO, RUN_TIMEOUT_S, checkpointed, make_spec, wait_until


async def test_a_script_that_raises_at_step_10_stops_after_two_attempts_with_its_traceback(
        client: TrainguardClient, stack: DevStack, prefix: str) -> None:
    spec = make_spec(prefix, steps=60, every=20, nodes=("node-0",))  # one rank: two attempts' imports only
    spec["entrypoint"] += ["--raise-at-step", "10"]
    logs_before = _log_sizes(stack)
    rid = await client.start_run(spec, workflow_id=f"it-sameerr-{uuid.uuid4().hex[:6]}")

    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)

    status = (await client.status(rid)).status
    assert status.attempt == 2, status.incidents
    crashes = [i for i in status.incidents if i.kind is IncidentKind.CRASH]
    assert [i.action for i in crashes] == [Action.RESTART, Action.STOP]
    last = crashes[-1]
    assert "ValueError: deliberate failure at step 10" in last.detail
    assert last.log_path and Path(last.log_path).is_file()  # the dev stack's nodes share this machine's disk
    assert "Traceback (most recent call last)" in last.log_tail
    # `run logs`: the rank's own output, read by its node's agent.
    log = await client.rank_log(rid, rank=last.rank, tail_bytes=4096)
    assert (log.node, log.attempt) == (last.node, 2) and "ValueError: deliberate failure at step 10" in log.text
    shown = await asyncio.to_thread(_cli, stack, "run", "logs", rid)
    assert shown.returncode == 0 and "ValueError: deliberate failure at step 10" in shown.stdout, shown
    message = describe_error(failed.value)
    assert "the same failure on 2 attempts in a row" in message
    assert "train.py" in message and "ValueError: deliberate failure at step 10" in message
    assert "Workflow execution failed" not in message
    # Issue 17: every incident used to log "Task exception was never retrieved ... Activity cancelled".
    noise = [line for line in _log_lines_since(stack, logs_before) if "never retrieved" in line]
    assert not noise, noise


def _log_sizes(stack: DevStack) -> dict[Path, int]:
    return {log: log.stat().st_size for log in stack.log_dir.glob("*.log")}


def _log_lines_since(stack: DevStack, sizes: dict[Path, int]) -> list[str]:
    """What the stack's processes (controller, agents) logged since `sizes` was taken."""
    lines: list[str] = []
    for log in stack.log_dir.glob("*.log"):
        with log.open("rb") as file:
            file.seek(sizes.get(log, 0))
            lines += [f"{log.name}: {line}" for line in file.read().decode(errors="replace").splitlines()]
    return lines


def _cli(stack: DevStack, *argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a user in another shell runs it: only TRAINGUARD_HOME says which stack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["TRAINGUARD_HOME"] = str(stack.home)
    return subprocess.run([sys.executable, "-m", "trainguard.cli", *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


async def test_the_cli_reaches_the_stack_its_home_names_and_prints_a_failed_runs_cause(
        stack: DevStack, prefix: str, tmp_path: Path) -> None:
    spec = make_spec(prefix)
    spec["entrypoint"] = ["/bin/sh", "-c", "true"]  # not on the dev pool's --allow list
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    rid = f"it-cli-cause-{uuid.uuid4().hex[:6]}"

    started = await asyncio.to_thread(_cli, stack, "run", "start", str(path), "--id", rid, "--wait")

    assert started.returncode == 1, started
    assert started.stdout.strip() == rid
    assert "warning: no controller" not in started.stderr  # the stack's controller polls
    assert started.stderr.startswith("trainguard: the run failed: "), started.stderr
    assert "is not allowed on node node-" in started.stderr and "Workflow execution failed" not in started.stderr
    listed = await asyncio.to_thread(_cli, stack, "run", "list")
    assert rid in listed.stdout, listed

    # The same id again: it says what it will do, and the new run's checkpoints are its own.
    again = await asyncio.to_thread(_cli, stack, "run", "start", str(path), "--id", rid, "--wait")
    assert f"run id {rid} was used by an earlier run (failed): this run starts fresh" in again.stderr, again
    client = await TrainguardClient.connect()
    [history] = (await client.histories(rid))[:1]
    scheduled = [e.activity_task_scheduled_event_attributes for e in history.events
                 if e.HasField("activity_task_scheduled_event_attributes")]
    finds = [json.loads(a.input.payloads[0].data) for a in scheduled if a.activity_type.name == "find_checkpoint"]
    assert finds and all(f["run_prefix"].startswith(f"{prefix}/{rid}.") for f in finds), finds


@pytest.mark.slow
async def test_a_dev_stack_restarted_mid_run_completes_and_leaves_no_node_cordoned(
        client: TrainguardClient, stack: DevStack, prefix: str) -> None:
    """The whole stack stops and starts while a run trains: its agents register again healthy, so a
    heartbeat timeout that fires afterwards must not cordon a node every later run then refuses."""
    spec = make_spec(prefix, steps=100, every=10, step_time=0.1, spares=("node-2",))
    rid = await client.start_run(spec, workflow_id=f"it-restack-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, checkpointed)

    await asyncio.to_thread(stack.down, lambda _line: None)
    await asyncio.to_thread(stack.up, lambda _line: None)

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert result.steps_completed == 100, result.incidents
    cordoned = {n.node: n.cordoned for n in await client.nodes() if n.cordoned}
    assert cordoned == {}, result.incidents



@pytest.fixture
async def gone_node(client: TrainguardClient, stack: DevStack) -> AsyncIterator[str]:
    """A node that registered once, labelled zone=b, and whose agent is gone: it sorts before every live node,
    so a choice by count meets it first, and must pass it over. Drained (out of the pool) afterwards."""
    from activities.nodes import register_node

    await register_node(client.client, "a-gone", "127.0.0.1", True, labels={"zone": "b"}, token=stack.peer_token())
    yield "a-gone"
    await client.drain_pool_node("a-gone")


async def test_a_cordoned_named_node_gets_a_spare_chosen_by_label_past_a_silent_node(
        client: TrainguardClient, prefix: str, gone_node: str) -> None:
    labels = {n.node: n.labels for n in await client.nodes()}
    assert labels["node-0"] == {"zone": "a"} and labels["node-2"] == {"zone": "b"}  # from the agents' --label
    await client.cordon("node-1", reason="fan failure")
    try:
        rid = await client.start_run(make_spec(prefix, steps=20, every=10, num_spares=1, node_selector={"zone": "b"}),
                                     workflow_id=f"it-spare-at-start-{uuid.uuid4().hex[:6]}")
        view = await wait_until(client, rid, lambda v: v.status.phase.value == "running")
        assert view.status.nodes == ["node-0", "node-2"]  # node-2 in node-1's place; a-gone passed over
        assert view.status.replaced_at_start == {"node-1": "node-2"} and "node-1" in view.status.cordoned
        assert (await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)).steps_completed == 20
    finally:
        await client.uncordon("node-1")
    assert all(n.leased_to is None for n in await client.nodes())


@pytest.mark.slow
async def test_a_run_by_count_trains_on_nodes_the_pool_chose_by_label(
        client: TrainguardClient, prefix: str, gone_node: str) -> None:
    spec = make_spec(prefix, steps=20, every=10)
    del spec["nodes"], spec["spare_nodes"]
    rid = await client.start_run({**spec, "num_nodes": 2, "num_spares": 1, "node_selector": {"zone": "b"}},
                                 workflow_id=f"it-bycount-{uuid.uuid4().hex[:6]}")
    with pytest.raises(WorkflowFailureError) as failed:  # one live zone=b node: too few, said at once
        await asyncio.wait_for(client.result(rid), 60)
    assert "num_nodes 2: the pool has 1 schedulable node matching node_selector zone=b" in str(failed.value.cause)
    rid = await client.start_run({**spec, "num_nodes": 2, "num_spares": 1, "node_selector": {"zone": "a"}},
                                 workflow_id=f"it-bycount-{uuid.uuid4().hex[:6]}")
    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    status = (await client.status(rid)).status
    assert status.nodes == ["node-0", "node-1"] and result.steps_completed == 20
