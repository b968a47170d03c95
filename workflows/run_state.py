"""What a `TrainingRun` carries across continue-as-new, and the one place its input is parsed.

`RunState` owns everything a later history needs: the status users query, the budgets spent, the nodes lost
and replaced, the checkpoints known corrupt, and the operator's requests not yet acted on. The workflow holds
one and hands it to `continue_as_new` whole: there is no field-by-field copy to forget a field in.
`Live` holds what each history rebuilds (tasks, watch groups, references into this attempt's incidents), each
field saying why it need not be carried. A unit test fails when the workflow grows state in neither.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, ValidationError
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue

with workflow.unsafe.imports_passed_through():
    from activities.fingerprint_models import Tie
    from activities.models import RankEvidence
    from trainguard.ids import validate_workflow_id
    from trainguard.models import Incident, RunStatus
    from trainguard.spec import RunSpec, SpecError, loads_spec_json, parse_spec
    from workflows.goodput import Goodput
    from workflows.node_group_models import GroupReport, NodeGroupWatchInput, NodeGroupWatchResult


class OperatorIntents(BaseModel):
    """Operator requests accepted by an update and not yet acted on: the loop acts on them, and a request
    accepted just before the run continues as new is acted on in the next history."""

    pause: bool = False
    """`pause` was accepted: stop the ranks at the supervisor's next look and wait for `resume`."""
    resume: bool = False
    """`resume` was accepted (while paused, or while a pause was on its way)."""
    abort_reason: str | None = None
    """`abort` was accepted: the paused run fails with this reason."""
    draining: list[str] = Field(default_factory=list)
    """Nodes to move off at the next committed checkpoint (`drain_node`)."""


class RunState(BaseModel):
    """Everything a run carries into its next history when it continues as new (its ranks keep running)."""

    status: RunStatus = Field(default_factory=RunStatus)
    """What the `status` query answers: phase, attempt, nodes, incidents, newest checkpoint."""
    started_at: float = 0.0
    """Workflow-clock time of the run's first start request, so wall time and goodput span every history."""
    spares: list[str] = Field(default_factory=list)
    """Spare nodes the run holds."""
    parks: bool = False
    """The run's script parks: its master node's ranks called `standby()` (`GroupStarted.parks`). From then on
    the run has its spares park its processes too, so a spare's relaunch is warm."""
    parked_spares: list[str] = Field(default_factory=list)
    """Spares asked to park the run's processes (`RunNodes.park_spares`), once each; a spare that joins the run
    leaves the list (its launch took them). Those still spares are stopped with the run's ranks when it ends."""
    leased: bool = False
    """The pool has leased nodes to the run: it releases them when the run ends."""
    launched: bool = False
    """Ranks may be running somewhere: the run stops them when it ends."""
    restart_times: list[float] = Field(default_factory=list)
    """Workflow-clock times of the relaunches the restart budget counts."""
    restarts_without_checkpoint: int = 0
    last_committed_step: int = -1
    state_since_attempt: int = 1
    """The attempt the live ranks' state comes from: the last relaunch (in-process restarts keep it)."""
    straggler_streak: dict[int, int] = Field(default_factory=dict)
    """Rank -> consecutive straggler windows it was slow in."""
    slow_window_end: float = 0.0
    """Unix time the last slow window the run judged ended (0: none yet): the committer returns only later ones."""
    lost: list[str] = Field(default_factory=list)
    """Nodes a shrink left behind, to grow back onto when they return."""
    replaced: list[str] = Field(default_factory=list)
    """Nodes a spare replaced, to take back as spares when they return."""
    corrupt_steps: list[int] = Field(default_factory=list)
    """Checkpoints found corrupt: no restore of this run loads them again."""
    restore_before: int | None = None
    """A silent data corruption or a numerical fault at this step: restores take only older checkpoints, until
    the run commits one at or past it again (`Incident.bad_step`). None: any."""
    tie: Tie | None = None
    """Two replicas that differed with no majority: held until a later attempt shows which node is sick
    (`workflows.supervision.tie_verdict`), or that the fault does not come back."""
    commit_times: list[float] = Field(default_factory=list)
    """Workflow-clock times of the last two commits: the interval the staleness bound is measured in."""
    commit_clock_from: float | None = None
    """Since when the run counts as without a commit: the newest commit, the first launch, or a resume."""
    learned_gaps: dict[int, float] = Field(default_factory=dict)
    """Gaps between steps the run's healthy ranks took (step -> seconds, `WatchEvent.gaps`): every watch is told
    them, so a gap that recurs is expected after a relaunch or a continue-as-new too."""
    restore_tier: str | None = None
    """Where the current attempt's restore read its shards from (`local`, `peer`, `store`, joined by `+`)."""
    warm: Incident | None = None
    """A crash the next attempt recovers from in process (its live ranks keep their state)."""
    injected_at: dict[str, float] = Field(default_factory=dict)
    """`fault@node` -> when chaos injected it: a node-down or slow rank is timed from there when noticed."""
    publish_search_attributes: bool = False
    """The namespace has trainguard's search attributes registered."""
    continued: int = 0
    """How many times the run has continued as new."""
    goodput: Goodput = Field(default_factory=Goodput)
    """Useful training time so far, attempt by attempt (`workflows/goodput.py`)."""
    intents: OperatorIntents = Field(default_factory=OperatorIntents)


