"""The node's side of checkpoints: upload its shards (from inside its watch) and write its node record last,
and download, from the nearest tier that has them, the shards its ranks restore from.

Every byte is checked against the sha256 its rank recorded, as it is read or written: an upload of bytes
that rotted on the node's disk is deleted again, and a download that does not match is never kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import queue
import shutil
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from activities.checkpoint_layout import (
    DECISION_TAG_CONTEXT,
    NODE_RECORD_TAG_CONTEXT,
    FINGERPRINT_TAG_CONTEXT,
    PACE_TAG_CONTEXT,
    SHA256_METADATA,
    ObjectRefused,
    decision_key,
    manifest_key,
    node_record_key,
    restore_sources,
    shard_from_meta,
    shard_layout_problem,
    shard_objects,
    signed_object,
    step_of,
    step_prefix,
    verified_object,
)
from activities.checkpoint_store import StoreActivities
from activities.store_reads import (ManifestRefused, bucket_missing, is_missing, not_modified, committed_shard,
                                    read_manifest)
from activities.models import (
    AttemptDecision,
    DownloadShardsInput,
    DownloadShardsResult,
    NodeCheckpointRecord,
    ShardInfo,
    UploadShardsInput,
    UploadShardsResult,
    WatchCheckpoints,
)
from activities.fingerprint_models import FingerprintRecord
from activities.fingerprints import fingerprint_key
from activities.pace import pace_key
from activities.pace_models import PaceRecord
from activities.peers import fetch_from_peer
from trainguard.error_types import ErrorType
from trainguard.protocol import RunLayout, shard_meta_name, shard_name, step_of_dir_name
from trainguard.rank import FORMAT_DCP
from trainguard.safe_load import sha256_file
from trainguard.settings import s3_client

log = logging.getLogger("activities.checkpoints")
"""The checkpoint logs keep the name they always had, whichever part of them logs."""

# Parts of 64 MiB, 4 in flight: measured here as the best upload/download rate SeaweedFS gives on 2 cores.
PART_SIZE_BYTES = 64 << 20
TRANSFER_CONCURRENCY = 4
_READ_CHUNK_BYTES = 8 << 20
"""Reads for checksums; divides PART_SIZE_BYTES so part boundaries fall between chunks."""
assert PART_SIZE_BYTES % _READ_CHUNK_BYTES == 0


def _transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=PART_SIZE_BYTES,
        multipart_chunksize=PART_SIZE_BYTES,
        max_concurrency=TRANSFER_CONCURRENCY,
        use_threads=True,
    )



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


def _meta_name(rank: int, name: str) -> str:
    """The record of a restored file's check: a `torch.save` shard's meta file, which the rank helper reads; a
    DCP file's stays out of the DCP folder, which a reader lists."""
    return shard_meta_name(rank) if name == shard_name(rank) else f".{name.replace('/', '_')}.verified.json"


def _partial_name(name: str) -> str:
    return f".{name}.part"


def restored_names(shards: list[ShardInfo]) -> set[str]:
    """Every path under a restore folder that downloading `shards` writes: each file the manifest names, its
    check's record, and the partial file it is downloaded into."""
    names: set[str] = set()
    for shard in shards:
        files = [name for name, _ in shard_objects(shard)] if shard.files is not None else [shard_name(shard.rank)]
        for name in files:
            folder, _, base = name.rpartition("/")
            names |= {name, _meta_name(shard.rank, name), f"{folder}/{_partial_name(base)}" if folder
                      else _partial_name(base)}
    return names


def clear_unnamed(restore_dir: Path, names: set[str]) -> list[str]:
    """Remove from `restore_dir` everything that is not one of `names` (paths under it) or a folder holding one;
    links are removed, never followed. Returns what went, for the log."""
    keep_dirs = {parent.as_posix() for name in names for parent in Path(name).parents if parent.as_posix() != "."}
    removed: list[str] = []

    def sweep(folder: Path, relative: str) -> None:
        for entry in folder.iterdir():
            path = f"{relative}{entry.name}"
            if entry.is_dir() and not entry.is_symlink() and path in keep_dirs:
                sweep(entry, f"{path}/")
            elif path not in names or entry.is_symlink() or not entry.is_file():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()  # a link goes itself: what it points at is left alone
                removed.append(path)

    sweep(restore_dir, "")
    if removed:
        log.info("restore folder %s: removed what the manifest does not name: %s", restore_dir,
                 ", ".join(sorted(removed)[:10]) + (" ..." if len(removed) > 10 else ""))
    return removed


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
        if is_missing(error):
            return False
        raise
    return (head["ContentLength"] == shard.size_bytes
            and head.get("Metadata", {}).get(SHA256_METADATA) == shard.sha256
            and str(head.get("ETag", "")).strip('"') == etag)


