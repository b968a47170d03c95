"""Activities that move checkpoints between nodes and S3, and commit them.

Layout in the bucket (readable with any S3 client, loadable with plain `torch.load`):

    <prefix>/<workflow-id>/step-00000100/rank-00000.pt     one shard per rank (torch.save of a dict)
    <prefix>/<workflow-id>/step-00000100/nodes/<node>.json a node's record: its shards are all uploaded
    <prefix>/<workflow-id>/step-00000100/manifest-00000.json  pages of a large manifest's shard list
    <prefix>/<workflow-id>/step-00000100/manifest.json     written last: the commit

Node agents upload their own shards from inside their watch and write their node record last; the
controller's committer sees a step whose records cover every rank and writes its manifest. No shard list
passes through a workflow's history.

A checkpoint without a manifest does not exist. The manifest is written only after every shard it names is
in the store with the size and sha256 the rank recorded, and never overwritten (conditional write). A reader
trusts a manifest only when it describes a whole checkpoint of its own step in this layout; a manifest that
cannot be parsed, or that names shards elsewhere or too few of them, is passed over like a missing one.

Multipart uploads that an uploader abandoned (killed mid-upload) are invisible to listings but keep their
parts until aborted: retention aborts the ones under the run's prefix once they are surely dead.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import queue
import re
import shutil
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from botocore.exceptions import ClientError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.models import (
    CommitCheckpointInput,
    CommitCheckpointsInput,
    CommitCheckpointsResult,
    CommittedCheckpoint,
    ManifestPage,
    NodeCheckpointRecord,
    DownloadShardsInput,
    DownloadShardsResult,
    FindCheckpointInput,
    FindCheckpointResult,
    Manifest,
    PruneCheckpointsInput,
    PruneCheckpointsResult,
    ShardFile,
    ShardInfo,
    UploadShardsInput,
    UploadShardsResult,
    WatchCheckpoints,
)
from activities.paths import RunLayout, shard_meta_name, shard_name, step_dir_name
from activities.peers import fetch_from_peer
from activities.progress import find_stragglers
from trainguard.models import CheckpointRef
from trainguard.error_types import ErrorType
from trainguard.rank import DCP_DIR, DCP_METADATA, FORMAT_DCP, FORMAT_TORCH, files_digest, sha256_file
from trainguard.settings import s3_client

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
SHA256_METADATA = "sha256"
# Parts of 64 MiB, 4 in flight: measured here as the best upload/download rate SeaweedFS gives on 2 cores.
PART_SIZE_BYTES = 64 << 20
TRANSFER_CONCURRENCY = 4
_READ_CHUNK_BYTES = 8 << 20
"""Reads for checksums; divides PART_SIZE_BYTES so part boundaries fall between chunks."""
assert PART_SIZE_BYTES % _READ_CHUNK_BYTES == 0
MANIFEST_FORMAT = Manifest.model_fields["format"].default

ORPHANED_UPLOAD_AGE_S = 3600.0
"""A multipart upload under a run's prefix initiated longer ago than this is abandoned, and aborted.

An upload lives at most one `upload_shards` attempt (TRANSFER_TIMEOUT, 30 min, in workflows/training_run.py;
boto3 starts a new upload on a retry, never resumes one). Twice that leaves room for clock skew between the
store (which stamps `Initiated`) and the controller, so an upload still in flight is never aborted under
its writer.
"""


MANIFEST_PAGE_RANKS = 1024
"""Shards listed inline in a manifest, and per page beyond that: a page is about 150 KB, one GET per node
at a restore, and never near a payload or object-size limit."""

NODE_RECORDS = "nodes"

STORE_CHECK_THREADS = 16
"""HEADs in flight when a restore checks that a checkpoint's shards are all there: 32,768 one after the
other would take minutes."""


def node_record_key(run_prefix: str, step: int, node: str) -> str:
    return f"{step_prefix(run_prefix, step)}{NODE_RECORDS}/{node}.json"


def step_prefix(run_prefix: str, step: int) -> str:
    return f"{run_prefix}/{step_dir_name(step)}/"


def manifest_key(run_prefix: str, step: int) -> str:
    return f"{step_prefix(run_prefix, step)}{MANIFEST_NAME}"


def _error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def _is_missing(error: ClientError) -> bool:
    return _error_code(error) in ("404", "NoSuchKey", "NotFound")


def _bucket_missing(error: ClientError, bucket: str) -> ApplicationError | None:
    if _error_code(error) == "NoSuchBucket":
        return ApplicationError(
            f"checkpoint.bucket {bucket!r} does not exist in the S3 store", type=ErrorType.BAD_SPEC, non_retryable=True
        )
    return None


def _transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=PART_SIZE_BYTES,
        multipart_chunksize=PART_SIZE_BYTES,
        max_concurrency=TRANSFER_CONCURRENCY,
        use_threads=True,
    )


_DCP_FILE = re.compile(rf"^{DCP_DIR}/(__\d+_\d+\.distcp|\.metadata)$")
"""What a DCP shard's file may be called: DCP's own names, in the step's `dcp/` folder and nowhere else."""


def shard_objects(shard: ShardInfo) -> list[tuple[str, ShardInfo]]:
    """The store objects a shard is made of, each with its path under the step's folder: one file of a
    `torch.save` shard, each file of a DCP shard, none of a replica (it is another rank's shard)."""
    if shard.replica_of is not None:
        return []
    if shard.files is None:
        return [(shard_name(shard.rank), shard)]
    prefix = shard.key.removesuffix(f"{DCP_DIR}/")
    return [(f.name, ShardInfo(rank=shard.rank, key=f"{prefix}{f.name}", size_bytes=f.size_bytes,
                               sha256=f.sha256, node=shard.node)) for f in shard.files]


def state_format_of(shards: list[ShardInfo]) -> str:
    return FORMAT_DCP if any(s.files is not None for s in shards) else FORMAT_TORCH


def reshardable_of(shards: list[ShardInfo]) -> bool:
    """False when a `torch.save` shard holds sharded tensors: such a checkpoint loads only onto the world size
    that wrote it (DTensor refuses to copy across meshes), so no shrink or grow may restore it."""
    return not any(s.sharded and s.files is None for s in shards)


