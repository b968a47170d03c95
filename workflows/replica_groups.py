"""A run with `replica_groups`: TorchFT's lighthouse, and one `TrainingRun` per replica group as its child.

Each group is a whole run of its own (its nodes, its share of the spares, its checkpoints, its restart budget),
so every recovery path a run has (a crash, a hang, a GPU fault, a lost node onto a spare, warm relaunches)
recovers that group alone: the other groups' ranks never stop, and TorchFT heals the relaunched group from a live
peer at its next quorum. This parent holds what the groups share: the lighthouse, which one node's agent serves
(started before the groups, started again on the same port if it dies, stopped with the run), and the result.

The groups' runs are `<run>-group-<i>`; `trainguard run status <run>` shows each, and chaos aimed at a node goes
to the group that holds it.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities import names
    from activities.lighthouse_models import LighthouseAddress, LighthouseInput
    from trainguard import WORKFLOW_TYPE, node_task_queue
    from trainguard.error_types import ErrorType, non_retryable
    from trainguard.models import Incident, Phase, RunResult
    from trainguard.slurm_job import SLURM_JOB_MEMO
    from trainguard.spec import ReplicaGroupsSpec, RunSpec
    from workflows.node_calls import NODE_SCHEDULE_TO_START
    from workflows.run_core import RunCore, cause_text

LIGHTHOUSE_START_TIMEOUT = timedelta(seconds=90)
"""Starting the lighthouse imports TorchFT and torch on the node (seconds); the activity waits for it to serve."""
LIGHTHOUSE_START_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10),
                                     maximum_attempts=5, non_retryable_error_types=non_retryable(ErrorType.BAD_SPEC))
"""A node that cannot start it five times (a port, a busy node) will not on the sixth; TorchFT missing there is
the spec's problem and is not retried at all."""
LIGHTHOUSE_HEARTBEAT = timedelta(seconds=20)
"""The keeper heartbeats every 0.5 s: silent this long, its agent (and the lighthouse with it) is gone."""
LIGHTHOUSE_KEEP_TIMEOUT = timedelta(days=365)
"""The keeper runs as long as the run: its heartbeat, not this, tells a lost one."""
LIGHTHOUSE_KEEP_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
"""A keeper lost with a restarting agent is started again, and starts the lighthouse again on its port."""
LIGHTHOUSE_STOP_TIMEOUT = timedelta(seconds=30)
LIGHTHOUSE_STOP_RETRY = RetryPolicy(maximum_attempts=3)
"""Best effort: a node gone for good took its lighthouse with it."""


FINISH_GRACE = timedelta(seconds=60)
"""How long the other groups have to finish once one group has (in step they finish within a step or two of
each other); a group still recovering after it is cancelled."""


def group_id(workflow_id: str, index: int) -> str:
    return f"{workflow_id}-group-{index}"


def lighthouse_node(spec: RunSpec) -> str:
    """The node whose agent serves the lighthouse: the first spare (it trains only once a group has lost a node,
    so a crash of training ranks never takes the lighthouse down), else the first node."""
    return spec.spare_nodes[0] if spec.spare_nodes else spec.nodes[0]


def group_spec(spec: RunSpec, index: int, child: RunSpec) -> RunSpec:
    """Group `index`'s spec: its checkpoints apart from the other groups' (their own namespace, and an earlier
    grouped run's same group to resume from)."""
    checkpoint = spec.checkpoint
    update: dict[str, object] = {}
    if checkpoint.namespace is not None:
        update["namespace"] = f"{checkpoint.namespace}.group-{index}"
    if checkpoint.resume_from is not None:
        update["resume_from"] = group_id(checkpoint.resume_from, index)
    return child.model_copy(update={"checkpoint": checkpoint.model_copy(update=update)}) if update else child


