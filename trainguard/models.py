"""Payloads users see: the run's result, its incidents and its live status.

Every field has a default so histories written by older versions still decode.
"""

from __future__ import annotations

import base64
import json
import re
import zlib

from enum import Enum

from typing import Any

from pydantic import BaseModel, Field, computed_field, model_validator


class IncidentKind(str, Enum):
    CRASH = "crash"
    HANG = "hang"
    NODE_UNRESPONSIVE = "node_unresponsive"
    STRAGGLER = "straggler"
    GPU_UNHEALTHY = "gpu_unhealthy"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"
    STORAGE_UNAVAILABLE = "storage_unavailable"
    USER_ERROR = "user_error"
    AGENT_RESTART = "agent_restart"
    """A node agent shut down gracefully (an upgrade, a restart): its ranks stop with it, the run waits for it
    to come back and relaunches on the same nodes. Costs no node, no spare and no restart budget."""
    GROW_BACK = "grow_back"
    """Not a fault: a run that shrank relaunches, at a committed checkpoint, with the nodes that came back. An
    incident so its cost (time to the first step on the larger world) is in the result and the report. Costs no
    restart budget."""
    SILENT_DATA_CORRUPTION = "silent_data_corruption"
    """Replicas that must hold bit-identical state do not (their fingerprints differ): the one a majority
    outvotes computed wrong. Rolled back to a checkpoint before it, its node cordoned and replaced."""
    NUMERICAL_FAULT = "numerical_fault"
    """The loss a rank reported was NaN, infinite or far outside its recent window. Rolled back to a checkpoint
    before it; one that comes back at the same step stops the run (the data or the hyper-parameters)."""


class Action(str, Enum):
    RESTART = "restart"
    """Stop every rank and relaunch all of them from the newest committed checkpoint."""
    REPLACE_NODE = "replace_node"
    """Cordon the bad node, take a spare in its place, relaunch."""
    SHRINK = "shrink"
    """Cordon the bad node and relaunch on fewer nodes (no spare left, `min_nodes` allows it)."""
    REPORT = "report"
    """Record the incident and keep training."""
    PAUSE = "pause"
    """Stop the ranks and wait for an operator's `resume` (after fixing or adding nodes) or `abort`."""
    STOP = "stop"
    """End the run with the incident's reason (budget spent, or a user error)."""


class Phase(str, Enum):
    VALIDATING = "validating"
    RESERVING = "reserving"
    RESTORING = "restoring"
    LAUNCHING = "launching"
    RUNNING = "running"
    RECOVERING = "recovering"
    PAUSED = "paused"
    FINISHING = "finishing"
    COMPLETED = "completed"
    FAILED = "failed"



class StopReason(str, Enum):
    """Why a run stops ranks (`StopRanksInput.reason`): what `trainguard run report` counts the stop as. The
    stop's summary says the same for people."""

    INCIDENT = "incident"
    """An incident's recovery (a restart, a replaced or dropped node, or the run's end on a stop policy)."""
    INCIDENT_PAUSE = "incident_pause"
    """An incident whose policy pauses the run: recovery while the ranks stop, paused once they have."""
    OPERATOR_PAUSE = "operator_pause"
    """An operator's `pause`: paused from the stop on."""
    RUN_ENDED = "run_ended"
    """The run is over (completed, failed or aborted): every rank of it, everywhere, is stopped."""
    DRAIN = "drain"
    """Nodes an operator drains leave the run."""
    GROW = "grow"
    """A shrunk run grows back onto nodes that returned: it relaunches on them."""
    IN_PROCESS_FAILED = "in_process_failed"
    """An in-process restart failed: every rank stops for a relaunch."""
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"
    """The checkpoint restored from is corrupt: the ranks stop to restore an older one."""

INCIDENT_TAILS_KEPT = 10
"""Incidents that keep their `log_tail`: the newest ones, which an operator reads first."""

