"""`RunCore`: the run's state, spec and the few helpers every part of a `TrainingRun` shares.

The run's parts (`RunNodes`, `Watches`, `Attempts`, `Supervisor`, `Recovery`) are small managers composed
around one `RunCore`: the state lives here once, and only `RunState` crosses continue-as-new.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.models import WatchEvent, merge_gaps
    from trainguard import search_attributes
    from trainguard.error_types import ErrorType
    from trainguard.faults import FaultKind
    from trainguard.models import (INCIDENT_TAILS_KEPT, Action, CheckpointRef, Incident, IncidentKind, Phase,
                                   RunStatus)
    from trainguard.spec import RunSpec
    from workflows.policy import next_phase
    from workflows.run_details import run_details
    from workflows.run_state import Live, RunState


def cause_text(error: BaseException) -> str:
    """The innermost readable cause of an activity or child failure."""
    cause = error.__cause__
    while cause is not None and cause.__cause__ is not None and not isinstance(cause, ApplicationError):
        cause = cause.__cause__
    return str(cause or error)


def error_type(error: BaseException) -> str | None:
    cause = error.__cause__
    return cause.type if isinstance(cause, ApplicationError) else None


def injected_key(fault: str, node: str) -> str:
    return f"{fault}@{node}"


class RunCore:
    def __init__(self, state: RunState) -> None:
        self.state = state
        self.live = Live()
        self.spec: RunSpec | None = None

    # ------------------------------------------------------------------------------------------ shared
    @property
    def status(self) -> RunStatus:
        return self.state.status

    @property
    def the_spec(self) -> RunSpec:
        assert self.spec is not None, "the run's spec is parsed before any part acts"
        return self.spec

    @staticmethod
    def wid() -> str:
        return workflow.info().workflow_id

    def run_prefix(self) -> str:
        spec = self.the_spec
        return f"{spec.checkpoint.prefix}/{spec.checkpoint.namespace or self.wid()}"

    def set_phase(self, phase: Phase) -> None:
        if phase is not self.status.phase:
            self.status.phase = next_phase(self.status.phase, phase)
            self.publish()

    def publish(self) -> None:
        """Phase, committed step and incident count as search attributes, for filtering runs; and the run's
        current details (phase, attempt, step, nodes, last incident) for the Web UI."""
        workflow.set_current_details(run_details(self.status, self.state.spares))
        if not self.state.publish_search_attributes:
            return
        committed = self.status.latest_checkpoint.step if self.status.latest_checkpoint else 0
        workflow.upsert_search_attributes([
            search_attributes.PHASE.value_set(self.status.phase.value),
            search_attributes.STEP.value_set(committed),
            search_attributes.INCIDENTS.value_set(len(self.status.incidents)),
        ])

    def fail(self, reason: str, kind: ErrorType, phase: bool = False) -> ApplicationError:
        """The error that ends the run, its reason in the status and its incidents in the details (a replica
        group's parent reports a failed group's incidents from them)."""
        self.say(reason)
        if phase:
            self.set_phase(Phase.FAILED)
        incidents = [incident.model_dump(mode="json") for incident in self.status.incidents]
        return ApplicationError(reason, incidents, type=kind, non_retryable=True)

    def count_restart(self, now: float) -> None:
        self.state.restart_times.append(now)
        self.state.restarts_without_checkpoint += 1

    def take_back_restart(self) -> None:
        self.state.restart_times = self.state.restart_times[:-1]
        self.state.restarts_without_checkpoint = max(0, self.state.restarts_without_checkpoint - 1)

    # ------------------------------------------------------------------------------------ transitions
    # The run's nodes, spares, lease, reason and commit clock change here and nowhere else.
    def say(self, reason: str | None) -> None:
        """Why the run is where it is (`status.reason`): waiting for nodes, paused, failed; None: nothing to say."""
        self.status.reason = reason

    def take_lease(self, nodes: list[str], replaced: dict[str, str]) -> None:
        """Train on the nodes the pool granted; a cordoned named node a spare replaced is out of the run (and
        taken back as a spare once repaired, as a node replaced later would be)."""
        self.state.leased = True
        if not nodes:
            return
        for named in replaced:
            self.status.cordoned = [*self.status.cordoned, named]
            self.state.replaced = [*self.state.replaced, named]
        self.status.replaced_at_start = dict(replaced)
        self.status.nodes = list(nodes)
        self.spec = self.the_spec.resolved(nodes)

    def hold_spares(self, spares: list[str]) -> None:
        self.state.spares = list(spares)

    def replace(self, node: str, spare: str, cordoned: bool = True, reclaim: bool = False, hold: bool = False) -> None:
        """`spare` in `node`'s place; `cordoned`: the run cordoned `node` in the pool (its status lists it);
        `reclaim`: `node` is taken back as a spare once repaired; `hold`: `node` is one of the run's spares now."""
        self.status.nodes = [spare if n == node else n for n in self.status.nodes]
        self.state.spares = [*(n for n in self.state.spares if n != spare), *([node] if hold else [])]
        if cordoned:
            self.status.cordoned = [*self.status.cordoned, node]
        if reclaim:
            self.state.replaced = [*self.state.replaced, node]
        if spare in self.state.parked_spares:  # its launch takes what it parked; a spare again, it parks again
            self.state.parked_spares = [n for n in self.state.parked_spares if n != spare]

    def cordon_spare(self, node: str) -> None:
        """A spare of the run cordoned: it leaves the run's spares, and its status lists it."""
        self.state.spares = [n for n in self.state.spares if n != node]
        self.status.cordoned = [*self.status.cordoned, node]

    def spares_back(self, back: list[str]) -> None:
        """Nodes spares replaced are repaired and leased again: this run's spares now."""
        self.state.replaced = [n for n in self.state.replaced if n not in back]
        self.state.spares = [*self.state.spares, *back]
        self.status.cordoned = [n for n in self.status.cordoned if n not in back]

    def shrink(self, node: str) -> None:
        """Go on without `node` (lost, cordoned, no spare): the world shrinks until it comes back."""
        self.state.lost = [*self.state.lost, node]
        self.status.nodes = [n for n in self.status.nodes if n != node]
        self.status.cordoned = [*self.status.cordoned, node]
        self.status.world_size = len(self.status.nodes) * self.the_spec.ranks_per_node

    def grow_back(self, returned: list[str]) -> None:
        """Nodes a shrink left behind are back, in their places in the spec's order."""
        spec = self.the_spec
        self.status.nodes = [n for n in spec.nodes if n in self.status.nodes or n in returned]
        self.state.lost = [n for n in self.state.lost if n not in returned]
        self.status.cordoned = [n for n in self.status.cordoned if n not in returned]
        self.status.world_size = len(self.status.nodes) * spec.ranks_per_node

    def start_commit_clock(self, restart: bool = False) -> None:
        """From now on, training without a commit is at risk: at the first launch, and again after a pause
        (`restart`: paused time put nothing at risk)."""
        if restart or self.state.commit_clock_from is None:
            self.state.commit_clock_from = workflow.now().timestamp()

    def committed(self, ref: CheckpointRef) -> None:
        """The committer already applied retention; the history records the commit."""
        if ref.step > self.state.last_committed_step:
            now = workflow.now().timestamp()
            self.state.last_committed_step = ref.step
            if self.state.restore_before is not None and ref.step >= self.state.restore_before:
                self.state.restore_before = None  # the run is past the rollback: its newest checkpoint is good
            self.state.restarts_without_checkpoint = 0
            self.state.commit_times = [*self.state.commit_times[-1:], now]
            self.state.commit_clock_from = now
            self.state.goodput.committed(ref.step, now)
            self.status.latest_checkpoint = ref
            self.status.last_commit_at = now
            self.status.store_error, self.status.upload_errors = None, {}
            self.status.step = max(self.status.step, ref.step)
            for incident in self.open_storage_incidents():  # checkpoints commit again: recovered
                incident.recovery_s = round(max(0.0, now - incident.detected_at), 3)
            self.publish()

    def open_storage_incidents(self) -> list[Incident]:
        """Storage incidents of checkpoints going stale that no commit has closed yet."""
        return [i for i in self.status.incidents if i.kind is IncidentKind.STORAGE_UNAVAILABLE
                and i.action is Action.REPORT and i.recovery_s is None]

    def checkpoint_age_s(self) -> float | None:
        """Seconds the run has gone without a commit (the clock starts at its first launch, and again at a
        resume); None before it launched."""
        since = self.state.commit_clock_from
        return None if since is None else round(max(0.0, workflow.now().timestamp() - since), 3)

    # --------------------------------------------------------------------------------------- incidents
    def record_incident(self, incident: Incident, publish: bool = True) -> None:
        """`publish=False`: the caller publishes next (a phase change), so no second search-attribute upsert
        is a command of its own."""
        if incident in self.status.incidents:
            return
        self.status.incidents = [*self.status.incidents, incident]
        if publish:
            self.publish()  # the Web UI's details and the TrainguardIncidents search attribute
        for older in self.status.incidents[:-INCIDENT_TAILS_KEPT]:
            older.log_tail = ""
        meter = workflow.metric_meter()  # replay-safe: nothing is emitted while replaying
        labels = {"kind": incident.kind.value, "action": incident.action.value}
        meter.create_counter("trainguard_incidents", "Incidents by kind and action").add(1, labels)
        if incident.detection_s is not None:
            meter.create_histogram_float("trainguard_detection_seconds", "Fault to detection", "s").record(
                incident.detection_s, {"kind": incident.kind.value})

    def learn(self, events: list[WatchEvent], step: int | None = None) -> None:
        """What watch events teach the run: the gaps in progress its script shows (a later watch's bound) and
        the tiers its ranks restored from (named on the incidents this attempt recovers); `step`: how far a
        failing rank got."""
        state = self.state
        for event in events:
            state.learned_gaps = merge_gaps(state.learned_gaps, event.gaps)
        tiers = {tier for event in events for tier in event.restore_tiers}
        known = set((state.restore_tier or "").split("+")) - {""}
        if tiers - known:
            state.restore_tier = "+".join(sorted(known | tiers))
            for incident in self.live.restored_by:
                incident.restore_tier = state.restore_tier
        if step is not None:
            self.status.step = max(self.status.step, step)

    def node_lost(self, node: str, attempt: int, detail: str) -> Incident:
        """A node whose agent stopped answering. Detection is timed from the fault when chaos injected it
        (`node-down`); otherwise the time of the agent's last heartbeat is not known here, and it is left out."""
        now = workflow.now().timestamp()
        down_at = self.state.injected_at.get(injected_key(FaultKind.NODE_DOWN, node))
        return Incident(kind=IncidentKind.NODE_UNRESPONSIVE, node=node, attempt=attempt, detail=detail,
                        detection_s=None if down_at is None else round(max(0.0, now - down_at), 3),
                        detected_at=now)

    def symptom_of_lost_node(self, symptom: Incident, node: str, seen_as: str, missed: str = "the stop") -> Incident:
        """One fault, one incident: a rank fault whose node then did not answer is taken back, and the lost
        node is the incident, timed from the symptom (its first sign), with the symptom in its detail."""
        self.status.incidents = [i for i in self.status.incidents if i is not symptom]
        lost = self.node_lost(node, symptom.attempt, f"node agent did not answer {missed} after "
                                                     f"{symptom.kind.value} on {symptom.node} ({seen_as})")
        # Timed from the symptom both ways, so detection_s + recovery_s is fault to first new step: measured to
        # when the node was found instead, a node-down bench-recovery counted the relaunch's 10 s wait twice.
        lost.detected_at = symptom.detected_at
        down_at = self.state.injected_at.get(injected_key(FaultKind.NODE_DOWN, node))
        lost.detection_s = (symptom.detection_s if down_at is None
                            else round(max(0.0, symptom.detected_at - down_at), 3))
        return lost

    def lost_at_launch(self, node: str, attempt: int, detail: str) -> Incident:
        """A node lost while attempt `attempt` restores, launches or runs. Before its first step, and after a
        rank fault that no stop proved harmless to its node (a fenced relaunch), the fault was this node's
        symptom: one incident, the lost node, and the relaunch it cost is not counted twice."""
        symptom, self.live.symptom = self.live.symptom, None
        if symptom is None or symptom[0].attempt != attempt - 1 or symptom[0].recovery_s is not None:
            return self.node_lost(node, attempt, detail)
        self.take_back_restart()
        return self.symptom_of_lost_node(symptom[0], node, symptom[1], missed=f"the relaunch ({detail})")
