"""Table tests of the supervision loop's pure decisions (workflows/run_decisions.py)."""

from __future__ import annotations

import pytest

from trainguard.models import Action, Incident, IncidentKind
from workflows.policy import Decision
from workflows.run_decisions import (SUGGESTED_HISTORY_BYTES, Ending, attempt_ending, continue_as_new_due,
                                     decision_every_s, earliest_incident, grow_or_finish, judge_pace,
                                     judge_stragglers, lost_since, pace_window_s, stop_reason)


def _incident(kind: IncidentKind = IncidentKind.CRASH, **fields: object) -> Incident:
    return Incident(kind=kind, node="node-1", rank=1, attempt=1, **fields)  # type: ignore[arg-type]


def test_the_earliest_failure_is_the_incident_and_ties_keep_the_first_reported() -> None:
    crash, peer, other = _incident(detail="a"), _incident(detail="b"), _incident(detail="c")
    assert earliest_incident([]) is None
    assert earliest_incident([(5.0, peer), (3.0, crash), (4.0, other)]) is crash
    assert earliest_incident([(3.0, peer), (3.0, crash)]) is peer


@pytest.mark.parametrize(("suggested", "size", "events", "due"), [
    (False, 0, 9_999, False),
    (False, 0, 10_000, True),  # the spec's count decides
    (True, 1024, 4_096, False),  # the server's event-count suggestion: not ours
    (True, SUGGESTED_HISTORY_BYTES, 4_096, True),  # the size's suggestion: taken
    (False, SUGGESTED_HISTORY_BYTES * 2, 10, False),  # size without a suggestion
])
def test_continue_as_new_by_the_specs_event_count_or_a_size_suggestion(suggested: bool, size: int, events: int,
                                                                       due: bool) -> None:
    assert continue_as_new_due(suggested=suggested, history_bytes=size, history_events=events,
                               max_events=10_000) is due


@pytest.mark.parametrize(("streaks", "slow", "spare", "first", "persisted", "carried"), [
    ({}, {3: 2.0}, True, [3], None, {3: 1}),
    ({3: 1}, {3: 2.0}, True, [], None, {3: 2}),
    ({3: 2}, {3: 2.0}, True, [], 3, {}),  # three windows in a row, a spare: the policy decides
    ({3: 2}, {3: 2.0}, False, [], None, {3: 3}),  # no spare: reported, kept counting
    ({3: 2}, {5: 2.0}, True, [5], None, {5: 1}),  # rank 3 recovered: its streak ends
    ({1: 2}, {1: 2.0, 2: 2.0}, True, [], 1, {}),  # the first to persist goes; rank 2 not yet seen by then
])
def test_a_straggler_is_reported_first_and_acted_on_when_it_persists(
        streaks: dict[int, int], slow: dict[int, float], spare: bool, first: list[int], persisted: int | None,
        carried: dict[int, int]) -> None:
    verdict = judge_stragglers(streaks, slow, windows=3, have_spare=spare)
    assert (verdict.first_seen, verdict.persisted, verdict.streaks) == (first, persisted, carried)


@pytest.mark.parametrize(("streaks", "last_end", "window_end", "slow", "first", "persisted", "carried"), [
    ({}, 0.0, 1000.0, {1: 5.0}, [1], None, {1: 1}),  # the first slow window: reported
    ({1: 1}, 1000.0, 1010.3, {1: 5.0}, [], 1, {}),  # the next window, slow again: checkpoint, then the spare
    ({1: 1}, 1000.0, 1017.0, {1: 5.0}, [], 1, {}),  # a node's window ends a little late: still in a row
    ({1: 1}, 1000.0, 1020.0, {1: 5.0}, [1], None, {1: 1}),  # a window kept pace in between: counted anew
    ({1: 1}, 1000.0, 1010.0, {2: 1.6}, [2], None, {2: 1}),  # another rank: rank 1's streak ends
])
def test_a_straggler_persists_over_windows_of_training_in_a_row(
        streaks: dict[int, int], last_end: float, window_end: float, slow: dict[int, float], first: list[int],
        persisted: int | None, carried: dict[int, int]) -> None:
    verdict = judge_pace(streaks, last_end, slow, window_end=window_end, window_s=10.0, windows=2, have_spare=True)
    assert (verdict.first_seen, verdict.persisted, verdict.streaks) == (first, persisted, carried)


