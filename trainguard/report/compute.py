"""Spans -> report: phases, the time each incident cost, goodput. Pure (`compute_report`,
`report_from_histories`: the clock and the histories are arguments, so they are unit-tested with fabricated
histories), but for `build_report`, which fetches the histories first."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

from trainguard.models import Action, Incident, RunResult, RunStatus, StopReason
from trainguard.report.decode import fetch_chain
from trainguard.report.model import PHASES, IncidentLoss, RunHistory, RunReport, Segment, Span, StepPoint


def _watch_events(spans: Sequence[Span]) -> list[tuple[Span, dict[str, Any]]]:
    return [(s, s.result) for s in spans if s.name == "watch_ranks" and isinstance(s.result, dict)]


_STOP_PHASES = {StopReason.OPERATOR_PAUSE: "paused", StopReason.RUN_ENDED: "finishing",
                StopReason.INCIDENT_PAUSE: "pause-after"}
"""What a stop of each reason starts (`pause-after`: recovery, then paused once the ranks are stopped); any
other reason is recovery."""


def _stop_kind(span: Span) -> str:
    """What a `stop_ranks` span starts, from its input's `reason`."""
    reason = span.input.get("reason") if span.input else None
    if reason is None:
        # Histories recorded before `StopRanksInput.reason` existed: only the summary tells.
        return _stop_kind_of_summary(span.summary)
    try:
        return _STOP_PHASES.get(StopReason(reason), "recovering")
    except ValueError:
        return "recovering"  # a reason newer than this release: every stop is recovery unless it says otherwise


def _stop_kind_of_summary(summary: str) -> str:
    if "paused by an operator" in summary:
        return "paused"
    if "run ended" in summary:
        return "finishing"
    if summary.rstrip().endswith(": pause"):
        return "pause-after"
    return "recovering"


def _mean_step(points: list[StepPoint]) -> float | None:
    """Median seconds per step between consecutive step reports of the same attempt."""
    rates = []
    for a, b in zip(points, points[1:]):
        if a.attempt == b.attempt and b.step > a.step and b.at_s > a.at_s:
            rates.append((b.at_s - a.at_s) / (b.step - a.step))
    return statistics.median(rates) if rates else None


