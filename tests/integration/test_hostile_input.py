"""Issue 27's findings about hostile input, each reproduced on the real stack: a start input, a run id, a spec
value or a rank's own file that once cordoned a healthy node, skipped the pool, wedged a run or confused the CLI.

Each test here failed on the build the review tried. The generated hostile specs are in `test_bad_input`; finding
9 (`TRAINGUARD_CHAOS=OFF`) is read by the node agent's own parser, in `tests/unit/test_node_agent_flags.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from trainguard import TASK_QUEUE, WORKFLOW_TYPE
from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import Action, IncidentKind, Phase, RunStatus
from trainguard.protocol import RunLayout, step_dir_name
from workflows.run_state import RunState

from .conftest import REPO, RUN_TIMEOUT_S, checkpointed, history_text, make_spec, wait_until

REFUSED_AT_ONCE_S = 30
"""A run refused before it acts fails in its first workflow task: well under a second on an idle stack."""
POOL_FREE_WAIT_S = 60
"""A test before may have just repaired a node or be releasing its lease."""


def _cli(stack: DevStack, *argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a user in another shell runs it: only TRAINGUARD_HOME says which stack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["TRAINGUARD_HOME"] = str(stack.home)
    return subprocess.run([sys.executable, "-m", "trainguard.cli", *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


async def _pool(client: TrainguardClient) -> dict[str, tuple[str | None, str | None]]:
    """Each node's (cordon reason, lessee)."""
    return {n.node: (n.cordoned, n.leased_to) for n in await client.nodes()}


async def _wait_pool_free(client: TrainguardClient, *nodes: str) -> None:
    deadline = time.monotonic() + POOL_FREE_WAIT_S
    while [n for n in nodes if (pool := await _pool(client))[n] != (None, None)]:
        assert time.monotonic() < deadline, pool
        await asyncio.sleep(0.5)


async def _fails_at_once(client: TrainguardClient, raw_input: Any, workflow_id: str) -> ApplicationError:
    """Start `TrainingRun` as `temporal workflow start` would (no client checks), and its typed failure."""
    handle = await client.client.start_workflow(WORKFLOW_TYPE, raw_input, id=workflow_id, task_queue=TASK_QUEUE)
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(handle.result(), REFUSED_AT_ONCE_S)  # before the fix some ran forever
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidSpec", cause
    history = history_text(await handle.fetch_history())
    # Refused before it acted: no node found, leased or launched on, no watch group started.
    assert not [a for a in ("acquire_nodes", "find_node_agents", "launch_ranks", "NodeGroupWatch") if a in history]
    return cause


# ---------------------------------------------------------------------------------- finding 1: working_dir
async def test_a_working_dir_the_os_cannot_look_up_fails_the_run_not_the_node(
        client: TrainguardClient, prefix: str) -> None:
    """Finding 1: `Path.is_dir()` raised ENAMETOOLONG for a 300-character folder name, which the launch took as
    the node's fault: node-0 cordoned, the spare spent, the run paused."""
    await _wait_pool_free(client, "node-0", "node-1")
    before = await _pool(client)
    spec = make_spec(prefix, nodes=("node-0",), spares=("node-1",), working_dir="/tmp/" + "w" * 300)
    rid = await client.start_run(spec, workflow_id=f"it-longdir-{uuid.uuid4().hex[:6]}")

    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(client.result(rid), 60)
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidSpec", cause
    assert "working_dir" in cause.message and "File name too long" in cause.message, cause.message
    status = (await client.status(rid)).status
    assert status.phase is Phase.FAILED  # not paused for an operator
    assert (status.attempt, status.incidents, status.cordoned, status.nodes) == (1, [], [], ["node-0"])
    assert await _pool(client) == before  # nothing cordoned, every lease given back


# ------------------------------------------------------------------------------ finding 2: a rank's own files
# Slow (make test-slow): `make test` stays under 15 minutes on 2 cores; the chaos soak kills the same component.
@pytest.mark.slow
async def test_a_ranks_own_step_entries_do_not_stop_its_relaunch(
        client: TrainguardClient, prefix: str, stack: DevStack) -> None:
    """Finding 2: a `step-<non-digits>` entry in the rank's checkpoint folder made the next launch raise in
    `_drop_uncommitted_shards` (`int('latest')`): the node was cordoned, the spare spent, the crash unrecorded."""
    await _wait_pool_free(client, "node-0", "node-1", "node-2")
    spec = make_spec(prefix, steps=40, every=10, spares=("node-2",))
    rid = await client.start_run(spec, workflow_id=f"it-steplink-{uuid.uuid4().hex[:6]}")
    view = await wait_until(client, rid, lambda v: checkpointed(v, min_step=12), timeout_s=90)
    assert view.status.latest_checkpoint is not None
    folder = RunLayout.of(stack.home / "nodes" / "node-0", rid).checkpoint_dir
    latest = folder / "step-latest"
    latest.symlink_to(folder / step_dir_name(view.status.latest_checkpoint.step))  # as a rank would keep one
    (folder / "step-xyz").mkdir()
    (folder / "step-xyz" / "notes.txt").write_text("the rank's own")
    await client.inject_fault(rid, "crash", "node-0")

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert result.steps_completed == 40
    crashes = [i for i in result.incidents if i.kind is IncidentKind.CRASH]
    assert [(i.node, i.action) for i in crashes] == [("node-0", Action.RESTART)], result.incidents
    status = (await client.status(rid)).status
    assert (status.nodes, status.cordoned) == (["node-0", "node-1"], [])  # the spare never moved in
    assert not [n for n, (cordoned, _) in (await _pool(client)).items() if cordoned]
    assert latest.is_symlink() and (folder / "step-xyz" / "notes.txt").exists()  # the rank's, left alone


