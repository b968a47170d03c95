"""A checkpoint namespace has an owner (issue 27 item 5), against an in-memory S3.

The findings: a run naming another run's `checkpoint.namespace` restored the other run's checkpoint, and its
`keep_last: 1` then deleted the victim's checkpoints; a manifest planted in the store was restored like the
controller's own. Each test here reproduces one and shows it refused.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from activities.checkpoint_layout import manifest_key, manifest_tag, owner_key, step_prefix
from activities.checkpoint_store import StoreActivities, manifest_key_from_env
from activities.store_reads import read_manifest
from activities.models import FindCheckpointInput, Manifest, PruneCheckpointsInput, ShardInfo
from tests.agent_checkpoints import KEEP_ALL, checkpoint
from tests.unit.s3_fake import MemoryStore, memory_store
from trainguard.error_types import ErrorType
from trainguard.protocol import shard_name

BUCKET = "b"
VICTIM, ATTACKER = "victim-run", "attacker-run"
KEY = b"k" * 64


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    return memory_store(monkeypatch)


def _commit(activities: StoreActivities, run_prefix: str, workflow_id: str, step: int,
            keep_last: int = KEEP_ALL, chain_id: str = "") -> None:
    """What run `workflow_id` commits at `step`: its two ranks' shards uploaded by their nodes' agents, then its
    committer's pass (retention keeping `keep_last`)."""
    bodies = {rank: f"{workflow_id} step {step} rank {rank}".encode() for rank in (0, 1)}
    committed = checkpoint(activities, BUCKET, run_prefix, workflow_id, step, bodies, chain_id=chain_id,
                           keep_last=keep_last)
    assert committed is not None and committed.step == step


def _find(activities: StoreActivities, run_prefix: str, workflow_id: str | None, **more: Any) -> Any:
    return activities._find(FindCheckpointInput(bucket=BUCKET, run_prefix=run_prefix, world_size=2,
                                                workflow_id=workflow_id, **more))


def _victim_with_checkpoints(store: MemoryStore, activities: StoreActivities, chain_id: str = "",
                              allow_resume: list[str] | None = None) -> str:
    """The victim's namespace (its workflow id, the default), claimed by its first restore, steps 10 and 20."""
    prefix = f"runs/{VICTIM}"
    # Its first attempt: nothing yet, the claim.
    assert _find(activities, prefix, VICTIM, chain_id=chain_id, allow_resume=allow_resume).manifest is None
    _commit(activities, prefix, VICTIM, 10, chain_id=chain_id)
    _commit(activities, prefix, VICTIM, 20, chain_id=chain_id)
    return prefix


# -------------------------------------------------------------------------------------------- owners


def test_a_run_naming_another_runs_namespace_is_refused_before_it_restores(store: MemoryStore) -> None:
    activities = StoreActivities()
    prefix = _victim_with_checkpoints(store, activities)
    before = dict(store.objects)

    with pytest.raises(ApplicationError) as refused:
        _find(activities, prefix, ATTACKER)  # checkpoint.namespace: victim-run

    assert refused.value.type == ErrorType.BAD_SPEC and refused.value.non_retryable
    assert f"belongs to run {VICTIM!r}" in refused.value.message
    assert f"--resume-from {VICTIM}" in refused.value.message
    assert store.objects == before  # nothing read was changed, no claim written over the victim's
    # The victim itself still restores its newest.
    found = _find(activities, prefix, VICTIM)
    assert found.manifest is not None and found.manifest.step == 20 and found.manifest.workflow_id == VICTIM


def test_a_namespace_from_before_owners_belongs_to_its_newest_manifests_run(store: MemoryStore) -> None:
    activities = StoreActivities()
    prefix = f"runs/{VICTIM}"
    _commit(activities, prefix, VICTIM, 10)  # written before owners: no owner.json
    assert owner_key(prefix) not in store.objects

    with pytest.raises(ApplicationError, match=f"belongs to run {VICTIM!r}"):
        _find(activities, prefix, ATTACKER)
    assert owner_key(prefix) not in store.objects  # the attacker claimed nothing

    assert _find(activities, prefix, VICTIM).manifest.step == 10  # type: ignore[union-attr]
    assert json.loads(store.objects[owner_key(prefix)])["workflow_id"] == VICTIM


