"""Where a run's wall time went: a goodput breakdown read from the run's Temporal history.

```
trainguard run report my-run [--png my-run.png]
```

Everything comes from the history (every run of the chain when the workflow continued as new) and the
run's result (or its `status` query while it still runs); nothing is measured twice:

- phases, from activity timestamps: `reserving` (start to the first restore), `restoring`
  (`find_checkpoint`, `download_shards`), `launching` (`launch_ranks`, or `rejoin_ranks` for an in-process
  restart, to the attempt's first training step, which the watch events carry: imports, rendezvous, loading
  the shards or taking a live peer's state), `running` (first step to an
  incident's detection or to the end of training), `recovering` (detection, `stop_ranks`, the policy's
  decision, up to the next restore), `paused` (waiting for an operator), `finishing` (the last step to the
  workflow's close: final commit, retention, releasing the nodes). They tile the wall time.
- time lost per incident: `detection_s + recovery_s + redone steps x mean step time`, where the redone steps
  are the steps trained between the checkpoint the next attempt resumed from and the detection.
- goodput: steps completed x mean step time over the wall time (as `RunResult.goodput`).

The pure part (`spans_from_events`, `compute_report`) takes history events or simplified spans and is
unit-tested with fabricated histories; `build_report` fetches a real one.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.models import Action, Incident, RunResult, RunStatus

PHASES = ("earlier runs", "reserving", "restoring", "launching", "running", "recovering", "paused",
          "finishing")
"""Report order. `earlier runs` only appears when older runs of a continued chain could not be read."""

PHASE_COLORS = {
    "earlier runs": "#bbbbbb", "reserving": "#9ecae1", "restoring": "#6baed6", "launching": "#fdae6b",
    "running": "#74c476", "recovering": "#fb6a4a", "paused": "#bcbddc", "finishing": "#969696",
}

MATPLOTLIB_HINT = "drawing PNGs needs matplotlib: pip install matplotlib (or pip install 'trainguard[bench]')"

_ATTEMPT = re.compile(r"\(attempt (\d+)")
_CLOSED = {
    "EVENT_TYPE_ACTIVITY_TASK_COMPLETED": ("completed", "activity_task_completed_event_attributes"),
    "EVENT_TYPE_ACTIVITY_TASK_FAILED": ("failed", "activity_task_failed_event_attributes"),
    "EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT": ("timed_out", "activity_task_timed_out_event_attributes"),
    "EVENT_TYPE_ACTIVITY_TASK_CANCELED": ("canceled", "activity_task_canceled_event_attributes"),
}
_RUN_CLOSED = {
    "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED": "COMPLETED",
    "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED": "FAILED",
    "EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED": "CANCELED",
    "EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED": "TERMINATED",
    "EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT": "TIMED_OUT",
    "EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW": "CONTINUED_AS_NEW",
}


# ------------------------------------------------------------------------------------------ model


@dataclass
class Span:
    """One activity of the run: scheduled at `start`, closed at `end` (None while open or abandoned)."""

    name: str
    start: float
    end: float | None = None
    summary: str = ""
    attempt: int | None = None
    """The launch attempt it belongs to (from its input, else its summary), when it has one."""
    outcome: str = "completed"
    """completed, failed, timed_out, canceled, or open."""
    input: dict[str, Any] | None = None
    result: Any = None
    """The decoded JSON result (a dict for `watch_ranks`: kind, step, first_step_at, detected_at, ...)."""


@dataclass
class RunHistory:
    """One run (one history) of a workflow id, reduced to what the report needs."""

    start: float
    end: float | None = None
    """Close time; None while running."""
    status: str = "RUNNING"
    spans: list[Span] = field(default_factory=list)
    run_id: str = ""
    continued_from: str = ""
    """Run id this one continued from (continue-as-new), empty for the first run."""
    input: Any = None
    result: Any = None
    """Decoded result of a completed run (a RunResult as JSON)."""
    failure: str = ""
    encrypted: bool = False
    """Payloads are encrypted and were not decoded (no codec key here): summaries and results are missing."""
    children: list[str] = field(default_factory=list)
    """Workflow ids of the child workflows it started (node groups): their activities are the run's too."""


