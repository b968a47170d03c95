"""Reading checkpoints back from the S3 store: steps under a run's prefix, manifests (paged, tagged), shards'
presence and orphaned uploads. The committer and retention (`activities.checkpoint_store`), the agent's
transfers and chaos read through these.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, TypeVar

from botocore.exceptions import ClientError
from pydantic import BaseModel
from temporalio.exceptions import ApplicationError

from activities.checkpoint_layout import SHA256_METADATA, ObjectRefused, shard_objects, tag_problem, verified_object
from activities.models import Manifest, ManifestPage, ShardInfo
from trainguard.error_types import ErrorType
from trainguard.protocol import shard_name
from trainguard.rank import FORMAT_DCP

log = logging.getLogger("activities.checkpoints")

ORPHANED_UPLOAD_AGE_S = 3600.0
"""A multipart upload under a run's prefix initiated longer ago than this is abandoned, and aborted.

An upload lives at most one watch's upload of a step (TRANSFER_TIMEOUT, 30 min, in workflows/node_group.py;
boto3 starts a new upload on a retry, never resumes one). Twice that leaves room for clock skew between the
store (which stamps `Initiated`) and the controller, so an upload still in flight is never aborted under
its writer.
"""


class ManifestRefused(ValueError):
    """A manifest whose integrity tag is missing or wrong under the controller's key: never restored."""


STORE_CHECK_THREADS = 16
"""HEADs in flight when a restore checks that a checkpoint's shards are all there: 32,768 one after the
other would take minutes."""


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def is_missing(error: ClientError) -> bool:
    return error_code(error) in ("404", "NoSuchKey", "NotFound")


def not_modified(error: ClientError) -> bool:
    """A conditional read (`IfNoneMatch`) of an object that has not changed."""
    return error_code(error) in ("304", "NotModified")


def bucket_missing(error: ClientError, bucket: str) -> ApplicationError | None:
    if error_code(error) == "NoSuchBucket":
        return ApplicationError(
            f"checkpoint.bucket {bucket!r} does not exist in the S3 store", type=ErrorType.BAD_SPEC, non_retryable=True
        )
    return None



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


Record = TypeVar("Record", bound=BaseModel)


def read_signed_records(client: Any, bucket: str, prefix: str, model: type[Record], context: bytes,
                        cache: dict[str, tuple[str, Record | None]], token: str | None = None) -> list[Record]:
    """Every node's record of one kind under `prefix` (a run's pace windows, its fingerprints), as `model`; only
    records whose ETag changed are read again. With the pool's peer token, a record without the tag its agent
    makes with it under `context` counts for nothing, and that version is not read again: anyone with the
    store's key could otherwise have healthy nodes judged slow or corrupt, replaced and cordoned. One
    half-written or foreign is skipped: its node's next write replaces it."""
    records: list[Record] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            key, etag = obj["Key"], obj["ETag"]
            if key not in cache or cache[key][0] != etag:
                try:
                    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
                    cache[key] = (etag, model.model_validate(verified_object(body, context, key, token)))
                except ObjectRefused as refused:
                    cache[key] = (etag, None)
                    log.warning("%s %s refused: %s", model.__name__, key, refused)
                    continue
                except ValueError:
                    continue
            record = cache[key][1]
            if record is not None:
                records.append(record)
    return records


def read_object(client: Any, bucket: str, key: str) -> bytes | None:
    """The object's bytes; None when there is none."""
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        if is_missing(error):
            return None
        raise


def stored_manifest(client: Any, bucket: str, key: str, secret: bytes | None,
                     sha256: str | None = None) -> tuple[dict[str, Any], str] | None:
    """The manifest object at `key` as stored and the sha256 of its bytes (None when there is none), its tag
    checked when `secret` is given and its bytes when `sha256` is (ManifestRefused); not JSON raises ValueError."""
    body = read_object(client, bucket, key)
    if body is None:
        return None
    digest = hashlib.sha256(body).hexdigest()
    if sha256 is not None and digest != sha256:
        raise ManifestRefused(f"its bytes have sha256 {digest[:12]}..., not the {sha256[:12]}... the controller "
                              "verified when it chose this checkpoint: changed since")
    document = json.loads(body)
    if not isinstance(document, dict):
        raise ValueError(f"manifest {key} is not a JSON object")
    if secret is not None and (problem := tag_problem(document, secret)):
        raise ManifestRefused(problem)
    return document, digest