def test_a_run_resuming_its_own_id_restores_as_before(store: MemoryStore) -> None:
    """Continue-as-new, a relaunch and a rerun under the same id share the workflow id: the same owner."""
    activities = StoreActivities()
    prefix = _victim_with_checkpoints(store, activities)
    for _ in range(2):
        found = _find(activities, prefix, VICTIM)
        assert found.manifest is not None and found.manifest.step == 20 and found.skipped == []


def test_retention_prunes_only_the_runs_own_checkpoints(store: MemoryStore) -> None:
    """Were an attacker's commits to land in the victim's namespace (written around the refusal), its
    `keep_last: 1` deletes none of the victim's checkpoints, and the victim goes on restoring its own."""
    activities = StoreActivities()
    prefix = _victim_with_checkpoints(store, activities)
    victims = {k: v for k, v in store.objects.items() if "/step-" in k}
    _commit(activities, prefix, ATTACKER, 30)
    _commit(activities, prefix, ATTACKER, 40)

    deleted = activities._prune(PruneCheckpointsInput(bucket=BUCKET, run_prefix=prefix, keep_last=1,
                                                      workflow_id=ATTACKER, protect_steps=[40]))

    assert deleted.deleted_steps == [30]  # its own older one
    assert all(store.objects.get(k) == v for k, v in victims.items())
    found = _find(activities, prefix, VICTIM)
    assert found.manifest is not None and found.manifest.step == 20
    assert found.skipped == [f"step 40: committed by run {ATTACKER!r}, not {VICTIM!r}"]


def test_retention_of_the_victim_itself_still_prunes_its_own(store: MemoryStore) -> None:
    """The negative control: the same retention under the owner's id deletes what it always did."""
    activities = StoreActivities()
    prefix = _victim_with_checkpoints(store, activities)
    deleted = activities._prune(PruneCheckpointsInput(bucket=BUCKET, run_prefix=prefix, keep_last=1,
                                                      workflow_id=VICTIM, protect_steps=[20]))
    assert deleted.deleted_steps == [10]
    assert manifest_key(prefix, 10) not in store.objects


def test_resume_from_restores_the_named_runs_checkpoint_then_the_runs_own(store: MemoryStore) -> None:
    activities = StoreActivities()
    source = _victim_with_checkpoints(store, activities, allow_resume=[ATTACKER])
    prefix = f"runs/{ATTACKER}"
    resume = {"resume_from": VICTIM, "resume_prefix": source}

    found = _find(activities, prefix, ATTACKER, **resume)
    assert found.manifest_key == manifest_key(source, 20) and found.manifest.workflow_id == VICTIM  # type: ignore[union-attr]

    _commit(activities, prefix, ATTACKER, 30, keep_last=1)
    _commit(activities, prefix, ATTACKER, 40, keep_last=1)
    activities._prune(PruneCheckpointsInput(bucket=BUCKET, run_prefix=prefix, keep_last=1, workflow_id=ATTACKER))
    found = _find(activities, prefix, ATTACKER, **resume)
    assert found.manifest_key == manifest_key(prefix, 40)
    # Its retention never reached the run it resumed from.
    assert manifest_key(source, 10) in store.objects and manifest_key(source, 20) in store.objects


def test_resume_from_restores_only_what_the_named_run_committed(store: MemoryStore) -> None:
    activities = StoreActivities()
    source = _victim_with_checkpoints(store, activities, allow_resume=[ATTACKER])
    _commit(activities, source, "third-run", 30)  # in the source's folder, by someone else

    found = _find(activities, f"runs/{ATTACKER}", ATTACKER, resume_from=VICTIM, resume_prefix=source)

    assert found.manifest_key == manifest_key(source, 20)
    assert found.skipped == [f"run {VICTIM}: step 30: committed by run 'third-run', not {VICTIM!r}"]


# -------------------------------------------------------------------------------------------- chains
# Issue 40 finding 5: a closed run's checkpoints were taken over by starting a new run under its workflow id
# (`temporal workflow start --workflow-id <victim>`): it restored the victim's step 20, and its `keep_last: 1`
# deleted the victim's steps 10 and 20. A run is its workflow id and its chain (first execution's run id).

CHAIN, RERUN = "chain-victim", "chain-rerun"