@dataclass
class Segment:
    phase: str
    start: float
    """Seconds after the run's start."""
    end: float
    attempt: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class IncidentLoss:
    kind: str
    node: str | None
    rank: int | None
    attempt: int
    action: str
    at_s: float | None
    """Detection, seconds after the run's start."""
    detection_s: float | None
    recovery_s: float | None
    step_at_detection: int | None
    resumed_step: int | None
    redone_steps: int | None
    redone_s: float | None
    lost_s: float
    """detection + recovery + redone work (unknown parts count as 0; see `note`)."""
    note: str = ""
    log_path: str | None = None
    """A rank incident's log on its node."""
    log_tail: str = ""
    """The last lines of that log when the incident was seen (its traceback)."""


@dataclass
class StepPoint:
    at_s: float
    """Seconds after the run's start."""
    step: int
    attempt: int


@dataclass
class RunReport:
    workflow_id: str
    status: str
    """COMPLETED, RUNNING, FAILED, ... of the newest run of the chain."""
    runs: int
    """Histories read (more than one when the run continued as new)."""
    started_at: float
    """Unix time the run started (the first history's start event)."""
    wall_s: float
    phases: dict[str, float]
    segments: list[Segment]
    incidents: list[IncidentLoss]
    steps_completed: int | None
    mean_step_s: float | None
    useful_s: float | None
    """steps completed x mean step time."""
    goodput: float | None
    lost_s: float
    """Total time lost to incidents."""
    attempts: int
    points: list[StepPoint] = field(default_factory=list)
    """Step against time, from the watch events (first step of each attempt, checkpoints, the end)."""
    result_wall_s: float | None = None
    """The run's own wall time (RunResult.wall_s, workflow clock), when it completed."""
    notes: list[str] = field(default_factory=list)
    hangs: list[tuple[int, Incident]] = field(default_factory=list)
    """Hang incidents (numbered as in the table) whose evidence is stored with the run."""

    @property
    def overhead_s(self) -> float | None:
        """Wall time that is neither useful training nor lost to incidents: the first start, checkpoints,
        finishing, step-time jitter."""
        if self.useful_s is None:
            return None
        return self.wall_s - self.useful_s - self.lost_s


# ------------------------------------------------------------------------------ history -> spans


def _decode(payload: Any) -> Any:
    """A json/plain payload's value (None for binary/null, empty or undecodable payloads)."""
    if payload is None or not payload.data:
        return None
    encoding = payload.metadata.get("encoding", b"")
    if encoding not in (b"json/plain", b""):
        return None
    try:
        return json.loads(payload.data)
    except ValueError:
        return None


def _first(payloads: Any) -> Any:
    items = list(payloads.payloads) if payloads is not None else []
    return _decode(items[0]) if items else None


def _attempt_of(summary: str, data: Any) -> int | None:
    if isinstance(data, dict) and isinstance(data.get("attempt"), int):
        return data["attempt"]
    match = _ATTEMPT.search(summary)
    return int(match.group(1)) if match else None