def compute_report(
    spans: Sequence[Span],
    *,
    start: float,
    end: float,
    workflow_id: str = "",
    status: str = "COMPLETED",
    result: RunResult | None = None,
    incidents: Sequence[Incident] | None = None,
    runs: int = 1,
    first_phase: str = "reserving",
    history_start: float | None = None,
    notes: Sequence[str] = (),
) -> RunReport:
    """The goodput breakdown of a run whose activities are `spans` (unix times), from `start` to `end`.

    `incidents` default to the result's. `history_start`: when older runs of a continued chain are missing,
    where the readable history begins (time before it is reported as `earlier runs`).
    """
    spans = sorted(spans, key=lambda s: s.start)
    incidents = list(result.incidents if incidents is None and result is not None else incidents or [])
    notes = list(notes)
    wall = max(0.0, end - start)

    # Markers: (unix time, order, phase, attempt). Order breaks ties: things scheduled together keep the
    # sequence the workflow ran them in.
    markers: list[tuple[float, int, str, int | None]] = [(start, 0, first_phase, None)]
    if history_start is not None and history_start > start:
        markers = [(start, 0, "earlier runs", None), (history_start, 1, first_phase, None)]
    order = 10
    first_step: dict[int, float] = {}
    finished_at: dict[int, float] = {}
    points: list[StepPoint] = []
    for span, event in _watch_events(spans):
        attempt = span.attempt or 0
        if isinstance(event.get("first_step_at"), (int, float)):
            first_step[attempt] = min(first_step.get(attempt, math.inf), float(event["first_step_at"]))
        detected = event.get("detected_at")
        if isinstance(detected, (int, float)) and detected > 0:
            if event.get("kind") == "finished":
                finished_at[attempt] = min(finished_at.get(attempt, math.inf), float(detected))
            if isinstance(event.get("step"), int) and event["step"] >= 0:
                points.append(StepPoint(detected - start, event["step"], attempt))
    for span in spans:
        # Each commit says how far the slowest node had got when it reported the checkpoint.
        if span.name == "commit_checkpoints" and isinstance(span.result, dict) and span.end is not None:
            for commit in span.result.get("commits") or []:
                if isinstance(commit, dict) and isinstance(commit.get("step"), int) and commit["step"] >= 0:
                    points.append(StepPoint(span.end - start, commit["step"], span.attempt or 0))
    restored_from: dict[int, int] = {}
    for span in spans:
        order += 1
        if span.name == "find_checkpoint":
            markers.append((span.start, order, "restoring", span.attempt))
        elif span.name == "launch_ranks":
            markers.append((span.start, order, "launching", span.attempt))
            if span.attempt is not None and span.input and isinstance(span.input.get("restore_step"), int):
                restored_from[span.attempt] = span.input["restore_step"]
        elif span.name == "rejoin_ranks":  # an in-process restart: no restore, the live ranks' step goes on
            markers.append((span.start, order, "launching", span.attempt))
            step = span.result.get("step") if isinstance(span.result, dict) else None
            if span.attempt is not None and isinstance(step, int):
                restored_from[span.attempt] = min(restored_from.get(span.attempt, step), step)
        elif span.name == "stop_ranks":
            kind = _stop_kind(span)
            if kind == "pause-after":
                markers.append((span.start, order, "recovering", span.attempt))
                stopped = span.end if span.end is not None else span.start
                markers.append((stopped, order, "paused", span.attempt))
            else:
                markers.append((span.start, order, kind, span.attempt))
    for attempt, at in first_step.items():
        markers.append((at, 5, "running", attempt))
        points.append(StepPoint(at - start, restored_from.get(attempt, 0), attempt))
    if finished_at:
        # Training ended at the last step: the first report of the final step (often its checkpoint), else
        # the ranks' exit.
        last = max(finished_at)
        final = max((p.step for p in points if p.attempt == last), default=None)
        reached = [start + p.at_s for p in points if p.attempt == last and p.step == final]
        markers.append((min([finished_at[last], *reached]), 5, "finishing", last))
    for incident in incidents:
        if incident.detected_at > 0 and incident.action is not Action.REPORT and incident.attempt > 0:
            markers.append((incident.detected_at, 4, "recovering", incident.attempt))

    markers = sorted((m for m in markers if start <= m[0] <= end), key=lambda m: (m[0], m[1]))
    segments: list[Segment] = []
    attempt = 0
    for at, _, phase, marker_attempt in markers:
        if marker_attempt is not None and phase in ("restoring", "launching", "running"):
            attempt = max(attempt, marker_attempt)
        offset = at - start
        if segments and segments[-1].phase == phase:
            continue
        if segments:
            segments[-1].end = offset
            if segments[-1].seconds <= 0:
                segments.pop()
        if segments and segments[-1].phase == phase:
            continue
        segments.append(Segment(phase, offset, offset, attempt))
    if segments:
        segments[-1].end = wall
    phases = {p: 0.0 for p in PHASES if p != "earlier runs" or history_start is not None}
    for segment in segments:
        phases[segment.phase] = phases.get(segment.phase, 0.0) + segment.seconds

    points.sort(key=lambda p: (p.attempt, p.at_s, p.step))
    mean_step = result.mean_step_s if result is not None and result.mean_step_s else _mean_step(points)
    latest = max((p.attempt for p in points), default=0)
    steps = result.steps_completed if result is not None else \
        max((p.step for p in points if p.attempt == latest), default=None)
    if result is None and steps is not None:
        notes.append(f"not completed: steps counted up to the newest one seen ({steps})")

    losses = [_incident_loss(i, spans, points, start, mean_step) for i in incidents]
    lost = sum(loss.lost_s for loss in losses)
    useful = result.useful_s if result is not None and result.useful_s is not None else \
        steps * mean_step if steps is not None and mean_step else None
    goodput = min(1.0, useful / wall) if useful is not None and wall > 0 else None
    attempts = max([0, *(s.attempt or 0 for s in spans), *first_step])
    return RunReport(
        workflow_id=workflow_id, status=status, runs=runs, started_at=start, wall_s=wall, phases=phases,
        segments=segments, incidents=losses, steps_completed=steps, mean_step_s=mean_step, useful_s=useful,
        goodput=goodput, lost_s=lost, attempts=attempts,
        points=sorted(points, key=lambda p: p.at_s), result_wall_s=result.wall_s if result else None,
        notes=notes, named_phases=dict(result.phase_s) if result is not None else {},
    )


