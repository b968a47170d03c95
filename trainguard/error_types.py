"""Every `ApplicationError` type trainguard raises, and what the retry policies may not retry.

An error's type is the string Temporal carries in the failure and matches against a retry policy's
`non_retryable_error_types`: a type misspelled on either side would silently be retried. So activities and
workflows raise `ErrorType` members (a `StrEnum`: the member is the string, the JSON of a failure is
unchanged), and the policies' lists come from `non_retryable(...)`, which takes members only.

Standard library only: workflows import it.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorType(StrEnum):
    # --- the user's input: never fixed by a retry
    INVALID_SPEC = "InvalidSpec"
    """The run's spec does not validate (the workflow fails at once, naming the field)."""
    BAD_SPEC = "BadSpec"
    """A node found the spec unusable (no such working dir, entrypoint, bucket, or an env it refuses)."""
    ENTRYPOINT_NOT_ALLOWED = "EntrypointNotAllowed"
    """The node's operator does not allow the spec's program (`--allow`)."""
    BAD_FAULT = "BadFault"
    """A chaos request that names no fault the agent knows, or a value out of range."""
    CHAOS_DISABLED = "ChaosDisabled"
    """The node's agent refuses fault injection (`--no-chaos`)."""
    NOT_THIS_JOBS_RUN = "NotThisJobsRun"
    """The node's agent belongs to another Slurm job than the run (`workers.job_fence`): a run that outlived its
    job does not take over the next job's nodes."""
    # --- the run moved on: the call no longer applies
    NO_SUCH_ATTEMPT = "NoSuchAttempt"
    STALE_ATTEMPT = "StaleAttempt"
    NO_SUCH_RANK = "NoSuchRank"
    NO_SUCH_LOG = "NoSuchLog"
    CHECKPOINT_SUPERSEDED = "CheckpointSuperseded"
    # --- checkpoint data that no retry repairs
    CORRUPT_CHECKPOINT = "CorruptCheckpoint"
    CORRUPT_LOCAL_SHARD = "CorruptLocalShard"
    INCOMPLETE_CHECKPOINT = "IncompleteCheckpoint"
    NO_SUCH_CHECKPOINT = "NoSuchCheckpoint"
    NO_SHARDS = "NoShards"
    NO_LOCAL_SHARDS = "NoLocalShards"
    CONFLICTING_COMMIT = "ConflictingCommit"
    # --- the world: retried within the policy's bound
    SHARD_NOT_VERIFIED = "ShardNotVerified"
    MANIFEST_WRITE_CONFLICT = "ManifestWriteConflict"
    NODE_UNAVAILABLE = "NodeUnavailable"
    AGENT_SHUTDOWN = "AgentShutdown"
    """A node agent shutting down gracefully (an upgrade, a restart) ended its watch: not a lost node."""
    NODE_CHECK_FAILED = "NodeCheckFailed"
    SCHEDULER_COMMAND_FAILED = "SchedulerCommandFailed"
    SCHEDULER_CONFIG_ERROR = "SchedulerConfigError"
    """The scheduler hook is misconfigured (unknown scheduler, missing executable): retries cannot help."""
    # --- how a run ends
    ABORTED = "Aborted"
    RUN_STOPPED = "RunStopped"
    NO_HEALTHY_NODES = "NoHealthyNodes"
    NODES_CORDONED = "NodesCordoned"
    NODES_UNAVAILABLE = "NodesUnavailable"
    # --- the node pool
    REGISTRATION_REFUSED = "RegistrationRefused"
    """An agent's registration whose proof the controller refused (not the pool's peer token, or signed too
    long ago): the agent backs off and says why."""


SPEC_FAULTS = frozenset({ErrorType.BAD_SPEC, ErrorType.STALE_ATTEMPT, ErrorType.ENTRYPOINT_NOT_ALLOWED})
"""Launch failures held against the spec (or its operator), never against the node: the run fails with
`InvalidSpec`, no node is cordoned and no spare spent. One set for the agent's launch, its watch and the run."""


def non_retryable(*types: ErrorType) -> list[str]:
    """A retry policy's `non_retryable_error_types`, from members only (a typo is an AttributeError at import,
    not an error retried until the policy gives up)."""
    for item in types:
        if not isinstance(item, ErrorType):
            raise TypeError(f"non_retryable takes ErrorType members, not {item!r}")
    return [str(item) for item in types]