def spans_from_events(events: Iterable[Any]) -> RunHistory:
    """Reduce one history's events (protobuf `HistoryEvent`s, e.g. `WorkflowHistory.events`) to spans."""
    history: RunHistory | None = None
    scheduled: dict[int, Span] = {}
    for event in events:
        kind = _event_type_name(event.event_type)
        at = event.event_time.ToDatetime().timestamp() if event.HasField("event_time") else 0.0
        if kind == "EVENT_TYPE_WORKFLOW_EXECUTION_STARTED":
            attrs = event.workflow_execution_started_event_attributes
            history = RunHistory(start=at, continued_from=attrs.continued_execution_run_id,
                                 input=_first(attrs.input))
            continue
        if history is None:
            history = RunHistory(start=at)
        if kind == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED":
            attrs = event.activity_task_scheduled_event_attributes
            summary = ""
            if event.HasField("user_metadata") and event.user_metadata.HasField("summary"):
                decoded = _decode(event.user_metadata.summary)
                summary = decoded if isinstance(decoded, str) else ""
            data = _first(attrs.input)
            if any(p.metadata.get("encoding") == b"binary/encrypted" for p in attrs.input.payloads):
                history.encrypted = True
            span = Span(name=attrs.activity_type.name, start=at, summary=summary,
                        attempt=_attempt_of(summary, data), outcome="open",
                        input=data if isinstance(data, dict) else None)
            scheduled[event.event_id] = span
            history.spans.append(span)
        elif kind in _CLOSED:
            outcome, field_name = _CLOSED[kind]
            attrs = getattr(event, field_name)
            span = scheduled.get(attrs.scheduled_event_id)
            if span is not None:
                span.end, span.outcome = at, outcome
                if outcome == "completed":
                    span.result = _first(attrs.result)
        elif kind == "EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED":
            history.children.append(event.child_workflow_execution_started_event_attributes.workflow_execution.workflow_id)
        elif kind in _RUN_CLOSED:
            history.end, history.status = at, _RUN_CLOSED[kind]
            if kind == "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED":
                history.result = _first(event.workflow_execution_completed_event_attributes.result)
            elif kind == "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED":
                history.failure = event.workflow_execution_failed_event_attributes.failure.message
    if history is None:
        raise ValueError("empty history")
    return history



def _event_type_name(value: int) -> str:
    from temporalio.api.enums.v1 import EventType

    return EventType.Name(value)


# ----------------------------------------------------------------------------- the computation


def _watch_events(spans: Sequence[Span]) -> list[tuple[Span, dict[str, Any]]]:
    return [(s, s.result) for s in spans if s.name == "watch_ranks" and isinstance(s.result, dict)]


