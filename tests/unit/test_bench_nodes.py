"""The node-scale benchmark's pure parts: history walking, p95, marginal events per checkpoint, the stand-ins'
simulated steps and queue routing."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.api.common.v1 import Header, Payload, Payloads, WorkflowExecution
from temporalio.api.enums.v1 import EventType, TimeoutType, WorkflowTaskFailedCause
from temporalio.api.history.v1 import (
    ActivityTaskCompletedEventAttributes,
    ActivityTaskScheduledEventAttributes,
    ActivityTaskTimedOutEventAttributes,
    ChildWorkflowExecutionStartedEventAttributes,
    HistoryEvent,
    WorkflowExecutionContinuedAsNewEventAttributes,
    WorkflowTaskFailedEventAttributes,
)
from temporalio.client import WorkflowHistory

from infra.bench.history import HistoryFigures, largest_payload, marginal_per_checkpoint, percentile, walk
from infra.bench.nodes import Plan
from infra.bench.nodes_report import target_events_per_checkpoint
from infra.bench.standins import Attempt, parse_entrypoint, shared_queue, shared_queues

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
E = EventType


def _event(event_id: int, kind: int, at: float = 0.0, **attributes: object) -> HistoryEvent:
    event = HistoryEvent(event_id=event_id, event_type=kind, **attributes)  # type: ignore[arg-type]
    event.event_time.FromMicroseconds(int(at * 1e6))
    return event


def _scheduled(event_id: int, name: str = "watch_ranks", payload: bytes = b"", at: float = 0.0) -> HistoryEvent:
    attributes = ActivityTaskScheduledEventAttributes(activity_id=str(event_id))
    attributes.activity_type.name = name
    if payload:
        attributes.input.CopyFrom(Payloads(payloads=[Payload(data=payload)]))
    return _event(event_id, E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED, at,
                  activity_task_scheduled_event_attributes=attributes)


def _completed(event_id: int, scheduled: int, payload: bytes = b"", at: float = 0.0) -> HistoryEvent:
    attributes = ActivityTaskCompletedEventAttributes(scheduled_event_id=scheduled)
    if payload:
        attributes.result.CopyFrom(Payloads(payloads=[Payload(data=payload)]))
    return _event(event_id, E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED, at,
                  activity_task_completed_event_attributes=attributes)


def test_pending_is_the_most_scheduled_and_not_yet_closed_at_once() -> None:
    events = [_scheduled(1), _scheduled(2), _scheduled(3), _completed(4, 1),
              _event(5, E.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED),  # still pending until it closes
              _scheduled(6), _scheduled(7),
              _event(8, E.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED),
              _event(9, E.EVENT_TYPE_ACTIVITY_TASK_CANCELED), _event(10, E.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT),
              _event(11, E.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED), _event(12, E.EVENT_TYPE_ACTIVITY_TASK_FAILED)]

    figures = walk(events)

    assert figures.events == 12
    assert figures.max_pending == 5  # after event 8: four activities and a child
    assert (figures.max_pending_activities, figures.max_pending_children) == (4, 1)
    assert (figures.open_activities, figures.open_children) == (1, 0)
    assert figures.activity_counts == {"watch_ranks": 5}


def test_largest_payload_is_found_wherever_it_sits_in_an_event() -> None:
    header = Header()
    header.fields["big"].CopyFrom(Payload(data=b"h" * 5000))  # a map of payloads
    scheduled = _scheduled(1, payload=b"x" * 300)
    scheduled.activity_task_scheduled_event_attributes.header.CopyFrom(header)
    events = [scheduled, _completed(2, 1, payload=b"y" * 1000)]

    figures = walk(events)

    assert figures.largest_payload_bytes == Payload(data=b"h" * 5000).ByteSize()
    assert figures.largest_payload_event == "1 EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"
    assert largest_payload(events[1]) == Payload(data=b"y" * 1000).ByteSize()
    assert largest_payload(_event(3, E.EVENT_TYPE_TIMER_FIRED)) == 0


def test_children_continue_as_new_and_refused_tasks_are_recorded() -> None:
    child = ChildWorkflowExecutionStartedEventAttributes(
        workflow_execution=WorkflowExecution(workflow_id="run-1-group-0", run_id="r-child"))
    failed = WorkflowTaskFailedEventAttributes(
        cause=WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND)
    events = [_event(1, E.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED,
                     child_workflow_execution_started_event_attributes=child),
              _event(2, E.EVENT_TYPE_WORKFLOW_TASK_FAILED, workflow_task_failed_event_attributes=failed),
              _event(3, E.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
                     workflow_execution_continued_as_new_event_attributes=WorkflowExecutionContinuedAsNewEventAttributes(
                         new_execution_run_id="r-next"))]

    figures = walk(events, "run-1", "r-first")

    assert figures.children == [("run-1-group-0", "r-child")]
    assert (figures.continued_as_new, figures.next_run_id) == (1, "r-next")
    assert figures.workflow_task_failures == {"WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND": 1}


def test_recorded_history_pending_matches_a_count_by_scheduled_event_id() -> None:
    history = WorkflowHistory.from_json("it-can", (HISTORIES / "it-can.json").read_text())
    open_ids: set[int] = set()
    most = 0
    closed = ("activity_task_completed_event_attributes", "activity_task_failed_event_attributes",
              "activity_task_timed_out_event_attributes", "activity_task_canceled_event_attributes")
    for event in history.events:
        if event.HasField("activity_task_scheduled_event_attributes"):
            open_ids.add(event.event_id)
        for name in closed:
            if event.HasField(name):
                open_ids.discard(getattr(event, name).scheduled_event_id)
        most = max(most, len(open_ids))

    figures = walk(history.events)

    assert figures.events == len(history.events)
    assert figures.max_pending == most > 0
    carried = history.events[0].workflow_execution_started_event_attributes.input.payloads[0]
    assert figures.largest_payload_bytes >= carried.ByteSize() > 1000  # the state carried across continue-as-new


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.95) is None
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([float(v) for v in range(1, 101)], 0.95) == 95.0
    assert percentile([5.0, 1.0, 2.0], 0.5) == 2.0


def test_marginal_events_per_checkpoint_leaves_out_intervals_across_incidents() -> None:
    history = HistoryFigures(times=[float(t) for t in range(100)])  # one event a second
    other = HistoryFigures(times=[15.5, 16.5])
    commits = [(10.0, 1), (20.0, 1), (30.0, 2), (50.0, 2), (90.0, 3)]

    # Intervals 10-20 and 30-50 (attempt 1, attempt 2): 10 + 20 events of `history`, 2 of `other`.
    assert marginal_per_checkpoint(commits, [history, other]) == 16.0
    assert marginal_per_checkpoint(commits, [history]) == 15.0
    assert marginal_per_checkpoint([(10.0, 1), (20.0, 2)], [history]) is None
    assert history.events_between(10.0, 20.0) == 10


def test_simulated_attempt_steps_after_the_rendezvous_and_saves_every_k_steps() -> None:
    attempt = Attempt(num_nodes=2, start_step=60, final_step=210, every=60, step_s=0.1)
    assert attempt.step(1000.0) == 60  # not every node has launched: no progress
    attempt.started_at = 100.0

    assert attempt.step(106.05) == 120
    assert attempt.saved(112.05, after=60) == [120, 180]
    assert attempt.saved(112.05, after=120) == [180]
    assert attempt.saved(130.0, after=-1) == [120, 180]  # never the final step, never the restored one
    assert attempt.step(130.0) == 210
    assert attempt.time_of(120) == pytest.approx(106.0)
    attempt.halted_at = 107.0  # a peer crashed: nobody steps past the next collective
    assert attempt.step(130.0) == 130


def test_routing_spreads_nodes_over_the_shared_queues_deterministically() -> None:
    nodes = [f"node-{i:04d}" for i in range(1024)]
    queues = {shared_queue(n, 16) for n in nodes}
    assert queues == set(shared_queues(16))
    assert shared_queue("node-0001", 16) == shared_queue("node-0001", 16)
    counts = [sum(shared_queue(n, 16) == q for n in nodes) for q in shared_queues(16)]
    assert max(counts) < 2 * 1024 / 16


def test_plan_puts_the_faults_between_checkpoints_and_finishes_past_the_last() -> None:
    plan = Plan.of(16, 8, checkpoints=6, every_steps=60, step_s=0.05)
    assert (plan.crash_after, plan.hang_after, plan.down_after) == (2, 3, 4)
    assert plan.final_step == 390 and plan.final_step % plan.every_steps
    faulty = {plan.crash_node, plan.hang_node, plan.down_node}
    assert len(faulty) == 3 and faulty <= set(plan.nodes)
    assert parse_entrypoint(plan.spec()["entrypoint"]) == (390, 0.05)
    assert len(plan.spec()["spare_nodes"]) == 2
    assert target_events_per_checkpoint(4096) == pytest.approx(459.6)


def test_activities_that_time_out_are_named_by_type_and_timeout() -> None:
    timed_out = ActivityTaskTimedOutEventAttributes(scheduled_event_id=1)
    timed_out.failure.timeout_failure_info.timeout_type = TimeoutType.TIMEOUT_TYPE_HEARTBEAT
    events = [_scheduled(1, "watch_ranks"), _scheduled(2, "check_node"),
              _event(3, E.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT, activity_task_timed_out_event_attributes=timed_out),
              _completed(4, 2), _event(5, E.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT)]

    figures = walk(events)

    assert figures.activity_troubles == {"watch_ranks: TIMEOUT_TYPE_HEARTBEAT": 1}
    assert figures.workflow_task_failures == {"TIMED_OUT": 1}