CAUSE_MAX_CHARS = 160
"""An error in an incident's detail or a cordon reason, at most: its first line's first sentence, cut to this
(a gloo error is ~600 characters on one line); the whole error stays in the incident's `log_tail`."""

TRAINGUARD_SAYS = "trainguard:"
"""How the rank helper's own errors begin."""

_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp|c|py):\d+\]\s*")
"""A C++ source location a torch or gloo error starts with (`[/pytorch/third_party/gloo/.../pair.cc:534] `)."""


def short_cause(error: str, max_chars: int = CAUSE_MAX_CHARS) -> str:
    """An error's cause in one short line, for people: its first non-empty line, source locations dropped,
    its first sentence, cut to `max_chars` (an ellipsis says where). trainguard's own errors (`trainguard:
    ...`, a rank helper's stop) are written to be read and say what to change: only their first line is kept."""
    line = next((part.strip() for part in error.splitlines() if part.strip()), "")
    if line.startswith(TRAINGUARD_SAYS):
        return line
    line = _SOURCE_LOCATION.sub("", line)
    line = re.split(r"(?<=[.!?])\s+(?=[A-Z(\[])", line, maxsplit=1)[0]
    return line if len(line) <= max_chars else line[:max_chars - 1].rstrip() + "…"


class Incident(BaseModel):
    """One failure and what was done about it."""

    kind: IncidentKind
    """What happened."""
    node: str | None = None
    """Node it happened on, when known."""
    group: int | None = None
    """The replica group it happened in (`replica_groups`); None in a run without groups."""
    rank: int | None = None
    """Global rank it happened to, when known."""
    attempt: int = 0
    """Launch attempt (1-based) the fault hit."""
    cause: str = ""
    """What was seen, as the node or the run found it, e.g. `exit code -9 (SIGKILL)`."""
    decision: str = ""
    """Why the policy decided `action`, e.g. `restart from step 40 (1 of 3 restarts used)`; empty until it did."""
    notes: list[str] = Field(default_factory=list)
    """What happened to the incident since, in order: a spare joined in the node's place, its agent came back."""
    detection_s: float | None = None
    """Seconds from the fault (when injected or known) or from the rank's last progress, to detection."""
    recovery_s: float | None = None
    """Seconds from detection to the first training step of the next attempt. None until it happens."""
    action: Action = Action.RESTART
    """What the policy decided."""
    resumed_step: int | None = None
    """Step the next attempt resumed from (0 when no checkpoint was committed yet)."""
    restore_tier: str | None = None
    """Where the next attempt's shards came from: `local` (each node's own verified copy), `peer` (the
    verified copy on the node that wrote the shard), `s3`, or a mix (`local+peer`); `peers` after an in-process
    restart (restarted ranks took a live peer's state); None when it started from scratch."""
    detected_at: float = 0.0
    """Unix time of detection, on the detecting node agent's clock."""
    evidence: str = ""
    """For a hang: why `rank` is the culprit, one or two lines: its innermost frames, and where its peers
    wait. Its full stacks and every rank's are stored with the run (`<prefix>/<run>/incidents/<attempt>/`),
    and `trainguard run report` prints them."""
    evidence_key: str | None = None
    """For a hang: `s3://bucket/<prefix>/<run>/incidents/<attempt>/`, where every rank's full stacks are."""
    attribution_s: float | None = None
    """For a hang: seconds from detection until the culprit was named from every rank's evidence."""
    recovery_path: str | None = None
    """How training came back: `relaunch` (every rank started again from a checkpoint), `in-process`
    (live ranks kept their state and formed a new process group with restarted ranks), or `relaunch after
    failed in-process: <why>`. None until the next attempt starts."""
    log_path: str | None = None
    """A rank incident's log on its node: the rank's stdout and stderr for that attempt
    (`$TRAINGUARD_HOME/nodes/<node>/runs/<run>/attempt-NNNN/logs/rank-NNNNN.log`)."""
    log_tail: str = ""
    """The last lines of that log when the incident was seen (its traceback). Kept on the newest
    `INCIDENT_TAILS_KEPT` incidents only, so a long run's status stays small."""
    signature: str | None = None
    """What identifies a crash across attempts: the exception and the frame that raised it. The same one on
    consecutive attempts is a script that fails the same way each time (`restarts.max_same_failure`)."""
    bad_step: int | None = None
    """`silent_data_corruption`, `numerical_fault`: the first step whose state may be wrong; the next attempt
    restores a checkpoint older than it. None for other kinds."""

    @model_validator(mode="before")
    @classmethod
    def _detail_is_the_cause(cls, data: Any) -> Any:
        """`Incident(detail=...)`, and an incident recorded before causes were kept apart: its text is the cause."""
        if isinstance(data, dict) and "detail" in data and "cause" not in data:
            return {**{k: v for k, v in data.items() if k != "detail"}, "cause": data["detail"]}
        return data

    @computed_field  # type: ignore[prop-decorator]  # mypy does not follow pydantic's decorator on a property
    @property
    def detail(self) -> str:
        """Cause, decision and notes in one line, for display (`run status`, the Web UI, the result)."""
        return "; ".join(part for part in (self.cause, self.decision, *self.notes) if part)


