"""Replay every committed workflow history against today's workflow code.

A change to a workflow's command sequence makes a replay fail with a non-determinism error, so it cannot
land unless it is guarded by `workflow.patched()`. Histories come from real runs on the dev stack:
`TRAINGUARD_RECORD_HISTORIES=1 make integration` refreshes them (only after a deliberate, patched change).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.common import RawValue
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.node_calls import NodeCalls
from workflows.node_group import NodeGroupWatch
from workflows.node_group_models import NodeCallsInput, NodeCallsResult
from workflows.node_pool import NodePool
from trainguard.models import RunResult
from workflows.training_run import TrainingRun

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("*.json"))


def _workflow_id(path: Path) -> str:
    """The recorded run's workflow id: its node groups' ids start with it, and a replay under another id would
    start children of other ids. Read from the first child it started (a run without children: any id)."""
    for event in json.loads(path.read_text())["events"]:
        started = event.get("startChildWorkflowExecutionInitiatedEventAttributes")
        if started:
            return str(started["workflowId"]).split("/", 1)[0]
    return path.stem


def test_histories_are_committed() -> None:
    assert len(HISTORIES) >= 5, "record them: TRAINGUARD_RECORD_HISTORIES=1 make integration"


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_history_replays_without_nondeterminism(path: Path) -> None:
    history = WorkflowHistory.from_json(_workflow_id(path), path.read_text())
    replayer = Replayer(workflows=[TrainingRun, NodePool, NodeCalls, NodeGroupWatch],
                        data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"


@workflow.defn(name="NodeCalls", sandboxed=False)
class _NodeCallsThatSkipTheirActivities:
    """A deliberately broken NodeCalls: it answers without calling any node."""

    @workflow.run
    async def run(self, request: NodeCallsInput) -> NodeCallsResult:
        return NodeCallsResult(outcomes=[])


async def test_a_changed_command_sequence_fails_replay() -> None:
    """The negative control: the replay suite catches a workflow that no longer does what its history did."""
    calls = [p for p in HISTORIES if p.stem.startswith("calls-")]
    assert calls, "no NodeCalls history recorded"
    history = WorkflowHistory.from_json(calls[0].stem, calls[0].read_text())
    replayer = Replayer(workflows=[_NodeCallsThatSkipTheirActivities], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is not None


@workflow.defn(name="TrainingRun", sandboxed=False)
class _TrainingRunThatWaitsFirst(TrainingRun):
    """A deliberately changed TrainingRun, as a careless edit would make it: the real run, with a timer first
    that no recorded history has, and no `workflow.patched` guard."""

    @workflow.run
    async def run(self, raw_spec: RawValue) -> RunResult:
        await workflow.sleep(0.001)
        return await super().run(raw_spec)


@workflow.defn(name="TrainingRun", sandboxed=False)
class _TrainingRunThatWaitsFirstBehindAPatch(TrainingRun):
    """The same change behind `workflow.patched`: old histories replay without the timer."""

    @workflow.run
    async def run(self, raw_spec: RawValue) -> RunResult:
        if workflow.patched("test-wait-first"):
            await workflow.sleep(0.001)
        return await super().run(raw_spec)


async def _replay_base(workflow_class: type) -> Any:
    path = next(p for p in HISTORIES if p.stem == "it-base")
    replayer = Replayer(workflows=[workflow_class], data_converter=pydantic_data_converter)
    history = WorkflowHistory.from_json(_workflow_id(path), path.read_text())
    return await replayer.replay_workflow(history, raise_on_replay_failure=False)


async def test_an_unguarded_change_to_the_training_run_fails_replay_of_a_committed_history() -> None:
    """The negative control of the TrainingRun replays: a changed command sequence is caught, and the same
    change behind `workflow.patched` is not (so a failure above means non-determinism, not a broken replay)."""
    result = await _replay_base(_TrainingRunThatWaitsFirst)
    assert result.replay_failure is not None
    assert "nondetermin" in f"{result.replay_failure}".lower()
    assert (await _replay_base(_TrainingRunThatWaitsFirstBehindAPatch)).replay_failure is None
