"""`TrainingRun` on the time-skipping test server, with stand-ins for every activity.

Controller stand-ins poll the test's own task queue (the workflow's); node stand-ins poll one
`trainguard-node-<id>` queue per node, as real node agents do. Every call is recorded so the tests can
assert on what the workflow asked the nodes and the store to do.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from types import SimpleNamespace
from uuid import uuid4

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.checkpoint_layout import reshardable_of
from activities.models import (
    AttemptDecision,
    CheckNodeInput,
    CheckNodeResult,
    CollectEvidenceInput,
    CollectEvidenceResult,
    CommitCheckpointInput,
    CommitCheckpointsInput,
    CommitCheckpointsResult,
    CommittedCheckpoint,
    DownloadShardsInput,
    DownloadShardsResult,
    FindCheckpointInput,
    FindCheckpointResult,
    FindNodeAgentsInput,
    FindNodeAgentsResult,
    GpuHealth,
    InjectFaultInput,
    InjectFaultResult,
    LaunchRanksInput,
    LaunchRanksResult,
    Manifest,
    NodeCheckpointRecord,
    PruneCheckpointsInput,
    PublishAttemptInput,
    RankEvidence,
    RejoinRanksInput,
    RejoinRanksResult,
    RequestCheckpointInput,
    RequestCheckpointResult,
    ShardInfo,
    StopRanksInput,
    StopRanksResult,
    UploadShardsInput,
    WatchEvent,
    WatchEventKind,
    WatchRanksInput,
)
from activities.pace_models import PaceVerdict
from activities.parking_models import ParkRanksInput, ParkRanksResult
from activities.scheduler import NotifySchedulerInput, NotifySchedulerResult
from trainguard import node_task_queue
from trainguard.models import (AcquireNodesRequest, AcquireNodesResult, AgentsBackInput, AgentsBackResult, NodeRequest,
                               PoolNode)
from trainguard.models import (
    Action,
    ChaosRequest,
    DrainRequest,
    StopReason,
    CheckpointRef,
    Incident,
    IncidentKind,
    OperatorRequest,
    OperatorResult,
    Phase,
    RunResult,
    RunStatus,
)
from workflows.pool_rules import grant, release
from workflows import node_group
from workflows.node_calls import NodeCalls
from workflows.node_group import NodeGroupWatch
from workflows.run_nodes import DIRECT_NODE_CALLS
from workflows.node_group_models import GroupReport, NodeGroupWatchResult
from workflows.run_state import HangAttribution, Live
from workflows.run_watch import Watches
from workflows.training_run import TrainingRun

RUN_TIMEOUT_S = 20.0
"""Real seconds a single run may take before the test gives up (they take well under one)."""

BLOCK = "block"
"""A watch script entry: the watch runs until the workflow cancels it (a rank that is still training)."""


@dataclass(frozen=True)
class Until:
    """A watch script entry: hold the watch until `condition()` holds, then go on with the next entry."""

    condition: Callable[[], bool]


WatchScriptEntry = WatchEvent | Until | str | Exception


def _node_ids(count: int) -> list[str]:
    prefix = f"n{uuid4().hex[:6]}"
    return [f"{prefix}-{i}" for i in range(count)]


def _spec(nodes: list[str], **changes: Any) -> dict[str, Any]:
    return {"entrypoint": ["python", "train.py"], "nodes": nodes, "checkpoint": {"every_steps": 10},
            **changes}


def _event(kind: WatchEventKind, step: int = -1, **fields: Any) -> WatchEvent:
    """An event as a node agent reports it; the stand-in watch fills in the node."""
    return WatchEvent(kind=kind, node="", step=step, **fields)


def _finished(step: int, digest: str = "d1g3st") -> WatchEvent:
    return _event(WatchEventKind.FINISHED, step, state_digest=digest, mean_step_s=0.1)


def _ready(*steps: int) -> WatchEvent:
    return _event(WatchEventKind.CHECKPOINT_READY, max(steps), checkpoint_steps=list(steps))


def _exited(code: int, rank: int = 0) -> WatchEvent:
    return _event(WatchEventKind.RANK_EXITED, rank=rank, exit_code=code,
                  detail=f"rank {rank} exit code {code}")


@dataclass
class Cluster:
    """The stand-ins' world: what they answer, and every call they received."""

    nodes: list[str]
    spares: list[str] = field(default_factory=list)
    watch_script: dict[tuple[int, str], list[WatchScriptEntry]] = field(default_factory=dict)
    """What each (attempt, node) watch does in turn: return an event, wait (Until), BLOCK, or raise; FINISHED
    at step 20 once a script runs out."""
    corrupt_steps: set[int] = field(default_factory=set)
    """Checkpoint steps whose shards fail their checksum at download."""
    corrupt_on: set[str] = field(default_factory=set)
    """...on these nodes only (empty: on every node)."""
    refuse_launch: dict[str, str] = field(default_factory=dict)
    """Node -> the non-retryable error type its agent refuses a launch with (its own allow-list, say)."""
    missing: list[str] = field(default_factory=list)
    """Nodes `find_node_agents` reports without an agent."""
    unhealthy: dict[str, str] = field(default_factory=dict)
    """Node -> GPU problem `check_node` reports."""
    unreachable: set[str] = field(default_factory=set)
    """Nodes whose agent is gone once their first attempt's ranks fail: they never answer `stop_ranks`, nor
    take up a relaunch (as a dead agent never starts either)."""
    dead: set[str] = field(default_factory=set)
    """Nodes whose agent died with their ranks: once a crash is reported, they never answer a node check (as a
    dead agent never starts one: Temporal times it out)."""
    store_down: bool = False
    """`find_checkpoint` fails as it does once its retries against an unreachable store run out."""
    returned: set[str] = field(default_factory=set)
    """Nodes the pool has back (repaired) when a shrunk run asks to reclaim them."""
    node_workers: dict[str, Worker] = field(default_factory=dict)
    """Each node's worker, as its agent: an `unreachable` node's stops polling at the relaunch."""
    ranks_per_node: int = 1
    stamp_detection: bool = False
    """Events the script gives no `detected_at` get the moment they are returned, as an agent stamps them."""
    sharded: bool = False
    """The ranks' shards are `torch.save`s of DTensors: their checkpoints cannot be resharded."""
    survivor_step: int = 17
    """Where the live ranks stand when an in-process restart reaches them (they live on the first node)."""
    rejoin_fails: set[str] = field(default_factory=set)
    """Nodes whose `rejoin_ranks` fails (their agent no longer runs the attempt)."""
    manifests: list[Manifest] = field(default_factory=list)
    records: dict[int, dict[str, NodeCheckpointRecord]] = field(default_factory=dict)
    """The store's node records: step -> node -> what its watch uploaded."""
    committed_refs: dict[int, CommittedCheckpoint] = field(default_factory=dict)
    calls: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    while_running: Callable[[WorkflowHandle[Any, Any]], Awaitable[None]] | None = None
    """Called once, from the first watch, while the ranks train: to query or update the run."""
    client: Any = None
    """The test's client (set by `_run`), for `while_running`."""
    evidence: dict[str, list[RankEvidence]] = field(default_factory=dict)
    """Node -> what its ranks show when `collect_evidence` asks (a hang)."""
    pool: dict[str, PoolNode] | None = None
    """The node pool's state, leased by its real rules (`workflows.pool_rules.grant`); None: every lease is
    granted as asked."""
    away_polls: dict[str, int] = field(default_factory=dict)
    """Node -> how many more `find_agents_back` asks find its restarting agent still away."""
    committer_patience_s: float | None = None
    """A committer pass with nothing to commit returns after this many real seconds at most (an abandoned one
    still running holds the test server's time skipping back)."""
    store_out: str | None = None
    """While set, the committer cannot reach the store: it polls to its deadline and returns this error."""
    slow_windows: list[PaceVerdict] = field(default_factory=list)
    """Windows of training the nodes' pace records show slow, in order: a committer returns the first that ends
    after the run's `pace_after`, as the real one compares them (`activities.pace`)."""
    parks: bool = False
    """The ranks call `standby()`: a starter's STARTED event says so (`WatchEvent.standby`)."""
    hold: dict[str, asyncio.Event] = field(default_factory=dict)
    """Activity name -> an event its next call waits for (heartbeating) before it answers: an update's handler
    held in flight."""

    async def _held(self, name: str) -> None:
        gate = self.hold.pop(name, None)
        while gate is not None and not gate.is_set():
            activity.heartbeat()
            await asyncio.sleep(0.01)

    def inputs(self, name: str) -> list[Any]:
        return self.calls[name]

    def newer_attempt(self, node: str, attempt: int) -> tuple[int, bool] | None:
        """As an agent's watch that follows decisions: a newer attempt launched on `node` by an activity of its
        own (the master: it reports its start), or one the run published, which the watch launches itself."""
        launched = max((r.attempt for r in self.calls["launch_ranks"] if r.node == node), default=attempt)
        if launched > attempt:
            return launched, True
        published: list[AttemptDecision] = [p.decision for p in self.calls["publish_attempt"]]
        if published and published[-1].attempt > attempt and node not in published[-1].leaving and (
                node not in published[-1].launched):
            return published[-1].attempt, False
        return None

    # ------------------------------------------------------------------------------ controller side
    def controller_activities(self) -> list[Any]:
        @activity.defn(name="find_node_agents")
        async def find_node_agents(request: FindNodeAgentsInput) -> FindNodeAgentsResult:
            self.calls["find_node_agents"].append(request)
            return FindNodeAgentsResult(missing=[n for n in request.nodes if n in self.missing])

        @activity.defn(name="find_checkpoint")
        async def find_checkpoint(request: FindCheckpointInput) -> FindCheckpointResult:
            self.calls["find_checkpoint"].append(request)
            if self.store_down:
                raise ApplicationError("Could not connect to the endpoint URL", type="EndpointConnectionError",
                                       non_retryable=True)
            smallest = min(request.world_size, request.min_world_size or request.world_size)
            largest = max(request.world_size, request.max_world_size or 0)
            usable = [m for m in self.manifests
                      if m.step not in request.exclude_steps and smallest <= m.world_size <= largest
                      and (m.reshardable or m.world_size == request.world_size)]
            if not usable:
                return FindCheckpointResult()
            newest = max(usable, key=lambda m: m.step)
            return FindCheckpointResult(manifest=newest,
                                        manifest_key=_manifest_key(request.run_prefix, newest.step),
                                        manifest_sha256=_manifest_sha256(newest.step))

        @activity.defn(name="commit_checkpoints")
        async def commit_checkpoints(request: CommitCheckpointsInput) -> CommitCheckpointsResult:
            """As the real committer: commit each step whose node records cover the world, prune, return."""
            self.calls["commit_checkpoints"].append(request)
            patience = request.max_duration_s if self.committer_patience_s is None else min(
                request.max_duration_s, self.committer_patience_s)
            deadline = time.monotonic() + (0.05 if request.quiet_s is not None else patience)
            # A finished run's last pass waits through the store's errors (to its bound), as the real one.
            out_deadline = time.monotonic() + patience if request.wait_for_store else deadline
            while True:
                if self.store_out is not None:
                    if time.monotonic() >= out_deadline:
                        return CommitCheckpointsResult(store_error=self.store_out)
                    activity.heartbeat()
                    await asyncio.sleep(0.01)
                    continue
                # As the real committer, a pass finds a step an abandoned pass committed again (its commit is
                # idempotent): a run that gave up on that pass still hears of it.
                commits = [c for step in sorted(self.records) if step > request.after_step
                           and (c := self.committed_refs.get(step) or self._commit(request, step)) is not None]
                slow = next((w for w in self.slow_windows if w.window_end > request.pace_after), None)
                slow = slow if request.pace_window_s else None
                if commits:
                    self.calls["prune_checkpoints"].append(PruneCheckpointsInput(
                        bucket=request.bucket, run_prefix=request.run_prefix, keep_last=request.keep_last,
                        protect_steps=[max(c.ref.step for c in commits)]))
                if commits or slow is not None:
                    return CommitCheckpointsResult(commits=commits, pace=slow)
                if time.monotonic() >= deadline:
                    return CommitCheckpointsResult()
                activity.heartbeat()
                await asyncio.sleep(0.01)

        @activity.defn(name="acquire_nodes")
        async def acquire_nodes(request: AcquireNodesRequest) -> AcquireNodesResult:
            self.calls["acquire_nodes"].append(request)
            if self.pool is not None:
                return grant(self.pool, request)
            if not request.nodes:  # a shrunk run reclaiming the nodes it lost
                return AcquireNodesResult(granted=True, spares=[n for n in request.spares if n in self.returned])
            return AcquireNodesResult(granted=True, spares=request.spares)

        @activity.defn(name="release_nodes")
        async def release_nodes(request: NodeRequest) -> list[str]:
            self.calls["release_nodes"].append(request)
            return release(self.pool, request.run_id or "", request.node) if self.pool is not None else []

        @activity.defn(name="cordon_node")
        async def cordon_node(request: NodeRequest) -> PoolNode:
            self.calls["cordon_node"].append(request)
            return PoolNode(node=request.node or "", cordoned=request.reason)

        @activity.defn(name="notify_scheduler")
        async def notify_scheduler(request: NotifySchedulerInput) -> NotifySchedulerResult:
            self.calls["notify_scheduler"].append(request)
            return NotifySchedulerResult()

        @activity.defn(name="publish_attempt")
        async def publish_attempt(request: PublishAttemptInput) -> None:
            self.calls["publish_attempt"].append(request)

        @activity.defn(name="find_agents_back")
        async def find_agents_back(request: AgentsBackInput) -> AgentsBackResult:
            self.calls["find_agents_back"].append(request)
            away = [n for n in request.nodes if self.away_polls.get(n, 0) > 0]
            for node in away:
                self.away_polls[node] -= 1
            return AgentsBackResult(away=away)

        return [find_node_agents, find_checkpoint, commit_checkpoints,
                acquire_nodes, release_nodes, cordon_node, notify_scheduler, publish_attempt, find_agents_back]

    def _commit(self, request: CommitCheckpointsInput, step: int) -> CommittedCheckpoint | None:
        records = [r for r in self.records[step].values() if request.min_attempt <= r.attempt <= request.attempt]
        shards = sorted((s for r in records for s in r.shards), key=lambda s: s.rank)
        if [s.rank for s in shards] != list(range(request.world_size)):
            return None
        self.calls["commit_checkpoint"].append(CommitCheckpointInput(
            bucket=request.bucket, run_prefix=request.run_prefix, workflow_id=request.workflow_id,
            attempt=request.attempt, step=step, world_size=request.world_size, shards=shards))
        self.manifests.append(Manifest(workflow_id=request.workflow_id, step=step, world_size=request.world_size,
                                       attempt=request.attempt, shards=shards, reshardable=reshardable_of(shards)))
        self.committed_refs[step] = CommittedCheckpoint(
            ref=CheckpointRef(step=step, manifest_key=_manifest_key(request.run_prefix, step), bucket=request.bucket,
                              world_size=request.world_size, total_bytes=sum(s.size_bytes for s in shards),
                              reshardable=reshardable_of(shards)),
            step=step)
        return self.committed_refs[step]

    def _upload_in_watch(self, request: WatchRanksInput, ready: WatchEvent, attempt: int) -> None:
        """What an agent's watch does with a complete local step: upload its shards, write its node record."""
        assert request.checkpoints is not None
        request = request.model_copy(update={"attempt": attempt})
        [group] = [r for r in [*self.calls["launch_ranks"], *self.calls["rejoin_ranks"]]
                   if (r.node, r.attempt) == (request.node, request.attempt)]
        first = group.node_rank * self.ranks_per_node
        for step in ready.checkpoint_steps:
            self.calls["upload_shards"].append(UploadShardsInput(
                workflow_id=request.workflow_id, attempt=request.attempt, node=request.node,
                bucket=request.checkpoints.bucket, run_prefix=request.checkpoints.run_prefix, step=step))
            shards = [ShardInfo(rank=r, key=f"{request.checkpoints.run_prefix}/step-{step:08d}/rank-{r:05d}.pt",
                                size_bytes=100, sha256=f"{r:064x}", node=request.node, sharded=self.sharded)
                      for r in range(first, first + self.ranks_per_node)]
            self.records.setdefault(step, {})[request.node] = NodeCheckpointRecord(
                node=request.node, attempt=request.attempt, step=step, shards=shards,
                rank_compute_s=ready.rank_compute_s)

    # ------------------------------------------------------------------------------------ node side
    def node_activities(self) -> list[Any]:
        @activity.defn(name="check_node")
        async def check_node(request: CheckNodeInput) -> CheckNodeResult:
            self.calls["check_node"].append(request)
            if request.node in self.dead and any(c.kind is WatchEventKind.RANK_EXITED for c in self.calls["events"]):
                await asyncio.Event().wait()  # no answer: the check's own timeout ends it
            problem = self.unhealthy.get(request.node)
            gpu = GpuHealth(available=True, healthy=problem is None, detail=problem or "1 GPUs healthy",
                            num_gpus=1)
            return CheckNodeResult(node=request.node, host=f"{request.node}.cluster", gpu=gpu)

        @activity.defn(name="download_shards")
        async def download_shards(request: DownloadShardsInput) -> DownloadShardsResult:
            self.calls["download_shards"].append(request)
            if any(f"/step-{step:08d}/" in (request.manifest_key or "") for step in self.corrupt_steps) and (
                    not self.corrupt_on or request.node in self.corrupt_on):
                raise ApplicationError("shard rank 0: sha256 mismatch", type="CorruptCheckpoint",
                                       non_retryable=True)
            return DownloadShardsResult(restore_dir=f"/restore/{request.node}/attempt-{request.attempt}",
                                        num_bytes=sum(s.size_bytes for s in request.shards))

        @activity.defn(name="launch_ranks")
        async def launch_ranks(request: LaunchRanksInput) -> LaunchRanksResult:
            self.calls["launch_ranks"].append(request)
            if request.attempt > 1:  # the unreachable agents are gone: nothing polls their queues any more
                for gone in self.unreachable:
                    if gone in self.node_workers:
                        await self.node_workers.pop(gone).shutdown()
            if request.node in self.unreachable and request.attempt > 1:
                raise ApplicationError(f"no agent on {request.node}", type="Unreachable", non_retryable=True)
            if request.node in self.refuse_launch:
                raise ApplicationError(f"entrypoint not allowed on {request.node}",
                                       type=self.refuse_launch[request.node], non_retryable=True)
            return LaunchRanksResult(node=request.node,
                                     master_addr=request.master_addr or f"{request.node}.cluster",
                                     master_port=request.master_port or 29500 + request.attempt,
                                     pids=[1000 + i for i in range(request.ranks_per_node)])

        @activity.defn(name="rejoin_ranks")
        async def rejoin_ranks(request: RejoinRanksInput) -> RejoinRanksResult:
            self.calls["rejoin_ranks"].append(request)
            if request.node in self.rejoin_fails:
                raise ApplicationError(f"{request.node} does not run attempt {request.from_attempt}",
                                       type="NoSuchAttempt", non_retryable=True)
            ranks = list(range(request.node_rank * self.ranks_per_node, (request.node_rank + 1) * self.ranks_per_node))
            live = request.node_rank == 0
            return RejoinRanksResult(node=request.node, master_addr=request.master_addr or f"{request.node}.cluster",
                                     master_port=request.master_port or 29600 + request.attempt,
                                     survivors=ranks if live else [], joiners=[] if live else ranks,
                                     step=self.survivor_step if live else None)

        @activity.defn(name="watch_ranks")
        async def watch_ranks(request: WatchRanksInput) -> WatchEvent:
            self.calls["watch_ranks"].append(request)
            self.calls["watch_groups"].append(activity.info().workflow_id)
            if request.launch is not None:  # as the agent: a relaunch's first watch downloads and launches
                launch = request.launch
                if request.download is not None:
                    restored = await download_shards(request.download)
                    launch = launch.model_copy(update={"restore_dir": restored.restore_dir})
                await launch_ranks(launch)
            if self.while_running is not None:
                while_running, self.while_running = self.while_running, None
                await while_running(self.client.get_workflow_handle(request.workflow_id))
            attempt, report_start = request.attempt, request.report_start
            follow = request.follow_decisions
            if follow:  # a watch started again after taking up a newer attempt watches that one
                attempt = max([attempt, *(r.attempt for r in self.calls["launch_ranks"] if r.node == request.node)])
            script = self.watch_script.setdefault((attempt, request.node), [])
            if follow and request.after_attempt is not None and attempt <= request.after_attempt:
                script.insert(0, BLOCK)  # reported already: it waits to take up the next attempt
            began, started = time.monotonic(), activity.info().started_time.timestamp()

            def now() -> float:
                """The server's clock (the time-skipping server's runs ahead of this one once it has skipped)."""
                return started + time.monotonic() - began

            while True:
                step = script.pop(0) if script else _finished(20)
                if isinstance(step, Until):
                    while not step.condition():
                        activity.heartbeat()
                        await asyncio.sleep(0.01)
                    step = script.pop(0)
                if isinstance(step, Exception):
                    raise step
                if step == BLOCK:
                    while True:  # heartbeats keep it alive; the workflow's cancel (or worker shutdown) ends it
                        activity.heartbeat()
                        newer = self.newer_attempt(request.node, attempt) if follow else None
                        if newer is not None:
                            break
                        await asyncio.sleep(0.05)
                    attempt, report_start = newer
                    if not report_start:  # taken up in place: launched here at the node's rank
                        decision = self.calls["publish_attempt"][-1].decision
                        before = [r for r in self.calls["launch_ranks"] if r.node == request.node][-1]
                        await launch_ranks(decision.launch.model_copy(update={"node": request.node,
                                                                              "node_rank": before.node_rank}))
                    script = self.watch_script.setdefault((attempt, request.node), [])
                    continue
                assert isinstance(step, WatchEvent)
                trained = step.kind in (WatchEventKind.CHECKPOINT_READY, WatchEventKind.KEEPALIVE)
                if trained and report_start:
                    script.insert(0, step)  # the node trained: its first step comes first
                    return _event(WatchEventKind.STARTED, first_step_at=now(), standby=self.parks).model_copy(
                        update={"node": request.node, "attempt": attempt if follow else None})
                if step.kind is WatchEventKind.CHECKPOINT_READY and request.checkpoints is not None:
                    self._upload_in_watch(request, step, attempt)
                    continue
                stamp = {"detected_at": now()} if self.stamp_detection and not step.detected_at else {}
                self.calls["events"].append(step)
                return step.model_copy(update={"node": request.node, **stamp,
                                               **({"attempt": attempt} if follow else {})})

        @activity.defn(name="inject_fault")
        async def inject_fault(request: InjectFaultInput) -> InjectFaultResult:
            self.calls["inject_fault"].append(request)
            await self._held("inject_fault")
            return InjectFaultResult(node=request.node, rank=request.rank or 0, pid=1000, injected_at=123.0)

        @activity.defn(name="stop_ranks")
        async def stop_ranks(request: StopRanksInput) -> StopRanksResult:
            self.calls["stop_ranks"].append(request)
            if request.node in self.unreachable:
                raise ApplicationError(f"no agent on {request.node}", type="Unreachable", non_retryable=True)
            return StopRanksResult(stopped=self.ranks_per_node)

        @activity.defn(name="collect_evidence")
        async def collect_evidence(request: CollectEvidenceInput) -> CollectEvidenceResult:
            self.calls["collect_evidence"].append(request)
            self.calls["stops_before_evidence"].append(len(self.calls["stop_ranks"]))
            ranks = [e.model_copy(update={"stacks_key": f"{request.run_prefix}/incidents/{request.attempt}/rank-{e.rank:05d}.txt"})
                     for e in self.evidence.get(request.node, [])]
            return CollectEvidenceResult(node=request.node, ranks=ranks)

        @activity.defn(name="request_checkpoint")
        async def request_checkpoint(request: RequestCheckpointInput) -> RequestCheckpointResult:
            self.calls["request_checkpoint"].append(request)
            await self._held("request_checkpoint")
            return RequestCheckpointResult(node=request.node, step=25, step_time_s=0.5)

        @activity.defn(name="park_ranks")
        async def park_ranks(request: ParkRanksInput) -> ParkRanksResult:
            assert request.node == activity.info().task_queue.removeprefix("trainguard-node-")
            self.calls["park_ranks"].append(request)
            return ParkRanksResult(parked=request.launch.ranks_per_node)

        return [check_node, download_shards, launch_ranks, rejoin_ranks, watch_ranks, inject_fault,
                stop_ranks, collect_evidence, request_checkpoint, park_ranks]


