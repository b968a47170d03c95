"""The controller's side of checkpoints: find, commit and prune them in the store (`StoreActivities`), and
the store reads they rest on.

A checkpoint without a manifest does not exist. The manifest is written only after every shard it names is
in the store with the size and sha256 the rank recorded, and never overwritten (conditional write). A reader
trusts a manifest only when it describes a whole checkpoint of its own step in this layout; a manifest that
cannot be parsed, or that names shards elsewhere or too few of them, is passed over like a missing one.

A namespace belongs to one run (`activities.checkpoint_owner`). With a manifest key (`TRAINGUARD_MANIFEST_KEY`,
the controller's alone) every manifest carries an HMAC of its canonical JSON, and a restore passes over one whose
tag is missing or wrong: a manifest planted in the store is never restored; the restore hands the nodes the sha256
of the manifest's bytes it verified. With the pool's peer token (`TRAINGUARD_PEER_TOKEN`) the committer commits
only from node records (and judges pace only from pace records) an agent tagged with it, and the run's relaunch
decision is tagged with it for the agents.

Multipart uploads that an uploader abandoned (killed mid-upload) are invisible to listings but keep their
parts until aborted: retention aborts the ones under the run's prefix once they are surely dead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from activities.checkpoint_layout import (
    DECISION_TAG_CONTEXT,
    NODE_RECORD_TAG_CONTEXT,
    NODE_RECORDS,
    ObjectRefused,
    decision_key,
    doomed_steps,
    manifest_body,
    manifest_header,
    manifest_key,
    manifest_problem,
    reshardable_of,
    restore_sources,
    signed_body,
    signed_object,
    state_format_of,
    step_prefix,
    verified_object,
)
from activities.checkpoint_owner import check_consent, claim_namespace, manifest_author
from activities.models import (
    AttemptDecision,
    CommitCheckpointsInput,
    CommitCheckpointsResult,
    CommittedCheckpoint,
    FindCheckpointInput,
    FindCheckpointResult,
    Manifest,
    NodeCheckpointRecord,
    PruneCheckpointsInput,
    PruneCheckpointsResult,
    PublishAttemptInput,
    ShardInfo,
)
from activities.fingerprints import fingerprint_problem, judge_records, read_fingerprints, settle_records
from activities.fingerprint_models import CorruptionVerdict, FingerprintRecord, TieSettlement
from activities.pace import judge_window, read_pace
from activities.pace_models import PaceRecord, PaceVerdict
from trainguard.error_types import ErrorType
from trainguard.models import CheckpointRef
from trainguard.rank import DCP_METADATA, FORMAT_DCP
from trainguard.settings import s3_client

from activities.store_reads import (STORE_CHECK_THREADS, ManifestRefused, bucket_missing, error_code, is_missing,
                                    abort_orphaned_uploads, check_shard_in_store, list_steps, read_manifest,
                                    read_manifest_digest)

log = logging.getLogger("activities.checkpoints")
"""The checkpoint logs keep the name they always had, whichever part of them logs."""

MANIFEST_KEY_ENV = "TRAINGUARD_MANIFEST_KEY"
"""The controller's manifest key: it tags every manifest it writes and trusts no other. Only the controller
holds it; node agents verify shards against the manifest the controller verified and handed them."""
MIN_MANIFEST_KEY_CHARS = 32


def manifest_key_from_env(environ: dict[str, str] | None = None) -> bytes | None:
    """The controller's manifest key from `TRAINGUARD_MANIFEST_KEY`; None when unset (manifests untagged,
    and any manifest trusted). A short key is refused: it would be guessed."""
    value = (os.environ if environ is None else environ).get(MANIFEST_KEY_ENV, "").strip()
    if not value:
        return None
    if len(value) < MIN_MANIFEST_KEY_CHARS:
        raise ValueError(f"{MANIFEST_KEY_ENV} has {len(value)} characters, fewer than {MIN_MANIFEST_KEY_CHARS}: "
                         f"use a long random one (python -c 'import secrets; print(secrets.token_hex(32))')")
    return value.encode()


STORE_ERROR_POLL_S = 5.0
"""How often a committer whose store is out tries it again (it heartbeats meanwhile)."""

ADOPT_RECHECK_S = 10.0
"""How often a committer looks again for a manifest of its own run that nothing reported, per step above the
run's last commit with no record of the current attempt: one GET per such step at most this often."""


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


