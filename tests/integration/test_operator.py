"""What an operator meets first: a failing script's own traceback as the run's reason, and errors that say
what happened (issue 17)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError

from trainguard.client import TrainguardClient
from trainguard.errors import describe_error
from trainguard.models import Action, IncidentKind

from .conftest import RUN_TIMEOUT_S, make_spec


async def test_a_script_that_raises_at_step_10_stops_after_two_attempts_with_its_traceback(
        client: TrainguardClient, prefix: str) -> None:
    spec = make_spec(prefix, steps=60, every=20)
    spec["entrypoint"] += ["--raise-at-step", "10"]
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
    message = describe_error(failed.value)
    assert "the same failure on 2 attempts in a row" in message
    assert "train.py" in message and "ValueError: deliberate failure at step 10" in message
    assert "Workflow execution failed" not in message