# ------------------------------------------------------------------------ finding 3: state only continue-as-new
def _carried(nodes: list[str]) -> dict[str, Any]:
    """What a run carries across continue-as-new, claiming ranks already launched on `nodes` and leased."""
    status = RunStatus(phase=Phase.RUNNING, attempt=1, nodes=nodes, world_size=len(nodes))
    return RunState(status=status, leased=True, launched=True).model_dump(mode="json")


async def test_a_start_input_carrying_state_is_refused_before_it_reaches_the_pool(
        client: TrainguardClient, prefix: str, stack: DevStack) -> None:
    """Finding 3: `{"spec": ..., "carried": ...}` from whoever starts the run skipped the reservation, so ranks
    ran on an operator-cordoned node and on a node leased to another run; a malformed `carried` left the run
    Running forever."""
    await _wait_pool_free(client, "node-0", "node-1", "node-2")
    await client.cordon("node-2", reason="issue 27 finding 3")
    try:
        spec = make_spec(prefix, nodes=("node-0",))
        cases = {
            "cordoned": {"spec": spec, "carried": _carried(["node-2"])},
            "unnamed": {"spec": spec, "carried": _carried(["node-1"])},  # a node the spec never named
            "malformed": {"spec": spec, "carried": {"status": {"attempt": "many"}, "leased": [1]}},
            "null": {"spec": spec, "carried": None},
            "extra": {"spec": spec, "carried": _carried(["node-0"]), "nodes": ["node-2"]},
        }
        ids = {name: f"it-carried-{uuid.uuid4().hex[:6]}" for name in cases}
        causes = await asyncio.gather(*(_fails_at_once(client, raw, ids[name]) for name, raw in cases.items()))
        for name, cause in zip(cases, causes, strict=True):
            assert "carried" in cause.message, (name, cause.message)
        pool = await _pool(client)
        assert pool["node-2"] == ("issue 27 finding 3", None), pool  # the operator's cordon stands
        assert not [n for n, (_, lessee) in pool.items() if lessee in ids.values()], pool
        for node in ("node-0", "node-1", "node-2"):
            for rid in ids.values():
                assert not RunLayout.of(stack.home / "nodes" / node, rid).root.exists(), (node, rid)
    finally:
        await client.uncordon("node-2")


# --------------------------------------------------------------------------------------- finding 11: run ids
BAD_IDS = ["bad-id-..-{}", "/X-{}", "bad-id-\x1b[2J-{}", "bad-id-\n-{}", "bad-id/{}/.."]
"""A run id names the run's folder on every node and its namespace in the store. Not `it-` ids: the history
recorder turns an `it-` id into a file name."""


async def test_run_ids_that_cannot_name_a_folder_are_refused_before_anything_starts(
        client: TrainguardClient, prefix: str, stack: DevStack, tmp_path: Path) -> None:
    """Finding 11: an id with `..` wedged a finished run (the store refused its uploads, it stayed Running with its
    nodes leased); `/X` wrote into another run's folder. The client and the CLI refuse them before they start
    anything, and the workflow refuses them itself when started straight through Temporal."""
    spec = make_spec(prefix, nodes=("node-0",))
    for pattern in BAD_IDS:
        workflow_id = pattern.format(uuid.uuid4().hex[:6])
        with pytest.raises(ValueError, match=r"run id .* choose an id"):
            await client.start_run(spec, workflow_id=workflow_id)
        with pytest.raises(RPCError) as missing:
            await client.client.get_workflow_handle(workflow_id).describe()
        assert missing.value.status is RPCStatusCode.NOT_FOUND, workflow_id

    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    cli_id = f"bad-id-..-{uuid.uuid4().hex[:6]}"
    started = await asyncio.to_thread(_cli, stack, "run", "start", str(path), "--id", cli_id)
    assert started.returncode == 2, started
    assert started.stderr.startswith("trainguard run start --id: run id") and "'..'" in started.stderr, started
    with pytest.raises(RPCError):
        await client.client.get_workflow_handle(cli_id).describe()

    raw_ids = [pattern.format(uuid.uuid4().hex[:6]) for pattern in BAD_IDS]
    causes = await asyncio.gather(*(_fails_at_once(client, spec, workflow_id) for workflow_id in raw_ids))
    for workflow_id, cause in zip(raw_ids, causes, strict=True):
        assert cause.message.startswith("invalid workflow id: run id"), (workflow_id, cause.message)
    pool = await _pool(client)
    assert not [n for n, (_, lessee) in pool.items() if lessee in raw_ids], pool