class ReplicaGroups:
    """The parent's whole life: the lighthouse, the groups' runs, their result."""

    def __init__(self, core: RunCore) -> None:
        self.core = core
        self.stopped: list[int] = []
        """Groups cancelled because another had finished the run (`FINISH_GRACE`)."""

    def _lighthouse_input(self, groups: ReplicaGroupsSpec) -> LighthouseInput:
        return LighthouseInput(workflow_id=self.core.wid(), min_replicas=groups.min_groups,
                               heartbeat_timeout_ms=round(groups.heartbeat_timeout_s * 1000),
                               join_timeout_ms=round(groups.join_timeout_s * 1000))

    async def run(self) -> RunResult:
        core, spec = self.core, self.core.the_spec
        groups = spec.replica_groups
        assert groups is not None
        host = lighthouse_node(spec)
        request = self._lighthouse_input(groups)
        keeper: asyncio.Task | None = None
        try:
            address: LighthouseAddress = await workflow.execute_activity(
                names.START_LIGHTHOUSE, request, task_queue=node_task_queue(host),
                start_to_close_timeout=LIGHTHOUSE_START_TIMEOUT, schedule_to_start_timeout=NODE_SCHEDULE_TO_START,
                retry_policy=LIGHTHOUSE_START_RETRY, result_type=LighthouseAddress,
                summary=f"start the TorchFT lighthouse on {host}")
            core.status.lighthouse = address.address
            keeper = asyncio.ensure_future(workflow.execute_activity(
                names.KEEP_LIGHTHOUSE, request, task_queue=node_task_queue(host),
                start_to_close_timeout=LIGHTHOUSE_KEEP_TIMEOUT, heartbeat_timeout=LIGHTHOUSE_HEARTBEAT,
                retry_policy=LIGHTHOUSE_KEEP_RETRY, summary=f"keep the lighthouse on {host} serving",
                cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED))
            # Inside a Slurm job, each group's run belongs to it as this one does: fenced to the job's agents, and
            # its cordons drain the job's nodes in Slurm.
            job = workflow.memo_value(SLURM_JOB_MEMO, default=None)
            memo = {SLURM_JOB_MEMO: job} if job is not None else None
            children = []
            for index, child in enumerate(spec.replica_group_specs(address.address)):
                child = group_spec(spec, index, child)
                children.append(await workflow.start_child_workflow(
                    WORKFLOW_TYPE, child.model_dump(mode="json"), id=group_id(core.wid(), index), memo=memo,
                    result_type=RunResult, parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
                    static_summary=f"replica group {index} of {groups.groups}: {', '.join(child.nodes)}"))
                core.status.replica_groups.append(group_id(core.wid(), index))
            core.set_phase(Phase.RUNNING)
            core.publish()
            try:
                outcomes = await self._until_one_finishes(children)
            except asyncio.CancelledError:
                # The run is cancelled: every group stops its ranks before the lighthouse goes.
                running = [handle for handle in children if not handle.done()]
                for handle in running:
                    handle.cancel()
                if running:
                    await workflow.wait(running)
                raise
            return self._result(groups, outcomes)
        except BaseException as error:
            if core.status.phase is not Phase.FAILED:
                core.say(core.status.reason or cause_text(error))
                core.set_phase(Phase.FAILED)
            raise
        finally:
            await self._stop_lighthouse(host, request, keeper)

    async def _until_one_finishes(self, children: list) -> list[RunResult | BaseException]:
        """Every group's outcome. Once one group has trained to the end the run's model is done: a group still
        recovering then (relaunched from an older checkpoint, with no live peer left to heal from) would only
        train on alone, so the groups not done `FINISH_GRACE` after the first are cancelled."""
        pending = set(children)
        first_done: float | None = None
        while pending:
            timeout = None if first_done is None else max(0.0, FINISH_GRACE.total_seconds() - (
                workflow.time() - first_done))
            done, pending = await workflow.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if first_done is None and any(not task.cancelled() and task.exception() is None for task in done):
                first_done = workflow.time()
            if not done and pending:  # the grace is over
                for index, child in enumerate(children):
                    if child in pending:
                        self.stopped.append(index)
                        child.cancel()
                await workflow.wait(pending)
                break
        outcomes: list[RunResult | BaseException] = []
        for child in children:
            try:
                outcomes.append(child.result())
            except BaseException as error:  # noqa: BLE001 - a group's failure is its outcome, reported by group
                outcomes.append(error)
        return outcomes

    async def _stop_lighthouse(self, host: str, request: LighthouseInput, keeper: asyncio.Task | None) -> None:
        if keeper is not None and not keeper.done():
            keeper.cancel()
            try:
                await keeper
            except (asyncio.CancelledError, ActivityError):
                pass
        try:
            await workflow.execute_activity(
                names.STOP_LIGHTHOUSE, request, task_queue=node_task_queue(host),
                start_to_close_timeout=LIGHTHOUSE_STOP_TIMEOUT, schedule_to_start_timeout=NODE_SCHEDULE_TO_START,
                retry_policy=LIGHTHOUSE_STOP_RETRY, summary=f"stop the lighthouse on {host}")
        except ActivityError as error:
            workflow.logger.warning("the lighthouse on %s was not stopped: %s", host, cause_text(error))

    def _result(self, groups: ReplicaGroupsSpec, outcomes: list[RunResult | BaseException]) -> RunResult:
        """Completed when a group completed (it holds the run's model); each group's incidents, by group."""
        core = self.core
        done = [(index, r) for index, r in enumerate(outcomes) if isinstance(r, RunResult)]
        failed = [(index, r) for index, r in enumerate(outcomes)
                  if not isinstance(r, RunResult) and index not in self.stopped]
        incidents: list[Incident] = []
        for index, result in done:
            incidents.extend(i.model_copy(update={"group": index}) for i in result.incidents)
        for index, error in failed:
            incidents.extend(i.model_copy(update={"group": index}) for i in failed_incidents(error))
        core.status.incidents = incidents
        if not done:  # one group that trained to the end holds the run's model; none did
            reasons = "; ".join(f"group {index}: {child_failure(error)}" for index, error in failed)
            raise core.fail(f"every replica group failed: {reasons}", ErrorType.RUN_STOPPED, phase=True)
        notes = [f"group {index} failed: {child_failure(error)}" for index, error in failed]
        notes += [f"group {index} stopped: group {done[0][0]} had finished the run" for index in self.stopped]
        if notes:
            core.say("; ".join(notes))
        core.set_phase(Phase.FINISHING)
        first = done[0][1]
        core.status.step = max(r.steps_completed for _, r in done)
        core.status.latest_checkpoint = first.final_checkpoint
        core.set_phase(Phase.COMPLETED)
        wall = (workflow.now() - workflow.info().workflow_start_time).total_seconds()
        # Each group's useful time counts for its share of the run's width: a step at reduced width is worth
        # the groups that took it, and a failed group's time is worth nothing.
        useful = sum(r.useful_s or 0.0 for _, r in done) / groups.groups
        return RunResult(
            workflow_id=core.wid(), steps_completed=core.status.step,
            attempts=sum(r.attempts for _, r in done), incidents=incidents, final_checkpoint=first.final_checkpoint,
            final_state_digest=first.final_state_digest, goodput=round(min(1.0, useful / max(wall, 1e-9)), 4),
            useful_s=round(useful, 3), wall_s=round(wall, 3), mean_step_s=first.mean_step_s, phase_s=first.phase_s)


def failed_incidents(error: BaseException) -> list[Incident]:
    """The incidents a group's run had when it failed (`RunCore.fail` sends them with its error); none from a
    failure that did not come through it."""
    cause = error.cause if isinstance(error, ChildWorkflowError) else error
    if not isinstance(cause, ApplicationError) or not cause.details:
        return []
    found = cause.details[0]
    return [Incident.model_validate(raw) for raw in found] if isinstance(found, list) else []


def child_failure(error: BaseException) -> str:
    if isinstance(error, ChildWorkflowError) and error.cause is not None:
        return cause_text(error.cause)
    return cause_text(error)
