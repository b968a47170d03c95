"""The Python client: start runs, watch them, inject faults, get results.

```python
from trainguard.client import TrainguardClient

tg = await TrainguardClient.connect()               # the stack TRAINGUARD_TEMPORAL_ADDRESS, TRAINGUARD_PORT_BASE
                                                     # or TRAINGUARD_HOME names (trainguard.settings)
run_id = await tg.start_run(spec)                    # a RunSpec, a dict, or a path to a JSON file
print(await tg.status(run_id))                       # phase, attempt, per-rank steps, incidents
result = await tg.result(run_id)                     # waits; RunResult
```
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowHistory
from temporalio.service import RPCError, RPCStatusCode
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from trainguard import NODE_GROUP_WATCH_WORKFLOW, READ_LOG_WORKFLOW_TYPE, TASK_QUEUE, WORKFLOW_TYPE
from trainguard.connect import connect
from trainguard.protocol import WatchHeartbeat, safe_name
from trainguard.errors import NO_POLLER, NoController, no_controller_hint
from trainguard.ids import validate_workflow_id
from trainguard.models import (
    ChaosRequest,
    CheckpointNowResult,
    DrainRequest,
    InjectFaultResult,
    NodeRequest,
    OperatorRequest,
    PoolNode,
    PoolStatus,
    OperatorResult,
    ReadRankLogInput,
    ReadRankLogResult,
    Phase,
    RunResult,
    RunStatus,
)
from trainguard.settings import Settings
from trainguard.run_attach import RunAttachRefused, start_memo, why_not_attach
from trainguard.spec import RunSpec, SpecError, loads_spec_json, parse_spec


@dataclass
class RunView:
    """A run as seen now: the workflow's own status plus live per-rank steps from the watch heartbeats."""

    workflow_id: str
    execution_status: str
    status: RunStatus
    rank_steps: dict[int, int | None] = field(default_factory=dict)
    long_phases: dict[int, str] = field(default_factory=dict)
    """Ranks between steps for longer than their step bound, and what they do (`busy 12.3s (eval)`, `waiting
    8.0s (a collective)`): an evaluation, a save, a wait for a peer. Not hung; from the watch heartbeats."""

    groups: list[RunView] = field(default_factory=list)
    """A run with replica groups: each group's run, group 0 first. The run's `nodes` and `rank_steps` are theirs
    laid end to end (global rank r of group g is the group's rank r - g * its world size)."""

    @property
    def live_step(self) -> int:
        steps = [s for s in self.rank_steps.values() if s is not None]
        return min(steps) if steps else self.status.step


def fresh_namespace(workflow_id: str) -> str:
    """A checkpoint namespace for a new run under a used id: the id made key-safe, and a random suffix."""
    return f"{safe_name(workflow_id)[:180].lstrip('._-') or 'run'}.{uuid.uuid4().hex[:8]}"