def _incident_loss(incident: Incident, spans: Sequence[Span], points: list[StepPoint], start: float,
                   mean_step: float | None) -> IncidentLoss:
    at = incident.detected_at - start if incident.detected_at > 0 else None
    notes: list[str] = []
    step: int | None = None
    if incident.action is not Action.REPORT and incident.detected_at > 0:
        # The watch event that reported it carries the node's step then; else the newest step seen before.
        for _span, event in _watch_events(spans):
            detected = event.get("detected_at")
            if (event.get("node") in (None, incident.node) and isinstance(detected, (int, float))
                    and abs(detected - incident.detected_at) < 1e-3 and isinstance(event.get("step"), int)):
                step = event["step"]
                break
        if step is None:
            earlier = [p.step for p in points
                       if p.attempt == incident.attempt and at is not None and p.at_s <= at]
            step = max(earlier) if earlier else None
    redone = redone_s = None
    if incident.action is Action.REPORT:
        notes.append("reported, training went on")
    elif step is not None and incident.resumed_step is not None:
        redone = max(0, step - incident.resumed_step)
        redone_s = redone * mean_step if mean_step else None
        if redone_s is None:
            notes.append("mean step time unknown: redone work not counted")
    elif incident.resumed_step is None:
        notes.append("not resumed (yet)")
    if incident.action is not Action.REPORT and incident.detection_s is None:
        notes.append("detection time unknown")
    if (incident.action is not Action.REPORT and incident.recovery_s is None
            and incident.resumed_step is not None):
        notes.append("no training step after it (yet)")
    lost = sum(x or 0.0 for x in (incident.detection_s, incident.recovery_s, redone_s)) \
        if incident.action is not Action.REPORT else 0.0
    return IncidentLoss(
        kind=incident.kind.value, node=incident.node, rank=incident.rank, attempt=incident.attempt,
        action=incident.action.value, at_s=at, detection_s=incident.detection_s,
        recovery_s=incident.recovery_s,
        step_at_detection=step, resumed_step=incident.resumed_step, redone_steps=redone, redone_s=redone_s,
        lost_s=lost, note="; ".join(notes), log_path=incident.log_path, log_tail=incident.log_tail,
    )


def report_from_histories(workflow_id: str, histories: Sequence[RunHistory], *, now: float | None = None,
                          status: RunStatus | None = None, missing_earlier: bool = False) -> RunReport:
    """The report of a chain of runs (oldest first). `status`: the `status` query's answer, used for the
    incidents of a run that has not completed; `missing_earlier`: older runs exist but could not be read."""
    if not histories:
        raise ValueError("no history")
    latest = histories[-1]
    spans = [span for history in histories for span in history.spans]
    start = histories[0].start
    history_start = None
    notes: list[str] = []
    first_phase = "reserving"
    first_input = histories[0].input
    carried = first_input.get("carried") if isinstance(first_input, dict) else None
    if missing_earlier or (carried and histories[0].continued_from):
        started_at = carried.get("started_at") if isinstance(carried, dict) else None
        first_phase = "running"
        if isinstance(started_at, (int, float)) and 0 < started_at < start:
            history_start, start = start, float(started_at)
        notes.append("earlier runs of this chain could not be read: their phases are not broken down")
    if any(h.encrypted for h in histories):
        notes.append("payloads are encrypted and no codec key is set here (TRAINGUARD_CODEC_KEY): attempts, "
                     "first steps and results are unknown, so phases and losses are incomplete")
    if len(histories) > 1:
        notes.append(f"continued as new {len(histories) - 1} time(s): {len(histories)} histories read")
    completed = latest.status == "COMPLETED" and latest.result
    result = RunResult.model_validate(latest.result) if completed else None
    incidents: list[Incident] | None = None
    if result is None:
        if status is not None:
            incidents = list(status.incidents)
        elif isinstance(carried, dict) and latest is histories[0]:
            # `RunState` (workflows/run_state.py): the status it carries holds the incidents.
            incidents = [Incident.model_validate(i) for i in (carried.get("status") or {}).get("incidents", [])]
        else:
            incidents = []
            notes.append("incidents unknown: the run has no result and its status query did not answer")
    if latest.failure:
        notes.append(f"run {latest.status.lower()}: {latest.failure}")
    end = latest.end if latest.end is not None else (now if now is not None else time.time())
    report = compute_report(spans, start=start, end=end, workflow_id=workflow_id, status=latest.status,
                            result=result, incidents=incidents, runs=len(histories), first_phase=first_phase,
                            history_start=history_start, notes=notes)
    report.hangs = [(i, inc) for i, inc in enumerate(incidents or (result.incidents if result else []), 1)
                    if inc.evidence_key]
    return report


async def build_report(client: Any, workflow_id: str) -> RunReport:
    """Read the run's whole history (every run of the chain) and compute its goodput breakdown."""
    histories, missing = await fetch_chain(client, workflow_id)
    status: RunStatus | None = None
    if histories[-1].status != "COMPLETED":
        try:
            status = await client.get_workflow_handle(workflow_id).query("status", result_type=RunStatus)
        except Exception:  # noqa: BLE001 - no worker to answer, or an old run: report without it
            status = None
    return report_from_histories(workflow_id, histories, status=status, missing_earlier=missing)
