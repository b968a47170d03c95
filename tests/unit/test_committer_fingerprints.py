"""The committer and the restore with fingerprints, against an in-memory S3: replicas that differ are returned to
the run, a checkpoint whose replicas disagree is never restored, and a rollback passes over what is too new."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from activities.checkpoint_layout import node_record_key
from activities.checkpoint_store import StoreActivities
from activities.fingerprint_models import FingerprintRecord, TieEvidence
from activities.fingerprints import fingerprint_key
from activities.models import (CommitCheckpointsInput, CommitCheckpointsResult, FindCheckpointInput,
                               NodeCheckpointRecord, ShardInfo)
from tests.unit.s3_fake import MemoryStore, memory_store

RUN = "runs/wf-1"
BUCKET = "b"
GOOD, BAD = "00000000000000aa", "00000000000000bb"


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    return memory_store(monkeypatch)


def _commit_once(**changes: Any) -> CommitCheckpointsResult:
    from temporalio.testing import ActivityEnvironment

    request = CommitCheckpointsInput(bucket=BUCKET, run_prefix=RUN, workflow_id="wf-1", attempt=2, min_attempt=2,
                                     world_size=4, num_nodes=2, keep_last=5, max_duration_s=0.0,
                                     poll_interval_s=0.0).model_copy(update=changes)
    return asyncio.run(ActivityEnvironment().run(StoreActivities().commit_checkpoints, request))


def _fingerprints(store: MemoryStore, node: int, values: dict[int, list[list[Any]]], attempt: int = 2) -> None:
    record = FingerprintRecord(node=f"node-{node}", attempt=attempt, written_at=1.0, ranks=values)
    store.objects[fingerprint_key(RUN, f"node-{node}")] = record.model_dump_json().encode()


def _upload(store: MemoryStore, step: int, node: int, values: dict[int, str]) -> None:
    """A node's two ranks' shards of `step`, each with the fingerprint of its state at that step."""
    shards = [ShardInfo(rank=r, key=f"{RUN}/step-{step:08d}/rank-{r:05d}.pt", size_bytes=10, sha256=f"{r:064x}",
                        node=f"node-{node}", fingerprint=[step, value, "replicated"]) for r, value in values.items()]
    for shard in shards:
        store.objects[shard.key] = b"x" * 10
    record = NodeCheckpointRecord(node=f"node-{node}", attempt=2, step=step, shards=shards, node_step=step)
    store.objects[node_record_key(RUN, step, f"node-{node}")] = record.model_dump_json().encode()


def test_the_committer_returns_the_replica_that_differs(store: MemoryStore) -> None:
    _fingerprints(store, 0, {0: [[10, GOOD, "replicated"]], 1: [[10, GOOD, "replicated"]]})
    _fingerprints(store, 1, {2: [[10, BAD, "replicated"]], 3: [[10, GOOD, "replicated"]]})
    verdict = _commit_once().corruption
    assert verdict is not None and (verdict.step, verdict.ranks, verdict.nodes) == (10, [2], {2: "node-1"})


def test_replicas_that_agree_or_an_older_attempts_records_return_nothing(store: MemoryStore) -> None:
    _fingerprints(store, 0, {0: [[10, GOOD, "replicated"]], 1: [[10, GOOD, "replicated"]]}, attempt=1)
    _fingerprints(store, 1, {2: [[10, BAD, "replicated"]], 3: [[10, GOOD, "replicated"]]}, attempt=1)
    assert _commit_once().corruption is None  # the relaunch's attempt 2 has written none yet
    assert _commit_once(compare_fingerprints=False, attempt=1, min_attempt=1).corruption is None


def test_a_checkpoint_whose_replicas_disagree_is_never_restored(store: MemoryStore) -> None:
    for step, node_1 in ((10, {2: GOOD, 3: GOOD}), (20, {2: BAD, 3: GOOD})):
        _upload(store, step, 0, {0: GOOD, 1: GOOD})
        _upload(store, step, 1, node_1)
    assert [c.step for c in _commit_once().commits] == [10, 20]
    found = StoreActivities()._find(FindCheckpointInput(bucket=BUCKET, run_prefix=RUN, world_size=4))
    assert found.manifest is not None and found.manifest.step == 10
    assert found.skipped == ["step 20: replicas disagree: rank(s) 2 hold other state than their replicas "
                             "(replicated) at this step"]


def test_a_rollback_restores_only_checkpoints_older_than_the_first_bad_step(store: MemoryStore) -> None:
    for step in (10, 20):
        _upload(store, step, 0, {0: GOOD, 1: GOOD})
        _upload(store, step, 1, {2: GOOD, 3: GOOD})
    _commit_once()
    found = StoreActivities()._find(FindCheckpointInput(bucket=BUCKET, run_prefix=RUN, world_size=4,
                                                        before_step=17))
    assert found.manifest is not None and found.manifest.step == 10
    assert "step 20: at or after step 17" in found.skipped[0]


def test_the_committer_returns_the_replays_answer_to_a_tie(store: MemoryStore) -> None:
    # a tie at step 10 of attempt 1 between rank 0 (node-0) and rank 2 (node-1); the replay (attempt 2) reaches
    # rank 0's state: rank 2 computed wrong
    evidence = TieEvidence(step=10, group="replicated", values={0: GOOD, 2: BAD},
                           nodes={"node-0": [0, 1], "node-1": [2, 3]})
    _fingerprints(store, 0, {0: [[10, GOOD, "replicated"]], 1: [[10, GOOD, "replicated"]]})
    assert _commit_once(settle=evidence).settled is None  # node-1's ranks have not fingerprinted step 10 yet
    _fingerprints(store, 1, {2: [[10, GOOD, "replicated"]], 3: [[10, GOOD, "replicated"]]})
    settled = _commit_once(settle=evidence).settled
    assert settled is not None and settled.node == "node-1", settled
