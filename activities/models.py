"""Inputs and results of every activity: one pydantic model in and one out.

New fields always get defaults, so events already in a workflow's history keep decoding.

Over 500 lines on purpose: these are the payloads in every history, kept in one file so a change to any of
them is seen next to the others it must stay compatible with.
"""

from __future__ import annotations

import zlib
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field

from activities.fingerprint_models import CorruptionVerdict, TieEvidence, TieSettlement
from activities.pace_models import PaceVerdict
from trainguard.models import SLOW_DUTY_MAX, SLOW_DUTY_MIN, CheckpointRef, InjectFaultResult, StopReason  # noqa: F401 - re-exported
from trainguard.numerics import DEFAULT_FINGERPRINT_EVERY_STEPS, DEFAULT_LOSS_SPIKE_RATIO
from trainguard.protocol import DEFAULT_CHECKPOINT_EVERY_STEPS
from trainguard.spec import NODE_ID_PATTERN, HealthSpec

# ---------------------------------------------------------------------------------------------- nodes


class FindNodeAgentsInput(BaseModel):
    nodes: list[str]
    """Node ids whose agents must be polling their queues."""
    max_idle_s: float = 90.0
    """A poller not seen for this long does not count as an agent (idle long polls last about 70 s)."""


class FindNodeAgentsResult(BaseModel):
    missing: list[str] = Field(default_factory=list)
    """Nodes with no agent polling `trainguard-node-<id>`."""
    search_attributes: bool = False
    """Whether trainguard's custom search attributes are registered, so the workflow may upsert them."""
    no_agent_hint: str | None = None
    """With nodes missing: why they may have no agent and what to run, from the controller's own settings (a
    dev stack in Slurm mode starts none: Slurm jobs do). None when it has nothing to add."""


class GpuHealth(BaseModel):
    available: bool = False
    """False when NVML is missing (no driver, no GPU): GPU checks are skipped, never failed."""
    healthy: bool = True
    detail: str = "GPU checks unavailable"
    num_gpus: int = 0


class CheckNodeInput(BaseModel):
    workflow_id: str
    node: str


class CheckNodeResult(BaseModel):
    node: str
    host: str
    """Address other nodes reach this node's rank 0 at (MASTER_ADDR)."""
    gpu: GpuHealth = Field(default_factory=GpuHealth)


# ------------------------------------------------------------------------------------------ checkpoints


class ShardFile(BaseModel):
    """One file of a shard made of several (a DCP checkpoint's part of one rank)."""

    name: str
    """Path under the step's folder, the same on a node and in the store (`dcp/__0_0.distcp`)."""
    size_bytes: int
    sha256: str


class ShardInfo(BaseModel):
    """One rank's shard of one checkpoint."""

    rank: int
    key: str = ""
    """S3 key once uploaded (a DCP shard: the folder its files are in, `.../step-N/dcp/`)."""
    size_bytes: int
    sha256: str
    """Of the file; of a DCP shard, `trainguard.safe_load.files_digest` over its files."""
    node: str = ""
    """Node that wrote it."""
    files: list[ShardFile] | None = None
    """A DCP shard's files, each an object of its own under the step's folder; None: one `torch.save`."""
    replica_of: int | None = None
    """Replicated state (`tg.init(replicated=True)`): this rank wrote nothing and restores that rank's shard."""
    sharded: bool = False
    """A `torch.save` shard holding sharded tensors (DTensor, ShardedTensor): it loads only onto the world size
    that wrote it, rank r from shard r. Default False (plain tensors, or a DCP shard, which reshards)."""
    fingerprint: list[Any] | None = None
    """The writing rank's fingerprint of its replicated state at the checkpoint's step (`trainguard.numerics`), where
    its script called `run.fingerprint`: a checkpoint whose replicas disagree is never restored. None: none taken."""


class ManifestPage(BaseModel):
    """One page of a large manifest's shard list, an object of its own next to the manifest."""

    key: str
    first_rank: int
    num_ranks: int
    sha256: str
    """Of the page object's bytes: a reader never trusts a page that does not match."""


