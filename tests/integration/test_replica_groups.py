"""Replica groups under TorchFT (examples/ft.json: 3 groups of 1 node x 2 ranks, 1 spare): a fault in one group
recovers that group only, while the others step on, and the relaunched group heals from a live peer.

A stack of its own with four nodes (the session's has three), so the session's stack is left alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from activities.checkpoint_layout import shard_objects
from activities.store_reads import read_manifest
from infra.harness import ADDRESS_ENV, PrivateStack, kept_logs_dir, live_rank_pids
from trainguard import procs
from trainguard.client import RunView, TrainguardClient, load_spec
from trainguard.devstack import DevStack
from trainguard.models import Action, IncidentKind
from trainguard.settings import Settings
from trainguard.state_digest import state_digest

from .conftest import REPO, wait_until

NODES = ("node-0", "node-1", "node-2", "node-3")
STEPS = 600
MAX_GAP_S = 2.0
"""The issue's bound on a healthy group's longest pause between two steps while another group recovers."""
STEP_LINE = re.compile(r"^step (\d+) at ([\d.]+)$", re.MULTILINE)
DIGEST_LINE = re.compile(r"finished \d+ steps, loss \S+, digest (\w+)")


@pytest.fixture(scope="module")
async def ft_stack() -> AsyncIterator[DevStack]:
    home = REPO / ".pytest-stack" / f"ft-{uuid.uuid4().hex[:8]}"
    private = PrivateStack(home, NODES, 29300, env={ADDRESS_ENV: os.environ.get(ADDRESS_ENV)},
                           keep_logs=kept_logs_dir(home))
    try:
        yield await asyncio.to_thread(private.start)
    finally:
        await asyncio.to_thread(private.stop)
    assert not private.leftovers, f"processes survived dev down: {private.leftovers}"


def rank_logs(stack: DevStack, run_id: str, group: int) -> dict[tuple[str, int], list[str]]:
    """(node, attempt) -> the text of each rank's log there, for one group's run."""
    found: dict[tuple[str, int], list[str]] = {}
    for log in sorted(stack.home.glob(f"nodes/*/runs/{run_id}-group-{group}/attempt-*/logs/rank-*.log")):
        node, attempt = log.parents[4].name, int(log.parents[1].name.split("-")[1])
        found.setdefault((node, attempt), []).append(log.read_text(errors="replace"))
    return found


def steps(text: str) -> list[tuple[int, float]]:
    return [(int(step), float(at)) for step, at in STEP_LINE.findall(text)]


def longest_gap(text: str) -> float:
    taken = steps(text)
    return max((b - a for (_, a), (_, b) in zip(taken, taken[1:])), default=0.0)


def group_ready(view: RunView, group: int, attempt: int, min_step: int) -> bool:
    if len(view.groups) <= group:
        return False
    status = view.groups[group]
    ranks = [s for s in view.groups[group].rank_steps.values() if s is not None]
    return status.status.attempt == attempt and len(ranks) == 2 and min(ranks) >= min_step


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

    # The groups that were not failing stepped throughout; the failed ones rejoined ahead of their checkpoint.
    crashed_at = {i.group: i.resumed_step for i in result.incidents}
    logs = {g: rank_logs(ft_stack, rid, g) for g in range(3)}
    assert sorted(logs[0]) == [("node-0", 1), ("node-3", 2)] and sorted(logs[1]) == [("node-1", 1), ("node-1", 2)]
    for group, attempts in logs.items():
        for (node, attempt), texts in attempts.items():
            for text in texts:
                assert longest_gap(text) <= MAX_GAP_S, (group, node, attempt, longest_gap(text))
    for text in logs[2][("node-2", 1)]:  # one attempt that steps on to the last step (a step it sat out, it heals)
        taken = [step for step, _ in steps(text)]
        assert taken[-1] == STEPS and all(a < b for a, b in zip(taken, taken[1:])), taken[-5:]
    for group, node in ((0, "node-3"), (1, "node-1")):
        for text in logs[group][(node, 2)]:
            first = steps(text)[0][0]
            assert first > (crashed_at[group] or 0) + 1, f"group {group} resumed at {first}: not healed from a peer"

    # Every rank of every group ends on the same parameters, and the final checkpoint loads with plain torch.
    finals = [DIGEST_LINE.findall(t) for g, n, a in ((0, "node-3", 2), (1, "node-1", 2), (2, "node-2", 1))
              for t in logs[g][(n, a)]]
    assert len(finals) == 6 and len({d[-1] for d in finals if d}) == 1, finals
    s3 = ft_stack.s3()
    manifest = read_manifest(s3, "trainguard", result.final_checkpoint.manifest_key)
    assert manifest is not None and manifest.step == STEPS
    name, obj = next((n, o) for shard in manifest.shards for n, o in shard_objects(shard) if n.endswith(".pt"))
    s3.download_file("trainguard", obj.key, str(tmp_path / "rank.pt"))
    state = torch.load(tmp_path / "rank.pt", weights_only=False)  # the run's own file (it holds a numpy RNG state)
    assert state_digest(state["model"]) == finals[0][-1]

    # Nothing outlives the run: no rank, no lighthouse.
    assert live_rank_pids(ft_stack.home) == []
    lighthouse = ft_stack.home / "nodes" / "node-3" / "lighthouses" / rid / "state.json"
    assert lighthouse.exists()
    assert procs.start_time(json.loads(lighthouse.read_text())["pid"]) is None
