"""Where checkpoints live in the bucket, and what a manifest must say: pure, no store calls.

    <prefix>/<workflow-id>/step-00000100/rank-00000.pt     one shard per rank (torch.save of a dict)
    <prefix>/<workflow-id>/step-00000100/dcp/...            or a DCP checkpoint's files, its own names
    <prefix>/<workflow-id>/step-00000100/nodes/<node>.json a node's record: its shards are all uploaded
    <prefix>/<workflow-id>/step-00000100/manifest-00000.json  pages of a large manifest's shard list
    <prefix>/<workflow-id>/step-00000100/manifest.json     written last: the commit
    <prefix>/<workflow-id>/owner.json                      the run the namespace belongs to (`NamespaceOwner`)

Integrity: a manifest carries an HMAC under the controller's manifest key (`manifest_tag`); a node's records
(checkpoint, pace) and the run's relaunch decision carry one under the pool's peer token (`object_tag`), which
the agents and the controller hold.

The store's side (reads, commits, retention) is `activities.checkpoint_store`; the node's uploads and
downloads are `activities.checkpoint_transfers`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from typing import Any

from temporalio.exceptions import ApplicationError

from activities.models import Manifest, ManifestPage, NamespaceOwner, ShardFile, ShardInfo
from trainguard.protocol import shard_name, step_dir_name
from trainguard.error_types import ErrorType
from trainguard.rank import DCP_METADATA, FORMAT_DCP, FORMAT_TORCH
from trainguard.safe_load import DCP_DIR, files_digest
from trainguard.spec import ANY_RUN

MANIFEST_NAME = "manifest.json"
SHA256_METADATA = "sha256"
MANIFEST_FORMAT = Manifest.model_fields["format"].default

MANIFEST_PAGE_RANKS = 1024
"""Shards listed inline in a manifest, and per page beyond that: a page is about 150 KB, one GET per node
at a restore, and never near a payload or object-size limit."""

NODE_RECORDS = "nodes"
OWNER_NAME = "owner.json"
MANIFEST_TAG_FIELD = "tag"


def decision_key(run_prefix: str) -> str:
    """The run's newest relaunch decision (`AttemptDecision`), which nodes watching in place take up."""
    return f"{run_prefix}/attempt.json"


def owner_key(run_prefix: str) -> str:
    """The namespace's owner record: the one run that restores and prunes the checkpoints under it."""
    return f"{run_prefix}/{OWNER_NAME}"


def node_record_key(run_prefix: str, step: int, node: str) -> str:
    return f"{step_prefix(run_prefix, step)}{NODE_RECORDS}/{node}.json"


def step_prefix(run_prefix: str, step: int) -> str:
    return f"{run_prefix}/{step_dir_name(step)}/"


def manifest_key(run_prefix: str, step: int) -> str:
    return f"{step_prefix(run_prefix, step)}{MANIFEST_NAME}"



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


def doomed_steps(steps: list[int], committed: list[int], keep_last: int, protect: list[int]) -> list[int]:
    """The step folders retention deletes: committed checkpoints beyond the newest `keep_last`, and folders
    never committed that `keep_last` newer commits have made useless (a crashed attempt's leftovers). An
    uncommitted folder with fewer newer commits may still be uploading or committing: commits can finish out
    of order, and deleting it would lose a checkpoint retention means to keep."""
    newest = sorted(committed, reverse=True)
    keep = set(newest[:keep_last]) | set(protect)
    return [s for s in steps if s not in keep
            and (s in committed or sum(1 for c in newest if c > s) >= keep_last)]


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


def shard_layout_problem(shard: ShardInfo, run_prefix: str, step: int) -> str | None:
    """None when `shard` (not a replica) lies where the layout puts it in step `step`'s folder of the run at
    `run_prefix`; else where it lies instead (another run's object, a file name outside the DCP layout)."""
    name = f"{DCP_DIR}/" if shard.files is not None else shard_name(shard.rank)
    expected = f"{step_prefix(run_prefix, step)}{name}"
    if shard.key != expected:
        return f"manifest puts the shard of rank {shard.rank} at {shard.key}, not {expected}"
    bad = [f.name for f in shard.files or [] if not _DCP_FILE.fullmatch(f.name)]
    if bad:
        return f"the shard of rank {shard.rank} names a file outside the DCP layout: {bad[0]!r}"
    return None


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
        if problem := shard_layout_problem(shard, run_prefix, step):
            return problem
    if manifest.state_format == FORMAT_DCP:
        if any(s.files is None for s in manifest.shards):
            return "a DCP checkpoint with a torch.save shard in it"
        metadata = [s.rank for s in manifest.shards for f in s.files or [] if f.name == DCP_METADATA]
        if len(metadata) != 1:
            return f"a DCP checkpoint needs one {DCP_METADATA}, the manifest names {len(metadata)}"
    return None