PACE_POLL_MIN_S = 1.0
PACE_POLLS_PER_WINDOW = 10
"""The committer looks at the nodes' pace this many times a straggler window, at most once a second: a node's
record changes once a window, each node at its own moment, and a slow one is seen within a tenth of a window
(only records whose ETag changed are read again)."""


FINGERPRINT_POLL_S = 1.0
"""The committer looks at the nodes' fingerprints at most this often: a node writes its record at most once a second
(`activities.fingerprints.FINGERPRINT_WRITE_MIN_S`), and only records whose ETag changed are read again."""


@dataclass
class _CommitterState:
    """What one committer activity remembers between its passes over the store."""

    records: dict[str, tuple[str, NodeCheckpointRecord | None]] = field(default_factory=dict)
    """Record key -> (ETag, record): a record is read again only when it changed. None: refused (unsigned, or
    its tag wrong, under the pool's peer token)."""
    refused: set[int] = field(default_factory=set)
    """Steps another writer's manifest holds: never committed by this one."""
    pace: dict[str, tuple[str, PaceRecord | None]] = field(default_factory=dict)
    """Pace record key -> (ETag, record), as `records`."""
    pace_before: dict[str, PaceRecord] = field(default_factory=dict)
    """Node -> the record its newest one replaced: the node's step wall time, which a rank's reported compute
    is checked against (`activities.pace.plausible_compute`)."""
    next_pace: float = 0.0
    """Monotonic time of the next look at the nodes' pace."""
    fingerprints: dict[str, tuple[str, FingerprintRecord | None]] = field(default_factory=dict)
    """Fingerprint record key -> (ETag, record), as `records`."""
    next_fingerprints: float = 0.0
    """Monotonic time of the next look at the nodes' fingerprints."""
    adopt_next: dict[int, float] = field(default_factory=dict)
    """Step -> monotonic time of the next look for a manifest of this run's that nothing reported (`_adopt`)."""
    settled: set[int] = field(default_factory=set)
    """Steps at or below the run's newest commit known to have a manifest: not looked at again."""
    late_next: dict[int, float] = field(default_factory=dict)
    """Step -> monotonic time of the next look at such a step without a manifest and without this attempt's
    records (a crashed attempt's leftovers: at 4,096 nodes a look is several LISTs)."""
    pruned: bool = False
    """Retention ran in this activity (a drain applies it once even when it commits nothing)."""


