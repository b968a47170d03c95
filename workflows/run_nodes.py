"""`RunNodes`: everything a run asks of its nodes and of the node pool, each call written once.

Node calls fan out one activity per node (through `NodeCalls` children past a handful) and come back typed:
one pydantic model in per call kind and one out (`node_calls.CALLS`), checked here and nowhere else.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, TypeVar

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as TemporalTimeout

with workflow.unsafe.imports_passed_through():
    from activities import names
    from activities.models import (
        CheckNodeInput,
        CheckNodeResult,
        FindNodeAgentsInput,
        FindNodeAgentsResult,
        InjectFaultInput,
        InjectFaultResult,
        LaunchRanksInput,
        NotifySchedulerInput,
        NotifySchedulerResult,
        RequestCheckpointInput,
        RequestCheckpointResult,
        SchedulerAction,
        StopRanksInput,
        StopRanksResult,
    )
    from activities.parking_models import ParkRanksInput, ParkRanksResult
    from trainguard import node_task_queue
    from trainguard.error_types import ErrorType
    from trainguard.models import (AcquireNodesRequest, AcquireNodesResult, Action, AgentsBackInput, AgentsBackResult,
                                   ChaosRequest, Incident, IncidentKind, NodeRequest, PoolNode, StopReason,
                                   short_cause)
    from workflows.node_calls import (CALLS, NODE_CALL_RETRY, NODE_SCHEDULE_TO_START, STOP_TIMEOUT, NodeCalls,
                                      call_nodes, groups_of)
    from workflows.node_group import watch_heartbeat_every_s, watch_heartbeat_timeout
    from workflows.node_group_models import NodeCall, NodeCallKind, NodeCallsInput, NodeCallsResult
    from workflows.node_pool import SCHEDULER_RETRY, SCHEDULER_SCHEDULE_TO_CLOSE, SCHEDULER_TIMEOUT
    from workflows.pool_rules import pool_request
    from workflows.run_core import RunCore, injected_key
    from workflows.run_decisions import lost_since
    from trainguard.slurm_job import SLURM_JOB_MEMO, recorded_job

DIRECT_NODE_CALLS = 4
"""Node calls this few the run makes itself, not through a `NodeCalls` child: a relaunch's master download and
launch, a small run's every call. A child's start and end cost the run two workflow tasks more than the
activities do, on the path every recovery waits on; four activities are nothing to the run's pending count."""

FAN_OUT_GROUPS = 8
"""Node-call groups a run keeps open at once: 512 node activities, which a dev server on two cores matches to
their agents within seconds; the 64 groups of a 4,096-node check all at once left 1,309 checks waiting past
their schedule-to-start timeout, and the run took those nodes for dead."""

CHECKPOINT_NOW_AHEAD_S = 2.0
"""A checkpoint on demand asks for a step about this far ahead of the master's: the request reaches every node (a
child workflow and an activity round trip per group, tens of milliseconds, more on a loaded machine) well
before the ranks get there."""

LIVENESS_SCHEDULE_TO_START = timedelta(seconds=2)
"""A crash's liveness check (`unanswered`): a live agent polls all the time and starts a node check in
milliseconds; one that has not started it in 2 s is a lost node whose crash its peers saw first. Found here,
the spare is chosen before the relaunch; found by the relaunch, it cost the launching watch's 10 s wait."""
LIVENESS_TIMEOUT = timedelta(seconds=5)
"""...and a check started takes an NVML query: one not done in 5 s is a node in no state to train."""
LIVENESS_RETRY = RetryPolicy(maximum_attempts=1)
"""Asked once: the recovery waits on it, and no answer is the answer."""
LIVENESS_MAX_NODES = 64
"""A crash in a run of up to this many nodes checks every node (each rank's peers are all the others); a larger
run checks the crashed rank's node only (its lost peers' watches miss their heartbeats), so a crash costs
the run's history at most 64 activities."""

STORE_TIMEOUT = timedelta(minutes=2)
"""Listing, HEADs and a small manifest PUT."""
STORE_HEARTBEAT_TIMEOUT = timedelta(seconds=15)
"""Find, commit and prune heartbeat every 2 s: a controller killed mid-call costs 15 s, not `STORE_TIMEOUT`."""
STORE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                          maximum_interval=timedelta(seconds=20), maximum_attempts=12)
"""About three minutes of retries against a flaky store before the run reports it."""