def download_one(bucket: str, restore_dir: Path, shard: ShardInfo, local_step_dir: Path | None,
                 peer_url: str | None = None, run_dir_name: str = "", name: str | None = None) -> str:
    """Put a verified copy of `shard` in `restore_dir`; returns the tier it came from: `local` (this
    node's own copy of a shard it wrote, checked against the manifest's sha256), `peer` (the copy on the
    node that wrote it, from its agent's shard server at `peer_url`, checked the same way) or `s3`.
    Without a `local_step_dir` (the local tier is off) it always comes from the store."""
    name = name or shard_name(shard.rank)
    final = restore_dir / name
    meta = restore_dir / _meta_name(shard.rank, name)
    partial = final.with_name(_partial_name(final.name))
    partial.parent.mkdir(parents=True, exist_ok=True)

    def keep(tier: str) -> str:
        """`partial` holds exactly the manifest's bytes: make it the restored shard."""
        partial.replace(final)
        meta.write_text(json.dumps({"rank": shard.rank, "size_bytes": shard.size_bytes, "sha256": shard.sha256}))
        return tier

    if (local_step_dir is not None and final.is_file() and not final.is_symlink() and meta.exists()
            and json.loads(meta.read_text()).get("sha256") == shard.sha256
            and final.stat().st_size == shard.size_bytes and sha256_file(final) == shard.sha256):
        return "local"  # verified here, not taken on its record's word: the record may be of other bytes
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
            if is_missing(error):
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


