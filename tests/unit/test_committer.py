"""The committer and the manifests it writes, against an in-memory S3: what commits, what waits, what pages."""

from __future__ import annotations

import asyncio
import time
import json
from typing import Any

import pytest

from activities import checkpoint_store
from activities.checkpoint_layout import MANIFEST_PAGE_RANKS, manifest_key, node_record_key
from activities.checkpoint_store import StoreActivities
from activities.store_reads import read_manifest
from activities.checkpoint_transfers import NodeCheckpointActivities
from activities.models import (
    CommitCheckpointsInput,
    CommitCheckpointsResult,
    DownloadShardsInput,
    FindCheckpointInput,
    NodeCheckpointRecord,
    ShardInfo,
)
from tests.unit.s3_fake import MemoryStore, memory_store

RUN = "runs/wf-1"
BUCKET = "b"


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    return memory_store(monkeypatch)


def _upload(store: MemoryStore, step: int, node_index: int, ranks_per_node: int, attempt: int = 1,
            compute_s: float = 0.1, chain_id: str = "", sharded: bool = False) -> None:
    """What a node's watch leaves in the store once its shards of `step` are uploaded."""
    ranks = range(node_index * ranks_per_node, (node_index + 1) * ranks_per_node)
    shards = [ShardInfo(rank=r, key=f"{RUN}/step-{step:08d}/rank-{r:05d}.pt", size_bytes=10,
                        sha256=f"{r:064x}", node=f"node-{node_index}", sharded=sharded) for r in ranks]
    for shard in shards:
        store.objects[shard.key] = b"x" * 10
    record = NodeCheckpointRecord(node=f"node-{node_index}", attempt=attempt, step=step, shards=shards,
                                  rank_compute_s={r: compute_s for r in ranks}, node_step=step + 2,
                                  chain_id=chain_id)
    store.objects[node_record_key(RUN, step, f"node-{node_index}")] = record.model_dump_json().encode()


def _commit_once(request: CommitCheckpointsInput) -> CommitCheckpointsResult:
    """The committer activity itself, given no time to wait (`max_duration_s` 0): one pass over the store."""
    from temporalio.testing import ActivityEnvironment

    return asyncio.run(ActivityEnvironment().run(StoreActivities().commit_checkpoints, request))


def _request(world_size: int, num_nodes: int, **changes: Any) -> CommitCheckpointsInput:
    return CommitCheckpointsInput(bucket=BUCKET, run_prefix=RUN, workflow_id="wf-1", attempt=2, min_attempt=2,
                                  world_size=world_size, num_nodes=num_nodes, keep_last=2,
                                  max_duration_s=0.0, poll_interval_s=0.0).model_copy(update=changes)


def test_a_step_commits_once_every_node_has_written_its_record(store: MemoryStore) -> None:
    _upload(store, 10, 0, 2, attempt=2)
    assert _commit_once(_request(4, 2)).commits == []  # node-1 has not uploaded yet
    assert manifest_key(RUN, 10) not in store.objects

    _upload(store, 10, 1, 2, attempt=2)
    [commit] = _commit_once(_request(4, 2)).commits
    assert (commit.ref.step, commit.ref.world_size, commit.step) == (10, 4, 12)
    manifest = read_manifest(store, BUCKET, manifest_key(RUN, 10))
    assert manifest is not None and [s.rank for s in manifest.shards] == [0, 1, 2, 3]


def test_records_of_a_dead_attempt_never_make_a_checkpoint(store: MemoryStore) -> None:
    # Attempt 1 uploaded step 10 on both nodes and crashed; attempt 2 (a relaunch) has only rewritten node-0's.
    _upload(store, 10, 0, 1, attempt=1)
    _upload(store, 10, 1, 1, attempt=1)
    _upload(store, 10, 0, 1, attempt=2)
    assert _commit_once(_request(2, 2)).commits == []
    # An in-process restart carries the live ranks' state over: attempt 1's records count with attempt 2's.
    [commit] = _commit_once(_request(2, 2, min_attempt=1)).commits
    assert commit.ref.step == 10