class CheckpointRef(BaseModel):
    """A committed checkpoint: its manifest exists, so every shard it names was uploaded and verified."""

    step: int
    """Training step the checkpoint holds (the next step to run is `step`)."""
    manifest_key: str
    """S3 key of the manifest, e.g. `runs/<workflow-id>/step-00000100/manifest.json`."""
    bucket: str
    """S3 bucket."""
    world_size: int = 0
    """Ranks that wrote it."""
    total_bytes: int = 0
    """Sum of shard sizes, bytes."""
    reshardable: bool = True
    """False: a per-rank `torch.save` of sharded tensors (DTensor), which loads only onto `world_size` ranks:
    the run pauses rather than shrink or grow onto it. Default True (DCP, or plain tensors)."""


class RunResult(BaseModel):
    """What a finished `TrainingRun` returns."""

    workflow_id: str = ""
    """The run's workflow id."""
    steps_completed: int = 0
    """Training steps completed by the final attempt (the trainer's own step count)."""
    attempts: int = 0
    """Launch attempts used (1 when nothing failed)."""
    incidents: list[Incident] = Field(default_factory=list)
    """Every incident, in order."""
    final_checkpoint: CheckpointRef | None = None
    """Newest committed checkpoint at the end, if any."""
    final_state_digest: str | None = None
    """sha256 of the final model parameters as reported by rank 0 (bit-identical runs share it)."""
    goodput: float = 0.0
    """Useful training time (`useful_s`) / wall time, 0..1."""
    useful_s: float | None = None
    """Useful training time, seconds: each attempt's steps the final state kept x that attempt's own step time
    (the final attempt's mean as rank 0 reports it; an earlier one's from its first step to its newest commit),
    so steps a failure made redo count once, and a shrunk world's steps at its own pace. None in results of
    runs before it (their goodput: steps completed x the final attempt's mean step time)."""
    wall_s: float = 0.0
    """Wall time of the run, seconds: from the start request (a wait for a controller included) to the end,
    on the workflow clock, as `trainguard run report` counts it."""
    mean_step_s: float | None = None
    """Mean step time of the final attempt as reported by rank 0, seconds (named phases left out)."""
    phase_s: dict[str, float] = Field(default_factory=dict)
    """Seconds the final attempt spent in each phase the script named (`RankRun.phase`): useful time, counted in
    `useful_s` beside its steps; empty when the script names none."""