def restore_sources(manifest: Manifest, ranks: list[int]) -> dict[int, ShardInfo]:
    """Rank -> the shard it restores from: of a DCP checkpoint every shard (each rank may need any part
    once resharded); else rank r's is shard r mod the checkpoint's world size, or the shard it replicates."""
    by_rank = {s.rank: s for s in manifest.shards}
    if manifest.state_format == FORMAT_DCP:
        return by_rank
    sources: dict[int, ShardInfo] = {}
    for rank in ranks:
        source = by_rank[rank % manifest.world_size]
        if source.replica_of is not None:
            source = by_rank[source.replica_of]
        sources[rank] = source
    return sources


def list_steps(client: Any, bucket: str, run_prefix: str) -> list[int]:
    """Every `step-*` folder under the run prefix, newest first (committed or not)."""
    steps: list[int] = []
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=f"{run_prefix}/", Delimiter="/"):
        for common in page.get("CommonPrefixes", []):
            name = common["Prefix"].rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("step-") and name.removeprefix("step-").isdigit():
                steps.append(int(name.removeprefix("step-")))
    return sorted(steps, reverse=True)


def doomed_steps(steps: list[int], committed: list[int], keep_last: int, protect: list[int]) -> list[int]:
    """The step folders retention deletes: committed checkpoints beyond the newest `keep_last`, and folders
    never committed that `keep_last` newer commits have made useless (a crashed attempt's leftovers). An
    uncommitted folder with fewer newer commits may still be uploading or committing: commits can finish out
    of order, and deleting it would lose a checkpoint retention means to keep."""
    newest = sorted(committed, reverse=True)
    keep = set(newest[:keep_last]) | set(protect)
    return [s for s in steps if s not in keep
            and (s in committed or sum(1 for c in newest if c > s) >= keep_last)]


def read_manifest(client: Any, bucket: str, key: str, ranks: list[int] | None = None) -> Manifest | None:
    """The manifest at `key` with its shard list filled in: all of it, or the pages holding the shards
    `ranks` restore (rank r: shard r mod the checkpoint's world size). None when there is none. A page whose
    bytes do not match the manifest raises ValueError, like bad JSON."""
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        if _is_missing(error):
            return None
        raise
    manifest = Manifest.model_validate_json(body)
    if not manifest.pages:
        return manifest
    # A DCP checkpoint restores from every shard; else rank r from shard r mod the world size.
    needed = (None if ranks is None or manifest.state_format == FORMAT_DCP
              else {r % manifest.world_size for r in ranks})
    shards = _read_pages(client, bucket, manifest.pages, needed)
    if needed is not None:  # a replica restores its original's shard: read that page too
        read = {s.rank for s in shards}
        originals = {s.replica_of for s in shards if s.replica_of is not None} - read
        if originals:
            shards.extend(s for s in _read_pages(client, bucket, manifest.pages, originals) if s.rank not in read)
    return manifest.model_copy(update={"shards": shards})


def _read_pages(client: Any, bucket: str, pages: list[ManifestPage], ranks: set[int] | None) -> list[ShardInfo]:
    """The shards on the pages that hold `ranks` (None: every page), each page checked against its sha256."""
    shards: list[ShardInfo] = []
    for page in pages:
        if ranks is not None and not any(page.first_rank <= r < page.first_rank + page.num_ranks for r in ranks):
            continue
        try:
            data = client.get_object(Bucket=bucket, Key=page.key)["Body"].read()
        except ClientError as error:
            if _is_missing(error):
                raise ValueError(f"manifest page {page.key} is missing") from None
            raise
        if hashlib.sha256(data).hexdigest() != page.sha256:
            raise ValueError(f"manifest page {page.key} does not match its sha256")
        shards.extend(ShardInfo.model_validate(s) for s in json.loads(data))
    return shards


def manifest_header(manifest: Manifest) -> Manifest:
    """The manifest without its shard list: what may pass through a workflow's history at any world size."""
    return manifest.model_copy(update={"shards": [], "pages": []})


def manifest_body(manifest: Manifest, run_prefix: str) -> tuple[bytes, dict[str, bytes]]:
    """The manifest object's bytes and, for a large world, its pages' (key -> bytes), to be written first."""
    if len(manifest.shards) <= MANIFEST_PAGE_RANKS:
        return manifest.model_dump_json(indent=1).encode(), {}
    pages: dict[str, bytes] = {}
    refs: list[ManifestPage] = []
    for first in range(0, len(manifest.shards), MANIFEST_PAGE_RANKS):
        chunk = manifest.shards[first : first + MANIFEST_PAGE_RANKS]
        data = json.dumps([s.model_dump(mode="json") for s in chunk]).encode()
        key = f"{step_prefix(run_prefix, manifest.step)}manifest-{first:05d}.json"
        pages[key] = data
        refs.append(ManifestPage(key=key, first_rank=first, num_ranks=len(chunk),
                                 sha256=hashlib.sha256(data).hexdigest()))
    header = manifest.model_copy(update={"shards": [], "pages": refs})
    return header.model_dump_json(indent=1).encode(), pages


