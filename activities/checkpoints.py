"""Activities that move checkpoints between nodes and S3, and commit them.

Layout in the bucket (readable with any S3 client, loadable with plain `torch.load`):

    <prefix>/<workflow-id>/step-00000100/rank-00000.pt     one shard per rank (torch.save of a dict)
    <prefix>/<workflow-id>/step-00000100/manifest.json     written last: the commit

A checkpoint without a manifest does not exist. The manifest is written only after every shard it names is
in the store with the size and sha256 the rank recorded, and never overwritten (conditional write).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.models import (
    CommitCheckpointInput,
    DownloadShardsInput,
    DownloadShardsResult,
    FindCheckpointInput,
    FindCheckpointResult,
    Manifest,
    PruneCheckpointsInput,
    PruneCheckpointsResult,
    ShardInfo,
    UploadShardsInput,
    UploadShardsResult,
)
from activities.paths import RunLayout, shard_meta_name, shard_name, step_dir_name
from trainguard.models import CheckpointRef
from trainguard.rank import sha256_file
from trainguard.settings import s3_client

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
SHA256_METADATA = "sha256"
# Parts of 64 MiB, 4 in flight: measured here as the best upload/download rate SeaweedFS gives on 2 cores.
PART_SIZE_BYTES = 64 << 20
TRANSFER_CONCURRENCY = 4


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
            f"checkpoint.bucket {bucket!r} does not exist in the S3 store", type="BadSpec", non_retryable=True
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


def read_manifest(client: Any, bucket: str, key: str) -> Manifest | None:
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        if _is_missing(error):
            return None
        raise
    return Manifest.model_validate_json(body)


def check_shard_in_store(client: Any, bucket: str, shard: ShardInfo) -> str | None:
    """None when the object exists with the recorded size and sha256; else what is wrong with it."""
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


class StoreActivities:
    """Controller-side activities: find, commit and prune checkpoints in the store."""

    @activity.defn(name="find_checkpoint")
    async def find_checkpoint(self, request: FindCheckpointInput) -> FindCheckpointResult:
        """The newest committed checkpoint whose shards all exist with their recorded sizes and checksums."""
        return await asyncio.to_thread(self._find, request)

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
            if manifest.world_size != request.world_size:
                skipped.append(f"step {step}: written by {manifest.world_size} ranks, run has {request.world_size}")
                continue
            problems = [p for s in manifest.shards if (p := check_shard_in_store(client, request.bucket, s))]
            if problems:
                skipped.append(f"step {step}: {problems[0]}")
                continue
            return FindCheckpointResult(manifest=manifest, manifest_key=key, skipped=skipped)
        return FindCheckpointResult(skipped=skipped)

    @activity.defn(name="commit_checkpoint")
    async def commit_checkpoint(self, request: CommitCheckpointInput) -> CheckpointRef:
        """Write the manifest, last, once every shard is verified in the store. Idempotent."""
        return await asyncio.to_thread(self._commit, request)

    def _commit(self, request: CommitCheckpointInput) -> CheckpointRef:
        client = s3_client()
        ranks = sorted(s.rank for s in request.shards)
        if ranks != list(range(request.world_size)):
            raise ApplicationError(
                f"step {request.step}: shards for ranks {ranks} do not cover world size {request.world_size}",
                type="IncompleteCheckpoint",
                non_retryable=True,
            )
        for shard in request.shards:
            problem = check_shard_in_store(client, request.bucket, shard)
            if problem:
                # Retryable: a store that lists lazily may not show a just-finished upload yet.
                raise ApplicationError(f"step {request.step}: {problem}", type="ShardNotVerified")
        manifest = Manifest(
            workflow_id=request.workflow_id,
            step=request.step,
            world_size=request.world_size,
            attempt=request.attempt,
            shards=sorted(request.shards, key=lambda s: s.rank),
            created_at=time.time(),
        )
        key = manifest_key(request.run_prefix, request.step)
        body = manifest.model_dump_json(indent=1).encode()
        try:
            client.put_object(Bucket=request.bucket, Key=key, Body=body, ContentType="application/json",
                              IfNoneMatch="*")
        except ClientError as error:
            if _error_code(error) not in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise
            existing = read_manifest(client, request.bucket, key)
            if existing is None or [s.sha256 for s in existing.shards] != [s.sha256 for s in manifest.shards]:
                raise ApplicationError(
                    f"step {request.step} was already committed with different shards (two writers?)",
                    type="ConflictingCommit",
                    non_retryable=True,
                ) from None
            manifest = existing  # our own earlier commit, retried
        log.info("committed %s (%d shards)", key, len(manifest.shards))
        return CheckpointRef(
            step=manifest.step,
            manifest_key=key,
            bucket=request.bucket,
            world_size=manifest.world_size,
            total_bytes=sum(s.size_bytes for s in manifest.shards),
        )

    @activity.defn(name="prune_checkpoints")
    async def prune_checkpoints(self, request: PruneCheckpointsInput) -> PruneCheckpointsResult:
        """Keep the newest `keep_last` committed checkpoints; delete older ones, manifest first."""
        return await asyncio.to_thread(self._prune, request)

    def _prune(self, request: PruneCheckpointsInput) -> PruneCheckpointsResult:
        client = s3_client()
        steps = list_steps(client, request.bucket, request.run_prefix)
        committed = [s for s in steps if self._exists(client, request.bucket, manifest_key(request.run_prefix, s))]
        keep = set(committed[: request.keep_last]) | set(request.protect_steps)
        oldest_kept = min(keep) if keep else 0
        # Uncommitted folders newer than the oldest kept one may still be uploading: leave them.
        doomed = [s for s in steps if s not in keep and (s in committed or s < oldest_kept)]
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

    def __init__(self, node: str, workdir: Path) -> None:
        self.node = node
        self.workdir = workdir

    @activity.defn(name="upload_shards")
    async def upload_shards(self, request: UploadShardsInput) -> UploadShardsResult:
        """Upload this node's shards of one step (multipart, parallel), each with its sha256. Idempotent."""
        layout = RunLayout.of(self.workdir, request.workflow_id)
        step_dir = layout.local_step_dir(request.step)
        metas = sorted(step_dir.glob("rank-*.json"))
        if not metas:
            raise ApplicationError(
                f"node {self.node} has no shards of step {request.step}", type="NoLocalShards", non_retryable=True
            )
        started = time.monotonic()
        shards: list[ShardInfo] = []
        for meta_path in metas:
            meta = json.loads(meta_path.read_text())
            shard = ShardInfo(
                rank=meta["rank"],
                key=f"{step_prefix(request.run_prefix, request.step)}{shard_name(meta['rank'])}",
                size_bytes=meta["size_bytes"],
                sha256=meta["sha256"],
                node=self.node,
            )
            await asyncio.to_thread(self._upload_one, request.bucket, step_dir / shard_name(shard.rank), shard)
            activity.heartbeat({"uploaded_rank": shard.rank})
            shards.append(shard)
        # The local tier keeps only the newest uploaded step; older ones are in S3.
        for old in layout.checkpoint_dir.glob("step-*"):
            if int(old.name.removeprefix("step-")) < request.step:
                shutil.rmtree(old, ignore_errors=True)
        return UploadShardsResult(
            shards=shards, num_bytes=sum(s.size_bytes for s in shards), seconds=time.monotonic() - started
        )

    def _upload_one(self, bucket: str, path: Path, shard: ShardInfo) -> None:
        client = s3_client()
        if sha256_file(path) != shard.sha256:
            raise ApplicationError(
                f"local shard {path} no longer matches the checksum its rank recorded", type="CorruptLocalShard",
                non_retryable=True,
            )
        try:
            if check_shard_in_store(client, bucket, shard) is None:
                return  # already uploaded by an earlier attempt of this activity
        except ClientError as error:
            raise _bucket_missing(error, bucket) or error
        client.upload_file(
            str(path), bucket, shard.key,
            ExtraArgs={"Metadata": {SHA256_METADATA: shard.sha256}},
            Config=_transfer_config(),
        )

    @activity.defn(name="download_shards")
    async def download_shards(self, request: DownloadShardsInput) -> DownloadShardsResult:
        """Download and verify the shards this node's ranks restore from. No unverified byte is kept."""
        if not request.shards:
            raise ApplicationError("no shards to download", type="NoShards", non_retryable=True)
        layout = RunLayout.of(self.workdir, request.workflow_id)
        step = int(request.shards[0].key.rsplit("/", 2)[-2].removeprefix("step-"))
        restore_dir = layout.restore_dir(step)
        restore_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        for shard in request.shards:
            await asyncio.to_thread(self._download_one, request.bucket, restore_dir, shard)
            activity.heartbeat({"downloaded_rank": shard.rank})
        for old in restore_dir.parent.glob("step-*"):
            if old != restore_dir:
                shutil.rmtree(old, ignore_errors=True)
        return DownloadShardsResult(
            restore_dir=str(restore_dir),
            num_bytes=sum(s.size_bytes for s in request.shards),
            seconds=time.monotonic() - started,
        )

    def _download_one(self, bucket: str, restore_dir: Path, shard: ShardInfo) -> None:
        final = restore_dir / shard_name(shard.rank)
        meta = restore_dir / shard_meta_name(shard.rank)
        if final.exists() and meta.exists() and json.loads(meta.read_text()).get("sha256") == shard.sha256:
            return
        partial = restore_dir / f".{shard_name(shard.rank)}.part"
        try:
            s3_client().download_file(bucket, shard.key, str(partial), Config=_transfer_config())
        except ClientError as error:
            if _is_missing(error):
                raise ApplicationError(f"shard {shard.key} is missing from the store", type="CorruptCheckpoint",
                                       non_retryable=True) from None
            raise
        actual = sha256_file(partial)
        if actual != shard.sha256:
            partial.unlink(missing_ok=True)
            raise ApplicationError(
                f"shard {shard.key} has sha256 {actual[:12]}..., manifest says {shard.sha256[:12]}...",
                type="CorruptCheckpoint",
                non_retryable=True,
            )
        partial.replace(final)
        meta.write_text(json.dumps({"rank": shard.rank, "size_bytes": shard.size_bytes, "sha256": shard.sha256}))