def _stop_kind(summary: str) -> str:
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
            kind = _stop_kind(span.summary)
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
    useful = steps * mean_step if steps is not None and mean_step else None
    goodput = min(1.0, useful / wall) if useful is not None and wall > 0 else None
    attempts = max([0, *(s.attempt or 0 for s in spans), *first_step])
    return RunReport(
        workflow_id=workflow_id, status=status, runs=runs, started_at=start, wall_s=wall, phases=phases,
        segments=segments, incidents=losses, steps_completed=steps, mean_step_s=mean_step, useful_s=useful,
        goodput=goodput, lost_s=lost, attempts=attempts,
        points=sorted(points, key=lambda p: p.at_s), result_wall_s=result.wall_s if result else None,
        notes=notes,
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
            incidents = [Incident.model_validate(i) for i in carried.get("incidents", [])]
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


def render_stacks(hangs: Sequence[tuple[int, Incident]], read: Any) -> str:
    """Each hang's evidence and every rank's full stacks, stored with the run. `read(url)` lists and reads
    the texts under an `s3://bucket/prefix/` URL: (key, text) pairs."""
    lines: list[str] = []
    for index, incident in hangs:
        lines += ["", f"incident {index}: hang, culprit rank {incident.rank} on {incident.node} "
                      f"(stacks: {incident.evidence_key})"]
        lines += [f"  {part}" for part in incident.evidence.splitlines()]
        try:
            texts = read(incident.evidence_key)
        except Exception as error:  # noqa: BLE001 - the store's any failure: say so, the table stands
            lines.append(f"  stacks not readable: {error}")
            continue
        for key, text in texts:
            lines += ["", f"--- {key}", text.rstrip()]
    return "\n".join(lines)


def read_store_texts(url: str, client: Any = None) -> list[tuple[str, str]]:
    """Every object under an `s3://bucket/prefix/` URL, as text (the store's client from the environment)."""
    from trainguard.settings import s3_client

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = client or s3_client()
    keys = sorted(o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                  for o in page.get("Contents", []))
    return [(key, client.get_object(Bucket=bucket, Key=key)["Body"].read().decode(errors="replace")) for key in keys]


# ------------------------------------------------------------------------------------- fetching


async def decode_events(events: Iterable[Any], codec: Any) -> int:
    """Run the payloads the report reads (inputs, results, summaries) through a payload codec, in place
    (payloads encrypted by `trainguard.codec`). Returns how many payloads stayed undecodable."""
    failed = 0

    async def payloads(container: Any) -> None:
        nonlocal failed
        items = list(container.payloads)
        if not items:
            return
        try:
            decoded = await codec.decode(items)
        except Exception:  # noqa: BLE001 - another key, altered bytes: report what can be read
            failed += len(items)
            return
        del container.payloads[:]
        container.payloads.extend(decoded)

    for event in events:
        kind = _event_type_name(event.event_type)
        if event.HasField("user_metadata") and event.user_metadata.HasField("summary"):
            try:
                [summary] = await codec.decode([event.user_metadata.summary])
                event.user_metadata.summary.CopyFrom(summary)
            except Exception:  # noqa: BLE001
                failed += 1
        if kind == "EVENT_TYPE_WORKFLOW_EXECUTION_STARTED":
            await payloads(event.workflow_execution_started_event_attributes.input)
        elif kind == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED":
            await payloads(event.activity_task_scheduled_event_attributes.input)
        elif kind == "EVENT_TYPE_ACTIVITY_TASK_COMPLETED":
            await payloads(event.activity_task_completed_event_attributes.result)
        elif kind == "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED":
            await payloads(event.workflow_execution_completed_event_attributes.result)
    return failed


async def fetch_chain(client: Any, workflow_id: str, max_runs: int = 1000) -> tuple[list[RunHistory], bool]:
    """Every run of the workflow id's continue-as-new chain, oldest first, and whether older runs exist
    that could not be read (retention)."""
    from temporalio.service import RPCError

    histories: list[RunHistory] = []
    run_id: str | None = None
    missing = False
    codec = getattr(getattr(client, "data_converter", None), "payload_codec", None)
    while len(histories) < max_runs:
        handle = client.get_workflow_handle(workflow_id, run_id=run_id)
        try:
            history = await handle.fetch_history()
        except RPCError:
            if not histories:
                raise
            missing = True
            break
        if codec is not None:
            await decode_events(history.events, codec)
        run = spans_from_events(history.events)
        run.run_id = run_id or ""
        for child in run.children:
            # A node group's calls and watches, across its own continue-as-new chain.
            for child_run in (await fetch_chain(client, child, max_runs))[0]:
                run.spans.extend(child_run.spans)
        histories.append(run)
        if not run.continued_from:
            break
        run_id = run.continued_from
    else:
        missing = True
    return list(reversed(histories)), missing


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


# -------------------------------------------------------------------------------------- output


def _f(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


LOG_LINES_SHOWN = 8
"""Lines of a rank incident's log tail the table shows: a traceback's last frames and its exception."""


def render_table(report: RunReport) -> str:
    wall = report.wall_s or 1e-9
    lines = [
        f"run {report.workflow_id}: {report.status.lower()}, {report.attempts} attempt(s), "
        f"{len(report.incidents)} incident(s), wall {report.wall_s:.2f} s"
        + (f" (workflow clock {report.result_wall_s:.2f} s)" if report.result_wall_s else ""),
        "",
        f"{'phase':<13} {'seconds':>9} {'share':>7}",
    ]
    for phase, seconds in report.phases.items():
        lines.append(f"{phase:<13} {seconds:>9.2f} {100 * seconds / wall:>6.1f}%")
    lines.append(f"{'total':<13} {sum(report.phases.values()):>9.2f} "
                 f"{100 * sum(report.phases.values()) / wall:>6.1f}%")
    by_attempt: dict[int, dict[str, float]] = {}
    for segment in report.segments:
        if segment.phase in ("restoring", "launching", "running") and segment.attempt:
            spent = by_attempt.setdefault(segment.attempt, {})
            spent[segment.phase] = spent.get(segment.phase, 0.0) + segment.seconds
    if len(by_attempt) > 1:
        lines.append("")
        for attempt, spent in sorted(by_attempt.items()):
            lines.append(f"attempt {attempt}: " + ", ".join(f"{p} {s:.2f} s" for p, s in spent.items()))
    lines += ["", "goodput"]
    steps = "-" if report.steps_completed is None else str(report.steps_completed)
    lines.append(f"  useful training   {_f(report.useful_s):>9} s  ({steps} steps x "
                 f"{_f(report.mean_step_s, '{:.4f}')} s)")
    lines.append(f"  lost to incidents {report.lost_s:>9.2f} s")
    lines.append(f"  other overhead    {_f(report.overhead_s):>9} s  (first start, checkpoints, finishing)")
    percent = None if report.goodput is None else 100 * report.goodput
    lines.append(f"  goodput           {_f(percent, '{:.1f}'):>9} %")
    if report.incidents:
        lines += ["", f"{'#':>2} {'kind':<18} {'node':<8} {'rank':>4} {'att':>3} {'action':<12} {'at_s':>7} "
                      f"{'detect_s':>8} {'recover_s':>9} {'steps':>11} {'redone_s':>8} {'lost_s':>7}  note"]
        for index, loss in enumerate(report.incidents, 1):
            steps_text = "-" if loss.step_at_detection is None else (
                f"{loss.resumed_step}..{loss.step_at_detection}" if loss.resumed_step is not None
                else str(loss.step_at_detection))
            lines.append(
                f"{index:>2} {loss.kind:<18} {loss.node or '-':<8} {_f(loss.rank, '{}'):>4} "
                f"{loss.attempt:>3} "
                f"{loss.action:<12} {_f(loss.at_s, '{:.1f}'):>7} {_f(loss.detection_s):>8} "
                f"{_f(loss.recovery_s):>9} {steps_text:>11} {_f(loss.redone_s):>8} {loss.lost_s:>7.2f}  "
                f"{loss.note}")
    for index, loss in enumerate(report.incidents, 1):
        if loss.log_path or loss.log_tail:
            lines += ["", f"#{index} {loss.kind} rank {_f(loss.rank, '{}')} on {loss.node or '-'}: "
                          f"log {loss.log_path or '-'}"]
            lines += [f"   | {line}" for line in loss.log_tail.splitlines()[-LOG_LINES_SHOWN:]]
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot on the headless Agg backend, or an error saying how to install it."""
    try:
        import matplotlib
    except ImportError as error:
        raise RuntimeError(MATPLOTLIB_HINT) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render_png(report: RunReport, path: str | Path) -> None:
    """Two panels: step against wall time over the phases (incidents marked), and the time lost per
    incident split into detection, recovery and redone work. Needs matplotlib."""
    plt = pyplot()
    from matplotlib.patches import Patch

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [3, 2]})
    for segment in report.segments:
        top.axvspan(segment.start, segment.end, color=PHASE_COLORS.get(segment.phase, "#dddddd"), alpha=0.45,
                    lw=0)
    by_attempt: dict[int, list[StepPoint]] = {}
    for point in report.points:
        by_attempt.setdefault(point.attempt, []).append(point)
    for attempt, points in sorted(by_attempt.items()):
        top.plot([p.at_s for p in points], [p.step for p in points], marker="o", ms=3, lw=1.8,
                 label=f"attempt {attempt}")
    top_step = max((p.step for p in report.points), default=1)
    for index, loss in enumerate(report.incidents, 1):
        if loss.at_s is None:
            continue
        top.axvline(loss.at_s, color="#a50f15", ls="--", lw=1)
        top.annotate(f"#{index} {loss.kind}", (loss.at_s, top_step), xytext=(3, -12),
                     textcoords="offset points", color="#a50f15", fontsize=8)
        if loss.detection_s:
            top.axvline(loss.at_s - loss.detection_s, color="#a50f15", ls=":", lw=1)
    top.set_xlim(0, max(report.wall_s, 1e-3))
    top.set_ylim(bottom=0)
    top.set_xlabel("seconds since the run started")
    top.set_ylabel("training step")
    goodput = "-" if report.goodput is None else f"{100 * report.goodput:.1f}%"
    top.set_title(f"{report.workflow_id}: {report.status.lower()}, wall {report.wall_s:.1f} s, "
                  f"goodput {goodput}")
    phase_handles = [Patch(color=PHASE_COLORS[p], alpha=0.45, label=f"{p} {s:.1f}s")
                     for p, s in report.phases.items() if s > 0]
    line_handles, _ = top.get_legend_handles_labels()
    top.legend(handles=[*line_handles, *phase_handles], fontsize=8, loc="upper left", ncol=2)

    if report.incidents:
        labels = [f"#{i} {loss.kind}\n{loss.node or ''}" for i, loss in enumerate(report.incidents, 1)]
        parts = [("detection", "#fdae6b", [loss.detection_s or 0.0 for loss in report.incidents]),
                 ("recovery (to first new step)", "#fb6a4a",
                  [loss.recovery_s or 0.0 for loss in report.incidents]),
                 ("redone steps", "#9e9ac8", [loss.redone_s or 0.0 for loss in report.incidents])]
        left = [0.0] * len(labels)
        for name, color, values in parts:
            bottom.barh(labels, values, left=left, color=color, label=name, height=0.6)
            left = [a + b for a, b in zip(left, values)]
        for y, loss in enumerate(report.incidents):
            bottom.annotate(f"{loss.lost_s:.2f} s", (left[y], y), xytext=(4, 0), textcoords="offset points",
                            va="center", fontsize=8)
        pad = max(0, 2 - len(labels)) * 0.5  # a lone bar stays bar-sized
        bottom.set_ylim(len(labels) - 0.4 + pad, -0.6 - pad)
        bottom.set_xlim(0, max(left) * 1.12 or 1.0)
        bottom.set_xlabel("seconds lost")
        bottom.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
        bottom.set_title(f"time lost per incident (total {report.lost_s:.2f} s)", pad=24)
    else:
        names = [p for p, s in report.phases.items() if s > 0]
        bottom.barh(names, [report.phases[p] for p in names], color=[PHASE_COLORS[p] for p in names])
        bottom.invert_yaxis()
        bottom.set_xlabel("seconds")
        bottom.set_title("time per phase (no incidents)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main_report(workflow_id: str, png: str | None) -> int:
    """`trainguard run report ID [--png FILE]`: print the breakdown, optionally draw it."""
    from temporalio.service import RPCError

    from trainguard.connect import connect

    try:
        client = await connect()
    except RuntimeError as error:  # the SDK's "Failed client connect: ..."
        print(f"report: {error}", file=sys.stderr)
        return 1
    try:
        report = await build_report(client, workflow_id)
    except RPCError as error:  # no such workflow, or no permission to read it
        print(f"report: {workflow_id}: {error.message}", file=sys.stderr)
        return 1
    print(render_table(report))
    if report.hangs:
        print(render_stacks(report.hangs, read_store_texts))
    if png:
        try:
            render_png(report, png)
        except RuntimeError as error:
            print(f"report: {error}", file=sys.stderr)
            return 1
        print(f"wrote {png}")
    return 0