def manifest_problem(manifest: Manifest, run_prefix: str, step: int) -> str | None:
    """None when the manifest describes a whole checkpoint of `step` in this run's layout; else what is wrong.

    Guards a restore against a manifest that is well-formed JSON but lies: copied into another step's folder,
    naming shards of another run, or too few shards for its world size (a node would get none to restore).
    """
    if manifest.format != MANIFEST_FORMAT:
        return f"manifest format {manifest.format!r}, expected {MANIFEST_FORMAT!r}"
    if manifest.step != step:
        return f"manifest in the folder of step {step} says step {manifest.step}"
    ranks = sorted(s.rank for s in manifest.shards)
    if ranks != list(range(manifest.world_size)):
        return f"manifest names shards of ranks {ranks}, not one per rank of world size {manifest.world_size}"
    if manifest.state_format not in (FORMAT_TORCH, FORMAT_DCP):
        return f"manifest state format {manifest.state_format!r} is not one this release reads"
    if manifest.state_format != state_format_of(manifest.shards):
        return f"manifest says state format {manifest.state_format!r}, its shards another"
    if manifest.reshardable != reshardable_of(manifest.shards):
        return f"manifest says reshardable {manifest.reshardable}, its shards another"
    originals = {s.rank for s in manifest.shards if s.replica_of is None}
    for shard in manifest.shards:
        if shard.replica_of is not None:
            if shard.replica_of not in originals or manifest.state_format == FORMAT_DCP:
                return f"the shard of rank {shard.rank} replicates rank {shard.replica_of}, which wrote none"
            continue
        name = f"{DCP_DIR}/" if shard.files is not None else shard_name(shard.rank)
        expected = f"{step_prefix(run_prefix, step)}{name}"
        if shard.key != expected:
            return f"manifest puts the shard of rank {shard.rank} at {shard.key}, not {expected}"
        bad = [f.name for f in shard.files or [] if not _DCP_FILE.match(f.name)]
        if bad:
            return f"the shard of rank {shard.rank} names a file outside the DCP layout: {bad[0]!r}"
    if manifest.state_format == FORMAT_DCP:
        if any(s.files is None for s in manifest.shards):
            return "a DCP checkpoint with a torch.save shard in it"
        metadata = [s.rank for s in manifest.shards for f in s.files or [] if f.name == DCP_METADATA]
        if len(metadata) != 1:
            return f"a DCP checkpoint needs one {DCP_METADATA}, the manifest names {len(metadata)}"
    return None


def abort_orphaned_uploads(
    client: Any, bucket: str, prefix: str, *, older_than_s: float = ORPHANED_UPLOAD_AGE_S, now: float
) -> list[str]:
    """Abort the multipart uploads under `prefix` initiated more than `older_than_s` before `now` (Unix time).

    Their parts are invisible to listings but occupy the store until aborted. `prefix` is a folder: a
    trailing `/` is added so `runs/a` never reaches into `runs/ab`. Returns the keys of the uploads aborted.
    """
    folder = prefix if prefix.endswith("/") else f"{prefix}/"
    aborted: list[str] = []
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=folder):
        for upload in page.get("Uploads", []):
            key = upload["Key"]
            if not key.startswith(folder) or now - upload["Initiated"].timestamp() < older_than_s:
                continue  # a store that ignores Prefix must not lead us into another run's uploads
            try:
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"])
            except ClientError as error:
                if _error_code(error) != "NoSuchUpload":  # completed or aborted since the listing
                    raise
            aborted.append(key)
    if aborted:
        log.info("aborted %d orphaned multipart uploads under s3://%s/%s", len(aborted), bucket, folder)
    return aborted


def check_shard_in_store(client: Any, bucket: str, shard: ShardInfo) -> str | None:
    """None when every object of the shard exists with its recorded size and sha256; else what is wrong."""
    objects = shard_objects(shard)
    if objects != [(shard_name(shard.rank), shard)]:
        return next((p for _, obj in objects if (p := check_shard_in_store(client, bucket, obj))), None)
    try:
        head = client.head_object(Bucket=bucket, Key=shard.key)
    except ClientError as error:
        if _is_missing(error):
            return f"shard of rank {shard.rank} missing ({shard.key})"
        raise
    if head["ContentLength"] != shard.size_bytes:
        return f"shard of rank {shard.rank} is {head['ContentLength']} bytes, manifest says {shard.size_bytes}"
    recorded = head.get("Metadata", {}).get(SHA256_METADATA)
    if recorded is not None and recorded != shard.sha256:
        return f"shard of rank {shard.rank} has sha256 {recorded[:12]}..., manifest says {shard.sha256[:12]}..."
    return None


def shard_from_meta(meta: dict[str, Any], prefix: str, node: str) -> ShardInfo:
    """The shard a rank's meta file (written by `trainguard.rank`) describes, keyed under `prefix`."""
    rank = int(meta["rank"])
    if meta.get("replica_of") is not None:
        return ShardInfo(rank=rank, size_bytes=0, sha256="", node=node, replica_of=int(meta["replica_of"]))
    if meta.get("format") == FORMAT_DCP:
        files = [ShardFile.model_validate(f) for f in meta["files"]]
        sha = files_digest([f.model_dump() for f in files])
        if sha != meta["sha256"]:
            raise ApplicationError(f"the meta file of rank {rank} does not add up ({sha[:12]}...)",
                                   type=ErrorType.CORRUPT_LOCAL_SHARD, non_retryable=True)
        return ShardInfo(rank=rank, key=f"{prefix}{DCP_DIR}/", size_bytes=sum(f.size_bytes for f in files),
                         sha256=sha, node=node, files=files)
    return ShardInfo(rank=rank, key=f"{prefix}{shard_name(rank)}", size_bytes=meta["size_bytes"],
                     sha256=meta["sha256"], node=node, sharded=bool(meta.get("sharded")))


def object_name(key: str) -> str:
    """An object's path under its step's folder (`.../step-00000100/dcp/__0_0.distcp` -> `dcp/__0_0.distcp`),
    which is also its path under the step's folder on a node."""
    return key.rsplit("/step-", 1)[1].split("/", 1)[1]


def step_of(key: str) -> int:
    """The step of any object under a step's folder (`.../step-00000100/rank-00000.pt`,
    `.../step-00000100/dcp/.metadata` -> 100)."""
    return int(key.rsplit("/step-", 1)[1].split("/", 1)[0])


def local_digests(path: Path) -> tuple[str, str]:
    """The file's sha256, and the ETag the store gives it once uploaded with our transfer settings.

    The ETag is the MD5 of the body for a single PUT, and the MD5 of the parts' MD5s plus `-<parts>` for a
    multipart upload (AWS S3, MinIO, SeaweedFS). A store that computes it otherwise (SSE-KMS) only costs a
    re-upload where one could have been skipped; a match cannot be wrong.
    """
    sha = hashlib.sha256()
    part_md5s: list[bytes] = []
    part = hashlib.md5(usedforsecurity=False)
    in_part = size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_READ_CHUNK_BYTES):
            sha.update(chunk)
            part.update(chunk)
            in_part += len(chunk)
            size += len(chunk)
            if in_part == PART_SIZE_BYTES:
                part_md5s.append(part.digest())
                part, in_part = hashlib.md5(usedforsecurity=False), 0
    if size < PART_SIZE_BYTES:  # one PUT below boto3's multipart threshold: the only part is the whole body
        return sha.hexdigest(), part.hexdigest()
    if in_part:
        part_md5s.append(part.digest())
    of_parts = hashlib.md5(b"".join(part_md5s), usedforsecurity=False).hexdigest()
    return sha.hexdigest(), f"{of_parts}-{len(part_md5s)}"


