"""`TrainingRun`: one training run as a durable workflow.

Validate the spec, reserve the nodes, restore the newest committed checkpoint, launch the ranks on each
node's agent, watch them, commit checkpoints as they come, and on an incident let the pure policy decide,
stop every rank of the attempt, and relaunch. All state lives in the workflow's history, so the run
survives the crash of the controller that drives it.

Over 500 lines: one workflow class whose methods share the run's state and a history of `workflow.patched`
branches that committed histories replay through. What can live outside it does: the decisions
(`workflows/policy.py`), the fan-out to nodes and their watching (`workflows/node_group.py`), the pool
(`workflows/node_pool.py`), the details the UI shows (`workflows/run_details.py`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityCancellationType
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.models import (
        AttemptDecision,
        PublishAttemptInput,
        SLOW_DUTY_MAX,
        SLOW_DUTY_MIN,
        CheckNodeInput,
        CheckNodeResult,
        CollectEvidenceInput,
        CollectEvidenceResult,
        CommitCheckpointsInput,
        CommitCheckpointsResult,
        DownloadShardsInput,
        DownloadShardsResult,
        FindCheckpointInput,
        FindCheckpointResult,
        FindNodeAgentsInput,
        FindNodeAgentsResult,
        InjectFaultInput,
        InjectFaultResult,
        LaunchRanksInput,
        LaunchRanksResult,
        RankEvidence,
        RejoinRanksInput,
        RejoinRanksResult,
        RequestCheckpointInput,
        RequestCheckpointResult,
        StopRanksInput,
        WatchEvent,
        WatchEventKind,
        WatchCheckpoints,
        WatchRanksInput,
    )
    from trainguard.models import AcquireNodesRequest, AcquireNodesResult, NodeRequest, PoolNode
    from trainguard.models import StopReason
    from trainguard import WORKFLOW_TYPE, node_task_queue
    from trainguard.error_types import ErrorType
    from trainguard.faults import FaultKind, choices as fault_choices, parse_fault
    from trainguard.models import (
        INCIDENT_TAILS_KEPT,
        Action,
        CarriedState,
        ChaosRequest,
        CheckpointNowResult,
        CheckpointRef,
        DrainRequest,
        Incident,
        IncidentKind,
        OperatorRequest,
        OperatorResult,
        Phase,
        RunResult,
        RunStatus,
    )
    from trainguard import search_attributes
    from trainguard.spec import RunSpec, SpecError, parse_spec
    from activities.models import NotifySchedulerInput, NotifySchedulerResult, SchedulerAction
    from workflows.node_pool import SCHEDULER_RETRY, SCHEDULER_SCHEDULE_TO_CLOSE, SCHEDULER_TIMEOUT
    from workflows.node_pool import pool_request
    from workflows.culprit import pick_culprit
    from workflows.policy import (RANK_FAULTS, Decision, RecoveryBudget, classify_exit, decide,
                                 may_change_world_size, next_phase, same_failure_streak)
    from workflows.run_details import run_details
    from workflows.node_group import (
        BURST_SCHEDULE_TO_START,
        EVIDENCE_RETRY,
        EVIDENCE_TIMEOUT,
        NODE_CALL_RETRY,
        NODES_PER_GROUP,
        WATCH_NODES_PER_GROUP,
        NODE_SCHEDULE_TO_START,
        PATCH_HANG_EVIDENCE_WITH_EVENT,
        STOP_TIMEOUT,
        TRANSFER_TIMEOUT,  # noqa: F401 - the upload bound retention's janitor relies on (activities/checkpoints.py)
        WATCH_MAX_DURATION_S,
        GroupReport,
        GroupStarted,
        NodeCallKind,
        NodeCall,
        NodeCalls,
        NodeCallsInput,
        NodeCallsResult,
        NodeGroupWatch,
        NodeGroupWatchInput,
        NodeGroupWatchResult,
        NodeOutcome,
        LostNode,
        call_nodes,
        groups_of,
        launch_wait_s,
        watch_heartbeat_every_s,
        watch_heartbeat_timeout,
    )

PATCH_RECLAIM_SPARES = "reclaim-spares"
"""Histories before this patch never took a replaced node back, even once it was repaired."""
PATCH_GROW_BACK = "grow-back"
"""Histories before this patch stayed on their remaining nodes after a shrink."""
PATCH_BOUNDED_DRAIN = "bounded-drain"
"""Histories before this patch waited for every in-flight upload and commit, however long, before recovering."""
PATCH_NODE_LOST_AT_STOP = "node-lost-at-stop"
"""Histories before this patch relaunched onto a node that had not answered the stop of its ranks."""
PATCH_IN_PROCESS = "in-process-restart"
"""Histories before this patch relaunched every rank after a crash whatever `restarts.in_process` said."""
PATCH_HANG_EVIDENCE = "hang-evidence"
"""Histories before this patch named the rank a watch found silent longest as a hang's culprit, and asked no
node for evidence; their watches kept the collective-wait grace."""
PATCH_ABANDON_COMMITTER = "abandon-committer"
"""Histories before this patch cancelled a committer they no longer needed (a cancel request in history)."""
PATCH_FAN_OUT_SLOTS = "fan-out-slots"
"""Histories before this patch started every group's node calls at once, however many groups."""
PATCH_LAUNCH_IN_WATCH = "launch-in-watch"
"""Histories before this patch downloaded and launched on every node with activities of their own, then
watched; now only the master node does, and every other node's first watch downloads and launches."""
PATCH_SAME_FAILURE = "same-failure-stops"
"""Histories before this patch relaunched a script that crashed the same way on every attempt until a restart
budget ran out."""
PATCH_STALE_CORDON = "stale-cordon"
"""Histories before this patch told the cluster scheduler of every cordon, even one the pool did not apply
(the lost node's agent had registered again since the run last heard from it)."""
PATCH_ONE_INCIDENT_PER_LOST_NODE = "one-incident-per-lost-node"
"""Histories before this patch recorded a lost node's symptom (its peer's crash) as an incident of its own and
counted two restarts for the one fault."""
PATCH_RESUME_WHILE_PAUSING = "resume-while-pausing"
"""Histories before this patch dropped any resume accepted before the run was PAUSED (none could be)."""
PATCH_DIRECT_NODE_CALLS = "direct-node-calls"
"""Histories before this patch made every node call through a `NodeCalls` child, even a single one."""
PATCH_FENCED_RELAUNCH = "fenced-relaunch"
"""Histories before this patch stopped every node's ranks (an activity per node) before relaunching them; now
each node's launch of the next attempt stops the old ranks itself (the agent fences by attempt), and only
nodes that leave the run are stopped. A node that does not take up the relaunch is found there instead."""
PATCH_POOL_BY_COUNT = "pool-by-count"
"""Histories before this patch leased named nodes only, and failed when one of them was cordoned even with a
spare free; now the pool also chooses nodes and spares by count and label, and puts a free spare in a cordoned
named node's place."""
PATCH_USER_ERROR_REASON = "user-error-reason"
"""Histories before this patch stopped on a rank's exit 78 with the policy's words alone, not the rank's own
(e.g. `rank 1 passed checkpoint step 50 ... without run.save`, which the incident held)."""
PATCH_UNRESHARDABLE = "unreshardable-checkpoint"
"""Histories before this patch shrank and grew onto any checkpoint, even one that loads only onto the world size
that wrote it (a per-rank `torch.save` of DTensors): its ranks crash-looped until the run failed."""
PATCH_SMALL_WATCH_GROUPS = "small-watch-groups"
"""Histories before this patch watched in groups of 64 nodes (`NODES_PER_GROUP`), now of 16
(`WATCH_NODES_PER_GROUP`); asked only by runs of more than 16 nodes, whose groups differ."""
PATCH_CONTINUE_BY_SPEC = "continue-by-spec"
"""Histories before this patch continued as new whenever Temporal suggested it; the server suggests it at 4,096
events by default, and a 4,096-node run, whose every relaunch costs its history about 5 events per watch group
(256 of them), continued as new after two relaunches: each continue-as-new starts every node's watch again
(4,096 activities). Now the event count is the spec's `max_history_events` (default 10,000, well inside the
51,200 limit), and only a size suggestion (past `SUGGESTED_HISTORY_BYTES`) is taken."""
PATCH_SPARE_JOINS_LAUNCH = "spare-joins-launch"
"""Histories before this patch relaunched once more when a node did not take up a relaunch (the node lost with
its ranks, its peers' crash seen first): the relaunch it found it by never trained. Now a spare takes the lost
node's place in that relaunch, joining the rendezvous its peers are waiting in: one relaunch per fault."""
PATCH_STANDING_GROUPS = "standing-groups"
"""Histories before this patch closed every watch group at an incident and started a new one per group for the
relaunch, each node's launching watch a new activity; asked only by runs of `STANDING_GROUPS_MIN_NODES` nodes or
more, which now relaunch in place."""
# Node groups (workflows/node_group.py) replaced per-node activities in the run's own history: histories of
# runs from before them cannot replay on this code at all, so they are not patched; a controller upgrade
# across that change runs old runs to their end on the old build first (README: upgrading the controller).

STANDING_GROUPS_MIN_NODES = NODES_PER_GROUP + 1
"""Runs of more nodes than one call group relaunch in place: their watch groups stand across attempts
(`NodeGroupWatchInput.standing`), the run writes each relaunch's `AttemptDecision` to the store, and every node
whose watch is still running takes it up there; only the nodes without a watch (those that reported, a spare
joining) launch from a new one. At 4,096 nodes a relaunch of new groups cost the run's history 4 events per
group (cancel the old, start the new), each its own workflow task: 46-53 s from the incident to the last node
launched on this machine, the last launching watches matched 30 s after the first. A small run's relaunch is a
group or two and stays as it was."""

DECISION_READS_PER_S = 1000
"""Reads of the run's decision object a run's watches make each second, at most: each node reads it every
max(1, nodes / 1,000) s (a 4,096-node run: every 4.1 s, which bounds how late a node takes up a relaunch)."""


def decision_every_s(num_nodes: int) -> float:
    return max(1.0, round(num_nodes / DECISION_READS_PER_S, 3))


SUGGESTED_HISTORY_BYTES = 4 * 1024 * 1024
"""Temporal's default size past which it suggests continue-as-new (`limit.historySize.suggestContinueAsNew`,
4 MB; the limit is 50 MB): a suggestion from a history this large is the size's, and is taken."""

DIRECT_NODE_CALLS = 4
"""Node calls this few the run makes itself, not through a `NodeCalls` child: a relaunch's master download and
launch, a small run's every call. A child's start and end cost the run two workflow tasks more than the
activities do, on the path every recovery waits on; four activities are nothing to the run's pending count."""

FAN_OUT_GROUPS = 8
"""Node-call groups a run keeps open at once: 512 node activities, which a dev server on two cores matches to
their agents within seconds; the 64 groups of a 4,096-node check all at once left 1,309 checks waiting past
their schedule-to-start timeout, and the run took those nodes for dead."""

RELAUNCHES = frozenset({Action.RESTART, Action.REPLACE_NODE, Action.SHRINK})
"""Decisions after which every node of the run launches the next attempt."""

SPEC_FAULTS = (ErrorType.BAD_SPEC, ErrorType.STALE_ATTEMPT, ErrorType.ENTRYPOINT_NOT_ALLOWED)
"""Launch failures that are the spec's (or its operator's) fault: the run fails with InvalidSpec, no node is
cordoned and no spare spent."""

# ------------------------------------------------------------------------------ timeouts and retries

DRAIN_TIMEOUT = timedelta(seconds=30)
"""After an incident, pause or drain: how long uploads already under way may take to finish and commit."""