def shard_from_meta(meta: dict[str, Any], prefix: str, node: str) -> ShardInfo:
    """The shard a rank's meta file (written by `trainguard.rank`) describes, keyed under `prefix`."""
    rank = int(meta["rank"])
    fingerprint = meta.get("fingerprint") if isinstance(meta.get("fingerprint"), list) else None
    if meta.get("replica_of") is not None:
        return ShardInfo(rank=rank, size_bytes=0, sha256="", node=node, replica_of=int(meta["replica_of"]),
                         fingerprint=fingerprint)
    if meta.get("format") == FORMAT_DCP:
        files = [ShardFile.model_validate(f) for f in meta["files"]]
        sha = files_digest([f.model_dump() for f in files])
        if sha != meta["sha256"]:
            raise ApplicationError(f"the meta file of rank {rank} does not add up ({sha[:12]}...)",
                                   type=ErrorType.CORRUPT_LOCAL_SHARD, non_retryable=True)
        return ShardInfo(rank=rank, key=f"{prefix}{DCP_DIR}/", size_bytes=sum(f.size_bytes for f in files),
                         sha256=sha, node=node, files=files, fingerprint=fingerprint)
    return ShardInfo(rank=rank, key=f"{prefix}{shard_name(rank)}", size_bytes=meta["size_bytes"],
                     sha256=meta["sha256"], node=node, sharded=bool(meta.get("sharded")), fingerprint=fingerprint)


def object_name(key: str) -> str:
    """An object's path under its step's folder (`.../step-00000100/dcp/__0_0.distcp` -> `dcp/__0_0.distcp`),
    which is also its path under the step's folder on a node."""
    return key.rsplit("/step-", 1)[1].split("/", 1)[1]


def step_of(key: str) -> int:
    """The step of any object under a step's folder (`.../step-00000100/rank-00000.pt`,
    `.../step-00000100/dcp/.metadata` -> 100)."""
    return int(key.rsplit("/step-", 1)[1].split("/", 1)[0])


# ------------------------------------------------------------------------------------------ integrity