class RunStatus(BaseModel):
    """Answer to the `status` query."""

    phase: Phase = Phase.VALIDATING
    attempt: int = 0
    nodes: list[str] = Field(default_factory=list)
    """Nodes the current attempt runs on."""
    cordoned: list[str] = Field(default_factory=list)
    """Nodes taken out of this run."""
    spares: list[str] = Field(default_factory=list)
    """Spare nodes the run holds, to replace a failed one."""
    world_size: int = 0
    step: int = 0
    """Newest step known to the workflow (from checkpoints and events)."""
    resumed_step: int = 0
    """Step the current attempt started from."""
    incidents: list[Incident] = Field(default_factory=list)
    latest_checkpoint: CheckpointRef | None = None
    reason: str | None = None
    """Why the run failed or is paused."""
    replaced_at_start: dict[str, str] = Field(default_factory=dict)
    """Named nodes that were cordoned when the run started -> the spare that took each one's place (they are
    in `cordoned` too). Empty when none was."""
    last_commit_at: float | None = None
    """Unix time (workflow clock) the newest checkpoint committed; None before the first."""
    at_risk_since: float | None = None
    """Unix time since which training is not yet in a committed checkpoint: the newest commit, the first
    launch, or a resume; None before the first launch."""
    checkpoint_age_s: float | None = None
    """Seconds since `at_risk_since`, by the reader's clock (`TrainguardClient.status` fills it in)."""
    store_error: str | None = None
    """The last store error the committer met since the newest commit; None when it reaches the store."""
    upload_errors: dict[str, str] = Field(default_factory=dict)
    replica_groups: list[str] = Field(default_factory=list)
    """A run with `replica_groups`: the workflow id of each group's run, group 0 first (each answers `status`
    for its own nodes, attempts and incidents)."""
    lighthouse: str | None = None
    """A run with `replica_groups`: where its TorchFT lighthouse serves (every rank's `TORCHFT_LIGHTHOUSE`)."""
    """Node -> its last failed upload since the newest commit (at most `UPLOAD_ERRORS_KEPT` nodes)."""


class ChaosRequest(BaseModel):
    """Input of the run's `inject_fault` update: which fault, where. The run fills in the rest itself (its
    own workflow id; for `corrupt`, its newest checkpoint), so nothing here goes unused."""

    node: str
    """Node of the run's current attempt the fault hits."""
    fault: str
    """`crash`, `hang`, `slow`, `gpu`, `node-down` or `corrupt` (see `trainguard chaos --help`)."""
    rank: int | None = None
    """Global rank; None: the node's first."""
    slow_duty: float = 0.5
    """For `slow`: the fraction of time the rank is stopped, 0.05 to 0.95."""
    recurring: bool = False
    """For `bitflip`: the node's GPU is sick, not hit once: it flips a bit in every attempt it runs ranks of, until
    its agent restarts (`trainguard chaos bitflip --recurring`)."""


class OperatorRequest(BaseModel):
    """Input of the `pause`, `resume` and `abort` updates."""

    reason: str = ""
    """Why, for the history and the status (e.g. `replacing PSU on node-1`)."""


class OperatorResult(BaseModel):
    phase: Phase
    """The run's phase when the request was accepted."""


class DrainRequest(BaseModel):
    """Input of the `drain_node` update."""

    node: str
    """Node to move the run off, at the next committed checkpoint (no work lost); a spare takes its place."""
    reason: str = ""


class CheckpointNowResult(BaseModel):
    step: int
    """The step every rank will checkpoint at (about two seconds ahead of the fastest rank)."""


# ------------------------------------------------------------------------------------------- node pool


