"""Checkpoints made the way the product makes them, for tests that need one committed.

Rank r's shard is saved on its own node, `node-r`, and that node's agent uploads it
(`NodeCheckpointActivities.upload_step`: every byte checked against the sha256 its rank recorded, the node's
record written last); then one pass of the committer (`StoreActivities.commit_checkpoints`) writes the manifest
once the records cover the world, and applies retention. Both activities run outside Temporal
(`ActivityEnvironment`), against whatever store their `s3_client` reaches: the test stack's SeaweedFS, or the
unit tests' `tests/unit/s3_fake.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from temporalio.testing import ActivityEnvironment

from activities.checkpoint_store import StoreActivities
from activities.checkpoint_transfers import NodeCheckpointActivities
from activities.models import CommitCheckpointsInput, CommitCheckpointsResult, NodeCheckpointRecord, WatchCheckpoints
from tests.conftest import SCRATCH
from trainguard.models import CheckpointRef
from trainguard.protocol import RunLayout, shard_meta_name, shard_name

KEEP_ALL = 100
"""Retention's `keep_last` unless a test says otherwise: more checkpoints than any test commits, so only a test
that means to prune does."""


def save_shard(workdir: Path, workflow_id: str, step: int, rank: int, body: bytes) -> None:
    """What a rank's `save` leaves on its node: the shard, then its meta file (the agent's sign it is written)."""
    step_dir = RunLayout.of(workdir, workflow_id).local_step_dir(step)
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / shard_name(rank)).write_bytes(body)
    meta = {"rank": rank, "step": step, "size_bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    (step_dir / shard_meta_name(rank)).write_text(json.dumps(meta))


def upload(bucket: str, run_prefix: str, workflow_id: str, step: int, bodies: dict[int, bytes], attempt: int = 1,
           chain_id: str = "", token: str | None = None) -> list[NodeCheckpointRecord]:
    """Each rank's shard of `step` (rank -> bytes) saved on its node and uploaded by that node's agent, which
    writes its record last. The nodes' disks are gone afterwards; what they uploaded stays."""
    SCRATCH.mkdir(exist_ok=True)
    target = WatchCheckpoints(bucket=bucket, run_prefix=run_prefix)
    records = []
    with tempfile.TemporaryDirectory(dir=SCRATCH, prefix="agents-") as disks:
        for rank, body in sorted(bodies.items()):
            node = f"node-{rank}"
            save_shard(Path(disks) / node, workflow_id, step, rank, body)
            agent = NodeCheckpointActivities(node, Path(disks) / node, token=token)
            records.append(asyncio.run(ActivityEnvironment().run(
                agent.upload_step, workflow_id, attempt, target, step, {rank: 0.1}, step, chain_id)))
    return records


def commit_once(controller: StoreActivities, bucket: str, run_prefix: str, workflow_id: str, step: int,
                world_size: int, attempt: int = 1, chain_id: str = "", keep_last: int = KEEP_ALL,
                **changes: Any) -> CommitCheckpointsResult:
    """One pass of `controller`'s committer over the steps from `step` on (the run's newest commit is the step
    before), counting the records of `attempt`; `changes` are further fields of its input."""
    request = CommitCheckpointsInput(bucket=bucket, run_prefix=run_prefix, workflow_id=workflow_id, attempt=attempt,
                                     min_attempt=attempt, chain_id=chain_id, world_size=world_size,
                                     num_nodes=world_size, after_step=step - 1, keep_last=keep_last,
                                     max_duration_s=0.0, poll_interval_s=0.0).model_copy(update=changes)
    return asyncio.run(ActivityEnvironment().run(controller.commit_checkpoints, request))


def checkpoint(controller: StoreActivities, bucket: str, run_prefix: str, workflow_id: str, step: int,
               bodies: dict[int, bytes], attempt: int = 1, chain_id: str = "",
               keep_last: int = KEEP_ALL) -> CheckpointRef | None:
    """Step `step` of a world of `len(bodies)` ranks uploaded by their agents, then committed by `controller`:
    the committed checkpoint, None when the committer committed nothing of that step."""
    upload(bucket, run_prefix, workflow_id, step, bodies, attempt=attempt, chain_id=chain_id)
    result = commit_once(controller, bucket, run_prefix, workflow_id, step, len(bodies), attempt=attempt,
                         chain_id=chain_id, keep_last=keep_last)
    return next((c.ref for c in result.commits if c.ref.step == step), None)
