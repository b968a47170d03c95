"""The inputs, results and signals of the node-group child workflows (workflows/node_group.py).

A module of its own, imported by the workflows through the sandbox's pass-through: the models are defined once
per controller process, not once per child workflow.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, Field

from activities import names
from activities.models import AttemptLaunch, RankEvidence, WatchEvent, WatchRanksInput


class NodeCallKind(str, Enum):
    """A per-node operation a run fans out: each is one activity on each node's agent."""

    CHECK = names.CHECK_NODE
    DOWNLOAD = names.DOWNLOAD_SHARDS
    LAUNCH = names.LAUNCH_RANKS
    REJOIN = names.REJOIN_RANKS
    STOP = names.STOP_RANKS
    REQUEST_CHECKPOINT = names.REQUEST_CHECKPOINT
    COLLECT_EVIDENCE = names.COLLECT_EVIDENCE


class NodeCall(BaseModel):
    node: str
    input: dict[str, Any]
    """The activity's input model, as JSON."""


class NodeCallsInput(BaseModel):
    kind: NodeCallKind
    calls: list[NodeCall]
    summary: str
    """What the calls do, for the UI; `{node}` is replaced by each call's node."""
    second_chance: bool = False
    """A call no agent started within its schedule-to-start timeout is made once more before it counts as the
    node's failure: a burst of thousands (the check at reservation) reaches its last agents late on a small
    Temporal, and a live node must not fail a run for the server's pace."""


class NodeOutcome(BaseModel):
    node: str
    result: dict[str, Any] | None = None
    """The activity's result model, as JSON; None when it failed."""
    error: str | None = None
    """Why it failed, from the innermost cause."""
    error_type: str | None = None
    """The failure's application error type (e.g. `BadSpec`), when it had one."""
    away_since: float | None = None
    """`AgentShutdown`: unix time (the node's clock) its agent began shutting down."""


class NodeCallsResult(BaseModel):
    outcomes: list[NodeOutcome]
    """One per call, in the calls' order."""


class GroupStarted(BaseModel):
    """Signal from a group to its run: the group's starters (the run's master node) have run the attempt's first
    step."""

    attempt: int
    group: int
    first_step_at: float
    """Unix time of the group's first step of the attempt."""
    parks: bool = False
    """The starters' ranks called `standby()` (the script parks): the run parks its processes on its spares
    too. False from groups of older builds."""


class UploadTrouble(BaseModel):
    """Signal from a group to its run: a node's uploads to the store keep failing."""

    node: str
    error: str
    """The last failed upload's error, as the node saw it."""
    at: float
    """Unix time the node reported it."""


class NodeGroupWatchInput(AttemptLaunch):
    """A watch group's input: its nodes, their watch, and the attempt's launch (`AttemptLaunch`: each node but
    `launched` launches from its first watch)."""

    run_workflow_id: str
    """The run to signal `group_started` to (by workflow id: it survives the run's continue-as-new)."""
    group: int
    watch: WatchRanksInput
    """The watch of every node of the group (its `node` is replaced by each node's)."""
    nodes: list[str]
    started: dict[str, float] = Field(default_factory=dict)
    """Carried across continue-as-new: node -> when its first step of the attempt was seen."""
    finished: list[WatchEvent] = Field(default_factory=list)
    """Carried across continue-as-new: nodes whose ranks have all finished."""
    signalled: bool = False
    first_node_rank: int = 0
    """Node rank of the group's first node: groups are consecutive slices of the attempt's nodes."""
    launch_wait_s: float | None = None
    """How long a launching watch may wait for its agent to start it before the node is taken for lost. None:
    `BURST_SCHEDULE_TO_START`."""
    standing: bool = False
    """The group outlives its attempt: it reports incidents and lost nodes to the run (`group_report`) and goes
    on watching, its nodes' watches taking up the run's next attempt in place (`WatchRanksInput.follow_decisions`);
    the run sends it the next attempt (`next_attempt`) where a node of it reported or a spare joins. It returns
    once every node has finished."""
    launch_second_chance: bool = False
    """A launching watch no agent started within its schedule-to-start timeout is scheduled once more before
    the node is taken for lost. For relaunches of thousands of nodes, whose burst a small Temporal matches
    to the last agents only after that timeout: a live node must not be cordoned for the server's pace."""


class LostNode(BaseModel):
    node: str
    detail: str
    error_type: str | None = None
    """The watch's application error type, when it failed with one: a launch from the watch can fail as the
    spec's fault (`BadSpec`, `EntrypointNotAllowed`) or the checkpoint's (`CorruptCheckpoint`), not the node's."""
    away_since: float | None = None
    """`AgentShutdown`: unix time (the node's clock) its agent began shutting down."""
    never_started: bool = False
    """Its launching watch was never started by an agent: the node launched nothing of the attempt, so a spare
    can take its place in the attempt's rendezvous, which its peers are still waiting in."""


class NodeGroupWatchResult(BaseModel):
    incidents: list[WatchEvent] = Field(default_factory=list)
    """Events the run must decide on (a rank exited or hung, a GPU fault), reported together."""
    lost: list[LostNode] = Field(default_factory=list)
    """Nodes whose agent stopped heartbeating or failed its watch."""
    finished: list[WatchEvent] = Field(default_factory=list)
    """Every node's FINISHED event when all of the group's ranks are done (else empty)."""
    evidence: dict[str, list[RankEvidence]] = Field(default_factory=dict)
    """With a hang: the evidence of the group's nodes that did not report it, asked at once (node -> its ranks')."""


class GroupReport(BaseModel):
    """Signal from a standing group to its run: what its nodes reported, as a group of attempts would return it."""

    group: int
    attempt: int
    """The newest attempt the group was told of (its events may say newer: their watches took it up in place)."""
    result: NodeGroupWatchResult