class PoolNode(BaseModel):
    """One node in the long-lived inventory."""

    node: str
    host: str = ""
    registered_at: float = 0.0
    """Workflow-clock time of the agent's latest registration."""
    healthy: bool = True
    """GPU health the agent reported when it registered."""
    leased_to: str | None = None
    """Workflow id of the run holding the node."""
    cordoned: str | None = None
    """Why the node may not be leased (a failure, or an operator); None when schedulable."""
    cordoned_at: float | None = None
    cordoned_by: str | None = None
    """The run (workflow id) whose incident cordoned the node; None for an operator's cordon."""
    draining: bool = False
    """Leaves the pool once its current run releases it."""
    peer_url: str = ""
    """Its agent's shard server (the peer tier); empty when it serves none."""
    labels: dict[str, str] = Field(default_factory=dict)
    """What its agent registered it with (`--label gpu=h100`), for runs that choose nodes by `node_selector`."""
    signed_at_ms: int = 0
    """The agent's clock (unix ms) in its latest accepted signed registration: a registration signed no later
    is a replay and refused. 0: none signed yet."""
    slurm_job: int | None = None
    """The Slurm job whose step started the node's agent (its latest registration); None outside Slurm. An
    agent of another job is not the node a run of this job leased (`find_agents_back`)."""


class AgentsBackInput(BaseModel):
    nodes: list[str]
    since: float
    """Unix time (workflow clock) the agents went away: one counts as back once it registered after it."""
    slurm_job: int | None = None
    """The Slurm job the run was started from (its memo); an agent another job started is not back. None: the
    run names no job, any agent counts."""


class AgentsBackResult(BaseModel):
    away: list[str] = Field(default_factory=list)
    """Nodes whose agent has not registered since `since` (or is cordoned, or reported its GPUs unhealthy)."""


class PoolStatus(BaseModel):
    nodes: list[PoolNode] = Field(default_factory=list)
    packed: str = ""
    """The same nodes as zlib-compressed JSON in base64, which the pool carries across continue-as-new instead:
    4,096 nodes are about 800 KB of plain JSON, far over Temporal's 256 KB payload warning, and ~60 KB packed."""

    @classmethod
    def pack(cls, nodes: list[PoolNode]) -> PoolStatus:
        body = json.dumps([n.model_dump(mode="json", exclude_defaults=True) for n in nodes], separators=(",", ":"))
        return cls(packed=base64.b64encode(zlib.compress(body.encode(), 9)).decode())

    def all_nodes(self) -> list[PoolNode]:
        """`nodes`, and those packed."""
        packed = ([PoolNode.model_validate(n) for n in json.loads(zlib.decompress(base64.b64decode(self.packed)))]
                  if self.packed else [])
        return [*self.nodes, *packed]


class RegisterNodeRequest(BaseModel):
    node: str
    host: str = ""
    healthy: bool = True
    peer_url: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    """The node's labels; each registration replaces the ones before."""
    signed_at_ms: int = 0
    """When the agent signed it (its clock, unix ms); 0: unsigned (an agent without the pool's peer token)."""
    slurm_job: int | None = None
    """The Slurm job whose step started the agent (`SLURM_JOB_ID`); None outside Slurm."""
    proof: str = ""
    """HMAC-SHA256 (hex) of every field above with the pool's peer token (`trainguard.pool.registration_proof`):
    the agent holds the pool's credential. A tag, never the token; empty: unsigned."""


class RegistrationVerdict(BaseModel):
    """What the controller's check of a registration's proof found (`verify_registration`)."""

    accepted: bool
    why: str = ""
    """Why it was refused (empty when accepted)."""
    authenticated: bool = False
    """Whether the proof was checked against the controller's token; False when the controller has none (the
    pool then takes any well-formed registration, as before proofs)."""


class AcquireNodesRequest(BaseModel):
    run_id: str
    nodes: list[str]
    """Named nodes (empty with `num_nodes`)."""
    spares: list[str] = Field(default_factory=list)
    num_nodes: int = 0
    """Nodes for the pool to choose (free, schedulable, matching `selector`) instead of `nodes`; 0: none."""
    num_spares: int = 0
    """Spares for the pool to choose besides `spares`, as many as are free up to this; 0: none."""
    selector: dict[str, str] = Field(default_factory=dict)
    """Labels every node the pool chooses must carry."""
    replace_cordoned: bool = False
    """A named node that is cordoned (or draining) is replaced by a free spare instead of refusing the lease.
    False (as before this field): refused."""
    exclude: list[str] = Field(default_factory=list)
    """Nodes the pool must not choose (their agent does not poll); the run's leases on them are given back."""