def _manifest_sha256(step: int) -> str:
    """The digest the stand-in controller found the manifest of `step` to have."""
    return f"{step:064x}"


def _manifest_key(run_prefix: str, step: int) -> str:
    return f"{run_prefix}/step-{step:08d}/manifest.json"


@asynccontextmanager
async def _workers(client: Client, cluster: Cluster, task_queue: str) -> AsyncIterator[None]:
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(Worker(client, task_queue=task_queue,
                                               workflows=[TrainingRun, NodeCalls, NodeGroupWatch],
                                               activities=cluster.controller_activities()))
        node_activities = cluster.node_activities()
        for node in [*cluster.nodes, *cluster.spares]:
            cluster.node_workers[node] = await stack.enter_async_context(
                Worker(client, task_queue=node_task_queue(node), activities=node_activities))
        yield


@dataclass
class Finished:
    handle: WorkflowHandle[Any, Any]
    outcome: RunResult | WorkflowFailureError
    status: RunStatus
    """The `status` query's answer once the run ended (asked while the workers still run: a closed
    workflow's query is answered by replaying it on a worker)."""


Operator = Callable[[WorkflowHandle[Any, Any]], Awaitable[None]]
"""What a test does to a started run from outside (pause, resume, abort) while the test waits for it."""


async def _run(env: WorkflowEnvironment, cluster: Cluster, spec: Any,
               operator: Operator | None = None, client: Client | None = None) -> Finished:
    """Start a run on a fresh task queue and wait for it to end, successfully or not. `client`: another
    client of the same server to run the workers and the run with (with interceptors, say)."""
    task_queue = f"tq-{uuid4()}"
    client = client or env.client
    cluster.client = client
    async with _workers(client, cluster, task_queue):
        handle = await client.start_workflow(TrainingRun.run, spec, id=f"run-{uuid4()}",
                                                 task_queue=task_queue, result_type=RunResult)
        if operator is not None:
            await asyncio.wait_for(operator(handle), RUN_TIMEOUT_S)
        outcome: RunResult | WorkflowFailureError
        try:
            outcome = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
        except WorkflowFailureError as error:
            outcome = error
        status = await handle.query(TrainingRun.status)
    return Finished(handle, outcome, status)


async def _wait_for_phase(handle: WorkflowHandle[Any, Any], phase: Phase) -> RunStatus:
    while (status := await handle.query(TrainingRun.status)).phase is not phase:
        await asyncio.sleep(0.02)
    return status


def _failure_message(outcome: RunResult | WorkflowFailureError) -> str:
    assert isinstance(outcome, WorkflowFailureError), f"expected the run to fail, it returned {outcome!r}"
    assert isinstance(outcome.cause, ApplicationError)
    return outcome.cause.message


def _by_attempt(requests: Sequence[Any], attempt: int) -> list[Any]:
    return [r for r in requests if r.attempt == attempt]


# -------------------------------------------------------------------------------------------- tests


