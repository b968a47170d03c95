"""`NodePool`: the long-lived node inventory that every run leases its nodes from.

Node agents register with it when they start; runs acquire their nodes (and spares) from it and release
them when they end, so two concurrent runs never get the same node; a cordon recorded here persists across
runs until an operator lifts it or the node's agent comes back healthy (a repaired node); a drained node
leaves after its current run. One instance per namespace, workflow id `trainguard-node-pool`.

The rules are pure functions of the pool state (workflows/pool_rules.py), table-tested without a server.

Registration is guarded (issue 27 item 6): its validator refuses a malformed one (node id, host, a peer address
on any host but the node's own, labels, sizes) before it enters history; a healthy registration lifts a cordon a
run or a failed GPU check set, never one an operator set; and the agent proves it holds the pool's peer token. A
workflow cannot read a secret, so the proof (an HMAC of the registration, `trainguard.pool.registration_proof`)
is checked by an activity on the controller (`verify_registration`) with the controller's own copy of the
token: the tag and the verdict enter history, the token never does. A controller without a token takes any
well-formed registration (a dev stack without peers): unauthenticated, but an operator's cordon still stands.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities import names
    from activities.models import NotifySchedulerInput, NotifySchedulerResult, SchedulerAction
    from trainguard.error_types import ErrorType, non_retryable
    from trainguard.models import (
        AcquireManyRequest,
        AcquireManyResult,
        AcquireNodesRequest,
        AcquireNodesResult,
        ReleaseManyRequest,
        ReleaseManyResult,
        NodeRequest,
        PoolNode,
        PoolStatus,
        RegisterNodeRequest,
        RegistrationVerdict,
    )
    from workflows.pool_rules import cordon, drain, grant, register, registration_problem, release, uncordon

from trainguard import POOL_WORKFLOW_TYPE

# Each request adds a handful of events; continue as new long before Temporal's limits.
POOL_HISTORY_EVENTS = 5_000
POOL_UPDATES_PER_HISTORY = 1_500
"""Temporal refuses more than 2,000 updates in one history: 4,096 agents registering at a cluster's boot
would reach that before `POOL_HISTORY_EVENTS` when the server batches updates into few workflow tasks, and a
pool that refuses updates adds no events, so it would never continue as new."""
PATCH_SCHEDULER_UNCORDON = "scheduler-uncordon"
"""Histories before this patch lifted cordons in the pool only, leaving the cluster scheduler's in place."""

PATCH_GUARDED_REGISTRATION = "guarded-registration"
"""Histories before this patch took any registration unchecked, and a healthy one lifted an operator's cordon."""

PATCH_REGISTRATION_ACTIVITY = "registration-activity"
"""Histories before this patch checked the proof in a local activity. An update handler awaiting one wrote
histories the SDK (temporalio 1.35) cannot replay: a check resolved in one workflow task whose handler then
completed in the next, after other registrations were accepted, replays as accepted and completed at once
("UpdateMachine in state CompletedCommandCreated ... WorkflowExecutionUpdateAccepted"), and the pool, which
every run leases from, failed every workflow task after a full restart of the stack. An activity's result is an
event of its own, so the handler resumes at the same place on replay."""

VERIFY_TIMEOUT = timedelta(seconds=5)
"""Checking a registration's proof is one HMAC on the controller: milliseconds."""
VERIFY_RETRY = RetryPolicy(maximum_attempts=3)
"""Only a controller restarting mid-check fails it; a refused proof is a verdict, not an error."""
VERIFY_ACTIVITY_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5))
"""The check as an activity: asked again while the controller restarts (a refused proof is a verdict, not an
error), within `VERIFY_SCHEDULE_TO_CLOSE`."""
VERIFY_SCHEDULE_TO_CLOSE = timedelta(minutes=2)
"""A controller away longer fails the registration; the agent registers again."""

SCHEDULER_TIMEOUT = timedelta(seconds=60)
"""At most two scheduler commands (cordon + taint) of at most 20 s each."""

SCHEDULER_SCHEDULE_TO_CLOSE = timedelta(minutes=5)
"""Bounds the whole hook, retries included, so a run never waits on it longer."""

SCHEDULER_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), backoff_coefficient=2.0,
                              maximum_interval=timedelta(seconds=30), maximum_attempts=6,
                              non_retryable_error_types=non_retryable(ErrorType.SCHEDULER_CONFIG_ERROR))
"""slurmctld or the API server may be restarting: about two minutes of retries. The hook is advisory (the pool's
cordon already keeps trainguard's runs off the node), so a failure is logged, never fatal to the run."""


