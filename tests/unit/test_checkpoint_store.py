"""The store's decisions: which manifests a reader trusts, which uploads the janitor aborts, which ETag."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from activities import checkpoint_store, checkpoint_transfers
from activities.checkpoint_layout import doomed_steps, manifest_problem, step_of
from activities.checkpoint_store import StoreActivities
from activities.store_reads import ORPHANED_UPLOAD_AGE_S, abort_orphaned_uploads, committed_shard
from activities.checkpoint_transfers import local_digests
from activities.models import Manifest, PruneCheckpointsInput, ShardInfo

RUN = "runs/wf-1"
NOW = 1_800_000_000.0


def _manifest(step: int = 100, world_size: int = 2, ranks: tuple[int, ...] = (0, 1),
              **changes: Any) -> Manifest:
    shards = [ShardInfo(rank=r, key=f"{RUN}/step-{step:08d}/rank-{r:05d}.pt", size_bytes=10, sha256="ab" * 32)
              for r in ranks]
    manifest = Manifest(workflow_id="wf-1", step=step, world_size=world_size, attempt=1, shards=shards)
    return manifest.model_copy(update=changes)


def _moved(manifest: Manifest, rank: int, key: str) -> Manifest:
    shards = [s.model_copy(update={"key": key}) if s.rank == rank else s for s in manifest.shards]
    return manifest.model_copy(update={"shards": shards})


@pytest.mark.parametrize(
    ("manifest", "problem"),
    [
        pytest.param(_manifest(), None, id="whole"),
        pytest.param(_manifest(ranks=(1, 0)), None, id="shards-in-any-order"),
        pytest.param(_manifest(format="trainguard-checkpoint/9"), "manifest format", id="unknown-format"),
        pytest.param(_manifest(step=90), "says step 90", id="copied-into-another-step"),
        pytest.param(_manifest(ranks=(0,)), "ranks [0], not one per rank of world size 2",
                     id="a-rank-missing"),
        pytest.param(_manifest(ranks=(0, 0)), "ranks [0, 0]", id="a-rank-twice"),
        pytest.param(_manifest(ranks=(0, 1, 2)), "ranks [0, 1, 2]", id="a-rank-beyond-world-size"),
        pytest.param(_manifest(ranks=()), "ranks []", id="no-shards"),
        pytest.param(_moved(_manifest(), 1, "runs/wf-2/step-00000100/rank-00001.pt"),
                     "shard of rank 1 at runs/wf-2", id="shard-of-another-run"),
        pytest.param(_moved(_manifest(), 0, f"{RUN}/step-00000090/rank-00000.pt"), "shard of rank 0 at",
                     id="shard-of-another-step"),
    ],
)
def test_manifest_problem(manifest: Manifest, problem: str | None) -> None:
    found = manifest_problem(manifest, RUN, 100)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_step_of_reads_the_step_folder() -> None:
    assert step_of(f"{RUN}/step-00000100/rank-00003.pt") == 100
    assert step_of(f"{RUN}/step-00000040/manifest.json") == 40


# ----------------------------------------------------------------------------------------------- janitor


def _error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}}, "Op")


class FakeStore:
    """list_multipart_uploads in pages, abort_multipart_upload; optionally a store that ignores Prefix."""

    def __init__(self, uploads: list[tuple[str, float]], page_size: int = 2, honours_prefix: bool = True,
                 abort_error: str | None = None, list_error: str | None = None) -> None:
        self.uploads: list[dict[str, Any]] = [
            {"Key": key, "UploadId": f"id-{i}", "Initiated": datetime.fromtimestamp(t, UTC)}
            for i, (key, t) in enumerate(uploads)
        ]
        self.page_size = page_size
        self.honours_prefix = honours_prefix
        self.abort_error = abort_error
        self.list_error = list_error
        self.aborted: list[str] = []
        self.prefixes: list[str] = []

    def get_paginator(self, name: str) -> Any:
        store = self

        class Paginator:
            def paginate(self, Bucket: str, Prefix: str = "", **_: Any) -> Any:
                if name == "list_objects_v2":
                    return iter([{}])
                assert name == "list_multipart_uploads"
                if store.list_error:
                    raise _error(store.list_error)
                store.prefixes.append(Prefix)
                listed = [u for u in store.uploads if not store.honours_prefix or u["Key"].startswith(Prefix)]
                return iter([{"Uploads": listed[i: i + store.page_size]}
                             for i in range(0, max(len(listed), 1), store.page_size)])

        return Paginator()

    def abort_multipart_upload(self, Bucket: str, Key: str, UploadId: str) -> None:
        if self.abort_error:
            raise _error(self.abort_error)
        self.aborted.append(Key)


def test_janitor_aborts_uploads_under_the_folder_older_than_the_bound() -> None:
    store = FakeStore([
        (f"{RUN}/step-00000100/rank-00000.pt", NOW - 7200),
        (f"{RUN}/step-00000200/rank-00000.pt", NOW - 60),  # may still be in flight
        (f"{RUN}/step-00000100/rank-00001.pt", NOW - 3600),  # exactly the bound: old enough
        (f"{RUN}x/step-00000100/rank-00000.pt", NOW - 7200),  # a sibling run sharing the string
        ("runs/wf-2/step-00000100/rank-00000.pt", NOW - 7200),
    ], honours_prefix=False)

    aborted = abort_orphaned_uploads(store, "b", RUN, older_than_s=3600, now=NOW)

    expected = [f"{RUN}/step-00000100/rank-00000.pt", f"{RUN}/step-00000100/rank-00001.pt"]
    assert aborted == store.aborted == expected
    assert store.prefixes == [f"{RUN}/"]


def test_janitor_with_no_bound_aborts_everything_under_the_folder() -> None:
    store = FakeStore([(f"{RUN}/step-{s:08d}/rank-00000.pt", NOW) for s in range(5)], page_size=2)
    assert len(abort_orphaned_uploads(store, "b", f"{RUN}/", older_than_s=0, now=NOW)) == 5


def test_janitor_tolerates_an_upload_finished_meanwhile_but_not_other_errors() -> None:
    key = f"{RUN}/step-00000100/rank-00000.pt"
    finished = FakeStore([(key, 0)], abort_error="NoSuchUpload")
    assert abort_orphaned_uploads(finished, "b", RUN, now=NOW) == [key]
    with pytest.raises(ClientError):
        abort_orphaned_uploads(FakeStore([(key, 0)], abort_error="AccessDenied"), "b", RUN, now=NOW)


def test_janitor_bound_outlives_an_upload_attempt() -> None:
    from workflows.node_calls import TRANSFER_TIMEOUT

    assert ORPHANED_UPLOAD_AGE_S >= 2 * TRANSFER_TIMEOUT.total_seconds()


def test_prune_runs_the_janitor_and_survives_a_store_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    old, fresh = f"{RUN}/step-00000100/rank-00000.pt", f"{RUN}/step-00000200/rank-00000.pt"
    store = FakeStore([(old, time.time() - ORPHANED_UPLOAD_AGE_S - 60), (fresh, time.time() - 60)])
    monkeypatch.setattr(checkpoint_store, "s3_client", lambda: store)
    request = PruneCheckpointsInput(bucket="b", run_prefix=RUN, keep_last=2)
    StoreActivities()._prune(request)
    assert store.aborted == [old]

    monkeypatch.setattr(checkpoint_store, "s3_client", lambda: FakeStore([], list_error="NotImplemented"))
    assert StoreActivities()._prune(request).deleted_steps == []


@pytest.mark.parametrize("steps, committed, keep_last, protect, doomed", [
    # The newest keep_last committed stay; older committed ones go.
    ([40, 30, 20, 10], [40, 30, 20, 10], 2, [], [20, 10]),
    # Step 20 committed before step 10, whose commit is still in flight: 10 stays (keep_last 10 keeps it).
    ([20, 10], [20], 10, [20], []),
    # ... and with keep_last 1, one newer commit makes an uncommitted 10 useless: it goes.
    ([20, 10], [20], 1, [20], [10]),
    # An uncommitted folder newer than every commit may be uploading: it stays.
    ([30, 20, 10], [20, 10], 1, [20], [10]),
    # A protected step (being restored) stays whatever its age.
    ([40, 30, 20, 10], [40, 30, 20, 10], 1, [10], [30, 20]),
], ids=["retention", "out-of-order-commit-kept", "out-of-order-commit-useless", "newest-uploading", "protected"])
def test_retention_deletes_only_what_it_means_to(steps: list[int], committed: list[int], keep_last: int,
                                                 protect: list[int], doomed: list[int]) -> None:
    assert doomed_steps(steps, committed, keep_last, protect) == doomed


# ----------------------------------------------------------------------------------------------- digests


def test_local_digests_single_put(tmp_path: Path) -> None:
    path = tmp_path / "shard.pt"
    path.write_bytes(b"abc" * 1000)
    body = b"abc" * 1000
    assert local_digests(path) == (hashlib.sha256(body).hexdigest(), hashlib.md5(body).hexdigest())


@pytest.mark.parametrize("size", [64, 100, 128, 129])
def test_local_digests_multipart_etag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    monkeypatch.setattr(checkpoint_transfers, "PART_SIZE_BYTES", 64)
    monkeypatch.setattr(checkpoint_transfers, "_READ_CHUNK_BYTES", 16)
    body = bytes(range(256))[:size]
    path = tmp_path / "shard.pt"
    path.write_bytes(body)
    parts = [body[i: i + 64] for i in range(0, size, 64)]
    etag = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
    assert local_digests(path) == (hashlib.sha256(body).hexdigest(), f"{etag}-{len(parts)}")


# ----------------------------------------------------------------------------------------- committed shard


class ManifestStore:
    def __init__(self, body: bytes | None) -> None:
        self.body = body

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        if self.body is None:
            raise _error("NoSuchKey")

        class Body:
            @staticmethod
            def read() -> bytes:
                return self.body  # type: ignore[return-value]

        return {"Body": Body()}


@pytest.mark.parametrize(
    ("body", "rank", "sha"),
    [
        pytest.param(None, 0, None, id="not-committed"),
        pytest.param(b"\x00garbage", 0, None, id="unreadable-manifest-protects-nothing"),
        pytest.param(_manifest().model_dump_json().encode(), 1, "ab" * 32, id="committed"),
        pytest.param(_manifest(ranks=(0,), world_size=1).model_dump_json().encode(), 1, None,
                     id="rank-not-named"),
    ],
)
def test_committed_shard(body: bytes | None, rank: int, sha: str | None) -> None:
    shard = committed_shard(ManifestStore(body), "b", f"{RUN}/step-00000100/manifest.json", rank)
    assert (shard.sha256 if shard else None) == sha


# ------------------------------------------------------------------------ DCP shards and replicas


def _dcp_manifest(world_size: int = 2, step: int = 100) -> Manifest:
    from activities.models import ShardFile
    from trainguard.safe_load import files_digest

    shards = []
    for r in range(world_size):
        files = [ShardFile(name=f"dcp/__{r}_0.distcp", size_bytes=10, sha256=f"{r:02d}" * 32)]
        if r == 0:
            files.append(ShardFile(name="dcp/.metadata", size_bytes=5, sha256="ee" * 32))
        shards.append(ShardInfo(rank=r, key=f"{RUN}/step-{step:08d}/dcp/", files=files, node=f"node-{r}",
                                size_bytes=sum(f.size_bytes for f in files),
                                sha256=files_digest([f.model_dump() for f in files])))
    return Manifest(workflow_id="wf-1", step=step, world_size=world_size, attempt=1, shards=shards,
                    state_format="dcp")


def _with_files(manifest: Manifest, rank: int, names: list[str]) -> Manifest:
    from activities.models import ShardFile

    shards = [s.model_copy(update={"files": [ShardFile(name=n, size_bytes=1, sha256="aa" * 32) for n in names]})
              if s.rank == rank else s for s in manifest.shards]
    return manifest.model_copy(update={"shards": shards})


def _sharded(manifest: Manifest, reshardable: bool) -> Manifest:
    shards = [shard.model_copy(update={"sharded": True}) for shard in manifest.shards]
    return manifest.model_copy(update={"shards": shards, "reshardable": reshardable})


@pytest.mark.parametrize(
    ("manifest", "problem"),
    [
        pytest.param(_dcp_manifest(), None, id="whole"),
        pytest.param(_with_files(_dcp_manifest(), 0, ["dcp/__0_0.distcp"]), "needs one dcp/.metadata",
                     id="no-metadata"),
        pytest.param(_with_files(_dcp_manifest(), 1, ["dcp/__1_0.distcp", "dcp/.metadata"]),
                     "names 2", id="two-metadata"),
        pytest.param(_with_files(_dcp_manifest(), 1, ["../../other-run/x.distcp"]), "outside the DCP layout",
                     id="a-file-outside-its-folder"),
        pytest.param(_dcp_manifest().model_copy(update={"state_format": "torch"}), "its shards another",
                     id="format-that-lies"),
        pytest.param(_manifest().model_copy(update={"state_format": "zarr"}), "not one this release reads",
                     id="unknown-state-format"),
        pytest.param(_manifest().model_copy(update={"shards": [
            _manifest().shards[0], ShardInfo(rank=1, size_bytes=0, sha256="", replica_of=0)]}), None,
            id="a-replica-of-rank-0"),
        pytest.param(_manifest().model_copy(update={"shards": [
            _manifest().shards[0], ShardInfo(rank=1, size_bytes=0, sha256="", replica_of=1)]}),
            "replicates rank 1, which wrote none", id="a-replica-of-nothing"),
        pytest.param(_sharded(_manifest(), reshardable=False), None, id="a-torch-save-of-dtensors-marked-so"),
        pytest.param(_sharded(_manifest(), reshardable=True), "says reshardable True, its shards another",
                     id="a-torch-save-of-dtensors-said-to-reshard"),
        pytest.param(_manifest(reshardable=False), "says reshardable False, its shards another",
                     id="plain-tensors-said-not-to-reshard"),
    ],
)
def test_manifest_problem_of_dcp_and_replicated_checkpoints(manifest: Manifest, problem: str | None) -> None:
    found = manifest_problem(manifest, RUN, 100)
    assert found == problem if problem is None else problem in (found or "")


def test_a_torch_save_of_dtensors_is_a_checkpoint_that_cannot_be_resharded() -> None:
    from activities.checkpoint_layout import reshardable_of, shard_from_meta

    meta = {"rank": 1, "step": 10, "size_bytes": 7, "sha256": "ab" * 32}
    plain = shard_from_meta(meta, f"{RUN}/step-00000010/", "node-1")
    sharded = shard_from_meta({**meta, "sharded": True}, f"{RUN}/step-00000010/", "node-1")
    assert (plain.sharded, sharded.sharded) == (False, True)
    assert reshardable_of([plain, plain]) and not reshardable_of([plain, sharded])
    assert reshardable_of(_dcp_manifest().shards)  # DCP reshards whatever it holds


def test_a_dcp_checkpoint_restores_from_every_shard_a_replica_from_its_original() -> None:
    from activities.checkpoint_layout import restore_sources

    dcp = _dcp_manifest(world_size=2)
    assert sorted(restore_sources(dcp, [0]).keys()) == [0, 1], "one rank after a shrink reads both shards"
    replicated = _manifest().model_copy(update={"shards": [
        _manifest().shards[0], ShardInfo(rank=1, size_bytes=0, sha256="", replica_of=0)]})
    assert {r: s.rank for r, s in restore_sources(replicated, [0, 1, 2, 3]).items()} == {0: 0, 1: 0, 2: 0, 3: 0}
    assert {r: s.rank for r, s in restore_sources(_manifest(), [0, 1, 2]).items()} == {0: 0, 1: 1, 2: 0}


def test_a_dcp_shard_is_its_files_in_the_store_and_a_replica_is_none() -> None:
    from activities.checkpoint_layout import shard_from_meta, shard_objects

    shard = _dcp_manifest().shards[0]
    meta = {"rank": 0, "format": "dcp", "sha256": shard.sha256,
            "files": [f.model_dump() for f in shard.files or []]}
    assert shard_from_meta(meta, f"{RUN}/step-00000100/", "node-0") == shard
    assert [(name, obj.key) for name, obj in shard_objects(shard)] == [
        ("dcp/__0_0.distcp", f"{RUN}/step-00000100/dcp/__0_0.distcp"),
        ("dcp/.metadata", f"{RUN}/step-00000100/dcp/.metadata")]
    assert shard_objects(ShardInfo(rank=3, size_bytes=0, sha256="", replica_of=0)) == []
    with pytest.raises(Exception, match="does not add up"):
        shard_from_meta({**meta, "sha256": "00" * 32}, f"{RUN}/step-00000100/", "node-0")


def test_step_of_any_object_of_a_step() -> None:
    assert step_of(f"{RUN}/step-00000100/dcp/__1_0.distcp") == 100
    assert step_of(f"{RUN}/step-00000100/dcp/") == 100
