"""Checkpoints that cannot lie, on the real SeaweedFS: bad bytes are never restored and runs still complete.

One source run writes genuine checkpoints (steps 10..40). Each case plants some of them under the prefix of a
new workflow id, as if an earlier run with that id had left them, damages them in one way, and starts a run
with that id. It must resume from the newest checkpoint that is still whole (or from 0), never from the
damaged one, finish, and end bit-identical to the source run: any restored byte that differed would show in
the final digest. One case uses literally the same workflow id as a finished run.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from temporalio.exceptions import ApplicationError

from activities.checkpoint_layout import (decision_key, manifest_key, manifest_problem, node_record_key, signed_body,
                                          step_prefix)
from activities.checkpoint_store import StoreActivities
from activities.fingerprints import FINGERPRINT_DIR
from activities.store_reads import not_modified, abort_orphaned_uploads, check_shard_in_store, list_steps, read_manifest
from activities.checkpoint_transfers import NodeCheckpointActivities
from activities.models import (
    AttemptDecision,
    CommitCheckpointsInput,
    CommitCheckpointsResult,
    FindCheckpointInput,
    FindCheckpointResult,
    LaunchRanksInput,
    Manifest,
    NodeCheckpointRecord,
    PublishAttemptInput,
    ShardInfo,
    WatchCheckpoints,
)
from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import CheckpointRef, IncidentKind, RunResult
from trainguard.protocol import RunLayout, shard_name

from tests.agent_checkpoints import checkpoint, commit_once, upload

from .conftest import NODES, activity_failures, make_spec

BUCKET = "trainguard"
STEPS = 40
EVERY = 10
RUN_TIMEOUT_S = 240


# ----------------------------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class Source:
    """A finished run's genuine checkpoints: the bytes cases plant, and the digest they must end at."""

    run_prefix: str
    digest: str
    manifests: dict[int, Manifest]

    @property
    def genuine(self) -> set[str]:
        """sha256 of every shard it wrote."""
        return {s.sha256 for m in self.manifests.values() for s in m.shards}


def spec_for(prefix: str, keep_last: int = 2) -> dict[str, Any]:
    spec = make_spec(prefix, steps=STEPS, every=EVERY)
    spec["checkpoint"]["keep_last"] = keep_last
    return spec


async def run_to_end(client: TrainguardClient, spec: dict[str, Any], workflow_id: str,
                     resume: bool = False) -> RunResult:
    await client.start_run(spec, workflow_id=workflow_id, resume=resume)
    return await asyncio.wait_for(client.result(workflow_id), RUN_TIMEOUT_S)


async def activity_calls(client: TrainguardClient, workflow_id: str, name: str, input_type: type,
                         result_type: type | None = None) -> list[tuple[Any, Any]]:
    """(input, result or None) of every `name` activity the run's latest execution or its node groups
    scheduled, in order within each history."""
    converter = client.client.data_converter
    calls: list[list[Any]] = []
    for history in await client.histories(workflow_id):
        index: dict[int, int] = {}
        for event in history.events:
            if event.HasField("activity_task_scheduled_event_attributes"):
                scheduled = event.activity_task_scheduled_event_attributes
                if scheduled.activity_type.name == name:
                    [request] = await converter.decode(scheduled.input.payloads, [input_type])
                    index[event.event_id] = len(calls)
                    calls.append([request, None])
            elif event.HasField("activity_task_completed_event_attributes") and result_type is not None:
                completed = event.activity_task_completed_event_attributes
                if completed.scheduled_event_id in index:
                    [result] = await converter.decode(completed.result.payloads, [result_type])
                    calls[index[completed.scheduled_event_id]][1] = result
    return [(request, result) for request, result in calls]


MANIFEST_SECRET: list[bytes | None] = [None]
"""The stack's manifest key, which tags every manifest its controller commits: a manifest planted as the run's
own must carry its tag too, or it is refused for that and not for the damage a test means."""


@pytest.fixture(autouse=True)
def _manifest_secret(stack: DevStack) -> None:
    MANIFEST_SECRET[0] = stack.manifest_key().encode()


def _signed(manifest: Manifest) -> bytes:
    return signed_body(manifest.model_dump_json(indent=1).encode(), MANIFEST_SECRET[0])


def plant(s3: Any, source: Source, run_prefix: str, workflow_id: str, steps: list[int]) -> None:
    """Copy the source's checkpoints of `steps` under `run_prefix`, as run `workflow_id` would write them."""
    for step in steps:
        original = source.manifests[step]
        shards = []
        for shard in original.shards:
            key = f"{step_prefix(run_prefix, step)}{shard_name(shard.rank)}"
            s3.copy_object(Bucket=BUCKET, Key=key, CopySource={"Bucket": BUCKET, "Key": shard.key})
            shards.append(shard.model_copy(update={"key": key}))
            assert check_shard_in_store(s3, BUCKET, shards[-1]) is None  # size and sha256 metadata came along
        # No chain: the run that restores them is a new chain of `workflow_id`, which a manifest of another
        # chain would refuse (issue 40 finding 5); a chainless one is one from before chains, which it adopts.
        manifest = original.model_copy(update={"workflow_id": workflow_id, "shards": shards, "tag": None,
                                               "chain_id": ""})
        s3.put_object(Bucket=BUCKET, Key=manifest_key(run_prefix, step), Body=_signed(manifest))