# ------------------------------------------------------------------------------- finding 12: names matched whole
@pytest.mark.parametrize("name", ["HF_TOKEN\n", "RANK\n"])
async def test_env_names_with_a_trailing_newline_are_refused_naming_the_field(
        client: TrainguardClient, prefix: str, name: str) -> None:
    """Finding 12: Python's `$` matches before a trailing newline, so `HF_TOKEN\\n` passed the secret check (its
    value reached the history) and `RANK\\n` the reserved one. Refused by the client, and by the workflow itself
    when sent straight to Temporal (no secret value there: whoever skips the client puts it in the history)."""
    spec = make_spec(prefix, nodes=("node-0",), env={name: "tg-fuzz-secret-" + uuid.uuid4().hex})
    workflow_id = f"it-envnl-{uuid.uuid4().hex[:6]}"
    with pytest.raises(ValueError, match=re.escape(f"env.{name}")):
        await client.start_run(spec, workflow_id=workflow_id)
    with pytest.raises(RPCError):
        await client.client.get_workflow_handle(workflow_id).describe()

    spec["env"] = {name: "0"}
    cause = await _fails_at_once(client, spec, f"it-envnl-raw-{uuid.uuid4().hex[:6]}")
    assert f"env.{name}" in cause.message, cause.message


# ------------------------------------------------------------------------------------ finding 13: huge numbers
async def test_a_spec_file_with_a_huge_number_names_the_file_and_the_field(
        stack: DevStack, prefix: str, tmp_path: Path) -> None:
    """Finding 13: a number of 5,001 digits gave 'Exceeds the limit (4300 digits)', exit 1, naming neither."""
    text = json.dumps(make_spec(prefix, every=12345))
    path = tmp_path / "huge.json"
    path.write_text(text.replace('"every_steps": 12345', '"every_steps": ' + "7" * 5001))
    workflow_id = f"it-huge-{uuid.uuid4().hex[:6]}"

    started = await asyncio.to_thread(_cli, stack, "run", "start", str(path), "--id", workflow_id)

    assert started.returncode == 2, started
    assert started.stderr.strip() == f"{path}: checkpoint.every_steps: a number of 5001 digits, too large for any " \
                                     "field", started.stderr
    assert "Traceback" not in started.stderr


# ------------------------------------------------------------------- issue 40 finding 12: input that cannot decode
@pytest.mark.parametrize(("case", "expected"), [
    ("huge", "checkpoint.every_steps: a number of 5001 digits, too large for any field"),
    ("none", "the run's input is missing"),
])
async def test_input_temporal_workflow_start_cannot_decode_fails_the_run_at_once(
        client: TrainguardClient, stack: DevStack, prefix: str, tmp_path: Path, case: str, expected: str) -> None:
    """Issue 40 finding 12: a number of 5,001 digits through `temporal workflow start` failed to decode in the
    workflow task, which then failed and was retried forever: the run sat Running. No input at all did the same."""
    text = json.dumps(make_spec(prefix, every=12345)).replace('"every_steps": 12345', '"every_steps": ' + "7" * 5001)
    path = tmp_path / "huge.json"
    path.write_text(text)
    workflow_id = f"it-undecodable-{uuid.uuid4().hex[:6]}"
    temporal = Path(sys.executable).parent / "temporal"
    argv = [str(temporal), "workflow", "start", "--type", WORKFLOW_TYPE, "--task-queue", TASK_QUEUE,
            "--workflow-id", workflow_id, "--address", stack.config.temporal_address]
    started = await asyncio.to_thread(subprocess.run, [*argv, *(["--input-file", str(path)] if case == "huge" else [])],
                                      capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started

    handle = client.client.get_workflow_handle(workflow_id)
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(handle.result(), REFUSED_AT_ONCE_S)  # before the fix: Running, its task retried
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidSpec", cause
    assert expected in cause.message, cause.message
    history = history_text(await handle.fetch_history())
    assert not [a for a in ("acquire_nodes", "find_node_agents", "launch_ranks", "NodeGroupWatch") if a in history]