def test_a_new_run_under_a_closed_runs_id_is_refused_its_namespace(store: MemoryStore) -> None:
    activities = StoreActivities()
    prefix = _victim_with_checkpoints(store, activities, chain_id=CHAIN)
    before = dict(store.objects)

    with pytest.raises(ApplicationError) as refused:
        _find(activities, prefix, VICTIM, chain_id=RERUN)

    assert refused.value.type == ErrorType.BAD_SPEC and refused.value.non_retryable
    assert "earlier run under the id" in refused.value.message
    assert "checkpoint.prefix" in refused.value.message and "--resume" in refused.value.message
    assert store.objects == before  # nothing restored from, nothing claimed over the victim's record
    # Continue-as-new keeps the chain: the victim itself still restores its newest.
    assert _find(activities, prefix, VICTIM, chain_id=CHAIN).manifest.step == 20  # type: ignore[union-attr]


def test_retention_of_a_run_reusing_a_closed_runs_id_never_deletes_its_checkpoints(store: MemoryStore) -> None:
    activities = StoreActivities()
    prefix = _victim_with_checkpoints(store, activities, chain_id=CHAIN)
    victims = {k: v for k, v in store.objects.items() if "/step-" in k}
    _commit(activities, prefix, VICTIM, 30, chain_id=RERUN)  # around the refusal
    _commit(activities, prefix, VICTIM, 40, chain_id=RERUN)

    deleted = activities._prune(PruneCheckpointsInput(bucket=BUCKET, run_prefix=prefix, keep_last=1,
                                                      workflow_id=VICTIM, chain_id=RERUN, protect_steps=[40]))

    assert deleted.deleted_steps == [30]  # its own older one
    assert all(store.objects.get(k) == v for k, v in victims.items())
    # The negative control: the victim's own chain prunes its own as it always did.
    deleted = activities._prune(PruneCheckpointsInput(bucket=BUCKET, run_prefix=prefix, keep_last=1,
                                                      workflow_id=VICTIM, chain_id=CHAIN, protect_steps=[20]))
    assert deleted.deleted_steps == [10]


def test_an_explicit_resume_of_its_own_id_takes_the_namespace_over_and_spares_the_earlier_runs(
        store: MemoryStore) -> None:
    """`trainguard run start --resume` (spec: `checkpoint.resume_from` its own id): allowed by default, as a
    rerun of a run under its id (a requeued Slurm job's `slurm-<job>`) relies on it."""
    activities = StoreActivities()
    prefix = _victim_with_checkpoints(store, activities, chain_id=CHAIN)
    resume = {"chain_id": RERUN, "resume_from": VICTIM, "resume_prefix": prefix}

    found = _find(activities, prefix, VICTIM, **resume)

    assert found.manifest_key == manifest_key(prefix, 20)
    assert json.loads(store.objects[owner_key(prefix)])["chain_id"] == RERUN
    _commit(activities, prefix, VICTIM, 30, chain_id=RERUN)
    _commit(activities, prefix, VICTIM, 40, chain_id=RERUN)
    deleted = activities._prune(PruneCheckpointsInput(bucket=BUCKET, run_prefix=prefix, keep_last=1,
                                                      workflow_id=VICTIM, chain_id=RERUN, protect_steps=[40]))
    assert deleted.deleted_steps == [30]
    assert manifest_key(prefix, 10) in store.objects and manifest_key(prefix, 20) in store.objects
    assert _find(activities, prefix, VICTIM, **resume).manifest_key == manifest_key(prefix, 40)
    with pytest.raises(ApplicationError, match="earlier run under the id"):
        _find(activities, prefix, VICTIM, chain_id=CHAIN)  # the namespace is the new run's now


def test_an_owner_allowing_no_resume_refuses_its_own_id_too(store: MemoryStore) -> None:
    activities = StoreActivities()
    prefix = _victim_with_checkpoints(store, activities, chain_id=CHAIN, allow_resume=[])
    before = dict(store.objects)

    with pytest.raises(ApplicationError) as refused:
        _find(activities, prefix, VICTIM, chain_id=RERUN, resume_from=VICTIM, resume_prefix=prefix)

    assert refused.value.type == ErrorType.BAD_SPEC and refused.value.non_retryable
    assert "checkpoint.allow_resume" in refused.value.message
    assert store.objects == before