def read_manifest(client: Any, bucket: str, key: str, ranks: list[int] | None = None, *,
                  secret: bytes | None = None, sha256: str | None = None) -> Manifest | None:
    """The manifest at `key` with its shard list filled in: all of it, or the pages holding the shards
    `ranks` restore (rank r: shard r mod the checkpoint's world size). None when there is none. A page whose
    bytes do not match the manifest raises ValueError, like bad JSON; with `secret` (the controller's key), so
    does a manifest whose integrity tag is missing or wrong (ManifestRefused), and with `sha256` (the digest
    the controller verified, `DownloadShardsInput.manifest_sha256`) one whose bytes are other ones."""
    found = read_manifest_digest(client, bucket, key, ranks, secret=secret, sha256=sha256)
    return None if found is None else found[0]


def read_manifest_digest(client: Any, bucket: str, key: str, ranks: list[int] | None = None, *,
                         secret: bytes | None = None, sha256: str | None = None) -> tuple[Manifest, str] | None:
    """`read_manifest`, with the sha256 of the manifest object's bytes: a paged manifest's pages are bound to
    it by their sha256s in it, so the digest names the whole shard list."""
    stored = stored_manifest(client, bucket, key, secret, sha256)
    if stored is None:
        return None
    document, digest = stored
    manifest = Manifest.model_validate(document)
    if not manifest.pages:
        return manifest, digest
    # A DCP checkpoint restores from every shard; else rank r from shard r mod the world size.
    needed = (None if ranks is None or manifest.state_format == FORMAT_DCP
              else {r % manifest.world_size for r in ranks})
    shards = _read_pages(client, bucket, manifest.pages, needed)
    if needed is not None:  # a replica restores its original's shard: read that page too
        read = {s.rank for s in shards}
        originals = {s.replica_of for s in shards if s.replica_of is not None} - read
        if originals:
            shards.extend(s for s in _read_pages(client, bucket, manifest.pages, originals) if s.rank not in read)
    return manifest.model_copy(update={"shards": shards}), digest


def _read_pages(client: Any, bucket: str, pages: list[ManifestPage], ranks: set[int] | None) -> list[ShardInfo]:
    """The shards on the pages that hold `ranks` (None: every page), each page checked against its sha256."""
    shards: list[ShardInfo] = []
    for page in pages:
        if ranks is not None and not any(page.first_rank <= r < page.first_rank + page.num_ranks for r in ranks):
            continue
        try:
            data = client.get_object(Bucket=bucket, Key=page.key)["Body"].read()
        except ClientError as error:
            if is_missing(error):
                raise ValueError(f"manifest page {page.key} is missing") from None
            raise
        if hashlib.sha256(data).hexdigest() != page.sha256:
            raise ValueError(f"manifest page {page.key} does not match its sha256")
        shards.extend(ShardInfo.model_validate(s) for s in json.loads(data))
    return shards


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
                if error_code(error) != "NoSuchUpload":  # completed or aborted since the listing
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
        if is_missing(error):
            return f"shard of rank {shard.rank} missing ({shard.key})"
        raise
    if head["ContentLength"] != shard.size_bytes:
        return f"shard of rank {shard.rank} is {head['ContentLength']} bytes, manifest says {shard.size_bytes}"
    recorded = head.get("Metadata", {}).get(SHA256_METADATA)
    if recorded is not None and recorded != shard.sha256:
        return f"shard of rank {shard.rank} has sha256 {recorded[:12]}..., manifest says {shard.sha256[:12]}..."
    return None


def committed_shard(client: Any, bucket: str, key: str, rank: int) -> ShardInfo | None:
    """The shard of `rank` that the manifest at `key` commits; None when there is no readable manifest."""
    try:
        manifest = read_manifest(client, bucket, key)
    except ValueError:
        return None  # unreadable: no reader will restore it, so it has nothing to protect
    if manifest is None:
        return None
    return next((s for s in manifest.shards if s.rank == rank), None)