RESERVE_POLL_INTERVAL = timedelta(seconds=2)
"""How often a run waiting for nodes leased to other runs asks the pool again."""
POOL_TIMEOUT = timedelta(seconds=30)
"""One update on the node pool workflow: milliseconds when the controller is up."""
POOL_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
"""The pool lives in the same Temporal as the run: retry until it answers (each call is idempotent)."""

PARK_TIMEOUT = timedelta(seconds=30)
"""A spare's agent parks the run's processes: it starts them (a fork and exec each) and returns; their imports
go on in the background."""
PARK_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5),
                         maximum_attempts=3)
"""Parking is an optimisation: a spare that cannot park after three tries starts its ranks cold when it joins,
as it did before; more retries would only keep a background activity open. A spare whose agent is gone never
starts it (`NODE_SCHEDULE_TO_START`), and that is not retried."""

AGENT_RETURN_POLL = timedelta(seconds=2)
"""How often a run waiting for restarting agents asks the pool whether they are back."""

R = TypeVar("R", bound=BaseModel)


def node_silence_s(num_nodes: int) -> float:
    """How long before it was found lost the run may last have heard from a node: a watch's heartbeat times
    out `watch_heartbeat_timeout` after the last one (10 s up to 200 nodes); a stop its agent never picked up
    waited `NODE_SCHEDULE_TO_START`."""
    heartbeat = watch_heartbeat_timeout(watch_heartbeat_every_s(num_nodes))
    return max(heartbeat, NODE_SCHEDULE_TO_START).total_seconds()


@dataclass(frozen=True, slots=True)
class NodeAnswer(Generic[R]):
    node: str
    result: R | None
    """None when the call failed."""
    error: str | None = None
    error_type: str | None = None