def test_a_previous_run_under_the_same_workflow_id_never_makes_a_checkpoint(store: MemoryStore) -> None:
    # The first run of the id left step 10 whole (its attempt 2, chain A); a rerun (chain B) is at attempt 2 too.
    _upload(store, 10, 0, 1, attempt=2, chain_id="chain-a")
    _upload(store, 10, 1, 1, attempt=2, chain_id="chain-a")
    assert _commit_once(_request(2, 2, chain_id="chain-b")).commits == []
    _upload(store, 10, 0, 1, attempt=2, chain_id="chain-b")
    _upload(store, 10, 1, 1, attempt=2, chain_id="chain-b")
    [commit] = _commit_once(_request(2, 2, chain_id="chain-b")).commits
    assert commit.ref.step == 10


def test_a_commit_no_one_reported_is_reported_by_the_next_attempts_committer(store: MemoryStore) -> None:
    # Attempt 2's committer wrote step 10's manifest, then was given up as its attempt ended: no one reported it.
    _upload(store, 10, 0, 1, attempt=2, chain_id="chain-a")
    _upload(store, 10, 1, 1, attempt=2, chain_id="chain-a")
    assert [c.ref.step for c in _commit_once(_request(2, 2, chain_id="chain-a")).commits] == [10]
    # Attempt 3 counts only its own records, yet reports step 10: the run's newest commit is the store's.
    [commit] = _commit_once(_request(2, 2, chain_id="chain-a", attempt=3, min_attempt=3)).commits
    assert (commit.ref.step, commit.ref.world_size, commit.ref.manifest_key) == (10, 2, manifest_key(RUN, 10))
    # A rerun under the same id (another chain) never takes the first run's commit for its own.
    assert _commit_once(_request(2, 2, chain_id="chain-b", attempt=3, min_attempt=3)).commits == []


def test_the_committer_commits_and_applies_retention(store: MemoryStore) -> None:
    for step in (10, 20, 30):
        _upload(store, step, 0, 2, attempt=2)
        _upload(store, step, 1, 2, attempt=2, compute_s=0.1 if step < 30 else 0.5)
    result = _commit_once(_request(4, 2))
    assert [c.ref.step for c in result.commits] == [10, 20, 30]
    # keep_last=2: step 10 is gone, manifest first, shards and records with it.
    assert not [k for k in store.objects if "/step-00000010/" in k]
    assert manifest_key(RUN, 20) in store.objects and manifest_key(RUN, 30) in store.objects


def test_retention_never_deletes_the_newest_commit_the_run_has_heard_of(store: MemoryStore) -> None:
    """A committer whose result never reaches the run (given up as the run ended) keeps the step the run's
    status and result name; the run's next drain, knowing the newer steps, prunes it."""
    for step in (10, 20, 30, 40):
        _upload(store, step, 0, 1, attempt=2)
        _upload(store, step, 1, 1, attempt=2)
    _commit_once(_request(2, 2, after_step=-1, max_duration_s=0.0))
    assert manifest_key(RUN, 10) not in store.objects  # keep_last=2: 30 and 40 kept
    for step in (50, 60, 70):
        _upload(store, step, 0, 1, attempt=2)
        _upload(store, step, 1, 1, attempt=2)
    # The run knows of step 40 only; this pass's report of 50..70 is lost.
    assert [c.ref.step for c in _commit_once(_request(2, 2, after_step=40)).commits] == [50, 60, 70]
    kept = sorted(s for s in (30, 40, 50, 60, 70) if manifest_key(RUN, s) in store.objects)
    assert kept == [40, 60, 70], "step 40, which the run names, outlives the committer it never heard from"
    # A drain that commits nothing new (the run has heard of 70 since) applies retention: 40 goes.
    drain = _request(2, 2, after_step=70, quiet_s=0.0)
    assert _commit_once(drain).commits == []
    assert sorted(s for s in (40, 60, 70) if manifest_key(RUN, s) in store.objects) == [60, 70]