async def test_happy_path_commits_a_checkpoint_and_completes(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    seen: list[RunStatus] = []

    async def query_status(handle: WorkflowHandle[Any, Any]) -> None:
        seen.append(await handle.query(TrainingRun.status))

    cluster = Cluster(nodes=nodes, while_running=query_status, watch_script={
        (1, nodes[0]): [_ready(10), _finished(30, digest="abc123")],
        (1, nodes[1]): [_ready(10), _event(WatchEventKind.KEEPALIVE, 12), _finished(30, digest="abc123")],
    })

    run = await _run(env, cluster, _spec(nodes))

    result = run.outcome
    assert isinstance(result, RunResult)
    assert result.workflow_id == run.handle.id
    assert result.steps_completed == 30
    assert result.attempts == 1
    assert result.incidents == []
    assert result.final_state_digest == "abc123"
    assert result.mean_step_s == pytest.approx(0.1)
    assert result.final_checkpoint is not None
    assert result.final_checkpoint.step == 10
    assert result.final_checkpoint.world_size == 2
    assert result.final_checkpoint.manifest_key == f"runs/{run.handle.id}/step-00000010/manifest.json"
    # Reserving checks every node's agent; a fresh run restores nothing.
    assert cluster.inputs("find_node_agents")[0].nodes == nodes
    assert sorted(c.node for c in cluster.inputs("check_node")) == sorted(nodes)
    assert cluster.inputs("download_shards") == []
    # The master node launches first and the other joins its rendezvous.
    launches = sorted(cluster.inputs("launch_ranks"), key=lambda r: r.node_rank)
    assert [(r.node, r.node_rank, r.attempt, r.restore_step) for r in launches] == [
        (nodes[0], 0, 1, 0), (nodes[1], 1, 1, 0)]
    assert launches[0].master_addr is None
    assert (launches[1].master_addr, launches[1].master_port) == (f"{nodes[0]}.cluster", 29501)
    assert all(r.checkpoint_every == 10 and r.entrypoint == ["python", "train.py"] for r in launches)
    # Both nodes' shards of step 10 were uploaded, then committed once as one checkpoint.
    uploads = sorted((u.node, u.step) for u in cluster.inputs("upload_shards"))
    assert uploads == [(nodes[0], 10), (nodes[1], 10)]
    [commit] = cluster.inputs("commit_checkpoint")
    assert (commit.step, commit.world_size, sorted(s.rank for s in commit.shards)) == (10, 2, [0, 1])
    # Each pass that commits prunes, and an abandoned pass may find the commit too: pruning is idempotent.
    prunes = [p.protect_steps for p in cluster.inputs("prune_checkpoints")]
    assert prunes and all(protected == [10] for protected in prunes)
    # A watch uploads its node's checkpoints itself: only the first step (the master's, once), a keepalive and
    # the end return it; nothing stopped.
    assert sorted((w.node, w.report_start) for w in cluster.inputs("watch_ranks")) == [
        (nodes[0], False), (nodes[0], True), (nodes[1], False), (nodes[1], False)]
    assert all(w.checkpoints is not None and w.checkpoints.run_prefix == f"runs/{run.handle.id}"
               for w in cluster.inputs("watch_ranks"))
    assert cluster.inputs("stop_ranks") == []
    # Queried while the ranks ran, and once done.
    [status] = seen
    assert (status.phase, status.attempt, status.nodes, status.world_size) == (Phase.RUNNING, 1, nodes, 2)
    assert run.status.phase is Phase.COMPLETED
    assert run.status.latest_checkpoint == result.final_checkpoint


async def test_a_hang_is_blamed_on_the_rank_its_evidence_names_asked_before_any_rank_is_stopped(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    # node-0's rank is the one the watch saw silent first; node-1's rank is outside the collective node-0's
    # rank waits in: the culprit.
    hang = _event(WatchEventKind.HANG, rank=0, detail="rank 0 made no progress for 2.0s").model_copy(
        update={"detected_at": 1_000.0, "fault_at": 998.0})
    cluster = Cluster(nodes=nodes, evidence={
        nodes[0]: [RankEvidence(node=nodes[0], rank=0, state="S", answered=True, collectives_enqueued=21,
                                collectives_completed=20, in_collective=True, collective="gloo:all_reduce",
                                innermost="graph.py:979 in _engine_run_backward < train.py:143 in main")],
        nodes[1]: [RankEvidence(node=nodes[1], rank=1, state="S", answered=True, collectives_enqueued=20,
                                collectives_completed=20, in_collective=False,
                                innermost="loader.py:12 in next_batch < train.py:120 in main")]})
    cluster.watch_script = {(1, nodes[0]): [_ready(10), hang], (1, nodes[1]): [_ready(10), BLOCK],
                            (2, nodes[0]): [_finished(25)], (2, nodes[1]): [_finished(25)]}

    run = await _run(env, cluster, _spec(nodes))

    assert isinstance(run.outcome, RunResult)
    [incident] = run.outcome.incidents
    assert (incident.kind, incident.node, incident.rank) == (IncidentKind.HANG, nodes[1], 1)
    assert incident.evidence.splitlines() == [
        "rank 1 is not inside a collective (entered 20) while its peers are, at loader.py:12 in next_batch < "
        "train.py:120 in main",
        "1 of 1 peers wait inside gloo:all_reduce #21 (rank 0: graph.py:979 in _engine_run_backward < "
        "train.py:143 in main)"]
    assert "the watch first saw rank 0 silent" in incident.detail
    assert incident.evidence_key == f"s3://trainguard/runs/{run.handle.id}/incidents/1/"
    assert incident.attribution_s is not None
    assert sorted(c.node for c in cluster.inputs("collect_evidence")) == nodes
    # Evidence first, from the attempt that hung; its ranks were stopped only after.
    assert all(c.attempt == 1 for c in cluster.inputs("collect_evidence"))
    assert cluster.inputs("stops_before_evidence") == [0, 0]
    assert _by_attempt(cluster.inputs("watch_ranks"), 1)[0].evidence


async def test_crash_relaunches_every_rank_from_the_committed_checkpoint_without_a_stop(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    crash = _exited(-9).model_copy(update={"detected_at": 1_000.0, "fault_at": 999.75})
    cluster = Cluster(nodes=nodes)
    both_uploaded = Until(lambda: len(cluster.inputs("upload_shards")) == 2)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), both_uploaded, crash],
        (1, nodes[1]): [_ready(10), BLOCK],
        (2, nodes[0]): [_finished(25).model_copy(update={"first_step_at": 1_006.5})],
        (2, nodes[1]): [_finished(25)],
    }

    run = await _run(env, cluster, _spec(nodes))

    result = run.outcome
    assert isinstance(result, RunResult)
    assert (result.attempts, result.steps_completed) == (2, 25)
    [incident] = result.incidents
    assert (incident.kind, incident.action) == (IncidentKind.CRASH, Action.RESTART)
    assert (incident.node, incident.rank, incident.attempt) == (nodes[0], 0, 1)
    assert incident.resumed_step == 10
    assert (incident.detection_s, incident.recovery_s) == (0.25, 6.5)
    assert "exit code -9" in incident.detail
    # No node was sent a stop: each stays in the run, and its launch of attempt 2 stops attempt 1's ranks
    # first (the agent's fence: tests/unit/test_launch_in_watch.py), one activity per node, not two.
    assert cluster.inputs("stop_ranks") == []
    # Attempt 2 found the committed step 10, downloaded each node's shard and launched from it.
    assert len(cluster.inputs("find_checkpoint")) == 2
    downloads = sorted(_by_attempt(cluster.inputs("download_shards"), 2), key=lambda d: d.node)
    assert [(d.node, d.ranks) for d in downloads] == [(nodes[0], [0]), (nodes[1], [1])]
    assert all(d.manifest_key == f"runs/{run.handle.id}/step-00000010/manifest.json" and not d.shards
               for d in downloads), "each node reads its shards from the manifest: none pass through history"
    assert {d.manifest_sha256 for d in downloads} == {_manifest_sha256(10)}, \
        "...and only the manifest bytes the controller verified (the master's download and the watch's)"
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 2), key=lambda r: r.node_rank)
    assert [(r.node, r.attempt, r.restore_step) for r in relaunches] == [(nodes[0], 2, 10), (nodes[1], 2, 10)]
    assert [r.restore_dir for r in relaunches] == [f"/restore/{n}/attempt-2" for n in nodes]
    assert {w.reported_step for w in _by_attempt(cluster.inputs("watch_ranks"), 2)} == {10}
    assert result.final_checkpoint is not None and result.final_checkpoint.step == 10
    assert run.status.phase is Phase.COMPLETED


async def test_in_process_restart_keeps_live_ranks_and_rejoins_them_with_the_crashed_one(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    crash = _exited(-9, rank=1).model_copy(update={"detected_at": 1_000.0, "fault_at": 999.9})
    cluster = Cluster(nodes=nodes)
    uploaded = Until(lambda: len(cluster.inputs("upload_shards")) == 2)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), uploaded, crash],
        (2, nodes[0]): [_finished(25).model_copy(update={"first_step_at": 1_001.25})],
        (2, nodes[1]): [_finished(25)],
    }

    run = await _run(env, cluster, _spec(nodes, restarts={"in_process": True}))

    result = run.outcome
    assert isinstance(result, RunResult) and result.attempts == 2
    [incident] = result.incidents
    assert (incident.kind, incident.action, incident.node) == (IncidentKind.CRASH, Action.RESTART, nodes[1])
    assert (incident.recovery_path, incident.restore_tier) == ("in-process", "peers")
    assert incident.resumed_step == 17  # where the live ranks stood, past the committed step 10
    assert incident.recovery_s == 1.25
    # No rank was stopped, nothing restored or launched: the nodes were told to rejoin, the master's new
    # group first, then the others pointed at it.
    assert cluster.inputs("stop_ranks") == []
    assert _by_attempt(cluster.inputs("launch_ranks"), 2) == []
    assert cluster.inputs("download_shards") == []  # no checkpoint was read, not even the committed one
    rejoins = cluster.inputs("rejoin_ranks")
    assert [(r.node, r.attempt, r.from_attempt) for r in rejoins] == [(nodes[0], 2, 1), (nodes[1], 2, 1)]
    assert (rejoins[1].master_addr, rejoins[1].master_port) == (f"{nodes[0]}.cluster", 29602)
    # Shards saved after the newest commit are still reported: the live ranks' checkpoints are good.
    assert {w.reported_step for w in _by_attempt(cluster.inputs("watch_ranks"), 2)} == {10}


async def test_failed_in_process_restart_falls_back_to_a_relaunch_from_the_checkpoint(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, rejoin_fails={nodes[1]})
    uploaded = Until(lambda: len(cluster.inputs("upload_shards")) == 2)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), uploaded, _exited(-9, rank=1)],
    }

    run = await _run(env, cluster, _spec(nodes, restarts={"in_process": True}))

    result = run.outcome
    assert isinstance(result, RunResult) and result.attempts == 3
    [incident] = result.incidents  # the failed in-process attempt is part of the crash, not a new incident
    assert incident.recovery_path is not None
    assert incident.recovery_path.startswith("relaunch after failed in-process: ")
    assert "does not run attempt 1" in incident.recovery_path
    assert incident.resumed_step == 10 and incident.restore_tier != "peers"
    # Attempt 2 (in process) was stopped everywhere; attempt 3 relaunched every rank from the checkpoint.
    assert sorted((s.node, s.attempt) for s in cluster.inputs("stop_ranks")) == [(nodes[0], 2), (nodes[1], 2)]
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 3), key=lambda r: r.node_rank)
    assert [(r.node, r.restore_step) for r in relaunches] == [(nodes[0], 10), (nodes[1], 10)]
    assert all(r.rejoin_timeout_s == 60.0 for r in relaunches)


async def test_exit_78_stops_the_run_without_retrying(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, watch_script={(1, nodes[0]): [_exited(78)], (1, nodes[1]): [BLOCK]})

    run = await _run(env, cluster, _spec(nodes))

    message = _failure_message(run.outcome)
    assert "78" in message
    assert "fix the script" in message
    assert {s.node for s in cluster.inputs("stop_ranks")} == set(nodes)
    assert {r.attempt for r in cluster.inputs("launch_ranks")} == {1}
    assert run.status.phase is Phase.FAILED
    assert run.status.reason == message
    assert [(i.kind, i.action) for i in run.status.incidents] == [(IncidentKind.USER_ERROR, Action.STOP)]


async def test_a_rank_that_stopped_itself_gives_the_run_its_reason(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    why = ("trainguard: rank 1 passed checkpoint step 10 (checkpoint.every_steps 10) without run.save(10, ...): "
           "the step can never commit without its shard")
    exited = _event(WatchEventKind.RANK_EXITED, rank=1, exit_code=78, detail=f"rank 1 exited with code 78: {why}",
                    log_path="/logs/rank-00001.log")
    cluster = Cluster(nodes=nodes, watch_script={(1, nodes[0]): [BLOCK], (1, nodes[1]): [exited]})

    run = await _run(env, cluster, _spec(nodes))

    message = _failure_message(run.outcome)
    assert "fix the script" in message and why in message, message  # the rank's own words, not only 78
    assert f"(log: /logs/rank-00001.log on {nodes[1]})" in message
    assert run.status.reason == message


async def test_bad_spec_fails_at_once_naming_the_field(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes)

    run = await _run(env, cluster, _spec(nodes, entrypoint="python train.py"))

    message = _failure_message(run.outcome)
    assert message.startswith("invalid run spec: entrypoint")
    assert isinstance(run.outcome.cause, ApplicationError) and run.outcome.cause.type == "InvalidSpec"
    assert dict(cluster.calls) == {}
    assert run.status.phase is Phase.FAILED


async def test_unknown_node_fails_naming_it(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, missing=[nodes[0]])

    run = await _run(env, cluster, _spec(nodes))

    message = _failure_message(run.outcome)
    assert f"nodes.0 '{nodes[0]}'" in message
    assert node_task_queue(nodes[0]) in message
    assert nodes[1] not in message
    assert cluster.inputs("launch_ranks") == []
    assert cluster.inputs("stop_ranks") == []


async def test_unhealthy_gpu_is_replaced_by_a_spare_before_launch(env: WorkflowEnvironment) -> None:
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares, unhealthy={nodes[1]: "GPU 0: 3 uncorrectable ECC errors"})

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares))

    result = run.outcome
    assert isinstance(result, RunResult)
    [incident] = result.incidents
    assert (incident.kind, incident.node, incident.action) == (IncidentKind.GPU_UNHEALTHY, nodes[1],
                                                               Action.REPLACE_NODE)
    launches = sorted((r.node_rank, r.node) for r in cluster.inputs("launch_ranks"))
    assert launches == [(0, nodes[0]), (1, spares[0])]
    assert (run.status.nodes, run.status.cordoned) == ([nodes[0], spares[0]], [nodes[1]])


async def test_unhealthy_gpu_without_a_spare_fails_before_launch(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, unhealthy={nodes[0]: "GPU 0: row remap failed"})

    run = await _run(env, cluster, _spec(nodes))

    message = _failure_message(run.outcome)
    assert f"node {nodes[0]} failed its GPU checks and no spare is left: GPU 0: row remap failed" in message
    assert cluster.inputs("launch_ranks") == []


@pytest.mark.parametrize(
    ("fault", "kind", "detail", "stopped"),
    [
        pytest.param(ApplicationError("agent lost its ranks", type="AgentLost"),
                     IncidentKind.NODE_UNRESPONSIVE, "agent lost its ranks", [],
                     id="agent-lost-not-asked-to-stop"),
        pytest.param(_event(WatchEventKind.GPU_UNHEALTHY, detail="GPU 0: XID 79 (fallen off the bus)"),
                     IncidentKind.GPU_UNHEALTHY, "XID 79", [1], id="gpu-fails-while-training"),
    ],
)
async def test_node_fault_while_training_is_replaced_by_a_spare(env: WorkflowEnvironment, fault: Any,
                                                                kind: IncidentKind, detail: str,
                                                                stopped: list[int]) -> None:
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares,
                      watch_script={(1, nodes[0]): [BLOCK], (1, nodes[1]): [fault]})

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares))

    result = run.outcome
    assert isinstance(result, RunResult)
    [incident] = result.incidents
    assert (incident.kind, incident.node, incident.action) == (kind, nodes[1], Action.REPLACE_NODE)
    assert detail in incident.detail
    assert f"replaced by spare {spares[0]}" in incident.detail
    stops = sorted((s.node, s.attempt) for s in cluster.inputs("stop_ranks"))
    assert stops == [(nodes[i], 1) for i in stopped]
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 2), key=lambda r: r.node_rank)
    assert [(r.node, r.node_rank) for r in relaunches] == [(nodes[0], 0), (spares[0], 1)]
    assert (run.status.nodes, run.status.cordoned) == ([nodes[0], spares[0]], [nodes[1]])
    # A lost node's cordon says when the run last heard from it, so the pool lets it stand only if the node's
    # agent has not registered again since; a GPU fault's cordon stands whatever.
    [cordon] = cluster.inputs("cordon_node")
    if kind is IncidentKind.NODE_UNRESPONSIVE:
        assert cordon.lost_since == pytest.approx(incident.detected_at - 10.0)
    else:
        assert cordon.lost_since is None


