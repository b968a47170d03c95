"""Replica groups under TorchFT (examples/ft.json: 3 groups of 1 node x 2 ranks, 1 spare): a fault in one group
recovers that group only, while the others step on, and the relaunched group heals from a live peer.

A stack of its own with four nodes (the session's has three), so the session's stack is left alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

from activities.checkpoint_layout import shard_objects
from activities.store_reads import read_manifest
from infra.harness import live_rank_pids
from trainguard import procs
from trainguard.client import TrainguardClient, load_spec
from trainguard.devstack import DevStack
from trainguard.models import Action, IncidentKind
from trainguard.settings import Settings
from trainguard.state_digest import state_digest

from .conftest import REPO, own_stack, wait_until
from .ft_logs import DIGEST_LINE, check_groups, group_ready, rank_logs

NODES = ("node-0", "node-1", "node-2", "node-3")
STEPS = 600


@pytest.fixture(scope="module")
async def ft_stack() -> AsyncIterator[DevStack]:
    async with own_stack("ft", NODES, 29300) as dev:
        yield dev


async def test_a_crash_and_a_lost_node_recover_their_groups_while_the_others_step_on(
        ft_stack: DevStack, tmp_path: Path) -> None:
    client = await TrainguardClient.connect(Settings.from_env({**os.environ, **ft_stack.client_env()}))
    spec = load_spec(REPO / "examples" / "ft.json")
    spec = spec.model_copy(update={
        "entrypoint": ["python", "examples/train_ft.py", "--steps", str(STEPS), "--step-time", "0.05",
                       "--log-steps"],
        "checkpoint": spec.checkpoint.model_copy(update={"prefix": f"ft-{uuid.uuid4().hex[:8]}"})})
    rid = await client.start_run(spec, workflow_id=f"it-ft-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: all(group_ready(v, g, 1, 60) for g in range(3)), timeout_s=180)
    await client.inject_fault(rid, "crash", "node-1")  # group 1
    await wait_until(client, rid, lambda v: group_ready(v, 1, 2, 1), timeout_s=120)
    await client.inject_fault(rid, "node-down", "node-0")  # group 0, whose spare is node-3
    result = await asyncio.wait_for(client.result(rid), 400)
    view = await client.status(rid)

    # Each fault is an incident of its own group, recovered there: the crash in place, the lost node on the spare.
    assert result.steps_completed == STEPS and result.final_checkpoint is not None, result
    found = {(i.group, i.kind, i.node, i.action) for i in result.incidents}
    assert found == {(1, IncidentKind.CRASH, "node-1", Action.RESTART),
                     (0, IncidentKind.NODE_UNRESPONSIVE, "node-0", Action.REPLACE_NODE)}, result.incidents
    assert [g.status.nodes for g in view.groups] == [["node-3"], ["node-1"], ["node-2"]]
    assert [g.status.attempt for g in view.groups] == [2, 2, 1]  # group 2 never stopped
    assert "node-0" in {n.node for n in await client.nodes() if n.cordoned}

    # The groups that were not failing stepped throughout; the failed ones rejoined ahead of their checkpoint; every
    # rank ends on the same parameters, and the final checkpoint loads with plain torch.
    digest = check_groups(ft_stack.home, rid, result, STEPS)
    s3 = ft_stack.s3()
    manifest = read_manifest(s3, "trainguard", result.final_checkpoint.manifest_key)
    assert manifest is not None and manifest.step == STEPS
    _, obj = next((n, o) for shard in manifest.shards for n, o in shard_objects(shard) if n.endswith(".pt"))
    s3.download_file("trainguard", obj.key, str(tmp_path / "rank.pt"))
    state = torch.load(tmp_path / "rank.pt", weights_only=False)  # the run's own file (it holds a numpy RNG state)
    assert state_digest(state["model"]) == digest

    # Nothing outlives the run: no rank, no lighthouse.
    assert live_rank_pids(ft_stack.home) == []
    lighthouse = ft_stack.home / "nodes" / "node-3" / "lighthouses" / rid / "state.json"
    assert lighthouse.exists()
    assert procs.start_time(json.loads(lighthouse.read_text())["pid"]) is None


async def test_a_cancelled_run_stops_every_group_and_its_lighthouse(ft_stack: DevStack) -> None:
    client = await TrainguardClient.connect(Settings.from_env({**os.environ, **ft_stack.client_env()}))
    spec = load_spec(REPO / "examples" / "ft.json")
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"prefix": f"ft-{uuid.uuid4().hex[:8]}"})})
    rid = await client.start_run(spec, workflow_id=f"it-ft-cancel-{uuid.uuid4().hex[:6]}")
    view = await wait_until(client, rid, lambda v: all(group_ready(v, g, 1, 5) for g in range(3)), timeout_s=180)
    await client.cancel(rid)
    with pytest.raises(WorkflowFailureError):
        await asyncio.wait_for(client.result(rid), 120)
    for group in view.groups:  # each group's run was cancelled, and stopped its ranks on the way out
        described = await client.handle(group.workflow_id).describe()
        assert described.status == WorkflowExecutionStatus.CANCELED, (group.workflow_id, described.status)
    assert live_rank_pids(ft_stack.home) == []
    state = json.loads((ft_stack.home / "nodes" / "node-3" / "lighthouses" / rid / "state.json").read_text())
    assert procs.start_time(state["pid"]) is None


@pytest.mark.slow  # a minute or more here: six ranks importing transformers, a relaunched group's import again
async def test_the_llama_ft_ddp_recipe_recovers_a_crashed_group_onto_one_digest(ft_stack: DevStack) -> None:
    """The guide's Hugging Face Llama recipe (examples/train_ft.py --model llama) in ft.json's three groups: a
    crash in group 1 relaunches that group, which heals from a live one; every rank ends on one digest."""
    client = await TrainguardClient.connect(Settings.from_env({**os.environ, **ft_stack.client_env()}))
    spec = load_spec(REPO / "examples" / "ft.json")
    spec = spec.model_copy(update={
        "entrypoint": ["python", "examples/train_ft.py", "--model", "llama", "--steps", "200", "--step-time", "0.1",
                       "--log-steps"],
        "health": spec.health.model_copy(update={"hang_floor_s": 10.0}),  # transformers' import, on a loaded machine
        "checkpoint": spec.checkpoint.model_copy(update={"prefix": f"ft-{uuid.uuid4().hex[:8]}"})})
    rid = await client.start_run(spec, workflow_id=f"it-ft-llama-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: all(group_ready(v, g, 1, 30) for g in range(3)), timeout_s=240)
    await client.inject_fault(rid, "crash", "node-1")
    result = await asyncio.wait_for(client.result(rid), 400)
    assert [(i.group, i.kind) for i in result.incidents] == [(1, IncidentKind.CRASH)], result.incidents
    finals = [DIGEST_LINE.findall(text)[-1] for group in range(3)
              for texts in rank_logs(ft_stack.home, rid, group).values() for text in texts if DIGEST_LINE.search(text)]
    assert len(finals) == 6 and set(finals) == {result.final_state_digest}, finals