def test_an_older_step_whole_after_a_newer_one_committed_is_committed_too(store: MemoryStore) -> None:
    """Uploads run side by side: step 20 can be whole while step 10 still uploads on a node. Step 10 is
    committed once whole (not reported: the run's newest is 20), and a drain waits for it meanwhile."""
    _upload(store, 10, 0, 1, attempt=2)
    for node in (0, 1):
        _upload(store, 20, node, 1, attempt=2)
    assert [c.ref.step for c in _commit_once(_request(2, 2, keep_last=3)).commits] == [20]
    assert manifest_key(RUN, 10) not in store.objects
    # Step 10 is half uploaded by this attempt: a drain of the run that knows of 20 waits for it...
    began = time.monotonic()
    assert _commit_once(_request(2, 2, keep_last=3, after_step=20, quiet_s=0.3, max_duration_s=5.0,
                                 poll_interval_s=0.01)).commits == []
    assert time.monotonic() - began >= 0.3, "the drain waited for the older step"
    # ...which, once whole, commits without being reported.
    _upload(store, 10, 1, 1, attempt=2)
    assert _commit_once(_request(2, 2, keep_last=3, after_step=20)).commits == []
    manifest = read_manifest(store, BUCKET, manifest_key(RUN, 10))
    assert manifest is not None and [s.rank for s in manifest.shards] == [0, 1]