async def test_a_straggler_slow_over_two_windows_is_checkpointed_on_demand_then_replaced_by_a_spare(
        env: WorkflowEnvironment) -> None:
    """Judged from windows of training, not checkpoints: the only checkpoint after the first is the one the run
    asks for once the straggler persists, and the spare restores from it."""
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares, slow_windows=[
        PaceVerdict(slow={1: 5.0}, window_end=1000.0, window_s=10.0, step=60),
        PaceVerdict(slow={1: 5.0}, window_end=1010.2, window_s=10.0, step=80),
    ])
    asked = Until(lambda: any(r.step == 33 for r in cluster.inputs("request_checkpoint")))
    cluster.watch_script = {(1, node): [_ready(10), asked, _ready(33), BLOCK] for node in nodes}

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares))

    result = run.outcome
    assert isinstance(result, RunResult)
    assert [(i.kind, i.node, i.rank, i.action) for i in result.incidents] == [
        (IncidentKind.STRAGGLER, nodes[1], 1, Action.REPORT),
        (IncidentKind.STRAGGLER, nodes[1], 1, Action.REPLACE_NODE),
    ]
    assert "5.00x slower than its peers' median over 10s of training" in result.incidents[0].detail
    assert "after a checkpoint on demand at step 33" in result.incidents[1].detail
    # Where the master stands (the stand-in says step 25 at 0.5 s a step), then every node at 4 s ahead.
    where, *every = [(r.node, r.step) for r in cluster.inputs("request_checkpoint")]
    assert (where, sorted(every)) == ((nodes[0], None), [(nodes[0], 33), (nodes[1], 33)])
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 2), key=lambda r: r.node_rank)
    assert [(r.node, r.restore_step) for r in relaunches] == [(nodes[0], 33), (spares[0], 33)]
    # Issue 40 finding 10: slowness only the ranks' own figures say moves the node off this run, never cordons
    # it for every run in the pool (a script could cordon a healthy node per spare): it goes back to the pool.
    assert not cluster.inputs("cordon_node") and not cluster.inputs("notify_scheduler")
    assert run.status.cordoned == [] and nodes[1] not in run.status.nodes
    assert [r.node for r in cluster.inputs("release_nodes")][:1] == [nodes[1]]
    assert "left to the pool uncordoned" in result.incidents[1].detail


async def test_slow_windows_that_are_not_in_a_row_are_only_reported(env: WorkflowEnvironment) -> None:
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares, slow_windows=[
        PaceVerdict(slow={1: 2.0}, window_end=1000.0, window_s=10.0, step=60),
        PaceVerdict(slow={1: 2.0}, window_end=1030.0, window_s=10.0, step=120),  # two windows kept pace between
    ])
    committed = Until(lambda: len(cluster.calls["commit_checkpoints"]) >= 3)
    cluster.watch_script = {(1, node): [_ready(10), committed, _finished(20)] for node in nodes}

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares))

    result = run.outcome
    assert isinstance(result, RunResult)
    assert [(i.kind, i.action) for i in result.incidents] == [(IncidentKind.STRAGGLER, Action.REPORT)] * 2
    assert result.attempts == 1 and not cluster.inputs("request_checkpoint")


async def test_lost_node_without_a_spare_pauses_until_an_operator_resumes(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, away_polls={nodes[1]: 10_000}, watch_script={
        (1, nodes[0]): [BLOCK],
        (1, nodes[1]): [ApplicationError("agent lost its ranks", type="AgentLost")],
    })
    paused: list[RunStatus] = []

    async def fix_the_node_and_resume(handle: WorkflowHandle[Any, Any]) -> None:
        paused.append(await _wait_for_phase(handle, Phase.PAUSED))
        answer = await handle.execute_update(TrainingRun.resume, OperatorRequest(reason="node fixed"))
        assert answer == OperatorResult(phase=Phase.PAUSED)

    run = await _run(env, cluster, _spec(nodes), operator=fix_the_node_and_resume)

    [status] = paused
    assert status.reason is not None
    assert f"node_unresponsive on {nodes[1]} and no spare node left" in status.reason
    assert [(s.node, s.attempt) for s in cluster.inputs("stop_ranks")] == [(nodes[0], 1)]
    result = run.outcome
    assert isinstance(result, RunResult)
    assert result.attempts == 2
    assert [(i.kind, i.action) for i in result.incidents] == [(IncidentKind.NODE_UNRESPONSIVE, Action.PAUSE)]
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 2), key=lambda r: r.node_rank)
    assert [r.node for r in relaunches] == nodes
    assert run.status.reason is None


async def test_lost_node_without_a_spare_shrinks_to_min_nodes(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(3)
    cluster = Cluster(nodes=nodes)
    committed = Until(lambda: len(cluster.inputs("commit_checkpoint")) >= 1)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), committed, ApplicationError("agent lost its ranks", type="AgentLost")],
        (1, nodes[2]): [_ready(10), BLOCK],
        (2, nodes[0]): [_ready(20), _finished(20)],
        (2, nodes[2]): [_ready(20), _finished(20)],
    }

    run = await _run(env, cluster, _spec(nodes, min_nodes=2))

    result = run.outcome
    assert isinstance(result, RunResult), result
    [incident] = result.incidents
    assert (incident.kind, incident.node, incident.action) == (IncidentKind.NODE_UNRESPONSIVE, nodes[1],
                                                              Action.SHRINK)
    assert "continue on 2 nodes (min_nodes=2)" in incident.detail
    assert [c.node for c in cluster.inputs("cordon_node")] == [nodes[1]]
    # The smaller world restores the three-rank checkpoint: each node takes the shards of its new ranks.
    find = cluster.inputs("find_checkpoint")[1]
    assert (find.world_size, find.max_world_size) == (2, 3)
    downloads = sorted(_by_attempt(cluster.inputs("download_shards"), 2), key=lambda d: d.node)
    assert [(d.node, d.ranks) for d in downloads] == [(nodes[0], [0]), (nodes[2], [1])]
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 2), key=lambda r: r.node_rank)
    assert [(r.node, r.node_rank, r.num_nodes, r.restore_step) for r in relaunches] == [
        (nodes[0], 0, 2, 10), (nodes[2], 1, 2, 10)]
    # Its own checkpoints are written by the world of two.
    assert [c.world_size for c in cluster.inputs("commit_checkpoint")] == [3, 2]
    assert (run.status.nodes, run.status.world_size, run.status.cordoned) == ([nodes[0], nodes[2]], 2, [nodes[1]])


async def test_a_lost_node_pauses_rather_than_shrink_onto_a_checkpoint_that_cannot_be_resharded(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, sharded=True)
    committed = Until(lambda: len(cluster.inputs("commit_checkpoint")) >= 1)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), committed, ApplicationError("agent lost its ranks", type="AgentLost")],
    }
    paused: list[RunStatus] = []

    async def fix_the_node_and_resume(handle: WorkflowHandle[Any, Any]) -> None:
        paused.append(await _wait_for_phase(handle, Phase.PAUSED))
        await handle.execute_update(TrainingRun.resume, OperatorRequest(reason="node fixed"))

    run = await _run(env, cluster, _spec(nodes, min_nodes=1), operator=fix_the_node_and_resume)

    [status] = paused
    assert status.reason is not None and "not shrinking" in status.reason, status.reason
    assert "written by 2 ranks, which cannot be resharded onto 1" in status.reason
    result = run.outcome
    assert isinstance(result, RunResult), result
    assert [(i.kind, i.action) for i in result.incidents] == [(IncidentKind.NODE_UNRESPONSIVE, Action.PAUSE)]
    assert cluster.inputs("cordon_node") == []
    # Resumed at the world size that wrote the checkpoint: both nodes restore the two-rank step 10.
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 2), key=lambda r: r.node_rank)
    assert [(r.node, r.num_nodes, r.restore_step) for r in relaunches] == [(nodes[0], 2, 10), (nodes[1], 2, 10)]
    assert run.status.world_size == 2


async def test_a_shrunk_run_grows_back_when_its_node_returns(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes)
    committed = Until(lambda: len(cluster.inputs("commit_checkpoint")) >= 1)

    def repaired() -> bool:
        cluster.returned.add(nodes[1])  # the node's agent came back healthy: the pool has it again
        return True

    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), committed, ApplicationError("agent lost its ranks", type="AgentLost")],
        (2, nodes[0]): [Until(repaired), _ready(20), BLOCK],
        (3, nodes[0]): [_ready(30), _finished(40)],  # its first step ends the grow-back's time to recover
        (3, nodes[1]): [_ready(30), _finished(40)],
    }

    run = await _run(env, cluster, _spec(nodes, min_nodes=1))

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert [(i.kind, i.action) for i in result.incidents] == [(IncidentKind.NODE_UNRESPONSIVE, Action.SHRINK),
                                                              (IncidentKind.GROW_BACK, Action.RESTART)]
    grow = result.incidents[1]  # an incident of its own, so its cost is in the result and `run report`
    assert (grow.attempt, grow.node, grow.resumed_step) == (2, nodes[1], 20), grow
    assert grow.recovery_s is not None and "relaunch on world size 2 (was 1)" in grow.detail, grow
    # Each attempt's kept steps at its own step time (tests/unit/test_goodput.py), over the wall time.
    assert result.useful_s is not None and result.goodput == pytest.approx(min(1.0, result.useful_s / result.wall_s),
                                                                          abs=1e-3)
    # Shrunk: one node from step 10. Its node back in the pool: at the next commit it is reclaimed, and
    # attempt 3 runs on both nodes from the one-rank checkpoint, rank 1 restoring rank 0's shard.
    assert [(c.step, c.world_size) for c in cluster.inputs("commit_checkpoint")][:2] == [(10, 2), (20, 1)]
    reclaims = [a for a in cluster.inputs("acquire_nodes") if not a.nodes]
    assert reclaims and all(a.spares == [nodes[1]] for a in reclaims)
    downloads = sorted(_by_attempt(cluster.inputs("download_shards"), 3), key=lambda d: d.node)
    # (The agent maps rank 1 onto the one-rank checkpoint's shard 0: tests/unit/test_checkpoint_store.py.)
    assert [(d.node, d.ranks, d.manifest_key.rsplit("/", 2)[1]) for d in downloads] == [
        (nodes[0], [0], "step-00000020"), (nodes[1], [1], "step-00000020")]
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 3), key=lambda r: r.node_rank)
    assert [(r.node, r.num_nodes) for r in relaunches] == [(nodes[0], 2), (nodes[1], 2)]
    assert (run.status.nodes, run.status.world_size, run.status.cordoned) == (nodes, 2, [])
    # Neither the shrink nor the grow sent a stop: each node's launch stopped the attempt before it.
    assert cluster.inputs("stop_ranks") == []
    assert result.attempts == 3


GLOO_ERROR = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
              "[127.0.0.1]:29500. Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:672 "
              "(most recent call first): " + "frame #0: c10::Error::Error(c10::SourceLocation, std::string) " * 8)
"""What a lost peer's gloo error looks like on one line: about 600 characters, most of them frames."""


async def test_a_lost_nodes_incident_and_cordon_say_its_cause_in_one_short_line(env: WorkflowEnvironment) -> None:
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares, watch_script={
        (1, nodes[0]): [_ready(10), BLOCK], (1, nodes[1]): [_ready(10), ApplicationError(GLOO_ERROR, type="AgentLost")],
        (2, nodes[0]): [_finished(20)], (2, spares[0]): [_finished(20)]})

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares))

    assert isinstance(run.outcome, RunResult), run.outcome
    [incident] = run.outcome.incidents
    cause = "AgentLost: RuntimeError: Connection closed by peer [127.0.0.1]:29500."  # the first sentence
    assert incident.detail.startswith(f"node agent failed: {cause}; "), incident.detail
    [cordon] = cluster.inputs("cordon_node")
    assert cordon.reason == f"node_unresponsive: node agent failed: {cause}", cordon.reason


async def test_a_shrunk_run_stays_shrunk_on_a_checkpoint_that_cannot_be_resharded(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, sharded=True, returned={nodes[1]})
    cluster.watch_script = {
        # Lost before any checkpoint: the run shrinks and starts afresh; its checkpoints are then one rank's.
        (1, nodes[0]): [BLOCK],
        (1, nodes[1]): [ApplicationError("agent lost its ranks", type="AgentLost")],
        (2, nodes[0]): [_ready(10), _ready(20), _finished(30)],
    }

    run = await _run(env, cluster, _spec(nodes, min_nodes=1))

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert [(i.kind, i.action) for i in result.incidents] == [(IncidentKind.NODE_UNRESPONSIVE, Action.SHRINK)]
    assert [(c.step, c.world_size) for c in cluster.inputs("commit_checkpoint")] == [(10, 1), (20, 1)]
    # Its node back in the pool, but a one-rank torch.save of DTensors would not load onto two: no grow.
    assert [a for a in cluster.inputs("acquire_nodes") if not a.nodes] == []
    assert result.attempts == 2 and run.status.world_size == 1


async def test_a_replaced_node_that_returns_becomes_a_spare(env: WorkflowEnvironment) -> None:
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares)

    def repaired() -> bool:
        cluster.returned.add(nodes[1])  # its agent came back healthy: the pool has it again
        return True

    def reclaimed() -> bool:  # the run asked the pool for it at the commit after it came back
        return any(nodes[1] in a.spares for a in cluster.inputs("acquire_nodes"))

    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), _event(WatchEventKind.GPU_UNHEALTHY, detail="GPU 0: XID 79")],
        (2, nodes[0]): [_ready(20), Until(reclaimed), _finished(30)],
        (2, spares[0]): [Until(repaired), _ready(20), Until(reclaimed), _finished(30)],
    }

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares))

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert [(i.kind, i.action) for i in result.incidents] == [(IncidentKind.GPU_UNHEALTHY, Action.REPLACE_NODE)]
    assert result.attempts == 2  # taking a spare back costs no relaunch
    assert (run.status.nodes, run.status.spares, run.status.cordoned) == ([nodes[0], spares[0]], [nodes[1]], [])


