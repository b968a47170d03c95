"""Operator controls on live runs: checkpoint now, drain a node."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import RunResult

from .conftest import RUN_TIMEOUT_S, make_spec, wait_until


async def test_checkpoint_now_commits_an_extra_checkpoint_at_the_step_it_names(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    spec = make_spec(prefix, every=1000, step_time=0.2)  # no periodic checkpoint before the final step
    rid = await client.start_run(spec, workflow_id=f"it-ckpt-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: v.status.phase.value == "running" and v.live_step >= 3)
    target = (await client.checkpoint_now(rid)).step
    assert 3 < target < 60

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert result.incidents == []
    assert result.final_state_digest == baseline.final_state_digest
    # keep_last=2 keeps both commits: the one asked for and the final one.
    manifests = {o["Key"].split("/")[-2] for o in stack.s3().list_objects_v2(
        Bucket="trainguard", Prefix=f"{prefix}/{rid}/")["Contents"] if o["Key"].endswith("manifest.json")}
    assert manifests == {f"step-{target:08d}", "step-00000060"}


# In `make test-slow`: `make test` runs an operator's Slurm drain moving the run onto the spare at its next
# checkpoint through the same `drain_node` update (tests/integration/test_slurm.py).
@pytest.mark.slow
async def test_drained_node_is_replaced_by_a_spare_at_the_next_checkpoint(
    client: TrainguardClient, baseline: RunResult, prefix: str
) -> None:
    spec = make_spec(prefix, spares=("node-2",), step_time=0.1)
    rid = await client.start_run(spec, workflow_id=f"it-drain-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: v.status.phase.value == "running" and v.live_step >= 5)
    await client.drain_node(rid, "node-1", reason="firmware update")
    view = await wait_until(client, rid, lambda v: v.status.attempt == 2 and v.status.phase.value == "running")
    assert view.status.nodes == ["node-0", "node-2"]
    committed = view.status.latest_checkpoint
    # Left at a checkpoint boundary: the new attempt starts where the old one had just committed.
    assert committed is not None and view.status.resumed_step == committed.step > 0

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert result.incidents == []
    assert result.final_state_digest == baseline.final_state_digest
