"""The report reads the histories the real `TrainingRun` writes, not hand-written ones: its summaries, inputs
and results, on the time-skipping test server with stand-in activities. A reworded summary or a renamed
field the report depends on fails here (the hand-built histories of test_report.py would not notice). Each run
is also reported with every summary taken out of its histories: the report reads fields (an activity's
attempt, a stop's reason), so it must come out the same, and a field the workflow stops filling in, or fills
in wrong, fails here too."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from unittest import mock

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from test_training_run_workflow import (
    BLOCK,
    Cluster,
    Until,
    _exited,
    _finished,
    _node_ids,
    _ready,
    _run,
    _spec,
    _wait_for_phase,
)

from trainguard.models import IncidentKind, OperatorRequest, Phase, RunResult, StopReason
from trainguard.report import RunReport, Span, decode, fetch_chain, report_from_histories
from workflows.training_run import TrainingRun


async def _report(env: WorkflowEnvironment, workflow_id: str, summaries: bool = True
                  ) -> tuple[RunReport, list[Span]]:
    """What `trainguard run report` computes: from the run's history and its node groups' (`fetch_chain`).
    With `summaries` False, from those histories with every activity's summary taken out."""
    real = decode.spans_from_events

    def without_summaries(events: Iterable[Any]) -> Any:
        events = list(events)
        for event in events:
            event.ClearField("user_metadata")
        return real(events)

    with mock.patch.object(decode, "spans_from_events", real if summaries else without_summaries):
        histories, missing = await fetch_chain(env.client, workflow_id)
    assert not missing
    return report_from_histories(workflow_id, histories), [s for h in histories for s in h.spans]


def _phases(report: RunReport) -> list[str]:
    """The report's phase segments, repeats merged."""
    merged: list[str] = []
    for segment in report.segments:
        if not merged or merged[-1] != segment.phase:
            merged.append(segment.phase)
    return merged


async def test_a_crashed_and_relaunched_run_reads_as_two_attempts_with_a_recovery_between(
        env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = Cluster(nodes=nodes, stamp_detection=True)
    both_uploaded = Until(lambda: len(cluster.inputs("upload_shards")) == 2)
    cluster.watch_script = {
        (1, nodes[0]): [_ready(10), both_uploaded, _exited(-9)],
        (1, nodes[1]): [_ready(10), BLOCK],
        (2, nodes[0]): [_finished(25)],
        (2, nodes[1]): [_finished(25)],
    }
    run = await _run(env, cluster, _spec(nodes))
    assert isinstance(run.outcome, RunResult) and run.outcome.attempts == 2

    report, spans = await _report(env, run.handle.id)

    spans = [s for s in spans if s.name in ("find_checkpoint", "launch_ranks", "watch_ranks", "stop_ranks")]
    assert spans and all(s.attempt is not None for s in spans), \
        [(s.name, s.summary) for s in spans if s.attempt is None]
    assert sorted({s.attempt for s in spans if s.name == "find_checkpoint"}) == [1, 2]
    assert not [s for s in spans if s.name == "stop_ranks"], "a relaunch sends no stop: each launch fences"
    assert report.attempts == 2
    # From the crash's detection it is recovery, and attempt 2 restores and runs again.
    phases = _phases(report)
    assert "running" in phases and phases[phases.index("running"):][:4] == [
        "running", "recovering", "restoring", "launching"], phases
    assert report.phases["paused"] == 0.0
    [loss] = report.incidents
    assert (loss.kind, loss.attempt, loss.resumed_step) == (IncidentKind.CRASH.value, 1, 10)

    # Without its summaries, each restore still belongs to its attempt (`FindCheckpointInput.attempt`).
    bare, bare_spans = await _report(env, run.handle.id, summaries=False)
    assert not any(s.summary for s in bare_spans)
    assert [s.attempt for s in bare_spans if s.name == "find_checkpoint"] == [1, 2]
    assert _phases(bare) == phases and bare.phases == report.phases


async def test_an_operator_pause_reads_as_paused_not_as_recovery(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(1)

    async def pause(handle: WorkflowHandle[Any, Any]) -> None:
        await handle.execute_update(TrainingRun.pause, OperatorRequest(reason="swap a PSU"))

    async def resume(handle: WorkflowHandle[Any, Any]) -> None:
        await _wait_for_phase(handle, Phase.PAUSED)
        await handle.execute_update(TrainingRun.resume, OperatorRequest())

    cluster = Cluster(nodes=nodes, while_running=pause,
                      watch_script={(1, nodes[0]): [BLOCK], (2, nodes[0]): [_finished(20)]})
    run = await _run(env, cluster, _spec(nodes), operator=resume)
    assert isinstance(run.outcome, RunResult) and run.outcome.attempts == 2

    report, spans = await _report(env, run.handle.id)

    assert "paused" in _phases(report) and "recovering" not in _phases(report), _phases(report)
    assert report.phases["paused"] > 0.0 and report.phases["recovering"] == 0.0
    assert report.incidents == []
    stops = [s for s in spans if s.name == "stop_ranks"]
    assert [s.input["reason"] for s in stops if s.input] == [StopReason.OPERATOR_PAUSE.value], \
        [(s.summary, s.input) for s in stops]

    # Without its summaries, the stop is still the operator's pause (`StopRanksInput.reason`), not recovery.
    bare, bare_spans = await _report(env, run.handle.id, summaries=False)
    assert not any(s.summary for s in bare_spans)
    assert _phases(bare) == _phases(report) and bare.phases == report.phases