DRAIN_MARGIN = timedelta(seconds=10)
"""What the last pass may take beyond `DRAIN_TIMEOUT`: its final look at the store and a manifest write."""

DRAIN_QUIET_S = 3.0
"""...and the drain ends sooner once no node has reported a new upload for this long."""

COMMITTER_MAX_DURATION_S = 600.0
"""The committer returns after this long even if nothing was committed, so no activity runs unbounded."""
COMMITTER_TIMEOUT = timedelta(seconds=COMMITTER_MAX_DURATION_S + 120)
"""Its last pass may still be writing a manifest (pages first) when the duration ends."""

INCIDENT_SETTLE = timedelta(seconds=1)
"""After the first group reports an incident, how long the others may take to report theirs: a crash's
peers fail in their collective within milliseconds, and the earliest failure of all is the cause."""

STORE_TIMEOUT = timedelta(minutes=2)
"""Listing, HEADs and a small manifest PUT."""
STORE_HEARTBEAT_TIMEOUT = timedelta(seconds=15)
"""Find, commit and prune heartbeat every 2 s: a controller killed mid-call costs 15 s, not `STORE_TIMEOUT`."""

RESERVE_POLL_INTERVAL = timedelta(seconds=2)
"""How often a run waiting for nodes leased to other runs asks the pool again."""

POOL_TIMEOUT = timedelta(seconds=30)
"""One update on the node pool workflow: milliseconds when the controller is up."""

POOL_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
"""The pool lives in the same Temporal as the run: retry until it answers (each call is idempotent)."""


STORE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                          maximum_interval=timedelta(seconds=20), maximum_attempts=12)
"""About three minutes of retries against a flaky store before the run reports it."""

# --------------------------------------------------------------------------------------- internals


@dataclass
class _Outcome:
    finished: bool
    incident: Incident | None = None
    final_events: list[WatchEvent] = field(default_factory=list)
    paused: bool = False
    """An operator asked for a pause."""
    drain: bool = False
    """A node being drained can leave now: a checkpoint was just committed."""
    grow: list[str] = field(default_factory=list)
    """Nodes a shrink left behind are back and leased again: relaunch on them at this checkpoint."""
    continue_as_new: bool = False
    """The history is long: continue as new, the ranks keep running."""
    fallback: bool = False
    """An in-process restart failed: relaunch every rank from a checkpoint (no new incident)."""


_Group = TypeVar("_Group", LaunchRanksResult, RejoinRanksResult)
"""What a node answers when its part of an attempt's process group starts (`_master_first`)."""


class _StoreUnavailable(Exception):
    """The checkpoint store could not be read within `checkpoint.restore_timeout_s`."""


class _NodeFailed(Exception):
    """A node could not do its part of a restore or launch: an incident, not the end of the run."""

    def __init__(self, node: str, detail: str) -> None:
        super().__init__(detail)
        self.node = node


class _CheckpointCorrupt(Exception):
    def __init__(self, step: int, detail: str) -> None:
        super().__init__(detail)
        self.step = step


def _cause_text(error: BaseException) -> str:
    cause = error.__cause__
    while cause is not None and cause.__cause__ is not None and not isinstance(cause, ApplicationError):
        cause = cause.__cause__
    return str(cause or error)


def _lost_since(incident: Incident, num_nodes: int) -> float | None:
    """For a lost node: the earliest time the run may last have heard from it (a watch's heartbeat times out
    `watch_heartbeat_timeout` after the last one, 10 s up to 200 nodes; a stop its agent never picked up waited
    `NODE_SCHEDULE_TO_START`). An agent that registered after that is back; None for any other incident."""
    if incident.kind is not IncidentKind.NODE_UNRESPONSIVE or incident.detected_at <= 0:
        return None
    heartbeat = watch_heartbeat_timeout(watch_heartbeat_every_s(num_nodes))
    return incident.detected_at - max(heartbeat, NODE_SCHEDULE_TO_START).total_seconds()


def _same_failure_reason(incident: Incident, why: str) -> str:
    """A run stopped for a script that fails the same way every time: the reason names the failure, where
    the rank's log is, and ends with the traceback, so `run result`, `status` and the CLI show the cause."""
    where = f"rank {incident.rank} on {incident.node}" if incident.rank is not None else f"{incident.node}"
    log = f" (log: {incident.log_path} on {incident.node})" if incident.log_path else ""
    tail = f"\n{incident.log_tail}" if incident.log_tail else ""
    return f"{where}: {incident.signature}: {why}{log}{tail}"


def _error_type(error: BaseException) -> str | None:
    cause = error.__cause__
    return cause.type if isinstance(cause, ApplicationError) else None


