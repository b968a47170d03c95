"""The supervision reducer's rules (`workflows.supervision.observe`), one table per rule.

Each case folds events the way the `Supervisor` does: an action that asks a question is answered with the
event the test gives, exactly as the supervisor's `_act` feeds answers back.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from activities.models import WatchEvent, WatchEventKind
from activities.pace_models import PaceVerdict
from trainguard.error_types import ErrorType
from trainguard.models import Incident, IncidentKind
from workflows.node_group_models import LostNode, NodeGroupWatchResult
from workflows.run_decisions import Ending
from workflows.supervision import (STRAGGLER_CHECKPOINT_AHEAD_S, STRAGGLER_CHECKPOINT_WAIT_S, LostAs, Seen,
                                   classify_lost, observe)
from workflows.supervision_events import (AgentRestarting, AskCheckpoint, CheckHistory, Committed, Event, Found,
                                          History, JoinAnswer, JoinSpare, JudgeStorage, LoseNode, Reclaim,
                                          Reclaimed, ReclaimSpares, RecordIncident, Release, Reported, Settle,
                                          Settled, StartTimer, StragglerAsked, StragglerWaitOver,
                                          SupervisionAction, Tell, WatchAgain)

NODES = ["node-0", "node-1", "node-2"]
Answer = Callable[[SupervisionAction], Event | None]


def lost_incident(action: SupervisionAction) -> Event | None:
    """As `RunCore.lost_at_launch` would: a lost node found now."""
    if isinstance(action, LoseNode):
        return Found(Incident(kind=IncidentKind.NODE_UNRESPONSIVE, node=action.node, attempt=2, detected_at=50.0),
                     action.group, action.join)
    return None


def run(seen: Seen, event: Event, answer: Answer = lost_incident, *,
        standing: frozenset[int] = frozenset(), joined: bool = True) -> tuple[Seen, list[SupervisionAction]]:
    """Fold `event` and every answer, depth first, as the supervisor does; every action taken, in order."""
    seen, actions = observe(seen, event)
    queue, taken = list(reversed(actions)), []
    while queue:
        action = queue.pop()
        taken.append(action)
        reply = answer(action)
        if isinstance(action, Settle):
            reply = Settled(standing)
        elif isinstance(action, JoinSpare):
            reply = JoinAnswer(action.group, action.incident, joined)
        if reply is not None:
            seen, more = observe(seen, reply)
            queue.extend(reversed(more))
    return seen, taken


def rank_exit(node: str, occurred_at: float, rank: int = 0) -> WatchEvent:
    return WatchEvent(kind=WatchEventKind.RANK_EXITED, node=node, rank=rank, exit_code=1, detected_at=100.0,
                      occurred_at=occurred_at)


def reported(*results: tuple[int, NodeGroupWatchResult], launching: bool = False) -> Reported:
    return Reported(list(results), attempt=2, launching=launching, now=100.0)


# --------------------------------------------------------------------------------------- whose fault
@pytest.mark.parametrize(("lost", "launching", "expected"), [
    (LostNode(node="n", detail="", error_type=ErrorType.BAD_SPEC), False, LostAs.SPEC_FAULT),
    (LostNode(node="n", detail="", error_type=ErrorType.ENTRYPOINT_NOT_ALLOWED), True, LostAs.SPEC_FAULT),
    (LostNode(node="n", detail="", error_type=ErrorType.STALE_ATTEMPT), False, LostAs.SPEC_FAULT),
    (LostNode(node="n", detail="", error_type=ErrorType.CORRUPT_CHECKPOINT), True, LostAs.CORRUPT),
    (LostNode(node="n", detail="", error_type=ErrorType.AGENT_SHUTDOWN, away_since=5.0), False, LostAs.AGENT_RESTART),
    (LostNode(node="n", detail="", never_started=True), True, LostAs.JOIN),
    (LostNode(node="n", detail="", never_started=True), False, LostAs.LOST),
    (LostNode(node="n", detail="heartbeat timeout"), True, LostAs.LOST),
])
def test_a_lost_node_is_classified_by_whose_fault_it_is(lost: LostNode, launching: bool, expected: LostAs) -> None:
    assert classify_lost(lost, launching=launching) is expected


# ---------------------------------------------------------------------------------- which failure
def test_the_earliest_failure_is_the_incident_not_the_peer_that_failed_in_its_collective() -> None:
    peer = NodeGroupWatchResult(incidents=[rank_exit("node-0", occurred_at=90.5, rank=0)])
    cause = NodeGroupWatchResult(incidents=[rank_exit("node-2", occurred_at=90.0, rank=4)])
    seen, _ = run(Seen(watched=2), reported((0, peer), (1, cause)))
    assert seen.incident is not None and (seen.incident.node, seen.incident.rank) == ("node-2", 4)
    assert seen.ending(paused=False) is Ending.INCIDENT


def test_a_gpu_fault_counts_from_when_it_was_found_not_from_its_nvml_event() -> None:
    gpu = WatchEvent(kind=WatchEventKind.GPU_UNHEALTHY, node="node-1", detected_at=95.0, occurred_at=10.0)
    crash = rank_exit("node-0", occurred_at=92.0)
    seen, _ = run(Seen(watched=1), reported((0, NodeGroupWatchResult(incidents=[gpu, crash]))))
    assert seen.incident is not None and seen.incident.kind is IncidentKind.CRASH


def test_a_spec_fault_ends_the_attempt_before_the_incidents_it_explains() -> None:
    result = NodeGroupWatchResult(incidents=[rank_exit("node-0", 1.0)],
                                  lost=[LostNode(node="node-1", detail="no such dir", error_type=ErrorType.BAD_SPEC)])
    seen, taken = run(Seen(watched=1), reported((0, result)))
    assert seen.ending(paused=False) is Ending.SPEC_FAULT
    assert not any(isinstance(a, LoseNode) for a in taken)


def test_an_agent_restarting_is_recorded_as_coming_back_and_is_an_incident() -> None:
    result = NodeGroupWatchResult(lost=[LostNode(node="node-1", detail="upgrade", error_type=ErrorType.AGENT_SHUTDOWN,
                                                 away_since=70.0)])
    seen, taken = run(Seen(watched=1), reported((0, result)))
    assert AgentRestarting("node-1", 70.0) in taken
    assert seen.incident is not None and seen.incident.kind is IncidentKind.AGENT_RESTART


def test_nothing_reported_leaves_the_attempt_running() -> None:
    seen, taken = run(Seen(watched=2), reported())
    assert seen.ending(paused=False) is None and taken == [Settle()]


def test_every_group_finished_ends_the_attempt_and_a_pause_waits_for_a_healthy_one() -> None:
    done = NodeGroupWatchResult(finished=[WatchEvent(kind=WatchEventKind.FINISHED, node="node-0", step=40)])
    seen, _ = run(Seen(watched=2), reported((0, done)))
    assert seen.ending(paused=False) is None
    seen, _ = run(seen, reported((1, done)))
    assert seen.ending(paused=False) is Ending.FINISHED
    crashed, _ = run(Seen(watched=1), reported((0, NodeGroupWatchResult(incidents=[rank_exit("node-0", 1.0)]))))
    assert crashed.ending(paused=True) is Ending.INCIDENT
    assert Seen(watched=1).ending(paused=True) is Ending.PAUSE


# -------------------------------------------------------------------------- a spare joins the attempt
NEVER_STARTED = NodeGroupWatchResult(lost=[LostNode(node="node-1", detail="no agent", never_started=True)])


@pytest.mark.parametrize(("standing", "joined", "expected_watch", "incident"), [
    (frozenset({0}), True, Tell(0), False),  # a standing group still watching is told
    (frozenset(), True, WatchAgain(0), False),  # else the group watches again, the spare's launch in it
    (frozenset(), False, None, True),  # no spare: the lost node is the incident
])
def test_a_node_that_never_launched_has_a_spare_join_in_its_place(standing: frozenset[int], joined: bool,
                                                                   expected_watch: SupervisionAction | None,
                                                                   incident: bool) -> None:
    seen, taken = run(Seen(watched=1), reported((0, NEVER_STARTED), launching=True), standing=standing,
                      joined=joined)
    assert [a for a in taken if isinstance(a, JoinSpare)][0].incident.node == "node-1"
    watched = [a for a in taken if isinstance(a, (Tell, WatchAgain))]
    assert watched == ([expected_watch] if expected_watch else [])
    assert (seen.incident is not None) is incident


def test_no_spare_joins_when_another_failure_relaunches_every_node_anyway() -> None:
    crash = NodeGroupWatchResult(incidents=[rank_exit("node-0", occurred_at=20.0)])
    seen, taken = run(Seen(watched=2), reported((0, crash), (1, NEVER_STARTED), launching=True))
    assert not any(isinstance(a, JoinSpare) for a in taken)
    assert seen.incident is not None and seen.incident.kind is IncidentKind.CRASH
    assert seen.joining == [] and seen.candidates == []


# ------------------------------------------------------------------------------------------- commits
def committed(steps: list[int], *, pace: PaceVerdict | None = None, draining: bool = False, may_grow: bool = False,
              streaks: dict[int, int] | None = None, slow_window_end: float = 0.0, store_error: str | None = None,
              have_spare: bool = True, heals_from_peers: bool = False) -> Committed:
    return Committed(steps=steps, pace=pace, store_error=store_error, attempt=2, now=200.0, draining=draining,
                     may_grow=may_grow, streaks=streaks or {}, slow_window_end=slow_window_end, straggler_windows=2,
                     have_spare=have_spare, nodes=NODES, ranks_per_node=2, heals_from_peers=heals_from_peers)


def history(events: int) -> Answer:
    def answer(action: SupervisionAction) -> Event | None:
        if isinstance(action, CheckHistory):
            return History(suggested=False, bytes=1000, events=events, max_events=10_000)
        return None
    return answer


@pytest.mark.parametrize(("event", "events", "ending"), [
    (committed([10]), 100, None),
    (committed([10]), 10_000, Ending.CONTINUE),
    (committed([10], draining=True), 10_000, Ending.DRAIN),  # a drain is due first: no continue-as-new
    (committed([]), 10_000, Ending.CONTINUE),
])
def test_a_commit_ends_the_attempt_for_a_drain_or_a_long_history(event: Committed, events: int,
                                                                  ending: Ending | None) -> None:
    seen, taken = run(Seen(watched=1), event, history(events))
    assert seen.ending(paused=False) is ending
    assert (JudgeStorage(None) in taken) is (not event.steps)  # nothing committed: the store is judged


@pytest.mark.parametrize(("groups_ended", "grow", "released"), [
    (0, ["node-5"], []),
    (1, [], ["node-5"]),  # finishing wins: the node leased again for nothing goes back to the pool
])
def test_a_commit_grows_back_onto_returned_nodes_unless_a_group_ended(groups_ended: int, grow: list[str],
                                                                      released: list[str]) -> None:
    def answer(action: SupervisionAction) -> Event | None:
        if isinstance(action, Reclaim):
            return Reclaimed(["node-5"], groups_ended)
        return history(100)(action)

    seen, taken = run(Seen(watched=2), committed([10], may_grow=True), answer)
    assert seen.grow == grow
    assert [a.node for a in taken if isinstance(a, Release)] == released
    assert ReclaimSpares() in taken


# ------------------------------------------------------------------------------------------ stragglers
def slow(rank: int, end: float) -> PaceVerdict:
    return PaceVerdict(slow={rank: 2.5}, window_end=end, window_s=10.0, step=30)


def test_a_straggler_is_reported_first_then_replaced_after_a_checkpoint_on_demand() -> None:
    seen, taken = run(Seen(watched=1), committed([], pace=slow(3, 100.0)), history(100))
    [first] = [a.incident for a in taken if isinstance(a, RecordIncident)]
    assert (first.kind, first.rank, first.node) == (IncidentKind.STRAGGLER, 3, "node-1")
    assert seen.straggler is None and seen.incident is None

    def asked(action: SupervisionAction) -> Event | None:
        return StragglerAsked(60) if isinstance(action, AskCheckpoint) else history(100)(action)

    seen, taken = run(seen, committed([], pace=slow(3, 110.0), streaks={3: 1}, slow_window_end=100.0), asked)
    assert AskCheckpoint(STRAGGLER_CHECKPOINT_AHEAD_S) in taken and StartTimer(STRAGGLER_CHECKPOINT_WAIT_S) in taken
    assert seen.straggler is not None and seen.straggler.step == 60 and seen.incident is None
    assert not seen.continue_as_new  # a straggler being replaced holds the history
    seen, _ = run(seen, committed([50]), history(100))
    assert seen.incident is None  # an older step's commit is not its checkpoint
    seen, _ = run(seen, committed([60]), history(100))
    assert seen.incident is not None and "replaced after a checkpoint on demand at step 60" in seen.incident.detail


def test_a_replica_groups_straggler_is_replaced_at_once_without_a_checkpoint_on_demand() -> None:
    """A group's relaunch heals from a live group: a checkpoint would keep every group at the slow one's pace."""
    seen, taken = run(Seen(watched=1), committed([], pace=slow(3, 110.0), streaks={3: 1}, slow_window_end=100.0,
                                                 heals_from_peers=True), history(100))
    assert not any(isinstance(a, AskCheckpoint) for a in taken)
    assert seen.incident is not None and seen.incident.node == "node-1"
    assert seen.ending(paused=False) is not None and "heals from a live one" in seen.incident.detail
    seen, taken = run(Seen(watched=1), committed([], pace=slow(3, 100.0), heals_from_peers=True), history(100))
    assert seen.incident is None  # one slow window is still only reported


def test_a_slow_window_after_one_that_kept_pace_starts_the_streak_again() -> None:
    seen, taken = run(Seen(watched=1), committed([], pace=slow(3, 200.0), streaks={3: 1}, slow_window_end=100.0),
                      history(100))
    assert seen.straggler is None and not any(isinstance(a, AskCheckpoint) for a in taken)


def test_a_straggler_without_a_spare_is_only_reported() -> None:
    seen, taken = run(Seen(watched=1), committed([], pace=slow(3, 110.0), streaks={3: 1}, slow_window_end=100.0,
                                                 have_spare=False), history(100))
    assert seen.straggler is None and not any(isinstance(a, AskCheckpoint) for a in taken)


def persisting() -> Seen:
    def asked(action: SupervisionAction) -> Event | None:
        return StragglerAsked(60) if isinstance(action, AskCheckpoint) else history(100)(action)
    seen, _ = run(Seen(watched=1), committed([], pace=slow(3, 110.0), streaks={3: 1}, slow_window_end=100.0), asked)
    return seen


def test_a_straggler_checkpoint_that_never_commits_is_asked_again_then_the_node_replaced_without_it() -> None:
    seen, taken = run(persisting(), StragglerWaitOver(), lambda a: StragglerAsked(90) if isinstance(
        a, AskCheckpoint) else None)
    assert AskCheckpoint(2 * STRAGGLER_CHECKPOINT_AHEAD_S) in taken and seen.incident is None
    seen, taken = run(seen, StragglerWaitOver())
    assert taken == []
    assert seen.incident is not None and "step 90 did not commit" in seen.incident.detail


def test_a_failed_checkpoint_request_replaces_the_straggler_at_once() -> None:
    seen, _ = run(persisting(), StragglerWaitOver(), lambda a: StragglerAsked(None) if isinstance(
        a, AskCheckpoint) else None)
    assert seen.incident is not None and seen.incident.kind is IncidentKind.STRAGGLER
