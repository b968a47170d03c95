"""Simulated nodes and an in-memory store for the node-scale benchmark (`infra/bench/nodes.py`).

One stand-in per activity name, each a thin method over a small in-memory model, so that when an activity's
contract changes only its method changes:

- `StandinNodes`: every node-pinned activity the run calls (check, download, launch, rejoin, watch, stop,
  request a checkpoint, inject a fault) for every simulated node, served from ONE process. Per node it keeps which
  attempt runs there, from which step, and which checkpoint steps its ranks have saved. An attempt's ranks
  start stepping once every node of the attempt has launched (the rendezvous), at `--step-time` seconds a step,
  save a checkpoint every `checkpoint_every` steps, and finish at the step the entrypoint names
  (`standin --steps N --step-time S`).
- `StandinStore`: `find_checkpoint`, the committer (`commit_checkpoints`) and `publish_attempt` over manifests
  kept in memory, in the controller process; every commit is appended to a JSON-lines file the benchmark reads.

Queues: serving 4,096 `trainguard-node-<node>` queues would take 4,096 Workers. `install_routing` replaces
`trainguard.node_task_queue` (and every module's own reference to it) by `shared_queue`, which maps each node
onto one of a few shared queues by crc32(node) % num_queues, in the controller process and in the stand-ins'
process alike, before any worker starts. The Temporal cost of an activity (its events, the pending count, its
payloads) does not depend on which queue it is on.

Faults, as the real agent carries them out (`activities/chaos.py`):
- `crash`: one rank of the node exits (-9); the node's watch reports RANK_EXITED. Ranks on other nodes stop
  stepping (they block in the next collective) but do not exit, until the run stops them.
- `hang`: one rank of the node is stopped (SIGSTOP); no rank of the attempt steps on, and every node's watch
  judges a hang once its ranks are silent past the hang bound (`health.hang_floor_s`, `hang_step_multiplier`
  step times) and returns HANG with its ranks' evidence, as a real watch does (`evidence_with_event`): the
  stopped rank in state `T` one collective behind, every other rank asleep inside the next one. As the agent's
  watch, one that follows decisions and whose ranks all wait for a peer holds its report for
  `PEER_HANG_REPORT_DELAY_S` and takes up the run's relaunch instead if it comes first.
- `node-down`: the node's watch stops heartbeating and never returns, so Temporal times it out (the watch's
  heartbeat timeout); every later call to the node never completes (a real dead agent would never start it,
  and its schedule-to-start timeout would fire instead); the other nodes' ranks stop stepping, as for a crash.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import sys
import time
import zlib
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.evidence import PEER_HANG_REPORT_DELAY_S, waits_on_a_peer
from activities.models import (
    AttemptDecision,
    PublishAttemptInput,
    CheckNodeInput,
    CheckNodeResult,
    CollectEvidenceInput,
    CollectEvidenceResult,
    CommitCheckpointsInput,
    CommitCheckpointsResult,
    CommittedCheckpoint,
    DownloadShardsInput,
    DownloadShardsResult,
    FindCheckpointInput,
    FindCheckpointResult,
    GpuHealth,
    InjectFaultInput,
    InjectFaultResult,
    LaunchRanksInput,
    LaunchRanksResult,
    Manifest,
    RejoinRanksInput,
    RankEvidence,
    RejoinRanksResult,
    RequestCheckpointInput,
    RequestCheckpointResult,
    StopRanksInput,
    StopRanksResult,
    WatchEvent,
    WatchEventKind,
    WatchRanksInput,
)
from trainguard.error_types import ErrorType
from trainguard.faults import FaultKind
from trainguard.models import CheckpointRef
from trainguard.spec import HealthSpec

QUEUE_PREFIX = "trainguard-bench-nodes"
HEARTBEAT_EVERY_S = 1.0
"""How often a stand-in watch heartbeats; the SDK sends at most one per throttle interval (4 s here) anyway.
Waking every 2 s instead saved the one process that simulates the nodes CPU, but on a loaded machine its
heartbeats then reached Temporal past the 10 s timeout and live nodes read as lost (1,024 nodes, load 6).
A run of more nodes than `HEARTBEATS_PER_S` asks for fewer (`WatchRanksInput.heartbeat_every_s`): its
stand-ins wake that often, as the agent's watch heartbeats that often."""
SHARD_BYTES = 1 << 30
"""The size every simulated shard claims (1 GiB): it travels only as a number."""


