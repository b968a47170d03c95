"""Silent data corruption and numerical faults in the run's pure rules: the incident the supervision reducer makes of
a committer's corruption verdict and of a watch's numerical fault (`workflows.supervision`), and what the policy
decides about each (`workflows.policy`)."""

from __future__ import annotations

import pytest

from activities.fingerprint_models import CorruptionVerdict
from activities.models import WatchEvent, WatchEventKind
from trainguard.models import Action, Incident, IncidentKind
from trainguard.spec import parse_spec
from workflows.node_group_models import NodeGroupWatchResult
from workflows.policy import RecoveryBudget, decide, numerical_fault_recurs
from workflows.supervision import Seen, observe
from workflows.supervision_events import Committed, Reported, Settled

NODES = ["node-0", "node-1"]


def committed(verdict: CorruptionVerdict | None, flipped_at: dict[str, float] | None = None) -> Committed:
    return Committed(steps=[], pace=None, store_error=None, attempt=2, now=200.0, draining=False, may_grow=False,
                     streaks={}, slow_window_end=0.0, straggler_windows=2, have_spare=True, nodes=NODES,
                     ranks_per_node=2, corruption=verdict, flipped_at=flipped_at or {})


def test_an_outvoted_replica_ends_the_attempt_naming_its_rank_and_node() -> None:
    verdict = CorruptionVerdict(step=40, last_good_step=30, ranks=[2], nodes={2: "node-1"}, certain=True,
                                group="replicated")
    seen, _ = observe(Seen(watched=2), committed(verdict, flipped_at={"node-1": 197.5}))
    incident = seen.incident
    assert incident is not None and incident.kind is IncidentKind.SILENT_DATA_CORRUPTION
    assert (incident.node, incident.rank, incident.bad_step, incident.detection_s) == ("node-1", 2, 31, 2.5)
    assert "rank 2 (node-1)" in incident.detail and "step 40" in incident.detail
    assert seen.ending(paused=False) is not None


def test_two_replicas_that_differ_blame_no_node() -> None:
    verdict = CorruptionVerdict(step=40, last_good_step=-1, ranks=[0, 2], nodes={0: "node-0", 2: "node-1"},
                                certain=False, group="shard 0/2")
    seen, _ = observe(Seen(watched=2), committed(verdict))
    incident = seen.incident
    assert incident is not None and incident.node is None and incident.bad_step == 40
    assert "no majority" in incident.detail


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
