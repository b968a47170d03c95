"""What a workflow history costs in Temporal's terms, read from its events in one pass.

Pure functions over `temporalio.api.history.v1.HistoryEvent`s (from a live server or a JSON history), so they
are unit-tested on hand-built histories: the most activities + child workflows pending at once (scheduled or
initiated and not yet closed: Temporal refuses a workflow task that would take an execution over 2,000), the
largest single payload anywhere in an event, continue-as-new, and the children and next runs it links to.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from google.protobuf.message import Message
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType, TimeoutType, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent

ACTIVITY_OPENED = {EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED}
ACTIVITY_CLOSED = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
    EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
    EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
    EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED,
}
CHILD_OPENED = {EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED}
CHILD_CLOSED = {
    EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_FAILED,
    EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED,
    EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_FAILED,
    EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_CANCELED,
    EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_TIMED_OUT,
    EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_TERMINATED,
}
_PAYLOAD = Payload.DESCRIPTOR.full_name


@dataclass(slots=True)
class HistoryFigures:
    """One execution's history, summed up."""

    workflow_id: str = ""
    run_id: str = ""
    events: int = 0
    max_pending: int = 0
    """Most activities + child workflows open at once."""
    max_pending_activities: int = 0
    max_pending_children: int = 0
    largest_payload_bytes: int = 0
    largest_payload_event: str = ""
    """`<event id> <event type>` of the largest payload."""
    continued_as_new: int = 0
    next_run_id: str | None = None
    """The run it continued as, if it did."""
    children: list[tuple[str, str]] = field(default_factory=list)
    """(workflow id, run id) of every child it started."""
    times: list[float] = field(default_factory=list)
    """Unix time of each event, in order (for counting events in a time window)."""
    activity_counts: dict[str, int] = field(default_factory=dict)
    """Activities scheduled, by type."""
    workflow_task_failures: dict[str, int] = field(default_factory=dict)
    """Workflow tasks that failed, by cause, or timed out (`TIMED_OUT`) (e.g. `WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND`: a task that
    would have taken the execution over a limit, refused whole)."""
    activity_troubles: dict[str, int] = field(default_factory=dict)
    """Activities that timed out or failed, as `<type>: <timeout type or failure>`."""
    open_activities: int = 0
    open_children: int = 0
    names: dict[int, str] = field(default_factory=dict)
    """Scheduled event id -> activity type, for naming the ones that time out or fail."""
    scheduled: dict[int, tuple[str, float]] = field(default_factory=dict)
    """Scheduled event id -> (task queue, Unix time), for the wait until a worker started it."""
    start_waits: dict[str, list[float]] = field(default_factory=dict)
    """Task queue -> seconds each activity waited between scheduled and started."""

    def add(self, event: HistoryEvent) -> None:
        """Take in the next event of the history."""
        self.events += 1
        self.times.append(event.event_time.ToMicroseconds() / 1e6)
        kind = event.event_type
        if kind in ACTIVITY_OPENED:
            self.open_activities += 1
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            self.activity_counts[name] = self.activity_counts.get(name, 0) + 1
            self.names[event.event_id] = name
            queue = event.activity_task_scheduled_event_attributes.task_queue.name
            self.scheduled[event.event_id] = (queue, self.times[-1])
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            queue, at = self.scheduled.get(event.activity_task_started_event_attributes.scheduled_event_id,
                                           ("?", self.times[-1]))
            self.start_waits.setdefault(queue, []).append(self.times[-1] - at)
        elif kind in ACTIVITY_CLOSED:
            self.open_activities -= 1
            self._note_trouble(event)
        elif kind in CHILD_OPENED:
            self.open_children += 1
        elif kind in CHILD_CLOSED:
            self.open_children -= 1
        elif kind == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED:
            started = event.child_workflow_execution_started_event_attributes.workflow_execution
            self.children.append((started.workflow_id, started.run_id))
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
            self.continued_as_new += 1
            self.next_run_id = event.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
        elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
            cause = WorkflowTaskFailedCause.Name(event.workflow_task_failed_event_attributes.cause)
            self.workflow_task_failures[cause] = self.workflow_task_failures.get(cause, 0) + 1
        elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
            self.workflow_task_failures["TIMED_OUT"] = self.workflow_task_failures.get("TIMED_OUT", 0) + 1
        self.max_pending_activities = max(self.max_pending_activities, self.open_activities)
        self.max_pending_children = max(self.max_pending_children, self.open_children)
        self.max_pending = max(self.max_pending, self.open_activities + self.open_children)
        size = largest_payload(event)
        if size > self.largest_payload_bytes:
            self.largest_payload_bytes = size
            self.largest_payload_event = f"{event.event_id} {EventType.Name(kind)}"

    def _note_trouble(self, event: HistoryEvent) -> None:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            attributes = event.activity_task_timed_out_event_attributes
            what = TimeoutType.Name(attributes.failure.timeout_failure_info.timeout_type)
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
            attributes = event.activity_task_failed_event_attributes
            what = attributes.failure.application_failure_info.type or "failed"
        else:
            return
        key = f"{self.names.get(attributes.scheduled_event_id, '?')}: {what}"
        self.activity_troubles[key] = self.activity_troubles.get(key, 0) + 1

    def events_between(self, start: float, end: float) -> int:
        """Events with start < time <= end."""
        return bisect.bisect_right(self.times, end) - bisect.bisect_right(self.times, start)


def largest_payload(message: Message) -> int:
    """Size in bytes (data + metadata, as serialized) of the largest `Payload` anywhere inside `message`."""
    largest = 0
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None:
            continue
        if descriptor.message_type.GetOptions().map_entry:
            value_field = descriptor.message_type.fields_by_name["value"]
            items = list(value.values()) if value_field.message_type is not None else []
        elif descriptor.is_repeated:
            items = list(value)
        else:
            items = [value]
        for item in items:
            if item.DESCRIPTOR.full_name == _PAYLOAD:
                largest = max(largest, item.ByteSize())
            else:
                largest = max(largest, largest_payload(item))
    return largest


def walk(events: Iterable[HistoryEvent], workflow_id: str = "", run_id: str = "") -> HistoryFigures:
    """Sum up one execution's history in a single pass."""
    figures = HistoryFigures(workflow_id=workflow_id, run_id=run_id)
    for event in events:
        figures.add(event)
    return figures


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (q in 0..1) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def marginal_per_checkpoint(commits: list[tuple[float, int]], histories: list[HistoryFigures]) -> float | None:
    """Events per checkpoint in steady state: the events of `histories` between consecutive commits of the same
    attempt ((Unix time, attempt) each, any order), summed, over the number of such intervals. Intervals that
    span an incident (the attempt changes) are left out, so start-up and recovery are not charged to
    checkpoints. None without two commits in one attempt."""
    ordered = sorted(commits)
    total = intervals = 0
    for (start, attempt), (end, next_attempt) in zip(ordered, ordered[1:]):
        if attempt != next_attempt:
            continue
        intervals += 1
        total += sum(h.events_between(start, end) for h in histories)
    return round(total / intervals, 1) if intervals else None