class Manifest(BaseModel):
    """Written last; its existence is what makes a checkpoint real.

    Up to `MANIFEST_PAGE_RANKS` shards are listed inline. A larger world's shards go to pages written before
    the manifest, so a node restoring its ranks reads one page, not the shard list of every rank: a 32,768
    rank manifest inline would be about 5 MB, read by every node at every restore."""

    format: str = "trainguard-checkpoint/1"
    workflow_id: str
    step: int
    world_size: int
    attempt: int
    shards: list[ShardInfo] = Field(default_factory=list)
    pages: list[ManifestPage] = Field(default_factory=list)
    """Where the shard list is when it is not inline (`shards` empty)."""
    total_bytes: int = 0  # sum of shard sizes, bytes
    created_at: float = 0.0  # Unix time the controller wrote the manifest
    chain_id: str = ""
    """The run (its first execution's run id) that committed it: a committer reports its own chain's commits
    however they were made. Empty in manifests written before it."""
    state_format: str = "torch"
    """`torch`: one `torch.save` per rank, rank r restores shard r mod `world_size`. `dcp`: a
    `torch.distributed.checkpoint` under `step-N/dcp/` that every node downloads whole and loads resharded
    (`dcp_to_torch_save` reads it without trainguard)."""
    reshardable: bool = True
    """False: a `torch.save` checkpoint whose shards hold sharded tensors (`ShardInfo.sharded`). It restores
    only onto the world size that wrote it, so a run never shrinks or grows onto it. Default True."""
    tag: str | None = None
    """HMAC-SHA256 (hex) of the stored manifest's canonical JSON without this field, under the controller's
    `TRAINGUARD_MANIFEST_KEY` (`activities.checkpoint_layout.manifest_tag`). A controller with a key restores
    no manifest whose tag is missing or wrong. None: written by a controller without a key."""


class NamespaceOwner(BaseModel):
    """`<run prefix>/owner.json`: the run a checkpoint namespace belongs to, written (conditionally) by the
    first restore that looks there. Only that run (workflow id and chain) restores from and prunes the
    namespace; a later run under its workflow id takes it over only by resuming it, with the owner's consent."""

    workflow_id: str
    """The owning run's workflow id: stable across its attempts and continue-as-new."""
    claimed_at: float = 0.0
    """Unix time the controller wrote the record."""
    chain_id: str = ""
    """The owning run's chain (its first execution's run id): a new start under the same workflow id is
    another chain, another run. Empty in records written before it: the first chain of the workflow id that
    claims the namespace (or the chain its newest manifest names) is recorded then."""
    allow_resume: list[str] | None = None
    """The owner's `checkpoint.allow_resume`: the workflow ids of other runs that may restore its checkpoints
    (`*`: any). None (its default, and records written before it): a later run under its own workflow id
    only."""


class NodeCheckpointRecord(BaseModel):
    """What a node agent writes to `<run prefix>/step-N/nodes/<node>.json` once every shard its ranks saved
    at step N is uploaded and verified: the committer's evidence that this node's part of the step is done.
    Node and controller both import this model; neither parses it by key."""

    node: str
    attempt: int
    """The attempt whose watch uploaded the shards: the fencing token. A step commits only from records of
    the attempts that share the live ranks' state (`CommitCheckpointsInput.min_attempt` .. `attempt`)."""
    step: int
    shards: list[ShardInfo]
    rank_compute_s: dict[int, float] = Field(default_factory=dict)
    """Each local rank's recent compute time per step, seconds: the committer judges stragglers from these."""
    node_step: int = -1
    """Lowest step across this node's ranks when it wrote the record."""
    chain_id: str = ""
    """The run's chain (its first execution's run id): a rerun under the same workflow id has attempts of the
    same numbers, and a previous run's records must never count toward its commits."""
    tag: str | None = None
    """HMAC under the pool's peer token (`activities.checkpoint_layout.object_tag`), set by an agent holding one:
    a controller holding it commits nothing from a record without a valid tag. None: unsigned."""


