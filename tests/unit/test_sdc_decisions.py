"""Silent data corruption and numerical faults in the run's pure rules: the incident the supervision reducer makes of
a committer's corruption verdict and of a watch's numerical fault (`workflows.supervision`), and what the policy
decides about each (`workflows.policy`)."""

from __future__ import annotations

import pytest

from activities.fingerprint_models import CorruptionVerdict, Tie, TieEvidence, TieSettlement
from activities.models import WatchEvent, WatchEventKind
from trainguard.models import Action, Incident, IncidentKind
from trainguard.spec import parse_spec
from workflows.node_group_models import NodeGroupWatchResult
from workflows.policy import RecoveryBudget, decide, numerical_fault_recurs
from workflows.supervision import Seen, observe
from workflows.supervision_events import (Committed, CordonSpare, ForgetTie, HoldTie, RecordIncident, Reported,
                                          Settled)

NODES = ["node-0", "node-1"]


def committed(verdict: CorruptionVerdict | None, flipped_at: dict[str, float] | None = None, tie: Tie | None = None,
              attempt: int = 2, steps: list[int] | None = None, resumed_step: int = 0,
              settled: TieSettlement | None = None) -> Committed:
    return Committed(steps=steps or [], pace=None, store_error=None, attempt=attempt, now=200.0, draining=False,
                     may_grow=False, streaks={}, slow_window_end=0.0, straggler_windows=2, have_spare=True,
                     nodes=NODES, ranks_per_node=2, corruption=verdict, flipped_at=flipped_at or {}, tie=tie,
                     resumed_step=resumed_step, fingerprint_every=10, settled=settled)


def test_an_outvoted_replica_ends_the_attempt_naming_its_rank_and_node() -> None:
    verdict = CorruptionVerdict(step=40, last_good_step=30, ranks=[2], nodes={2: "node-1"}, certain=True,
                                group="replicated")
    seen, _ = observe(Seen(watched=2), committed(verdict, flipped_at={"node-1": 197.5}))
    incident = seen.incident
    assert incident is not None and incident.kind is IncidentKind.SILENT_DATA_CORRUPTION
    assert (incident.node, incident.rank, incident.bad_step, incident.detection_s) == ("node-1", 2, 31, 2.5)
    assert "rank 2 (node-1)" in incident.detail and "step 40" in incident.detail
    assert seen.ending(paused=False) is not None


TIED = CorruptionVerdict(step=40, last_good_step=30, ranks=[0, 2], nodes={0: "node-0", 2: "node-1"},
                         certain=False, group="shard 0/2")


def test_two_replicas_that_differ_blame_no_node_and_hold_the_tie() -> None:
    seen, actions = observe(Seen(watched=2), committed(TIED))
    incident = seen.incident
    assert incident is not None and incident.node is None and incident.bad_step == 31
    assert "no majority" in incident.detail
    assert HoldTie(Tie(step=40, nodes=["node-0", "node-1"], attempt=2)) in actions


EVIDENCE = TieEvidence(step=40, last_good_step=30, group="shard 0/2", values={0: "a1", 2: "b2"},
                       nodes={"node-0": [0, 1], "node-1": [2, 3]})


def test_a_tie_its_replay_settles_names_the_node_for_a_spare_and_forgets_the_tie() -> None:
    tie = Tie(step=40, nodes=["node-0", "node-1"], attempt=1, evidence=EVIDENCE)
    settled = TieSettlement(node="node-1", rank=2, why="node-1's ranks computed their loss of step 34 differently")
    seen, actions = observe(Seen(watched=2), committed(None, tie=tie, settled=settled))
    incident = seen.incident
    assert incident is not None and incident.kind is IncidentKind.SILENT_DATA_CORRUPTION
    assert (incident.node, incident.rank, incident.bad_step) == ("node-1", 2, None), incident
    assert "node-1 computes wrong" in incident.detail and "step 34" in incident.detail
    assert ForgetTie() in actions and seen.ending(paused=False) is not None
    decision = decide(incident.kind, incident.node, SPEC, NODES, ["spare-0"], RecoveryBudget(), now=1000.0)
    assert (decision.action, decision.replacement, decision.cordon) == (Action.REPLACE_NODE, "spare-0", True)


def test_a_tie_its_replay_cannot_settle_waits_for_the_fault_to_come_back() -> None:
    tie = Tie(step=40, nodes=["node-0", "node-1"], attempt=1, evidence=EVIDENCE)
    seen, actions = observe(Seen(watched=2), committed(None, tie=tie, settled=TieSettlement(why="not deterministic")))
    assert seen.incident is None
    assert HoldTie(tie.model_copy(update={"evidence": None})) in actions