class StoreActivities:
    """Controller-side activities: find, commit and prune checkpoints in the store."""

    def __init__(self, secret: bytes | None = None, token: str | None = None) -> None:
        self.secret = secret
        """The manifest key (`manifest_key_from_env`): tags what this controller commits, refuses the rest.
        None: manifests go untagged and any is trusted."""
        self.token = token
        """The pool's peer token (`TRAINGUARD_PEER_TOKEN`), which the agents hold too: it tags the relaunch
        decisions this controller publishes, and the committer commits only from node records tagged with it.
        None: decisions go untagged and every record counts."""
        self.refused_records = 0
        """Node records refused for their tag since this controller started (each version counted once)."""

    @activity.defn(name=names.PUBLISH_ATTEMPT)
    async def publish_attempt(self, request: PublishAttemptInput) -> None:
        """Write the run's relaunch decision for its nodes to take up. Idempotent: a decision older than the one
        in the store (a retry that lost a race with the next relaunch) leaves the newer in place."""
        await _heartbeating(self._publish, request)

    def _publish(self, request: PublishAttemptInput) -> None:
        client, key = s3_client(), decision_key(request.run_prefix)
        try:
            body = client.get_object(Bucket=request.bucket, Key=key)["Body"].read()
            there = AttemptDecision.model_validate(verified_object(body, DECISION_TAG_CONTEXT, key, self.token))
            if there.chain_id == request.decision.chain_id and there.attempt > request.decision.attempt:
                return
        except ClientError as error:
            if not is_missing(error):
                raise bucket_missing(error, request.bucket) or error  # noqa: B904 - re-raises `error` itself unless translated, as before
        except ValueError:
            pass  # unreadable, or (with a token) not tagged with it: written over
        body = signed_object(request.decision.model_dump_json().encode(), DECISION_TAG_CONTEXT, key, self.token)
        client.put_object(Bucket=request.bucket, Key=key, Body=body, ContentType="application/json")

    @activity.defn(name=names.FIND_CHECKPOINT)
    async def find_checkpoint(self, request: FindCheckpointInput) -> FindCheckpointResult:
        """The newest committed checkpoint of this run (or, while it has none, of the run it resumes from)
        whose shards all exist with their recorded sizes and checksums."""
        if request.workflow_id is None:  # a workflow from before owners: the caller's id is the owner
            request = request.model_copy(update={"workflow_id": activity.info().workflow_id})
        return await _heartbeating(self._find, request)

    def _find(self, request: FindCheckpointInput) -> FindCheckpointResult:
        """`workflow_id` None (a tool, a test reading a store): any run's manifests, and no owner claimed."""
        client = s3_client()
        skipped: list[str] = []
        try:
            if request.workflow_id is not None:
                claim_namespace(client, request, request.workflow_id)
            found = self._newest(client, request, request.run_prefix, request.workflow_id, "", skipped)
            source = request.resume_prefix
            if (found is None and request.resume_from and source
                    and (source, request.resume_from) != (request.run_prefix, request.workflow_id)):
                if request.workflow_id is not None:
                    check_consent(client, request.bucket, source, request.workflow_id)
                found = self._newest(client, request, source, request.resume_from,
                                     f"run {request.resume_from}: ", skipped)
        except ClientError as error:
            raise bucket_missing(error, request.bucket) or error  # noqa: B904 - re-raises `error` itself unless translated, as before
        if found is None:
            return FindCheckpointResult(skipped=skipped)
        key, manifest, digest = found
        return FindCheckpointResult(manifest=manifest_header(manifest), manifest_key=key, manifest_sha256=digest,
                                    skipped=skipped)

    def _newest(self, client: Any, request: FindCheckpointInput, run_prefix: str, author: str | None, label: str,
                skipped: list[str]) -> tuple[str, Manifest, str] | None:
        """The newest restorable manifest under `run_prefix` that `author` committed (None: anyone), with its
        key and the sha256 of its bytes; what it passed over goes to `skipped`, each line starting with `label`."""
        for step in list_steps(client, request.bucket, run_prefix):
            if step in request.exclude_steps:
                skipped.append(f"{label}step {step}: a shard failed verification at download")
                continue
            if request.before_step is not None and step >= request.before_step:
                skipped.append(f"{label}step {step}: at or after step {request.before_step}, the first the run "
                               f"found wrong (rolled back past it)")
                continue
            key = manifest_key(run_prefix, step)
            try:
                stored = read_manifest_digest(client, request.bucket, key, secret=self.secret)
            except ManifestRefused as refused:
                log.warning("passing over %s: %s", key, refused)
                skipped.append(f"{label}step {step}: {refused}")
                continue
            except ValueError as error:
                skipped.append(f"{label}step {step}: unreadable manifest ({error.__class__.__name__})")
                continue
            if stored is None:
                skipped.append(f"{label}step {step}: no manifest (never committed)")
                continue
            manifest, digest = stored
            problem = manifest_problem(manifest, run_prefix, step) or fingerprint_problem(manifest.shards)
            if author is not None and not problem and manifest.workflow_id != author:
                problem = f"committed by run {manifest.workflow_id!r}, not {author!r}"
                log.warning("passing over %s: %s", key, problem)
            if problem:
                skipped.append(f"{label}step {step}: {problem}")
                continue
            smallest = min(request.world_size, request.min_world_size or request.world_size)
            largest = max(request.world_size, request.max_world_size or 0)
            if not smallest <= manifest.world_size <= largest:
                skipped.append(f"{label}step {step}: written by {manifest.world_size} ranks, run has "
                               f"{request.world_size}")
                continue
            if not manifest.reshardable and manifest.world_size != request.world_size:
                skipped.append(f"{label}step {step}: a per-rank torch.save of sharded tensors written by "
                               f"{manifest.world_size} ranks cannot be resharded onto {request.world_size}")
                continue
            sources = restore_sources(manifest, list(range(request.world_size)))
            needed = list({s.rank: s for s in sources.values()}.values())
            with ThreadPoolExecutor(max_workers=STORE_CHECK_THREADS) as pool:
                problems = [p for p in pool.map(lambda s: check_shard_in_store(client, request.bucket, s), needed)
                            if p]
            if problems:
                skipped.append(f"{label}step {step}: {problems[0]}")
                continue
            return key, manifest, digest
        return None

    def _put_manifest(self, client: Any, bucket: str, run_prefix: str, manifest: Manifest) -> CheckpointRef:
        """Write the manifest (its pages first, its tag set), never over another: a retry finds its own."""
        key = manifest_key(run_prefix, manifest.step)
        body, pages = manifest_body(manifest, run_prefix)
        body = signed_body(body, self.secret)
        for page_key, data in pages.items():
            client.put_object(Bucket=bucket, Key=page_key, Body=data, ContentType="application/json")
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json",
                              IfNoneMatch="*")
        except ClientError as error:
            code = error_code(error)
            if code == "ConditionalRequestConflict":
                # Another conditional write of this key is in flight: retry and compare with what it wrote.
                raise ApplicationError(f"step {manifest.step}: concurrent manifest write, retrying",
                                       type=ErrorType.MANIFEST_WRITE_CONFLICT) from None
            if code not in ("PreconditionFailed", "412"):
                raise
            try:
                existing = read_manifest(client, bucket, key, secret=self.secret)
            except ValueError:
                existing = None  # an unreadable (or, with a key, untagged) manifest is not ours either
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

    @activity.defn(name=names.COMMIT_CHECKPOINTS)
    async def commit_checkpoints(self, request: CommitCheckpointsInput) -> CommitCheckpointsResult:
        """The committer: commit every step whose node records cover the world (manifest last), apply
        retention, and return what it committed. Heartbeats while it waits; idempotent (a step already
        committed is committed again as itself). Each pass over the store runs in a thread; the waits between
        passes do not, so a cancelled committer stops at once instead of holding a thread for minutes."""
        deadline = time.monotonic() + request.max_duration_s
        state = _CommitterState()
        last_change = time.monotonic()
        store_error: str | None = None
        while True:
            activity.heartbeat()
            try:
                commits, pending, changed = await asyncio.to_thread(self._commit_pass, request, state)
                store_error = None
            except (BotoCoreError, ClientError, OSError) as error:
                # The store is out (or refuses writes): keep polling to the deadline, and say why nothing
                # committed, so the run can tell its operator (a missing bucket is the spec's: raised as such).
                store_error = f"{type(error).__name__}: {error}"[:300]
                log.warning("commit pass over s3://%s/%s failed: %s", request.bucket, request.run_prefix, error)
                commits, pending, changed = [], True, False
            pace = await self._pace_pass(request, state) if store_error is None else None
            corruption, settled = await self._fingerprint_pass(request, state) if store_error is None else (None, None)
            if commits or pace is not None or corruption is not None or settled is not None:
                return CommitCheckpointsResult(commits=commits, pace=pace, corruption=corruption, settled=settled)
            now = time.monotonic()
            # A finished run's drain counts its quiet from when the store answers again.
            if changed or (request.wait_for_store and store_error is not None):
                last_change = now
            if now >= deadline:
                return CommitCheckpointsResult(store_error=store_error)
            if request.quiet_s is not None and (not pending or now - last_change >= request.quiet_s):
                return CommitCheckpointsResult(store_error=store_error)
            await asyncio.sleep(request.poll_interval_s if store_error is None else STORE_ERROR_POLL_S)

    async def _pace_pass(self, request: CommitCheckpointsInput, state: _CommitterState) -> PaceVerdict | None:
        """`PACE_POLLS_PER_WINDOW` times a straggler window: the ranks slow over the nodes' newest windows
        (`activities.pace`). A store error here is the next pass's to meet: the commits go on."""
        if request.pace_window_s is None or time.monotonic() < state.next_pace:
            return None
        state.next_pace = time.monotonic() + max(PACE_POLL_MIN_S, request.pace_window_s / PACE_POLLS_PER_WINDOW)
        known = {record.node: record for _, record in state.pace.values() if record is not None}
        try:
            records = await asyncio.to_thread(read_pace, s3_client(), request.bucket, request.run_prefix, state.pace,
                                              self.token)
        except (BotoCoreError, ClientError, OSError) as error:
            log.warning("reading the nodes' pace under s3://%s/%s failed: %s", request.bucket, request.run_prefix,
                        error)
            return None
        for record in records:
            if (earlier := known.get(record.node)) is not None and earlier is not record:
                state.pace_before[record.node] = earlier
        return judge_window(records, ratio=request.straggler_ratio, after=request.pace_after,
                            chain_id=request.chain_id, min_attempt=request.min_attempt, attempt=request.attempt,
                            before=state.pace_before)

    async def _fingerprint_pass(self, request: CommitCheckpointsInput, state: _CommitterState
                                ) -> tuple[CorruptionVerdict | None, TieSettlement | None]:
        """At most every `FINGERPRINT_POLL_S`: replicas whose newest fingerprints differ, and the replay's answer
        to an earlier tie (`activities.fingerprints`). A store error here is the next pass's to meet: the commits
        go on."""
        if not request.compare_fingerprints or time.monotonic() < state.next_fingerprints:
            return None, None
        state.next_fingerprints = time.monotonic() + FINGERPRINT_POLL_S
        try:
            records = await asyncio.to_thread(read_fingerprints, s3_client(), request.bucket, request.run_prefix,
                                              state.fingerprints, self.token)
        except (BotoCoreError, ClientError, OSError) as error:
            log.warning("reading the nodes' fingerprints under s3://%s/%s failed: %s", request.bucket,
                        request.run_prefix, error)
            return None, None
        corruption = judge_records(records, now=time.time(), chain_id=request.chain_id,
                                   min_attempt=request.min_attempt, attempt=request.attempt)
        settled = None if request.settle is None else settle_records(
            records, request.settle, chain_id=request.chain_id, min_attempt=request.min_attempt,
            attempt=request.attempt)
        return corruption, settled

    def _commit_pass(self, request: CommitCheckpointsInput, state: _CommitterState
                     ) -> tuple[list[CommittedCheckpoint], bool, bool]:
        """Commit what is complete, then apply retention. Returns (commits, whether a step is partly
        uploaded by this attempt, whether any node record is new since the last pass)."""
        client = s3_client()
        commits: list[CommittedCheckpoint] = []
        late_commits = 0
        pending = changed = False
        try:
            listed = list_steps(client, request.bucket, request.run_prefix)
        except ClientError as error:
            raise bucket_missing(error, request.bucket) or error  # noqa: B904 - re-raises `error` itself unless translated, as before
        late = self._late_steps(client, request, listed, state)
        steps = sorted([*late, *(s for s in listed if s > request.after_step)])
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
            if step <= request.after_step:
                # Uploads run side by side: a newer step can commit while an older one still uploads. Committed
                # when whole (a checkpoint the user may want), never reported: the run's newest is newer.
                if done is not None:
                    state.settled.add(step)
                    late_commits += 1
                elif any(r.attempt == request.attempt for r in found):
                    pending = True
                else:  # an older attempt's leftovers, until retention clears them: looked at now and then
                    state.late_next[step] = time.monotonic() + ADOPT_RECHECK_S
                continue
            if done is None and not any(r.attempt == request.attempt for r in found):
                done = self._adopt(client, request, step, state)
            if done is not None:
                commits.append(done)
            elif any(r.attempt == request.attempt for r in found):
                # Only this attempt's nodes still upload (an agent fences older attempts): half a step left by
                # an older one is not waited for again, as after a relaunch in which nothing trained.
                pending = True
        if commits or late_commits or (request.quiet_s is not None and not state.pruned):
            # The run's newest known commit stays until the run has heard of a newer one: a committer whose
            # result never reaches the run (given up as its attempt or the run ended) must not delete the
            # checkpoint the run's status and result name. A drain applies retention even when it commits
            # nothing, so what such a committer spared is pruned by the run's last pass.
            protect = [*(c.ref.step for c in commits[-1:]), *([request.after_step] if request.after_step >= 0 else [])]
            self._prune(PruneCheckpointsInput(bucket=request.bucket, run_prefix=request.run_prefix,
                                              keep_last=request.keep_last, workflow_id=request.workflow_id,
                                              chain_id=request.chain_id, protect_steps=protect))
            state.pruned = True
        return commits, pending, changed

    def _late_steps(self, client: Any, request: CommitCheckpointsInput, listed: list[int],
                    state: _CommitterState) -> list[int]:
        """Steps at or below the run's newest commit without a manifest (looked up once per step and
        committer: retention deletes such a folder once `keep_last` newer checkpoints are committed)."""
        late, now = [], time.monotonic()
        for step in listed:
            if step > request.after_step or step in state.settled or now < state.late_next.get(step, 0.0):
                continue
            if self._exists(client, request.bucket, manifest_key(request.run_prefix, step)):
                state.settled.add(step)
            else:
                late.append(step)
        return late

    def _adopt(self, client: Any, request: CommitCheckpointsInput, step: int,
               state: _CommitterState) -> CommittedCheckpoint | None:
        """A step this run committed in an attempt whose records no longer count: a committer given up as its
        attempt ended still wrote the manifest, and nothing reported it. Reported now, so the run's newest
        commit is the store's (its status, its result, retention's count). Looked at once every
        `ADOPT_RECHECK_S` per step: such a step stays above the run's last commit until it is pruned."""
        now = time.monotonic()
        if not request.chain_id or now < state.adopt_next.get(step, 0.0):
            return None
        state.adopt_next[step] = now + ADOPT_RECHECK_S
        key = manifest_key(request.run_prefix, step)
        try:
            manifest = read_manifest(client, request.bucket, key, secret=self.secret)
        except ValueError:  # unreadable or refused: not known to be ours
            return None
        if manifest is None or manifest.chain_id != request.chain_id or manifest.workflow_id != request.workflow_id:
            return None
        log.info("step %d was committed by attempt %d of this run without being reported: reporting it", step,
                 manifest.attempt)
        return CommittedCheckpoint(ref=CheckpointRef(step=step, manifest_key=key, bucket=request.bucket,
                                                     world_size=manifest.world_size, total_bytes=manifest.total_bytes,
                                                     reshardable=manifest.reshardable), step=step)

    def _node_records(self, client: Any, request: CommitCheckpointsInput, step: int,
                      cache: dict[str, tuple[str, NodeCheckpointRecord | None]]
                      ) -> tuple[list[NodeCheckpointRecord], bool]:
        """The node records of `step` that count for this commit (attempts `min_attempt`..`attempt`), and
        whether any was new or changed since the last look. With the pool's peer token, a record without its
        valid tag counts for nothing: anyone with the store's key could otherwise name shards of their choosing
        for the manifest this controller signs."""
        prefix = f"{step_prefix(request.run_prefix, step)}{NODE_RECORDS}/"
        changed = False
        found: list[NodeCheckpointRecord] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=request.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                key, etag = obj["Key"], obj["ETag"]
                if key not in cache or cache[key][0] != etag:
                    try:
                        body = client.get_object(Bucket=request.bucket, Key=key)["Body"].read()
                        document = verified_object(body, NODE_RECORD_TAG_CONTEXT, key, self.token)
                        cache[key] = (etag, NodeCheckpointRecord.model_validate(document))
                    except ObjectRefused as refused:
                        cache[key] = (etag, None)  # this version is not read again
                        self.refused_records += 1
                        log.warning("node record %s refused, its shards are not committed from it: %s (%d records "
                                    "refused by this controller)", key, refused, self.refused_records)
                        continue
                    except (ClientError, ValueError) as error:
                        log.warning("node record %s unreadable (%s); waiting for it to be rewritten", key, error)
                        continue
                    changed = True
                record = cache[key][1]
                if record is None:
                    continue
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
                            attempt=request.attempt, chain_id=request.chain_id, shards=shards,
                            total_bytes=sum(s.size_bytes for s in shards),
                            created_at=time.time(), state_format=state_format_of(shards),
                            reshardable=reshardable_of(shards))
        ref = self._put_manifest(client, request.bucket, request.run_prefix, manifest)
        return CommittedCheckpoint(ref=ref, step=min((r.node_step for r in records), default=step))

    def _prune(self, request: PruneCheckpointsInput) -> PruneCheckpointsResult:
        """Retention, after each committer pass that commits: keep the newest `keep_last` checkpoints this run
        (workflow id and chain) committed; delete its older ones, manifest first. A step another run committed
        (an earlier run under the same id included, or one whose manifest names no chain, is unreadable, or
        untagged under a key) is neither kept nor counted nor deleted: never this run's to prune."""
        client = s3_client()
        steps, committed = [], []
        for step in list_steps(client, request.bucket, request.run_prefix):
            author = manifest_author(client, request.bucket, manifest_key(request.run_prefix, step), self.secret)
            if author is False:
                steps.append(step)  # never committed: retention may clear it (`doomed_steps`)
            elif request.workflow_id is None or (
                    isinstance(author, tuple) and author[0] == request.workflow_id
                    and (not request.chain_id or author[1] == request.chain_id)):
                steps.append(step)
                committed.append(step)
            else:
                log.warning("retention leaves step %d under %s alone: %s", step, request.run_prefix,
                            "another run's" if isinstance(author, tuple) else "not known to be this run's")
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
            if is_missing(error):
                return False
            raise
        return True