class FindCheckpointInput(BaseModel):
    bucket: str
    run_prefix: str
    """`<spec.checkpoint.prefix>/<spec.checkpoint.namespace or workflow-id>`."""
    world_size: int
    """Only checkpoints written by this many ranks can be restored into this run..."""
    max_world_size: int | None = None
    """...or, for a run that may shrink (`min_nodes`), by any world size from `min_world_size` to this: rank r
    restores shard r mod the checkpoint's world size, which is exact for replicated state (data parallel:
    every rank holds the whole model and optimizer)."""
    min_world_size: int | None = None
    exclude_steps: list[int] = Field(default_factory=list)
    """Steps already found corrupt at download: passed over."""
    before_step: int | None = None
    """Only checkpoints older than this step (a rollback past a silent data corruption or a numerical fault);
    None: any."""
    attempt: int | None = None
    """The launch attempt this restore is for (the report reads it); None in histories recorded before it."""
    workflow_id: str | None = None
    """The run restoring: it owns `run_prefix` (refused, non-retryable, when another run does) and restores
    only manifests it committed. None (histories before owners): the calling workflow's id."""
    resume_from: str | None = None
    """The spec's `checkpoint.resume_from`: another run's workflow id, whose manifests under `resume_prefix` this
    run may restore from while it has none of its own. Never pruned by this run. Default None."""
    resume_prefix: str | None = None
    """`<spec.checkpoint.prefix>/<resume_from>`: where that run's checkpoints are."""
    chain_id: str = ""
    """The restoring run's chain (its first execution's run id): a namespace another chain owns is refused
    even under the same workflow id, unless this run resumes it (`resume_from` its own id) with the owner's
    consent. Empty in histories before it: the workflow id alone is compared, as before."""
    allow_resume: list[str] | None = None
    """The run's `checkpoint.allow_resume`, recorded in the owner record when it claims the namespace."""


class FindCheckpointResult(BaseModel):
    manifest: Manifest | None = None
    """The manifest's header: its shard list stays in the store (`shards` and `pages` empty), so no payload
    grows with the world size; nodes read the shards they restore themselves from `manifest_key`."""
    manifest_key: str | None = None
    manifest_sha256: str | None = None
    """The sha256 of the manifest object's bytes the controller verified (paged: of its header, whose tag binds
    the pages' sha256s): what nodes restore from must have exactly these bytes. None: from before the digest."""
    skipped: list[str] = Field(default_factory=list)
    """Why newer manifests were passed over, e.g. `step 200: shard rank 1 missing`."""


class DownloadShardsInput(BaseModel):
    workflow_id: str
    attempt: int
    node: str
    bucket: str
    shards: list[ShardInfo] = Field(default_factory=list)
    """Shards of the ranks this node will run; each is verified against its sha256 before use. Empty: read
    them from `manifest_key` for `ranks`."""
    manifest_key: str | None = None
    manifest_sha256: str | None = None
    """The sha256 the controller found `manifest_key`'s bytes to have (`FindCheckpointResult.manifest_sha256`):
    a manifest read with other bytes is refused. None: not checked (an input from before the digest)."""
    ranks: list[int] = Field(default_factory=list)
    """The global ranks this node will run: rank r restores shard r mod the checkpoint's world size."""
    local_tier: bool = True
    """Use the node's own verified copy when it has one; False: always the store."""


class DownloadShardsResult(BaseModel):
    restore_dir: str
    num_bytes: int = 0
    seconds: float = 0.0
    tiers: dict[int, str] = Field(default_factory=dict)
    """Where each rank's shard came from: `local` (the node's own verified copy), `peer` (the verified copy
    on the node that wrote it) or `s3`."""


class UploadShardsInput(BaseModel):
    workflow_id: str
    attempt: int
    node: str
    bucket: str
    run_prefix: str
    step: int
    committed_step: int = -1
    """The run's newest committed step: local copies older than it are dropped (the local tier keeps the
    newest committed one; newer steps may still be waiting for their own upload)."""


class UploadShardsResult(BaseModel):
    shards: list[ShardInfo]
    num_bytes: int = 0
    seconds: float = 0.0