def test_a_tie_found_beside_another_incident_is_not_held() -> None:
    crash = Incident(kind=IncidentKind.CRASH, node="node-0", rank=0, attempt=2)
    seen, actions = observe(Seen(watched=2, incident=crash), committed(TIED))
    assert seen.incident is crash and not any(isinstance(a, HoldTie) for a in actions)


def test_a_tie_back_on_the_same_two_nodes_sets_the_higher_ranks_node_aside() -> None:
    tie = Tie(step=40, nodes=["node-0", "node-1"], attempt=1)
    seen, actions = observe(Seen(watched=2), committed(TIED, tie=tie))
    incident = seen.incident
    assert incident is not None and (incident.node, incident.rank) == ("node-1", 2), incident
    assert "to tell which" in incident.detail and incident.bad_step == 31
    assert HoldTie(tie.model_copy(update={"swapped_out": "node-1", "attempt": 2})) in actions
    decision = decide(incident.kind, incident.node, SPEC, NODES, ["spare-0"], RecoveryBudget(), now=1000.0,
                      suspect=True)
    assert (decision.action, decision.replacement, decision.cordon, decision.hold) == (
        Action.REPLACE_NODE, "spare-0", False, True)
    no_spare = decide(incident.kind, incident.node, SPEC, NODES, [], RecoveryBudget(), now=1000.0, suspect=True)
    assert no_spare.action is Action.RESTART and "no spare" in no_spare.reason


def test_a_tie_back_on_the_node_kept_names_it() -> None:
    tie = Tie(step=40, nodes=["node-0", "node-1"], attempt=2, swapped_out="node-1")
    again = CorruptionVerdict(step=30, last_good_step=20, ranks=[0, 2], nodes={0: "node-0", 2: "spare-0"},
                              certain=False, group="shard 0/2")
    seen, actions = observe(Seen(watched=2), committed(again, tie=tie, attempt=3))
    incident = seen.incident
    assert incident is not None and (incident.node, incident.rank) == ("node-0", 0), incident
    assert "node-0 computes wrong" in incident.detail and ForgetTie() in actions
    decision = decide(incident.kind, incident.node, SPEC, NODES, ["node-1"], RecoveryBudget(), now=1000.0)
    assert (decision.action, decision.replacement, decision.cordon) == (Action.REPLACE_NODE, "node-1", True)


@pytest.mark.parametrize(("tie", "steps", "resumed", "expected"), [
    # set aside, and verified two fingerprints (10 steps each) past the restore and past step 40: node-1 is sick
    (Tie(step=40, nodes=["node-0", "node-1"], attempt=2, swapped_out="node-1"), [50], 30, "cordon"),
    # too early: a flip after the attempt's first fingerprint shows only at its second
    (Tie(step=40, nodes=["node-0", "node-1"], attempt=2, swapped_out="node-1"), [45], 30, None),
    (Tie(step=40, nodes=["node-0", "node-1"], attempt=2, swapped_out="node-1"), [40], 30, None),
    # a one-off: never back, nobody to blame
    (Tie(step=40, nodes=["node-0", "node-1"], attempt=2), [60], 30, "forget"),
    # the attempt that found it says nothing of it coming back
    (Tie(step=40, nodes=["node-0", "node-1"], attempt=3), [60], 30, None),
])
def test_a_tie_that_does_not_come_back_names_the_node_set_aside_or_nobody(
        tie: Tie, steps: list[int], resumed: int, expected: str | None) -> None:
    event = committed(None, tie=tie, attempt=3, steps=steps, resumed_step=resumed)
    seen, actions = observe(Seen(watched=2), event)
    assert seen.incident is None  # training goes on either way
    cordoned = [a for a in actions if isinstance(a, CordonSpare)]
    reported = [a.incident for a in actions if isinstance(a, RecordIncident)]
    if expected == "cordon":
        assert [c.node for c in cordoned] == ["node-1"] and ForgetTie() in actions
        assert [(i.node, i.action) for i in reported] == [("node-1", Action.REPORT)]
        assert "not since node-1 left the run" in reported[0].detail
    elif expected == "forget":
        assert ForgetTie() in actions and not cordoned and not reported
    else:
        assert ForgetTie() not in actions and not cordoned


