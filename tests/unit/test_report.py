"""The goodput report, computed from fabricated histories: each phase lasts what its spans say, incidents cost
what their detection, recovery and redone steps cost, and a continued chain reads as one run. (That the report
reads the histories the real workflow writes is test_report_of_a_run.py's.)"""

from __future__ import annotations

import json
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from trainguard.models import Action, Incident, IncidentKind, RunResult, RunStatus, StopReason
from trainguard.report import (
    RunHistory,
    Span,
    compute_report,
    render_png,
    render_table,
    report_from_histories,
    spans_from_events,
)

T0 = 1_800_000_000.0


def _payload(value: Any) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(value).encode())


def _time(at: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(datetime.fromtimestamp(at, tz=UTC))
    return stamp


class FakeHistory:
    """Builds protobuf history events the way the server records a TrainingRun's."""

    def __init__(self, start: float, workflow_input: Any = None, continued_from: str = "") -> None:
        self.events: list[HistoryEvent] = []
        event = self._event(start, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
        attrs = event.workflow_execution_started_event_attributes
        attrs.workflow_type.name = "TrainingRun"
        attrs.continued_execution_run_id = continued_from
        if workflow_input is not None:
            attrs.input.CopyFrom(Payloads(payloads=[_payload(workflow_input)]))

    def _event(self, at: float, kind: int) -> HistoryEvent:
        event = HistoryEvent(event_id=len(self.events) + 1, event_type=kind, event_time=_time(at))
        self.events.append(event)
        return event

    def activity(self, name: str, start: float, end: float | None, summary: str = "", data: Any = None,
                 result: Any = None, outcome: str = "completed") -> None:
        event = self._event(start, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
        attrs = event.activity_task_scheduled_event_attributes
        attrs.activity_type.name = name
        attrs.activity_id = str(event.event_id)
        if data is not None:
            attrs.input.CopyFrom(Payloads(payloads=[_payload(data)]))
        if summary:
            event.user_metadata.summary.CopyFrom(_payload(summary))
        scheduled = event.event_id
        started = self._event(start, EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED)
        started.activity_task_started_event_attributes.scheduled_event_id = scheduled
        if end is None:
            return
        if outcome == "completed":
            done = self._event(end, EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED)
            done.activity_task_completed_event_attributes.scheduled_event_id = scheduled
            if result is not None:
                done.activity_task_completed_event_attributes.result.CopyFrom(
                    Payloads(payloads=[_payload(result)]))
        else:
            failed = self._event(end, EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED)
            failed.activity_task_failed_event_attributes.scheduled_event_id = scheduled
            failed.activity_task_failed_event_attributes.failure.message = "boom"

    def completed(self, at: float, result: RunResult) -> None:
        event = self._event(at, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED)
        event.workflow_execution_completed_event_attributes.result.CopyFrom(
            Payloads(payloads=[_payload(result.model_dump(mode="json"))]))

    def continued(self, at: float) -> None:
        self._event(at, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW)


def _watch(history: FakeHistory, node: str, attempt: int, start: float, end: float, **event: Any) -> None:
    result = {"node": node, "checkpoint_steps": [], "fault_at": None, "mean_step_s": None, **event}
    history.activity("watch_ranks", start, end, f"watch ranks on {node} (attempt {attempt})",
                     {"workflow_id": "r", "attempt": attempt, "node": node}, result)


CRASH = Incident(kind=IncidentKind.CRASH, node="node-1", rank=1, attempt=1, detection_s=0.1, recovery_s=6.0,
                 resumed_step=20, detected_at=T0 + 12.0, action=Action.RESTART, restore_tier="s3")


def crash_run() -> FakeHistory:
    """Two nodes, a crash of rank 1 at step 45 (detected at +12 s), resumed from step 20; 60 steps of
    0.1 s."""
    h = FakeHistory(T0, {"entrypoint": ["python", "train.py"], "nodes": ["node-0", "node-1"]})
    h.activity("find_node_agents", T0 + 0.1, T0 + 0.2, "find node agents", result={"missing": []})
    h.activity("acquire_nodes", T0 + 0.2, T0 + 0.3, "lease nodes from the pool", result={"granted": True})
    for node in ("node-0", "node-1"):
        h.activity("check_node", T0 + 0.3, T0 + 0.4, f"check {node}", {"workflow_id": "r", "node": node})
    h.activity("find_checkpoint", T0 + 0.5, T0 + 0.6, "find newest checkpoint (attempt 1)", result={})
    h.activity("launch_ranks", T0 + 0.6, T0 + 0.7, "launch ranks on node-0 (attempt 1, from step 0)",
               {"attempt": 1, "node": "node-0", "restore_step": 0})
    h.activity("launch_ranks", T0 + 0.7, T0 + 0.8, "launch ranks on node-1 (attempt 1, from step 0)",
               {"attempt": 1, "node": "node-1", "restore_step": 0})
    _watch(h, "node-0", 1, T0 + 0.8, T0 + 10.0, kind="checkpoint_ready", step=20, checkpoint_steps=[20],
           first_step_at=T0 + 5.0, detected_at=T0 + 10.0)
    _watch(h, "node-1", 1, T0 + 0.8, T0 + 12.0, kind="rank_exited", step=45, first_step_at=T0 + 5.0,
           detected_at=T0 + 12.0, fault_at=T0 + 11.9)
    for node in ("node-0", "node-1"):
        h.activity("stop_ranks", T0 + 12.1, T0 + 12.5, f"stop ranks on {node}: crash: restart",
                   {"workflow_id": "r", "node": node, "attempt": 1})
    h.activity("find_checkpoint", T0 + 12.5, T0 + 12.6, "find newest checkpoint (attempt 2)", result={})
    for node in ("node-0", "node-1"):
        h.activity("download_shards", T0 + 12.6, T0 + 13.0, f"download step 20 to {node} (attempt 2)",
                   {"attempt": 2, "node": node})
    h.activity("launch_ranks", T0 + 13.0, T0 + 13.2, "launch ranks on node-0 (attempt 2, from step 20)",
               {"attempt": 2, "node": "node-0", "restore_step": 20})
    _watch(h, "node-0", 2, T0 + 13.2, T0 + 20.0, kind="checkpoint_ready", step=40, checkpoint_steps=[40],
           first_step_at=T0 + 18.0, detected_at=T0 + 20.0)
    _watch(h, "node-0", 2, T0 + 20.0, T0 + 24.0, kind="finished", step=60, first_step_at=T0 + 18.0,
           detected_at=T0 + 24.0, mean_step_s=0.1)
    h.activity("release_nodes", T0 + 24.0, T0 + 24.5, "release nodes", result=["node-0", "node-1"])
    h.completed(T0 + 25.0, RunResult(workflow_id="r", steps_completed=60, attempts=2, incidents=[CRASH],
                                     goodput=0.24, wall_s=25.0, mean_step_s=0.1))
    return h


def test_events_become_spans_with_summaries_attempts_and_results() -> None:
    run = spans_from_events(crash_run().events)
    assert run.start == pytest.approx(T0) and run.end == pytest.approx(T0 + 25.0)
    assert run.status == "COMPLETED" and run.result["steps_completed"] == 60
    launches = [s for s in run.spans if s.name == "launch_ranks"]
    assert [s.attempt for s in launches] == [1, 1, 2]
    assert launches[2].summary == "launch ranks on node-0 (attempt 2, from step 20)"
    assert launches[2].input["restore_step"] == 20
    finds = [s for s in run.spans if s.name == "find_checkpoint"]
    assert [s.attempt for s in finds] == [1, 2], "the attempt comes from the summary when the input has none"
    watch = next(s for s in run.spans if s.name == "watch_ranks" and s.result["kind"] == "rank_exited")
    assert watch.end - watch.start == pytest.approx(11.2) and watch.result["step"] == 45


def test_each_phase_of_a_crashed_and_recovered_run_lasts_what_its_spans_say() -> None:
    report = report_from_histories("r", [spans_from_events(crash_run().events)])
    assert report.wall_s == pytest.approx(25.0)
    assert report.result_wall_s == 25.0
    expected = {"reserving": 0.5, "restoring": 0.1 + 0.5, "launching": 4.4 + 5.0, "running": 7.0 + 6.0,
                "recovering": 0.5, "paused": 0.0, "finishing": 1.0}
    assert report.phases == pytest.approx(expected, abs=1e-3)
    assert [s.phase for s in report.segments] == [
        "reserving", "restoring", "launching", "running", "recovering", "restoring", "launching", "running",
        "finishing"]
    assert [s.attempt for s in report.segments][-4:] == [2, 2, 2, 2]
    assert report.attempts == 2


def test_an_incident_costs_detection_recovery_and_redone_steps() -> None:
    report = report_from_histories("r", [spans_from_events(crash_run().events)])
    [loss] = report.incidents
    assert (loss.kind, loss.node, loss.rank, loss.attempt) == ("crash", "node-1", 1, 1)
    assert loss.step_at_detection == 45, "the step of the watch event that detected it"
    assert loss.redone_steps == 25 and loss.redone_s == pytest.approx(2.5)
    assert loss.lost_s == pytest.approx(0.1 + 6.0 + 2.5)
    assert loss.at_s == pytest.approx(12.0)
    assert report.lost_s == pytest.approx(8.6)
    assert report.useful_s == pytest.approx(6.0) and report.goodput == pytest.approx(6.0 / 25.0)
    assert report.overhead_s == pytest.approx(25.0 - 6.0 - 8.6)


def test_step_points_follow_each_attempt() -> None:
    report = report_from_histories("r", [spans_from_events(crash_run().events)])
    attempt2 = [(round(p.at_s, 3), p.step) for p in report.points if p.attempt == 2]
    assert attempt2 == [(18.0, 20), (20.0, 40), (24.0, 60)], "the resumed step first, then checkpoints"


def test_simplified_spans_are_enough() -> None:
    """The computation needs nothing but (name, start, end) spans and the incidents."""
    spans = [
        Span("find_checkpoint", T0 + 1, T0 + 1.5, attempt=1),
        Span("launch_ranks", T0 + 1.5, T0 + 1.6, attempt=1, input={"restore_step": 0}),
        Span("watch_ranks", T0 + 1.6, T0 + 9.0, attempt=1,
             result={"kind": "finished", "step": 30, "first_step_at": T0 + 3.0, "detected_at": T0 + 9.0}),
    ]
    report = compute_report(spans, start=T0, end=T0 + 10.0, incidents=[])
    assert report.phases["reserving"] == pytest.approx(1.0)
    assert report.phases["restoring"] == pytest.approx(0.5)
    assert report.phases["launching"] == pytest.approx(1.5)
    assert report.phases["running"] == pytest.approx(6.0)
    assert report.phases["finishing"] == pytest.approx(1.0)
    assert report.mean_step_s == pytest.approx(0.2), "no result: estimated from the step reports"
    assert report.steps_completed == 30 and report.incidents == []


def test_an_in_process_restart_is_recovery_then_launching_from_the_live_step() -> None:
    """No restore after an in-process restart: the rejoin to the first step is launching, and the new
    attempt's timeline goes on from the live ranks' step, not from a checkpoint."""
    crash = Incident(kind=IncidentKind.CRASH, node="n1", rank=1, attempt=1, detection_s=0.2, recovery_s=1.5,
                     resumed_step=27, detected_at=T0 + 5.0, recovery_path="in-process", restore_tier="peers")
    spans = [
        Span("find_checkpoint", T0 + 1, T0 + 1.5, attempt=1),
        Span("launch_ranks", T0 + 1.5, T0 + 1.6, attempt=1, input={"restore_step": 0}),
        Span("watch_ranks", T0 + 1.6, T0 + 5.0, attempt=1,
             result={"kind": "rank_exited", "step": 27, "first_step_at": T0 + 2.0, "detected_at": T0 + 5.0}),
        Span("rejoin_ranks", T0 + 5.1, T0 + 5.2, attempt=2, result={"step": 27, "survivors": [0]}),
        Span("watch_ranks", T0 + 5.2, T0 + 9.0, attempt=2,
             result={"kind": "finished", "step": 45, "first_step_at": T0 + 6.5, "detected_at": T0 + 9.0}),
    ]
    report = compute_report(spans, start=T0, end=T0 + 9.5, incidents=[crash])
    assert report.phases["restoring"] == pytest.approx(0.5), "attempt 1's restore only"
    assert report.phases["recovering"] == pytest.approx(0.1)
    assert report.phases["launching"] == pytest.approx(0.5 + 1.4)
    assert [(p.attempt, p.step) for p in report.points if p.at_s == pytest.approx(6.5)] == [(2, 27)]


def test_finishing_starts_at_the_last_step_not_at_the_ranks_exit() -> None:
    spans = [
        Span("launch_ranks", T0 + 0.5, T0 + 0.6, attempt=1, input={"restore_step": 0}),
        Span("watch_ranks", T0 + 0.6, T0 + 7.0, attempt=1,
             result={"kind": "checkpoint_ready", "step": 30, "first_step_at": T0 + 1.0,
                     "detected_at": T0 + 7.0}),
        Span("watch_ranks", T0 + 7.0, T0 + 9.0, attempt=1,
             result={"kind": "finished", "step": 30, "first_step_at": T0 + 1.0, "detected_at": T0 + 9.0}),
    ]
    report = compute_report(spans, start=T0, end=T0 + 9.5, incidents=[])
    assert report.phases["running"] == pytest.approx(6.0)
    assert report.phases["finishing"] == pytest.approx(2.5), "the ranks' exit after the last step"


def test_an_operator_pause_is_counted_as_paused() -> None:
    spans = [
        Span("find_checkpoint", T0 + 0.5, T0 + 0.6, attempt=1),
        Span("launch_ranks", T0 + 0.6, T0 + 0.7, attempt=1),
        Span("watch_ranks", T0 + 0.7, T0 + 10.0, attempt=1,
             result={"kind": "checkpoint_ready", "step": 50, "first_step_at": T0 + 2.0,
                     "detected_at": T0 + 9.0}),
        Span("stop_ranks", T0 + 10.0, T0 + 10.5, "stop ranks on node-0: paused by an operator", attempt=1),
        Span("find_checkpoint", T0 + 40.0, T0 + 40.2, attempt=2),
        Span("launch_ranks", T0 + 40.2, T0 + 40.3, attempt=2),
        Span("watch_ranks", T0 + 40.3, T0 + 50.0, attempt=2,
             result={"kind": "finished", "step": 100, "first_step_at": T0 + 42.0, "detected_at": T0 + 50.0}),
    ]
    report = compute_report(spans, start=T0, end=T0 + 50.5, incidents=[])
    assert report.phases["paused"] == pytest.approx(30.0)
    assert report.phases["recovering"] == 0.0
    assert sum(report.phases.values()) == pytest.approx(50.5)


def test_a_policy_pause_counts_the_stop_as_recovery_then_paused() -> None:
    lost = Incident(kind=IncidentKind.NODE_UNRESPONSIVE, node="node-1", attempt=1, detected_at=T0 + 10.0,
                    action=Action.PAUSE)
    spans = [
        Span("find_checkpoint", T0 + 0.5, T0 + 0.6, attempt=1),
        Span("launch_ranks", T0 + 0.6, T0 + 0.7, attempt=1),
        Span("watch_ranks", T0 + 0.7, T0 + 10.0, attempt=1, outcome="timed_out",
             result=None),
        Span("stop_ranks", T0 + 10.2, T0 + 11.0, "stop ranks on node-0: node_unresponsive: pause", attempt=1),
    ]
    report = compute_report(spans, start=T0, end=T0 + 30.0, status="RUNNING", incidents=[lost])
    assert report.phases["recovering"] == pytest.approx(1.0)
    assert report.phases["paused"] == pytest.approx(19.0)
    [loss] = report.incidents
    assert loss.note == "not resumed (yet); detection time unknown" and loss.lost_s == 0.0



def _phases_after_a_stop(reason: str | None, summary: str = "") -> tuple[str, str]:
    """The phases a run is in just after a stop that starts at 10 s and ends at 11 s, and at 20 s."""
    spans = [
        Span("find_checkpoint", T0 + 0.5, T0 + 0.6, attempt=1),
        Span("launch_ranks", T0 + 0.6, T0 + 0.7, attempt=1),
        Span("watch_ranks", T0 + 0.7, T0 + 10.0, attempt=1,
             result={"kind": "checkpoint_ready", "step": 50, "first_step_at": T0 + 2.0, "detected_at": T0 + 9.0}),
        Span("stop_ranks", T0 + 10.0, T0 + 11.0, summary, attempt=1,
             input={"workflow_id": "wf", "node": "node-0", "attempt": 1,
                    **({} if reason is None else {"reason": reason})}),
    ]
    report = compute_report(spans, start=T0, end=T0 + 30.0, status="RUNNING", incidents=[])

    def at(offset: float) -> str:
        return next(s.phase for s in report.segments if s.start <= offset < s.end)

    return at(10.5), at(20.0)


PHASES_AFTER_A_STOP = {
    StopReason.OPERATOR_PAUSE: ("paused", "paused"),
    StopReason.INCIDENT_PAUSE: ("recovering", "paused"),
    StopReason.RUN_ENDED: ("finishing", "finishing"),
    StopReason.INCIDENT: ("recovering", "recovering"),
    StopReason.DRAIN: ("recovering", "recovering"),
    StopReason.GROW: ("recovering", "recovering"),
    StopReason.IN_PROCESS_FAILED: ("recovering", "recovering"),
    StopReason.CORRUPT_CHECKPOINT: ("recovering", "recovering"),
}
"""Every reason, by hand: a new one is recovery unless the report's table says otherwise, and the check below
makes sure that choice is made on purpose."""


@pytest.mark.parametrize(("reason", "phases"), PHASES_AFTER_A_STOP.items())
def test_a_stop_counts_as_its_reason_says_without_a_summary(reason: StopReason, phases: tuple[str, str]) -> None:
    assert _phases_after_a_stop(reason.value) == phases


def test_a_stop_reason_wins_over_its_summary_which_only_histories_before_it_are_read_by() -> None:
    assert _phases_after_a_stop(StopReason.INCIDENT.value, "stop ranks on node-0: paused by an operator") == (
        "recovering", "recovering")
    assert _phases_after_a_stop(None, "stop ranks on node-0: paused by an operator") == ("paused", "paused")
    assert _phases_after_a_stop("a-reason-of-a-newer-release") == ("recovering", "recovering")


def test_every_stop_reason_has_its_row_in_the_table() -> None:
    assert set(PHASES_AFTER_A_STOP) == set(StopReason)

def test_a_reported_straggler_costs_nothing_and_changes_no_phase() -> None:
    straggler = Incident(kind=IncidentKind.STRAGGLER, node="node-1", rank=1, attempt=1, detected_at=T0 + 5.0,
                         action=Action.REPORT)
    spans = [Span("launch_ranks", T0, T0 + 0.1, attempt=1),
             Span("watch_ranks", T0, T0 + 10, attempt=1,
                  result={"kind": "finished", "step": 10, "first_step_at": T0 + 1.0, "detected_at": T0 + 10})]
    report = compute_report(spans, start=T0, end=T0 + 10.0, incidents=[straggler])
    assert report.phases["recovering"] == 0.0 and report.incidents[0].lost_s == 0.0
    assert report.incidents[0].note == "reported, training went on"


def test_a_grow_back_is_an_incident_of_the_report_with_its_time_to_recover() -> None:
    """A shrunk run relaunching onto its returned node at the commit of step 20: its relaunch and the steps it
    took past the commit are what the grow cost."""
    grow = Incident(kind=IncidentKind.GROW_BACK, node="node-1", attempt=2, detection_s=0.0, recovery_s=4.0,
                    resumed_step=20, detected_at=T0 + 6.0, detail="node-1 back: relaunch on world size 2 (was 1)")
    spans = [Span("launch_ranks", T0, T0 + 0.1, attempt=2, input={"restore_step": 10}),
             Span("watch_ranks", T0 + 0.1, T0 + 6.0, attempt=2,
                  result={"kind": "keepalive", "step": 22, "first_step_at": T0 + 1.0, "detected_at": T0 + 6.0}),
             Span("launch_ranks", T0 + 6.5, T0 + 6.6, attempt=3, input={"restore_step": 20}),
             Span("watch_ranks", T0 + 6.6, T0 + 14.0, attempt=3,
                  result={"kind": "finished", "step": 40, "first_step_at": T0 + 10.0, "detected_at": T0 + 14.0})]
    report = compute_report(spans, start=T0, end=T0 + 14.0, incidents=[grow])
    [loss] = report.incidents
    assert (loss.kind, loss.recovery_s, loss.redone_steps) == ("grow_back", 4.0, 2)
    assert loss.lost_s > 4.0 and "unknown" not in loss.note, loss
    assert "grow_back" in render_table(report)


def test_a_continued_chain_is_one_run() -> None:
    first = FakeHistory(T0, {"entrypoint": ["x"], "nodes": ["node-0"]})
    first.activity("find_checkpoint", T0 + 0.5, T0 + 0.6, "find newest checkpoint (attempt 1)")
    first.activity("launch_ranks", T0 + 0.6, T0 + 0.7, "launch ranks on node-0 (attempt 1, from step 0)",
                   {"attempt": 1, "restore_step": 0})
    _watch(first, "node-0", 1, T0 + 0.7, T0 + 10.0, kind="checkpoint_ready", step=50, first_step_at=T0 + 2.0,
           detected_at=T0 + 10.0)
    first.continued(T0 + 10.1)
    carried = {"status": {"attempt": 1, "nodes": ["node-0"], "incidents": []}, "started_at": T0}
    second = FakeHistory(T0 + 10.1, {"spec": {}, "carried": carried}, continued_from="run-1")
    _watch(second, "node-0", 1, T0 + 10.2, T0 + 20.0, kind="finished", step=100, first_step_at=T0 + 2.0,
           detected_at=T0 + 20.0, mean_step_s=0.18)
    second.completed(T0 + 20.5, RunResult(workflow_id="r", steps_completed=100, attempts=1, mean_step_s=0.18,
                                          wall_s=20.5))
    runs = [spans_from_events(first.events), spans_from_events(second.events)]
    assert runs[0].status == "CONTINUED_AS_NEW" and runs[1].continued_from == "run-1"
    report = report_from_histories("r", runs)
    assert report.runs == 2 and report.wall_s == pytest.approx(20.5)
    assert report.phases["running"] == pytest.approx(18.0), "no phase change at the continue-as-new"
    assert report.goodput == pytest.approx(100 * 0.18 / 20.5)
    assert any("continued as new 1 time" in n for n in report.notes)


def test_only_the_newest_run_readable_reports_the_rest_as_earlier_runs() -> None:
    carried = {"status": {"attempt": 3, "nodes": ["node-0"], "incidents": [CRASH.model_dump(mode="json")]},
               "started_at": T0 - 100.0}
    latest = FakeHistory(T0, {"spec": {}, "carried": carried}, continued_from="gone")
    _watch(latest, "node-0", 3, T0, T0 + 5.0, kind="checkpoint_ready", step=500, detected_at=T0 + 5.0)
    report = report_from_histories("r", [spans_from_events(latest.events)], now=T0 + 10.0,
                                   missing_earlier=True)
    assert report.status == "RUNNING"
    assert report.wall_s == pytest.approx(110.0)
    assert report.phases["earlier runs"] == pytest.approx(100.0)
    assert report.phases["running"] == pytest.approx(10.0)
    assert [i.kind for i in report.incidents] == ["crash"], "incidents carried into the newest run"


def test_a_running_run_takes_its_incidents_from_the_status_query() -> None:
    h = crash_run()
    h.events = h.events[:-5]  # the last watch still open: running
    run = spans_from_events(h.events)
    assert run.status == "RUNNING" and run.end is None
    status = RunStatus(attempt=2, incidents=[CRASH])
    report = report_from_histories("r", [run], now=T0 + 22.0, status=status)
    assert report.wall_s == pytest.approx(22.0)
    assert report.phases["running"] == pytest.approx(7.0 + 4.0)
    assert report.steps_completed == 40 and report.mean_step_s == pytest.approx(0.1)
    assert report.incidents[0].lost_s == pytest.approx(0.1 + 6.0 + 2.5)
    assert any("not completed" in n for n in report.notes)


def test_the_table_names_every_phase_and_incident() -> None:
    text = render_table(report_from_histories("r", [spans_from_events(crash_run().events)]))
    for word in ("reserving", "restoring", "launching", "running", "recovering", "paused", "finishing",
                 "goodput", "24.0 %", "lost to incidents", "crash", "20..45", "8.60"):
        assert word in text, word
    assert "attempt 2: restoring 0.50 s, launching 5.00 s, running 6.00 s" in text


def test_the_png_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "report.png"
    render_png(report_from_histories("r", [spans_from_events(crash_run().events)]), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    quiet = compute_report([], start=T0, end=T0 + 1.0, incidents=[])
    render_png(quiet, tmp_path / "quiet.png")
    assert (tmp_path / "quiet.png").stat().st_size > 0


def test_no_matplotlib_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        render_png(compute_report([], start=T0, end=T0 + 1.0, incidents=[]), tmp_path / "x.png")


def test_an_empty_history_is_an_error() -> None:
    with pytest.raises(ValueError):
        spans_from_events([])
    with pytest.raises(ValueError):
        report_from_histories("r", [])
    assert isinstance(RunHistory(start=T0).spans, list)


# ------------------------------------------------------------- the benchmark's pictures (infra.bench.plots)

BENCH = {
    "config": {"faults": ["crash"], "steps": 400, "step_time": 0.1, "fault_step": 120,
               "checkpoint_every": 50},
    "results": [
        {"fault": "crash", "system": "trainguard", "detection_s": 0.2, "restart_s": 3.0,
         "time_to_recover_s": 3.2, "goodput": 0.8, "wall_s": 50.0, "steps_completed": 400, "fault_step": 120,
         "resumed_step": 100, "mean_step_s": 0.1, "note": "", "events": []},
        {"fault": "crash", "system": "torchrun", "detection_s": None, "restart_s": None,
         "time_to_recover_s": None, "goodput": None, "wall_s": None, "steps_completed": None,
         "fault_step": None, "resumed_step": None, "mean_step_s": None, "note": "error: boom", "events": []},
    ],
    "floor": {"cold_start_s": 4.0},
}


def test_a_timeline_is_reconstructed_from_the_figures() -> None:
    from infra.bench.plots import lost_parts, timeline_of

    line = timeline_of(BENCH["results"][0], BENCH["config"])
    assert line is not None and not line.measured
    # 50 s of wall: (120 + 300) steps x 0.1 s of training, 3.2 s of recovery, the rest start-up (4.8 s).
    assert line.points[1] == pytest.approx((4.8, 0))
    assert line.fault_s == pytest.approx(16.8) and line.detected_s == pytest.approx(17.0)
    assert line.recovered_s == pytest.approx(20.0)
    assert line.points[-1] == pytest.approx((50.0, 400))
    assert (line.fault_step, line.resumed_step) == (120, 100)
    assert lost_parts(BENCH["results"][0], BENCH["config"]) == pytest.approx(
        {"detection": 0.2, "restart": 3.0, "redone": 2.0})
    assert timeline_of(BENCH["results"][1], BENCH["config"]) is None, "a failed measurement draws nothing"


def test_a_measured_timeline_wins() -> None:
    from infra.bench.plots import timeline_of

    measured = {**BENCH["results"][0], "fault_at_s": 16.0,
                "timeline": [[5.0, 1, 0], [16.0, 120, 0], [19.2, 101, 1], [49.0, 400, 1]]}
    line = timeline_of(measured, BENCH["config"])
    assert line is not None and line.measured
    assert line.points == [(5.0, 1), (16.0, 120), (19.2, 120), (19.2, 101), (49.0, 400)], \
        "flat until the next attempt's first step, then back to its step"
    assert line.detected_s == pytest.approx(16.2) and line.recovered_s == pytest.approx(19.2)


def test_the_benchmark_pictures_are_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from infra.bench.plots import main

    (tmp_path / "recovery.json").write_text(json.dumps(BENCH))
    (tmp_path / "checkpoint.json").write_text(json.dumps({"context": {"size_mib": 1}, "figures": [
        {"name": "checkpoint stall", "unit": "s", "trainguard": 0.1, "baseline": 0.4, "floor": 0.09},
        {"name": "upload", "unit": "MB/s", "trainguard": 80.0, "baseline": 120.0, "floor": None}]}))
    (tmp_path / "goodput.json").write_text(json.dumps({"config": {"steps": 60, "schedule": [[20, "crash"]]},
                                                       "outcomes": [
        {"system": "trainguard", "goodput": 0.5, "completed": True, "steps_completed": 60,
         "timeline": [[0, 0], [5, 20], [6, 15], [12, 60]], "faults": [[5, "crash"]]},
        {"system": "torchrun", "goodput": 0.2, "completed": False, "steps_completed": 20,
         "timeline": [[0, 0], [9, 20]], "faults": [[9, "crash"]]}]}))
    (tmp_path / "paths.json").write_text(json.dumps({"config": {"repeats": 1}, "floor": {"cold_start_s": 4.0},
                                                     "summary": [
        {"path": "s3", "detection_s": 0.1, "teardown_s": 0.1, "restore_s": 0.1, "relaunch_s": 2.3,
         "time_to_recover_s": 2.6},
        {"path": "in-process", "detection_s": 0.1, "teardown_s": 0.02, "restore_s": 0, "relaunch_s": 1.4,
         "time_to_recover_s": 1.5}]}))
    code = main(["--recovery", str(tmp_path / "recovery.json"),
                 "--checkpoint", str(tmp_path / "checkpoint.json"), "--goodput", str(tmp_path / "goodput.json"),
                 "--paths", str(tmp_path / "paths.json"), "--out", str(tmp_path / "out")])
    assert code == 0
    for name in ("recovery-timeline.png", "recovery-lost.png", "checkpoint.png", "goodput-timeline.png",
                 "recovery-paths.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG", name


async def test_encrypted_payloads_are_decoded_with_the_codec() -> None:
    from trainguard.codec import EncryptionCodec
    from trainguard.report import decode_events

    codec = EncryptionCodec(bytes(range(32)), "k1")
    events = crash_run().events
    for event in events:  # encrypt what a worker with the codec would have written
        for name in ("activity_task_scheduled_event_attributes", "activity_task_completed_event_attributes",
                     "workflow_execution_completed_event_attributes",
                     "workflow_execution_started_event_attributes"):
            if event.HasField(name):
                attrs = getattr(event, name)
                container = attrs.input if hasattr(attrs, "input") else attrs.result
                sealed = await codec.encode(list(container.payloads))
                del container.payloads[:]
                container.payloads.extend(sealed)
        if event.HasField("user_metadata"):
            event.user_metadata.summary.CopyFrom((await codec.encode([event.user_metadata.summary]))[0])

    unreadable = report_from_histories("r", [spans_from_events(events)])
    assert unreadable.incidents == [] and any("no codec key" in n for n in unreadable.notes)

    assert await decode_events(events, EncryptionCodec(bytes(32), "other")) > 0, "another key reads nothing"
    assert await decode_events(events, codec) == 0
    report = report_from_histories("r", [spans_from_events(events)])
    assert report.lost_s == pytest.approx(8.6) and report.phases["running"] == pytest.approx(13.0)


def test_a_rank_incident_shows_its_log_and_traceback() -> None:
    report = compute_report([], start=T0, end=T0 + 30.0, incidents=[CRASH.model_copy(update={
        "log_path": "/n/runs/r/attempt-0001/logs/rank-00001.log",
        "log_tail": "Traceback (most recent call last):\nValueError: nan"})])
    text = render_table(report)
    assert "log /n/runs/r/attempt-0001/logs/rank-00001.log" in text
    assert "   | ValueError: nan" in text


def test_named_phases_are_useful_time_in_the_report() -> None:
    result = RunResult(workflow_id="r", steps_completed=100, attempts=1, wall_s=30.0, mean_step_s=0.1,
                       useful_s=10.0 + 12.5, goodput=0.75, phase_s={"eval": 12.5})
    report = compute_report([], start=T0, end=T0 + 30.0, incidents=[], result=result)

    assert report.named_phases == {"eval": 12.5}
    assert "100 steps x 0.1000 s + eval 12.50 s" in render_table(report)