class CommitCheckpointInput(BaseModel):
    bucket: str
    run_prefix: str
    workflow_id: str
    attempt: int
    step: int
    world_size: int
    shards: list[ShardInfo]
    chain_id: str = ""
    """The committing run's chain, written into the manifest. Default empty (a tool's commit)."""
    keep_last: int | None = None
    """The run's retention: a shard of this step can only have been pruned once `keep_last` newer steps are
    committed. With fewer, a missing shard is a store that has not shown it yet, and the commit retries."""


class CommitCheckpointsInput(BaseModel):
    """The committer: watch the store for steps whose every shard the node agents have uploaded, and commit
    them (manifest last), then apply retention. Returns once it committed something, or after
    `max_duration_s`."""

    bucket: str
    run_prefix: str
    workflow_id: str
    attempt: int
    chain_id: str = ""
    """Only records of this chain count (and records written before chains were recorded)."""
    min_attempt: int
    """Records of attempts `min_attempt`..`attempt` count: after an in-process restart the live ranks' state
    (and their shards) carries over from earlier attempts; after a relaunch, only the new attempt's."""
    world_size: int
    num_nodes: int
    after_step: int = -1
    """The newest committed step: only newer steps are committed."""
    keep_last: int = 3
    straggler_ratio: float = 1.5
    max_duration_s: float = 600.0
    poll_interval_s: float = 0.5
    quiet_s: float | None = None
    """Drain mode: return after this long with no new upload (`wait_for_store`: nor store error), or when done."""
    wait_for_store: bool = False
    pace_window_s: float | None = None
    """Also compare the nodes' `PaceRecord`s ten times a window and return a slow one (None: not)."""
    pace_after: float = 0.0
    """...only of windows ending after this unix time (the run has judged those before)."""
    compare_fingerprints: bool = True
    """Compare the nodes' fingerprint records of attempts `min_attempt`..`attempt` (`activities.fingerprints`), and
    return when replicas differ."""
    settle: TieEvidence | None = None
    """Two replicas that differed with no majority in an earlier attempt: compare this one (their replay) with
    what they held, and return once it tells them apart or cannot (`activities.fingerprints.settle`)."""


class CommittedCheckpoint(BaseModel):
    ref: CheckpointRef
    step: int = -1
    """Lowest step any node had reached when it reported the checkpoint."""


class CommitCheckpointsResult(BaseModel):
    commits: list[CommittedCheckpoint] = Field(default_factory=list)
    """Oldest first; empty when `max_duration_s` passed with nothing to commit."""
    store_error: str | None = None
    """The last error the committer met reading or writing the store in this call (it goes on polling through
    them); None when its last pass reached the store."""
    pace: PaceVerdict | None = None
    """Ranks slow over a window of training (`activities.pace`), when the committer returned for them."""
    corruption: CorruptionVerdict | None = None
    """Replicas whose fingerprints differ (`activities.fingerprints`), when the committer returned for them."""
    settled: TieSettlement | None = None
    """The replay's answer to `CommitCheckpointsInput.settle`, when the committer returned for it."""


class PruneCheckpointsInput(BaseModel):
    bucket: str
    run_prefix: str
    keep_last: int
    workflow_id: str | None = None
    """Only manifests this run committed count and go; another run's (or one without a valid tag, with a
    manifest key) are left alone. None: every manifest (a tool pruning a namespace it owns whole)."""
    chain_id: str = ""
    """...and only those of this chain: an earlier run under the same workflow id keeps its checkpoints (a
    manifest without a chain is not known to be this run's either). Empty (histories before chains): any
    chain of `workflow_id`."""
    protect_steps: list[int] = Field(default_factory=list)
    """Steps never deleted (the newest committed, the one being restored)."""


class PruneCheckpointsResult(BaseModel):
    deleted_steps: list[int] = Field(default_factory=list)


# ----------------------------------------------------------------------------------------------- ranks


