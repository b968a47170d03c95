"""`TrainingRun`: one training run as a durable workflow.

Validate the spec, reserve the nodes, restore the newest committed checkpoint, launch the ranks on each
node's agent, watch them, commit checkpoints as they come, and on an incident let the pure policy decide,
stop every rank of the attempt, and relaunch. All state lives in the workflow's history, so the run
survives the crash of the controller that drives it.

This class holds the handlers and the loop. Its state is one `RunState` (workflows/run_state.py), the one
thing continue-as-new carries; handlers only record the operator's intent, and the loop acts on it. The
parts it composes each own a stage: `RunNodes` (node calls and the pool), `Watches` (watch groups and the
committer), `Attempts` (restore and launch), `Supervisor` (watching an attempt, its rules one pure reducer in
workflows/supervision.py), `Recovery` (between attempts); the decisions they take are pure functions
(workflows/policy.py, workflows/run_decisions.py). An attempt's `Outcome` says how it ended (`Ending`), and
the loop acts on that alone.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.models import SLOW_DUTY_MAX, SLOW_DUTY_MIN, InjectFaultResult, WatchEvent
    from trainguard import WORKFLOW_TYPE
    from trainguard.error_types import ErrorType
    from trainguard.faults import FaultKind, choices as fault_choices, parse_fault
    from trainguard.models import (Action, ChaosRequest, CheckpointNowResult, DrainRequest, OperatorRequest,
                                   OperatorResult, Phase, RunResult, RunStatus, StopReason)
    from workflows.node_group_models import GroupReport, GroupStarted, UploadTrouble
    from workflows.run_attempt import Attempts
    from workflows.run_core import RunCore, cause_text
    from workflows.run_decisions import Ending
    from workflows.run_hang import HangCulprit
    from workflows.replica_groups import ReplicaGroups
    from workflows.run_nodes import RunNodes
    from workflows.run_recovery import Recovery
    from workflows.run_state import (NO_INPUT, RunInputError, RunState, continued_input, decode_run_input,
                                     parse_run_input)
    from workflows.run_supervise import Supervisor
    from workflows.run_watch import Watches
    from workflows.supervision import Outcome

UPLOAD_ERRORS_KEPT = 16
"""Nodes whose failing uploads the status names, at most: an outage of every node of a large run would
otherwise put thousands of errors into every status answer and the state carried across continue-as-new."""


@workflow.defn(name=WORKFLOW_TYPE)
class TrainingRun:
    def __init__(self) -> None:
        self.core = RunCore(RunState())
        self.nodes = RunNodes(self.core)
        self.watches = Watches(self.core)
        self.recovery = Recovery(self.core, self.nodes, self.watches)
        self.hang = HangCulprit(self.core, self.nodes, self.watches)
        self.supervisor = Supervisor(self.core, self.nodes, self.watches, self.recovery, self.hang)
        self.attempts = Attempts(self.core, self.nodes)

    def _one_world(self, what: str) -> None:
        """A run with replica groups trains in its groups' runs: operator requests go to those."""
        if self.core.spec is not None and self.core.spec.replica_groups is not None:
            groups = ", ".join(self.core.status.replica_groups) or "its groups' runs, once started"
            raise ValueError(f"this run trains in replica groups: {what} one of them ({groups})")

    # ------------------------------------------------------------------------------------------ queries
    @workflow.query
    def status(self) -> RunStatus:
        return self.core.status.model_copy(update={"spares": list(self.core.state.spares),
                                                   "at_risk_since": self.core.state.commit_clock_from})

    # ------------------------------------------------------------------------------- operator updates
    @workflow.update
    async def pause(self, request: OperatorRequest) -> OperatorResult:
        """Stop the ranks (progress since the newest checkpoint is redone later) and wait for `resume`."""
        self.core.state.intents.pause = True
        self.core.say(f"pause requested: {request.reason}" if request.reason else "pause requested")
        return OperatorResult(phase=self.core.status.phase)

    @pause.validator
    def _validate_pause(self, request: OperatorRequest) -> None:
        self._one_world("pause")
        if self.core.status.phase in (Phase.PAUSED, Phase.COMPLETED, Phase.FAILED, Phase.FINISHING):
            raise ValueError(f"run is {self.core.status.phase.value}: cannot pause")

    @workflow.update
    async def resume(self, request: OperatorRequest) -> OperatorResult:
        """Relaunch a paused run from its newest committed checkpoint (recovery budgets start afresh)."""
        self.core.state.intents.resume = True
        return OperatorResult(phase=self.core.status.phase)

    @resume.validator
    def _validate_resume(self, request: OperatorRequest) -> None:
        self._one_world("resume")
        # A pause on its way counts: `await pause(); await resume()` must not race the ranks' stop.
        if self.core.status.phase is not Phase.PAUSED and not self.core.state.intents.pause:
            raise ValueError(f"run is {self.core.status.phase.value}, not paused: nothing to resume")

    @workflow.update
    async def abort(self, request: OperatorRequest) -> OperatorResult:
        """End a paused run: its ranks are already stopped; the run fails with the operator's reason."""
        self.core.state.intents.abort_reason = request.reason or "aborted by an operator"
        return OperatorResult(phase=self.core.status.phase)

    @abort.validator
    def _validate_abort(self, request: OperatorRequest) -> None:
        self._one_world("abort")
        if self.core.status.phase is not Phase.PAUSED:
            raise ValueError(f"run is {self.core.status.phase.value}: only a paused run is aborted (cancel it instead)")

    @workflow.update
    async def drain_node(self, request: DrainRequest) -> OperatorResult:
        """Move the run off a node at the next committed checkpoint; a spare takes its place."""
        if request.node not in self.core.state.intents.draining:
            self.core.state.intents.draining.append(request.node)
        return OperatorResult(phase=self.core.status.phase)

    @drain_node.validator
    def _validate_drain(self, request: DrainRequest) -> None:
        self._one_world("drain a node of")
        status, state = self.core.status, self.core.state
        if request.node not in status.nodes:
            raise ValueError(f"node {request.node!r} is not in the run (nodes: {', '.join(status.nodes)})")
        if len(state.spares) <= len(state.intents.draining):
            raise ValueError(f"no spare node left to take {request.node}'s place (add spare_nodes)")

    @workflow.update
    async def checkpoint_now(self, request: OperatorRequest) -> CheckpointNowResult:
        """Have every rank checkpoint about two seconds from now; it commits like any other checkpoint."""
        return CheckpointNowResult(step=await self.nodes.checkpoint_soon(self.core.status.attempt))

    @checkpoint_now.validator
    def _validate_checkpoint_now(self, request: OperatorRequest) -> None:
        self._one_world("checkpoint")
        if self.core.status.phase is not Phase.RUNNING:
            raise ValueError(f"run is {self.core.status.phase.value}, not running: no ranks to checkpoint")

    @workflow.update
    async def inject_fault(self, request: ChaosRequest) -> InjectFaultResult:
        """Chaos: have a node agent crash or hang one rank of the current attempt."""
        return await self.nodes.inject_fault(request)

    @inject_fault.validator
    def _validate_fault(self, request: ChaosRequest) -> None:
        self._one_world("inject faults into")
        status = self.core.status
        if status.phase is not Phase.RUNNING:
            raise ValueError(f"run is {status.phase.value}, not running: nothing to inject into")
        if request.node not in status.nodes:
            raise ValueError(f"node {request.node!r} is not in the run (nodes: {', '.join(status.nodes)})")
        if parse_fault(request.fault) is None:
            raise ValueError(f"unknown fault {request.fault!r}: choose one of {fault_choices()}")
        if request.fault == FaultKind.SLOW and not SLOW_DUTY_MIN <= request.slow_duty <= SLOW_DUTY_MAX:
            raise ValueError(f"slow_duty {request.slow_duty:g} is out of range: "
                             f"give {SLOW_DUTY_MIN} to {SLOW_DUTY_MAX}")
        if request.fault == FaultKind.CORRUPT and status.latest_checkpoint is None:
            raise ValueError("no committed checkpoint yet to corrupt: wait for the first commit")

    # ------------------------------------------------------------------------------- group signals
    @workflow.signal
    def group_report(self, report: GroupReport) -> None:
        """A standing group's incidents and lost nodes (it goes on watching the others)."""
        self.core.live.reports.append(report)

    @workflow.signal
    def upload_trouble(self, trouble: UploadTrouble) -> None:
        """A node's uploads keep failing: the status names the error until a checkpoint commits again."""
        errors = self.core.status.upload_errors
        if trouble.node in errors or len(errors) < UPLOAD_ERRORS_KEPT:
            errors[trouble.node] = trouble.error

    @workflow.signal
    def group_started(self, started: GroupStarted) -> None:
        """A node group has run the attempt's first step on its master node: the previous incident's time to
        recover ends here (every rank steps together, so the first step of one group is the first step of all).
        Where its ranks called `standby()` the script parks: the spares park its processes from now on."""
        if started.attempt != self.core.status.attempt:
            return  # a late signal of an attempt already over
        if started.parks and not self.core.state.parks:
            self.core.state.parks = True
            self.nodes.park_spares()
        self.core.state.goodput.started(started.attempt, started.first_step_at)
        for incident in self.core.status.incidents:
            if incident.recovery_s is None and incident.action is not Action.REPORT and (
                    incident.attempt < started.attempt or any(incident is j for j in self.core.live.joins)):
                incident.recovery_s = round(max(0.0, started.first_step_at - incident.detected_at), 3)
                workflow.metric_meter().create_histogram_float(
                    "trainguard_recovery_seconds", "Detection to the first step of the next attempt", "s"
                ).record(incident.recovery_s, {"kind": incident.kind.value})

    # --------------------------------------------------------------------------------------------- run
    @workflow.run
    async def run(self, raw_input: RawValue = NO_INPUT) -> RunResult:
        core, info = self.core, workflow.info()
        try:
            parsed = parse_run_input(decode_run_input(raw_input), continued=info.continued_run_id is not None,
                                     workflow_id=info.workflow_id)
        except RunInputError as error:
            raise core.fail(str(error), ErrorType.INVALID_SPEC, phase=True) from None
        core.spec, resumed = parsed.spec, parsed.carried is not None
        if parsed.carried is not None:
            core.state = parsed.carried
            core.publish()
        else:
            # From the start request, not the first workflow task: a run that waited for a controller waited in
            # its wall time too, as `trainguard run report` (which reads the history's own timestamps) counts it.
            core.state.started_at = info.workflow_start_time.timestamp()
            core.status.nodes, core.status.world_size = list(parsed.spec.nodes), parsed.spec.world_size
        if parsed.spec.replica_groups is not None:
            return await ReplicaGroups(core).run()  # the groups' own runs train; this one holds what they share
        attempt = core.status.attempt
        try:
            if not resumed:
                core.set_phase(Phase.RESERVING)
                await self.nodes.reserve()
            while True:
                if resumed:
                    resumed = False  # watch the ranks the previous history launched
                    outcome = await self.supervisor.supervise(attempt)
                else:
                    attempt += 1
                    core.status.attempt = attempt
                    outcome = await self._attempt(attempt)
                if outcome.finished:
                    break
                await self._between_attempts(attempt, outcome)
            await self._finish_background()
            await workflow.wait_condition(workflow.all_handlers_finished)
            if parked := self.nodes.parked_spares():  # the ranks finished; the spares' parked processes go too
                await self.nodes.stop_everywhere(parked, None, "run ended: stop parked processes",
                                                 StopReason.RUN_ENDED)
            await self.nodes.release()
            return self._result(attempt, outcome.final_events)
        except workflow.ContinueAsNewError:
            raise
        except BaseException as error:
            # Whatever ends the run (a stop decision, cancellation, a bug): no rank may outlive it.
            if core.status.phase is not Phase.FAILED:
                core.say(core.status.reason or cause_text(error))
                core.set_phase(Phase.FAILED)
            if core.state.launched:  # the spares' parked processes too
                await self.nodes.stop_everywhere([*core.status.nodes, *self.nodes.parked_spares()], None,
                                                 "run ended: stop every rank", StopReason.RUN_ENDED)
            await self.nodes.release()
            raise

    async def _attempt(self, attempt: int) -> Outcome:
        """Restore and launch, then supervise until something ends the attempt."""
        launched = await self.attempts.run(attempt)
        if isinstance(launched, Outcome):
            return launched
        outcome = await self.supervisor.supervise(attempt, launched.launch, launched.download)
        return await self.attempts.settle(attempt, launched, outcome)

    async def _between_attempts(self, attempt: int, outcome: Outcome) -> None:
        match outcome.ending:
            case Ending.CONTINUE:
                await self._continue_as_new()
            case Ending.PAUSE:
                await self.nodes.stop_everywhere(self.core.status.nodes, attempt, "paused by an operator",
                                                 StopReason.OPERATOR_PAUSE)
                await self.recovery.wait_for_operator(StopReason.OPERATOR_PAUSE)
            case Ending.DRAIN:
                await self.recovery.move_off_drained(attempt)
            case Ending.GROW:
                self.recovery.grow_back(attempt, outcome.grow)
            case Ending.INCIDENT:
                assert outcome.incident is not None
                await self.recovery.recover(attempt, outcome.incident)
            case Ending.RELAUNCH:
                pass  # recorded already: the next attempt restores the newest usable checkpoint

    async def _continue_as_new(self) -> None:
        """Carry the run's whole state into a new history; its ranks keep running. Handlers finish first, so
        an operator's request accepted now is either acted on here or carried, never acknowledged and lost."""
        await self._finish_background()
        await workflow.wait_condition(workflow.all_handlers_finished)
        self.core.state.continued += 1
        workflow.continue_as_new(continued_input(self.core.the_spec, self.core.state))

    async def _finish_background(self) -> None:
        """Let background activities (a scheduler's cordon) finish before the run reports done or continues."""
        for task in self.core.live.background:
            try:
                await task
            except ActivityError as error:
                workflow.logger.warning("background activity failed: %s", cause_text(error))
        self.core.live.background.clear()

    def _result(self, attempts: int, events: list[WatchEvent]) -> RunResult:
        core = self.core
        wall = max(1e-9, workflow.now().timestamp() - core.state.started_at)
        steps = min((e.step for e in events), default=0)
        first = events[0] if events else None
        mean = first.mean_step_s if first else None
        phases: dict[str, float] = {}
        for event in events:
            for name, seconds in event.phase_s.items():
                phases[name] = max(seconds, phases.get(name, 0.0))
        useful = min(wall, core.state.goodput.useful(attempts, steps, mean) + sum(phases.values()))
        goodput = min(1.0, useful / wall)
        core.status.step = max(core.status.step, steps)
        core.set_phase(Phase.COMPLETED)
        workflow.metric_meter().create_gauge_float("trainguard_goodput", "Useful training time / wall time of "
                                                   "the latest completed run").set(goodput)
        return RunResult(
            workflow_id=workflow.info().workflow_id,
            steps_completed=steps,
            attempts=attempts,
            incidents=core.status.incidents,
            final_checkpoint=core.status.latest_checkpoint,
            final_state_digest=first.state_digest if first else None,
            goodput=round(goodput, 4),
            useful_s=round(useful, 3),
            wall_s=round(wall, 3),
            mean_step_s=mean,
            phase_s=phases,
        )