def test_two_differing_replicas_on_one_node_name_it() -> None:
    verdict = CorruptionVerdict(step=40, ranks=[0, 1], nodes={0: "node-0", 1: "node-0"}, certain=False,
                                group="replicated")
    seen, actions = observe(Seen(watched=2), committed(verdict))
    assert seen.incident is not None and seen.incident.node == "node-0"
    assert not any(isinstance(a, HoldTie) for a in actions)


def test_no_verdict_no_incident() -> None:
    seen, _ = observe(Seen(watched=2), committed(None))
    assert seen.incident is None


def test_a_numerical_fault_from_a_watch_is_the_incident_with_its_step() -> None:
    event = WatchEvent(kind=WatchEventKind.NUMERICAL_FAULT, node="node-1", rank=3, detected_at=100.0, fault_at=99.0,
                       occurred_at=99.0, fault_step=57, detail="rank 3 at step 57: loss is nan")
    seen, actions = observe(Seen(watched=2), Reported([(1, NodeGroupWatchResult(incidents=[event]))], attempt=2,
                                                      launching=False, now=100.0))
    seen, _ = observe(seen, Settled(frozenset()))
    incident = seen.incident
    assert incident is not None and incident.kind is IncidentKind.NUMERICAL_FAULT
    assert (incident.node, incident.rank, incident.bad_step, incident.detection_s) == ("node-1", 3, 57, 1.0)


def test_of_several_numerical_faults_the_one_a_rank_saw_first_is_the_incident() -> None:
    # A NaN on node-1's rank 3 at step 57 reached node-0's ranks through the all-reduce: their losses are NaN from
    # step 58, and node-0's watch happened to report first. The rollback must go past step 57.
    def fault(node: str, rank: int, step: int, occurred: float, detected: float) -> WatchEvent:
        return WatchEvent(kind=WatchEventKind.NUMERICAL_FAULT, node=node, rank=rank, detected_at=detected,
                          occurred_at=occurred, fault_step=step, detail=f"rank {rank} at step {step}: loss is nan")

    results = [(0, NodeGroupWatchResult(incidents=[fault("node-0", 0, 58, 101.0, 101.5)])),
               (1, NodeGroupWatchResult(incidents=[fault("node-1", 3, 57, 100.5, 102.0)]))]
    seen, _ = observe(Seen(watched=2), Reported(results, attempt=2, launching=False, now=102.0))
    seen, _ = observe(seen, Settled(frozenset()))
    assert seen.incident is not None and (seen.incident.rank, seen.incident.bad_step) == (3, 57)


# ------------------------------------------------------------------------------------------------ the policy
SPEC = parse_spec({"entrypoint": ["python", "train.py"], "nodes": NODES, "spare_nodes": ["spare-0"]})


@pytest.mark.parametrize(("kind", "node", "budget", "action", "fragment"), [
    (IncidentKind.SILENT_DATA_CORRUPTION, "node-1", RecoveryBudget(), Action.REPLACE_NODE, "replaced by spare"),
    (IncidentKind.SILENT_DATA_CORRUPTION, None, RecoveryBudget(), Action.RESTART, "relaunch"),
    (IncidentKind.NUMERICAL_FAULT, "node-1", RecoveryBudget(), Action.RESTART, "relaunch"),
    (IncidentKind.NUMERICAL_FAULT, "node-1", RecoveryBudget(numerical_recurs=True), Action.STOP,
     "the data or the hyper-parameters"),
])
def test_policy(kind: IncidentKind, node: str | None, budget: RecoveryBudget, action: Action, fragment: str) -> None:
    decision = decide(kind, node, SPEC, NODES, ["spare-0"], budget, now=1000.0)
    assert decision.action is action and fragment in decision.reason
    if action is Action.REPLACE_NODE:
        assert decision.cordon and decision.replacement == "spare-0"


def fault(attempt: int, step: int | None, kind: IncidentKind = IncidentKind.NUMERICAL_FAULT,
          action: Action = Action.RESTART) -> Incident:
    return Incident(kind=kind, attempt=attempt, bad_step=step, action=action)


@pytest.mark.parametrize(("earlier", "recurs"), [
    ([], False),
    ([fault(1, 57)], True),
    ([fault(1, 56)], False),  # another step: another fault
    ([fault(1, 57, IncidentKind.CRASH)], False),
    ([fault(1, 57), fault(2, None, IncidentKind.STRAGGLER, Action.REPORT)], True),  # only reported in between
    ([fault(0, 57)], False),  # not the previous attempt
])
def test_numerical_fault_recurs(earlier: list[Incident], recurs: bool) -> None:
    assert numerical_fault_recurs(fault(2, 57), earlier) is recurs