async def test_a_crash_whose_node_then_does_not_take_up_the_relaunch_replaces_that_node(
        env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that died takes its ranks with it; its peers fail in the collective and are seen first. A relaunch
    sends no stop, so the node is found when it does not take up the relaunch: it becomes the incident, and
    the relaunch it cost is not counted against the restart budget twice."""
    # The dead node's queue: nothing takes up its launching watch, nor the check that asks it before it is
    # taken as lost. That check gives up in 1 s, not 10: the master's watch waits for the spare in real time.
    monkeypatch.setattr(node_group, "SILENT_CHECK_SCHEDULE_TO_START", timedelta(seconds=1))
    nodes, spares = _node_ids(2), _node_ids(1)

    injected: list[bool] = []

    async def take_it_down(handle: WorkflowHandle[Any, Any]) -> None:  # chaos: injected at 123.0 (the stand-in's)
        await handle.execute_update(TrainingRun.inject_fault, ChaosRequest(node=nodes[1], fault="node-down"))
        injected.append(True)

    cluster = Cluster(nodes=nodes, spares=spares, unreachable={nodes[1]}, while_running=take_it_down, watch_script={
        # The peer's crash follows the fault, as it does on a real cluster: on a loaded machine the injection's
        # update could otherwise land after the crash was judged, and the incident had no fault to time from.
        (1, nodes[0]): [Until(lambda: bool(injected)), _exited(1).model_copy(update={"detected_at": 1_000.0})],
        (1, nodes[1]): [BLOCK],
        # The master's ranks wait in the rendezvous until the spare's join it.
        (2, nodes[0]): [Until(lambda: any(r.node == spares[0] for r in cluster.inputs("launch_ranks"))),
                        _finished(25).model_copy(update={"first_step_at": 1_012.5})],
        (2, spares[0]): [_finished(25)],
    })

    # One restart allowed: the one fault may cost only one.
    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares, restarts={"max_restarts": 1}))

    result = run.outcome
    assert isinstance(result, RunResult), result
    # One fault, one incident: the peer's crash was the lost node's symptom, and the incident names the node.
    [incident] = result.incidents
    assert (incident.kind, incident.node, incident.action) == (
        IncidentKind.NODE_UNRESPONSIVE, nodes[1], Action.REPLACE_NODE)
    assert "did not answer the relaunch" in incident.detail
    assert f"after crash on {nodes[0]} (rank 0 exit code 1)" in incident.detail
    assert cluster.inputs("stop_ranks") == []
    # The spare took the lost node's place in the relaunch that found it: one relaunch for the one fault, the
    # master launched once, into the same rendezvous.
    assert result.attempts == 2
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 2), key=lambda r: r.node_rank)
    assert [(r.node, r.node_rank) for r in relaunches] == [(nodes[0], 0), (spares[0], 1)]
    assert (relaunches[1].master_addr, relaunches[1].master_port) == (f"{nodes[0]}.cluster", 29502)  # the master's
    assert (incident.recovery_path, incident.recovery_s) == ("relaunch, a spare joining it", 12.5)
    # Timed from its first sign both ways: the fault (123.0) to the peer's crash, then to the first new step.
    assert incident.detection_s == 877.0 and incident.detected_at == 1_000.0
    assert (run.status.nodes, run.status.cordoned) == ([nodes[0], spares[0]], [nodes[1]])


async def test_a_crash_whose_peer_node_is_dead_replaces_that_node_before_the_relaunch(
        env: WorkflowEnvironment) -> None:
    """A node that died with its ranks: its peer's rank crashes in the collective and is reported first. The
    crash's liveness check of every node finds the dead one, so the spare is chosen before the relaunch: the
    dead node is never asked to launch, and the one fault is one incident."""
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares, dead={nodes[1]}, watch_script={
        (1, nodes[0]): [_ready(10), Until(lambda: len(cluster.inputs("commit_checkpoint")) >= 1),
                        _exited(1).model_copy(update={"detected_at": 1_000.0})],
        (1, nodes[1]): [_ready(10), BLOCK],
    })

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares, restarts={"max_restarts": 1}))

    result = run.outcome
    assert isinstance(result, RunResult), result
    [incident] = result.incidents
    assert (incident.kind, incident.node, incident.action) == (
        IncidentKind.NODE_UNRESPONSIVE, nodes[1], Action.REPLACE_NODE)
    assert f"did not answer a liveness check within 2s after crash on {nodes[0]}" in incident.detail
    assert incident.detected_at == 1_000.0  # timed from its first sign, the crash
    checked = sorted(r.node for r in cluster.inputs("check_node"))
    assert checked == sorted([*nodes, *nodes])  # at reservation, then the crash's check of both
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 2), key=lambda r: r.node_rank)
    assert [(r.node, r.node_rank, r.restore_step) for r in relaunches] == [(nodes[0], 0, 10), (spares[0], 1, 10)]
    assert result.attempts == 2 and (run.status.nodes, run.status.cordoned) == ([nodes[0], spares[0]], [nodes[1]])


async def test_two_nodes_that_do_not_take_up_the_relaunch_are_both_replaced_within_it(
        env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes of one group lost with their ranks: each gets a spare in its place in the same relaunch, and the
    group is watched again once, not once per spare."""
    # The dead node's queue: nothing takes up its launching watch, nor the check that asks it before it is
    # taken as lost. That check gives up in 1 s, not 10: the master's watch waits for the spare in real time.
    monkeypatch.setattr(node_group, "SILENT_CHECK_SCHEDULE_TO_START", timedelta(seconds=1))
    nodes, spares = _node_ids(3), _node_ids(2)

    def both_spares_launched() -> bool:
        return {r.node for r in _by_attempt(cluster.inputs("launch_ranks"), 2)} >= set(spares)

    cluster = Cluster(nodes=nodes, spares=spares, unreachable={nodes[1], nodes[2]}, watch_script={
        (1, nodes[0]): [_exited(1).model_copy(update={"detected_at": 1_000.0})],
        (1, nodes[1]): [BLOCK],
        (1, nodes[2]): [BLOCK],
        (2, nodes[0]): [Until(both_spares_launched), _finished(25).model_copy(update={"first_step_at": 1_020.0})],
        **{(2, spare): [_finished(25)] for spare in spares},
    })

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares))

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert result.attempts == 2
    assert sorted(i.node for i in result.incidents) == nodes[1:]
    assert {(i.kind, i.action, i.recovery_path) for i in result.incidents} == {
        (IncidentKind.NODE_UNRESPONSIVE, Action.REPLACE_NODE, "relaunch, a spare joining it")}
    assert all(i.recovery_s is not None for i in result.incidents)
    assert sorted(run.status.nodes[1:]) == sorted(spares) and sorted(run.status.cordoned) == nodes[1:]
    # Attempt 2's watches: the first group, then one group again for the spares (or one per join when the two
    # were found apart), never two groups watching a node at once: each spare's watch launched it once.
    launches = [r.node for r in _by_attempt(cluster.inputs("launch_ranks"), 2)]
    assert sorted(launches) == sorted([nodes[0], *spares]), launches


def _crash_after_the_first_commit(nodes: list[str], index: int, then: list[WatchScriptEntry]) -> Cluster:
    """Every node (one rank each) saves step 10 and trains on; node `index`'s rank crashes once step 10 is
    committed; every node's attempt 2 does `then`."""
    cluster = Cluster(nodes=nodes)
    cluster.watch_script = {
        **{(1, n): [_ready(10), BLOCK] for n in nodes},
        (1, nodes[index]): [_ready(10), Until(lambda: len(cluster.inputs("commit_checkpoint")) >= 1),
                            _exited(-9, rank=index)],
        **{(2, n): list(then) for n in nodes},
    }
    return cluster


async def test_a_run_of_many_nodes_watches_in_groups_of_sixteen_and_relaunches_each_node_at_its_rank(
        env: WorkflowEnvironment) -> None:
    """A watch's every start and heartbeat is a write of its group's execution, which Temporal serializes: a run
    watches in groups of 16 nodes (`WATCH_NODES_PER_GROUP`), and a relaunch's launching watches give each node
    its place in the world whatever its group."""
    nodes = _node_ids(40)
    cluster = _crash_after_the_first_commit(nodes, 35, [_finished(20)])

    run = await _run(env, cluster, _spec(nodes))

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert result.attempts == 2 and [i.node for i in result.incidents] == [nodes[35]]
    groups = {attempt: {g for g, w in zip(cluster.inputs("watch_groups"), cluster.inputs("watch_ranks"))
                        if w.attempt == attempt} for attempt in (1, 2)}
    assert [len(groups[1]), len(groups[2])] == [3, 3], groups  # 16 + 16 + 8 nodes
    launched = {w.node: w.launch.node_rank for w in _by_attempt(cluster.inputs("watch_ranks"), 2)
                if w.launch is not None}
    assert launched == {n: i for i, n in enumerate(nodes) if i > 0}  # the master launched by an activity


async def test_a_run_of_many_nodes_relaunches_in_place_with_no_new_launching_watch(
        env: WorkflowEnvironment) -> None:
    """Past one call group of nodes, the watch groups stand across attempts: a crash's relaunch is published
    for every node to take up in place, each at its rank (the node that reported waits in a new watch for it);
    no node launches from a launching watch, no group is started again, and the relaunch's first step still
    ends the incident."""
    nodes = _node_ids(80)
    cluster = _crash_after_the_first_commit(nodes, 35, [_ready(20), _finished(30)])

    run = await _run(env, cluster, _spec(nodes))

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert result.attempts == 2 and [i.node for i in result.incidents] == [nodes[35]]
    assert result.incidents[0].recovery_s is not None  # the master's in-place watch reported the first step
    [published] = cluster.inputs("publish_attempt")
    assert published.decision.attempt == 2 and published.decision.launched == [nodes[0]]
    assert published.decision.download is not None  # from step 10, committed before the crash
    assert published.decision.download.manifest_sha256 == _manifest_sha256(10)
    assert len(set(cluster.inputs("watch_groups"))) == 5  # 80 nodes in groups of 16, none started again
    relaunched = [w.node for w in cluster.inputs("watch_ranks") if w.launch is not None and w.launch.attempt == 2]
    assert relaunched == []
    waiting = [w.node for w in cluster.inputs("watch_ranks") if w.after_attempt is not None]
    assert waiting == [nodes[35]]
    ranks = {r.node: r.node_rank for r in _by_attempt(cluster.inputs("launch_ranks"), 2)}
    assert ranks == {n: i for i, n in enumerate(nodes)}
    assert result.final_checkpoint is not None and result.final_checkpoint.step == 20
    if os.environ.get("TRAINGUARD_RECORD_HISTORIES"):  # the replay tests' histories of relaunching in place
        await _record_histories(run.handle, "standing", [cluster.inputs("watch_groups")[0],
                                                        [g for g in cluster.inputs("watch_groups") if g.endswith("-2")][0]])


async def test_a_fault_every_node_reports_still_relaunches_in_place(env: WorkflowEnvironment) -> None:
    """Every node's ranks fail (peers whose collective errors out on the crash, as gloo's do): each node that
    reported waits in a watch, and the relaunch still needs no launching watch; the earliest failure is the
    incident."""
    nodes = _node_ids(80)
    cluster = _crash_after_the_first_commit(nodes, 35, [_ready(20), _finished(30)])
    for index, node in enumerate(nodes):
        if index != 35:  # a peer's rank fails in its next collective, after the crash
            cluster.watch_script[(1, node)] = [_ready(10), Until(lambda: bool(cluster.inputs("commit_checkpoint"))),
                                               _exited(1, rank=index).model_copy(update={"occurred_at": 2e9})]

    run = await _run(env, cluster, _spec(nodes))

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert result.attempts == 2 and [i.node for i in result.incidents] == [nodes[35]]
    assert len(cluster.inputs("publish_attempt")) == 1
    assert len(set(cluster.inputs("watch_groups"))) == 5
    assert not [w for w in cluster.inputs("watch_ranks") if w.launch is not None and w.launch.attempt == 2]
    ranks = {r.node: r.node_rank for r in _by_attempt(cluster.inputs("launch_ranks"), 2)}
    assert ranks == {n: i for i, n in enumerate(nodes)}


async def _record_histories(handle: WorkflowHandle[Any, Any], name: str, children: list[str]) -> None:
    folder = Path(__file__).resolve().parents[1] / "histories"
    (folder / f"{name}.json").write_text((await handle.fetch_history()).to_json())
    for index, child in enumerate(dict.fromkeys(children)):
        history = await handle._client.get_workflow_handle(child).fetch_history()
        (folder / f"{name}-group-{index}.json").write_text(history.to_json())


async def test_store_down_at_restore_pauses_with_an_incident_until_resumed(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes)

    def store_goes_down() -> bool:
        cluster.store_down = len(cluster.inputs("commit_checkpoint")) >= 1  # after the first commit
        return cluster.store_down

    cluster.watch_script = {(1, nodes[0]): [_ready(10), Until(store_goes_down), _exited(-9)],
                            (1, nodes[1]): [_ready(10), BLOCK]}
    paused: list[RunStatus] = []

    async def store_back_then_resume(handle: WorkflowHandle[Any, Any]) -> None:
        paused.append(await _wait_for_phase(handle, Phase.PAUSED))
        cluster.store_down = False
        await handle.execute_update(TrainingRun.resume, OperatorRequest(reason="store is back"))

    run = await _run(env, cluster, _spec(nodes), operator=store_back_then_resume)

    [status] = paused
    assert status.reason is not None and "checkpoint store unreachable at restore" in status.reason
    result = run.outcome
    assert isinstance(result, RunResult), result
    assert [(i.kind, i.action) for i in result.incidents] == [
        (IncidentKind.CRASH, Action.RESTART), (IncidentKind.STORAGE_UNAVAILABLE, Action.PAUSE)]
    assert "checkpoint.restore_timeout_s=180" in result.incidents[1].detail
    assert "Could not connect" in result.incidents[1].detail
    assert cluster.inputs("launch_ranks")[-1].restore_step == 10  # resumed from the checkpoint after all
    assert result.attempts == 3


async def test_paused_run_aborted_by_an_operator_fails_with_the_reason(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, watch_script={
        (1, nodes[0]): [BLOCK],
        (1, nodes[1]): [ApplicationError("agent lost its ranks", type="AgentLost")],
    })

    async def abort(handle: WorkflowHandle[Any, Any]) -> None:
        await _wait_for_phase(handle, Phase.PAUSED)
        await handle.execute_update(TrainingRun.abort, OperatorRequest(reason="rack 7 is down"))

    run = await _run(env, cluster, _spec(nodes), operator=abort)

    assert _failure_message(run.outcome) == "rack 7 is down"
    assert (run.status.phase, run.status.reason) == (Phase.FAILED, "rack 7 is down")
    assert {r.attempt for r in cluster.inputs("launch_ranks")} == {1}
    # Ranks stopped when the run paused, and every attempt's (0: None) once more when it ended, on every node.
    assert sorted((s.node, s.attempt or 0) for s in cluster.inputs("stop_ranks")) == [
        (nodes[0], 0), (nodes[0], 1), (nodes[1], 0)]