@pytest.mark.parametrize(("configured", "nodes", "window"), [
    (10.0, 2, 10.0), (10.0, 1000, 10.0), (10.0, 4096, 40.96), (60.0, 4096, 60.0),
])
def test_a_large_run_widens_its_straggler_window_to_bound_the_stores_load(configured: float, nodes: int,
                                                                          window: float) -> None:
    assert pace_window_s(configured, nodes) == window


@pytest.mark.parametrize(("kind", "detected_at", "since"), [
    (IncidentKind.NODE_UNRESPONSIVE, 100.0, 90.0),
    (IncidentKind.NODE_UNRESPONSIVE, 0.0, None),  # never detected: no bound
    (IncidentKind.CRASH, 100.0, None),  # not a lost node
])
def test_a_lost_node_was_last_heard_from_one_silence_before_it_was_found(
        kind: IncidentKind, detected_at: float, since: float | None) -> None:
    assert lost_since(_incident(kind, detected_at=detected_at), 10.0) == since


@pytest.mark.parametrize(("returned", "ended", "grow"), [
    (["node-2"], 0, ["node-2"]),
    (["node-2"], 1, []),  # a group finished (or reported) at this commit: finishing wins
    ([], 0, []),
])
def test_growing_back_never_outranks_finishing(returned: list[str], ended: int, grow: list[str]) -> None:
    assert grow_or_finish(returned, groups_ended=ended) == grow


def test_a_stop_names_its_cause() -> None:
    spent = Decision(Action.STOP, "restart budget spent")
    same = _incident(signature="ValueError: x", log_tail="Traceback ...", log_path="/logs/rank-1.log")
    quoted = stop_reason(spent, same, "exit 1", same_failures=3, max_same_failure=3, rank_fault=True)
    assert quoted.reason.startswith("rank 1 on node-1: ValueError: x: restart budget spent")
    assert quoted.reason.endswith("Traceback ...")
    named = stop_reason(spent, same, "exit 1", same_failures=1, max_same_failure=3, rank_fault=True)
    assert named.reason == "restart budget spent; the last incident: exit 1 (log: /logs/rank-1.log on node-1)"
    node = _incident(IncidentKind.NODE_UNRESPONSIVE)
    assert stop_reason(spent, node, "gone", same_failures=0, max_same_failure=3, rank_fault=False) == spent
    restart = Decision(Action.RESTART, "relaunch")
    assert stop_reason(restart, same, "exit 1", same_failures=5, max_same_failure=3, rank_fault=True) == restart


@pytest.mark.parametrize(("seen", "ending"), [
    ({}, Ending.FINISHED),
    ({"continue_as_new": True}, Ending.CONTINUE),
    ({"continue_as_new": True, "paused": True}, Ending.PAUSE),  # an operator's pause is never carried past
    ({"drain": True, "grow": True}, Ending.DRAIN),
    ({"grow": True}, Ending.GROW),
    ({"incident": True, "paused": True, "drain": True}, Ending.INCIDENT),
    ({"corrupt": True, "incident": True}, Ending.CORRUPT),
    ({"spec_fault": True, "corrupt": True, "incident": True}, Ending.SPEC_FAULT),
])
def test_what_ends_an_attempt(seen: dict[str, bool], ending: Ending) -> None:
    flags = dict.fromkeys(("spec_fault", "corrupt", "incident", "continue_as_new", "paused", "drain", "grow"), False)
    assert attempt_ending(**{**flags, **seen}) is ending


@pytest.mark.parametrize(("nodes", "every"), [(2, 1.0), (1_000, 1.0), (4_096, 4.096)])
def test_nodes_read_the_runs_decision_at_most_a_thousand_times_a_second(nodes: int, every: float) -> None:
    assert decision_every_s(nodes) == every