class RunNodes:
    def __init__(self, core: RunCore) -> None:
        self.core = core

    # --------------------------------------------------------------------------------------- fan-out
    async def fan_out(self, kind: NodeCallKind, calls: Sequence[tuple[str, BaseModel]], summary: str,
                      result_type: type[R], direct: bool | None = None) -> list[NodeAnswer[R]]:
        """One activity of `kind` per node, in the calls' order; past `DIRECT_NODE_CALLS` (or where `direct` is
        False), through a `NodeCalls` child per group of nodes so no execution holds more than a group's
        activities. Inputs and answers are checked against the call's contract (`node_calls.CALLS`)."""
        contract = CALLS[kind]
        assert contract.result is result_type, f"{kind.value} answers {contract.result.__name__}"
        assert all(isinstance(request, contract.input) for _, request in calls), f"{kind.value} takes {contract.input}"
        wire = [NodeCall(node=node, input=request.model_dump(mode="json")) for node, request in calls]
        if direct if direct is not None else len(wire) <= DIRECT_NODE_CALLS:
            outcomes = (await call_nodes(NodeCallsInput(kind=kind, summary=summary, calls=wire))).outcomes
        else:
            tag, chunks = str(workflow.uuid4())[:8], groups_of(wire)
            # Past FAN_OUT_GROUPS groups the rest wait for a free slot: thousands of node activities queued at
            # once wait longer than NODE_SCHEDULE_TO_START to be matched to their agents, and read as dead nodes.
            limit = asyncio.Semaphore(min(len(chunks), FAN_OUT_GROUPS))
            # A check reaches every node at once: past one window of slots, its last calls are matched late.
            second_chance = kind is NodeCallKind.CHECK and len(chunks) > FAN_OUT_GROUPS

            async def one(index: int, chunk: list[NodeCall]) -> NodeCallsResult:
                async with limit:
                    # result_type: the SDK's typed overloads leave it out for a method, which it decodes alike
                    return await workflow.execute_child_workflow(  # type: ignore[call-overload]  # result_type
                        NodeCalls.run, NodeCallsInput(kind=kind, calls=chunk, summary=summary,
                                                      second_chance=second_chance),
                        id=f"{self.core.wid()}/{kind.value}-{tag}-{index}", result_type=NodeCallsResult,
                        static_summary=f"{kind.value} on {chunk[0].node}..{chunk[-1].node} ({len(chunk)} nodes)")

            results = await asyncio.gather(*(one(index, chunk) for index, chunk in enumerate(chunks)))
            outcomes = [outcome for result in results for outcome in result.outcomes]
        return [NodeAnswer(o.node, None if o.result is None else result_type.model_validate(o.result),
                           o.error, o.error_type) for o in outcomes]

    async def stop_everywhere(self, nodes: list[str], attempt: int | None, why: str,
                              reason: StopReason = StopReason.INCIDENT) -> list[str]:
        """Stop the ranks on these nodes; returns the nodes whose agent could not be reached (they are fenced
        instead: an agent kills older attempts before any launch). `why` is the UI's, `reason` the report's."""
        wid = self.core.wid()
        answers = await self.fan_out(NodeCallKind.STOP, [
            (n, StopRanksInput(workflow_id=wid, node=n, attempt=attempt, reason=reason)) for n in nodes],
            f"stop ranks on {{node}}: {why}", StopRanksResult)
        for answer in answers:
            if answer.result is None:
                workflow.logger.warning("could not stop ranks on %s: %s", answer.node, answer.error)
        return [a.node for a in answers if a.result is None]

    async def checkpoint_soon(self, attempt: int, ahead_s: float = CHECKPOINT_NOW_AHEAD_S) -> int:
        """Have every rank checkpoint about `ahead_s` from now (an operator's `checkpoint_now`, a straggler's
        before it is replaced); the step asked for. It commits like any other checkpoint."""
        nodes = list(self.core.status.nodes)
        # The master node says where training is: every rank steps in lockstep with it (collectives).
        [where] = await self.request_checkpoint(attempt, nodes[:1], None)
        target = where.step + max(5, math.ceil(ahead_s / (where.step_time_s or 0.1)))
        await self.request_checkpoint(attempt, nodes, target)
        return target

    async def request_checkpoint(self, attempt: int, nodes: list[str],
                                 step: int | None) -> list[RequestCheckpointResult]:
        wid = self.core.wid()
        answers = await self.fan_out(
            NodeCallKind.REQUEST_CHECKPOINT,
            [(n, RequestCheckpointInput(workflow_id=wid, attempt=attempt, node=n, step=step)) for n in nodes],
            "checkpoint now on {node}" + (f" at step {step}" if step is not None else ""), RequestCheckpointResult)
        failed = [f"{a.node}: {a.error}" for a in answers if a.result is None]
        if failed:
            raise ApplicationError(f"checkpoint request failed on {'; '.join(failed[:3])}",
                                   type=ErrorType.NODE_UNAVAILABLE)
        return [a.result for a in answers if a.result is not None]

    async def inject_fault(self, request: ChaosRequest) -> InjectFaultResult:
        newest = self.core.status.latest_checkpoint
        result: InjectFaultResult = await workflow.execute_activity(
            names.INJECT_FAULT,
            InjectFaultInput(workflow_id=self.core.wid(), node=request.node, rank=request.rank,
                             fault=request.fault, slow_duty=request.slow_duty, recurring=request.recurring,
                             bucket=newest.bucket if newest else None,
                             manifest_key=newest.manifest_key if newest else None),
            task_queue=node_task_queue(request.node),
            start_to_close_timeout=STOP_TIMEOUT,
            schedule_to_start_timeout=NODE_SCHEDULE_TO_START,
            retry_policy=NODE_CALL_RETRY,
            result_type=InjectFaultResult,
            summary=f"chaos {request.fault} on {request.node}",
        )
        self.core.state.injected_at[injected_key(request.fault, request.node)] = result.injected_at
        return result

    # ------------------------------------------------------------------------------------------ pool
    async def _pool(self, name: str, request: BaseModel, result_type: type, summary: str):
        return await workflow.execute_activity(
            name, request, start_to_close_timeout=POOL_TIMEOUT, retry_policy=POOL_RETRY,
            result_type=result_type, summary=summary,
        )

    async def reserve(self) -> None:
        """Find the nodes' agents, lease the nodes (spares in cordoned named nodes' places), check their GPUs."""
        core, spec = self.core, self.core.the_spec
        found: FindNodeAgentsResult = await workflow.execute_activity(
            names.FIND_NODE_AGENTS, FindNodeAgentsInput(nodes=spec.nodes + spec.spare_nodes),
            start_to_close_timeout=STORE_TIMEOUT, retry_policy=STORE_RETRY, result_type=FindNodeAgentsResult,
            summary="find node agents",
        )
        core.state.publish_search_attributes = found.search_attributes
        unknown = [f"nodes.{i} {n!r}" for i, n in enumerate(spec.nodes) if n in found.missing]
        if unknown:
            raise core.fail(f"invalid run spec: {', '.join(unknown)}: no node agent polls "
                            f"{', '.join(node_task_queue(n) for n in spec.nodes if n in found.missing)} "
                            f"(unknown node){f'; {found.no_agent_hint}' if found.no_agent_hint else ''}",
                            ErrorType.INVALID_SPEC, phase=True)
        spares = await self._acquire([n for n in spec.spare_nodes if n not in found.missing])
        for check in await self.check_nodes(core.status.nodes):
            if check.gpu.available and not check.gpu.healthy:
                core.record_incident(Incident(kind=IncidentKind.GPU_UNHEALTHY, node=check.node,
                                              detail=check.gpu.detail, action=Action.REPLACE_NODE))
                await self.cordon(check.node, f"GPU checks failed: {check.gpu.detail}")
                if not spares:
                    raise core.fail(f"node {check.node} failed its GPU checks and no spare is left: "
                                    f"{check.gpu.detail}", ErrorType.NO_HEALTHY_NODES)
                core.replace(check.node, spares.pop(0))
        core.hold_spares(spares)

    async def _acquire(self, spares: list[str]) -> list[str]:
        """Lease the nodes from the pool; wait (bounded) for nodes other runs hold; fail on cordoned ones."""
        core, spec = self.core, self.core.the_spec
        waited = 0.0
        request = pool_request(spec, AcquireNodesRequest(run_id=core.wid(), nodes=spec.nodes, spares=spares))
        while True:
            lease = await self._pool(names.ACQUIRE_NODES, request, AcquireNodesResult, "lease nodes from the pool")
            if lease.granted:
                core.say(None)
                for named, spare in lease.replaced.items():
                    workflow.logger.info("%s is cordoned: spare %s takes its place", named, spare)
                core.take_lease(lease.nodes, lease.replaced)
                if lease.nodes:
                    core.publish()
                return lease.spares
            if lease.unsatisfiable:
                raise core.fail(f"{lease.unsatisfiable}: register more nodes, uncordon some, or ask for fewer",
                                ErrorType.NODES_UNAVAILABLE)
            if lease.cordoned and not (lease.busy or lease.unregistered):
                where = ", ".join(f"nodes.{spec.nodes.index(n)} {n!r} is cordoned ({why})"
                                  for n, why in lease.cordoned.items())
                raise core.fail(f"{where}: uncordon it (`trainguard nodes uncordon NODE`) or add a spare to take "
                                f"its place or choose another node", ErrorType.NODES_CORDONED)
            waiting = [f"{n} (leased to {run})" for n, run in lease.busy.items()]
            waiting += [f"{n} (agent not registered yet)" for n in lease.unregistered]
            if waited >= spec.reserve_timeout_s:
                raise core.fail(f"nodes still unavailable after {waited:.0f}s: {', '.join(waiting)}",
                                ErrorType.NODES_UNAVAILABLE)
            core.say(f"waiting for {', '.join(waiting)}")
            await workflow.sleep(RESERVE_POLL_INTERVAL)
            waited += RESERVE_POLL_INTERVAL.total_seconds()

    async def unanswered(self, nodes: list[str]) -> list[str]:
        """The nodes whose agent did not answer a node check within `LIVENESS_SCHEDULE_TO_START` (or took past
        `LIVENESS_TIMEOUT`): lost. A check that failed otherwise came from a live agent."""
        wid = self.core.wid()
        answers = await asyncio.gather(*(workflow.execute_activity(
            NodeCallKind.CHECK.value, CheckNodeInput(workflow_id=wid, node=node), task_queue=node_task_queue(node),
            schedule_to_start_timeout=LIVENESS_SCHEDULE_TO_START, start_to_close_timeout=LIVENESS_TIMEOUT,
            retry_policy=LIVENESS_RETRY, result_type=CheckNodeResult, summary=f"is {node} alive? (a crash)")
            for node in nodes), return_exceptions=True)
        return [node for node, answer in zip(nodes, answers)
                if isinstance(answer, ActivityError) and isinstance(answer.cause, TemporalTimeout)]

    async def check_nodes(self, nodes: list[str]) -> list[CheckNodeResult]:
        wid = self.core.wid()
        answers = await self.fan_out(NodeCallKind.CHECK, [(n, CheckNodeInput(workflow_id=wid, node=n)) for n in nodes],
                                     "check {node}", CheckNodeResult)
        for answer in answers:
            if answer.result is None:
                # A node that cannot answer its check fails the reservation, and the run with it.
                raise self.core.fail(f"node {answer.node} did not answer its check: {answer.error}",
                                     ErrorType.NODE_CHECK_FAILED)
        return [a.result for a in answers if a.result is not None]

    async def cordon(self, node: str, reason: str, since: float | None = None) -> None:
        result: PoolNode = await self._pool(
            names.CORDON_NODE, NodeRequest(node=node, run_id=self.core.wid(), reason=reason, lost_since=since),
            PoolNode, f"cordon {node}: {reason[:80]}")
        if result.cordoned is None:
            workflow.logger.info("%s registered again since the run last heard from it: not cordoned", node)
            return
        # The cluster's scheduler hears about it too (Slurm drain, Kubernetes cordon + taint; off by default),
        # in the background: recovery never waits on it.
        self.core.live.background.append(workflow.start_activity(
            names.NOTIFY_SCHEDULER,
            NotifySchedulerInput(node=node, action=SchedulerAction.CORDON, reason=reason, run_id=self.core.wid()),
            start_to_close_timeout=SCHEDULER_TIMEOUT,
            schedule_to_close_timeout=SCHEDULER_SCHEDULE_TO_CLOSE,
            retry_policy=SCHEDULER_RETRY,
            result_type=NotifySchedulerResult,
            summary=f"tell the scheduler: cordon {node}",
        ))

    async def release(self, node: str | None = None) -> None:
        if self.core.state.leased:
            await self._pool(names.RELEASE_NODES, NodeRequest(run_id=self.core.wid(), node=node), list[str],
                             f"release {node or 'nodes'}")

    async def wait_for_agents(self, nodes: list[str], since: float, once: bool = False) -> list[str]:
        """Wait (`restarts.agent_return_timeout_s` at most; `once`: just ask) until every node's agent registered
        again after `since`; the nodes still away."""
        core, waited = self.core, 0.0
        while True:
            back: AgentsBackResult = await workflow.execute_activity(
                names.FIND_AGENTS_BACK, AgentsBackInput(nodes=nodes, since=since, slurm_job=run_slurm_job()),
                start_to_close_timeout=POOL_TIMEOUT, retry_policy=POOL_RETRY, result_type=AgentsBackResult,
                summary=f"are the agents of {', '.join(nodes[:3])}{'...' if len(nodes) > 3 else ''} back?")
            if once:
                return back.away
            if not back.away or waited >= core.the_spec.restarts.agent_return_timeout_s:
                core.say(None)
                return back.away
            core.say(f"waiting for the agents of {', '.join(back.away[:8])} to come back")
            await workflow.sleep(AGENT_RETURN_POLL)
            waited += AGENT_RETURN_POLL.total_seconds()

    async def reclaim(self, nodes: list[str]) -> list[str]:
        """Nodes this run lost or had replaced that the pool has back (uncordoned, agent healthy): leased to
        this run again."""
        got: AcquireNodesResult = await self._pool(
            names.ACQUIRE_NODES, AcquireNodesRequest(run_id=self.core.wid(), nodes=[], spares=nodes),
            AcquireNodesResult, f"reclaim {', '.join(nodes)}")
        return [n for n in nodes if n in got.spares]

    async def reclaim_spares(self) -> None:
        """A node a spare replaced is back: it becomes one of this run's spares (parking for it, if it parks)."""
        state = self.core.state
        back = await self.reclaim(state.replaced)
        if back:
            self.core.spares_back(back)
            workflow.logger.info("%s back as spare", ", ".join(back))
            self.park_spares()

    def park_spares(self) -> None:
        """Once the run knows its script parks (`RunState.parks`): ask each spare it holds and has not asked yet
        to park its processes (`park_ranks`), in the background (nothing waits on it; a spare that cannot park
        starts cold when it joins). Once per spare: O(spares) activities per run."""
        core, state, spec = self.core, self.core.state, self.core.the_spec
        if not state.parks:
            return
        wid, chain = core.wid(), workflow.info().first_execution_run_id
        for spare in state.spares:
            if spare in state.parked_spares:
                continue
            state.parked_spares = [*state.parked_spares, spare]
            template = LaunchRanksInput(
                workflow_id=wid, attempt=core.status.attempt, chain_id=chain, node=spare, node_rank=0,
                num_nodes=len(core.status.nodes), ranks_per_node=spec.ranks_per_node, entrypoint=spec.entrypoint,
                env=spec.env, working_dir=spec.working_dir, checkpoint_every=spec.checkpoint.every_steps)
            core.live.background.append(workflow.start_activity(
                names.PARK_RANKS, ParkRanksInput(workflow_id=wid, node=spare, launch=template),
                task_queue=node_task_queue(spare), start_to_close_timeout=PARK_TIMEOUT,
                schedule_to_start_timeout=NODE_SCHEDULE_TO_START, retry_policy=PARK_RETRY,
                result_type=ParkRanksResult, summary=f"park processes on spare {spare} for a warm relaunch"))

    async def unpark_spares(self, reason: StopReason) -> None:
        """A paused run relaunches nothing soon: its spares' parked processes stop (on a GPU node each holds
        memory and a CUDA context), and the spares park again when it resumes (`park_spares`)."""
        parked = self.parked_spares()
        if not parked:
            return
        self.core.state.parked_spares = [n for n in self.core.state.parked_spares if n not in parked]
        await self.stop_everywhere(parked, None, "paused: stop the processes parked on spares", reason)

    def parked_spares(self) -> list[str]:
        """Spares still holding processes parked for the run: stopped with its ranks when it ends."""
        state = self.core.state
        return [n for n in state.parked_spares if n in state.spares]

    async def cordon_lost(self, incident: Incident) -> None:
        """Cordon the incident's node; a node found lost only if its agent has not registered since."""
        assert incident.node is not None
        since = lost_since(incident, node_silence_s(len(self.core.status.nodes)))
        # The cause, not what was done about it (after "; "): the pool's list shows one short line per node.
        await self.cordon(incident.node, f"{incident.kind.value}: {short_cause(incident.cause)}",
                          since)

    async def cordon_spare(self, node: str, reason: str) -> None:
        """A spare of the run found sick (a tie's suspect it set aside): cordoned in the pool, and no longer the
        run's spare; processes parked on it stop."""
        if node in self.parked_spares():
            self.core.state.parked_spares = [n for n in self.core.state.parked_spares if n != node]
            await self.stop_everywhere([node], None, f"cordoned: {reason}")
        await self.cordon(node, reason)
        self.core.cordon_spare(node)

    async def swap_in_spare(self, incident: Incident, spare: str, cordon: bool = True, hold: bool = False) -> None:
        """`spare` in the place of the incident's node in the run, and that node cordoned in the pool; without
        `cordon` (a straggler: `Decision.cordon`) the node is released to the pool instead, and this run does not
        take it back as a spare; with `hold` (a tie's suspect) it stays leased, as one of the run's spares."""
        assert incident.node is not None
        if cordon:
            await self.cordon_lost(incident)
        elif not hold:
            await self.release(incident.node)
        self.core.replace(incident.node, spare, cordoned=cordon, reclaim=cordon, hold=hold)


def run_slurm_job() -> int | None:
    """The Slurm job this run's start recorded (its memo, carried across continue-as-new); None: none."""
    job = recorded_job({SLURM_JOB_MEMO: workflow.memo_value(SLURM_JOB_MEMO, default=None)})
    return job.job_id if job is not None else None