async def test_operator_pause_stops_the_ranks_and_resume_relaunches(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(1)
    refused: list[str] = []

    async def pause(handle: WorkflowHandle[Any, Any]) -> None:
        try:
            await handle.execute_update(TrainingRun.resume, OperatorRequest())
        except WorkflowUpdateFailedError as error:
            refused.append(str(error.cause))
        await handle.execute_update(TrainingRun.pause, OperatorRequest(reason="swap a PSU"))

    async def resume(handle: WorkflowHandle[Any, Any]) -> None:
        status = await _wait_for_phase(handle, Phase.PAUSED)
        assert status.reason == "pause requested: swap a PSU"
        await handle.execute_update(TrainingRun.resume, OperatorRequest())

    cluster = Cluster(nodes=nodes, while_running=pause, watch_script={(1, nodes[0]): [BLOCK]})

    run = await _run(env, cluster, _spec(nodes), operator=resume)

    assert refused and "not paused: nothing to resume" in refused[0]
    result = run.outcome
    assert isinstance(result, RunResult)
    assert (result.attempts, result.incidents) == (2, [])
    assert [(s.node, s.attempt) for s in cluster.inputs("stop_ranks")] == [(nodes[0], 1)]


async def test_a_resume_right_after_a_pause_is_accepted_and_the_run_goes_on(env: WorkflowEnvironment) -> None:
    """`await tg.pause(id); await tg.resume(id)`, as a script writes it: the pause returns before the ranks are
    stopped, and the resume must not be refused for it, leaving the run paused and holding its nodes."""
    nodes = _node_ids(1)
    answers: list[Phase] = []

    async def pause_then_resume(handle: WorkflowHandle[Any, Any]) -> None:
        for update in (TrainingRun.pause, TrainingRun.resume):
            answers.append((await handle.execute_update(update, OperatorRequest())).phase)

    cluster = Cluster(nodes=nodes, while_running=pause_then_resume,
                      watch_script={(1, nodes[0]): [BLOCK], (2, nodes[0]): [_finished(30)]})

    run = await _run(env, cluster, _spec(nodes))

    assert answers == [Phase.RUNNING, Phase.RUNNING]
    result = run.outcome
    assert isinstance(result, RunResult), result
    assert result.attempts == 2 and [(s.node, s.attempt) for s in cluster.inputs("stop_ranks")] == [(nodes[0], 1)]


async def test_the_web_ui_shows_the_runs_phase_and_step_in_its_current_details(env: WorkflowEnvironment) -> None:
    from temporalio.api.sdk.v1 import WorkflowMetadata

    nodes = _node_ids(1)
    seen: list[str] = []

    async def look(handle: WorkflowHandle[Any, Any]) -> None:
        metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
        seen.append(metadata.current_details)

    cluster = Cluster(nodes=nodes, while_running=look, watch_script={(1, nodes[0]): [BLOCK]})
    cluster.watch_script[(1, nodes[0])] = [Until(lambda: bool(seen)), _finished(20)]

    run = await _run(env, cluster, _spec(nodes))

    assert isinstance(run.outcome, RunResult)
    assert seen and seen[0].startswith("**running**, attempt 1"), seen
    assert f"nodes: {nodes[0]} (1 ranks)" in seen[0]


async def test_wall_time_counts_from_the_start_request_as_the_report_does(env: WorkflowEnvironment) -> None:
    """A run started while no controller polls waits for one; `run result` and `run report` must agree that
    the wait was part of the run's wall time (the report reads the history's timestamps)."""
    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes, watch_script={(1, nodes[0]): [_finished(20)]})
    cluster.client = env.client
    task_queue = f"tq-{uuid4()}"
    handle = await env.client.start_workflow(TrainingRun.run, _spec(nodes), id=f"run-{uuid4()}",
                                             task_queue=task_queue, result_type=RunResult)
    await asyncio.sleep(2.0)  # no controller yet (the test server skips no time while a task waits for a worker)
    async with _workers(env.client, cluster, task_queue):
        result = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
    history = await handle.fetch_history()
    span = history.events[-1].event_time.ToDatetime() - history.events[0].event_time.ToDatetime()
    assert result.wall_s >= 2.0
    assert result.wall_s == pytest.approx(span.total_seconds(), abs=0.5)


@pytest.mark.parametrize("namespace", [None, "my-run.3fa2c1d0"])
async def test_checkpoints_live_in_the_runs_namespace(env: WorkflowEnvironment, namespace: str | None) -> None:
    """A run under a reused id gets a namespace of its own (the client sets it): it restores and commits
    there, never the earlier run's checkpoints; without one, the workflow id is the namespace."""
    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes, watch_script={(1, nodes[0]): [_ready(10), _finished(20)]})

    run = await _run(env, cluster, _spec(nodes, checkpoint={"every_steps": 10, "prefix": "p",
                                                            "namespace": namespace}))

    assert isinstance(run.outcome, RunResult), run.outcome
    expected = f"p/{namespace or run.handle.id}"
    assert {f.run_prefix for f in cluster.inputs("find_checkpoint")} == {expected}
    assert {c.run_prefix for c in cluster.inputs("commit_checkpoints")} == {expected}


async def test_find_checkpoint_names_the_run_and_the_run_it_resumes_from(env: WorkflowEnvironment) -> None:
    """Issue 27 item 5: the store restores only what the run's own workflow id (or the run named in
    `checkpoint.resume_from`) committed; the workflow tells it both, and where the other run's checkpoints are."""
    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes, watch_script={(1, nodes[0]): [_ready(10), _finished(20)]})

    run = await _run(env, cluster, _spec(nodes, checkpoint={"every_steps": 10, "prefix": "p",
                                                            "resume_from": "earlier-run"}))

    assert isinstance(run.outcome, RunResult), run.outcome
    [find] = cluster.inputs("find_checkpoint")
    assert (find.workflow_id, find.resume_from, find.resume_prefix) == (run.handle.id, "earlier-run", "p/earlier-run")
    assert find.run_prefix == f"p/{run.handle.id}"


async def test_corrupt_checkpoint_falls_back_to_the_one_before(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes, corrupt_steps={20}, watch_script={
        (1, nodes[0]): [_ready(10, 20), _exited(-9)],
        (2, nodes[0]): [_finished(30)],
    })

    run = await _run(env, cluster, _spec(nodes))

    result = run.outcome
    assert isinstance(result, RunResult)
    assert sorted(c.step for c in cluster.inputs("commit_checkpoint")) == [10, 20]
    assert [f.exclude_steps for f in cluster.inputs("find_checkpoint")] == [[], [], [20]]
    [relaunch] = _by_attempt(cluster.inputs("launch_ranks"), 2)
    assert relaunch.restore_step == 10
    assert [(i.kind, i.attempt) for i in result.incidents] == [(IncidentKind.CRASH, 1),
                                                               (IncidentKind.CHECKPOINT_CORRUPT, 2)]
    assert result.incidents[1].detail.startswith("step 20: ")
    assert "sha256 mismatch" in result.incidents[1].detail
    assert result.incidents[1].resumed_step == 10


async def test_a_corrupt_shard_found_by_a_launching_watch_restores_the_checkpoint_before(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, corrupt_steps={20}, corrupt_on={nodes[1]}, watch_script={
        (1, nodes[0]): [_ready(10, 20), _exited(-9)],
        (1, nodes[1]): [_ready(10, 20), BLOCK],
    })

    run = await _run(env, cluster, _spec(nodes))

    result = run.outcome
    assert isinstance(result, RunResult)
    # The master downloaded step 20 intact and launched; node 1's first watch found its shard corrupt.
    assert [(d.node, d.attempt) for d in cluster.inputs("download_shards")
            if "/step-00000020/" in (d.manifest_key or "")] == [(nodes[0], 2), (nodes[1], 2)]
    assert [(i.kind, i.node, i.attempt) for i in result.incidents] == [
        (IncidentKind.CRASH, nodes[0], 1), (IncidentKind.CHECKPOINT_CORRUPT, nodes[1], 2)]
    assert [f.exclude_steps for f in cluster.inputs("find_checkpoint")] == [[], [], [20]]
    assert sorted((r.node, r.restore_step) for r in _by_attempt(cluster.inputs("launch_ranks"), 3)) == [
        (nodes[0], 10), (nodes[1], 10)]
    assert cluster.inputs("cordon_node") == [], "a corrupt checkpoint is not the node's fault"


async def test_a_launch_a_node_refuses_from_its_watch_fails_the_run_as_the_specs_fault(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(3)
    cluster = Cluster(nodes=nodes, refuse_launch={nodes[2]: "EntrypointNotAllowed"},
                      watch_script={(1, n): [BLOCK] for n in nodes[:2]})

    run = await _run(env, cluster, _spec(nodes))

    assert isinstance(run.outcome, WorkflowFailureError)
    assert isinstance(run.outcome.cause, ApplicationError) and run.outcome.cause.type == "InvalidSpec"
    assert nodes[2] in run.outcome.cause.message and "not allowed" in run.outcome.cause.message
    assert cluster.inputs("cordon_node") == [], "no node is blamed, no spare spent"
    assert {s.node for s in cluster.inputs("stop_ranks")} == set(nodes), "no rank outlives the run"


async def test_incident_before_a_corrupt_checkpoint_records_where_the_run_resumed(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes, corrupt_steps={20}, watch_script={
        (1, nodes[0]): [_ready(10, 20), _exited(-9)],
        (2, nodes[0]): [_finished(30)],
    })

    run = await _run(env, cluster, _spec(nodes))

    assert isinstance(run.outcome, RunResult)
    crash = run.outcome.incidents[0]
    assert crash.kind is IncidentKind.CRASH
    assert crash.resumed_step == 10


async def test_inject_fault_reaches_the_node_and_unknown_nodes_are_refused(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    answers: list[Any] = []

    async def inject(handle: WorkflowHandle[Any, Any]) -> None:
        for node, fault, duty in ((nodes[1], "crash", 0.5), ("not-a-node", "crash", 0.5), (nodes[1], "slow", 5.0)):
            try:
                request = ChaosRequest(node=node, fault=fault, rank=1, slow_duty=duty)  # the run adds its own id
                answers.append(await handle.execute_update(TrainingRun.inject_fault, request))
            except WorkflowUpdateFailedError as error:
                answers.append(error.cause)

    cluster = Cluster(nodes=nodes, while_running=inject)

    run = await _run(env, cluster, _spec(nodes))

    assert isinstance(run.outcome, RunResult)
    accepted, refused, clamped = answers
    assert accepted == InjectFaultResult(node=nodes[1], rank=1, pid=1000, injected_at=123.0)
    assert "'not-a-node' is not in the run" in str(refused)
    assert "slow_duty 5 is out of range: give 0.05 to 0.95" in str(clamped)  # refused, not clamped
    [request] = cluster.inputs("inject_fault")
    assert (request.workflow_id, request.node, request.fault) == (run.handle.id, nodes[1], "crash")


@pytest.mark.parametrize(
    ("restarts", "reason"),
    [
        pytest.param({"max_restarts": 2, "max_restarts_without_checkpoint": 5},
                     "restart budget spent: 2 restarts", id="restart-budget"),
        pytest.param({"max_restarts": 10, "max_restarts_without_checkpoint": 2},
                     "2 restarts in a row committed no new checkpoint", id="no-new-checkpoint"),
    ],
)
async def test_a_run_that_keeps_crashing_stops_with_a_reason(env: WorkflowEnvironment,
                                                             restarts: dict[str, int], reason: str) -> None:
    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes, watch_script={(a, nodes[0]): [_exited(-9)] for a in range(1, 10)})

    run = await _run(env, cluster, _spec(nodes, restarts=restarts))

    message = _failure_message(run.outcome)
    assert reason in message
    assert [r.attempt for r in cluster.inputs("launch_ranks")] == [1, 2, 3]
    assert run.status.phase is Phase.FAILED
    assert [i.action for i in run.status.incidents] == [Action.RESTART, Action.RESTART, Action.STOP]


TRACE = 'Traceback (most recent call last):\n  File "train.py", line 9, in main\nValueError: loss is nan'
SAME = "train.py:9 in main: ValueError: loss is nan"


def _raised(signature: str | None) -> WatchEvent:
    return _event(WatchEventKind.RANK_EXITED, rank=0, exit_code=1, detail="rank 0 exited with code 1",
                  log_path="/agent/runs/r/attempt-0001/logs/rank-00000.log", log_tail=TRACE,
                  failure_signature=signature)


@pytest.mark.parametrize(
    ("signatures", "launches"),
    [
        pytest.param([SAME, SAME], 2, id="same-failure-twice-stops-after-two-attempts"),
        pytest.param([SAME, "train.py:9 in main: KeyError: 'x'", None], 3, id="different-failures-spend-the-budget"),
    ],
)
async def test_a_script_that_fails_the_same_way_stops_with_its_traceback(
        env: WorkflowEnvironment, signatures: list[str | None], launches: int) -> None:
    nodes = _node_ids(1)
    script = {(a, nodes[0]): [_raised(signatures[min(a, len(signatures)) - 1])] for a in range(1, 10)}
    cluster = Cluster(nodes=nodes, watch_script=script)

    run = await _run(env, cluster, _spec(nodes, restarts={"max_restarts_without_checkpoint": 2}))

    message = _failure_message(run.outcome)
    assert len(cluster.inputs("launch_ranks")) == launches
    first = run.status.incidents[0]
    assert first.log_tail == TRACE and first.log_path and first.signature == signatures[0]
    if launches == 2:
        assert message.startswith(f"rank 0 on {nodes[0]}: {SAME}: the same failure on 2 attempts in a row")
        assert "ValueError: loss is nan" in message.splitlines()[-1], "the traceback ends the reason"
        assert "rank-00000.log" in message
    else:
        assert "committed no new checkpoint" in message and "the last incident: rank 0 exited" in message
    assert run.status.reason == message


async def test_with_tracing_one_trace_covers_the_run_its_workflow_tasks_and_every_activity(
        env: WorkflowEnvironment) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from temporalio.contrib.opentelemetry import TracingInterceptor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traced = Client(**{**env.client.config(), "interceptors": [TracingInterceptor(provider.get_tracer("test"))]})
    nodes = _node_ids(DIRECT_NODE_CALLS + 1)  # enough that the check at reservation goes through node groups
    cluster = Cluster(nodes=nodes, watch_script={(1, n): [_ready(10), _finished(20)] for n in nodes})

    run = await _run(env, cluster, _spec(nodes), client=traced)

    assert isinstance(run.outcome, RunResult)
    spans = exporter.get_finished_spans()
    names = {span.name for span in spans}
    for expected in ("StartWorkflow:TrainingRun", "RunWorkflow:TrainingRun", "StartActivity:launch_ranks",
                     "RunActivity:launch_ranks", "RunActivity:watch_ranks", "RunActivity:commit_checkpoints",
                     "RunWorkflow:NodeCalls", "RunWorkflow:NodeGroupWatch"):
        assert expected in names, sorted(names)
    [start] = [span for span in spans if span.name == "StartWorkflow:TrainingRun"]
    assert {span.context.trace_id for span in spans if span.name.startswith("RunActivity:")} == \
        {start.context.trace_id}, "every activity of the run is in the trace its start opened"


# ------------------------------------------------------------------------------- pools by count and label


def _labelled_pool(nodes: list[str], labels: dict[str, dict[str, str]]) -> dict[str, PoolNode]:
    return {n: PoolNode(node=n, labels=labels.get(n, {})) for n in nodes}


async def test_a_run_by_count_trains_on_the_nodes_the_pool_chose_by_label(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(4)
    zone_a = {n: {"zone": "a"} for n in nodes[1:]}
    cluster = Cluster(nodes=nodes, pool=_labelled_pool(nodes, zone_a))

    run = await _run(env, cluster, {"entrypoint": ["python", "train.py"], "num_nodes": 2, "num_spares": 1,
                                    "node_selector": {"zone": "a"}, "checkpoint": {"every_steps": 10}})

    assert isinstance(run.outcome, RunResult), run.outcome
    assert run.status.nodes == nodes[1:3]  # natural order, node 0 has no zone=a label
    assert sorted({la.node for la in cluster.inputs("launch_ranks")} |
                  {w.node for w in cluster.inputs("watch_ranks")}) == nodes[1:3]
    assert run.status.world_size == 2 and run.outcome.steps_completed == 20
    [lease] = cluster.inputs("acquire_nodes")
    assert (lease.nodes, lease.num_nodes, lease.num_spares, lease.selector) == ([], 2, 1, {"zone": "a"})
    assert sorted(c.node for c in cluster.inputs("check_node")) == nodes[1:3]
    assert all(state.leased_to is None for state in cluster.pool.values())  # released at the end


async def test_a_named_node_cordoned_at_start_is_replaced_by_a_free_spare(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(3)
    pool = _labelled_pool(nodes, {})
    pool[nodes[1]].cordoned = "fan failure"
    cluster = Cluster(nodes=nodes, pool=pool)

    run = await _run(env, cluster, _spec(nodes[:2], spare_nodes=[nodes[2]]))

    assert isinstance(run.outcome, RunResult), run.outcome
    assert run.status.nodes == [nodes[0], nodes[2]]
    assert run.status.replaced_at_start == {nodes[1]: nodes[2]}
    assert nodes[1] in run.status.cordoned
    assert nodes[1] not in {w.node for w in cluster.inputs("watch_ranks")}
    assert pool[nodes[1]].cordoned == "fan failure" and pool[nodes[1]].leased_to is None


async def test_a_selector_no_node_matches_fails_the_run_at_once_saying_so(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, pool=_labelled_pool(nodes, {nodes[0]: {"gpu": "a100"}}))

    run = await _run(env, cluster, {"entrypoint": ["python", "train.py"], "num_nodes": 1,
                                    "node_selector": {"gpu": "h100"}})

    message = _failure_message(run.outcome)
    assert "node_selector gpu=h100" in message and "gpu=a100" in message, message
    assert cluster.inputs("check_node") == []


async def test_a_cordoned_named_node_without_a_spare_still_fails_naming_it(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    pool = _labelled_pool(nodes, {})
    pool[nodes[1]].cordoned = "xid 79"
    run = await _run(env, Cluster(nodes=nodes, pool=pool), _spec(nodes))
    message = _failure_message(run.outcome)
    assert f"nodes.1 '{nodes[1]}' is cordoned (xid 79)" in message, message


def _hang_with_evidence(node: str, rank: int, inside: bool, enqueued: int, at: float) -> WatchEvent:
    """A HANG as a watch asked for `evidence_with_event` returns it: its node's evidence taken with it."""
    return _event(WatchEventKind.HANG, rank=rank, detail=f"rank {rank} made no progress for 2.0s").model_copy(update={
        "detected_at": at, "fault_at": at - 2.0, "evidence": [RankEvidence(
            node=node, rank=rank, state="S", answered=True, collectives_enqueued=enqueued,
            collectives_completed=enqueued - inside, in_collective=inside, collective="gloo:all_reduce",
            innermost="train.py:143 in main", stacks_key=f"k/rank-{rank}")]})


async def test_a_hangs_group_asks_its_other_nodes_at_once_and_the_run_asks_none_again(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    # node-0's rank waits in the collective node-1's rank never joined: a wait, not a hang, so node-0's watch
    # reports nothing. node-1's watch reports the hang; its group asks node-0 for its evidence right away.
    cluster = Cluster(nodes=nodes, evidence={
        nodes[0]: [RankEvidence(node=nodes[0], rank=0, state="S", answered=True, collectives_enqueued=21,
                                collectives_completed=20, in_collective=True, innermost="train.py:120 in main")]})
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), _hang_with_evidence(nodes[1], 1, False, 20, 1_000.0)],
        (2, nodes[0]): [_finished(25)], (2, nodes[1]): [_finished(25)]}

    run = await _run(env, cluster, _spec(nodes))

    assert isinstance(run.outcome, RunResult)
    [incident] = run.outcome.incidents
    assert (incident.kind, incident.node, incident.rank) == (IncidentKind.HANG, nodes[1], 1)
    assert incident.evidence.startswith("rank 1 is not inside a collective (entered 20) while its peers are")
    assert [c.node for c in cluster.inputs("collect_evidence")] == [nodes[0]]  # once: by the group
    assert all(w.evidence_with_event for w in _by_attempt(cluster.inputs("watch_ranks"), 1))


async def test_a_hang_only_some_watches_brought_evidence_for_asks_only_the_other_nodes(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, evidence={
        nodes[1]: [RankEvidence(node=nodes[1], rank=1, state="S", answered=True, collectives_enqueued=20,
                                collectives_completed=20, in_collective=False, innermost="train.py:120 in main")]})
    cluster.watch_script = {(1, nodes[0]): [_ready(10), _hang_with_evidence(nodes[0], 0, True, 21, 1_000.0)],
                            (1, nodes[1]): [_ready(10), BLOCK],  # its watch has not judged (yet)
                            (2, nodes[0]): [_finished(25)], (2, nodes[1]): [_finished(25)]}

    run = await _run(env, cluster, _spec(nodes))

    assert isinstance(run.outcome, RunResult)
    [incident] = run.outcome.incidents
    assert (incident.node, incident.rank) == (nodes[1], 1)
    assert [c.node for c in cluster.inputs("collect_evidence")] == [nodes[1]]



def _hang_every_node_reports(nodes: list[str], culprit: int, culprit_reports: WatchScriptEntry,
                             culprit_event: WatchEvent) -> Cluster:
    """Every node (one rank each) saves step 10; once it is committed every node's watch judges a hang with its
    evidence, a victim's rank inside the collective its peers wait in; the culprit's node reports
    `culprit_event` only once `culprit_reports` holds. Attempt 2 trains to the end a second after that report
    (a real attempt trains on for long after its hang's last report)."""
    cluster = Cluster(nodes=nodes)
    committed = Until(lambda: bool(cluster.inputs("commit_checkpoint")))
    reported: list[float] = []

    def a_second_after_the_culprits_report() -> bool:
        if not reported and any(e is culprit_event for e in cluster.calls["events"]):
            reported.append(time.monotonic())
        return bool(reported) and time.monotonic() - reported[0] > 1.0

    cluster.watch_script = {
        **{(1, n): [_ready(10), committed, _hang_with_evidence(n, i, True, 21, 1_000.0)]
           for i, n in enumerate(nodes)},
        (1, nodes[culprit]): [_ready(10), culprit_reports, culprit_event],
        **{(2, n): [_ready(20), Until(a_second_after_the_culprits_report), _finished(30)] for n in nodes}}
    return cluster


async def test_a_hang_of_a_run_whose_groups_stand_relaunches_before_every_nodes_evidence_is_in(
        env: WorkflowEnvironment) -> None:
    """At thousands of nodes every node's watch reports a hang with its evidence, and taking all of it in before
    the relaunch held a 4,096-node run's relaunch for 24 s. A run whose groups stand publishes the relaunch from
    the first reports and names the culprit as the rest come in: here the culprit's node reports only once the
    relaunch is published (a run that waited for its evidence would never relaunch), and the incident still
    names its rank, with no node asked for evidence."""
    nodes = _node_ids(80)
    cluster = _hang_every_node_reports(nodes, 50, Until(lambda: bool(cluster.inputs("publish_attempt"))),
                                       _hang_with_evidence(nodes[50], 50, False, 20, 1_000.5))

    run = await _run(env, cluster, _spec(nodes))

    result = run.outcome
    assert isinstance(result, RunResult), result
    [incident] = result.incidents
    assert (incident.kind, incident.action, incident.node, incident.rank) == (
        IncidentKind.HANG, Action.RESTART, nodes[50], 50)
    assert incident.evidence.startswith("rank 50 is not inside a collective (entered 20) while its peers are")
    assert incident.detail.startswith("rank 50 hung (outside-collective); the watch first saw rank ")
    assert incident.attribution_s is not None and incident.recovery_s is not None
    assert cluster.inputs("collect_evidence") == []
    assert [p.decision.attempt for p in cluster.inputs("publish_attempt")] == [2]
    assert result.final_checkpoint is not None and result.final_checkpoint.step == 20


async def test_a_gpu_fault_the_hung_culprits_node_reports_after_the_relaunch_sends_it_to_a_spare(
        env: WorkflowEnvironment) -> None:
    """The relaunch of a hang is published before every node has reported: a node whose late report of the
    hung attempt is a GPU fault is not trained on, its spare takes its place."""
    nodes, spares = _node_ids(80), ["spare-0"]
    cluster = _hang_every_node_reports(nodes, 50, Until(lambda: bool(cluster.inputs("publish_attempt"))),
                                       _event(WatchEventKind.GPU_UNHEALTHY, detail="GPU 0: XID 79"))
    cluster.spares = spares  # its agent polls, as a spare's does
    for node in nodes:  # attempt 2 trains on until the GPU fault relaunches it (attempt 3) on the spare
        cluster.watch_script[(2, node)] = [BLOCK]
        cluster.watch_script[(3, node)] = [_ready(20), _finished(30)]
    cluster.watch_script[(3, spares[0])] = [_ready(20), _finished(30)]

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares))

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert [(i.kind, i.action) for i in result.incidents] == [(IncidentKind.HANG, Action.RESTART),
                                                             (IncidentKind.GPU_UNHEALTHY, Action.REPLACE_NODE)]
    assert result.incidents[1].node == nodes[50]
    assert nodes[50] not in run.status.nodes and spares[0] in run.status.nodes