def node_of_rank(status: RunStatus, rank: int) -> str:
    """The node of the current attempt that runs global rank `rank` (ranks are laid out node by node)."""
    per_node = status.world_size // len(status.nodes) if status.nodes else 0
    if not per_node or not 0 <= rank < status.world_size:
        raise ValueError(f"rank {rank} is not in the run (world size {status.world_size})")
    return status.nodes[rank // per_node]


def load_spec(source: RunSpec | dict[str, Any] | str | Path) -> RunSpec:
    """Validate a spec, or a spec file (UTF-8 JSON, a byte-order mark allowed). Raises `SpecError`; for a file,
    its message starts with the file's name, whether the file cannot be read, is not JSON, or is a bad spec."""
    if not isinstance(source, (str, Path)):
        return parse_spec(source)
    try:
        # utf-8-sig: editors on Windows save JSON with a byte-order mark, which plain utf-8 refuses.
        text = Path(source).read_text(encoding="utf-8-sig")
    except OSError as error:
        raise SpecError(f"{source}: cannot read the spec file: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise SpecError(f"{source}: not UTF-8 text (byte {error.start}): save the spec as UTF-8 JSON") from None
    try:
        return parse_spec(loads_spec_json(text))
    except SpecError as error:
        raise SpecError(f"{source}: {error}") from None


class TrainguardClient:
    def __init__(self, client: Client) -> None:
        self.client = client

    @classmethod
    async def connect(cls, settings: Settings | None = None) -> TrainguardClient:
        return cls(await connect(settings))

    async def earlier_run(self, workflow_id: str) -> str | None:
        """How the latest earlier execution under `workflow_id` ended (`COMPLETED`, `FAILED`, ...), or None
        when the id is new (or its execution still runs: starting it again is refused anyway)."""
        try:
            description = await self.handle(workflow_id).describe()
        except RPCError as error:
            if error.status is RPCStatusCode.NOT_FOUND:
                return None
            raise
        status = description.status
        return None if status in (None, WorkflowExecutionStatus.RUNNING) else status.name

    async def start_run(self, spec: RunSpec | dict[str, Any] | str | Path, workflow_id: str | None = None,
                        resume: bool = False, resume_from: str | None = None) -> str:
        """Validate the spec here (errors name the field), start a `TrainingRun`, return its workflow id.

        Under an id an earlier run used, the run starts fresh in a checkpoint namespace of its own
        (`<id>.<random>`), unless `resume` (or the spec's `checkpoint.namespace`) says where to restore from:
        `resume` restores the earlier run's newest checkpoint (the spec records it as `checkpoint.resume_from`
        naming this id, so the earlier run's `checkpoint.allow_resume` applies). `resume_from` (the spec's
        `checkpoint.resume_from`) names another run whose newest checkpoint this run starts from; this run
        commits to its own namespace and never prunes that run's checkpoints.

        Under the id of a run that still runs, this attaches to it when that run was started with this very spec
        from this very Slurm job (a requeued job starts its run again under the same id and must find the one it
        was doing); otherwise it raises `RunAttachRefused` naming what differs (`trainguard.run_attach`)."""
        if workflow_id is not None:
            validate_workflow_id(workflow_id)
        workflow_id = workflow_id or f"run-{uuid.uuid4().hex[:12]}"
        parsed = self._asked_spec(load_spec(spec), workflow_id, resume, resume_from)
        asked = parsed  # what a later start under this id compares itself with, before a random namespace
        if not resume and parsed.checkpoint.namespace is None and await self.earlier_run(workflow_id):
            parsed = parsed.model_copy(update={"checkpoint": parsed.checkpoint.model_copy(
                update={"namespace": fresh_namespace(workflow_id)})})
        try:
            await self.client.start_workflow(
                WORKFLOW_TYPE,
                parsed.model_dump(mode="json"),
                id=workflow_id,
                task_queue=TASK_QUEUE,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                # The spec's digest, and inside a Slurm job the job this run belongs to: the only job the
                # controller may end for it, and the only start that may attach to it.
                memo=start_memo(asked),
            )
        except WorkflowAlreadyStartedError:
            if not await self.attach(workflow_id, asked):
                raise  # it ended in between: starting again is the caller's to decide
        return workflow_id

    @staticmethod
    def _asked_spec(parsed: RunSpec, workflow_id: str, resume: bool, resume_from: str | None) -> RunSpec:
        """`parsed` with `resume` and `resume_from` recorded in it: what a start asks for, before a namespace of
        its own is drawn."""
        if resume_from is not None:
            validate_workflow_id(resume_from)
            if parsed.checkpoint.resume_from not in (None, resume_from):
                raise ValueError(f"resume_from {resume_from!r} differs from the spec's checkpoint.resume_from "
                                 f"{parsed.checkpoint.resume_from!r}: name one run")
            parsed = parsed.model_copy(update={"checkpoint": parsed.checkpoint.model_copy(
                update={"resume_from": resume_from})})
        if resume:  # recorded as a resume of its own id: the store lets a new run take over an earlier one's
            # namespace only then, and only as far as that run's `checkpoint.allow_resume` lets it
            if parsed.checkpoint.resume_from not in (None, workflow_id):
                raise ValueError(f"resume restores run {workflow_id!r}'s checkpoints, and the spec's "
                                 f"checkpoint.resume_from names {parsed.checkpoint.resume_from!r}: name one run")
            parsed = parsed.model_copy(update={"checkpoint": parsed.checkpoint.model_copy(
                update={"resume_from": workflow_id})})
        return parsed

    async def attach(self, workflow_id: str, spec: RunSpec | dict[str, Any] | str | Path, resume: bool = False,
                     resume_from: str | None = None) -> bool:
        """Whether a run runs under `workflow_id` that a start of `spec` (with `resume`, `resume_from`, in this
        environment's Slurm job) may attach to: False when none runs; `RunAttachRefused` naming what differs when
        one runs that another spec or another Slurm job started."""
        memo = await self.running_memo(workflow_id)
        if memo is None:
            return False
        asked = self._asked_spec(load_spec(spec), workflow_id, resume, resume_from)
        if why := why_not_attach(memo, asked):
            raise RunAttachRefused(f"run {workflow_id} is running and is not this start's: {why}. Start under "
                                   f"another id, or cancel that run (`trainguard run cancel {workflow_id}`) first")
        return True

    async def running_memo(self, workflow_id: str) -> Mapping[str, Any] | None:
        """The memo of the execution running under `workflow_id`; None when none runs."""
        try:
            description = await self.handle(workflow_id).describe()
        except RPCError as error:
            if error.status is RPCStatusCode.NOT_FOUND:
                return None
            raise
        if description.status not in (None, WorkflowExecutionStatus.RUNNING):
            return None
        return await description.memo()

    async def running(self, workflow_id: str) -> bool:
        """Whether an execution under `workflow_id` is running now (starting it again attaches to it)."""
        try:
            description = await self.handle(workflow_id).describe()
        except RPCError as error:
            if error.status is RPCStatusCode.NOT_FOUND:
                return False
            raise
        return description.status in (None, WorkflowExecutionStatus.RUNNING)

    def handle(self, workflow_id: str) -> WorkflowHandle[Any, Any]:
        return self.client.get_workflow_handle(workflow_id)

    async def histories(self, workflow_id: str) -> list[WorkflowHistory]:
        """The run's history (of its current execution) and the history of every node-group child workflow
        it started: the calls to its nodes and their watches live there."""
        root = await self.handle(workflow_id).fetch_history()
        found = [root]
        for event in root.events:
            if event.HasField("child_workflow_execution_started_event_attributes"):
                child = event.child_workflow_execution_started_event_attributes.workflow_execution
                found.append(await self.client.get_workflow_handle(child.workflow_id, run_id=child.run_id)
                             .fetch_history())
        return found

    async def controller_running(self, max_idle_s: float = 90.0) -> bool:
        """Whether a controller polled the `trainguard` task queue recently (as the server saw it): without
        one, a started run waits in `reserving` and no query is answered."""
        from temporalio.api.enums.v1 import TaskQueueType

        from trainguard.pool import has_pollers

        return await has_pollers(self.client, TASK_QUEUE, TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, max_idle_s)

    async def status(self, workflow_id: str) -> RunView:
        handle = self.handle(workflow_id)
        description = await handle.describe()
        try:
            status = await handle.query("status", result_type=RunStatus)
        except RPCError as error:
            # A query is answered by a worker: with none polling, the server times out and says only that.
            if NO_POLLER in error.message or not await self.controller_running():
                raise NoController(no_controller_hint(self.client.service_client.config.target_host)) from error
            raise
        steps: dict[int, int | None] = {}
        phases: dict[int, str] = {}
        live = status.phase in (Phase.RUNNING, Phase.FINISHING)
        if status.at_risk_since is not None and description.status == WorkflowExecutionStatus.RUNNING:
            status.checkpoint_age_s = round(max(0.0, time.time() - status.at_risk_since), 1)
        # The watches run in the run's node-group children: their latest heartbeats hold each rank's step.
        groups = [c for c in description.raw_description.pending_children
                  if c.workflow_type_name == NODE_GROUP_WATCH_WORKFLOW] if live else []
        for group in groups:
            try:
                child = await self.client.get_workflow_handle(group.workflow_id).describe()
            except RPCError:
                continue  # it ended meanwhile
            for pending in child.raw_description.pending_activities:
                if pending.activity_type.name != "watch_ranks" or not pending.heartbeat_details.payloads:
                    continue
                details = (await self.client.data_converter.decode(pending.heartbeat_details.payloads))[0]
                beat = WatchHeartbeat.from_json(details)
                if beat is None or beat.attempt != status.attempt:
                    continue  # a cancelled watch of an earlier attempt, not yet acknowledged
                steps.update(beat.steps or {})
                phases.update(beat.phases or {})
        execution = description.status.name if description.status else "UNKNOWN"
        view = RunView(workflow_id, execution, status, dict(sorted(steps.items())), dict(sorted(phases.items())))
        if status.replica_groups:
            await self._with_groups(view)
        return view

    async def _with_groups(self, view: RunView) -> None:
        """The groups' own views in `view`, and their nodes and ranks as the whole run's."""
        nodes: list[str] = []
        for index, group_id in enumerate(view.status.replica_groups):
            try:
                group = await self.status(group_id)
            except RPCError:
                continue  # not started yet
            view.groups.append(group)
            offset = index * group.status.world_size
            nodes.extend(group.status.nodes)
            view.rank_steps.update({offset + rank: step for rank, step in group.rank_steps.items()})
            view.long_phases.update({offset + rank: what for rank, what in group.long_phases.items()})
        if len(view.groups) == len(view.status.replica_groups):
            view.status.nodes = nodes
            view.status.attempt = max(g.status.attempt for g in view.groups)
            if view.status.phase is Phase.RUNNING:
                view.status.step = min(g.status.step for g in view.groups)

    async def group_of(self, workflow_id: str, node: str | None, rank: int | None) -> tuple[str, int | None]:
        """The run that acts for `node` (or global `rank`): the group's run holding it in a run with replica
        groups (and the rank as that group numbers it), else the run itself."""
        view = await self.status(workflow_id)
        for index, group in enumerate(view.groups):
            offset = index * group.status.world_size
            if node is not None and node in group.status.nodes:
                return group.workflow_id, None if rank is None else rank - offset
            if node is None and rank is not None and offset <= rank < offset + group.status.world_size:
                return group.workflow_id, rank - offset
        if view.groups:
            where = f"node {node!r}" if node is not None else f"rank {rank}"
            raise ValueError(f"{where} is in none of the run's replica groups (nodes: {', '.join(view.status.nodes)})")
        return workflow_id, rank

    async def result(self, workflow_id: str) -> RunResult:
        return await self.client.get_workflow_handle(workflow_id, result_type=RunResult).result()

    async def inject_fault(self, workflow_id: str, fault: str, node: str | None = None, rank: int | None = None,
                           slow_duty: float = 0.5, recurring: bool = False) -> InjectFaultResult:
        """Chaos through the run itself, carried out by the node's agent: `crash` or `hang` a rank, `slow` it
        down, report a `gpu` fault, take the whole node down (`node-down`), or flip a byte of the node's shard
        of the newest committed checkpoint (`corrupt`: the next restore falls back to the one before), flip a bit
        of a parameter (`bitflip`; `recurring`: in every attempt the node runs, a sick GPU) or make a loss NaN
        (`nan`). Without `node`, the node that runs `rank` now."""
        if node is None and rank is None:
            raise ValueError("inject_fault: name the node or the rank")
        workflow_id, rank = await self.group_of(workflow_id, node, rank)
        if node is None:
            assert rank is not None
            node = node_of_rank((await self.status(workflow_id)).status, rank)
        return await self.handle(workflow_id).execute_update(
            "inject_fault",
            ChaosRequest(node=node, rank=rank, fault=fault, slow_duty=slow_duty, recurring=recurring),
            result_type=InjectFaultResult,
        )

    async def rank_log(self, workflow_id: str, node: str | None = None, rank: int | None = None,
                       attempt: int | None = None, offset: int = 0,
                       tail_bytes: int | None = None) -> ReadRankLogResult:
        """A chunk of a rank's log (its stdout and stderr), read by its node's agent: `rank` on `node`
        (either one finds the other from the run's current nodes; default rank 0), the newest `attempt` there
        unless given; from `offset`, or the last `tail_bytes`."""
        if node is None or rank is None:
            status = (await self.status(workflow_id)).status
            if rank is None:
                per_node = status.world_size // len(status.nodes) if status.nodes else 1
                rank = status.nodes.index(node) * per_node if node in status.nodes else 0
            node = node or node_of_rank(status, rank)
        request = ReadRankLogInput(workflow_id=workflow_id, node=node, rank=rank, attempt=attempt, offset=offset,
                                   tail_bytes=tail_bytes)
        return await self.client.execute_workflow(
            READ_LOG_WORKFLOW_TYPE, request, id=f"{workflow_id}/log-{uuid.uuid4().hex[:8]}", task_queue=TASK_QUEUE,
            result_type=ReadRankLogResult, execution_timeout=timedelta(minutes=1))

    async def pause(self, workflow_id: str, reason: str = "") -> OperatorResult:
        """Stop the run's ranks and hold it PAUSED until `resume` (or `abort`)."""
        return await self._operator(workflow_id, "pause", reason)

    async def resume(self, workflow_id: str, reason: str = "") -> OperatorResult:
        """Relaunch a paused run (paused by you, or by the policy when a node was lost with no spare)."""
        return await self._operator(workflow_id, "resume", reason)

    async def abort(self, workflow_id: str, reason: str = "") -> OperatorResult:
        """End a paused run; it fails with `reason`."""
        return await self._operator(workflow_id, "abort", reason)

    async def drain_node(self, workflow_id: str, node: str, reason: str = "") -> OperatorResult:
        """Move the run off `node` at its next committed checkpoint; a spare takes its place."""
        return await self.handle(workflow_id).execute_update(
            "drain_node", DrainRequest(node=node, reason=reason), result_type=OperatorResult
        )

    async def checkpoint_now(self, workflow_id: str, reason: str = "") -> CheckpointNowResult:
        """Have every rank checkpoint about two seconds from now; returns the step it will commit."""
        return await self.handle(workflow_id).execute_update(
            "checkpoint_now", OperatorRequest(reason=reason), result_type=CheckpointNowResult
        )

    async def _operator(self, workflow_id: str, update: str, reason: str) -> OperatorResult:
        return await self.handle(workflow_id).execute_update(
            update, OperatorRequest(reason=reason), result_type=OperatorResult
        )

    async def cancel(self, workflow_id: str) -> None:
        await self.handle(workflow_id).cancel()

    # ------------------------------------------------------------------------------------ node pool
    async def nodes(self) -> list[PoolNode]:
        """The node pool: each node's registration, lease, cordon and drain state."""
        from trainguard.pool import pool_nodes

        return await pool_nodes(self.client)

    async def cordon(self, node: str, reason: str = "") -> PoolNode:
        """Keep `node` out of every future lease until `uncordon` (or its agent comes back healthy)."""
        return await self._pool_update("cordon", NodeRequest(node=node, reason=reason or "cordoned by an operator"),
                                       PoolNode)

    async def uncordon(self, node: str) -> PoolNode:
        return await self._pool_update("uncordon", NodeRequest(node=node), PoolNode)

    async def drain_pool_node(self, node: str) -> PoolStatus:
        """Take `node` out of the pool once its current run releases it (at once if it is free)."""
        return await self._pool_update("drain", NodeRequest(node=node), PoolStatus)

    async def _pool_update(self, name: str, request: NodeRequest, result_type: type) -> Any:
        from trainguard.pool import pool_handle

        return await (await pool_handle(self.client)).execute_update(name, request, result_type=result_type)

    async def list_runs(self, query: str | None = None, limit: int = 50) -> list[tuple[str, str]]:
        """(workflow id, execution status) of recent runs, newest first."""
        base = f"WorkflowType = '{WORKFLOW_TYPE}'"
        runs = []
        async for execution in self.client.list_workflows(f"{base} AND ({query})" if query else base, limit=limit):
            status = execution.status or WorkflowExecutionStatus.RUNNING
            runs.append((execution.id, status.name))
        return runs