class AcquireNodesResult(BaseModel):
    granted: bool
    spares: list[str] = Field(default_factory=list)
    """Spares granted with the nodes (those free and schedulable)."""
    nodes: list[str] = Field(default_factory=list)
    """The nodes the run trains on, in order: the named ones, spares in cordoned ones' places, or those the
    pool chose. Empty when not granted (and from pools before this field)."""
    replaced: dict[str, str] = Field(default_factory=dict)
    """Cordoned named node -> the spare granted in its place (`replace_cordoned`)."""
    unsatisfiable: str = ""
    """Why the request cannot be granted however long the run waits (too few nodes match); empty otherwise."""
    cordoned: dict[str, str] = Field(default_factory=dict)
    """Requested nodes that are cordoned, with why: the run cannot start until they are uncordoned."""
    busy: dict[str, str] = Field(default_factory=dict)
    """Requested nodes leased to other runs (node -> run id): the run waits for them."""
    unregistered: list[str] = Field(default_factory=list)


class AcquireManyRequest(BaseModel):
    """Input of the pool's `acquire_many` update: leases of several runs, granted in order."""

    requests: list[AcquireNodesRequest]


class AcquireManyResult(BaseModel):
    results: list[AcquireNodesResult]
    """One per request, in order."""


class ReleaseManyRequest(BaseModel):
    """Input of the pool's `release_many` update: releases of several runs, in order."""

    requests: list[NodeRequest]


class ReleaseManyResult(BaseModel):
    results: list[list[str]]
    """The nodes each request freed, in order."""


class NodeRequest(BaseModel):
    """Input of the pool's `cordon`, `uncordon`, `drain` and `release` updates."""

    node: str | None = None
    run_id: str | None = None
    reason: str = ""
    lost_since: float | None = None
    """A run's cordon for a node it lost: the workflow-clock time (unix seconds) it last heard from the node.
    The cordon does not stand when the node's agent registered after that: it came back (a restarted agent,
    a restarted stack), and the cause of the cordon no longer holds."""


# ---------------------------------------------------------------- node-agent payloads the client reads too
# Defined here, not in `activities`, so the public package never imports worker code; `activities.models`
# and `activities.rank_logs` re-export them.

SLOW_DUTY_MIN = 0.05
SLOW_DUTY_MAX = 0.95
"""`slow` chaos: the fraction of time a rank is stopped. Below 0.05 it is not slowed measurably; at 1.0 it is a
hang, which `hang` injects."""


class InjectFaultResult(BaseModel):
    node: str
    rank: int
    pid: int
    injected_at: float
    step: int | None = None
    """For `corrupt`: the checkpoint step whose shard was damaged."""


LOG_CHUNK_MAX_BYTES = 256 * 1024
"""One read of a rank's log: well under Temporal's 2 MB payload limit (and its 256 KB warning)."""


class ReadRankLogInput(BaseModel):
    workflow_id: str
    """The run whose rank's log to read."""
    node: str
    rank: int
    attempt: int | None = None
    """Launch attempt (1-based); None: the newest one this node has a log of the rank for."""
    offset: int = Field(0, ge=0)
    """Byte offset to read from (ignored with `tail_bytes`)."""
    tail_bytes: int | None = Field(None, ge=0, le=LOG_CHUNK_MAX_BYTES)
    """Read only the last this many bytes (the default view); None: from `offset`."""
    max_bytes: int = Field(LOG_CHUNK_MAX_BYTES, ge=1, le=LOG_CHUNK_MAX_BYTES)


class ReadRankLogResult(BaseModel):
    node: str
    rank: int
    path: str
    """The log file on the node."""
    attempt: int
    text: str = ""
    next_offset: int = 0
    """Where the next read (`--follow`) goes on from."""
    size: int = 0
    """The file's size when read, bytes."""