def committed_shard(client: Any, bucket: str, key: str, rank: int) -> ShardInfo | None:
    """The shard of `rank` that the manifest at `key` commits; None when there is no readable manifest."""
    try:
        manifest = read_manifest(client, bucket, key)
    except ValueError:
        return None  # unreadable: no reader will restore it, so it has nothing to protect
    if manifest is None:
        return None
    return next((s for s in manifest.shards if s.rank == rank), None)


class _HashingReader:
    """A file read once, front to back, hashed on the way: the upload and its checksum pass are one read.
    Not seekable, so boto3's transfer manager reads it in order (and still sends the parts in parallel)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self.sha256.update(data)
        return bytes(data)


class _HashingWriter:
    """A file written once, front to back, hashed on the way: the download and its checksum pass are one
    write. Not seekable, so the transfer manager hands it the parts in order (fetching them in parallel).
    The hashing runs in a thread of its own (hashlib releases the GIL), beside the writes, not between them."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._sha256 = hashlib.sha256()
        self._chunks: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._hasher = threading.Thread(target=self._hash, name="download-sha256", daemon=True)
        self._hasher.start()

    def _hash(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            self._sha256.update(chunk)

    def seekable(self) -> bool:
        return False

    def write(self, data: bytes) -> int:
        self._chunks.put(bytes(data))
        return int(self._handle.write(data))

    def hexdigest(self) -> str:
        """The sha256 of everything written; call once, after the last write."""
        self._chunks.put(None)
        self._hasher.join()
        return self._sha256.hexdigest()


def stored_intact(client: Any, bucket: str, shard: ShardInfo, etag: str) -> bool:
    """True when the object holds exactly the local bytes: recorded size and sha256, and their ETag.

    Size and metadata alone are not enough: bytes that rot in place keep both, and skipping the upload
    would let the commit that follows vouch for them.
    """
    try:
        head = client.head_object(Bucket=bucket, Key=shard.key)
    except ClientError as error:
        if _is_missing(error):
            return False
        raise
    return (head["ContentLength"] == shard.size_bytes
            and head.get("Metadata", {}).get(SHA256_METADATA) == shard.sha256
            and str(head.get("ETag", "")).strip('"') == etag)


T = TypeVar("T")
R = TypeVar("R")
STORE_HEARTBEAT_EVERY_S = 2.0
"""Find, commit and prune heartbeat this often while their store calls run (the workflow's timeout: 15 s)."""


async def _heartbeating(fn: Callable[[T], R], request: T) -> R:
    """Run blocking store work in a thread, heartbeating meanwhile: the controller dying mid-call is noticed
    within the heartbeat timeout, and the call is retried on another controller."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, request))
    while not work.done():
        activity.heartbeat()
        await asyncio.wait({work}, timeout=STORE_HEARTBEAT_EVERY_S)
    return work.result()


@dataclass
class _CommitterState:
    """What one committer activity remembers between its passes over the store."""

    records: dict[str, tuple[str, NodeCheckpointRecord]] = field(default_factory=dict)
    """Record key -> (ETag, record): a record is read again only when it changed."""
    refused: set[int] = field(default_factory=set)
    """Steps another writer's manifest holds: never committed by this one."""


class StoreActivities:
    """Controller-side activities: find, commit and prune checkpoints in the store."""

    @activity.defn(name="find_checkpoint")
    async def find_checkpoint(self, request: FindCheckpointInput) -> FindCheckpointResult:
        """The newest committed checkpoint whose shards all exist with their recorded sizes and checksums."""
        return await _heartbeating(self._find, request)

    def _find(self, request: FindCheckpointInput) -> FindCheckpointResult:
        client = s3_client()
        skipped: list[str] = []
        try:
            steps = list_steps(client, request.bucket, request.run_prefix)
        except ClientError as error:
            raise _bucket_missing(error, request.bucket) or error
        for step in steps:
            if step in request.exclude_steps:
                skipped.append(f"step {step}: a shard failed verification at download")
                continue
            key = manifest_key(request.run_prefix, step)
            try:
                manifest = read_manifest(client, request.bucket, key)
            except ValueError as error:
                skipped.append(f"step {step}: unreadable manifest ({error.__class__.__name__})")
                continue
            if manifest is None:
                skipped.append(f"step {step}: no manifest (never committed)")
                continue
            problem = manifest_problem(manifest, request.run_prefix, step)
            if problem:
                skipped.append(f"step {step}: {problem}")
                continue
            smallest = min(request.world_size, request.min_world_size or request.world_size)
            largest = max(request.world_size, request.max_world_size or 0)
            if not smallest <= manifest.world_size <= largest:
                skipped.append(f"step {step}: written by {manifest.world_size} ranks, run has {request.world_size}")
                continue
            if not manifest.reshardable and manifest.world_size != request.world_size:
                skipped.append(f"step {step}: a per-rank torch.save of sharded tensors written by "
                               f"{manifest.world_size} ranks cannot be resharded onto {request.world_size}")
                continue
            sources = restore_sources(manifest, list(range(request.world_size)))
            needed = list({s.rank: s for s in sources.values()}.values())
            with ThreadPoolExecutor(max_workers=STORE_CHECK_THREADS) as pool:
                problems = [p for p in pool.map(lambda s: check_shard_in_store(client, request.bucket, s), needed)
                            if p]
            if problems:
                skipped.append(f"step {step}: {problems[0]}")
                continue
            return FindCheckpointResult(manifest=manifest_header(manifest), manifest_key=key, skipped=skipped)
        return FindCheckpointResult(skipped=skipped)

    @activity.defn(name="commit_checkpoint")
    async def commit_checkpoint(self, request: CommitCheckpointInput) -> CheckpointRef:
        """Write the manifest, last, once every shard is verified in the store. Idempotent."""
        return await _heartbeating(self._commit, request)

    def _commit(self, request: CommitCheckpointInput) -> CheckpointRef:
        client = s3_client()
        ranks = sorted(s.rank for s in request.shards)
        if ranks != list(range(request.world_size)):
            raise ApplicationError(
                f"step {request.step}: shards for ranks {ranks} do not cover world size {request.world_size}",
                type=ErrorType.INCOMPLETE_CHECKPOINT,
                non_retryable=True,
            )
        for shard in request.shards:
            problem = check_shard_in_store(client, request.bucket, shard)
            if problem:
                newer = [s for s in list_steps(client, request.bucket, request.run_prefix) if s > request.step
                         and self._exists(client, request.bucket, manifest_key(request.run_prefix, s))]
                if newer and (request.keep_last is None or len(newer) >= request.keep_last):
                    # Newer checkpoints committed meanwhile and retention let this one go: nothing to retry.
                    raise ApplicationError(f"step {request.step}: {problem}; superseded by committed step "
                                           f"{max(newer)}", type=ErrorType.CHECKPOINT_SUPERSEDED, non_retryable=True)
                # Retryable: a store that lists lazily may not show a just-finished upload yet.
                raise ApplicationError(f"step {request.step}: {problem}", type=ErrorType.SHARD_NOT_VERIFIED)
        manifest = Manifest(
            workflow_id=request.workflow_id,
            step=request.step,
            world_size=request.world_size,
            attempt=request.attempt,
            shards=sorted(request.shards, key=lambda s: s.rank),
            total_bytes=sum(s.size_bytes for s in request.shards),
            created_at=time.time(),
            state_format=state_format_of(request.shards),
            reshardable=reshardable_of(request.shards),
        )
        return self._put_manifest(client, request.bucket, request.run_prefix, manifest)

    @staticmethod
    def _put_manifest(client: Any, bucket: str, run_prefix: str, manifest: Manifest) -> CheckpointRef:
        """Write the manifest (its pages first), never over another: a retry finds its own and succeeds."""
        key = manifest_key(run_prefix, manifest.step)
        body, pages = manifest_body(manifest, run_prefix)
        for page_key, data in pages.items():
            client.put_object(Bucket=bucket, Key=page_key, Body=data, ContentType="application/json")
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json",
                              IfNoneMatch="*")
        except ClientError as error:
            code = _error_code(error)
            if code == "ConditionalRequestConflict":
                # Another conditional write of this key is in flight: retry and compare with what it wrote.
                raise ApplicationError(f"step {manifest.step}: concurrent manifest write, retrying",
                                       type=ErrorType.MANIFEST_WRITE_CONFLICT) from None
            if code not in ("PreconditionFailed", "412"):
                raise
            try:
                existing = read_manifest(client, bucket, key)
            except ValueError:
                existing = None  # an unreadable manifest is not ours either
            if existing is None or [s.sha256 for s in existing.shards] != [s.sha256 for s in manifest.shards]:
                raise ApplicationError(
                    f"step {manifest.step} was already committed with different shards (two writers?)",
                    type=ErrorType.CONFLICTING_COMMIT,
                    non_retryable=True,
                ) from None
            manifest = existing  # our own earlier commit, retried
        log.info("committed %s (%d shards)", key, len(manifest.shards))
        return CheckpointRef(
            step=manifest.step,
            manifest_key=key,
            bucket=bucket,
            world_size=manifest.world_size,
            total_bytes=sum(s.size_bytes for s in manifest.shards),
            reshardable=manifest.reshardable,
        )

    @activity.defn(name="commit_checkpoints")
    async def commit_checkpoints(self, request: CommitCheckpointsInput) -> CommitCheckpointsResult:
        """The committer: commit every step whose node records cover the world (manifest last), apply
        retention, and return what it committed. Heartbeats while it waits; idempotent (a step already
        committed is committed again as itself). Each pass over the store runs in a thread; the waits between
        passes do not, so a cancelled committer stops at once instead of holding a thread for minutes."""
        deadline = time.monotonic() + request.max_duration_s
        state = _CommitterState()
        last_change = time.monotonic()
        while True:
            activity.heartbeat()
            commits, pending, changed = await asyncio.to_thread(self._commit_pass, request, state)
            if commits:
                return CommitCheckpointsResult(commits=commits)
            now = time.monotonic()
            last_change = now if changed else last_change
            if now >= deadline:
                return CommitCheckpointsResult()
            if request.quiet_s is not None and (not pending or now - last_change >= request.quiet_s):
                return CommitCheckpointsResult()
            await asyncio.sleep(request.poll_interval_s)

    def _commit_pass(self, request: CommitCheckpointsInput, state: _CommitterState
                     ) -> tuple[list[CommittedCheckpoint], bool, bool]:
        """Commit what is complete, then apply retention. Returns (commits, whether a step is partly
        uploaded, whether any node record is new since the last pass)."""
        client = s3_client()
        commits: list[CommittedCheckpoint] = []
        pending = changed = False
        try:
            steps = sorted(s for s in list_steps(client, request.bucket, request.run_prefix) if s > request.after_step)
        except ClientError as error:
            raise _bucket_missing(error, request.bucket) or error
        for step in steps:
            found, new = self._node_records(client, request, step, state.records)
            changed = changed or new
            if step in state.refused:
                continue  # committed already by another writer, with other shards: never ours to commit
            try:
                done = self._commit_step(client, request, step, found)
            except ApplicationError as error:
                if error.type != ErrorType.CONFLICTING_COMMIT:
                    raise
                # A manifest of another writer (or an unreadable one) holds the step: leave it, go on with
                # the steps after it. Restores pass over it if it is not whole.
                log.warning("%s; not committing step %d", error.message, step)
                state.refused.add(step)
                continue
            if done is not None:
                commits.append(done)
            elif found:
                pending = True
        if commits:
            self._prune(PruneCheckpointsInput(bucket=request.bucket, run_prefix=request.run_prefix,
                                              keep_last=request.keep_last,
                                              protect_steps=[max(c.ref.step for c in commits)]))
        return commits, pending, changed

    @staticmethod
    def _node_records(client: Any, request: CommitCheckpointsInput, step: int,
                      cache: dict[str, tuple[str, NodeCheckpointRecord]]) -> tuple[list[NodeCheckpointRecord], bool]:
        """The node records of `step` that count for this commit (attempts `min_attempt`..`attempt`), and
        whether any was new or changed since the last look."""
        prefix = f"{step_prefix(request.run_prefix, step)}{NODE_RECORDS}/"
        changed = False
        found: list[NodeCheckpointRecord] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=request.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                key, etag = obj["Key"], obj["ETag"]
                if key not in cache or cache[key][0] != etag:
                    try:
                        body = client.get_object(Bucket=request.bucket, Key=key)["Body"].read()
                        cache[key] = (etag, NodeCheckpointRecord.model_validate_json(body))
                    except (ClientError, ValueError) as error:
                        log.warning("node record %s unreadable (%s); waiting for it to be rewritten", key, error)
                        continue
                    changed = True
                record = cache[key][1]
                ours = not (request.chain_id and record.chain_id and record.chain_id != request.chain_id)
                if ours and request.min_attempt <= record.attempt <= request.attempt and record.step == step:
                    found.append(record)
        return found, changed

    def _commit_step(self, client: Any, request: CommitCheckpointsInput, step: int,
                     records: list[NodeCheckpointRecord]) -> CommittedCheckpoint | None:
        """Commit `step` if its records hold exactly one shard per rank of the world; else None."""
        by_rank: dict[int, ShardInfo] = {}
        for record in sorted(records, key=lambda r: (r.attempt, r.node)):
            for shard in record.shards:
                by_rank[shard.rank] = shard  # a newer attempt's upload of the same rank wins
        if sorted(by_rank) != list(range(request.world_size)):
            return None
        shards = [by_rank[r] for r in range(request.world_size)]
        if state_format_of(shards) == FORMAT_DCP and (
                any(s.files is None for s in shards)
                or sum(f.name == DCP_METADATA for s in shards for f in s.files or []) != 1):
            log.warning("step %d: not one DCP checkpoint of every rank (mixed formats, or no metadata); "
                        "not committing it", step)
            return None
        manifest = Manifest(workflow_id=request.workflow_id, step=step, world_size=request.world_size,
                            attempt=request.attempt, shards=shards, total_bytes=sum(s.size_bytes for s in shards),
                            created_at=time.time(), state_format=state_format_of(shards),
                            reshardable=reshardable_of(shards))
        ref = self._put_manifest(client, request.bucket, request.run_prefix, manifest)
        compute = {r: c for record in records for r, c in record.rank_compute_s.items()}
        return CommittedCheckpoint(ref=ref, slow_ranks=find_stragglers(compute, request.straggler_ratio),
                                   step=min((r.node_step for r in records), default=step))

    @activity.defn(name="prune_checkpoints")
    async def prune_checkpoints(self, request: PruneCheckpointsInput) -> PruneCheckpointsResult:
        """Keep the newest `keep_last` committed checkpoints; delete older ones, manifest first."""
        return await _heartbeating(self._prune, request)

    def _prune(self, request: PruneCheckpointsInput) -> PruneCheckpointsResult:
        client = s3_client()
        steps = list_steps(client, request.bucket, request.run_prefix)
        committed = [s for s in steps if self._exists(client, request.bucket, manifest_key(request.run_prefix, s))]
        doomed = doomed_steps(steps, committed, request.keep_last, request.protect_steps)
        for step in doomed:
            # Manifest first: from that moment the checkpoint no longer exists for any reader.
            client.delete_object(Bucket=request.bucket, Key=manifest_key(request.run_prefix, step))
            keys = [
                {"Key": obj["Key"]}
                for page in client.get_paginator("list_objects_v2").paginate(
                    Bucket=request.bucket, Prefix=step_prefix(request.run_prefix, step)
                )
                for obj in page.get("Contents", [])
            ]
            for start in range(0, len(keys), 1000):
                client.delete_objects(Bucket=request.bucket, Delete={"Objects": keys[start : start + 1000]})
        try:
            abort_orphaned_uploads(client, request.bucket, f"{request.run_prefix}/", now=time.time())
        except ClientError as error:
            # Retention is done; a store without ListMultipartUploads must not fail it over the janitor.
            log.warning("could not abort orphaned uploads under %s: %s", request.run_prefix, error)
        return PruneCheckpointsResult(deleted_steps=sorted(doomed))

    @staticmethod
    def _exists(client: Any, bucket: str, key: str) -> bool:
        try:
            client.head_object(Bucket=bucket, Key=key)
        except ClientError as error:
            if _is_missing(error):
                return False
            raise
        return True