class RankGroupInput(BaseModel):
    """One node's part of an attempt's process group: what launch and in-process rejoin start ranks with."""

    workflow_id: str
    attempt: int
    """Fencing token: a launch of an older attempt than the node has seen is refused."""
    chain_id: str = ""
    """The run's first execution run id: stable across continue-as-new, new when a closed workflow id is run
    again, so a rerun's attempt 1 is never mistaken for the previous run's attempt 1."""
    node: str
    node_rank: int
    """Index of this node in the attempt (GROUP_RANK)."""
    num_nodes: int
    ranks_per_node: int
    master_addr: str | None = None
    """None on the master node: it picks a fresh rendezvous port and returns it."""
    master_port: int | None = None
    entrypoint: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    working_dir: str | None = None
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY_STEPS
    """The spec's `checkpoint.every_steps`, given to the ranks as `TRAINGUARD_CHECKPOINT_EVERY`."""
    fingerprint_every: int = DEFAULT_FINGERPRINT_EVERY_STEPS
    """The spec's `health.fingerprint_every_steps`, given to the ranks as `TRAINGUARD_FINGERPRINT_EVERY`."""
    loss_spike_ratio: float = DEFAULT_LOSS_SPIKE_RATIO
    """The spec's `health.loss_spike_ratio`, given to the ranks as `TRAINGUARD_LOSS_SPIKE_RATIO`."""


class LaunchRanksInput(RankGroupInput):
    restore_dir: str | None = None
    restore_step: int = 0
    rejoin_timeout_s: float | None = None
    """With in-process restarts on: how long a rank whose peers failed waits to rejoin. None: it exits."""


class RejoinRanksInput(RankGroupInput):
    """In-process restart on one node: the ranks still alive there stay, the dead ones are started again as
    joiners, and all of them form attempt `attempt`'s new process group (the fencing token from now on)."""

    from_attempt: int
    """The attempt whose live ranks carry over; the node must still run it (else: NoSuchAttempt)."""
    rejoin_timeout_s: float = 60.0


class RejoinRanksResult(BaseModel):
    node: str
    master_addr: str
    master_port: int
    survivors: list[int] = Field(default_factory=list)
    """Ranks that stayed alive and rejoin with the state they hold."""
    joiners: list[int] = Field(default_factory=list)
    """Ranks started again: they take their state from a survivor."""
    step: int | None = None
    """The survivors' last reported step (None without survivors)."""


class LaunchRanksResult(BaseModel):
    node: str
    master_addr: str
    master_port: int
    pids: list[int]
    adopted: bool = False
    """True when the ranks were already running (a retried launch) and were adopted, not started again."""


class StopRanksInput(BaseModel):
    workflow_id: str
    node: str
    attempt: int | None = None
    """Stop ranks of attempts up to and including this one; None stops every attempt of the run."""
    grace_s: float = 2.0
    """SIGTERM first, SIGKILL to the whole process group after this long."""
    reason: StopReason | None = None
    """Why the run stops them (the report reads it); None in histories recorded before it."""


class StopRanksResult(BaseModel):
    stopped: int = 0


class WatchEventKind(str, Enum):
    RANK_EXITED = "rank_exited"
    HANG = "hang"
    CHECKPOINT_READY = "checkpoint_ready"
    FINISHED = "finished"
    GPU_UNHEALTHY = "gpu_unhealthy"
    KEEPALIVE = "keepalive"
    """Nothing happened within the watch's lifetime; the workflow starts a new watch."""
    STARTED = "started"
    """The attempt's first step on this node (returned once, when the watch was asked to report it)."""
    NUMERICAL_FAULT = "numerical_fault"
    """A rank's reported loss was NaN, infinite or far outside its recent window (`trainguard.numerics`)."""


class WatchCheckpoints(BaseModel):
    """Where a watch uploads its node's checkpoints itself (fenced by its attempt), so no per-step, per-node
    event passes through the workflow's history."""

    bucket: str
    run_prefix: str


class AttemptLaunch(BaseModel):
    """How an attempt's ranks reach the nodes that launch them from a watch, defined once: the run gives it to
    each watch group (`NodeGroupWatchInput`) and, relaunching in place, writes it to the store
    (`AttemptDecision`); the master node's own launch activity takes `launch` with its fields filled in."""

    launch: LaunchRanksInput | None = None
    """The attempt's launch, `node` and `node_rank` left for each node to fill in (a node taking up a decision
    keeps its node rank). None: the ranks run already (a watch after continue-as-new)."""
    download: DownloadShardsInput | None = None
    """With `launch`: what each node downloads first (its `node` and `ranks` filled in); None: a start from scratch."""
    starters: list[str] | None = None
    """The nodes whose first step of the attempt is reported (the run's master node: every rank steps in
    lockstep with it, and a report per node would cost a 4,096-node relaunch 8,192 more events); None: all."""
    launched: list[str] = Field(default_factory=list)
    """Nodes launched by an activity of their own (the master node, which picks the rendezvous)."""