@workflow.defn(name=WORKFLOW_TYPE)
class TrainingRun:
    def __init__(self) -> None:
        self._status = RunStatus()
        self._spec: RunSpec | None = None
        self._restart_times: list[float] = []
        self._restarts_without_checkpoint = 0
        self._last_committed_step = -1
        self._spares: list[str] = []
        self._launched = False
        self._leased = False
        self._restore_tier: str | None = None
        self._warm: Incident | None = None
        """A crash the next attempt recovers from in process (live ranks keep their state)."""
        self._background: list[asyncio.Task[Any]] = []
        self._pause_requested = False
        self._draining: list[str] = []
        self._resume_requested = False
        self._abort_reason: str | None = None
        self._straggler_streak: dict[int, int] = {}
        self._state_since_attempt = 1
        """The attempt the live ranks' state comes from: the last relaunch (in-process restarts keep it)."""
        self._publish_search_attributes = False
        self._injected_at: dict[tuple[str, str], float] = {}
        """(fault, node) -> when chaos injected it: node-down and slow are timed from here when noticed."""
        self._lost: list[str] = []
        self._replaced: list[str] = []
        self._continued = 0
        self._restored_by: list[Incident] = []
        """The incidents this attempt's restore recovers: nodes that downloaded from their watch add their
        restore tiers to them as their events come."""
        self._corrupt_steps: list[int] = []
        """Checkpoints a node's launching watch found corrupt: later restores pass them over."""
        self._symptom: tuple[Incident, str] | None = None
        """The rank fault this relaunch recovers from, with what it was first seen as, while no node has been
        stopped to prove its node reachable: a node lost before the next attempt's first step was its cause."""
        self._joins: list[Incident] = []
        """Lost nodes a spare replaced within the attempt they were found in (`_join_spare`): that attempt's
        first step ends their recovery."""
        self._reports: list[GroupReport] = []
        """What standing groups reported (`group_report`), not yet taken by the attempt's supervision."""
        self._standing: dict[int, asyncio.Task[NodeGroupWatchResult]] = {}
        """Standing groups still watching after the attempt that ended, by index, for the next to take up."""
        self._standing_nodes: list[str] = []
        """The run's nodes when they stood: a relaunch onto as many nodes in the same places takes them up."""
        self._reported_groups: set[int] = set()
        """Standing groups that reported in the attempt that ended: nodes of theirs have no watch left."""
        self._group_ids: dict[int, str] = {}
        self._group_requests: dict[int, NodeGroupWatchInput] = {}
        """Each watch group's workflow id and what it was last given, by index."""

    # ------------------------------------------------------------------------------ queries/updates
    @workflow.query
    def status(self) -> RunStatus:
        return self._status.model_copy(update={"spares": list(self._spares)})

    @workflow.update
    async def inject_fault(self, request: ChaosRequest) -> InjectFaultResult:
        """Chaos: have a node agent crash or hang one rank of the current attempt."""
        newest = self._status.latest_checkpoint
        result: InjectFaultResult = await workflow.execute_activity(
            "inject_fault",
            InjectFaultInput(workflow_id=workflow.info().workflow_id, node=request.node, rank=request.rank,
                             fault=request.fault, slow_duty=request.slow_duty,
                             bucket=newest.bucket if newest else None,
                             manifest_key=newest.manifest_key if newest else None),
            task_queue=node_task_queue(request.node),
            start_to_close_timeout=STOP_TIMEOUT,
            schedule_to_start_timeout=NODE_SCHEDULE_TO_START,
            retry_policy=NODE_CALL_RETRY,
            result_type=InjectFaultResult,
            summary=f"chaos {request.fault} on {request.node}",
        )
        self._injected_at[(request.fault, request.node)] = result.injected_at
        return result

    @workflow.update
    async def pause(self, request: OperatorRequest) -> OperatorResult:
        """Stop the ranks (progress since the newest checkpoint is redone later) and wait for `resume`."""
        self._pause_requested = True
        self._status.reason = f"pause requested: {request.reason}" if request.reason else "pause requested"
        return OperatorResult(phase=self._status.phase)

    @pause.validator
    def _validate_pause(self, request: OperatorRequest) -> None:
        if self._status.phase in (Phase.PAUSED, Phase.COMPLETED, Phase.FAILED, Phase.FINISHING):
            raise ValueError(f"run is {self._status.phase.value}: cannot pause")

    @workflow.update
    async def resume(self, request: OperatorRequest) -> OperatorResult:
        """Relaunch a paused run from its newest committed checkpoint (recovery budgets start afresh)."""
        self._resume_requested = True
        return OperatorResult(phase=self._status.phase)

    @resume.validator
    def _validate_resume(self, request: OperatorRequest) -> None:
        # A pause on its way counts: `await pause(); await resume()` must not race the ranks' stop.
        if self._status.phase is not Phase.PAUSED and not self._pause_requested:
            raise ValueError(f"run is {self._status.phase.value}, not paused: nothing to resume")

    @workflow.update
    async def abort(self, request: OperatorRequest) -> OperatorResult:
        """End a paused run: its ranks are already stopped; the run fails with the operator's reason."""
        self._abort_reason = request.reason or "aborted by an operator"
        return OperatorResult(phase=self._status.phase)

    @abort.validator
    def _validate_abort(self, request: OperatorRequest) -> None:
        if self._status.phase is not Phase.PAUSED:
            raise ValueError(f"run is {self._status.phase.value}: only a paused run is aborted (cancel it instead)")

    @workflow.update
    async def drain_node(self, request: DrainRequest) -> OperatorResult:
        """Move the run off a node at the next committed checkpoint; a spare takes its place."""
        if request.node not in self._draining:
            self._draining.append(request.node)
        return OperatorResult(phase=self._status.phase)

    @drain_node.validator
    def _validate_drain(self, request: DrainRequest) -> None:
        if request.node not in self._status.nodes:
            raise ValueError(f"node {request.node!r} is not in the run (nodes: {', '.join(self._status.nodes)})")
        if len(self._spares) <= len(self._draining):
            raise ValueError(f"no spare node left to take {request.node}'s place (add spare_nodes)")

    @workflow.update
    async def checkpoint_now(self, request: OperatorRequest) -> CheckpointNowResult:
        """Have every rank checkpoint about two seconds from now; it commits like any other checkpoint."""
        attempt, nodes = self._status.attempt, list(self._status.nodes)
        # The master node says where training is: every rank steps in lockstep with it (collectives).
        [where] = await self._request_checkpoint(attempt, nodes[:1], None)
        step_time = where.step_time_s or 0.1
        # About two seconds of steps ahead: the request reaches every node (a child workflow and an activity
        # round trip per group, tens of milliseconds, more on a loaded machine or a large run) well before.
        target = where.step + max(5, math.ceil(2.0 / step_time))
        await self._request_checkpoint(attempt, nodes, target)
        return CheckpointNowResult(step=target)

    @checkpoint_now.validator
    def _validate_checkpoint_now(self, request: OperatorRequest) -> None:
        if self._status.phase is not Phase.RUNNING:
            raise ValueError(f"run is {self._status.phase.value}, not running: no ranks to checkpoint")

    async def _request_checkpoint(self, attempt: int, nodes: list[str],
                                  step: int | None) -> list[RequestCheckpointResult]:
        wid = workflow.info().workflow_id
        outcomes = await self._fan_out(
            NodeCallKind.REQUEST_CHECKPOINT,
            [(n, RequestCheckpointInput(workflow_id=wid, attempt=attempt, node=n, step=step)) for n in nodes],
            "checkpoint now on {node}" + (f" at step {step}" if step is not None else ""))
        failed = [f"{o.node}: {o.error}" for o in outcomes if o.result is None]
        if failed:
            raise ApplicationError(f"checkpoint request failed on {'; '.join(failed[:3])}",
                                   type=ErrorType.NODE_UNAVAILABLE)
        return [RequestCheckpointResult.model_validate(o.result) for o in outcomes]

    async def _fan_out(self, kind: NodeCallKind, calls: list[tuple[str, Any]], summary: str) -> list[NodeOutcome]:
        """One activity of `kind` per node, through a `NodeCalls` child per group of nodes, so no execution
        holds more than a group's activities; every node's outcome, in the calls' order."""
        wid = workflow.info().workflow_id
        if len(calls) <= DIRECT_NODE_CALLS and workflow.patched(PATCH_DIRECT_NODE_CALLS):
            direct = NodeCallsInput(kind=kind, summary=summary, calls=[
                NodeCall(node=node, input=request.model_dump(mode="json")) for node, request in calls])
            return (await call_nodes(direct)).outcomes
        tag = str(workflow.uuid4())[:8]
        chunks = groups_of([NodeCall(node=node, input=request.model_dump(mode="json")) for node, request in calls])
        # Past FAN_OUT_GROUPS groups, the rest wait for a free slot: thousands of node activities queued at once
        # wait longer than NODE_SCHEDULE_TO_START to be matched to their agents, and would read as dead nodes.
        limit = asyncio.Semaphore(FAN_OUT_GROUPS if len(chunks) > FAN_OUT_GROUPS and workflow.patched(
            PATCH_FAN_OUT_SLOTS) else len(chunks) or 1)

        # A check reaches every node at once: past one window of slots, its last calls are matched late.
        second_chance = kind is NodeCallKind.CHECK and len(chunks) > FAN_OUT_GROUPS

        async def one(index: int, chunk: list[NodeCall]) -> NodeCallsResult:
            async with limit:
                return await workflow.execute_child_workflow(
                    NodeCalls.run, NodeCallsInput(kind=kind, calls=chunk, summary=summary,
                                                  second_chance=second_chance),
                    id=f"{wid}/{kind.value}-{tag}-{index}", result_type=NodeCallsResult,
                    static_summary=f"{kind.value} on {chunk[0].node}..{chunk[-1].node} ({len(chunk)} nodes)")

        results = await asyncio.gather(*(one(index, chunk) for index, chunk in enumerate(chunks)))
        return [outcome for result in results for outcome in result.outcomes]

    @inject_fault.validator
    def _validate_fault(self, request: ChaosRequest) -> None:
        if self._status.phase is not Phase.RUNNING:
            raise ValueError(f"run is {self._status.phase.value}, not running: nothing to inject into")
        if request.node not in self._status.nodes:
            raise ValueError(f"node {request.node!r} is not in the run (nodes: {', '.join(self._status.nodes)})")
        if parse_fault(request.fault) is None:
            raise ValueError(f"unknown fault {request.fault!r}: choose one of {fault_choices()}")
        if request.fault == FaultKind.SLOW and not SLOW_DUTY_MIN <= request.slow_duty <= SLOW_DUTY_MAX:
            raise ValueError(f"slow_duty {request.slow_duty:g} is out of range: give {SLOW_DUTY_MIN} to {SLOW_DUTY_MAX}")
        if request.fault == FaultKind.CORRUPT and self._status.latest_checkpoint is None:
            raise ValueError("no committed checkpoint yet to corrupt: wait for the first commit")

    # ------------------------------------------------------------------------------------------ run
    @workflow.run
    async def run(self, raw_spec: Any) -> RunResult:
        carried: CarriedState | None = None
        if isinstance(raw_spec, dict) and set(raw_spec) == {"spec", "carried"}:
            carried = CarriedState.model_validate(raw_spec["carried"])
            raw_spec = raw_spec["spec"]
        try:
            spec = parse_spec(raw_spec)
        except SpecError as error:
            self._status.reason = str(error)
            self._set_phase(Phase.FAILED)
            raise ApplicationError(str(error), type=ErrorType.INVALID_SPEC, non_retryable=True) from None
        self._spec = spec
        # From the start request, not the first workflow task: a run that waited for a controller waited in
        # its wall time too, as `trainguard run report` (which reads the history's own timestamps) counts it.
        started = workflow.info().workflow_start_time.timestamp()
        self._status.nodes = list(spec.nodes)
        self._status.world_size = spec.world_size
        attempt = 0
        try:
            if carried is None:
                self._set_phase(Phase.RESERVING)
                self._spares = await self._reserve(spec)
                spec = self._spec or spec  # as leased: the nodes a count chose, spares in cordoned ones' places
            else:
                started, attempt = carried.started_at, carried.attempt
                self._adopt(carried)
            while True:
                if carried is not None:
                    carried = None  # watch the ranks the previous history launched
                    outcome = await self._supervise(spec, attempt)
                else:
                    attempt += 1
                    self._status.attempt = attempt
                    outcome = await self._run_attempt(spec, attempt)
                if outcome.finished:
                    break
                if outcome.continue_as_new:
                    await self._finish_background()
                    workflow.continue_as_new({"spec": spec.model_dump(mode="json"),
                                              "carried": self._carry(attempt, started).model_dump(mode="json")})
                if outcome.paused:
                    await self._stop_everywhere(self._status.nodes, attempt, "paused by an operator",
                                                StopReason.OPERATOR_PAUSE)
                    await self._wait_for_operator()
                    continue
                if outcome.drain:
                    await self._move_off_drained(attempt)
                    continue
                if outcome.grow:
                    await self._grow_back(spec, attempt, outcome.grow)
                    continue
                if outcome.fallback:
                    continue
                assert outcome.incident is not None
                await self._recover(spec, attempt, outcome.incident)
            await self._finish_background()
            await self._release()
            return self._result(spec, attempt, started, outcome.final_events)
        except workflow.ContinueAsNewError:
            raise
        except BaseException as error:
            # Whatever ends the run (a stop decision, cancellation, a bug): no rank may outlive it.
            if self._status.phase is not Phase.FAILED:
                self._status.reason = self._status.reason or _cause_text(error)
                self._set_phase(Phase.FAILED)
            if self._launched:
                await self._stop_everywhere(self._status.nodes, None, "run ended: stop every rank",
                                            StopReason.RUN_ENDED)
            await self._release()
            raise

    async def _move_off_drained(self, attempt: int) -> None:
        """At a checkpoint boundary: stop the attempt, put spares in the drained nodes' places, relaunch."""
        self._set_phase(Phase.RECOVERING)
        # The nodes that stay are stopped by their own launch of the next attempt (fenced by attempt).
        leaving = ([n for n in self._status.nodes if n in self._draining] if workflow.patched(PATCH_FENCED_RELAUNCH)
                   else self._status.nodes)
        await self._stop_everywhere(leaving, attempt, f"drain {', '.join(self._draining)}", StopReason.DRAIN)
        for node in [n for n in self._draining if n in self._status.nodes]:
            self._replace(node, self._spares.pop(0))
            await self._release(node)
        self._draining.clear()
        self._set_phase(Phase.RESTORING)

    async def _grow_back(self, spec: RunSpec, attempt: int, returned: list[str]) -> None:
        """At a checkpoint boundary: stop the shrunk attempt and relaunch with the returned nodes in their
        places; the restore maps the smaller world's shards onto the larger one."""
        self._set_phase(Phase.RECOVERING)
        if not workflow.patched(PATCH_FENCED_RELAUNCH):  # every node stays: each one's launch stops its ranks
            await self._stop_everywhere(self._status.nodes, attempt, f"grow back onto {', '.join(returned)}",
                                        StopReason.GROW)
        self._status.nodes = [n for n in spec.nodes if n in self._status.nodes or n in returned]
        self._lost = [n for n in self._lost if n not in returned]
        self._status.cordoned = [n for n in self._status.cordoned if n not in returned]
        self._status.world_size = len(self._status.nodes) * spec.ranks_per_node
        workflow.logger.info("grow back onto %s: %d nodes", ", ".join(returned), len(self._status.nodes))
        self._set_phase(Phase.RESTORING)

    async def _reclaim(self, nodes: list[str]) -> list[str]:
        """Nodes this run lost or had replaced that the pool has back (uncordoned, agent healthy): leased to
        this run again."""
        got: AcquireNodesResult = await self._pool(
            "acquire_nodes", AcquireNodesRequest(run_id=workflow.info().workflow_id, nodes=[], spares=nodes),
            AcquireNodesResult, f"reclaim {', '.join(nodes)}")
        return [n for n in nodes if n in got.spares]

    async def _reclaim_spares(self) -> None:
        """A node a spare replaced is back: it becomes one of this run's spares."""
        back = await self._reclaim(self._replaced)
        if back:
            self._replaced = [n for n in self._replaced if n not in back]
            self._spares = [*self._spares, *back]
            self._status.cordoned = [n for n in self._status.cordoned if n not in back]
            workflow.logger.info("%s back as spare", ", ".join(back))

    async def _finish_background(self) -> None:
        """Let retention finish before the run reports done or continues as new."""
        for task in self._background:
            try:
                await task
            except ActivityError as error:
                workflow.logger.warning("background activity failed: %s", _cause_text(error))
        self._background.clear()

    def _carry(self, attempt: int, started: float) -> CarriedState:
        return CarriedState(
            attempt=attempt, nodes=self._status.nodes, cordoned=self._status.cordoned, spares=self._spares,
            incidents=self._status.incidents, restart_times=self._restart_times,
            restarts_without_checkpoint=self._restarts_without_checkpoint,
            last_committed_step=self._last_committed_step, latest_checkpoint=self._status.latest_checkpoint,
            started_at=started, resumed_step=self._status.resumed_step, step=self._status.step,
            straggler_streak=self._straggler_streak, publish_search_attributes=self._publish_search_attributes,
            continued=self._continued + 1, lost=self._lost, replaced=self._replaced,
            state_since_attempt=self._state_since_attempt, replaced_at_start=self._status.replaced_at_start,
        )

    def _adopt(self, carried: CarriedState) -> None:
        self._status.attempt = carried.attempt
        self._status.nodes = carried.nodes
        self._status.world_size = len(carried.nodes) * (self._spec.ranks_per_node if self._spec else 1)
        self._status.cordoned = carried.cordoned
        self._status.incidents = carried.incidents
        self._status.latest_checkpoint = carried.latest_checkpoint
        self._status.resumed_step = carried.resumed_step
        self._status.step = carried.step
        self._spares = carried.spares
        self._restart_times = carried.restart_times
        self._restarts_without_checkpoint = carried.restarts_without_checkpoint
        self._last_committed_step = carried.last_committed_step
        self._straggler_streak = carried.straggler_streak
        self._publish_search_attributes = carried.publish_search_attributes
        self._continued = carried.continued
        self._lost = list(carried.lost)
        self._replaced = list(carried.replaced)
        self._state_since_attempt = carried.state_since_attempt or carried.attempt
        self._status.replaced_at_start = dict(carried.replaced_at_start)
        self._launched = True
        self._leased = True
        self._set_phase(Phase.RUNNING)

    async def _wait_for_operator(self) -> None:
        """PAUSED until an operator resumes (relaunch, budgets afresh) or aborts (the run fails)."""
        self._set_phase(Phase.PAUSED)
        # A resume accepted while the pause was on its way is kept: the run goes straight back.
        keep_resume = self._resume_requested and workflow.patched(PATCH_RESUME_WHILE_PAUSING)
        self._pause_requested, self._resume_requested = False, keep_resume
        await workflow.wait_condition(lambda: self._resume_requested or self._abort_reason is not None)
        if self._abort_reason is not None:
            self._status.reason = self._abort_reason
            raise ApplicationError(self._abort_reason, type=ErrorType.ABORTED, non_retryable=True)
        self._resume_requested = False
        self._status.reason = None
        self._restart_times.clear()
        self._restarts_without_checkpoint = 0
        self._set_phase(Phase.RESTORING)

    def _set_phase(self, phase: Phase) -> None:
        if phase is not self._status.phase:
            self._status.phase = next_phase(self._status.phase, phase)
            self._publish()

    def _publish(self) -> None:
        """Phase, committed step and incident count as search attributes, for filtering runs; and the run's
        current details (phase, attempt, step, nodes, last incident) for the Web UI."""
        workflow.set_current_details(run_details(self._status, self._spares))
        if not self._publish_search_attributes:
            return
        committed = self._status.latest_checkpoint.step if self._status.latest_checkpoint else 0
        workflow.upsert_search_attributes([
            search_attributes.PHASE.value_set(self._status.phase.value),
            search_attributes.STEP.value_set(committed),
            search_attributes.INCIDENTS.value_set(len(self._status.incidents)),
        ])

    # ------------------------------------------------------------------------------------- reserve
    async def _reserve(self, spec: RunSpec) -> list[str]:
        found = await workflow.execute_activity(
            "find_node_agents",
            FindNodeAgentsInput(nodes=spec.nodes + spec.spare_nodes),
            start_to_close_timeout=STORE_TIMEOUT,
            retry_policy=STORE_RETRY,
            result_type=FindNodeAgentsResult,
            summary="find node agents",
        )
        self._publish_search_attributes = found.search_attributes
        unknown = [f"nodes.{i} {n!r}" for i, n in enumerate(spec.nodes) if n in found.missing]
        if unknown:
            reason = (f"invalid run spec: {', '.join(unknown)}: no node agent polls "
                      f"{', '.join(node_task_queue(n) for n in spec.nodes if n in found.missing)} (unknown node)")
            self._status.reason = reason
            self._set_phase(Phase.FAILED)
            raise ApplicationError(reason, type=ErrorType.INVALID_SPEC, non_retryable=True)
        spares = await self._acquire(spec, [n for n in spec.spare_nodes if n not in found.missing])
        for check in await self._check_nodes(self._status.nodes):
            if check.gpu.available and not check.gpu.healthy:
                self._record_incident(Incident(kind=IncidentKind.GPU_UNHEALTHY, node=check.node,
                                               detail=check.gpu.detail, action=Action.REPLACE_NODE))
                await self._cordon(check.node, f"GPU checks failed: {check.gpu.detail}")
                if not spares:
                    raise ApplicationError(f"node {check.node} failed its GPU checks and no spare is left: "
                                           f"{check.gpu.detail}", type=ErrorType.NO_HEALTHY_NODES, non_retryable=True)
                self._replace(check.node, spares.pop(0))
        return spares

    async def _acquire(self, spec: RunSpec, spares: list[str]) -> list[str]:
        """Lease the nodes from the pool; wait (bounded) for nodes other runs hold; fail on cordoned ones."""
        waited = 0.0
        request = AcquireNodesRequest(run_id=workflow.info().workflow_id, nodes=spec.nodes, spares=spares)
        pooled = workflow.patched(PATCH_POOL_BY_COUNT)
        if pooled:
            request = pool_request(spec, request)
        while True:
            lease = await self._pool("acquire_nodes", request, AcquireNodesResult, "lease nodes from the pool")
            if lease.granted:
                self._leased = True
                self._status.reason = None
                if pooled and lease.nodes:
                    self._take_lease(spec, lease)
                return lease.spares
            if lease.unsatisfiable:
                reason = f"{lease.unsatisfiable}: register more nodes, uncordon some, or ask for fewer"
                self._status.reason = reason
                raise ApplicationError(reason, type=ErrorType.NODES_UNAVAILABLE, non_retryable=True)
            if lease.cordoned and not (pooled and (lease.busy or lease.unregistered)):
                where = ", ".join(f"nodes.{spec.nodes.index(n)} {n!r} is cordoned ({why})"
                                  for n, why in lease.cordoned.items())
                spare = " or add a spare to take its place" if pooled else ""
                reason = f"{where}: uncordon it (`trainguard nodes uncordon NODE`){spare} or choose another node"
                self._status.reason = reason
                raise ApplicationError(reason, type=ErrorType.NODES_CORDONED, non_retryable=True)
            waiting = [f"{n} (leased to {run})" for n, run in lease.busy.items()]
            waiting += [f"{n} (agent not registered yet)" for n in lease.unregistered]
            if waited >= spec.reserve_timeout_s:
                reason = f"nodes still unavailable after {waited:.0f}s: {', '.join(waiting)}"
                self._status.reason = reason
                raise ApplicationError(reason, type=ErrorType.NODES_UNAVAILABLE, non_retryable=True)
            self._status.reason = f"waiting for {', '.join(waiting)}"
            await workflow.sleep(RESERVE_POLL_INTERVAL)
            waited += RESERVE_POLL_INTERVAL.total_seconds()

    def _take_lease(self, spec: RunSpec, lease: AcquireNodesResult) -> None:
        """Train on the nodes the pool granted; a cordoned named node a spare replaced is out of the run (and
        taken back as a spare once repaired, as a node replaced later would be)."""
        for named, spare in lease.replaced.items():
            workflow.logger.info("%s is cordoned: spare %s takes its place", named, spare)
            self._status.cordoned = [*self._status.cordoned, named]
            self._replaced = [*self._replaced, named]
        self._status.replaced_at_start = dict(lease.replaced)
        self._status.nodes = list(lease.nodes)
        self._spec = spec.resolved(lease.nodes)
        self._publish()

    async def _pool(self, name: str, request: Any, result_type: type, summary: str) -> Any:
        return await workflow.execute_activity(
            name, request, start_to_close_timeout=POOL_TIMEOUT, retry_policy=POOL_RETRY,
            result_type=result_type, summary=summary,
        )

    async def _cordon(self, node: str, reason: str, lost_since: float | None = None) -> None:
        result: PoolNode = await self._pool(
            "cordon_node", NodeRequest(node=node, run_id=workflow.info().workflow_id, reason=reason,
                                       lost_since=lost_since),
            PoolNode, f"cordon {node}: {reason[:80]}")
        if result.cordoned is None and workflow.patched(PATCH_STALE_CORDON):
            workflow.logger.info("%s registered again since the run last heard from it: not cordoned", node)
            return
        # The cluster's scheduler hears about it too (Slurm drain, Kubernetes cordon + taint; off by default),
        # in the background: recovery never waits on it.
        self._background.append(workflow.start_activity(
            "notify_scheduler",
            NotifySchedulerInput(node=node, action=SchedulerAction.CORDON, reason=reason,
                                 run_id=workflow.info().workflow_id),
            start_to_close_timeout=SCHEDULER_TIMEOUT,
            schedule_to_close_timeout=SCHEDULER_SCHEDULE_TO_CLOSE,
            retry_policy=SCHEDULER_RETRY,
            result_type=NotifySchedulerResult,
            summary=f"tell the scheduler: cordon {node}",
        ))

    async def _release(self, node: str | None = None) -> None:
        if self._leased:
            await self._pool("release_nodes", NodeRequest(run_id=workflow.info().workflow_id, node=node),
                             list[str], f"release {node or 'nodes'}")

    async def _check_nodes(self, nodes: list[str]) -> list[CheckNodeResult]:
        wid = workflow.info().workflow_id
        outcomes = await self._fan_out(NodeCallKind.CHECK, [(n, CheckNodeInput(workflow_id=wid, node=n)) for n in nodes],
                                       "check {node}")
        failed = [o for o in outcomes if o.result is None]
        if failed:
            # As before groups: a node that cannot answer its check fails the reservation, and the run with it.
            raise ApplicationError(f"node {failed[0].node} did not answer its check: {failed[0].error}",
                                   type=ErrorType.NODE_CHECK_FAILED)
        return [CheckNodeResult.model_validate(o.result) for o in outcomes]

    async def _swap_in_spare(self, incident: Incident, spare: str, lost_since: float | None) -> None:
        """The incident's node cordoned in the pool and `spare` in its place in the run."""
        assert incident.node is not None
        await self._cordon(incident.node, f"{incident.kind.value}: {incident.detail}", lost_since)
        self._replaced.append(incident.node)
        self._spares.remove(spare)
        self._replace(incident.node, spare)

    def _replace(self, node: str, spare: str) -> None:
        self._status.nodes = [spare if n == node else n for n in self._status.nodes]
        self._status.cordoned = [*self._status.cordoned, node]

    # ------------------------------------------------------------------------------------- attempt
    def _run_prefix(self, spec: RunSpec) -> str:
        return f"{spec.checkpoint.prefix}/{spec.checkpoint.namespace or workflow.info().workflow_id}"

    async def _run_attempt(self, spec: RunSpec, attempt: int) -> _Outcome:
        if self._warm is not None:
            return await self._run_in_process(spec, attempt, self._warm)
        in_watch = workflow.patched(PATCH_LAUNCH_IN_WATCH)
        try:
            found, restore_dirs = await self._restore(spec, attempt, master_only=in_watch)
        except _NodeFailed as failed:
            return _Outcome(False, self._lost_at_launch(failed.node, attempt, str(failed)))
        except _StoreUnavailable as unavailable:
            return _Outcome(False, Incident(kind=IncidentKind.STORAGE_UNAVAILABLE, attempt=attempt,
                                            detail=str(unavailable), detected_at=workflow.now().timestamp()))
        restore_step = found.manifest.step if found.manifest else 0
        self._status.resumed_step = restore_step
        self._status.step = max(self._status.step, restore_step)
        self._state_since_attempt = attempt  # a relaunch: only this attempt's shards make its checkpoints
        self._restored_by = []
        for incident in self._status.incidents:
            if incident.resumed_step is None and incident.action is not Action.REPORT:
                incident.resumed_step = restore_step
                incident.restore_tier = self._restore_tier if found.manifest else None
                incident.recovery_path = incident.recovery_path or "relaunch"
                if found.manifest:
                    self._restored_by.append(incident)

        self._set_phase(Phase.LAUNCHING)
        self._launched = True
        wid, chain = workflow.info().workflow_id, workflow.info().first_execution_run_id
        nodes = self._status.nodes

        def launch(index: int, master: LaunchRanksResult | None) -> LaunchRanksInput:
            return LaunchRanksInput(
                workflow_id=wid, attempt=attempt, node=nodes[index], node_rank=index, chain_id=chain,
                num_nodes=len(nodes), ranks_per_node=spec.ranks_per_node,
                master_addr=master.master_addr if master else None,
                master_port=master.master_port if master else None,
                entrypoint=spec.entrypoint, env=spec.env, working_dir=spec.working_dir,
                restore_dir=restore_dirs.get(nodes[index]), restore_step=restore_step,
                checkpoint_every=spec.checkpoint.every_steps,
                rejoin_timeout_s=spec.restarts.rejoin_timeout_s if spec.restarts.in_process else None,
            )

        summary = f"launch ranks on {{node}} (attempt {attempt}, from step {restore_step})"
        if in_watch:
            # The master picks the rendezvous; every other node launches from its first watch, given it.
            outcomes = await self._fan_out(NodeCallKind.LAUNCH, [(nodes[0], launch(0, None))], summary)
        else:
            outcomes = await self._master_first(NodeCallKind.LAUNCH, launch, LaunchRanksResult, summary)
        for outcome in outcomes:
            if outcome.result is not None:
                continue
            if outcome.error_type in SPEC_FAULTS:
                self._status.reason = outcome.error
                raise ApplicationError(self._status.reason or "bad spec",
                                       type=ErrorType.INVALID_SPEC, non_retryable=True)
            return _Outcome(False, self._lost_at_launch(outcome.node, attempt, f"launch failed: {outcome.error}"))
        self._set_phase(Phase.RUNNING)
        if not in_watch or len(nodes) == 1:
            return await self._supervise(spec, attempt)
        master = LaunchRanksResult.model_validate(outcomes[0].result)
        template = launch(0, master).model_copy(update={"node": "", "node_rank": 0, "restore_dir": None})
        download = None
        if found.manifest is not None and found.manifest_key is not None:
            download = DownloadShardsInput(workflow_id=wid, attempt=attempt, node="", bucket=spec.checkpoint.bucket,
                                           manifest_key=found.manifest_key, local_tier=spec.checkpoint.local_tier)
        return await self._supervise(spec, attempt, launch=template, download=download)

    async def _master_first(self, kind: NodeCallKind, make: Callable[[int, Any], Any], result_type: type[_Group],
                            summary: str) -> list[NodeOutcome]:
        """`kind` on every node of the attempt: the master node first (it picks the process group's fresh
        port, `master` None), then the others together, given the master's answer. Every node's outcome;
        only the master's when it failed."""
        nodes = self._status.nodes
        [first] = await self._fan_out(kind, [(nodes[0], make(0, None))], summary)
        if first.result is None:
            return [first]
        master = result_type.model_validate(first.result)
        return [first, *await self._fan_out(kind, [(nodes[i], make(i, master)) for i in range(1, len(nodes))],
                                            summary)]

    async def _run_in_process(self, spec: RunSpec, attempt: int, incident: Incident) -> _Outcome:
        """Recover from a crash without a relaunch: the live ranks form attempt `attempt`'s process group with
        the crashed ranks started again, which take a live peer's state. Any failure before the attempt's
        first step falls back to a full relaunch from the newest checkpoint, and the incident says so."""
        self._warm = None
        self._set_phase(Phase.LAUNCHING)
        nodes = self._status.nodes
        self._launched = True
        wid, chain = workflow.info().workflow_id, workflow.info().first_execution_run_id

        def rejoin(index: int, master: RejoinRanksResult | None) -> RejoinRanksInput:
            return RejoinRanksInput(
                workflow_id=wid, chain_id=chain, attempt=attempt, from_attempt=attempt - 1, node=nodes[index],
                node_rank=index, num_nodes=len(nodes), ranks_per_node=spec.ranks_per_node,
                master_addr=master.master_addr if master else None,
                master_port=master.master_port if master else None,
                entrypoint=spec.entrypoint, env=spec.env, working_dir=spec.working_dir,
                checkpoint_every=spec.checkpoint.every_steps, rejoin_timeout_s=spec.restarts.rejoin_timeout_s,
            )

        outcomes = await self._master_first(NodeCallKind.REJOIN, rejoin, RejoinRanksResult,
                                            f"rejoin ranks on {{node}} in process (attempt {attempt})")
        failed = [f"{o.node}: {o.error}" for o in outcomes if o.result is None]
        done = [RejoinRanksResult.model_validate(o.result) for o in outcomes if o.result is not None]
        steps = [r.step for r in done if r.step is not None]
        why = "; ".join(failed) or ("" if steps else "no rank survived the crash")
        if not why:
            # The run's resumed_step stays: shards the live ranks saved after the newest commit are still
            # theirs to report and commit.
            incident.resumed_step, incident.restore_tier, incident.recovery_path = min(steps), "peers", "in-process"
            self._set_phase(Phase.RUNNING)
            outcome = await self._supervise(spec, attempt)
            if outcome.incident is None or incident.recovery_s is not None:
                return outcome  # the in-process restart worked: what ends the attempt is news
            why = f"{outcome.incident.kind.value} before the first step: {outcome.incident.detail}"
        workflow.logger.warning("in-process restart of attempt %d failed, relaunching: %s", attempt, why)
        incident.recovery_path = f"relaunch after failed in-process: {why}"
        incident.resumed_step = incident.restore_tier = None
        self._set_phase(Phase.RECOVERING)
        await self._stop_everywhere(nodes, attempt, "in-process restart failed: relaunch",
                                    StopReason.IN_PROCESS_FAILED)
        return _Outcome(False, fallback=True)

    async def _restore(self, spec: RunSpec, attempt: int,
                       master_only: bool = False) -> tuple[FindCheckpointResult, dict[str, str]]:
        """The newest usable checkpoint, downloaded to every node (`master_only`: to the master node; the
        others download from their launching watch). A corrupt one is passed over for the one before."""
        self._set_phase(Phase.RESTORING)
        excluded: list[int] = list(self._corrupt_steps)
        while True:
            try:
                found = await self._find_checkpoint(spec, attempt, excluded)
            except ActivityError as error:
                if _error_type(error) == ErrorType.BAD_SPEC:  # e.g. the bucket does not exist: no wait fixes that
                    self._status.reason = _cause_text(error)
                    raise ApplicationError(self._status.reason,
                                           type=ErrorType.INVALID_SPEC, non_retryable=True) from None
                raise _StoreUnavailable(
                    f"no answer from the checkpoint store within checkpoint.restore_timeout_s="
                    f"{spec.checkpoint.restore_timeout_s:.0f}: {_cause_text(error)}") from None
            if found.manifest is None or found.manifest_key is None:
                return found, {}
            try:
                return found, await self._download(spec, attempt, found.manifest.step, found.manifest_key,
                                                   count=1 if master_only else None)
            except _CheckpointCorrupt as corrupt:
                excluded.append(corrupt.step)
                self._corrupt_steps.append(corrupt.step)  # a later attempt's restore passes it over too
                self._record_incident(Incident(kind=IncidentKind.CHECKPOINT_CORRUPT, attempt=attempt,
                                               detail=str(corrupt), action=Action.RESTART,
                                               detected_at=workflow.now().timestamp()))

    async def _find_checkpoint(self, spec: RunSpec, attempt: int, excluded: list[int]) -> FindCheckpointResult:
        return await workflow.execute_activity(
            "find_checkpoint",
            FindCheckpointInput(bucket=spec.checkpoint.bucket, run_prefix=self._run_prefix(spec),
                                world_size=self._status.world_size, exclude_steps=excluded, attempt=attempt,
                                min_world_size=None if spec.min_nodes is None else spec.min_nodes * spec.ranks_per_node,
                                max_world_size=None if spec.min_nodes is None else spec.world_size),
            start_to_close_timeout=STORE_TIMEOUT,
            schedule_to_close_timeout=timedelta(seconds=spec.checkpoint.restore_timeout_s),
            heartbeat_timeout=STORE_HEARTBEAT_TIMEOUT,
            retry_policy=STORE_RETRY,
            result_type=FindCheckpointResult,
            summary=f"find newest checkpoint (attempt {attempt})",
        )

    async def _download(self, spec: RunSpec, attempt: int, step: int, manifest_key: str,
                        count: int | None = None) -> dict[str, str]:
        """Every node (the first `count`) reads the shards its ranks restore from the manifest itself (rank r:
        shard r mod the checkpoint's world size): no shard list passes through history."""
        nodes, per_node, wid = self._status.nodes[:count], spec.ranks_per_node, workflow.info().workflow_id
        outcomes = await self._fan_out(NodeCallKind.DOWNLOAD, [
            (node, DownloadShardsInput(workflow_id=wid, attempt=attempt, node=node, bucket=spec.checkpoint.bucket,
                                       manifest_key=manifest_key,
                                       ranks=list(range(index * per_node, (index + 1) * per_node)),
                                       local_tier=spec.checkpoint.local_tier))
            for index, node in enumerate(nodes)], f"download step {step} to {{node}} (attempt {attempt})")
        for outcome in outcomes:
            if outcome.error_type == ErrorType.CORRUPT_CHECKPOINT:
                raise _CheckpointCorrupt(step, f"step {step}: {outcome.error}")
        for outcome in outcomes:
            if outcome.result is None:
                raise _NodeFailed(outcome.node, f"download failed: {outcome.error}")
        results = [DownloadShardsResult.model_validate(o.result) for o in outcomes]
        tiers = {tier for r in results for tier in r.tiers.values()}
        self._restore_tier = "+".join(sorted(tiers)) or None
        return {node: result.restore_dir for node, result in zip(nodes, results)}

    # ----------------------------------------------------------------------------------- supervise
    def _group_inputs(self, spec: RunSpec, attempt: int, launch: LaunchRanksInput | None,
                      download: DownloadShardsInput | None, standing: bool) -> list[NodeGroupWatchInput]:
        """Each watch group's input: with `launch`, each node but the master launches from its first watch."""
        wid = workflow.info().workflow_id
        watch = WatchRanksInput(
            workflow_id=wid, attempt=attempt, node="", health=spec.health,
            # Steps up to the newest commit need no upload again (after continue-as-new too).
            reported_step=max(self._status.resumed_step, self._last_committed_step),
            evidence=workflow.patched(PATCH_HANG_EVIDENCE),
            evidence_with_event=workflow.patched(PATCH_HANG_EVIDENCE_WITH_EVENT),
            max_duration_s=WATCH_MAX_DURATION_S,
            heartbeat_every_s=watch_heartbeat_every_s(len(self._status.nodes)),
            checkpoints=WatchCheckpoints(bucket=spec.checkpoint.bucket, run_prefix=self._run_prefix(spec)),
            follow_decisions=standing, decision_every_s=decision_every_s(len(self._status.nodes)))
        master = self._status.nodes[:1]
        second_chance = len(self._status.nodes) > FAN_OUT_GROUPS * NODES_PER_GROUP
        # A run of one group: its launching watches are a burst of at most 64, matched in well under the stop's
        # 10 s even on a loaded machine, and that is how fast a node lost with its ranks (its peers' crash seen
        # first) is found. Larger relaunches wait 30 s (at 256 nodes, load 16, 10 s read a live node as lost).
        # Past 3,000 nodes the wait grows with the burst (`launch_wait_s`).
        launch_wait = (NODE_SCHEDULE_TO_START.total_seconds() if len(self._status.nodes) <= NODES_PER_GROUP
                       and workflow.patched(PATCH_FENCED_RELAUNCH) else None)
        if launch_wait is None and launch_wait_s(len(self._status.nodes)) > BURST_SCHEDULE_TO_START.total_seconds():
            launch_wait = launch_wait_s(len(self._status.nodes))
        size = self._watch_group_size()
        return [NodeGroupWatchInput(run_workflow_id=wid, group=index, watch=watch, nodes=group,
                                    starters=[n for n in group if n in master], launch=launch, download=download,
                                    first_node_rank=index * size,
                                    launched=[n for n in group if n in master] if launch else [],
                                    launch_second_chance=second_chance, launch_wait_s=launch_wait,
                                    standing=standing)
                for index, group in enumerate(groups_of(self._status.nodes, size))]

    def _watch_group_size(self) -> int:
        if len(self._status.nodes) > WATCH_NODES_PER_GROUP and workflow.patched(PATCH_SMALL_WATCH_GROUPS):
            return WATCH_NODES_PER_GROUP
        return NODES_PER_GROUP

    def _watch_groups(self, spec: RunSpec, attempt: int, launch: LaunchRanksInput | None = None,
                      download: DownloadShardsInput | None = None, only: int | None = None,
                      standing: bool = False) -> dict[int, asyncio.Task[NodeGroupWatchResult]]:
        """A `NodeGroupWatch` per group (`only`: that group's alone, started again); with `launch`, each node but
        the master launches from its first watch."""
        inputs = self._group_inputs(spec, attempt, launch, download, standing)
        return self._start_groups(attempt, [r for r in inputs if only is None or r.group == only])

    def _start_groups(self, attempt: int, inputs: list[NodeGroupWatchInput]) -> dict[int, asyncio.Task[NodeGroupWatchResult]]:
        wid = workflow.info().workflow_id
        tag = str(workflow.uuid4())[:8]
        for request in inputs:
            self._group_ids[request.group] = f"{wid}/watch-{attempt}-{tag}-{request.group}"
            self._group_requests[request.group] = request
        return {request.group: asyncio.ensure_future(workflow.execute_child_workflow(
            NodeGroupWatch.run, request,
            id=self._group_ids[request.group], result_type=NodeGroupWatchResult,
            static_summary=f"watch {request.nodes[0]}..{request.nodes[-1]} ({len(request.nodes)} nodes, "
                           f"attempt {attempt})",
        )) for request in inputs}

    def _stands(self) -> bool:
        """Whether this run's watch groups stand across attempts (`STANDING_GROUPS_MIN_NODES`)."""
        return len(self._status.nodes) >= STANDING_GROUPS_MIN_NODES and workflow.patched(PATCH_STANDING_GROUPS)

    async def _take_up_groups(self, spec: RunSpec, attempt: int, launch: LaunchRanksInput | None,
                              download: DownloadShardsInput | None) -> dict[int, asyncio.Task[NodeGroupWatchResult]]:
        """The attempt's watch groups. A run that stands relaunches in place: the groups still watching go on
        (those with a node left without a watch, or a spare joining, are told the attempt), the decision goes to
        the store for their nodes to take up, and only groups that closed start again."""
        standing = self._stands()
        kept, self._standing = self._standing, {}
        reported, self._reported_groups = self._reported_groups, set()
        inputs = self._group_inputs(spec, attempt, launch, download, standing)
        for request in inputs:
            self._group_requests[request.group] = request
        same_places = len(self._status.nodes) == len(self._standing_nodes)
        if not standing or launch is None or not same_places:
            await self._stop_watching(kept)
            return self._start_groups(attempt, inputs)
        before = groups_of(self._standing_nodes, self._watch_group_size())
        groups: dict[int, asyncio.Task[NodeGroupWatchResult]] = {}
        told: list[NodeGroupWatchInput] = []
        for request in inputs:
            task = kept.get(request.group)
            if task is None or task.done():
                continue
            groups[request.group] = task
            if request.group in reported or before[request.group] != request.nodes:
                told.append(request)
        fresh = self._start_groups(attempt, [r for r in inputs if r.group not in groups])
        wid = workflow.info().workflow_id
        decision = AttemptDecision(
            workflow_id=wid, chain_id=workflow.info().first_execution_run_id, attempt=attempt, launch=launch,
            download=download, starters=self._status.nodes[:1], launched=self._status.nodes[:1],
            leaving=[n for n in self._standing_nodes if n not in self._status.nodes])
        await asyncio.gather(
            *(self._tell_group(request) for request in told),
            workflow.execute_activity(
                "publish_attempt",
                PublishAttemptInput(bucket=spec.checkpoint.bucket, run_prefix=self._run_prefix(spec),
                                    decision=decision),
                start_to_close_timeout=STORE_TIMEOUT, heartbeat_timeout=STORE_HEARTBEAT_TIMEOUT,
                retry_policy=STORE_RETRY, summary=f"publish attempt {attempt} for the nodes to take up"))
        return {**groups, **fresh}

    async def _take_reports(self, attempt: int) -> list[tuple[int, NodeGroupWatchResult]]:
        """The standing groups' reports, less what their nodes reported of attempts before `attempt`: a group
        not yet told of it is told now, and its nodes that reported launch from a new watch."""
        taken, self._reports = self._reports, []
        results, behind = [], []
        for report in taken:
            result = report.result
            current = [e for e in result.incidents if (e.attempt or report.attempt) >= attempt]
            if (report.attempt < attempt or len(current) < len(result.incidents)) and report.group not in behind:
                behind.append(report.group)
            if current or result.lost:
                results.append((report.group, result.model_copy(update={"incidents": current})))
        # Together: each signal's confirmation is a workflow task of the run's, and a fault every node reports
        # after the decision brings one report per group.
        await asyncio.gather(*(self._tell_group(self._group_requests[g]) for g in behind if g in self._group_requests))
        return results

    async def _drop_standing(self) -> None:
        """End the standing groups: what comes next is no relaunch in place."""
        kept, self._standing = self._standing, {}
        await self._stop_watching(kept)

    async def _tell_group(self, request: NodeGroupWatchInput) -> None:
        """A standing group's next attempt (its nodes without a watch launch from a new one)."""
        self._group_requests[request.group] = request
        try:
            await workflow.get_external_workflow_handle(self._group_ids[request.group]).signal("next_attempt", request)
        except Exception as error:  # the group closed meanwhile: its result says how, and the run goes by that
            workflow.logger.warning("could not tell watch group %d of attempt %d: %s", request.group,
                                    request.watch.attempt, error)

    def _committer(self, spec: RunSpec, attempt: int, quiet_s: float | None = None) -> asyncio.Task[CommitCheckpointsResult]:
        return asyncio.ensure_future(workflow.execute_activity(
            "commit_checkpoints",
            CommitCheckpointsInput(bucket=spec.checkpoint.bucket, run_prefix=self._run_prefix(spec),
                                   workflow_id=workflow.info().workflow_id, attempt=attempt,
                                   chain_id=workflow.info().first_execution_run_id,
                                   min_attempt=min(self._state_since_attempt, attempt),
                                   world_size=self._status.world_size, num_nodes=len(self._status.nodes),
                                   after_step=self._last_committed_step, keep_last=spec.checkpoint.keep_last,
                                   straggler_ratio=spec.health.straggler_ratio,
                                   max_duration_s=DRAIN_TIMEOUT.total_seconds() if quiet_s else COMMITTER_MAX_DURATION_S,
                                   quiet_s=quiet_s),
            start_to_close_timeout=COMMITTER_TIMEOUT,
            # The last pass is bounded whatever the store does: with the store down its retries would hold
            # recovery for minutes, for a checkpoint the run can do without.
            schedule_to_close_timeout=DRAIN_TIMEOUT + DRAIN_MARGIN if quiet_s else None,
            heartbeat_timeout=STORE_HEARTBEAT_TIMEOUT,
            retry_policy=STORE_RETRY,
            result_type=CommitCheckpointsResult,
            summary=(f"commit the checkpoints left (attempt {attempt})" if quiet_s else
                     f"commit checkpoints after step {self._last_committed_step} (attempt {attempt})"),
            # Given up without a cancel request: a cancel racing the committer's own return is refused
            # (ACTIVITY_UNKNOWN) and fails the workflow task. An abandoned committer is harmless (its commits
            # are idempotent, and the next pass finds them), and stops at its next heartbeat once the run closes.
            cancellation_type=(ActivityCancellationType.ABANDON if workflow.patched(PATCH_ABANDON_COMMITTER)
                               else ActivityCancellationType.TRY_CANCEL),
        ))

    async def _supervise(self, spec: RunSpec, attempt: int, launch: LaunchRanksInput | None = None,
                         download: DownloadShardsInput | None = None) -> _Outcome:
        nodes = list(self._status.nodes)
        watches = await self._take_up_groups(spec, attempt, launch, download)
        reporting: set[int] = set()
        """Standing groups that reported in this attempt."""
        reports = asyncio.ensure_future(workflow.wait_condition(lambda: bool(self._reports)))
        committer = self._committer(spec, attempt)
        finished: dict[int, NodeGroupWatchResult] = {}
        incident: Incident | None = None
        self._event_evidence: dict[str, list[RankEvidence]] = {}
        paused = False
        control = asyncio.ensure_future(workflow.wait_condition(lambda: self._pause_requested))

        continue_as_new = drain = False
        grow: list[str] = []
        spec_fault: LostNode | None = None
        corrupt: LostNode | None = None
        """A launching watch's download found the restored checkpoint corrupt."""
        joining: list[tuple[int, LostNode]] = []
        """Nodes that never took up their launching watch, by group: a spare may join the attempt in their place."""
        while incident is None and not paused and not continue_as_new and not drain and not grow and (
                spec_fault is None and corrupt is None and len(finished) < len(watches)):
            pending: list[asyncio.Task[Any]] = [*(t for g, t in watches.items() if g not in finished), committer,
                                                control, reports]
            await workflow.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            paused = control.done()
            reported = [g for g, t in watches.items() if g not in finished and t.done()]
            if any(not watches[g].result().finished for g in reported) or self._reports:
                # Give the other groups a moment to report theirs: the earliest failure of all is the cause.
                others = [t for g, t in watches.items() if g not in finished and not t.done()]
                if others:
                    await workflow.wait(others, timeout=INCIDENT_SETTLE.total_seconds())
                reported = [g for g, t in watches.items() if g not in finished and t.done()]
            results = [(g, watches[g].result()) for g in reported]
            if reports.done():
                results += await self._take_reports(attempt)
                reporting.update(g for g, _ in results if g not in reported)
                reports = asyncio.ensure_future(workflow.wait_condition(lambda: bool(self._reports)))
            # Several nodes may report at once (e.g. a controller was down meanwhile): the incident is the
            # earliest failure (by when it happened where the node knows, else when it was seen), not the
            # first node's, so a peer that failed in a collective because of it is never blamed for it.
            seen: list[tuple[float, Incident]] = []
            for group, result in sorted(results, key=lambda found: found[0]):  # a fixed order: deterministic
                self._add_restore_tiers([*result.incidents, *result.finished])
                for lost in result.lost:
                    if lost.error_type in SPEC_FAULTS:  # from a launching watch: the spec's fault, not the node's
                        spec_fault = spec_fault or lost
                        continue
                    if lost.error_type == ErrorType.CORRUPT_CHECKPOINT:
                        corrupt = corrupt or lost
                        continue
                    if lost.never_started and launch is not None:
                        joining.append((group, lost))  # a spare may take its place: decided below
                        continue
                    found = self._lost_at_launch(lost.node, attempt, lost.detail)
                    seen.append((found.detected_at, found))
                for event in result.incidents:
                    self._status.step = max(self._status.step, event.step)
                    if event.evidence:  # taken by its watch (`evidence_with_event`): not asked again
                        self._event_evidence[event.node] = event.evidence
                    if event.kind is WatchEventKind.GPU_UNHEALTHY:
                        seen.append((event.detected_at, Incident(
                            kind=IncidentKind.GPU_UNHEALTHY, node=event.node, attempt=attempt, detail=event.detail,
                            detection_s=None if event.fault_at is None else round(event.detected_at - event.fault_at, 3),
                            detected_at=event.detected_at)))
                    else:
                        seen.append((event.occurred_at or event.detected_at, self._rank_incident(event, attempt)))
                if result.finished:
                    finished[group] = result
            rejoined: list[int] = []
            for group, lost in joining:
                found = self._lost_at_launch(lost.node, attempt, lost.detail)
                if seen or not workflow.patched(PATCH_SPARE_JOINS_LAUNCH) or not await self._join_spare(
                        spec, attempt, found):
                    seen.append((found.detected_at, found))
                elif group not in rejoined:
                    rejoined.append(group)
            joining.clear()
            if rejoined and not seen:  # else the incident relaunches every node, spares joined included
                nodes = list(self._status.nodes)
                for group in rejoined:  # one new watch of the group however many of its nodes a spare replaced
                    if group in watches and not watches[group].done() and self._group_requests[group].standing:
                        await self._tell_group(self._group_inputs(spec, attempt, launch, download, True)[group])
                    else:
                        watches.update(self._watch_groups(spec, attempt, launch, download, only=group,
                                                          standing=self._stands()))
            if seen:
                incident = min(seen, key=lambda found: found[0])[1]  # min keeps the first of equals

            if committer.done():
                try:
                    commits = committer.result().commits
                except ActivityError as error:
                    workflow.logger.warning("committer failed: %s", _cause_text(error))
                    commits = []
                for commit in commits:
                    self._committed(commit.ref)
                    self._status.step = max(self._status.step, commit.step)
                    incident = incident or self._judge_stragglers(spec, attempt, commit.ref.step, commit.slow_ranks)
                if commits:
                    drain = drain or any(n in nodes for n in self._draining)
                    if (self._lost and not grow and workflow.patched(PATCH_GROW_BACK)
                            and may_change_world_size(self._newest_checkpoint())):
                        grow = await self._reclaim(self._lost)
                    if self._replaced and workflow.patched(PATCH_RECLAIM_SPARES):
                        await self._reclaim_spares()
                info = workflow.info()
                suggested = info.is_continue_as_new_suggested()
                if (suggested and info.get_current_history_size() < SUGGESTED_HISTORY_BYTES
                        and workflow.patched(PATCH_CONTINUE_BY_SPEC)):
                    suggested = False  # the server's count: the spec's `max_history_events` decides that
                continue_as_new = not drain and not grow and incident is None and len(finished) < len(watches) and (
                    suggested or info.get_current_history_length() >= spec.max_history_events)
                committer = self._committer(spec, attempt)

        if incident is not None and incident.kind is IncidentKind.HANG and workflow.patched(PATCH_HANG_EVIDENCE):
            await self._attribute_hang(spec, attempt, incident)  # first: the ranks are still where they hung
        control.cancel()
        committer.cancel()
        reports.cancel()
        await asyncio.gather(committer, control, reports, return_exceptions=True)  # a cancel is not waited on
        if incident is not None and spec_fault is None and corrupt is None and self._stands():
            # The groups stand for the relaunch to take up; `_recover` ends them if it decides otherwise.
            self._standing = {g: t for g, t in watches.items() if not t.done()}
            self._standing_nodes, self._reported_groups = list(self._status.nodes), reporting
        else:
            await self._stop_watching(watches)
        if spec_fault is not None:
            self._status.reason = f"launch failed on {spec_fault.node}: {spec_fault.detail}"
            raise ApplicationError(self._status.reason, type=ErrorType.INVALID_SPEC, non_retryable=True)
        if corrupt is not None:
            # As a corrupt download before any launch: pass the checkpoint over and restore the one before.
            step = self._status.resumed_step
            self._corrupt_steps.append(step)
            for recovered in self._restored_by:  # not resumed from there after all: the next restore says where
                recovered.resumed_step = recovered.restore_tier = None
            self._record_incident(Incident(kind=IncidentKind.CHECKPOINT_CORRUPT, attempt=attempt, node=corrupt.node,
                                           detail=f"step {step}: {corrupt.detail}", action=Action.RESTART,
                                           detected_at=workflow.now().timestamp()))
            self._set_phase(Phase.RECOVERING)
            await self._stop_everywhere(self._status.nodes, attempt, f"checkpoint {step} is corrupt: restore older",
                                        StopReason.CORRUPT_CHECKPOINT)
            return _Outcome(False, fallback=True)
        if continue_as_new and incident is None and not paused:
            return _Outcome(False, continue_as_new=True)
        # Shards already saved may still commit: a checkpoint is valid whoever crashed after it.
        await self._commit_the_rest(spec, attempt)
        if paused and incident is None:
            return _Outcome(False, paused=True)
        if drain and incident is None:
            return _Outcome(False, drain=True)
        if grow and incident is None:
            return _Outcome(False, grow=grow)
        if incident is not None:
            return _Outcome(False, incident)
        self._set_phase(Phase.FINISHING)
        return _Outcome(True, final_events=[e for g in sorted(finished) for e in finished[g].finished])

    async def _join_spare(self, spec: RunSpec, attempt: int, incident: Incident) -> bool:
        """A node never took up its launching watch of attempt `attempt`: it launched nothing, and its peers wait
        for its ranks in the attempt's rendezvous. Where the policy would replace it, a spare takes its place
        (its node rank, the same rendezvous and restore) and the attempt goes on: no relaunch of everyone, which
        would cost a lost node found this way (its peers' crash seen first) two relaunches for one fault.
        False: the policy decides otherwise (no spare, a spent budget), and the incident takes the usual path."""
        now = workflow.now().timestamp()
        merged = incident.attempt < attempt  # the lost node is the previous incident, the relaunch its cost
        budget = RecoveryBudget(tuple(self._restart_times), self._restarts_without_checkpoint,
                                same_failure_streak(incident, self._status.incidents))
        decision = decide(incident.kind, incident.node, spec, self._status.nodes, self._spares, budget, now,
                          newest=self._newest_checkpoint())
        if decision.action is not Action.REPLACE_NODE or not incident.node or not decision.replacement:
            return False
        spare = decision.replacement
        incident.action = decision.action
        incident.detail = f"{incident.detail}; {decision.reason}; it joined attempt {attempt} in the node's place"
        incident.resumed_step, incident.restore_tier = self._status.resumed_step, self._restore_tier
        incident.recovery_path = "relaunch, a spare joining it"
        self._record_incident(incident)
        workflow.logger.info("incident %s on %s: %s joins attempt %d in its place", incident.kind.value,
                             incident.node, spare, attempt)
        if merged:  # the relaunch already made counts once, as it did before the symptom was taken back
            self._restart_times.append(now)
            self._restarts_without_checkpoint += 1
        await self._swap_in_spare(incident, spare, _lost_since(incident, len(self._status.nodes)))
        self._joins.append(incident)  # its recovery ends at this attempt's first step
        self._publish()
        return True

    @staticmethod
    async def _stop_watching(watches: dict[int, asyncio.Task[NodeGroupWatchResult]]) -> None:
        """Cancel the groups still watching (their ranks keep running) and wait until they have ended."""
        running = [t for t in watches.values() if not t.done()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    async def _commit_the_rest(self, spec: RunSpec, attempt: int) -> None:
        """One last committer pass, bounded by `DRAIN_TIMEOUT` and ending once uploads go quiet: with the
        store down, an upload retries for hours, and recovery must not wait on a checkpoint it can do without."""
        try:
            result = await self._committer(spec, attempt, quiet_s=DRAIN_QUIET_S)
        except ActivityError as error:
            workflow.logger.warning("last commit pass failed: %s", _cause_text(error))
            return
        for commit in result.commits:
            self._committed(commit.ref)

    def _add_restore_tiers(self, events: list[WatchEvent]) -> None:
        tiers = {tier for event in events for tier in event.restore_tiers}
        known = set((self._restore_tier or "").split("+")) - {""}
        if tiers - known:
            self._restore_tier = "+".join(sorted(known | tiers))
            for incident in self._restored_by:
                incident.restore_tier = self._restore_tier

    def _newest_checkpoint(self) -> CheckpointRef | None:
        """The newest committed checkpoint, as the policy may weigh it (older histories never looked at
        whether it reshards)."""
        newest = self._status.latest_checkpoint
        if newest is not None and not newest.reshardable and not workflow.patched(PATCH_UNRESHARDABLE):
            return None
        return newest

    def _committed(self, ref: CheckpointRef) -> None:
        """The committer already applied retention; the history records the commit."""
        if ref.step > self._last_committed_step:
            self._last_committed_step = ref.step
            self._restarts_without_checkpoint = 0
            self._status.latest_checkpoint = ref
            self._status.step = max(self._status.step, ref.step)
            self._publish()

    def _judge_stragglers(self, spec: RunSpec, attempt: int, step: int, slow: dict[int, float]) -> Incident | None:
        """At each committed checkpoint: the committer compared the ranks' compute times over the interval. A
        straggler is reported when first seen; one that persists comes back as an incident for the policy."""
        self._straggler_streak = {r: self._straggler_streak.get(r, 0) + 1 for r in slow}
        for rank, ratio in slow.items():
            node = self._status.nodes[rank // spec.ranks_per_node]
            streak = self._straggler_streak[rank]
            now = workflow.now().timestamp()
            slowed_at = self._injected_at.get(("slow", node))
            incident = Incident(kind=IncidentKind.STRAGGLER, node=node, rank=rank, attempt=attempt,
                                detail=f"rank {rank} computes {ratio:.2f}x slower than its peers' median "
                                       f"(interval ending at step {step}, {streak} in a row)",
                                detection_s=None if slowed_at is None else round(max(0.0, now - slowed_at), 3),
                                action=Action.REPORT, detected_at=now)
            if streak == 1:
                self._record_incident(incident)
            if streak >= spec.health.straggler_windows and self._spares:
                self._straggler_streak.clear()
                return incident
        return None

    @workflow.signal
    def group_report(self, report: GroupReport) -> None:
        """A standing group's incidents and lost nodes (it goes on watching the others)."""
        self._reports.append(report)

    @workflow.signal
    def group_started(self, started: GroupStarted) -> None:
        """A node group has run the attempt's first step on every node. The first group of the attempt
        closes the previous incident's time to recover (every rank steps together, so the first step of one
        group is the first step of all)."""
        if started.attempt != self._status.attempt:
            return  # a late signal of an attempt already over
        for incident in self._status.incidents:
            if incident.recovery_s is None and incident.action is not Action.REPORT and (
                    incident.attempt < started.attempt or any(incident is joined for joined in self._joins)):
                incident.recovery_s = round(max(0.0, started.first_step_at - incident.detected_at), 3)
                workflow.metric_meter().create_histogram_float(
                    "trainguard_recovery_seconds", "Detection to the first step of the next attempt", "s"
                ).record(incident.recovery_s, {"kind": incident.kind.value})

    def _rank_incident(self, event: WatchEvent, attempt: int) -> Incident:
        kind = IncidentKind.HANG if event.kind is WatchEventKind.HANG else classify_exit(event.exit_code)
        detection = None if event.fault_at is None else round(max(0.0, event.detected_at - event.fault_at), 3)
        return Incident(kind=kind, node=event.node, rank=event.rank, attempt=attempt, detail=event.detail,
                        detection_s=detection, detected_at=event.detected_at, log_path=event.log_path,
                        log_tail=event.log_tail, signature=event.failure_signature)

    def _symptom_of_lost_node(self, symptom: Incident, node: str, seen_as: str, missed: str = "the stop") -> Incident:
        """One fault, one incident: a rank fault whose node then did not answer is taken back, and the lost
        node is the incident, timed from the symptom (its first sign), with the symptom in its detail."""
        self._status.incidents = [i for i in self._status.incidents if i is not symptom]
        lost = self._node_lost(node, symptom.attempt, f"node agent did not answer {missed} after "
                                                      f"{symptom.kind.value} on {symptom.node} ({seen_as})")
        # Timed from the symptom both ways, so detection_s + recovery_s is fault to first new step: measured to
        # when the node was found instead, a node-down bench-recovery counted the relaunch's 10 s wait twice.
        lost.detected_at = symptom.detected_at
        down_at = self._injected_at.get((FaultKind.NODE_DOWN, node))
        lost.detection_s = (symptom.detection_s if down_at is None
                            else round(max(0.0, symptom.detected_at - down_at), 3))
        return lost

    def _lost_at_launch(self, node: str, attempt: int, detail: str) -> Incident:
        """A node lost while attempt `attempt` restores, launches or runs. Before its first step, and after a
        rank fault that no stop proved harmless to its node (a fenced relaunch), the fault was this node's
        symptom: one incident, the lost node, and the relaunch it cost is not counted twice."""
        symptom, self._symptom = self._symptom, None
        if symptom is None or symptom[0].attempt != attempt - 1 or symptom[0].recovery_s is not None:
            return self._node_lost(node, attempt, detail)
        self._restart_times = self._restart_times[:-1]
        self._restarts_without_checkpoint = max(0, self._restarts_without_checkpoint - 1)
        return self._symptom_of_lost_node(symptom[0], node, symptom[1], missed=f"the relaunch ({detail})")

    def _node_lost(self, node: str, attempt: int, detail: str) -> Incident:
        """A node whose agent stopped answering. Detection is timed from the fault when chaos injected it
        (`node-down`); otherwise the time of the agent's last heartbeat is not known here, and it is left out."""
        now = workflow.now().timestamp()
        down_at = self._injected_at.get((FaultKind.NODE_DOWN, node))
        return Incident(kind=IncidentKind.NODE_UNRESPONSIVE, node=node, attempt=attempt, detail=detail,
                        detection_s=None if down_at is None else round(max(0.0, now - down_at), 3),
                        detected_at=now)

    # ------------------------------------------------------------------------------------- recover
    async def _recover(self, spec: RunSpec, attempt: int, incident: Incident) -> None:
        self._set_phase(Phase.RECOVERING)
        self._symptom = None
        now = workflow.now().timestamp()
        same = same_failure_streak(incident, self._status.incidents)
        if (spec.restarts.max_same_failure and same >= spec.restarts.max_same_failure
                and not workflow.patched(PATCH_SAME_FAILURE)):
            same = 0
        decision: Decision = decide(
            incident.kind, incident.node, spec, self._status.nodes, self._spares,
            RecoveryBudget(tuple(self._restart_times), self._restarts_without_checkpoint, same), now,
            persisted=incident.kind is IncidentKind.STRAGGLER, newest=self._newest_checkpoint(),
        )
        seen_as = incident.detail
        incident.action = decision.action
        incident.detail = f"{incident.detail}; {decision.reason}" if incident.detail else decision.reason
        if decision.action is Action.STOP and spec.restarts.max_same_failure and same >= spec.restarts.max_same_failure:
            decision = Decision(Action.STOP, _same_failure_reason(incident, decision.reason))
        elif decision.action is Action.STOP and seen_as and (
                incident.kind in RANK_FAULTS
                or (incident.kind is IncidentKind.USER_ERROR and workflow.patched(PATCH_USER_ERROR_REASON))):
            # A spent budget names the fault that spent it, and where its rank's log is.
            where = f" (log: {incident.log_path} on {incident.node})" if incident.log_path else ""
            decision = Decision(Action.STOP, f"{decision.reason}; the last incident: {seen_as}{where}")
        self._record_incident(incident)
        workflow.logger.info("incident %s on %s rank %s: %s", incident.kind.value, incident.node, incident.rank,
                             decision.reason)
        if (decision.action is Action.RESTART and incident.kind is IncidentKind.CRASH and spec.restarts.in_process
                and workflow.patched(PATCH_IN_PROCESS)):
            # The live ranks stay up: the next attempt rejoins them with the crashed ones started again.
            self._warm = incident
            await self._drop_standing()
            self._restart_times.append(now)
            self._restarts_without_checkpoint += 1
            self._set_phase(Phase.RESTORING)
            return
        reachable = [n for n in self._status.nodes if
                     not (incident.kind is IncidentKind.NODE_UNRESPONSIVE and n == incident.node)]
        fenced = decision.action in RELAUNCHES and workflow.patched(PATCH_FENCED_RELAUNCH)
        if not fenced and self._standing:
            await self._drop_standing()
        unreachable = [] if fenced else await self._stop_everywhere(
            reachable, attempt, f"{incident.kind.value}: {decision.action.value}",
            StopReason.INCIDENT_PAUSE if decision.action is Action.PAUSE else StopReason.INCIDENT)
        if decision.action is Action.STOP:
            self._status.reason = decision.reason
            raise ApplicationError(decision.reason, type=ErrorType.RUN_STOPPED, non_retryable=True)
        if decision.action is Action.PAUSE:
            self._status.reason = decision.reason
            await self._wait_for_operator()
            return
        if (unreachable and decision.action is Action.RESTART and incident.kind in RANK_FAULTS
                and workflow.patched(PATCH_NODE_LOST_AT_STOP)):
            # The rank fault was a symptom: a node stopped answering and its peers failed in the collective.
            # Deal with the node now rather than after a relaunch that cannot reach it.
            if workflow.patched(PATCH_ONE_INCIDENT_PER_LOST_NODE):
                await self._recover(spec, attempt, self._symptom_of_lost_node(incident, unreachable[0], seen_as))
                return
            self._restart_times.append(now)
            self._restarts_without_checkpoint += 1
            await self._recover(spec, attempt, self._node_lost(
                unreachable[0], attempt, f"node agent did not answer the stop after {incident.kind.value}"))
            return
        lost_since = _lost_since(incident, len(self._status.nodes))
        if decision.action is Action.REPLACE_NODE and incident.node and decision.replacement:
            await self._swap_in_spare(incident, decision.replacement, lost_since)
        if decision.action is Action.SHRINK and incident.node:
            await self._cordon(incident.node, f"{incident.kind.value}: {incident.detail}", lost_since)
            self._lost.append(incident.node)
            self._status.nodes = [n for n in self._status.nodes if n != incident.node]
            self._status.cordoned = [*self._status.cordoned, incident.node]
            self._status.world_size = len(self._status.nodes) * spec.ranks_per_node
        if fenced:
            # Every node staying in the run stops this attempt's ranks as it launches the next one; those
            # leaving it (a straggler or a sick GPU replaced) are stopped here.
            leaving = [n for n in reachable if n not in self._status.nodes]
            if leaving:
                await self._stop_everywhere(leaving, attempt, f"{incident.kind.value}: {decision.action.value}")
            if decision.action is Action.RESTART and incident.kind in RANK_FAULTS:
                self._symptom = (incident, seen_as)
        self._restart_times.append(now)
        self._restarts_without_checkpoint += 1
        self._set_phase(Phase.RESTORING)

    async def _attribute_hang(self, spec: RunSpec, attempt: int, incident: Incident) -> None:
        """Before anything is stopped: every node's evidence (its ranks' stacks and collective positions),
        and the culprit it names (`workflows.culprit`). The full stacks go to the store with the run."""
        wid = workflow.info().workflow_id
        # Nodes whose watch judged the hang too brought their evidence with the event: only the others are asked.
        evidence: list[RankEvidence] = [e for n in self._status.nodes for e in self._event_evidence.get(n, [])]
        calls = [(n, CollectEvidenceInput(workflow_id=wid, attempt=attempt, node=n, bucket=spec.checkpoint.bucket,
                                          run_prefix=self._run_prefix(spec)))
                 for n in self._status.nodes if n not in self._event_evidence]
        summary = f"collect hang evidence on {{node}} (attempt {attempt})"
        if calls and len(calls) <= NODES_PER_GROUP:
            # One group's worth of activities from the run itself: the recovery waits on this, and a child
            # workflow's start and end cost it two more workflow tasks.
            answers = await asyncio.gather(*(workflow.execute_activity(
                "collect_evidence", request, task_queue=node_task_queue(node),
                start_to_close_timeout=EVIDENCE_TIMEOUT, schedule_to_start_timeout=NODE_SCHEDULE_TO_START,
                retry_policy=EVIDENCE_RETRY, result_type=CollectEvidenceResult,
                summary=summary.replace("{node}", node)) for node, request in calls), return_exceptions=True)
            evidence += [item for answer in answers if isinstance(answer, CollectEvidenceResult)
                         for item in answer.ranks]
        elif calls:
            outcomes = await self._fan_out(NodeCallKind.COLLECT_EVIDENCE, calls, summary)
            evidence += [item for o in outcomes if o.result is not None
                         for item in CollectEvidenceResult.model_validate(o.result).ranks]
        culprit = pick_culprit(evidence, incident.rank, incident.node)
        if culprit.rank != incident.rank and culprit.rank is not None:
            incident.detail = (f"rank {culprit.rank} hung ({culprit.rule}); the watch first saw rank "
                               f"{incident.rank} silent: {incident.detail}")
        incident.rank, incident.node = culprit.rank, culprit.node
        incident.evidence = culprit.evidence
        if any(item.stacks_key for item in evidence):
            incident.evidence_key = f"s3://{spec.checkpoint.bucket}/{self._run_prefix(spec)}/incidents/{attempt}/"
        incident.attribution_s = round(max(0.0, workflow.now().timestamp() - incident.detected_at), 3)
        injected = [at for (fault, node), at in self._injected_at.items()
                    if node == culprit.node and fault.startswith("hang")]
        if injected:
            incident.detection_s = round(max(0.0, incident.detected_at - max(injected)), 3)

    def _record_incident(self, incident: Incident) -> None:
        if incident not in self._status.incidents:
            self._status.incidents = [*self._status.incidents, incident]
            workflow.set_current_details(run_details(self._status, self._spares))
            for older in self._status.incidents[:-INCIDENT_TAILS_KEPT]:
                older.log_tail = ""
            meter = workflow.metric_meter()  # replay-safe: nothing is emitted while replaying
            labels = {"kind": incident.kind.value, "action": incident.action.value}
            meter.create_counter("trainguard_incidents", "Incidents by kind and action").add(1, labels)
            if incident.detection_s is not None:
                meter.create_histogram_float("trainguard_detection_seconds", "Fault to detection", "s").record(
                    incident.detection_s, {"kind": incident.kind.value})

    async def _stop_everywhere(self, nodes: list[str], attempt: int | None, why: str,
                               reason: StopReason = StopReason.INCIDENT) -> list[str]:
        """Stop the ranks on these nodes; returns the nodes whose agent could not be reached. `why` is the
        summary's, for people; `reason` is the input's, for the report."""
        wid = workflow.info().workflow_id
        outcomes = await self._fan_out(NodeCallKind.STOP, [
            (n, StopRanksInput(workflow_id=wid, node=n, attempt=attempt, reason=reason)) for n in nodes],
            f"stop ranks on {{node}}: {why}")
        for outcome in outcomes:
            if outcome.result is None:
                # An unreachable node is fenced instead: its agent kills older attempts before any launch.
                workflow.logger.warning("could not stop ranks on %s: %s", outcome.node, outcome.error)
        return [o.node for o in outcomes if o.result is None]

    # -------------------------------------------------------------------------------------- result
    def _result(self, spec: RunSpec, attempts: int, started: float, events: list[WatchEvent]) -> RunResult:
        wall = max(1e-9, workflow.now().timestamp() - started)
        steps = min((e.step for e in events), default=0)
        first = events[0] if events else None
        mean = first.mean_step_s if first else None
        goodput = min(1.0, steps * mean / wall) if mean else 0.0
        self._status.step = max(self._status.step, steps)
        self._set_phase(Phase.COMPLETED)
        workflow.metric_meter().create_gauge_float("trainguard_goodput", "Useful training time / wall time of "
                                                   "the latest completed run").set(goodput)
        return RunResult(
            workflow_id=workflow.info().workflow_id,
            steps_completed=steps,
            attempts=attempts,
            incidents=self._status.incidents,
            final_checkpoint=self._status.latest_checkpoint,
            final_state_digest=first.state_digest if first else None,
            goodput=round(goodput, 4),
            wall_s=round(wall, 3),
            mean_step_s=mean,
        )