def shard_key(run_prefix: str, step: int, rank: int) -> str:
    return f"{step_prefix(run_prefix, step)}{shard_name(rank)}"


def rewrite_shard(s3: Any, key: str, change: Callable[[bytes], bytes]) -> None:
    """Replace a shard's bytes, keeping its sha256 metadata: only a check of the bytes themselves can tell."""
    head = s3.head_object(Bucket=BUCKET, Key=key)
    body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=key, Body=change(body), Metadata=head["Metadata"])


def flip_byte(body: bytes) -> bytes:
    middle = len(body) // 2
    return body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1:]


def rewrite_manifest(s3: Any, run_prefix: str, step: int, change: Callable[[Manifest], Manifest]) -> None:
    key = manifest_key(run_prefix, step)
    manifest = Manifest.model_validate_json(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    s3.put_object(Bucket=BUCKET, Key=key, Body=_signed(change(manifest).model_copy(update={"tag": None})))


def lying_checkpoints(s3: Any, run_prefix: str, steps: list[int] | None = None) -> list[str]:
    """Checkpoints a reader accepts from their manifest and HEADs whose bytes do not match the manifest."""
    lies = []
    for step in list_steps(s3, BUCKET, run_prefix) if steps is None else steps:
        try:
            manifest = read_manifest(s3, BUCKET, manifest_key(run_prefix, step))
        except ValueError:
            continue
        if (manifest is None or manifest_problem(manifest, run_prefix, step)
                or any(check_shard_in_store(s3, BUCKET, s) for s in manifest.shards)):
            continue
        for shard in manifest.shards:
            body = s3.get_object(Bucket=BUCKET, Key=shard.key)["Body"].read()
            if hashlib.sha256(body).hexdigest() != shard.sha256:
                lies.append(f"step {step} rank {shard.rank}")
    return lies


def restored_files(stack: DevStack, workflow_id: str) -> list[Path]:
    """Every file the node agents kept in the run's restore folders."""
    return sorted(p for node in NODES for p in RunLayout.of(stack.home / "nodes" / node, workflow_id)
                  .root.joinpath("restore").rglob("*") if p.is_file())


@pytest.fixture(scope="module")
async def source(client: TrainguardClient, stack: DevStack) -> Source:
    tag = uuid.uuid4().hex[:6]
    prefix, workflow_id = f"ck-source-{tag}", f"ck-source-{tag}"
    spec = spec_for(prefix, keep_last=10)
    spec["checkpoint"]["allow_resume"] = ["*"]  # the follower below resumes from it under an id of its own
    result = await run_to_end(client, spec, workflow_id)
    assert result.steps_completed == STEPS and result.incidents == [] and result.final_state_digest
    s3 = stack.s3()
    run_prefix = f"{prefix}/{workflow_id}"
    manifests = {step: read_manifest(s3, BUCKET, manifest_key(run_prefix, step)) for step in (10, 20, 30, 40)}
    missing = [step for step, manifest in manifests.items() if manifest is None]
    assert not missing, f"steps {missing} never committed; {await activity_failures(client, workflow_id)}"
    return Source(run_prefix, result.final_state_digest, manifests)  # type: ignore[arg-type]


@pytest.fixture
def store_env(stack: DevStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The activities' own S3 client (trainguard.settings) pointed at the test stack, as workers have it."""
    env = stack.worker_env()
    for name in ("TRAINGUARD_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.setenv(name, env[name])


# ------------------------------------------------------------------------------------------ the matrix


def _no_damage(s3: Any, rp: str) -> None:
    pass


def _truncated_shard(s3: Any, rp: str) -> None:
    rewrite_shard(s3, shard_key(rp, 30, 1), lambda body: body[: len(body) // 2])


def _flipped_byte(s3: Any, rp: str) -> None:
    rewrite_shard(s3, shard_key(rp, 30, 0), flip_byte)


def _missing_shard(s3: Any, rp: str) -> None:
    s3.delete_object(Bucket=BUCKET, Key=shard_key(rp, 30, 1))


def _missing_manifest(s3: Any, rp: str) -> None:
    s3.delete_object(Bucket=BUCKET, Key=manifest_key(rp, 30))


def _manifest_names_missing_shard(s3: Any, rp: str) -> None:
    def elsewhere(m: Manifest) -> Manifest:
        shards = [s.model_copy(update={"key": f"{s.key}.gone"}) if s.rank == 1 else s for s in m.shards]
        return m.model_copy(update={"shards": shards})

    rewrite_manifest(s3, rp, 30, elsewhere)


def _manifest_lacks_a_rank(s3: Any, rp: str) -> None:
    rewrite_manifest(s3, rp, 30, lambda m: m.model_copy(update={"shards": m.shards[:1]}))


def _garbage_manifest(s3: Any, rp: str) -> None:
    body = b'{"format": "trainguard-checkpoint/1", \x00\xff'
    s3.put_object(Bucket=BUCKET, Key=manifest_key(rp, 30), Body=body)


def _every_checkpoint_corrupt(s3: Any, rp: str) -> None:
    for step in (10, 20, 30):
        rewrite_shard(s3, shard_key(rp, step, step // 10 % 2), flip_byte)


@dataclass(frozen=True)
class Case:
    damage: Callable[[Any, str], None]
    resumes_from: int
    num_corrupt_incidents: int = 0
    """Damage only a download can see (the bytes, not their size or metadata) costs one incident per step."""
    skipped: str | None = None
    """What the first `find_checkpoint` says about step 30, when it passes it over without downloading."""


CASES = {
    "control_no_damage": Case(_no_damage, 30),
    "truncated_shard": Case(_truncated_shard, 20, skipped="step 30: shard of rank 1 is"),
    "flipped_byte_same_size_and_metadata": Case(_flipped_byte, 20, num_corrupt_incidents=1),
    "missing_shard": Case(_missing_shard, 20, skipped="step 30: shard of rank 1 missing"),
    "missing_manifest": Case(_missing_manifest, 20, skipped="step 30: no manifest"),
    "manifest_names_missing_shard": Case(_manifest_names_missing_shard, 20, skipped="step 30: manifest puts"),
    "manifest_lacks_a_rank": Case(_manifest_lacks_a_rank, 20, skipped="step 30: manifest names shards of"),
    "garbage_manifest": Case(_garbage_manifest, 20, skipped="step 30: unreadable manifest"),
    "every_checkpoint_corrupt": Case(_every_checkpoint_corrupt, 0, num_corrupt_incidents=3),
}
FAST_CASES = ("truncated_shard", "flipped_byte_same_size_and_metadata", "every_checkpoint_corrupt")
"""In `make test`: a shard that fails its size check, one that fails only its checksum, and no checkpoint left to
trust (about 9 s each); the other damages run in `make test-slow` (the store-level tests below and
tests/unit/test_checkpoint_store.py check how each is recognised)."""


async def assert_resumed_cleanly(client: TrainguardClient, stack: DevStack, source: Source, workflow_id: str,
                                 run_prefix: str, result: RunResult, case: Case, genuine: set[str]) -> None:
    assert result.steps_completed == STEPS
    # Bit-identical to the run that wrote the genuine checkpoints: no damaged byte reached a rank.
    assert result.final_state_digest == source.digest
    # The master node launches with an activity of its own; the other node from its first watch, after its
    # download. A shard only the other node reads is found corrupt there, after the master launched: that
    # attempt ends, and the next one restores the checkpoint before. The last attempt restores the good one.
    launches = await activity_calls(client, workflow_id, "launch_ranks", LaunchRanksInput)
    final = [request for request, _ in launches if request.attempt == result.attempts]
    assert [request.restore_step for request in final] == [case.resumes_from], launches
    assert result.attempts <= 1 + case.num_corrupt_incidents
    corrupt = [i for i in result.incidents if i.kind is IncidentKind.CHECKPOINT_CORRUPT]
    assert len(corrupt) == case.num_corrupt_incidents, result.incidents
    assert len(result.incidents) == len(corrupt), result.incidents
    assert corrupt[-1:] == [] or corrupt[-1].resumed_step == case.resumes_from, result.incidents
    if case.skipped is not None:
        finds = await activity_calls(client, workflow_id, "find_checkpoint", FindCheckpointInput,
                                     FindCheckpointResult)
        assert any(case.skipped in reason for reason in finds[0][1].skipped), finds[0][1].skipped
    # The agents kept no byte that failed verification: every file in a restore folder is a genuine shard.
    for path in restored_files(stack, workflow_id):
        assert not path.name.endswith(".part"), path
        if path.suffix == ".pt":
            assert hashlib.sha256(path.read_bytes()).hexdigest() in genuine, path
    # Every commit the run made vouches for bytes that are really there: a re-saved step whose old shard
    # rotted in place is repaired by the upload, not waved through because its size and metadata still match.
    commits = await activity_calls(client, workflow_id, "commit_checkpoints", CommitCheckpointsInput,
                                   CommitCheckpointsResult)
    committed = sorted({c.ref.step for _, result in commits if result is not None for c in result.commits})
    assert committed and committed[-1] == STEPS, commits
    assert lying_checkpoints(stack.s3(), run_prefix, committed) == []


@pytest.mark.parametrize("name", [name if name in FAST_CASES else pytest.param(name, marks=pytest.mark.slow)
                                  for name in CASES])
async def test_damaged_checkpoint_is_never_restored_and_the_run_completes(
    client: TrainguardClient, stack: DevStack, source: Source, prefix: str, name: str
) -> None:
    case = CASES[name]
    workflow_id = f"ck-{name.replace('_', '-')[:24]}-{uuid.uuid4().hex[:6]}"
    run_prefix = f"{prefix}/{workflow_id}"
    s3 = stack.s3()
    plant(s3, source, run_prefix, workflow_id, [10, 20, 30])
    case.damage(s3, run_prefix)

    result = await run_to_end(client, spec_for(prefix), workflow_id)

    await assert_resumed_cleanly(client, stack, source, workflow_id, run_prefix, result, case, source.genuine)
    if case.num_corrupt_incidents:
        detail = [i.detail for i in result.incidents]
        assert all("sha256" in d for d in detail), detail


@pytest.mark.slow  # ~20 s; a flipped byte's restore runs in make test below
async def test_same_workflow_id_rerun_restores_past_a_flipped_byte(
    client: TrainguardClient, stack: DevStack, source: Source, prefix: str
) -> None:
    """The literal story: a run finishes, its newest checkpoint rots, the same workflow id starts again."""
    workflow_id = f"ck-rerun-{uuid.uuid4().hex[:6]}"
    run_prefix = f"{prefix}/{workflow_id}"
    first = await run_to_end(client, spec_for(prefix), workflow_id)
    assert first.steps_completed == STEPS and first.final_state_digest == source.digest
    s3 = stack.s3()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{run_prefix}/")["Contents"]
    kept = {o["Key"].removeprefix(f"{run_prefix}/").split("/")[0] for o in listed}
    # keep_last=2; the namespace's owner record; the nodes' fingerprint records (the replicas' comparison) and,
    # for a run slowed past a straggler window (a loaded machine), their pace records, which are no checkpoints
    assert kept - {"pace", FINGERPRINT_DIR} == {"owner.json", "step-00000030", "step-00000040"}
    # A fresh start seeds Python's RNG from the OS, so this run's shards are its own, not the source's.
    manifests = [read_manifest(s3, BUCKET, manifest_key(run_prefix, step)) for step in (30, 40)]
    genuine = {s.sha256 for m in manifests if m is not None for s in m.shards}
    rewrite_shard(s3, shard_key(run_prefix, 40, 1), flip_byte)
    # The nodes' own copies would be restored first (verified, so the rot in S3 would not matter): drop them,
    # as if the run came back on fresh nodes, so the restore has to read, and reject, the rotted object.
    for local in (stack.home / "nodes").glob(f"*/runs/{workflow_id}/checkpoints"):
        shutil.rmtree(local)

    second = await run_to_end(client, spec_for(prefix), workflow_id, resume=True)  # the earlier run's checkpoints

    await assert_resumed_cleanly(client, stack, source, workflow_id, run_prefix, second,
                                 Case(_no_damage, 30, num_corrupt_incidents=1), genuine)


async def test_orphaned_multipart_upload_neither_counts_nor_survives_the_janitor(
    client: TrainguardClient, stack: DevStack, source: Source, prefix: str
) -> None:
    workflow_id = f"ck-orphan-{uuid.uuid4().hex[:6]}"
    run_prefix = f"{prefix}/{workflow_id}"
    s3 = stack.s3()
    plant(s3, source, run_prefix, workflow_id, [10, 20, 30])
    # Step 40 as an agent killed mid-upload leaves it: rank 1's shard landed, rank 0's upload never completed.
    s3.copy_object(Bucket=BUCKET, Key=shard_key(run_prefix, 40, 1),
                   CopySource={"Bucket": BUCKET, "Key": source.manifests[40].shards[1].key})
    orphans = {
        "ours": shard_key(run_prefix, 40, 0),
        "sibling run": shard_key(f"{run_prefix}x", 40, 0),  # shares the prefix string, not the folder
        "other run": shard_key(f"{prefix}-other/{workflow_id}", 40, 0),
    }
    upload_ids = {}
    for what, key in orphans.items():
        upload_ids[what] = s3.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
        s3.upload_part(Bucket=BUCKET, Key=key, UploadId=upload_ids[what], PartNumber=1, Body=b"\x01" * 4096)

    def pending(under: str) -> list[str]:
        return [u["Key"] for u in s3.list_multipart_uploads(Bucket=BUCKET, Prefix=under).get("Uploads", [])]

    try:
        result = await run_to_end(client, spec_for(prefix), workflow_id)
        await assert_resumed_cleanly(client, stack, source, workflow_id, run_prefix, result,
                                     Case(_no_damage, 30, skipped="step 40: no manifest"), source.genuine)
        # Retention (the committer's, after each commit) ran its janitor, which leaves an upload younger than
        # its bound alone: it may be in flight.
        assert await activity_calls(client, workflow_id, "commit_checkpoints", CommitCheckpointsInput)
        assert pending(f"{run_prefix}/") == [orphans["ours"]]

        assert abort_orphaned_uploads(s3, BUCKET, run_prefix, older_than_s=3600, now=time.time()) == []
        aborted = abort_orphaned_uploads(s3, BUCKET, run_prefix, older_than_s=0, now=time.time())
        assert aborted == [orphans["ours"]]
        assert pending(f"{run_prefix}/") == []
        assert pending(f"{run_prefix}x/") == [orphans["sibling run"]]
        assert pending(f"{prefix}-other/") == [orphans["other run"]]
        # Aborting the orphan left the committed shard at the same key whole.
        assert lying_checkpoints(s3, run_prefix) == []
        assert read_manifest(s3, BUCKET, manifest_key(run_prefix, 40)) is not None
    finally:
        abort_orphaned_uploads(s3, BUCKET, prefix, older_than_s=0, now=time.time())
        abort_orphaned_uploads(s3, BUCKET, f"{prefix}-other", older_than_s=0, now=time.time())


# ------------------------------------------------------------------------- the activities, called directly


def _put_shard(s3: Any, run_prefix: str, step: int, rank: int, body: bytes) -> ShardInfo:
    key = shard_key(run_prefix, step, rank)
    sha = hashlib.sha256(body).hexdigest()
    s3.put_object(Bucket=BUCKET, Key=key, Body=body, Metadata={"sha256": sha})
    return ShardInfo(rank=rank, key=key, size_bytes=len(body), sha256=sha, node=f"node-{rank}")


def test_two_writers_for_one_step_cannot_replace_the_committed_manifest(
    stack: DevStack, store_env: None, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s3 = stack.s3()
    run_prefix = f"{prefix}/ck-writers"
    store = StoreActivities()

    def commit(attempt: int) -> list[CheckpointRef]:
        result = commit_once(store, BUCKET, run_prefix, "ck-w", 10, world_size=2, attempt=attempt)
        return [c.ref for c in result.commits]

    first = {rank: f"writer A rank {rank}".encode() * 64 for rank in (0, 1)}
    upload(BUCKET, run_prefix, "ck-w", 10, first, attempt=1)
    [ref] = commit(attempt=1)
    committed = s3.get_object(Bucket=BUCKET, Key=ref.manifest_key)["Body"].read()
    assert ref.step == 10 and ref.world_size == 2

    # The committer's next pass (a retried activity) is idempotent: the same commit, manifest untouched.
    assert commit(attempt=1) == [ref]
    assert s3.get_object(Bucket=BUCKET, Key=ref.manifest_key)["Body"].read() == committed

    # A second writer's agent (a zombie attempt, a restarted run) may not overwrite the committed shards.
    late = tmp_path / shard_name(0)
    late.write_bytes(b"writer B rank 0" * 64)
    late_shard = ShardInfo(rank=0, key=shard_key(run_prefix, 10, 0), size_bytes=late.stat().st_size,
                           sha256=hashlib.sha256(late.read_bytes()).hexdigest())
    with pytest.raises(ApplicationError) as refused:
        NodeCheckpointActivities("node-b", tmp_path)._upload_one(BUCKET, late, late_shard, ref.manifest_key)
    assert refused.value.type == "ConflictingCommit" and refused.value.non_retryable
    assert s3.get_object(Bucket=BUCKET, Key=shard_key(run_prefix, 10, 0))["Body"].read() == b"writer A rank 0" * 64

    # Its shards and node records land anyway (written around the agent): its committer commits nothing, and
    # says why.
    for rank in (0, 1):
        shard = _put_shard(s3, run_prefix, 10, rank, f"writer B rank {rank}".encode() * 64)
        record = NodeCheckpointRecord(node=f"node-{rank}", attempt=2, step=10, shards=[shard])
        s3.put_object(Bucket=BUCKET, Key=node_record_key(run_prefix, 10, f"node-{rank}"),
                      Body=record.model_dump_json().encode())
    with caplog.at_level(logging.WARNING, logger="activities.checkpoints"):
        assert commit(attempt=2) == []
    assert "step 10 was already committed with different shards (two writers?)" in caplog.text
    assert s3.get_object(Bucket=BUCKET, Key=ref.manifest_key)["Body"].read() == committed

    # Writer B's bytes now sit under writer A's manifest: a reader passes the step over, never restores it.
    found = store._find(FindCheckpointInput(bucket=BUCKET, run_prefix=run_prefix, world_size=2))
    assert found.manifest is None
    assert found.skipped and found.skipped[0].startswith("step 10: shard of rank 0"), found.skipped


def test_a_half_uploaded_step_overtaken_by_a_newer_commit_holds_the_last_pass_only_while_retention_keeps_it(
    stack: DevStack, store_env: None, prefix: str
) -> None:
    """A node's upload of step 10 never finished (its node died mid-checkpoint) and step 20 committed. While
    retention keeps two, step 10 may still be uploading: the run's last pass waits for it, and never gives the
    checkpoint up. Keeping one, retention clears its folder, and the last pass returns at once instead of
    holding the finished run for its quiet period."""
    s3 = stack.s3()
    run_prefix = f"{prefix}/ck-superseded"
    store = StoreActivities()
    upload(BUCKET, run_prefix, "ck-s", 10, {0: b"step 10 rank 0" * 64})  # rank 1's node never uploaded
    upload(BUCKET, run_prefix, "ck-s", 20, {rank: f"step 20 rank {rank}".encode() * 64 for rank in (0, 1)})
    assert [c.ref.step for c in commit_once(store, BUCKET, run_prefix, "ck-s", 10, 2, keep_last=2).commits] == [20]

    def last_pass(keep_last: int) -> float:
        began = time.monotonic()
        result = commit_once(store, BUCKET, run_prefix, "ck-s", 21, 2, keep_last=keep_last, quiet_s=1.0,
                             max_duration_s=60.0, poll_interval_s=0.1)
        assert result.commits == [] and result.store_error is None
        return time.monotonic() - began

    assert last_pass(keep_last=2) >= 1.0, "waited for the step that may still be uploading"
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix=step_prefix(run_prefix, 10)).get("Contents"), "kept"
    assert last_pass(keep_last=1) < 1.0, "returned at once: nothing of this run is left uploading"
    assert not s3.list_objects_v2(Bucket=BUCKET, Prefix=step_prefix(run_prefix, 10)).get("Contents"), "cleared"
    assert read_manifest(s3, BUCKET, manifest_key(run_prefix, 20)) is not None


def test_a_shrunk_run_finds_the_larger_worlds_checkpoint_only_when_allowed(
    stack: DevStack, store_env: None, prefix: str
) -> None:
    s3 = stack.s3()
    run_prefix = f"{prefix}/ck-shrink"
    assert checkpoint(StoreActivities(), BUCKET, run_prefix, "ck-k", 10,
                      {rank: f"rank {rank}".encode() * 64 for rank in range(3)}) is not None
    s3.delete_object(Bucket=BUCKET, Key=shard_key(run_prefix, 10, 2))  # the lost node's: the smaller world needs none

    def find(world_size: int, max_world_size: int | None, min_world_size: int | None = None) -> FindCheckpointResult:
        return StoreActivities()._find(FindCheckpointInput(bucket=BUCKET, run_prefix=run_prefix, world_size=world_size,
                                                           max_world_size=max_world_size,
                                                           min_world_size=min_world_size))

    assert find(2, None).manifest is None  # a run that never shrank takes only its own world's checkpoints
    assert "written by 3 ranks, run has 2" in find(2, None).skipped[0]
    found = find(2, 3)
    assert found.manifest is not None and (found.manifest.step, found.manifest.world_size) == (10, 3)
    assert find(3, None).manifest is None  # the full world needs the missing shard

    # The shrunk run commits as a world of two; grown back to three, rank 2 restores shard 2 mod 2 = 0.
    assert checkpoint(StoreActivities(), BUCKET, run_prefix, "ck-k", 20,
                      {rank: f"world 2 rank {rank}".encode() * 64 for rank in range(2)}, attempt=2) is not None
    assert find(3, 3).manifest is None  # only with min_nodes may a larger world restore a smaller one
    grown = find(3, 3, min_world_size=2)
    assert grown.manifest is not None and (grown.manifest.step, grown.manifest.world_size) == (20, 2)


def test_upload_skips_an_intact_shard_and_repairs_a_rotted_one(
    stack: DevStack, store_env: None, prefix: str, tmp_path: Path
) -> None:
    s3 = stack.s3()
    run_prefix = f"{prefix}/ck-repair"
    local = tmp_path / shard_name(0)
    local.write_bytes(bytes(range(256)) * 64)
    shard = _put_shard(s3, run_prefix, 10, 0, local.read_bytes())
    agent = NodeCheckpointActivities("node-x", tmp_path)
    manifest = manifest_key(run_prefix, 10)

    intact = s3.head_object(Bucket=BUCKET, Key=shard.key)["LastModified"]
    time.sleep(1.1)  # LastModified has one-second resolution
    agent._upload_one(BUCKET, local, shard, manifest)
    assert s3.head_object(Bucket=BUCKET, Key=shard.key)["LastModified"] == intact  # skipped, not re-sent

    rewrite_shard(s3, shard.key, flip_byte)
    assert check_shard_in_store(s3, BUCKET, shard) is None  # size and metadata still vouch for it
    agent._upload_one(BUCKET, local, shard, manifest)
    assert s3.get_object(Bucket=BUCKET, Key=shard.key)["Body"].read() == local.read_bytes()


def test_download_keeps_no_byte_that_fails_its_checksum(
    stack: DevStack, store_env: None, prefix: str, tmp_path: Path
) -> None:
    s3 = stack.s3()
    run_prefix = f"{prefix}/ck-download"
    genuine = b"".join(i.to_bytes(4, "little") for i in range(4096))
    shard = _put_shard(s3, run_prefix, 10, 0, genuine)
    agent = NodeCheckpointActivities("node-x", tmp_path)
    restore_dir = tmp_path / "restore"
    restore_dir.mkdir()

    # Same size, same sha256 metadata, one byte different: the HEAD check passes, the bytes do not.
    rewrite_shard(s3, shard.key, flip_byte)
    assert check_shard_in_store(s3, BUCKET, shard) is None
    with pytest.raises(ApplicationError) as corrupt:
        agent._download_one(BUCKET, restore_dir, shard, tmp_path / "no-local-copy")
    assert corrupt.value.type == "CorruptCheckpoint" and corrupt.value.non_retryable
    assert list(restore_dir.iterdir()) == []

    # Gone between the reader's HEAD and the download.
    s3.delete_object(Bucket=BUCKET, Key=shard.key)
    with pytest.raises(ApplicationError) as missing:
        agent._download_one(BUCKET, restore_dir, shard, tmp_path / "no-local-copy")
    assert missing.value.type == "CorruptCheckpoint" and missing.value.non_retryable
    assert list(restore_dir.iterdir()) == []

    # The genuine bytes are kept, with the checksum the rank re-verifies before loading.
    _put_shard(s3, run_prefix, 10, 0, genuine)
    agent._download_one(BUCKET, restore_dir, shard, tmp_path / "no-local-copy")
    assert (restore_dir / shard_name(0)).read_bytes() == genuine


def test_find_checkpoint_passes_over_unreadable_manifests(
    stack: DevStack, store_env: None, prefix: str
) -> None:
    s3 = stack.s3()
    run_prefix = f"{prefix}/ck-garbage"
    assert checkpoint(StoreActivities(), BUCKET, run_prefix, "ck-g", 10,
                      {rank: f"rank {rank}".encode() * 64 for rank in (0, 1)}) is not None
    bodies = [b"", b"\x00\xff\xfe", b"[1, 2, 3]", b'{"step": "twenty"}', b"null"]
    for index, body in enumerate(bodies):
        step = 20 + 10 * index
        s3.put_object(Bucket=BUCKET, Key=shard_key(run_prefix, step, 0), Body=b"x")
        s3.put_object(Bucket=BUCKET, Key=manifest_key(run_prefix, step), Body=body)

    found = StoreActivities()._find(FindCheckpointInput(bucket=BUCKET, run_prefix=run_prefix, world_size=2))

    assert found.manifest is not None and found.manifest.step == 10
    newest_first = [f"step {20 + 10 * i}" for i in reversed(range(len(bodies)))]
    assert [r.split(":")[0] for r in found.skipped] == newest_first
    assert all("unreadable manifest" in r for r in found.skipped), found.skipped


def test_janitor_aborts_only_uploads_older_than_its_bound(stack: DevStack, prefix: str) -> None:
    s3 = stack.s3()
    key = shard_key(f"{prefix}/ck-janitor", 10, 0)
    upload = s3.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    try:
        now = time.time()
        assert abort_orphaned_uploads(s3, BUCKET, f"{prefix}/ck-janitor", older_than_s=60, now=now) == []
        later = now + 61
        assert abort_orphaned_uploads(s3, BUCKET, f"{prefix}/ck-janitor", older_than_s=60, now=later) == [key]
        assert not s3.list_multipart_uploads(Bucket=BUCKET, Prefix=f"{prefix}/").get("Uploads")
    finally:
        try:
            s3.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload)
        except ClientError:
            pass


def test_a_published_relaunch_is_read_back_by_the_nodes_and_never_replaced_by_an_older_one(
        stack: DevStack, store_env: None, prefix: str, tmp_path: Path) -> None:
    """A large run's relaunch decision goes through the real store: the node reads it back (again only when it
    changed), and a retried publish of an older attempt leaves the newer decision in place."""
    run_prefix = f"{prefix}/ck-decision"
    target = WatchCheckpoints(bucket=BUCKET, run_prefix=run_prefix)
    node = NodeCheckpointActivities("node-x", tmp_path)
    assert node.read_decision(target) is None, "nothing published yet"

    def decision(attempt: int) -> AttemptDecision:
        launch = LaunchRanksInput(workflow_id="ck-d", chain_id="c1", attempt=attempt, node="", node_rank=0,
                                  num_nodes=2, ranks_per_node=1, master_addr="10.0.0.1", master_port=29500,
                                  entrypoint=["python", "train.py"], restore_step=10 * attempt)
        return AttemptDecision(workflow_id="ck-d", chain_id="c1", attempt=attempt, launch=launch,
                               starters=["node-a"], launched=["node-a"])

    store = StoreActivities()
    store._publish(PublishAttemptInput(bucket=BUCKET, run_prefix=run_prefix, decision=decision(3)))
    read = node.read_decision(target)
    assert read is not None and read.attempt == 3 and read.launch.restore_step == 30
    assert node.read_decision(target) == read  # unchanged: answered from what it read, by its ETag
    etag = stack.s3().head_object(Bucket=BUCKET, Key=decision_key(run_prefix))["ETag"]
    with pytest.raises(ClientError) as unchanged:
        stack.s3().get_object(Bucket=BUCKET, Key=decision_key(run_prefix), IfNoneMatch=etag)
    assert not_modified(unchanged.value), "the store answers an unchanged decision without its body"

    store._publish(PublishAttemptInput(bucket=BUCKET, run_prefix=run_prefix, decision=decision(2)))
    assert node.read_decision(target).attempt == 3, "an older attempt's publish changed nothing"
    store._publish(PublishAttemptInput(bucket=BUCKET, run_prefix=run_prefix, decision=decision(4)))
    assert node.read_decision(target).attempt == 4
    assert list_steps(stack.s3(), BUCKET, run_prefix) == [], "the decision is not taken for a checkpoint step"


# ------------------------------------------------------------------------ owners (issue 27 item 5)


def _committed(s3: Any, run_prefix: str) -> dict[int, bytes]:
    """Step -> manifest bytes of every committed checkpoint under `run_prefix`."""
    found: dict[int, bytes] = {}
    for step in list_steps(s3, BUCKET, run_prefix):
        try:
            found[step] = s3.get_object(Bucket=BUCKET, Key=manifest_key(run_prefix, step))["Body"].read()
        except ClientError:
            pass
    return found


async def test_a_run_naming_another_runs_namespace_neither_restores_nor_prunes_it(
    client: TrainguardClient, stack: DevStack, source: Source
) -> None:
    """The finding: a run with `checkpoint.namespace` set to the source run's restored its checkpoint, and its
    `keep_last: 1` deleted the source's. Now it fails at once naming the owner, before any rank runs; the
    source's checkpoints are untouched, and a run that names the source with `resume_from` starts from them,
    commits to its own namespace and leaves them all in place."""
    from temporalio.client import WorkflowFailureError

    s3 = stack.s3()
    prefix, owner = source.run_prefix.split("/")
    before = _committed(s3, source.run_prefix)
    assert sorted(before) == [10, 20, 30, 40]
    attacker = f"ck-attacker-{uuid.uuid4().hex[:6]}"
    spec = spec_for(prefix, keep_last=1)
    spec["checkpoint"]["namespace"] = owner

    await client.start_run(spec, workflow_id=attacker)
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(client.result(attacker), RUN_TIMEOUT_S)

    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidSpec", cause
    assert f"belongs to run {owner!r}" in cause.message and f"--resume-from {owner}" in cause.message
    assert await activity_calls(client, attacker, "launch_ranks", LaunchRanksInput) == []
    assert _committed(s3, source.run_prefix) == before

    follower = f"ck-follower-{uuid.uuid4().hex[:6]}"
    follow = spec_for(prefix, keep_last=1)
    follow["entrypoint"][follow["entrypoint"].index("--steps") + 1] = str(STEPS + 20)
    await client.start_run(follow, workflow_id=follower, resume_from=owner)
    result = await asyncio.wait_for(client.result(follower), RUN_TIMEOUT_S)

    assert result.steps_completed == STEPS + 20
    launches = await activity_calls(client, follower, "launch_ranks", LaunchRanksInput)
    assert [request.restore_step for request, _ in launches] == [STEPS], launches
    assert result.final_checkpoint is not None
    assert result.final_checkpoint.manifest_key.startswith(f"{prefix}/{follower}/")
    assert _committed(s3, source.run_prefix) == before  # its retention (keep_last 1) never reached the source
    assert sorted(_committed(s3, f"{prefix}/{follower}")) == [STEPS + 20]


async def test_a_new_run_under_a_closed_runs_id_neither_restores_nor_prunes_its_checkpoints(
    client: TrainguardClient, stack: DevStack, source: Source
) -> None:
    """Issue 40 finding 5: `temporal workflow start --workflow-id <victim>` (no client, so no fresh namespace)
    restored the victim's step 40, and its `keep_last: 1` deleted the victim's older steps. It is another run
    (chain) under the same id: it fails at once, before any rank runs, and the victim's checkpoints stay."""
    from temporalio.client import WorkflowFailureError

    from trainguard import TASK_QUEUE, WORKFLOW_TYPE
    from trainguard.client import load_spec

    s3 = stack.s3()
    prefix, victim = source.run_prefix.split("/")
    before = _committed(s3, source.run_prefix)
    assert sorted(before) == [10, 20, 30, 40]

    await client.client.start_workflow(WORKFLOW_TYPE, load_spec(spec_for(prefix, keep_last=1)).model_dump(mode="json"),
                                       id=victim, task_queue=TASK_QUEUE)
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(client.result(victim), RUN_TIMEOUT_S)

    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidSpec", cause
    assert "earlier run under the id" in cause.message and "--resume" in cause.message
    assert await activity_calls(client, victim, "launch_ranks", LaunchRanksInput) == []
    assert _committed(s3, source.run_prefix) == before


def test_a_planted_manifest_is_refused_by_a_controller_with_a_key(
    stack: DevStack, store_env: None, prefix: str
) -> None:
    """On the real store: the controller's commits carry its tag and restore; a manifest written straight into
    the store (untagged, or tagged under another key) is passed over naming why; the namespace's claim is a
    conditional write, so of two runs claiming it one wins."""
    run_prefix = f"{prefix}/ck-tagged"
    store = StoreActivities(b"k" * 64)

    def find(workflow_id: str) -> FindCheckpointResult:
        return store._find(FindCheckpointInput(bucket=BUCKET, run_prefix=run_prefix, world_size=2,
                                               workflow_id=workflow_id))

    assert find("ck-t").manifest is None  # the claim
    with pytest.raises(ApplicationError, match="belongs to run 'ck-t'"):
        find("ck-other")
    assert checkpoint(store, BUCKET, run_prefix, "ck-t", 10,
                      {rank: f"rank {rank}".encode() * 64 for rank in (0, 1)}) is not None
    # Planted: committed by a controller without the key, and by one with another key.
    for step, planter in ((20, StoreActivities()), (30, StoreActivities(b"x" * 64))):
        assert checkpoint(planter, BUCKET, run_prefix, "ck-t", step,
                          {rank: f"planted {step} {rank}".encode() * 64 for rank in (0, 1)}) is not None

    found = find("ck-t")

    assert found.manifest is not None and found.manifest.step == 10
    assert [r.split(":")[0] for r in found.skipped] == ["step 30", "step 20"]
    assert "integrity tag does not match" in found.skipped[0] and "no integrity tag" in found.skipped[1]
    # The control: a controller without a key restores the newest planted one.
    assert StoreActivities()._find(FindCheckpointInput(bucket=BUCKET, run_prefix=run_prefix, world_size=2,
                                                       workflow_id="ck-t")).manifest.step == 30  # type: ignore[union-attr]