class NodeCheckpointActivities:
    """Node-side activities: upload this node's shards, download the shards its ranks restore from."""

    def __init__(self, node: str, workdir: Path,
                 peer_urls: Callable[[], Awaitable[dict[str, str]]] | None = None, token: str | None = None) -> None:
        self.node = node
        self.workdir = workdir
        self._peer_urls = peer_urls
        """Node -> URL of its agent's shard server (the peer tier); None: no peer tier."""
        self.token = token
        """The pool's peer token (`TRAINGUARD_PEER_TOKEN`): tags this node's records, and a relaunch decision
        without its valid tag is not taken up. None: records go untagged and decisions unchecked."""
        self._decisions: dict[tuple[str, str], tuple[str, AttemptDecision | None]] = {}
        """(bucket, key) -> the ETag and decision read last (`read_decision`); None: refused."""

    async def _peers(self, request: DownloadShardsInput) -> dict[str, str]:
        if self._peer_urls is None or not request.local_tier or all(s.node == self.node for s in request.shards):
            return {}
        try:
            return {node: url for node, url in (await self._peer_urls()).items() if node != self.node and url}
        except Exception as error:  # noqa: BLE001 - without peers the store still has every shard
            log.warning("peer tier: cannot look up the peers' shard servers: %s", error)
            return {}

    async def upload_shards(self, request: UploadShardsInput) -> UploadShardsResult:
        """Upload this node's shards of one step (multipart, parallel), each with its sha256. Idempotent. Called
        by `upload_step`, from inside a watch (whose heartbeat it sends): no workflow schedules it."""
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
            step = step_of_dir_name(old.name)  # None: the rank's own entry (a `step-latest` link), left alone
            if step is not None and step < request.committed_step and not old.is_symlink():
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
            raise bucket_missing(error, bucket) or error  # noqa: B904 - re-raises `error` itself unless translated, as before
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
                if not is_missing(error):
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
            raise bucket_missing(error, bucket) or error  # noqa: B904 - re-raises `error` itself unless translated, as before

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

    @activity.defn(name=names.DOWNLOAD_SHARDS)
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
        # What an earlier job under the same run id, an earlier world size or another format left here would be
        # read as part of this checkpoint (a leftover `dcp/` made the rank helper take a torch.save for DCP).
        await asyncio.to_thread(clear_unnamed, restore_dir, restored_names(request.shards))
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
            # The controller verified the manifest's tag and hands over the digest of the bytes it verified: the
            # agent holds no manifest key, and restores from exactly those bytes (a paged manifest's pages are
            # bound to them by their sha256s).
            manifest = read_manifest(s3_client(), request.bucket, request.manifest_key, request.ranks,
                                     sha256=request.manifest_sha256)
        except ManifestRefused as refused:
            raise ApplicationError(f"manifest {request.manifest_key} refused: {refused}",
                                   type=ErrorType.CORRUPT_CHECKPOINT, non_retryable=True) from None
        except ValueError as error:
            raise ApplicationError(f"manifest {request.manifest_key} unreadable: {error}",
                                   type=ErrorType.CORRUPT_CHECKPOINT, non_retryable=True) from None
        if manifest is None:
            raise ApplicationError(f"manifest {request.manifest_key} is gone", type=ErrorType.CORRUPT_CHECKPOINT,
                                   non_retryable=True)
        # The agent acts on what it read: only shards the layout puts in the manifest's own step folder (a
        # manifest written with the store's key alone could name another run's objects, or a file name that
        # leaves the restore folder).
        run_prefix, step = request.manifest_key.rsplit("/step-", 1)[0], step_of(request.manifest_key)
        problem = (f"manifest in the folder of step {step} says step {manifest.step}" if manifest.step != step
                   else next((p for s in manifest.shards if s.replica_of is None
                              and (p := shard_layout_problem(s, run_prefix, step))), None))
        if problem is not None:
            raise ApplicationError(f"manifest {request.manifest_key} refused: {problem}",
                                   type=ErrorType.CORRUPT_CHECKPOINT, non_retryable=True)
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
        key = node_record_key(target.run_prefix, step, self.node)
        body = signed_object(record.model_dump_json().encode(), NODE_RECORD_TAG_CONTEXT, key, self.token)
        await asyncio.to_thread(s3_client().put_object, Bucket=target.bucket, Key=key, Body=body,
                                ContentType="application/json")
        return record

    async def write_pace(self, target: WatchCheckpoints, record: PaceRecord) -> None:
        """From a watch: this node's ranks' pace over its last window, for the committer to compare
        (`activities.pace`). Overwritten once a window; idempotent."""
        key = pace_key(target.run_prefix, self.node)
        body = signed_object(record.model_dump_json().encode(), PACE_TAG_CONTEXT, key, self.token)
        await asyncio.to_thread(s3_client().put_object, Bucket=target.bucket, Key=key, Body=body,
                                ContentType="application/json")

    async def write_fingerprints(self, target: WatchCheckpoints, record: FingerprintRecord) -> None:
        """From a watch: this node's ranks' newest fingerprints, for the committer to compare replicas
        (`activities.fingerprints`). Overwritten; idempotent."""
        key = fingerprint_key(target.run_prefix, self.node)
        body = signed_object(record.model_dump_json().encode(), FINGERPRINT_TAG_CONTEXT, key, self.token)
        await asyncio.to_thread(s3_client().put_object, Bucket=target.bucket, Key=key, Body=body,
                                ContentType="application/json")

    def read_decision(self, target: WatchCheckpoints) -> AttemptDecision | None:
        """The run's newest relaunch decision, blocking; None while there is none, or while the one there is
        refused (with the pool's peer token: untagged, or its tag wrong). Asked again only for a newer version
        than the one read last (`If-None-Match`): a watch asks every few seconds."""
        key = (target.bucket, decision_key(target.run_prefix))
        known = self._decisions.get(key)
        try:
            reply = s3_client().get_object(Bucket=key[0], Key=key[1],
                                           **({"IfNoneMatch": known[0]} if known else {}))
        except ClientError as error:
            if known and not_modified(error):
                return known[1]
            if is_missing(error):
                return None
            raise
        decision: AttemptDecision | None = None
        try:
            decision = AttemptDecision.model_validate(
                verified_object(reply["Body"].read(), DECISION_TAG_CONTEXT, key[1], self.token))
        except ObjectRefused as refused:
            # Taken up, it would name the program, env and checkpoint this node's ranks run: only the controller's
            # (a controller without the pool's token publishes untagged decisions: give it the token).
            log.warning("not taking up the relaunch decision s3://%s/%s: %s", key[0], key[1], refused)
        self._decisions[key] = (str(reply.get("ETag", "")), decision)
        return decision

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

    _download_one = staticmethod(download_one)
    """Tests and the checkpoint benchmark time the node's own download path through the agent."""