class AttemptDecision(AttemptLaunch):
    """The run's decision to relaunch, written to the store (`{run_prefix}/attempt.json`) for the nodes whose
    watch is still running: each takes it up there (stops its ranks of the attempt before, downloads its shards,
    launches the new attempt at its node rank) and goes on watching, with no new activity per node. A relaunch
    of thousands of nodes then costs Temporal a few events, not a launching watch per node."""

    workflow_id: str
    chain_id: str
    attempt: int
    leaving: list[str] = Field(default_factory=list)
    """Nodes no longer in the run (replaced or cordoned): they take up nothing."""
    tag: str | None = None
    """HMAC under the pool's peer token (`activities.checkpoint_layout.object_tag`), set by a controller holding
    one: an agent holding it takes up no decision without a valid tag. None: unsigned."""


class PublishAttemptInput(BaseModel):
    bucket: str
    run_prefix: str
    decision: AttemptDecision


class WatchRanksInput(BaseModel):
    workflow_id: str
    attempt: int
    node: str
    health: HealthSpec = Field(default_factory=HealthSpec)
    reported_step: int = -1
    """Newest checkpoint step already reported by an earlier watch; only newer ones are reported."""
    max_duration_s: float = 600.0
    """Return KEEPALIVE after this long so no single activity runs forever."""
    checkpoints: WatchCheckpoints | None = None
    """Upload complete local steps and write their `NodeCheckpointRecord` instead of returning CHECKPOINT_READY."""
    report_start: bool = False
    """Return STARTED once the attempt's first step is seen here."""
    launch: LaunchRanksInput | None = None
    """Launch this node's ranks of `attempt` first, unless the node already runs it (or a newer one): a
    relaunch then launches each node from its watch, with no launch (and download) activity of its own."""
    download: DownloadShardsInput | None = None
    """With `launch`: download the shards its ranks restore from first, and launch them from there."""
    download_timeout_s: float = 7200.0
    """How long the watch retries a download the store fails (an outage), before it fails as the node's."""
    evidence: bool = False
    """The run names a hang's culprit from every rank's evidence (`collect_evidence`): no rank's report is
    held back to let the stopped one go first (`COLLECTIVE_WAIT_GRACE_S`), so a hang is seen that much sooner.
    False (histories before the evidence patch): the grace applies."""
    evidence_with_event: bool = False
    """On judging a hang, ask this node's ranks for their evidence right there and return it with the HANG
    event (`WatchEvent.evidence`), so the run need not ask this node again (`collect_evidence`)."""
    follow_decisions: bool = False
    """Read the run's `AttemptDecision` from the store (`checkpoints`' bucket and prefix) every
    `decision_every_s` and take up a newer attempt in place, and follow a newer attempt launched here by another
    activity, instead of failing or returning: the watch then watches that attempt (its events say which)."""
    decision_every_s: float = 1.0
    after_attempt: int | None = None
    """With `follow_decisions`: the run has this node's report of this attempt (its ranks failed or hung): report
    nothing of it or an older one, and take up the next in place when it is published (a node leaving the run
    returns KEEPALIVE then). A large run's every reporting node thus waits in a watch, and a fault every node
    reports (a hang every watch judges) still relaunches with no activity per node after the decision."""
    learned_gaps: dict[int, float] = Field(default_factory=dict)
    """Gaps between steps the run learned its healthy ranks take (`WatchEvent.gaps`): expected next time."""
    heartbeat_every_s: float | None = None
    """Heartbeat at most this often (a large run bounds its heartbeats per second: `HEARTBEATS_PER_S` in
    `workflows/node_group.py`); None: at every poll, as the agent's worker throttles them."""

    def first_heartbeat_s(self) -> float:
        """Seconds from the watch's start to its first heartbeat. None of a large run's watches heartbeats at
        once (its start set Temporal's heartbeat clock already), and each waits its own share of the interval,
        from its node's name: a launch's thousands of watches start within seconds, and heartbeating together
        they came to the server in bursts of a thousand, each a write, which a small Temporal answered 5-16 s
        late, so a live node's three intervals passed without one recorded (a 4,096-node run paused for want
        of spares). Between half and the whole interval: the timeout is three."""
        if self.heartbeat_every_s is None:
            return 0.0
        share = zlib.crc32(self.node.encode()) % 1000 / 1000
        return round(self.heartbeat_every_s * (0.5 + share / 2), 3)