@dataclass
class HangAttribution:
    """A hang's culprit being named from every node's evidence (`workflows.culprit`) while the run goes on."""

    incident: Incident
    attempt: int
    """The attempt that hung."""
    nodes: list[str]
    """Its nodes: the attribution is complete once each has given its evidence."""
    evidence: dict[str, list[RankEvidence]]
    """What each node's ranks showed, by node."""
    watch_rank: int | None
    watch_node: str | None
    """The rank the first watch judged hung: the culprit when the evidence tells the ranks apart no better."""
    prefix: str = ""
    """What naming a rank other than the watch's put in front of the incident's cause (replaced when renamed)."""
    fresh: bool = False
    """Evidence came in since the culprit was last named."""


@dataclass
class Live:
    """What one history of the run rebuilds rather than carries. The run continues as new only from a quiet
    supervisor (no incident, no relaunch under way) after its watch groups and background activities ended, so
    none of this holds anything a later history needs."""

    background: list[asyncio.Task[Any]] = field(default_factory=list)
    """Activities nobody waits on (a scheduler's cordon): awaited before the run ends or continues."""
    restored_by: list[Incident] = field(default_factory=list)
    """Incidents this attempt's restore recovers, to add the restore tiers of launching watches to: the
    launches are over once a checkpoint committed, and only then may the run continue as new."""
    symptom: tuple[Incident, str] | None = None
    """The rank fault a relaunch recovers from, with what it was first seen as, while no stop proved its node
    reachable; a committed checkpoint since makes it moot."""
    liveness: asyncio.Task[list[str]] | None = None
    """A crash's liveness check of its node and its peers' (`RunNodes.unanswered`), started as the crash is
    seen: the recovery takes a node that did not answer as the crash's cause."""
    joins: list[Incident] = field(default_factory=list)
    """Lost nodes a spare replaced within the attempt: its first step ends their recovery (long past at a
    continue-as-new)."""
    event_evidence: dict[str, list[RankEvidence]] = field(default_factory=dict)
    """Hang evidence watches brought with their events, by node: per incident."""
    attributing: HangAttribution | None = None
    """A hang relaunched before every node's evidence was in (a run whose groups stand): the groups' later
    reports of the hung attempt add theirs and the culprit is named again. Dropped at a continue-as-new (the
    culprit stays as named so far): a run continues as new only at a commit, long after a hang's reports."""
    reports: list[GroupReport] = field(default_factory=list)
    """What standing groups reported, not yet taken by the supervisor. Groups end before continue-as-new."""
    standing: dict[int, asyncio.Task[NodeGroupWatchResult]] = field(default_factory=dict)
    """Standing groups still watching after the attempt that ended, for the relaunch to take up."""
    standing_nodes: list[str] = field(default_factory=list)
    """The run's nodes when they stood: a relaunch onto as many nodes in the same places takes them up."""
    reported_groups: set[int] = field(default_factory=set)
    """Standing groups that reported in the attempt that ended: nodes of theirs have no watch left."""
    restarting: dict[str, float] = field(default_factory=dict)
    """Nodes whose agents said they were shutting down (an upgrade, a restart), with when: the recovery waits
    for all of them to be back before it relaunches (a whole stack restarting at once)."""
    group_ids: dict[int, str] = field(default_factory=dict)
    group_requests: dict[int, NodeGroupWatchInput] = field(default_factory=dict)
    """Each watch group's workflow id and what it was last given, by index."""


