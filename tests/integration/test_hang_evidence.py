"""A hang whose culprit's process keeps running: every rank goes silent together, and only the evidence the
ranks give before anything is stopped (stacks, collective position) names the right one."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.evidence import fault_name
from trainguard.models import IncidentKind
from trainguard.report import read_store_texts

from .conftest import RUN_TIMEOUT_S, checkpointed, make_spec, wait_until


@pytest.mark.slow  # ~30 s; a hang's recovery runs in make test (test_training_run), its culprit in the unit tests
async def test_python_hang_on_node_1_names_its_rank_with_evidence_and_stores_its_stacks(
    client: TrainguardClient, prefix: str, stack: DevStack
) -> None:
    # The quickstart's shape: 2 nodes x 2 ranks, default hang bounds. Rank 3 is node-1's second rank: the
    # watch cannot tell it from its blocked peers by progress or by process state (all sleep).
    spec = make_spec(prefix, steps=120, every=20, ranks_per_node=2, health={})
    rid = await client.start_run(spec, workflow_id=f"it-hangev-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=22))
    fault = await client.inject_fault(rid, fault_name("python"), "node-1", rank=3)

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    hangs = [i for i in result.incidents if i.kind is IncidentKind.HANG]
    assert len(hangs) == 1, result.incidents
    hang = hangs[0]
    assert (hang.node, hang.rank) == ("node-1", fault.rank), hang
    assert "hang_in_python" in hang.evidence and "peers wait" in hang.evidence, hang.evidence
    assert hang.attribution_s is not None and hang.detection_s is not None and hang.detection_s < 10
    assert hang.evidence_key and hang.evidence_key.endswith(f"/incidents/{hang.attempt}/")

    s3 = stack.s3()

    async def stacks() -> dict[str, str]:
        found: dict[str, str] = {}
        for _ in range(50):  # uploaded beside the recovery: give it a moment
            found = dict(await asyncio.to_thread(read_store_texts, hang.evidence_key, s3))
            if len(found) == 4:
                return found
            await asyncio.sleep(0.2)
        return found

    texts = await stacks()
    assert sorted(k.rsplit("/", 1)[1] for k in texts) == [f"rank-{r:05d}.txt" for r in range(4)]
    culprit = texts[f"{hang.evidence_key.removeprefix('s3://trainguard/')}rank-00003.txt"]
    assert "hang_in_python" in culprit and "Current thread" in culprit