@pytest.mark.parametrize(("allow_resume", "restores"), [
    pytest.param(None, False, id="default-its-own-id-only"),
    pytest.param(["third-run"], False, id="another-run-named"),
    pytest.param([ATTACKER], True, id="this-run-named"),
    pytest.param(["*"], True, id="any-run"),
])
def test_resume_from_another_run_needs_its_owners_consent(store: MemoryStore, allow_resume: list[str] | None,
                                                          restores: bool) -> None:
    activities = StoreActivities()
    source = _victim_with_checkpoints(store, activities, chain_id=CHAIN, allow_resume=allow_resume)
    resume = {"chain_id": "chain-reader", "resume_from": VICTIM, "resume_prefix": source}

    if restores:
        assert _find(activities, f"runs/{ATTACKER}", ATTACKER, **resume).manifest_key == manifest_key(source, 20)
        return
    with pytest.raises(ApplicationError) as refused:
        _find(activities, f"runs/{ATTACKER}", ATTACKER, **resume)
    assert refused.value.type == ErrorType.BAD_SPEC and refused.value.non_retryable
    assert "checkpoint.allow_resume" in refused.value.message and ATTACKER in refused.value.message


def test_an_owner_record_from_before_chains_takes_the_chain_of_its_run_in_flight(store: MemoryStore) -> None:
    activities = StoreActivities()
    prefix = f"runs/{VICTIM}"
    store.objects[owner_key(prefix)] = json.dumps({"workflow_id": VICTIM, "claimed_at": 1.0}).encode()
    _commit(activities, prefix, VICTIM, 10)  # committed before chains were recorded

    assert _find(activities, prefix, VICTIM, chain_id=CHAIN).manifest.step == 10  # type: ignore[union-attr]

    assert json.loads(store.objects[owner_key(prefix)])["chain_id"] == CHAIN
    with pytest.raises(ApplicationError, match="earlier run under the id"):
        _find(activities, prefix, VICTIM, chain_id=RERUN)


def test_an_owner_record_from_before_chains_belongs_to_the_chain_of_its_newest_manifest(
        store: MemoryStore) -> None:
    """Its run ended before chains were in the record, after its manifests carried its chain: a new run under
    its id is another chain, refused like one."""
    activities = StoreActivities()
    prefix = f"runs/{VICTIM}"
    store.objects[owner_key(prefix)] = json.dumps({"workflow_id": VICTIM, "claimed_at": 1.0}).encode()
    _commit(activities, prefix, VICTIM, 10, chain_id=CHAIN)
    before = dict(store.objects)

    with pytest.raises(ApplicationError, match="earlier run under the id"):
        _find(activities, prefix, VICTIM, chain_id=RERUN)
    assert store.objects == before
    assert _find(activities, prefix, VICTIM, chain_id=CHAIN).manifest.step == 10  # type: ignore[union-attr]


# ----------------------------------------------------------------------------------------- integrity


def test_the_controller_tags_what_it_commits_and_restores_it(store: MemoryStore) -> None:
    activities = StoreActivities(KEY)
    prefix = _victim_with_checkpoints(store, activities)
    document = json.loads(store.objects[manifest_key(prefix, 20)])
    assert document["tag"] == manifest_tag(document, KEY)
    assert read_manifest(store, BUCKET, manifest_key(prefix, 20), secret=KEY) is not None
    assert _find(activities, prefix, VICTIM).manifest.step == 20  # type: ignore[union-attr]


def _plant(store: MemoryStore, prefix: str, step: int, tag: str | None, **changes: Any) -> None:
    """A manifest written straight into the store (anyone with its credentials), naming real shards."""
    shards = []
    for rank in (0, 1):
        key = f"{step_prefix(prefix, step)}{shard_name(rank)}"
        store.objects[key] = b"planted " + bytes([rank])
        shards.append(ShardInfo(rank=rank, key=key, size_bytes=9, sha256=hashlib.sha256(store.objects[key]).hexdigest()))
    document = Manifest(workflow_id=VICTIM, step=step, world_size=2, attempt=1, shards=shards).model_dump(mode="json")
    document.update(changes)
    document["tag"] = tag
    store.objects[manifest_key(prefix, step)] = json.dumps(document).encode()


@pytest.mark.parametrize(("tag", "why"), [
    pytest.param(None, "manifest has no integrity tag", id="missing"),
    pytest.param("00" * 32, "integrity tag does not match", id="wrong"),
    pytest.param("other-key", "integrity tag does not match", id="another-key"),
])
def test_a_planted_manifest_is_passed_over_naming_why(store: MemoryStore, tag: str | None, why: str) -> None:
    activities = StoreActivities(KEY)
    prefix = _victim_with_checkpoints(store, activities)
    if tag == "other-key":
        probe = Manifest(workflow_id=VICTIM, step=30, world_size=2, attempt=1).model_dump(mode="json")
        tag = manifest_tag(probe, b"x" * 64)
    _plant(store, prefix, 30, tag)

    found = _find(activities, prefix, VICTIM)

    assert found.manifest is not None and found.manifest.step == 20
    assert len(found.skipped) == 1 and found.skipped[0].startswith("step 30: ") and why in found.skipped[0]