@workflow.defn(name=POOL_WORKFLOW_TYPE)
class NodePool:
    @workflow.init
    def __init__(self, carried: PoolStatus | None = None) -> None:
        # The nodes are in place before any handler runs: the first workflow task of a pool (its start, or a
        # continue-as-new) may carry leases already, and a lease handled before `run` began saw an empty pool
        # and was refused its nodes as unregistered.
        self._nodes: dict[str, PoolNode] = {node.node: node for node in (carried.all_nodes() if carried else [])}
        self._updates = 0

    @workflow.run
    async def run(self, carried: PoolStatus | None = None) -> None:
        await workflow.wait_condition(
            lambda: workflow.info().get_current_history_length() > POOL_HISTORY_EVENTS
            or self._updates >= POOL_UPDATES_PER_HISTORY
            or workflow.info().is_continue_as_new_suggested()
        )
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(PoolStatus.pack(list(self._nodes.values())))

    def _counted(self) -> None:
        self._updates += 1

    def _now(self) -> float:
        return workflow.now().timestamp()

    @workflow.query
    def nodes(self) -> PoolStatus:
        return PoolStatus(nodes=sorted(self._nodes.values(), key=lambda n: n.node))

    @workflow.update
    async def register(self, request: RegisterNodeRequest) -> PoolNode:
        self._counted()
        guarded = workflow.patched(PATCH_GUARDED_REGISTRATION)
        if guarded and workflow.patched(PATCH_REGISTRATION_ACTIVITY):
            verdict = await workflow.execute_activity(
                names.VERIFY_REGISTRATION, request, result_type=RegistrationVerdict,
                start_to_close_timeout=VERIFY_TIMEOUT, schedule_to_close_timeout=VERIFY_SCHEDULE_TO_CLOSE,
                retry_policy=VERIFY_ACTIVITY_RETRY, summary=f"check {request.node}'s registration proof")
        elif guarded:
            verdict = await workflow.execute_local_activity(
                names.VERIFY_REGISTRATION, request, result_type=RegistrationVerdict,
                start_to_close_timeout=VERIFY_TIMEOUT, retry_policy=VERIFY_RETRY,
                summary=f"check {request.node}'s registration proof")
        if guarded:
            # Another registration of the node may have landed while this one was checked.
            problem = verdict.why if not verdict.accepted else registration_problem(
                request, self._nodes.get(request.node))
            if problem:
                raise ApplicationError(f"registration of {request.node} refused: {problem}",
                                       type=ErrorType.REGISTRATION_REFUSED, non_retryable=True)
        was_cordoned = request.node in self._nodes and self._nodes[request.node].cordoned is not None
        register(self._nodes, request, self._now(), keep_operator_cordon=guarded)
        self._tell_scheduler_if_lifted(request.node, was_cordoned)
        return self._nodes[request.node]

    @register.validator
    def _validate_register(self, request: RegisterNodeRequest) -> None:
        """A malformed registration is refused before it enters history (validators do not run on replay)."""
        if problem := registration_problem(request, self._nodes.get(request.node)):
            raise ValueError(f"registration refused: {problem}")

    @workflow.update
    def acquire(self, request: AcquireNodesRequest) -> AcquireNodesResult:
        self._counted()
        return grant(self._nodes, request)

    @workflow.update
    def release(self, request: NodeRequest) -> list[str]:
        self._counted()
        return release(self._nodes, request.run_id or "", request.node)

    @workflow.update
    def acquire_many(self, request: AcquireManyRequest) -> AcquireManyResult:
        """Several runs' leases in one update, granted in order: what a controller sends when many runs start
        at once, so they do not queue for Temporal's 10 updates in flight (and 2,000 a history) one by one."""
        self._counted()
        return AcquireManyResult(results=[grant(self._nodes, r) for r in request.requests])

    @workflow.update
    def release_many(self, request: ReleaseManyRequest) -> ReleaseManyResult:
        self._counted()
        return ReleaseManyResult(results=[release(self._nodes, r.run_id or "", r.node) for r in request.requests])

    @release_many.validator
    def _validate_release_many(self, request: ReleaseManyRequest) -> None:
        for one in request.requests:
            self._validate_release(one)

    @release.validator
    def _validate_release(self, request: NodeRequest) -> None:
        if not request.run_id:
            raise ValueError("release needs run_id")

    @workflow.update
    def cordon(self, request: NodeRequest) -> PoolNode:
        self._counted()
        assert request.node is not None
        cordon(self._nodes, request.node, request.reason, self._now(), request.lost_since,
               request.run_id)
        if request.run_id is not None:
            release(self._nodes, request.run_id, request.node)
        return self._nodes[request.node]

    @workflow.update
    def uncordon(self, request: NodeRequest) -> PoolNode:
        self._counted()
        assert request.node is not None
        was_cordoned = self._nodes[request.node].cordoned is not None
        uncordon(self._nodes, request.node)
        self._tell_scheduler_if_lifted(request.node, was_cordoned)
        return self._nodes[request.node]

    def _tell_scheduler_if_lifted(self, node: str, was_cordoned: bool) -> None:
        """A node back in the pool goes back into the cluster's scheduler too (Slurm resume, Kubernetes
        uncordon + untaint; off by default), in the background: the pool never waits on it."""
        if was_cordoned and self._nodes[node].cordoned is None and workflow.patched(PATCH_SCHEDULER_UNCORDON):
            workflow.start_activity(
                names.NOTIFY_SCHEDULER, NotifySchedulerInput(node=node, action=SchedulerAction.UNCORDON),
                start_to_close_timeout=SCHEDULER_TIMEOUT, schedule_to_close_timeout=SCHEDULER_SCHEDULE_TO_CLOSE,
                retry_policy=SCHEDULER_RETRY, result_type=NotifySchedulerResult,
                summary=f"tell the scheduler: uncordon {node}",
            )

    @workflow.update
    def drain(self, request: NodeRequest) -> PoolStatus:
        self._counted()
        assert request.node is not None
        drain(self._nodes, request.node)
        return self.nodes()

    @cordon.validator
    def _validate_cordon(self, request: NodeRequest) -> None:
        self._validate_known(request)  # a typo must not make a phantom node

    @uncordon.validator
    def _validate_uncordon(self, request: NodeRequest) -> None:
        self._validate_known(request)

    @drain.validator
    def _validate_drain(self, request: NodeRequest) -> None:
        self._validate_known(request)

    def _validate_known(self, request: NodeRequest) -> None:
        if not request.node or request.node not in self._nodes:
            raise ValueError(f"node {request.node!r} is not in the pool (nodes: {', '.join(sorted(self._nodes))})")