class NodeCheckpointActivities:
    """Node-side activities: upload this node's shards, download the shards its ranks restore from."""

    def __init__(self, node: str, workdir: Path,
                 peer_urls: Callable[[], Awaitable[dict[str, str]]] | None = None) -> None:
        self.node = node
        self.workdir = workdir
        self._peer_urls = peer_urls
        """Node -> URL of its agent's shard server (the peer tier); None: no peer tier."""

    async def _peers(self, request: DownloadShardsInput) -> dict[str, str]:
        if self._peer_urls is None or not request.local_tier or all(s.node == self.node for s in request.shards):
            return {}
        try:
            return {node: url for node, url in (await self._peer_urls()).items() if node != self.node and url}
        except Exception as error:  # noqa: BLE001 - without peers the store still has every shard
            log.warning("peer tier: cannot look up the peers' shard servers: %s", error)
            return {}

    @activity.defn(name="upload_shards")
    async def upload_shards(self, request: UploadShardsInput) -> UploadShardsResult:
        """Upload this node's shards of one step (multipart, parallel), each with its sha256. Idempotent."""
        layout = RunLayout.of(self.workdir, request.workflow_id)
        step_dir = layout.local_step_dir(request.step)
        metas = sorted(step_dir.glob("rank-*.json"))
        if not metas:
            raise ApplicationError(
                f"node {self.node} has no shards of step {request.step}",
                type=ErrorType.NO_LOCAL_SHARDS, non_retryable=True
            )
        started = time.monotonic()
        shards: list[ShardInfo] = []
        for meta_path in metas:
            shard = shard_from_meta(json.loads(meta_path.read_text()),
                                    step_prefix(request.run_prefix, request.step), self.node)
            await asyncio.to_thread(self._upload_shard, request.bucket, step_dir, shard,
                                    manifest_key(request.run_prefix, request.step))
            activity.heartbeat({"uploaded_rank": shard.rank})
            shards.append(shard)
        # The local tier keeps the newest committed step (older ones are in S3). Only copies older than it go: an
        # older, uncommitted step may still be waiting for its own upload (uploads can finish out of order).
        for old in layout.checkpoint_dir.glob("step-*"):
            if int(old.name.removeprefix("step-")) < request.committed_step:
                shutil.rmtree(old, ignore_errors=True)
        return UploadShardsResult(
            shards=shards, num_bytes=sum(s.size_bytes for s in shards), seconds=time.monotonic() - started
        )

    def _upload_shard(self, bucket: str, step_dir: Path, shard: ShardInfo, manifest: str) -> None:
        """Every object of the shard (none for a replica), once the step's manifest, if any, agrees."""
        if shard.files is None and shard.replica_of is None:
            self._upload_one(bucket, step_dir / shard_name(shard.rank), shard, manifest)
            return
        self._check_not_committed_otherwise(s3_client(), bucket, shard, manifest)
        for name, obj in shard_objects(shard):
            self._upload_one(bucket, step_dir / name, obj, None)

    @staticmethod
    def _check_not_committed_otherwise(client: Any, bucket: str, shard: ShardInfo, manifest: str) -> None:
        try:
            committed = committed_shard(client, bucket, manifest, shard.rank)
        except ClientError as error:
            raise _bucket_missing(error, bucket) or error
        if committed is not None and committed.sha256 != shard.sha256:
            # Overwriting would leave the committed manifest naming bytes that are gone: a checkpoint
            # that was whole would stop being so, and this step could not be committed anyway.
            raise ApplicationError(
                f"step {step_of(manifest)} is already committed with another shard of rank {shard.rank} "
                f"(sha256 {committed.sha256[:12]}..., this one {shard.sha256[:12]}...): not overwriting it",
                type=ErrorType.CONFLICTING_COMMIT, non_retryable=True)

    def _upload_one(self, bucket: str, path: Path, shard: ShardInfo, manifest: str | None) -> None:
        """One object; `manifest` None: its shard was checked against the step's manifest already."""
        client = s3_client()
        try:
            committed = committed_shard(client, bucket, manifest, shard.rank) if manifest else None
            if committed is not None and committed.sha256 != shard.sha256:
                # Overwriting would leave the committed manifest naming bytes that are gone: a checkpoint
                # that was whole would stop being so, and this step could not be committed anyway.
                raise ApplicationError(
                    f"step {step_of(shard.key)} is already committed with another shard of rank {shard.rank} "
                    f"(sha256 {committed.sha256[:12]}..., this one {shard.sha256[:12]}...): "
                    "not overwriting it",
                    type=ErrorType.CONFLICTING_COMMIT,
                    non_retryable=True,
                )
            try:
                client.head_object(Bucket=bucket, Key=shard.key)
            except ClientError as error:
                if not _is_missing(error):
                    raise
                # The usual case, nothing there yet: upload and checksum in one read of the file.
                self._upload_verified(client, bucket, path, shard)
                return
            # Something is there (an earlier attempt, a rotted copy): compare before writing.
            sha256, etag = local_digests(path)
            if sha256 != shard.sha256:
                raise ApplicationError(
                    f"local shard {path} no longer matches the checksum its rank recorded",
                    type=ErrorType.CORRUPT_LOCAL_SHARD, non_retryable=True,
                )
            if stored_intact(client, bucket, shard, etag):
                return  # already uploaded by an earlier attempt of this activity
            # Also when a committed shard with this sha256 is there but its bytes are not: the upload repairs it.
            self._upload_verified(client, bucket, path, shard)
        except ClientError as error:
            raise _bucket_missing(error, bucket) or error

    @staticmethod
    def _upload_verified(client: Any, bucket: str, path: Path, shard: ShardInfo) -> None:
        """Upload the file, checking as it is read that it still has the sha256 its rank recorded. If it does
        not (the local disk rotted it), the object just written is deleted again: no commit can vouch for it."""
        with path.open("rb") as handle:
            reader = _HashingReader(handle)
            client.upload_fileobj(reader, bucket, shard.key, ExtraArgs={"Metadata": {SHA256_METADATA: shard.sha256}},
                                  Config=_transfer_config())
        if reader.sha256.hexdigest() != shard.sha256:
            client.delete_object(Bucket=bucket, Key=shard.key)
            raise ApplicationError(
                f"local shard {path} no longer matches the checksum its rank recorded",
                type=ErrorType.CORRUPT_LOCAL_SHARD,
                non_retryable=True,
            )

    @activity.defn(name="download_shards")
    async def download_shards(self, request: DownloadShardsInput) -> DownloadShardsResult:
        """Download and verify the shards this node's ranks restore from. No unverified byte is kept."""
        if not request.shards and request.manifest_key:
            request = request.model_copy(update={"shards": await asyncio.to_thread(self._shards_of, request)})
        if not request.shards:
            raise ApplicationError("no shards to download", type=ErrorType.NO_SHARDS, non_retryable=True)
        layout = RunLayout.of(self.workdir, request.workflow_id)
        step = step_of(request.shards[0].key)
        restore_dir = layout.restore_dir(step)
        restore_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        tiers: dict[int, str] = {}
        peers = await self._peers(request)
        for shard in request.shards:
            if shard.files is not None:  # a DCP shard: its files, by name; the peer tier serves only .pt
                found = set()
                for name, obj in shard_objects(shard):
                    found.add(await asyncio.to_thread(
                        self._download_one, request.bucket, restore_dir, obj,
                        layout.local_step_dir(step) if request.local_tier else None, None, "", name))
                # One tier per rank: the farthest any of its files came from.
                tiers[shard.rank] = next((t for t in ("s3", "peer", "local") if t in found), "local")
            else:
                tiers[shard.rank] = await asyncio.to_thread(
                    self._download_one, request.bucket, restore_dir, shard,
                    layout.local_step_dir(step) if request.local_tier else None, peers.get(shard.node or ""),
                    layout.root.name)
            activity.heartbeat({"downloaded_rank": shard.rank})
        for old in restore_dir.parent.glob("step-*"):
            if old != restore_dir:
                shutil.rmtree(old, ignore_errors=True)
        return DownloadShardsResult(
            restore_dir=str(restore_dir),
            num_bytes=sum(s.size_bytes for s in request.shards),
            seconds=time.monotonic() - started,
            tiers=tiers,
        )

    @staticmethod
    def _shards_of(request: DownloadShardsInput) -> list[ShardInfo]:
        """The shards `request.ranks` restore, read from the manifest (only the pages that hold them): rank
        r restores shard r mod the checkpoint's world size, saved under rank r's own name."""
        assert request.manifest_key is not None
        try:
            manifest = read_manifest(s3_client(), request.bucket, request.manifest_key, request.ranks)
        except ValueError as error:
            raise ApplicationError(f"manifest {request.manifest_key} unreadable: {error}",
                                   type=ErrorType.CORRUPT_CHECKPOINT, non_retryable=True) from None
        if manifest is None:
            raise ApplicationError(f"manifest {request.manifest_key} is gone", type=ErrorType.CORRUPT_CHECKPOINT,
                                   non_retryable=True)
        sources = restore_sources(manifest, request.ranks)
        if manifest.state_format == FORMAT_DCP:
            return sorted(sources.values(), key=lambda s: s.rank)
        return [sources[r].model_copy(update={"rank": r}) for r in request.ranks]

    async def upload_step(self, workflow_id: str, attempt: int, target: WatchCheckpoints, step: int,
                          rank_compute_s: dict[int, float], node_step: int,
                          chain_id: str = "") -> NodeCheckpointRecord:
        """From a watch: upload this node's shards of `step`, then write its node record (last), so the
        committer can see this node's part of the step is in the store. Idempotent."""
        result = await self.upload_shards(UploadShardsInput(
            workflow_id=workflow_id, attempt=attempt, node=self.node, bucket=target.bucket,
            run_prefix=target.run_prefix, step=step,
            committed_step=await asyncio.to_thread(self._newest_committed, workflow_id, target, step)))
        record = NodeCheckpointRecord(node=self.node, attempt=attempt, step=step, shards=result.shards,
                                      rank_compute_s=rank_compute_s, node_step=node_step, chain_id=chain_id)
        await asyncio.to_thread(
            s3_client().put_object, Bucket=target.bucket, Key=node_record_key(target.run_prefix, step, self.node),
            Body=record.model_dump_json().encode(), ContentType="application/json")
        return record

    def _newest_committed(self, workflow_id: str, target: WatchCheckpoints, before: int) -> int:
        """The newest committed step of this run older than `before` that this node still keeps locally: the
        local tier keeps it, and drops what is older."""
        layout = RunLayout.of(self.workdir, workflow_id)
        client = s3_client()
        local = sorted((int(d.name.removeprefix("step-")) for d in layout.checkpoint_dir.glob("step-*")
                        if d.name.removeprefix("step-").isdigit()), reverse=True)
        for step in local:
            if step < before and StoreActivities._exists(client, target.bucket, manifest_key(target.run_prefix, step)):
                return step
        return -1

    def _download_one(self, bucket: str, restore_dir: Path, shard: ShardInfo, local_step_dir: Path | None,
                      peer_url: str | None = None, run_dir_name: str = "", name: str | None = None) -> str:
        """Put a verified copy of `shard` in `restore_dir`; returns the tier it came from: `local` (this
        node's own copy of a shard it wrote, checked against the manifest's sha256), `peer` (the copy on the
        node that wrote it, from its agent's shard server at `peer_url`, checked the same way) or `s3`.
        Without a `local_step_dir` (the local tier is off) it always comes from the store."""
        name = name or shard_name(shard.rank)
        final = restore_dir / name
        # A DCP file's record of its check stays out of the DCP folder, which a reader lists.
        meta = (restore_dir / shard_meta_name(shard.rank) if name == shard_name(shard.rank)
                else restore_dir / f".{name.replace('/', '_')}.verified.json")
        partial = final.with_name(f".{final.name}.part")
        partial.parent.mkdir(parents=True, exist_ok=True)

        def keep(tier: str) -> str:
            """`partial` holds exactly the manifest's bytes: make it the restored shard."""
            partial.replace(final)
            meta.write_text(json.dumps({"rank": shard.rank, "size_bytes": shard.size_bytes, "sha256": shard.sha256}))
            return tier

        if (local_step_dir is not None and final.exists() and meta.exists()
                and json.loads(meta.read_text()).get("sha256") == shard.sha256):
            return "local"
        local = local_step_dir / name if local_step_dir is not None else None
        if (local is not None and local.exists() and local.stat().st_size == shard.size_bytes
                and sha256_file(local) == shard.sha256):
            shutil.copyfile(local, partial)  # a copy: the rank's next save must not write through a link
            return keep("local")
        if peer_url:
            problem = fetch_from_peer(peer_url, run_dir_name, shard, partial)
            if problem is None:
                return keep("peer")
            log.info("peer tier: %s; reading the store instead", problem)
        with partial.open("wb") as handle:
            writer = _HashingWriter(handle)  # download and checksum in one pass
            try:
                s3_client().download_fileobj(bucket, shard.key, writer, Config=_transfer_config())
            except ClientError as error:
                writer.hexdigest()  # ends its hashing thread
                partial.unlink(missing_ok=True)
                if _is_missing(error):
                    raise ApplicationError(f"shard {shard.key} is missing from the store",
                                           type=ErrorType.CORRUPT_CHECKPOINT, non_retryable=True) from None
                raise
            except BaseException:
                writer.hexdigest()
                raise
        actual = writer.hexdigest()
        if actual != shard.sha256:
            partial.unlink(missing_ok=True)
            raise ApplicationError(
                f"shard {shard.key} has sha256 {actual[:12]}..., manifest says {shard.sha256[:12]}...",
                type=ErrorType.CORRUPT_CHECKPOINT,
                non_retryable=True,
            )
        return keep("s3")