def test_a_late_report_of_a_hang_relaunched_early_adds_its_evidence_and_keeps_a_sick_gpu_as_an_incident() -> None:
    """What a standing group reports of the hung attempt after the relaunch was published: its nodes' evidence goes
    to the attribution (the culprit is named again from it), and a GPU fault among it is an incident of the
    attempt now running, so its node goes to a spare rather than being trained on."""
    nodes = _node_ids(3)
    incident = Incident(kind=IncidentKind.HANG, node=nodes[0], rank=0, attempt=1, detected_at=1_000.0)
    hang = HangAttribution(incident=incident, attempt=1, nodes=nodes, evidence={}, watch_rank=0,
                           watch_node=nodes[0])
    core = SimpleNamespace(live=Live(attributing=hang), status=SimpleNamespace(nodes=nodes))
    late_hang = _hang_with_evidence(nodes[1], 1, False, 20, 1_000.5).model_copy(update={"node": nodes[1],
                                                                                       "attempt": 1})
    sick = _event(WatchEventKind.GPU_UNHEALTHY, detail="GPU 0: XID 79").model_copy(update={"node": nodes[2],
                                                                                          "attempt": 1})
    report = GroupReport(group=0, attempt=2, result=NodeGroupWatchResult(incidents=[late_hang, sick]))

    kept = Watches(core)._late_evidence(report)  # type: ignore[arg-type]

    assert kept == [sick]
    assert hang.fresh and hang.evidence == {nodes[1]: late_hang.evidence}
    core.status.nodes = nodes[:2]  # a node the run has left already: no incident of it
    assert Watches(core)._late_evidence(report) == []  # type: ignore[arg-type]


# ------------------------------------------------------------------- controls at the continue-as-new boundary


def _trains_through_continue_as_new(cluster: Cluster, node: str, commits: int = 40) -> list[WatchScriptEntry]:
    """A watch that readies a checkpoint each time the one before committed: enough commits for a run with
    `max_history_events: 100` to continue as new, then blocks (still training)."""
    script: list[WatchScriptEntry] = []
    for k in range(1, commits + 1):
        script += [_ready(10 * k), Until(lambda k=k: len(cluster.inputs("commit_checkpoint")) >= k)]
    return [*script, BLOCK]


async def _continuing_as_new(handle: WorkflowHandle[Any, Any]) -> None:
    """Until the run has decided to continue as new and waits for its handlers: a committer returned commits,
    the task that took them completed, and no committer followed (the loop starts one while it goes on)."""
    from temporalio.api.enums.v1 import EventType

    while True:
        events = (await handle.fetch_history()).events
        scheduled = {e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                     and e.activity_task_scheduled_event_attributes.activity_type.name == "commit_checkpoints"}
        done = [e for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
                and e.activity_task_completed_event_attributes.scheduled_event_id in scheduled]
        if (len(events) >= 100 and len(done) == len(scheduled)
                and events[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED):
            return
        await asyncio.sleep(0.02)


async def test_a_drain_and_a_fault_sent_at_the_continue_as_new_boundary_each_take_effect_once(
        env: WorkflowEnvironment) -> None:
    """A `checkpoint_now` in flight holds the continue-as-new until its handler finishes; a fault injected and a
    drain accepted while the run waits are each done once: the fault by its handler before the run continues,
    the drain carried into the next history, where it moves the run off the node."""
    from temporalio.client import WorkflowUpdateStage

    nodes, spare = _node_ids(1), "node-spare"
    cluster = Cluster(nodes=nodes, spares=[spare])
    cluster.watch_script = {(1, nodes[0]): _trains_through_continue_as_new(cluster, nodes[0])}
    release = cluster.hold["request_checkpoint"] = asyncio.Event()
    first_run: list[str | None] = []

    async def at_the_boundary(handle: WorkflowHandle[Any, Any]) -> None:
        await _wait_for_phase(handle, Phase.RUNNING)
        first_run.append((await handle.describe()).run_id)
        await handle.start_update(TrainingRun.checkpoint_now, OperatorRequest(),
                                  wait_for_stage=WorkflowUpdateStage.ACCEPTED)
        await _continuing_as_new(handle)
        await handle.execute_update(TrainingRun.inject_fault, ChaosRequest(node=nodes[0], fault="slow"))
        await handle.execute_update(TrainingRun.drain_node, DrainRequest(node=nodes[0]))
        release.set()

    run = await _run(env, cluster, _spec(nodes, spare_nodes=[spare], max_history_events=100),
                     operator=at_the_boundary)

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert (await run.handle.describe()).run_id != first_run[0], "the run continued as new"
    assert len(cluster.inputs("inject_fault")) == 1
    drains = [s for s in cluster.inputs("stop_ranks") if s.reason is StopReason.DRAIN]
    assert [s.node for s in drains] == [nodes[0]]
    assert run.status.nodes == [spare] and result.attempts == 2


async def test_a_pause_and_resume_sent_at_the_continue_as_new_boundary_pause_once_and_go_on(
        env: WorkflowEnvironment) -> None:
    """`checkpoint_now` in flight holds the continue-as-new; a pause and a resume accepted meanwhile are
    carried: the next history stops the ranks once and relaunches, and the checkpoint request is made once."""
    from temporalio.client import WorkflowUpdateStage

    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes)
    cluster.watch_script = {(1, nodes[0]): _trains_through_continue_as_new(cluster, nodes[0])}
    release = cluster.hold["request_checkpoint"] = asyncio.Event()
    answers: list[Any] = []

    async def at_the_boundary(handle: WorkflowHandle[Any, Any]) -> None:
        await _wait_for_phase(handle, Phase.RUNNING)
        update = await handle.start_update(TrainingRun.checkpoint_now, OperatorRequest(),
                                           wait_for_stage=WorkflowUpdateStage.ACCEPTED)
        await _continuing_as_new(handle)
        for control in (TrainingRun.pause, TrainingRun.resume):
            answers.append((await handle.execute_update(control, OperatorRequest(reason="at the boundary"))).phase)
        release.set()
        answers.append(await update.result())

    run = await _run(env, cluster, _spec(nodes, max_history_events=100), operator=at_the_boundary)

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert answers[:2] == [Phase.RUNNING, Phase.RUNNING]
    target = answers[2].step
    assert [(r.step) for r in cluster.inputs("request_checkpoint")] == [None, target]
    pauses = [s for s in cluster.inputs("stop_ranks") if s.reason is StopReason.OPERATOR_PAUSE]
    assert len(pauses) == 1 and result.attempts == 2