def _canonical(document: dict[str, Any]) -> bytes:
    """A manifest object's canonical JSON: its fields as stored, sorted, without the tag. Computed over the
    stored document, not over this release's model, so fields a newer release adds are covered too."""
    body = {k: v for k, v in document.items() if k != MANIFEST_TAG_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_tag(document: dict[str, Any], secret: bytes) -> str:
    """HMAC-SHA256 of the manifest's canonical JSON under the controller's manifest key, hex."""
    return hmac.new(secret, _canonical(document), hashlib.sha256).hexdigest()


def signed_body(body: bytes, secret: bytes | None) -> bytes:
    """The manifest object's bytes with its integrity tag set (as they are without a key)."""
    if secret is None:
        return body
    document = json.loads(body)
    document[MANIFEST_TAG_FIELD] = manifest_tag(document, secret)
    return json.dumps(document, indent=1).encode()


def tag_problem(document: dict[str, Any], secret: bytes) -> str | None:
    """None when the stored manifest carries the tag only the controller's key makes; else why not.

    A page's bytes are bound by its sha256 in the tagged header, so the tag covers a paged manifest whole."""
    tag = document.get(MANIFEST_TAG_FIELD)
    if not tag:
        return "manifest has no integrity tag: the controller did not write it (or wrote it before it had a key)"
    if not isinstance(tag, str) or not hmac.compare_digest(tag, manifest_tag(document, secret)):
        return "manifest integrity tag does not match: written without the controller's key, or changed since"
    return None


NODE_RECORD_TAG_CONTEXT = b"trainguard-node-record-v1\n"
PACE_TAG_CONTEXT = b"trainguard-pace-v1\n"
FINGERPRINT_TAG_CONTEXT = b"trainguard-fingerprints-v1\n"
DECISION_TAG_CONTEXT = b"trainguard-attempt-v1\n"
"""What a record's or a decision's tag signs first: a tag under the pool's peer token is valid for one kind of
object only, never as another kind's, nor as a registration's proof (`trainguard.pool.REGISTRATION_PROOF_CONTEXT`)."""


def object_tag(context: bytes, key: str, document: dict[str, Any], token: str) -> str:
    """HMAC-SHA256 under the pool's peer token of `context`, the object's key and its canonical JSON (the tag
    left out), hex: bound to the key, so a tagged object copied to another key (another node, step or run) is
    refused there."""
    message = context + key.encode() + b"\n" + _canonical(document)
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def signed_object(body: bytes, context: bytes, key: str, token: str | None) -> bytes:
    """The object's bytes with its tag under the peer token `token` set (as they are without a token)."""
    if not token:
        return body
    document = json.loads(body)
    document[MANIFEST_TAG_FIELD] = object_tag(context, key, document, token)
    return json.dumps(document, separators=(",", ":")).encode()


def object_tag_problem(document: dict[str, Any], context: bytes, key: str, token: str) -> str | None:
    """None when the stored object at `key` carries the tag only a holder of the pool's peer token makes;
    else why not."""
    tag = document.get(MANIFEST_TAG_FIELD)
    if not tag:
        return "unsigned: written without the pool's TRAINGUARD_PEER_TOKEN (or by a release before tags)"
    if not isinstance(tag, str) or not hmac.compare_digest(tag, object_tag(context, key, document, token)):
        return "its tag does not match: written without the pool's TRAINGUARD_PEER_TOKEN, moved, or changed since"
    return None


class ObjectRefused(ValueError):
    """A node's record (checkpoint, pace) or a relaunch decision whose tag under the pool's peer token is missing
    or wrong."""


def verified_object(body: bytes, context: bytes, key: str, token: str | None) -> dict[str, Any]:
    """The stored object at `key` as a JSON object, its tag checked when `token` is given: ValueError (not JSON,
    or `ObjectRefused`) otherwise."""
    document = json.loads(body)
    if not isinstance(document, dict):
        raise ValueError(f"{key} is not a JSON object")
    if token and (problem := object_tag_problem(document, context, key, token)):
        raise ObjectRefused(problem)
    return document


def resume_allowed(owner: NamespaceOwner, workflow_id: str) -> bool:
    """Whether the namespace's owner consents to run `workflow_id` restoring its checkpoints: its
    `allow_resume` names that run (or any, `*`); without one, only a later run under the owner's own id."""
    if owner.allow_resume is None:
        return workflow_id == owner.workflow_id
    return workflow_id in owner.allow_resume or ANY_RUN in owner.allow_resume


def owner_problem(owner: NamespaceOwner, workflow_id: str, run_prefix: str, chain_id: str = "",
                  resuming: bool = False) -> str | None:
    """None when the namespace at `run_prefix` is the run's (`workflow_id`, chain `chain_id`) to restore from
    and prune; else what the run's operator should do. A run restores and prunes only checkpoints its own
    workflow id committed: sharing a namespace let one run restore another's checkpoint, prune it away and
    leave its own shards in their place. A new run under a closed run's id is another run (another chain):
    it takes the namespace over only when it resumes it explicitly (`resuming`) and the owner consents.
    An empty chain on either side (a record or a history from before chains) compares workflow ids only."""
    if owner.workflow_id != workflow_id:
        return (f"the checkpoint namespace {run_prefix}/ belongs to run {owner.workflow_id!r}: a run restores and "
                f"prunes only its own checkpoints. Leave checkpoint.namespace unset (or choose an unused one), and "
                f"to start from that run's checkpoints set checkpoint.resume_from to {owner.workflow_id!r} "
                f"(`trainguard run start --resume-from {owner.workflow_id}`), which that run's "
                f"checkpoint.allow_resume must allow: it restores from them and never prunes them")
    if not chain_id or not owner.chain_id or owner.chain_id == chain_id:
        return None
    earlier = f"the checkpoint namespace {run_prefix}/ belongs to an earlier run under the id {workflow_id!r}"
    if not resuming:
        return (f"{earlier} (chain {owner.chain_id}), and this is a new run under that id: it neither restores "
                f"nor prunes that run's checkpoints unless it resumes them. Start it fresh under a checkpoint.prefix "
                f"(or checkpoint.namespace) no run has used (`trainguard run start` without --resume does this "
                f"itself), or resume that run explicitly: `trainguard run start --resume` (in the spec: "
                f"checkpoint.resume_from {workflow_id!r})")
    if not resume_allowed(owner, workflow_id):
        return (f"{earlier} (chain {owner.chain_id}), whose checkpoint.allow_resume {owner.allow_resume} does not "
                f"let a later run under its id resume it. Start this run under a checkpoint.prefix (or "
                f"checkpoint.namespace) no run has used; an operator who means to hand the checkpoints over adds "
                f"{workflow_id!r} to allow_resume in {owner_key(run_prefix)}")
    return None


def resume_problem(owner: NamespaceOwner, reader: str, source_prefix: str) -> str | None:
    """None when run `reader` may restore the checkpoints under `source_prefix` (`checkpoint.resume_from`);
    else what its operator should do. Reading another run's checkpoints needs the owner's consent."""
    if resume_allowed(owner, reader):
        return None
    allowed = ("unset: only a later run under its own id" if owner.allow_resume is None
               else f"{owner.allow_resume}")
    return (f"run {reader!r} may not restore the checkpoints under {source_prefix}/: they belong to run "
            f"{owner.workflow_id!r}, whose checkpoint.allow_resume ({allowed}) does not name {reader!r}. Start "
            f"{owner.workflow_id!r} with checkpoint.allow_resume naming {reader!r} (an operator may add it to "
            f"allow_resume in {owner_key(source_prefix)}), or leave checkpoint.resume_from unset")