async def test_a_finished_runs_drain_waits_through_store_errors_and_commits_once_it_answers(
        store: MemoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain gives up once uploads go quiet, and with the store out nothing is ever new; a finished run's
    drain (`wait_for_store`) keeps asking to its bound and commits the final step once the store answers."""
    from temporalio.testing import ActivityEnvironment

    monkeypatch.setattr(checkpoint_store, "STORE_ERROR_POLL_S", 0.05)
    _upload(store, 10, 0, 1, attempt=2)
    _upload(store, 10, 1, 1, attempt=2)
    down = {"out": True}

    def out_or_memory() -> Any:
        if down["out"]:
            raise OSError("Could not connect to the endpoint URL")
        return store

    monkeypatch.setattr(checkpoint_store, "s3_client", out_or_memory)
    committer = StoreActivities().commit_checkpoints
    drain = _request(2, 2, max_duration_s=30.0, quiet_s=0.2, poll_interval_s=0.01)
    gave_up = await ActivityEnvironment().run(committer, drain)
    assert gave_up.commits == [] and gave_up.store_error is not None

    async def store_comes_back() -> None:
        await asyncio.sleep(0.6)  # well past quiet_s
        down["out"] = False

    back = asyncio.ensure_future(store_comes_back())
    [commit] = (await ActivityEnvironment().run(committer, drain.model_copy(update={"wait_for_store": True}))).commits
    await back
    assert commit.ref.step == 10 and manifest_key(RUN, 10) in store.objects


async def test_drain_mode_returns_once_uploads_go_quiet_and_commits_what_arrives_meanwhile(
        store: MemoryStore) -> None:
    from temporalio.testing import ActivityEnvironment

    committer = StoreActivities().commit_checkpoints
    # Nothing uploaded at all: the drain ends at once, long before its bound.
    request = _request(2, 2, max_duration_s=60.0, quiet_s=30.0, poll_interval_s=0.01)
    assert (await ActivityEnvironment().run(committer, request)).commits == []
    # Half a step uploaded: the drain waits for the rest, which arrives, and commits it.
    _upload(store, 10, 0, 1, attempt=2)

    async def the_rest_arrives() -> None:
        await asyncio.sleep(0.1)
        _upload(store, 10, 1, 1, attempt=2)

    arriving = asyncio.ensure_future(the_rest_arrives())
    [commit] = (await ActivityEnvironment().run(committer, request)).commits
    await arriving
    assert commit.ref.step == 10
    # Half a step that never completes (its node died): the drain gives up once nothing new came for quiet_s.
    _upload(store, 20, 0, 1, attempt=2)
    quiet = request.model_copy(update={"after_step": 10, "quiet_s": 0.2})
    assert (await ActivityEnvironment().run(committer, quiet)).commits == []


async def test_the_last_pass_of_an_attempt_that_never_trained_does_not_wait_on_an_older_half_step(
        store: MemoryStore) -> None:
    """A relaunch whose attempt never trained (a node did not take it up): the half step its predecessor
    left, which that attempt's last pass already waited on, is not waited on for another `quiet_s`."""
    from temporalio.testing import ActivityEnvironment

    _upload(store, 10, 0, 1, attempt=1)
    committer = StoreActivities().commit_checkpoints
    last_pass = _request(2, 2, attempt=2, min_attempt=2, max_duration_s=60.0, quiet_s=30.0, poll_interval_s=0.01)
    began = time.monotonic()
    assert (await ActivityEnvironment().run(committer, last_pass)).commits == []
    assert time.monotonic() - began < 10.0, "returned at once, not after quiet_s"
    # The attempt that left it still waits for the rest, which may yet be on its way.
    attempt_1 = last_pass.model_copy(update={"attempt": 1, "min_attempt": 1, "quiet_s": 0.3})
    began = time.monotonic()
    assert (await ActivityEnvironment().run(committer, attempt_1)).commits == []
    assert time.monotonic() - began >= 0.3


def test_a_large_world_is_paged_and_a_node_reads_only_its_page(store: MemoryStore) -> None:
    world, per_node = 4 * MANIFEST_PAGE_RANKS, 8
    for node in range(world // per_node):
        _upload(store, 10, node, per_node, attempt=2)
    [commit] = _commit_once(_request(world, world // per_node)).commits
    header = json.loads(store.objects[manifest_key(RUN, 10)])
    assert header["shards"] == [] and len(header["pages"]) == 4
    assert len(store.objects[manifest_key(RUN, 10)]) < 4096, "the manifest object itself stays small"
    assert commit.ref.total_bytes == 10 * world

    # The restore: the controller's find returns the header only; a node reads the one page holding its ranks.
    found = StoreActivities()._find(FindCheckpointInput(bucket=BUCKET, run_prefix=RUN, world_size=world))
    assert found.manifest is not None and found.manifest.shards == [] and found.manifest.pages == []
    assert len(found.model_dump_json()) < 2048
    store.gets.clear()
    ranks = list(range(world - per_node, world))
    shards = NodeCheckpointActivities._shards_of(DownloadShardsInput(
        workflow_id="wf-1", attempt=3, node="node-x", bucket=BUCKET, manifest_key=found.manifest_key, ranks=ranks))
    assert [s.rank for s in shards] == ranks
    assert [k.rsplit("/", 1)[1] for k in store.gets] == ["manifest.json", f"manifest-{3 * MANIFEST_PAGE_RANKS:05d}.json"]


def test_a_page_that_does_not_match_its_checksum_is_refused(store: MemoryStore) -> None:
    world = 2 * MANIFEST_PAGE_RANKS
    for node in range(world // 8):
        _upload(store, 10, node, 8, attempt=2)
    _commit_once(_request(world, world // 8))
    page = next(k for k in store.objects if "/manifest-01024.json" in k)
    store.objects[page] = store.objects[page].replace(b'"size_bytes": 10', b'"size_bytes": 11', 1)
    with pytest.raises(ValueError, match="does not match its sha256"):
        read_manifest(store, BUCKET, manifest_key(RUN, 10))


def test_a_grown_world_restores_shard_r_mod_the_checkpoints_world(store: MemoryStore) -> None:
    _upload(store, 20, 0, 1, attempt=2)  # written by a world of one (a shrunk run)
    _commit_once(_request(1, 1))
    shards = NodeCheckpointActivities._shards_of(DownloadShardsInput(
        workflow_id="wf-1", attempt=3, node="node-1", bucket=BUCKET, manifest_key=manifest_key(RUN, 20), ranks=[1]))
    assert [(s.rank, s.key.rsplit("/", 1)[1]) for s in shards] == [(1, "rank-00000.pt")]


def test_a_torch_save_of_dtensors_commits_marked_and_restores_only_onto_its_own_world_size(
        store: MemoryStore) -> None:
    for node in (0, 1):
        _upload(store, 10, node, 1, attempt=2, sharded=True)
    [commit] = _commit_once(_request(2, 2)).commits
    manifest = read_manifest(store, BUCKET, manifest_key(RUN, 10))
    assert commit.ref.reshardable is False and manifest is not None and manifest.reshardable is False

    def find(world_size: int) -> Any:
        return StoreActivities()._find(FindCheckpointInput(bucket=BUCKET, run_prefix=RUN, world_size=world_size,
                                                           min_world_size=1, max_world_size=2))

    assert find(2).manifest.step == 10
    shrunk = find(1)  # a shrink the policy did not stop (an older controller): never restored resharded
    assert shrunk.manifest is None
    assert shrunk.skipped == ["step 10: a per-rank torch.save of sharded tensors written by 2 ranks cannot be "
                              "resharded onto 1"]