async def test_a_shrunk_run_whose_node_returns_at_its_final_commit_finishes(env: WorkflowEnvironment) -> None:
    """Growing back never outranks finishing: the node is back in the pool when the last checkpoint commits,
    and the ranks finish right after it; the run completes instead of cancelling finished ranks to regrow."""
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes)
    committed = Until(lambda: len(cluster.inputs("commit_checkpoint")) >= 1)

    def repaired() -> bool:
        cluster.returned.add(nodes[1])
        return True

    last_committed = Until(lambda: any(c.step == 20 for c in cluster.inputs("commit_checkpoint")))
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), committed, ApplicationError("agent lost its ranks", type="AgentLost")],
        (2, nodes[0]): [Until(repaired), _ready(20), last_committed, _finished(20)],
    }

    run = await _run(env, cluster, _spec(nodes, min_nodes=1))

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert result.attempts == 2 and result.steps_completed == 20
    assert _by_attempt(cluster.inputs("launch_ranks"), 3) == []
    assert result.final_checkpoint is not None and result.final_checkpoint.step == 20
    assert run.status.nodes == [nodes[0]]


async def test_a_start_input_that_carries_state_is_refused(env: WorkflowEnvironment) -> None:
    """Only the run's own continue-as-new carries state: a start request with `carried` (which could name
    nodes the pool never leased it) fails at once, naming the field."""
    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes)
    forged = {"spec": _spec(nodes), "carried": {"status": {"nodes": ["someone-elses-node"], "attempt": 1}}}

    run = await _run(env, cluster, forged)

    assert "carried" in _failure_message(run.outcome)
    assert cluster.inputs("launch_ranks") == [] and cluster.inputs("acquire_nodes") == []


async def test_checkpoints_that_stop_committing_are_an_incident_until_they_commit_again(
        env: WorkflowEnvironment) -> None:
    """The store refuses every write: past `checkpoint.stale_after_s` without a commit the run records a
    `storage_unavailable` incident naming the store and the error, and trains on; the next commit closes it."""
    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes, committer_patience_s=0.5,
                      store_out="ClientError: An error occurred (InternalError) when calling PutObject")
    cluster.watch_script = {(1, nodes[0]): [_ready(10), BLOCK]}
    seen: list[RunStatus] = []

    async def watch_status(handle: WorkflowHandle[Any, Any]) -> None:
        while not (status := await handle.query(TrainingRun.status)).incidents:
            await asyncio.sleep(0.02)
        seen.append(status)
        cluster.store_out = None  # the store is back: the next pass commits
        while (await handle.query(TrainingRun.status)).latest_checkpoint is None:
            await asyncio.sleep(0.02)
        await handle.execute_update(TrainingRun.pause, OperatorRequest())  # done: end the test's run
        await _wait_for_phase(handle, Phase.PAUSED)
        await handle.execute_update(TrainingRun.abort, OperatorRequest(reason="test over"))

    run = await _run(env, cluster, _spec(nodes, checkpoint={"every_steps": 10, "stale_after_s": 2}),
                     operator=watch_status)

    [status] = seen
    [incident] = status.incidents
    assert (incident.kind, incident.action) == (IncidentKind.STORAGE_UNAVAILABLE, Action.REPORT)
    assert "no checkpoint committed for" in incident.detail and "(bound 2s)" in incident.detail
    assert "s3://" in incident.detail and "InternalError" in incident.detail
    assert status.phase is Phase.RUNNING, "training goes on"
    assert status.store_error is not None and status.at_risk_since is not None
    [closed] = run.status.incidents
    assert closed.recovery_s is not None, "the commit that came next closed it"
    assert run.status.store_error is None and run.status.last_commit_at is not None


async def test_a_run_that_finishes_while_the_store_is_out_waits_for_it_and_names_its_final_checkpoint(
        env: WorkflowEnvironment) -> None:
    """The soak's case: the store was restarting as the ranks finished. The run's last pass waits for it, and
    the result names the final checkpoint (the pass that gave up at once left the result naming none, or an
    older one that retention then deleted)."""
    nodes = _node_ids(1)
    cluster = Cluster(nodes=nodes, store_out="EndpointConnectionError: Could not connect to the endpoint URL")
    cluster.watch_script = {(1, nodes[0]): [_ready(10), _ready(20), _finished(20)]}

    async def store_comes_back(handle: WorkflowHandle[Any, Any]) -> None:
        while not any(r.quiet_s is not None for r in cluster.inputs("commit_checkpoints")):
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # the last pass has begun, and the store is still out
        cluster.store_out = None

    run = await _run(env, cluster, _spec(nodes, checkpoint={"every_steps": 10}), operator=store_comes_back)

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert result.final_checkpoint is not None and result.final_checkpoint.step == 20
    assert run.status.phase is Phase.COMPLETED


async def test_an_agent_that_shuts_down_and_comes_back_costs_no_node_no_spare_and_no_budget(
        env: WorkflowEnvironment) -> None:
    """A node agent restarting (an upgrade, `dev down` and `dev up`) ends its watch saying so; its ranks stop
    with it. The run waits for it to register again and relaunches on the same nodes: nothing cordoned, the
    spare still spare, and the restart budget untouched (a rolling upgrade restarts every agent once)."""
    nodes, spare = _node_ids(2), "node-spare"
    cluster = Cluster(nodes=nodes, spares=[spare], away_polls={nodes[1]: 2})
    committed = Until(lambda: len(cluster.inputs("commit_checkpoint")) >= 1)
    shutting_down = ApplicationError(f"node agent on {nodes[1]} is shutting down (an upgrade or a restart)",
                                     time.time(), type="AgentShutdown", non_retryable=True)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), committed, shutting_down],
        (2, nodes[0]): [_ready(20), _finished(20)],
        (2, nodes[1]): [_ready(20), _finished(20)],
    }

    run = await _run(env, cluster, _spec(nodes, spare_nodes=[spare], restarts={"max_restarts": 1}))

    result = run.outcome
    assert isinstance(result, RunResult), result
    [incident] = result.incidents
    assert (incident.kind, incident.node, incident.action) == (IncidentKind.AGENT_RESTART, nodes[1], Action.RESTART)
    assert incident.recovery_s is not None and incident.resumed_step == 10
    assert cluster.inputs("cordon_node") == [] and run.status.cordoned == []
    assert run.status.nodes == nodes and run.status.spares == [spare]
    assert len(cluster.inputs("find_agents_back")) == 3, "asked until the agent was back"
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 2), key=lambda r: r.node_rank)
    assert [(r.node, r.restore_step) for r in relaunches] == [(nodes[0], 10), (nodes[1], 10)]


async def test_an_agent_that_shuts_down_and_stays_away_is_a_lost_node(env: WorkflowEnvironment) -> None:
    nodes, spare = _node_ids(2), "node-spare"
    cluster = Cluster(nodes=nodes, spares=[spare], away_polls={nodes[1]: 10_000})
    committed = Until(lambda: len(cluster.inputs("commit_checkpoint")) >= 1)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), committed, ApplicationError("shutting down", time.time(), type="AgentShutdown",
                                                               non_retryable=True)],
    }

    run = await _run(env, cluster, _spec(nodes, spare_nodes=[spare], restarts={"agent_return_timeout_s": 4}))

    result = run.outcome
    assert isinstance(result, RunResult), result
    kinds = [(i.kind, i.action) for i in result.incidents]
    assert kinds == [(IncidentKind.AGENT_RESTART, Action.RESTART),
                     (IncidentKind.NODE_UNRESPONSIVE, Action.REPLACE_NODE)], result.incidents
    assert run.status.nodes == [nodes[0], spare] and [c.node for c in cluster.inputs("cordon_node")] == [nodes[1]]


async def test_a_run_paused_for_a_lost_node_resumes_by_itself_when_the_node_comes_back(
        env: WorkflowEnvironment) -> None:
    """No spare, no `min_nodes`: the run pauses, says what it waits for, asks the pool now and then, and once
    the node's agent has registered healthy again it relaunches on it with no operator (a restart counted)."""
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, away_polls={nodes[1]: 2}, committer_patience_s=0.5, watch_script={
        (1, nodes[0]): [BLOCK],
        (1, nodes[1]): [ApplicationError("agent lost its ranks", type="AgentLost")],
    })
    reasons: list[str] = []

    async def look(handle: WorkflowHandle[Any, Any]) -> None:
        """What the pause says while it lasts (the time-skipping server may skip the asks at once)."""
        while (status := await handle.query(TrainingRun.status)).attempt < 2:
            if status.phase is Phase.PAUSED and status.reason:
                reasons.append(status.reason)
            await asyncio.sleep(0.01)

    run = await _run(env, cluster, _spec(nodes, restarts={"heal_poll_s": 1}), operator=look)

    assert all(f"resumes by itself once {nodes[1]}'s agent registers" in r for r in reasons), reasons
    result = run.outcome
    assert isinstance(result, RunResult), result
    [incident] = result.incidents
    assert incident.action is Action.PAUSE and "came back: resumed by itself" in incident.detail
    assert len(cluster.inputs("find_agents_back")) == 3
    relaunches = sorted(_by_attempt(cluster.inputs("launch_ranks"), 2), key=lambda r: r.node_rank)
    assert [r.node for r in relaunches] == nodes and cluster.inputs("cordon_node") == []


# ------------------------------------------------------------------------------- spares park too (warm spares)


def _parked_on(cluster: Cluster) -> list[str]:
    return [p.node for p in cluster.inputs("park_ranks")]


def _spare_stops(cluster: Cluster, spares: Sequence[str]) -> list[tuple[str, int | None, StopReason | None]]:
    return [(s.node, s.attempt, s.reason) for s in cluster.inputs("stop_ranks") if s.node in spares]


async def test_a_run_whose_script_parks_has_its_spare_park_once_and_stops_it_when_it_ends(
        env: WorkflowEnvironment) -> None:
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares, parks=True)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), Until(lambda: bool(_parked_on(cluster))), _ready(20), _finished(30)],
        (1, nodes[1]): [_ready(10), _ready(20), _finished(30)],
    }

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares, env={"LR": "0.1"}, working_dir="/code"))

    assert isinstance(run.outcome, RunResult), run.outcome
    [park] = cluster.inputs("park_ranks")  # once, although a later commit could have asked again
    assert park.node == spares[0] and park.workflow_id == run.handle.id
    # The launch template the spare's launch will be given: what its agent keys the parked processes by.
    [master] = [r for r in cluster.inputs("launch_ranks") if r.node == nodes[0]]
    assert (park.launch.entrypoint, park.launch.env, park.launch.working_dir, park.launch.chain_id,
            park.launch.ranks_per_node) == (master.entrypoint, master.env, master.working_dir, master.chain_id,
                                            master.ranks_per_node)
    # The ranks finished by themselves; the spare's parked processes are stopped by the run.
    assert _spare_stops(cluster, spares) == [(spares[0], None, StopReason.RUN_ENDED)]
    assert all(s.node in spares for s in cluster.inputs("stop_ranks"))


async def test_a_script_that_never_calls_standby_is_never_parked_on_a_spare(env: WorkflowEnvironment) -> None:
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares, parks=False, watch_script={
        (1, nodes[0]): [_ready(10), _ready(20), _finished(30)],
        (1, nodes[1]): [_ready(10), _ready(20), _finished(30)],
    })

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares))

    assert isinstance(run.outcome, RunResult), run.outcome
    assert cluster.inputs("park_ranks") == [] and cluster.inputs("stop_ranks") == []


async def test_a_parked_spare_that_joins_is_not_parked_again_and_a_spare_reclaimed_later_is(
        env: WorkflowEnvironment) -> None:
    """The spare parks once the run has started; a GPU fault swaps it in (its launch takes what it parked: no
    second park on it, and it is no spare to stop at the end); the repaired node comes back as a spare and
    parks in its turn, and is the one stopped when the run ends."""
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares, parks=True)

    def repaired() -> bool:
        cluster.returned.add(nodes[1])
        return True

    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), Until(lambda: bool(_parked_on(cluster))),
                        _event(WatchEventKind.GPU_UNHEALTHY, detail="GPU 0: XID 79")],
        (2, nodes[0]): [_ready(20), Until(lambda: len(_parked_on(cluster)) == 2), _finished(30)],
        (2, spares[0]): [Until(repaired), _ready(20), Until(lambda: len(_parked_on(cluster)) == 2), _finished(30)],
    }

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares))

    result = run.outcome
    assert isinstance(result, RunResult), result
    assert [(i.kind, i.action) for i in result.incidents] == [(IncidentKind.GPU_UNHEALTHY, Action.REPLACE_NODE)]
    assert (run.status.nodes, run.status.spares) == ([nodes[0], spares[0]], [nodes[1]])
    assert _parked_on(cluster) == [spares[0], nodes[1]]
    # What the old spare parked went to its launch; the spare of the end is stopped with the run.
    assert _spare_stops(cluster, [*spares, nodes[1]]) == [(nodes[1], 1, StopReason.INCIDENT),
                                                          (nodes[1], None, StopReason.RUN_ENDED)]


async def test_a_paused_run_keeps_nothing_parked_on_its_spares_and_parks_them_again_as_it_resumes(
        env: WorkflowEnvironment) -> None:
    """A pause can last hours, and a parked process on a GPU spare holds memory: the pause stops them with the
    ranks, and the resume has the spare park again for the relaunch."""
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares, parks=True)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), BLOCK],
        (1, nodes[1]): [_ready(10), BLOCK],
        (2, nodes[0]): [_ready(20), Until(lambda: len(_parked_on(cluster)) == 2), _finished(30)],
        (2, nodes[1]): [_ready(20), _finished(30)],
    }
    paused: list[list[tuple[str, int | None, StopReason | None]]] = []

    async def pause_then_resume(handle: WorkflowHandle[Any, Any]) -> None:
        while not _parked_on(cluster):
            await asyncio.sleep(0.02)
        await handle.execute_update(TrainingRun.pause, OperatorRequest(reason="rack maintenance"))
        await _wait_for_phase(handle, Phase.PAUSED)
        paused.append(_spare_stops(cluster, spares))
        await handle.execute_update(TrainingRun.resume, OperatorRequest())

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares), operator=pause_then_resume)

    assert isinstance(run.outcome, RunResult), run.outcome
    assert paused == [[(spares[0], None, StopReason.OPERATOR_PAUSE)]], "stopped by the time the run says PAUSED"
    assert _parked_on(cluster) == [spares[0], spares[0]]
    assert _spare_stops(cluster, spares) == [(spares[0], None, StopReason.OPERATOR_PAUSE),
                                             (spares[0], None, StopReason.RUN_ENDED)]


async def test_a_run_that_fails_stops_its_parked_spares_with_its_ranks(env: WorkflowEnvironment) -> None:
    nodes, spares = _node_ids(2), _node_ids(1)
    cluster = Cluster(nodes=nodes, spares=spares, parks=True)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), Until(lambda: bool(_parked_on(cluster))), _exited(1)],
        (1, nodes[1]): [_ready(10), BLOCK],
    }

    run = await _run(env, cluster, _spec(nodes, spare_nodes=spares, restarts={"max_restarts": 0}))

    assert isinstance(run.outcome, WorkflowFailureError)
    ended = {s.node for s in cluster.inputs("stop_ranks") if s.attempt is None}
    assert ended == {*nodes, spares[0]}, "nothing parked outlives the run"