def test_a_tagged_manifest_changed_after_the_commit_is_refused(store: MemoryStore) -> None:
    activities = StoreActivities(KEY)
    prefix = _victim_with_checkpoints(store, activities)
    key = manifest_key(prefix, 20)
    document = json.loads(store.objects[key])
    document["shards"][0]["sha256"] = "ab" * 32  # points the victim at other bytes, keeps the old tag
    store.objects[key] = json.dumps(document).encode()

    found = _find(activities, prefix, VICTIM)

    assert found.manifest is not None and found.manifest.step == 10
    assert "integrity tag does not match" in found.skipped[0]


def test_without_a_key_an_untagged_manifest_is_restored(store: MemoryStore) -> None:
    """The negative control: the planted manifest passes a controller without a key (as before the fix)."""
    activities = StoreActivities()
    prefix = _victim_with_checkpoints(store, activities)
    _plant(store, prefix, 30, None)
    assert _find(activities, prefix, VICTIM).manifest.step == 30  # type: ignore[union-attr]


def test_a_planted_manifest_never_makes_retention_delete_real_checkpoints(store: MemoryStore) -> None:
    activities = StoreActivities(KEY)
    prefix = _victim_with_checkpoints(store, activities)
    _plant(store, prefix, 900, None)  # "newest", in the victim's own name

    activities._prune(PruneCheckpointsInput(bucket=BUCKET, run_prefix=prefix, keep_last=1, workflow_id=VICTIM,
                                            protect_steps=[20]))

    assert manifest_key(prefix, 20) in store.objects  # kept: the planted step counted for nothing
    assert manifest_key(prefix, 900) in store.objects  # and was not the controller's to delete either


def test_a_short_manifest_key_is_refused_and_none_is_no_key() -> None:
    assert manifest_key_from_env({}) is None
    assert manifest_key_from_env({"TRAINGUARD_MANIFEST_KEY": " "}) is None
    assert manifest_key_from_env({"TRAINGUARD_MANIFEST_KEY": "a" * 40}) == b"a" * 40
    with pytest.raises(ValueError, match="fewer than 32"):
        manifest_key_from_env({"TRAINGUARD_MANIFEST_KEY": "short"})


# ------------------------------------------------------------------------------------------- the client


class _StartOnly:
    """A Temporal client that records what `start_workflow` was given."""

    def __init__(self) -> None:
        self.specs: list[dict[str, Any]] = []

    async def start_workflow(self, _workflow: str, spec: dict[str, Any], **_: Any) -> None:
        self.specs.append(spec)


@pytest.mark.parametrize(("resume", "namespace", "resume_from"), [
    pytest.param(True, None, VICTIM, id="resume-names-its-own-id"),
    pytest.param(False, "fresh", None, id="a-rerun-starts-fresh"),
])
async def test_run_start_resume_is_recorded_as_an_explicit_resume_of_its_own_id(
        monkeypatch: pytest.MonkeyPatch, resume: bool, namespace: str | None, resume_from: str | None) -> None:
    """`--resume` used to say only "no fresh namespace": the run could not tell a resume from a takeover."""
    from trainguard.client import TrainguardClient

    temporal = _StartOnly()
    client = TrainguardClient(temporal)  # type: ignore[arg-type]

    async def earlier(_workflow_id: str) -> str:
        return "COMPLETED"

    monkeypatch.setattr(client, "earlier_run", earlier)
    await client.start_run({"entrypoint": ["python"], "nodes": ["node-0"]}, workflow_id=VICTIM, resume=resume)

    [spec] = temporal.specs
    assert spec["checkpoint"]["resume_from"] == resume_from
    assert (spec["checkpoint"]["namespace"] or "").startswith(VICTIM) == (namespace is not None)
    with pytest.raises(ValueError, match="name one run"):
        await client.start_run({"entrypoint": ["python"], "nodes": ["node-0"], "checkpoint": {"resume_from": "x"}},
                               workflow_id=VICTIM, resume=True)