GAPS_KEPT = 16
"""Learned gaps kept per run (the newest steps'): what a watch input, an event and the run's state carry."""


def merge_gaps(known: dict[int, float], more: dict[int, float], keep: int = GAPS_KEPT) -> dict[int, float]:
    """Learned gaps (step it followed -> seconds) joined: the longest per step, the newest `keep` steps."""
    merged = dict(known)
    for step, gap in more.items():
        merged[int(step)] = max(float(gap), merged.get(int(step), 0.0))
    return {step: merged[step] for step in sorted(merged)[-keep:]}



class WatchEvent(BaseModel):
    kind: WatchEventKind
    node: str
    attempt: int | None = None
    """The attempt the event is of, where a watch follows decisions (it may have taken up a newer attempt than
    it was started for); None: the watch's own."""
    rank: int | None = None
    exit_code: int | None = None
    detail: str = ""
    detected_at: float = 0.0
    """Unix time the agent saw the event."""
    fault_at: float | None = None
    """Unix time of the fault: injected by chaos when known, else the rank's last progress."""
    occurred_at: float | None = None
    """Unix time the failure itself happened, when the node knows it: an injected fault, or the rank's exit.
    Of several failures reported together, the earliest is the cause (its peers failed in a collective)."""
    checkpoint_steps: list[int] = Field(default_factory=list)
    """Complete local checkpoints (every local rank saved) not yet reported, oldest first."""
    first_step_at: float | None = None
    """Unix time the attempt's first training step was seen on this node."""
    step: int = -1
    """Lowest step across this node's ranks."""
    state_digest: str | None = None
    mean_step_s: float | None = None
    rank_compute_s: dict[int, float] = Field(default_factory=dict)
    """Each local rank's recent compute time per step (what it reports outside collectives), seconds."""
    restore_tiers: list[str] = Field(default_factory=list)
    """Where this node's ranks of the attempt restored from, when its watch downloaded their shards: the run
    learns the tiers of nodes that launched from their watch from their events."""
    upload_error: str | None = None
    """KEEPALIVE: the node's uploads to the store are failing; the last error. Reported at most every
    `UPLOAD_ERROR_REPORT_S` per node, so an outage costs the run's history little."""
    log_path: str | None = None
    """RANK_EXITED, HANG: the rank's log on its node (stdout and stderr of the attempt)."""
    log_tail: str = ""
    """RANK_EXITED, HANG: the last lines of that log (`activities.rank_logs.read_tail`), its traceback."""
    failure_signature: str | None = None
    """RANK_EXITED: the exception in the tail and the frame that raised it, addresses and ports masked
    (`activities.rank_logs.failure_signature`); None when the tail shows no Python exception."""
    evidence: list[RankEvidence] = Field(default_factory=list)
    """HANG, with `WatchRanksInput.evidence_with_event`: every local rank's evidence, taken when the hang was
    judged and before anything was stopped (what `collect_evidence` would have answered)."""
    standby: bool = False
    """STARTED: the node's ranks of the attempt called `standby()` (the script parks); False in older histories."""
    gaps: dict[int, float] = Field(default_factory=dict)
    """Gaps between steps this node's healthy ranks took: step -> seconds (`activities.rank_activity.GapBook`)."""
    phase_s: dict[str, float] = Field(default_factory=dict)
    """FINISHED: seconds the node's ranks spent in each phase their script named (the longest rank's)."""
    fault_step: int | None = None
    """NUMERICAL_FAULT: the step whose loss was the fault (the run rolls back to a checkpoint before it)."""


