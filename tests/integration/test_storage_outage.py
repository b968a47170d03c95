"""The S3 store goes down mid-run: training goes on, uploads retry with backoff, checkpoints commit when it
returns. Down at a restore: bounded retries, then an incident and a pause until an operator resumes. (Each
test brings the shared store back for the tests after it.)"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import Action, IncidentKind, Phase, RunResult

from .conftest import RUN_TIMEOUT_S, checkpointed, make_spec, wait_until


async def test_s3_down_mid_run_training_goes_on_and_checkpoints_commit_when_it_returns(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    spec = make_spec(prefix, every=10, step_time=0.25)  # ~15 s of training: the outage falls inside it
    rid = await client.start_run(spec, workflow_id=f"it-s3down-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=12))
    await asyncio.to_thread(stack.stop, ["s3"], lambda _line: None)
    down_at_step = (await client.status(rid)).live_step
    # Ranks keep training with the store gone, past the next checkpoint step (whose upload now has to wait).
    during = await wait_until(client, rid, lambda v: v.live_step >= down_at_step + 15, timeout_s=60)
    assert during.status.incidents == []
    started = time.monotonic()
    await asyncio.to_thread(stack.up, lambda _line: None)
    assert time.monotonic() - started < 120

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert result.incidents == []
    assert result.final_checkpoint is not None and result.final_checkpoint.step == 60
    assert result.final_state_digest == baseline.final_state_digest


# Failed twice in full fresh-clone runs under load, passes alone: `make test-slow` until its timing is understood;
# the workflow test of the same decision stays in `make test`.
@pytest.mark.slow
async def test_checkpoints_that_stop_committing_are_an_incident_and_the_run_still_ends_identical(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    """The store is down longer than the run's staleness bound: `run status` shows the checkpoint's age, the
    store's error and a `storage_unavailable` incident while training goes on; once the store is back the
    uploads commit, the incident gets its time to recover, and the run ends with the undisturbed digest."""
    spec = make_spec(prefix, every=10, step_time=0.25)
    spec["checkpoint"]["stale_after_s"] = 4
    rid = await client.start_run(spec, workflow_id=f"it-stale-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=12))
    await asyncio.to_thread(stack.stop, ["s3"], lambda _line: None)
    try:
        view = await wait_until(client, rid, lambda v: any(
            i.kind is IncidentKind.STORAGE_UNAVAILABLE for i in v.status.incidents), timeout_s=60)
    finally:
        await asyncio.to_thread(stack.up, lambda _line: None)
    [incident] = view.status.incidents
    assert incident.action is Action.REPORT and "s3://trainguard/" in incident.detail, incident.detail
    assert view.status.phase is Phase.RUNNING, "training goes on"
    # By the reader's clock, which may run a second or two behind the server's on a loaded machine.
    assert view.status.checkpoint_age_s is not None and view.status.checkpoint_age_s > 1
    assert view.status.store_error or view.status.upload_errors, view.status

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    [closed] = result.incidents
    assert closed.kind is IncidentKind.STORAGE_UNAVAILABLE and closed.recovery_s is not None
    assert result.final_checkpoint is not None and result.final_checkpoint.step == 60
    assert result.final_state_digest == baseline.final_state_digest


# About a minute (the store is down for the restore's whole bound): `make test-slow`. The workflow unit test
# `test_store_down_at_restore_pauses_with_an_incident_until_resumed` keeps the decision in `make test`.
@pytest.mark.slow
async def test_s3_down_at_restore_pauses_with_an_incident_and_resumes_when_it_is_back(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    spec = make_spec(prefix, step_time=0.2, checkpoint={"prefix": prefix, "every_steps": 20, "keep_last": 2,
                                                        "restore_timeout_s": 6})
    rid = await client.start_run(spec, workflow_id=f"it-s3restore-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, checkpointed)
    await asyncio.to_thread(stack.stop, ["s3"], lambda _line: None)
    try:
        await client.inject_fault(rid, "crash", "node-1")
        view = await wait_until(client, rid, lambda v: v.status.phase is Phase.PAUSED, timeout_s=90)
    finally:
        await asyncio.to_thread(stack.up, lambda _line: None)
    assert "checkpoint store unreachable at restore" in (view.status.reason or "")
    await client.resume(rid, reason="store is back")

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert [(i.kind, i.action) for i in result.incidents] == [
        (IncidentKind.CRASH, Action.RESTART), (IncidentKind.STORAGE_UNAVAILABLE, Action.PAUSE)]
    assert "restore_timeout_s=6" in result.incidents[1].detail
    assert result.final_state_digest == baseline.final_state_digest