class RunInputError(ValueError):
    """A start input the run refuses: a bad spec, or state only a continue-as-new may carry."""


@dataclass(frozen=True, slots=True)
class RunInput:
    spec: RunSpec
    carried: RunState | None
    """None: a fresh start."""


def continued_input(spec: RunSpec, state: RunState) -> dict[str, Any]:
    """The input of the run's next history."""
    return {"spec": spec.model_dump(mode="json"), "carried": state.model_dump(mode="json")}


NO_INPUT = RawValue(Payload())
"""What `TrainingRun.run` is given when the start request carried no input at all (`temporal workflow start`
without `--input`): refused like a bad spec, where a missing argument would fail every workflow task forever."""

JSON_ENCODING = b"json/plain"
NULL_ENCODING = b"binary/null"
"""The payload encodings a start input may have: JSON (what `temporal workflow start --input` and every SDK's
JSON converter send), or an explicit null (refused by `parse_spec` naming it)."""


def decode_run_input(raw: RawValue) -> Any:
    """The run's input payload as plain values. The workflow decodes it itself, not the SDK: a payload the SDK
    fails to decode (a number of 5,001 digits, JSON that is not JSON) fails the workflow *task*, which Temporal
    retries forever while the run sits Running. Here every such input raises `RunInputError`, so the run fails at
    once as a bad spec, saying what to fix."""
    if raw is NO_INPUT:
        raise RunInputError("the run's input is missing: start TrainingRun with its spec as the input "
                            "(`temporal workflow start ... --input-file examples/<spec>.json`)")
    encoding = raw.payload.metadata.get("encoding", b"")
    if encoding == NULL_ENCODING:
        return None
    if encoding != JSON_ENCODING:
        raise RunInputError(f"the run's input is encoded as {encoding.decode(errors='replace')[:40]!r}: start "
                            "TrainingRun with its spec as JSON")
    try:
        return loads_spec_json(raw.payload.data)
    except SpecError as error:
        raise RunInputError(f"invalid run input: {error}") from None


def parse_run_input(raw: Any, *, continued: bool, workflow_id: str) -> RunInput:
    """The run's input, parsed once. A start request gives a spec; only the run's own continue-as-new
    (`continued`) may carry state, and what it carries is validated before anything acts on it."""
    try:
        validate_workflow_id(workflow_id)
    except ValueError as error:
        raise RunInputError(f"invalid workflow id: {error}") from None
    carried: RunState | None = None
    if isinstance(raw, dict) and "carried" in raw:
        if not continued:
            raise RunInputError("invalid run input: `carried` is the run's own continue-as-new state; "
                                "start a run with its spec alone")
        if set(raw) != {"spec", "carried"}:
            raise RunInputError(f"invalid carried input: unexpected keys {sorted(set(raw) - {'spec', 'carried'})}")
        try:
            carried = RunState.model_validate(raw["carried"])
        except ValidationError as error:
            raise RunInputError(f"invalid carried state: {error}") from None
        raw = raw["spec"]
    try:
        spec = parse_spec(raw)
    except SpecError as error:
        raise RunInputError(str(error)) from None
    return RunInput(spec=spec, carried=carried)