# --------------------------------------------------------------------------------------------- queues


def shared_queue(node: str, num_queues: int) -> str:
    """The shared task queue a node's activities go to: crc32(node) % num_queues."""
    return f"{QUEUE_PREFIX}-{zlib.crc32(node.encode()) % num_queues:02d}"


def shared_queues(num_queues: int) -> list[str]:
    return [f"{QUEUE_PREFIX}-{index:02d}" for index in range(num_queues)]


def install_routing(num_queues: int) -> Callable[[str], str]:
    """Replace `trainguard.node_task_queue`, and every loaded module's own reference to it, by the shared-queue
    routing. Call it after importing the workflows and activities and before any worker starts: workflow code
    imports it again from `trainguard` inside the sandbox, and gets the replacement."""
    import trainguard

    original = trainguard.node_task_queue

    def node_task_queue(node: str) -> str:
        return shared_queue(node, num_queues)

    node_task_queue.__doc__ = f"Benchmark routing: node -> one of {num_queues} shared queues (crc32)."
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, "node_task_queue", None) is original:
            module.node_task_queue = node_task_queue  # type: ignore[attr-defined]
    return node_task_queue


# ------------------------------------------------------------------------------------------ the nodes


@dataclass(slots=True)
class Attempt:
    """One attempt of one run across its nodes: its ranks step once every node has launched."""

    num_nodes: int
    start_step: int
    final_step: int
    every: int
    step_s: float
    launched: dict[str, float] = field(default_factory=dict)
    """Node -> Unix time its launch returned."""
    started_at: float | None = None
    """When the last node launched (the rendezvous completes): the first step is one step time later."""
    halted_at: float | None = None
    """When a rank of the attempt crashed or its node went down: its peers block in the next collective, so no
    rank of the attempt steps past it (and none can finish before the run notices)."""
    hung: tuple[str, int] | None = None
    """(node, global rank) of the rank stopped at `halted_at` (`hang`): every node's watch then judges a hang."""

    def step(self, now: float) -> int:
        if self.started_at is None:
            return self.start_step
        until = now if self.halted_at is None else min(now, self.halted_at)
        return min(self.final_step, self.start_step + math.floor((until - self.started_at) / self.step_s))

    def saved(self, now: float, after: int) -> list[int]:
        """Checkpoint steps every rank has saved by `now`, newer than `after`."""
        top = self.step(now)
        first = (max(after, self.start_step) // self.every + 1) * self.every
        return [s for s in range(first, top + 1, self.every) if s < self.final_step]

    def time_of(self, step: int) -> float:
        assert self.started_at is not None
        return self.started_at + (step - self.start_step) * self.step_s


@dataclass(slots=True)
class NodeState:
    """What one node runs for one run."""

    attempt: int
    node_rank: int
    ranks_per_node: int
    stopped: bool = False
    crashed: tuple[int, float] | None = None
    """(global rank, Unix time) of a crashed rank."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def ranks(self) -> list[int]:
        first = self.node_rank * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    def poke(self) -> None:
        self.changed.set()


def parse_entrypoint(entrypoint: list[str]) -> tuple[int, float]:
    """`standin --steps N --step-time S` -> (N, S)."""
    args = dict(zip(entrypoint[1::2], entrypoint[2::2]))
    return int(args["--steps"]), float(args["--step-time"])


def digest(final_step: int) -> str:
    return hashlib.sha256(f"standin-final-{final_step}".encode()).hexdigest()


def hang_bound_s(health: HealthSpec, step_s: float) -> float:
    """How long a rank stepping every `step_s` may be silent before a watch judges it hung
    (`activities.progress.silence_bound_s`, past its first steps, no grace: the run names the culprit)."""
    return min(max(health.hang_floor_s, health.hang_step_multiplier * step_s), health.hang_max_s)


class StandinNodes:
    """Every simulated node's activities. State is keyed by (run, node), the run being the root workflow id."""

    def __init__(self, runs: list[str] | None = None, records: NodeRecords | None = None) -> None:
        self.records = records or NodeRecords(Path("/nonexistent"))
        """Where the watches "upload": the stand-in of the store's node records, which the committer reads."""
        self.runs = list(runs or [])
        """The runs' root workflow ids: a call from any workflow whose id starts with one (a child workflow per
        node group, say) counts for that run, so a node's state and an attempt's rendezvous are the run's."""
        self.nodes: dict[tuple[str, str], NodeState] = {}
        self.attempts: dict[tuple[str, int], Attempt] = {}
        self.down: dict[str, float] = {}
        """Node -> when it went down."""
        self.calls: dict[str, int] = {}

    # --------------------------------------------------------------------------------- helpers
    def run_of(self, workflow_id: str) -> str:
        return next((run for run in self.runs if workflow_id.startswith(run)), workflow_id)

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    async def _unless_down(self, node: str) -> None:
        """A node that is down never answers: the call waits (without heartbeats) until Temporal gives up."""
        if node in self.down:
            await asyncio.Event().wait()

    def launch_times(self, workflow_id: str, attempt: int) -> dict[str, float]:
        found = self.attempts.get((workflow_id, attempt))
        return dict(found.launched) if found else {}

    def _current(self, workflow_id: str, node: str, attempt: int, or_newer: bool = False) -> NodeState:
        """The node's state of the run at `attempt` (`or_newer`: at any attempt, as a watch that follows
        decisions takes it)."""
        state = self.nodes.get((workflow_id, node))
        if state is None or (state.attempt != attempt and not or_newer):
            raise ApplicationError(f"node {node} has no ranks of {workflow_id} attempt {attempt}",
                                   type=ErrorType.NO_SUCH_ATTEMPT, non_retryable=True)
        return state

    # ------------------------------------------------------------------------------ activities
    @activity.defn(name="check_node")
    async def check_node(self, request: CheckNodeInput) -> CheckNodeResult:
        self._count("check_node")
        await self._unless_down(request.node)
        return CheckNodeResult(node=request.node, host=f"{request.node}.sim", gpu=GpuHealth())

    @activity.defn(name="download_shards")
    async def download_shards(self, request: DownloadShardsInput) -> DownloadShardsResult:
        self._count("download_shards")
        await self._unless_down(request.node)
        ranks = request.ranks or [s.rank for s in request.shards]
        return DownloadShardsResult(restore_dir=f"/sim/{request.node}/attempt-{request.attempt}",
                                    num_bytes=SHARD_BYTES * len(ranks), tiers={r: "local" for r in ranks})

    @activity.defn(name="launch_ranks")
    async def launch_ranks(self, request: LaunchRanksInput) -> LaunchRanksResult:
        self._count("launch_ranks")
        await self._unless_down(request.node)
        key = (self.run_of(request.workflow_id), request.node)
        current = self.nodes.get(key)
        if current is not None and current.attempt > request.attempt:
            raise ApplicationError(f"attempt {request.attempt} is older than {current.attempt}",
                                   type=ErrorType.STALE_ATTEMPT,
                                   non_retryable=True)
        final, step_s = parse_entrypoint(request.entrypoint)
        attempt = self.attempts.setdefault((key[0], request.attempt), Attempt(
            num_nodes=request.num_nodes, start_step=request.restore_step, final_step=final,
            every=request.checkpoint_every, step_s=step_s))
        adopted = current is not None and current.attempt == request.attempt
        if not adopted:
            if current is not None:
                current.stopped = True
                current.poke()
            self.nodes[key] = NodeState(attempt=request.attempt, node_rank=request.node_rank,
                                        ranks_per_node=request.ranks_per_node)
        now = time.time()
        attempt.launched.setdefault(request.node, now)
        if attempt.started_at is None and len(attempt.launched) >= attempt.num_nodes:
            attempt.started_at = now
        return LaunchRanksResult(node=request.node, master_addr=request.master_addr or f"{request.node}.sim",
                                 master_port=request.master_port or 29500 + request.attempt,
                                 pids=[100_000 + r for r in self.nodes[key].ranks()], adopted=adopted)

    @activity.defn(name="rejoin_ranks")
    async def rejoin_ranks(self, request: RejoinRanksInput) -> RejoinRanksResult:
        """The benchmark's runs restart by relaunch only: an in-process rejoin falls back to it."""
        self._count("rejoin_ranks")
        raise ApplicationError(f"stand-in node {request.node} does not rejoin in process",
                               type=ErrorType.NO_SUCH_ATTEMPT,
                               non_retryable=True)

    @activity.defn(name="watch_ranks")
    async def watch_ranks(self, request: WatchRanksInput) -> WatchEvent:
        self._count("watch_ranks")
        await self._unless_down(request.node)
        run = self.run_of(request.workflow_id)
        current = self.nodes.get((run, request.node))
        if request.launch is not None and (current is None or current.attempt < request.launch.attempt):
            # As the real agent: a relaunch's first watch downloads and launches the node's ranks itself.
            if request.download is not None:
                await self.download_shards(request.download)
            await self.launch_ranks(request.launch)
        follow = request.follow_decisions and request.checkpoints is not None
        state = self._current(run, request.node, request.attempt, or_newer=follow)  # as the agent's watch
        attempt = self.attempts[(run, state.attempt)]
        began = time.monotonic()
        uploaded = -1
        report_start = request.report_start
        next_heartbeat = began + request.first_heartbeat_s()  # as the agent's watch
        next_decision = began
        decision: AttemptDecision | None = None
        held: tuple[Attempt, float, WatchEvent] | None = None  # as the agent's watch: a peer's hang, held
        while True:
            if request.node in self.down:
                await asyncio.Event().wait()  # no heartbeat, no answer: the heartbeat timeout notices
            if follow and time.monotonic() >= next_decision:
                # As the real agent: take up a newer attempt the run decided (read from the store).
                assert request.checkpoints is not None
                next_decision = time.monotonic() + request.decision_every_s
                decision = self.records.decision(request.checkpoints.run_prefix)
                if (decision is not None and decision.attempt > state.attempt and request.node not in decision.leaving
                        and request.node not in decision.launched):
                    await self._take_up(decision, request.node, state)
            newer = self.nodes.get((run, request.node)) if follow else None
            if newer is not None and newer is not state and newer.attempt > state.attempt:
                # ...or launched here by an activity of its own (the master node): watch that one.
                assert request.checkpoints is not None
                state, attempt, uploaded = newer, self.attempts[(run, newer.attempt)], -1
                decision = self.records.decision(request.checkpoints.run_prefix)
                # Launched by an activity before the decision was published: the master, which reports.
                report_start = decision is None or decision.attempt < state.attempt or request.node in decision.starters
            if follow and request.after_attempt is not None and state.attempt <= request.after_attempt:
                # As the agent's watch: reported already, it waits for the next attempt (or for its leaving).
                if time.monotonic() >= next_heartbeat:
                    next_heartbeat = time.monotonic() + (request.heartbeat_every_s or 0.0)
                    activity.heartbeat({"node": request.node, "attempt": state.attempt})
                leaving = decision is not None and decision.attempt > state.attempt and request.node in decision.leaving
                if leaving or time.monotonic() - began > request.max_duration_s:
                    return WatchEvent(kind=WatchEventKind.KEEPALIVE, node=request.node, detected_at=time.time(),
                                      attempt=state.attempt)
                state.changed.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(state.changed.wait(), max(0.0, next_decision - time.monotonic()) + 0.001)
                continue
            now = time.time()
            step = attempt.step(now)
            first_step_at = attempt.time_of(attempt.start_step + 1) if step > attempt.start_step else None

            def event(kind: WatchEventKind, **fields: object) -> WatchEvent:
                return WatchEvent(kind=kind, node=request.node, detected_at=now, first_step_at=first_step_at,
                                  step=step, attempt=state.attempt if follow else None,
                                  **fields)

            if time.monotonic() >= next_heartbeat:  # as the agent's watch: not more often than asked
                next_heartbeat = time.monotonic() + (request.heartbeat_every_s or 0.0)
                activity.heartbeat({"node": request.node, "attempt": state.attempt,
                                    "steps": {str(r): step for r in state.ranks()}})
            if state.stopped and not (follow and self.nodes.get((run, request.node)) is not state):
                rank = state.ranks()[0]
                return event(WatchEventKind.RANK_EXITED, rank=rank, exit_code=-15, detail=f"rank {rank} stopped")
            if held is not None and held[0] is attempt and not state.stopped:
                if time.monotonic() >= held[1]:
                    return held[2]
            elif attempt.hung is not None and attempt.halted_at is not None and not state.stopped and (
                    now >= attempt.halted_at + hang_bound_s(request.health, attempt.step_s)):
                culprit = attempt.hung[0] == request.node
                evidence = self._evidence(request.node, state, attempt, step)
                found = event(WatchEventKind.HANG, rank=attempt.hung[1] if culprit else state.ranks()[0],
                              fault_at=attempt.halted_at, occurred_at=attempt.halted_at if culprit else None,
                              evidence=evidence,
                              detail=f"rank {attempt.hung[1] if culprit else state.ranks()[0]} made no progress "
                                     f"for {now - attempt.halted_at:.1f}s (stand-in hang)")
                if not (follow and waits_on_a_peer(evidence)):
                    return found
                held = (attempt, time.monotonic() + PEER_HANG_REPORT_DELAY_S, found)
            if state.crashed is not None:
                rank, at = state.crashed
                return event(WatchEventKind.RANK_EXITED, rank=rank, exit_code=-9, fault_at=at, occurred_at=at,
                             detail=f"rank {rank} was killed by SIGKILL (stand-in crash)")
            ready = attempt.saved(now, max(request.reported_step, uploaded))
            if ready and request.checkpoints is not None and not state.stopped:
                # As the real agent: upload the node's shards of each saved step, then write its node record.
                for step_saved in ready:
                    self.records.write(request.checkpoints.run_prefix, step_saved, request.node, state.attempt,
                                       state.ranks(), step)
                uploaded = max(ready)
            if report_start and first_step_at is not None:
                return event(WatchEventKind.STARTED)
            if step >= attempt.final_step:
                return event(WatchEventKind.FINISHED, state_digest=digest(attempt.final_step),
                             mean_step_s=attempt.step_s)
            if time.monotonic() - began > request.max_duration_s:
                return event(WatchEventKind.KEEPALIVE)
            wait = min(request.heartbeat_every_s or HEARTBEAT_EVERY_S,
                       max(0.0, next_heartbeat - time.monotonic()) + 0.001)
            if follow:
                wait = min(wait, max(0.0, next_decision - time.monotonic()) + 0.001)
            if held is not None and held[0] is attempt:
                wait = min(wait, max(0.0, held[1] - time.monotonic()) + 0.001)
            elif attempt.hung is not None and attempt.halted_at is not None:
                wait = min(wait, max(0.0, attempt.halted_at + hang_bound_s(request.health, attempt.step_s) - now)
                           + 0.001)
            if attempt.started_at is not None and attempt.halted_at is None:
                upcoming = min((step // attempt.every + 1) * attempt.every, attempt.final_step)
                wait = min(wait, max(0.0, attempt.time_of(upcoming) - now) + 0.001)
            state.changed.clear()
            try:
                await asyncio.wait_for(state.changed.wait(), wait)
            except TimeoutError:
                pass

    @staticmethod
    def _evidence(node: str, state: NodeState, attempt: Attempt, step: int) -> list[RankEvidence]:
        """What the node's ranks show when asked in a hang: the stopped one outside the collective its peers
        wait in."""
        entered = 2 * step  # two collectives a step, say
        return [RankEvidence(node=node, rank=rank, state="T" if attempt.hung == (node, rank) else "S",
                             answered=attempt.hung != (node, rank), step=step,
                             collectives_enqueued=entered if attempt.hung == (node, rank) else entered + 1,
                             collectives_completed=entered, in_collective=attempt.hung != (node, rank),
                             collective="gloo:all_reduce", innermost="train.py:120 in train_step")
                for rank in state.ranks()]

    @activity.defn(name="collect_evidence")
    async def collect_evidence(self, request: CollectEvidenceInput) -> CollectEvidenceResult:
        self._count("collect_evidence")
        await self._unless_down(request.node)
        run = self.run_of(request.workflow_id)
        state = self._current(run, request.node, request.attempt)
        attempt = self.attempts[(run, state.attempt)]
        return CollectEvidenceResult(node=request.node,
                                     ranks=self._evidence(request.node, state, attempt, attempt.step(time.time())))

    async def _take_up(self, decision: AttemptDecision, node: str, state: NodeState) -> None:
        """As the real agent's watch: the run's decision, taken up in place at the node's rank."""
        if decision.download is not None:
            per_node = state.ranks_per_node
            await self.download_shards(decision.download.model_copy(update={
                "node": node, "ranks": list(range(state.node_rank * per_node, (state.node_rank + 1) * per_node))}))
        await self.launch_ranks(decision.launch.model_copy(update={"node": node, "node_rank": state.node_rank}))

    @activity.defn(name="stop_ranks")
    async def stop_ranks(self, request: StopRanksInput) -> StopRanksResult:
        self._count("stop_ranks")
        await self._unless_down(request.node)
        state = self.nodes.get((self.run_of(request.workflow_id), request.node))
        if state is None or state.stopped or (request.attempt is not None and state.attempt > request.attempt):
            return StopRanksResult(stopped=0)
        state.stopped = True
        state.poke()
        return StopRanksResult(stopped=state.ranks_per_node)

    @activity.defn(name="request_checkpoint")
    async def request_checkpoint(self, request: RequestCheckpointInput) -> RequestCheckpointResult:
        self._count("request_checkpoint")
        await self._unless_down(request.node)
        self._current(self.run_of(request.workflow_id), request.node, request.attempt)
        attempt = self.attempts[(self.run_of(request.workflow_id), request.attempt)]
        return RequestCheckpointResult(node=request.node, step=attempt.step(time.time()), step_time_s=attempt.step_s)

    @activity.defn(name="inject_fault")
    async def inject_fault(self, request: InjectFaultInput) -> InjectFaultResult:
        self._count("inject_fault")
        await self._unless_down(request.node)
        now = time.time()
        state = self.nodes.get((self.run_of(request.workflow_id), request.node))
        if state is None or state.stopped:
            raise ApplicationError(f"no live rank of {request.workflow_id} on {request.node}",
                                   type=ErrorType.NO_SUCH_RANK,
                                   non_retryable=True)
        attempt = self.attempts.get((self.run_of(request.workflow_id), state.attempt))
        if attempt is not None and request.fault in (FaultKind.NODE_DOWN, FaultKind.CRASH):
            attempt.halted_at = attempt.halted_at or now
        if request.fault == FaultKind.NODE_DOWN:
            self.down[request.node] = now
            state.poke()
            return InjectFaultResult(node=request.node, rank=-1, pid=-1, injected_at=now)
        if request.fault == FaultKind.HANG and attempt is not None:
            rank = request.rank if request.rank is not None else state.ranks()[0]
            attempt.halted_at, attempt.hung = attempt.halted_at or now, (request.node, rank)
            for other in [s for (r, _), s in self.nodes.items() if r == self.run_of(request.workflow_id)]:
                other.poke()  # every watch sets its wake-up by the hang bound
            return InjectFaultResult(node=request.node, rank=rank, pid=100_000 + rank, injected_at=now)
        if request.fault == FaultKind.CRASH:
            rank = request.rank if request.rank is not None else state.ranks()[0]
            state.crashed = state.crashed or (rank, now)
            state.poke()
            return InjectFaultResult(node=request.node, rank=rank, pid=100_000 + rank, injected_at=state.crashed[1])
        raise ApplicationError(f"the stand-in nodes carry out crash, hang and node-down, not {request.fault!r}",
                               type=ErrorType.BAD_FAULT, non_retryable=True)

    def activities(self) -> list[Callable[..., object]]:
        return [self.check_node, self.download_shards, self.launch_ranks, self.rejoin_ranks, self.watch_ranks,
                self.stop_ranks, self.request_checkpoint, self.inject_fault, self.collect_evidence]


# ------------------------------------------------------------------------------------------ the store


def manifest_key(run_prefix: str, step: int) -> str:
    return f"{run_prefix}/step-{step:08d}/manifest.json"


@dataclass(frozen=True)
class NodeRecords:
    """The node records the real agents write to the store (`<run>/step-N/nodes/<node>.json`), as small files
    under one folder: the stand-in watches (in the benchmark's process) write them, the stand-in committer (in
    the controller's) lists and reads them, as the real committer lists and reads the store."""

    root: Path
    _decisions: dict[str, tuple[float, AttemptDecision | None]] = field(default_factory=dict, compare=False,
                                                                         repr=False)
    """Run prefix -> when the decision was read last in this process, and what it said."""

    def _step_dir(self, run_prefix: str, step: int) -> Path:
        return self.root / hashlib.sha256(run_prefix.encode()).hexdigest()[:16] / f"{step:08d}"

    def write(self, run_prefix: str, step: int, node: str, attempt: int, ranks: list[int], node_step: int) -> None:
        folder = self._step_dir(run_prefix, step)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{node}.json").write_text(json.dumps({"attempt": attempt, "ranks": ranks, "node_step": node_step}))

    def steps(self, run_prefix: str) -> list[int]:
        folder = self._step_dir(run_prefix, 0).parent
        return sorted(int(d.name) for d in folder.iterdir()) if folder.is_dir() else []

    def read(self, run_prefix: str, step: int) -> list[dict[str, object]]:
        return [json.loads(p.read_text()) for p in self._step_dir(run_prefix, step).glob("*.json")]

    def _decision_file(self, run_prefix: str) -> Path:
        return self.root / "decisions" / f"{hashlib.sha256(run_prefix.encode()).hexdigest()[:16]}.json"

    def publish(self, run_prefix: str, decision: AttemptDecision) -> None:
        """The run's decision (`<run>/attempt.json` in the store): written whole, then renamed into place."""
        path = self._decision_file(run_prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(".tmp")
        temp.write_text(decision.model_dump_json())
        temp.replace(path)

    def decision(self, run_prefix: str) -> AttemptDecision | None:
        """The run's decision, read at most once a `DECISION_CACHE_S` per run for all the nodes of this
        process (each real agent reads the store's object itself)."""
        now = time.monotonic()
        cached = self._decisions.get(run_prefix)
        if cached is not None and now - cached[0] < DECISION_CACHE_S:
            return cached[1]
        path = self._decision_file(run_prefix)
        found = AttemptDecision.model_validate_json(path.read_text()) if path.is_file() else None
        self._decisions[run_prefix] = (now, found)
        return found


DECISION_CACHE_S = 0.25


class StandinStore:
    """The checkpoint store's controller-side activities over manifests kept in memory. Built as `workers.controller`
    builds `StoreActivities` (its manifest-tag secret and the pool's token are not needed here); `commits_file` is
    set before the worker starts."""

    commits_file: Path | None = None
    """Each commit appends {"at", "step", "attempt", "shards"} here, for the benchmark to read."""
    records: NodeRecords | None = None
    """The nodes' records, as the stand-in watches write them."""

    def __init__(self, secret: bytes | None = None, token: str | None = None) -> None:
        self.manifests: dict[str, dict[int, Manifest]] = {}
        """Run prefix -> step -> manifest."""

    @activity.defn(name="find_checkpoint")
    async def find_checkpoint(self, request: FindCheckpointInput) -> FindCheckpointResult:
        smallest = min(request.world_size, request.min_world_size or request.world_size)
        largest = max(request.world_size, request.max_world_size or 0)
        usable = [m for step, m in self.manifests.get(request.run_prefix, {}).items()
                  if step not in request.exclude_steps and smallest <= m.world_size <= largest]
        if not usable:
            return FindCheckpointResult()
        newest = max(usable, key=lambda m: m.step)
        return FindCheckpointResult(manifest=newest, manifest_key=manifest_key(request.run_prefix, newest.step))

    @activity.defn(name="commit_checkpoints")
    async def commit_checkpoints(self, request: CommitCheckpointsInput) -> CommitCheckpointsResult:
        """As the real committer (`activities/checkpoint_store.py`): commit each step whose node records of the
        attempts sharing the live state cover the world, keep `keep_last`, return the commits."""
        assert self.records is not None
        deadline = time.monotonic() + request.max_duration_s
        last_change, seen = time.monotonic(), 0
        while True:
            activity.heartbeat()
            commits, pending, count = await asyncio.to_thread(self._commit_pass, request)
            if commits:
                return CommitCheckpointsResult(commits=commits)
            now = time.monotonic()
            if count != seen:
                last_change, seen = now, count
            if now >= deadline or (request.quiet_s is not None and (not pending or now - last_change >= request.quiet_s)):
                return CommitCheckpointsResult()
            await asyncio.sleep(request.poll_interval_s)

    def _commit_pass(self, request: CommitCheckpointsInput) -> tuple[list[CommittedCheckpoint], bool, int]:
        assert self.records is not None
        steps = self.manifests.setdefault(request.run_prefix, {})
        commits: list[CommittedCheckpoint] = []
        pending, count = False, 0
        for step in self.records.steps(request.run_prefix):
            if step <= request.after_step or step in steps:
                continue
            found = [r for r in self.records.read(request.run_prefix, step)
                     if request.min_attempt <= int(r["attempt"]) <= request.attempt]  # type: ignore[call-overload]
            count += len(found)
            ranks = sorted(rank for r in found for rank in r["ranks"])  # type: ignore[attr-defined]
            if ranks != list(range(request.world_size)):
                pending = pending or bool(found)
                continue
            steps[step] = Manifest(workflow_id=request.workflow_id, step=step, world_size=request.world_size,
                                   attempt=request.attempt, created_at=time.time())
            self._log(step, request.attempt, request.world_size, request.workflow_id)
            commits.append(CommittedCheckpoint(
                ref=CheckpointRef(step=step, manifest_key=manifest_key(request.run_prefix, step),
                                  bucket=request.bucket, world_size=request.world_size,
                                  total_bytes=SHARD_BYTES * request.world_size),
                step=min(int(r["node_step"]) for r in found)))  # type: ignore[call-overload]
        if commits:
            for old in sorted(steps)[:-request.keep_last]:
                del steps[old]
        return commits, pending, count

    def _log(self, step: int, attempt: int, shards: int, workflow_id: str) -> None:
        if self.commits_file is None:
            return
        line = {"at": time.time(), "step": step, "attempt": attempt, "shards": shards, "workflow_id": workflow_id}
        with self.commits_file.open("a") as out:
            out.write(json.dumps(line) + "\n")

    @activity.defn(name="publish_attempt")
    async def publish_attempt(self, request: PublishAttemptInput) -> None:
        assert self.records is not None
        self.records.publish(request.run_prefix, request.decision)
