"""Who a checkpoint namespace belongs to, read and claimed in the store: the controller's side of the owner
and consent rules (`activities.checkpoint_layout.owner_problem`, `resume_problem`).

A namespace belongs to one run (`owner.json`, claimed by its first restore): only that run, its workflow id and
its chain, restores from it and prunes it, and a restore refuses a namespace another run owns. A new run under a
closed run's id is another chain: refused too, unless it resumes that run (`checkpoint.resume_from` its own id)
and the owner consents; it then owns the namespace and never prunes the earlier run's checkpoints. A run may
restore another run's checkpoints only where it names that run (`checkpoint.resume_from`) and that run's
`checkpoint.allow_resume` names it, and never prunes them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from botocore.exceptions import ClientError
from temporalio.exceptions import ApplicationError

from activities.checkpoint_layout import manifest_key, owner_key, owner_problem, resume_problem
from activities.models import FindCheckpointInput, NamespaceOwner
from activities.store_reads import error_code, stored_manifest, list_steps, read_object
from trainguard.error_types import ErrorType

log = logging.getLogger("activities.checkpoints")
"""The checkpoint logs keep the name they always had, whichever part of them logs."""


def claim_namespace(client: Any, request: FindCheckpointInput, workflow_id: str) -> None:
    """Make sure the namespace is this run's (its workflow id and chain): claim it when nobody has
    (conditionally, so of two runs claiming at once one wins); take it over from an earlier run under the
    same id when this run resumes it and the owner consents, or add this run's chain to a record from
    before chains; else refuse it, non-retryably."""
    bucket, run_prefix, chain_id = request.bucket, request.run_prefix, request.chain_id
    key = owner_key(run_prefix)
    record = read_owner(client, bucket, key)
    owner = record
    if record is None or (chain_id and not record.chain_id):
        # A namespace from before owners (or before chains): the run whose manifest is newest in it owns it.
        author = newest_author(client, bucket, run_prefix)
        if record is None:
            owner = NamespaceOwner(workflow_id=author[0], chain_id=author[1]) if author else None
        elif author is not None and author[0] == record.workflow_id:
            owner = record.model_copy(update={"chain_id": author[1]})
    mine = NamespaceOwner(workflow_id=workflow_id, chain_id=chain_id, claimed_at=time.time(),
                          allow_resume=request.allow_resume)
    problem = owner_problem(owner or mine, workflow_id, run_prefix, chain_id,
                            resuming=request.resume_from == workflow_id)
    if problem is None and record is None:
        owner = _create_owner(client, bucket, key, mine)
        problem = owner_problem(owner, workflow_id, run_prefix, chain_id,
                                resuming=request.resume_from == workflow_id)
    elif problem is None and chain_id and record is not None and record.chain_id != chain_id:
        # Taken over (or a record from before chains): one execution runs under a workflow id at a time, so
        # no other run writes this record meanwhile, and no conditional write is needed.
        log.info("run %s (chain %s) takes over the checkpoint namespace %s/ from chain %r", workflow_id,
                 chain_id, run_prefix, (owner or record).chain_id)
        client.put_object(Bucket=bucket, Key=key, Body=mine.model_dump_json().encode(),
                          ContentType="application/json")
    if problem:
        shown = owner or mine
        log.warning("run %s (chain %s) refused the checkpoint namespace %s/: owned by run %s (chain %s)",
                    workflow_id, chain_id, run_prefix, shown.workflow_id, shown.chain_id)
        raise ApplicationError(problem, type=ErrorType.BAD_SPEC, non_retryable=True)


def _create_owner(client: Any, bucket: str, key: str, mine: NamespaceOwner) -> NamespaceOwner:
    """Write the owner record where there is none; the record that won when another run wrote one first."""
    try:
        client.put_object(Bucket=bucket, Key=key, Body=mine.model_dump_json().encode(),
                          ContentType="application/json", IfNoneMatch="*")
    except ClientError as error:
        if error_code(error) == "ConditionalRequestConflict":
            raise ApplicationError(f"{key}: concurrent claim of the namespace, retrying",
                                   type=ErrorType.MANIFEST_WRITE_CONFLICT) from None
        if error_code(error) not in ("PreconditionFailed", "412"):
            raise
        return read_owner(client, bucket, key) or mine  # another run claimed it first
    return mine


def check_consent(client: Any, bucket: str, source_prefix: str, reader: str) -> None:
    """Refuse, non-retryably, to read the checkpoints under `source_prefix` for run `reader` unless their
    owner's `allow_resume` lets it. A namespace from before owners belongs to its newest manifest's run,
    which consented to nobody else; one with nothing in it has nothing to read."""
    owner = read_owner(client, bucket, owner_key(source_prefix))
    if owner is None:
        author = newest_author(client, bucket, source_prefix)
        if author is None:
            return
        owner = NamespaceOwner(workflow_id=author[0], chain_id=author[1])
    problem = resume_problem(owner, reader, source_prefix)
    if problem:
        log.warning("run %s refused the checkpoints under %s/ of run %s: not in its allow_resume %s", reader,
                    source_prefix, owner.workflow_id, owner.allow_resume)
        raise ApplicationError(problem, type=ErrorType.BAD_SPEC, non_retryable=True)


def read_owner(client: Any, bucket: str, key: str) -> NamespaceOwner | None:
    """The namespace's owner record at `key`; None when there is none. An unreadable one fails the run's restore
    non-retryably: no run may take over a namespace whose owner cannot be told."""
    body = read_object(client, bucket, key)
    if body is None:
        return None
    try:
        return NamespaceOwner.model_validate_json(body)
    except ValueError:
        raise ApplicationError(f"the namespace's owner record {key} is unreadable: an operator must look at "
                               f"it and remove it", type=ErrorType.BAD_SPEC, non_retryable=True) from None


def newest_author(client: Any, bucket: str, run_prefix: str) -> tuple[str, str] | None:
    """The workflow id and chain (empty when it names none) the newest readable manifest under `run_prefix`
    names; None when none does. Its tag is not asked for: it only ever refuses the namespace to a run, never
    opens it to one (a namespace from before the key has only untagged manifests, and is still its run's)."""
    for step in list_steps(client, bucket, run_prefix):
        author = manifest_author(client, bucket, manifest_key(run_prefix, step), None)
        if isinstance(author, tuple):
            return author
    return None


def manifest_author(client: Any, bucket: str, key: str, secret: bytes | None) -> tuple[str, str] | bool:
    """Who committed the manifest at `key`: its workflow id and chain (empty when it names none); False when
    there is none; True when there is one nobody can be sure of (unreadable, or without a valid tag under
    `secret`)."""
    try:
        stored = stored_manifest(client, bucket, key, secret)
    except ValueError:
        return True
    if stored is None:
        return False
    document = stored[0]
    author, chain = document.get("workflow_id"), document.get("chain_id", "")
    return (author, chain) if isinstance(author, str) and isinstance(chain, str) else True
