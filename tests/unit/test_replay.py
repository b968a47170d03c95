"""Replay every committed workflow history against today's workflow code.

A change to a workflow's command sequence makes a replay fail with a non-determinism error, so it cannot
land unless it is guarded by `workflow.patched()`. Histories come from real runs on the dev stack:
`TRAINGUARD_RECORD_HISTORIES=1 make integration` refreshes them (only after a deliberate, patched change).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.node_group import NodeCalls, NodeGroupWatch
from workflows.node_pool import NodePool
from workflows.training_run import TrainingRun

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("*.json"))


def test_histories_are_committed() -> None:
    assert len(HISTORIES) >= 5, "record them: TRAINGUARD_RECORD_HISTORIES=1 make integration"


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_history_replays_without_nondeterminism(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=[TrainingRun, NodePool, NodeCalls, NodeGroupWatch],
                        data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"