class InjectFaultInput(BaseModel):
    workflow_id: str
    node: str
    rank: int | None = None
    """Global rank; None picks the node's first rank."""
    fault: str
    """`crash` (SIGKILL a rank), `hang` (SIGSTOP a rank), `slow` (stop/continue a rank with a duty cycle),
    `gpu` (the node's GPU check reports an XID error), `node-down` (the agent kills its ranks and itself),
    `corrupt` (a byte of the node's shard of the newest committed checkpoint flips, in S3 and on local disk)."""
    slow_duty: float = 0.5
    """For `slow`: the fraction of time the rank is stopped (`SLOW_DUTY_MIN`..`SLOW_DUTY_MAX`); refused outside."""
    recurring: bool = False
    """For `bitflip`: flip again in every attempt the node runs (`NodeHealth.flips_bits`); refused for others."""
    bucket: str | None = None
    """For `corrupt`: the run's checkpoint bucket (filled in by the workflow)."""
    manifest_key: str | None = None
    """For `corrupt`: the newest committed checkpoint's manifest (filled in by the workflow)."""


class RequestCheckpointInput(BaseModel):
    workflow_id: str
    attempt: int
    node: str
    step: int | None = None
    """Ask the ranks to save at this step; None only reports where the ranks are."""


class RequestCheckpointResult(BaseModel):
    node: str
    step: int = -1
    """Newest step any local rank reported."""
    step_time_s: float | None = None
    """Slowest local rank's recent step time."""


class RankEvidence(BaseModel):
    """What a rank showed when its node was asked, before anything was stopped (see `trainguard.evidence`)."""

    node: str
    rank: int
    state: str = ""
    """Its process state from /proc (`S` sleeping, `R` running, `T` stopped, `D` uninterruptible I/O, `Z`
    defunct), `exited` once it is gone."""
    answered: bool = False
    """Its helper answered the position request (a stopped rank, or one holding the GIL in C, cannot)."""
    step: int | None = None
    """Steps it had reported done."""
    collectives_enqueued: int | None = None
    """Collectives it has entered (torch's Flight Recorder), None when not known."""
    collectives_completed: int | None = None
    in_collective: bool | None = None
    """Inside a collective now (entered, not completed); None when not known."""
    collective: str = ""
    """The newest collective it entered, e.g. `gloo:all_reduce`."""
    innermost: str = ""
    """Its main thread's innermost frames, one line (`file:line in function < ...`)."""
    stacks_key: str | None = None
    """Where its full stacks (every thread) are in the store, when they were taken."""


class CollectEvidenceInput(BaseModel):
    workflow_id: str
    attempt: int
    node: str
    bucket: str | None = None
    """Where the full stacks go (`<run_prefix>/incidents/<attempt>/rank-<r>.txt`); None keeps them local."""
    run_prefix: str = ""


class CollectEvidenceResult(BaseModel):
    node: str
    ranks: list[RankEvidence] = Field(default_factory=list)


# ------------------------------------------------------------------------------------------ scheduler

HOOK_OFF = "scheduler hook off"


class SchedulerAction(str, Enum):
    CORDON = "cordon"
    UNCORDON = "uncordon"


class NotifySchedulerInput(BaseModel):
    node: str = Field(pattern=NODE_ID_PATTERN)
    """trainguard node id; the hook passes it to the scheduler as its node name, so the two must agree."""
    action: SchedulerAction
    """`cordon` (Slurm: drain; Kubernetes: cordon + taint) or `uncordon` (resume; uncordon + untaint)."""
    reason: str = ""
    """Why, for the scheduler's records (Slurm's drain reason, the taint's value). Ignored by uncordon."""
    run_id: str | None = None
    """Workflow id of the run that asked, for the logs. Default None (an operator or the pool)."""


class NotifySchedulerResult(BaseModel):
    scheduler: str = "none"
    """Which scheduler was told: none, slurm or kubernetes."""
    commands: list[list[str]] = Field(default_factory=list)
    """Every command run, as argv; empty when the hook is off."""
    detail: str = HOOK_OFF
    """One line for the UI: what was done, or `scheduler hook off`."""
