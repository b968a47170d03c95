"""In-process restart on the real stack: after a rank crash the live ranks keep their state and form a new
process group with the restarted rank, which takes its state from them; when they cannot, the run falls back
to a full relaunch from the newest checkpoint. Either way the run ends bit-identical to the `baseline`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import IncidentKind, RunResult
from trainguard.protocol import RunLayout

from .conftest import RUN_TIMEOUT_S, checkpointed, live_rank_pids, make_spec, wait_until


def in_process_spec(prefix: str, *trainer_args: str) -> dict[str, Any]:
    spec = make_spec(prefix, restarts={"in_process": True, "rejoin_timeout_s": 60})
    spec["entrypoint"] += list(trainer_args)
    return spec


def rank_record(stack: DevStack, node: str, workflow_id: str) -> dict[str, Any]:
    return json.loads(RunLayout.of(stack.home / "nodes" / node, workflow_id).ranks_file.read_text())


def rank_pids(stack: DevStack, node: str, workflow_id: str) -> dict[int, int]:
    return {item["rank"]: item["pid"] for item in rank_record(stack, node, workflow_id)["ranks"]}


async def test_crash_recovers_in_process_and_the_live_rank_keeps_running(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    rid = f"it-inproc-{uuid.uuid4().hex[:6]}"
    await client.start_run(in_process_spec(prefix), workflow_id=rid)
    view = await wait_until(client, rid, checkpointed)
    committed = view.status.latest_checkpoint.step  # type: ignore[union-attr]
    live_before = rank_pids(stack, "node-0", rid)
    crashed_before = rank_pids(stack, "node-1", rid)
    standby = rank_record(stack, "node-1", rid)["standby"]["pid"]  # torch already imported, waiting
    await client.inject_fault(rid, "crash", "node-1")

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    [crash] = result.incidents
    assert crash.kind is IncidentKind.CRASH and crash.node == "node-1", result.incidents
    assert crash.recovery_path == "in-process" and crash.restore_tier == "peers", crash
    # It went on from where the live rank stood, not back to the checkpoint.
    assert crash.resumed_step is not None and crash.resumed_step >= committed, (crash, committed)
    assert crash.recovery_s is not None
    assert result.attempts == 2
    # The live rank is the same process; node-1's standby process took the crashed rank's place.
    assert rank_pids(stack, "node-0", rid) == live_before
    assert rank_pids(stack, "node-1", rid) == {1: standby} != crashed_before
    assert result.final_state_digest == baseline.final_state_digest
    assert live_rank_pids(stack) == []  # the standbys went with the finished ranks


@pytest.mark.slow  # ~18 s; the workflow test of the fallback runs in make test
async def test_a_trainer_that_cannot_rejoin_falls_back_to_a_full_relaunch(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    rid = f"it-inproc-fallback-{uuid.uuid4().hex[:6]}"
    # --no-rejoin: the live rank exits when its peer dies, as a trainer without `rejoin` does.
    await client.start_run(in_process_spec(prefix, "--no-rejoin"), workflow_id=rid)
    view = await wait_until(client, rid, checkpointed)
    committed = view.status.latest_checkpoint.step  # type: ignore[union-attr]
    await client.inject_fault(rid, "crash", "node-1")

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    [crash] = result.incidents  # the failed in-process attempt is part of this incident, not a new one
    assert crash.kind is IncidentKind.CRASH and crash.node == "node-1", result.incidents
    assert crash.recovery_path and crash.recovery_path.startswith("relaunch after failed in-process"), crash
    assert crash.resumed_step is not None and crash.resumed_step >= committed
    assert crash.restore_tier is not None and crash.restore_tier != "peers"
    assert result.final_state_digest == baseline.final_state_digest
    assert live_rank_pids(stack) == []
