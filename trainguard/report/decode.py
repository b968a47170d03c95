"""History -> spans: a run's Temporal history (and its node groups', across continue-as-new) reduced to
activity spans with their summaries, inputs and results. Reading only: nothing is computed here."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from trainguard.report.model import RunHistory, Span


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
    """The attempt an activity belongs to, from its input's `attempt`."""
    if isinstance(data, dict) and isinstance(data.get("attempt"), int):
        return data["attempt"]
    # Histories recorded before `FindCheckpointInput.attempt` existed: only its summary tells.
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
            closed = scheduled.get(attrs.scheduled_event_id)
            if closed is not None:
                closed.end, closed.outcome = at, outcome
                if outcome == "completed":
                    closed.result = _first(attrs.result)
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

    return EventType.Name(value)  # type: ignore[arg-type]  # protobuf's stubs: enum numbers as a NewType


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
            except Exception:  # noqa: BLE001 - an undecodable summary is counted, the rest still decodes
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
