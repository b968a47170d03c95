"""The pure policy of a `TrainingRun`: what to do about an incident, and which phase may follow which."""

from __future__ import annotations

import pytest

from trainguard.models import Action, CheckpointRef, Incident, IncidentKind, Phase
from trainguard.spec import RunSpec, parse_spec
from workflows.policy import (
    ALLOWED_TRANSITIONS,
    STRAGGLER_REPLACE_EVERY_S,
    IllegalTransition,
    RecoveryBudget,
    classify_exit,
    decide,
    may_change_world_size,
    next_phase,
    same_failure_streak,
)

NOW = 1_000_000.0
NODES = ["node-0", "node-1"]


def _spec(max_restarts: int = 3, window_s: float = 600.0, without_checkpoint: int = 2) -> RunSpec:
    return parse_spec({
        "entrypoint": ["python", "train.py"],
        "nodes": NODES,
        "spare_nodes": ["spare-0"],
        "restarts": {"max_restarts": max_restarts, "window_s": window_s,
                     "max_restarts_without_checkpoint": without_checkpoint},
    })


DECIDE_CASES = [
    # kind, node, spares, budget, expected action, fragment of the reason, replacement (persisted=False)
    pytest.param(IncidentKind.USER_ERROR, "node-0", ["spare-0"], RecoveryBudget(), Action.STOP,
                 "code 78", None, id="user-error-stops"),
    pytest.param(IncidentKind.USER_ERROR, "node-0", [], RecoveryBudget((NOW - 1,) * 9, 9), Action.STOP,
                 "fix the script", None, id="user-error-stops-whatever-the-budget"),
    pytest.param(IncidentKind.CRASH, "node-0", [], RecoveryBudget(), Action.RESTART,
                 "crash: relaunch", None, id="crash-restarts"),
    pytest.param(IncidentKind.HANG, "node-1", [], RecoveryBudget(), Action.RESTART,
                 "hang", None, id="hang-restarts"),
    pytest.param(IncidentKind.CHECKPOINT_CORRUPT, None, [], RecoveryBudget(), Action.RESTART,
                 "checkpoint_corrupt", None, id="corrupt-checkpoint-restarts"),
    pytest.param(IncidentKind.CRASH, "node-0", [], RecoveryBudget((NOW - 30, NOW - 20, NOW - 10)),
                 Action.STOP, "restart budget spent: 3 restarts", None, id="budget-spent-in-window"),
    pytest.param(IncidentKind.CRASH, "node-0", [], RecoveryBudget((NOW - 5000, NOW - 4000, NOW - 10)),
                 Action.RESTART, "relaunch", None, id="old-restarts-outside-window-do-not-count"),
    pytest.param(IncidentKind.CRASH, "node-0", [], RecoveryBudget((NOW - 600, NOW - 20, NOW - 10)),
                 Action.RESTART, "relaunch", None, id="restart-exactly-window-ago-does-not-count"),
    pytest.param(IncidentKind.CRASH, "node-0", [], RecoveryBudget((NOW - 20,), restarts_without_checkpoint=2),
                 Action.STOP, "2 restarts in a row committed no new checkpoint", None,
                 id="restarts-without-checkpoint-limit"),
    pytest.param(IncidentKind.CRASH, "node-0", [], RecoveryBudget((NOW - 20,), restarts_without_checkpoint=1),
                 Action.RESTART, "relaunch", None, id="below-without-checkpoint-limit"),
    pytest.param(IncidentKind.NODE_UNRESPONSIVE, "node-1", ["spare-0", "spare-1"], RecoveryBudget(),
                 Action.REPLACE_NODE, "replaced by spare spare-0", "spare-0", id="unresponsive-with-spare"),
    pytest.param(IncidentKind.GPU_UNHEALTHY, "node-0", ["spare-0"], RecoveryBudget(),
                 Action.REPLACE_NODE, "gpu_unhealthy on node-0", "spare-0", id="bad-gpu-with-spare"),
    pytest.param(IncidentKind.NODE_UNRESPONSIVE, "node-1", [], RecoveryBudget(), Action.PAUSE,
                 "no spare node left: paused for an operator", None, id="unresponsive-without-spare-pauses"),
    pytest.param(IncidentKind.GPU_UNHEALTHY, "node-0", [], RecoveryBudget(), Action.PAUSE,
                 "gpu_unhealthy on node-0 and no spare node left", None, id="bad-gpu-without-spare-pauses"),
    pytest.param(IncidentKind.NODE_UNRESPONSIVE, "node-9", [], RecoveryBudget(), Action.RESTART,
                 "no longer in the run", None, id="unresponsive-node-already-gone"),
    pytest.param(IncidentKind.NODE_UNRESPONSIVE, "node-1", ["spare-0"], RecoveryBudget((NOW - 1,) * 3),
                 Action.STOP, "restart budget spent", None, id="budget-checked-before-replacing"),
    pytest.param(IncidentKind.STORAGE_UNAVAILABLE, None, ["spare-0"], RecoveryBudget(), Action.PAUSE,
                 "checkpoint store unreachable", None, id="store-down-at-restore-pauses"),
    pytest.param(IncidentKind.STRAGGLER, "node-0", [], RecoveryBudget((NOW - 1,) * 3, 5), Action.REPORT,
                 "training goes on", None, id="straggler-only-reported"),
]


@pytest.mark.parametrize(("kind", "node", "spares", "budget", "action", "reason", "replacement"),
                         DECIDE_CASES)
def test_decide(kind: IncidentKind, node: str | None, spares: list[str], budget: RecoveryBudget,
                action: Action, reason: str, replacement: str | None) -> None:
    decision = decide(kind, node, _spec(), NODES, spares, budget, NOW)

    assert decision.action is action
    assert reason in decision.reason
    assert decision.replacement == replacement


@pytest.mark.parametrize(
    ("node", "spares", "action", "replacement"),
    [
        pytest.param("node-1", ["spare-0"], Action.REPLACE_NODE, "spare-0",
                     id="persisted-with-spare-replaced"),
        pytest.param("node-1", [], Action.REPORT, None, id="persisted-without-spare-reported"),
        pytest.param("node-9", ["spare-0"], Action.REPORT, None, id="persisted-on-node-not-in-run-reported"),
    ],
)
def test_persisting_straggler(node: str, spares: list[str], action: Action, replacement: str | None) -> None:
    decision = decide(IncidentKind.STRAGGLER, node, _spec(), NODES, spares, RecoveryBudget(), NOW,
                      persisted=True)

    assert decision.action is action
    assert decision.replacement == replacement


@pytest.mark.parametrize(
    ("kind", "nodes", "min_nodes", "spares", "action"),
    [
        pytest.param(IncidentKind.NODE_UNRESPONSIVE, ["node-0", "node-1", "node-2"], 2, [], Action.SHRINK,
                     id="lost-node-shrinks-to-min"),
        pytest.param(IncidentKind.GPU_UNHEALTHY, ["node-0", "node-1"], 1, [], Action.SHRINK,
                     id="bad-gpu-shrinks-to-one-node"),
        pytest.param(IncidentKind.NODE_UNRESPONSIVE, ["node-0", "node-1"], 2, [], Action.PAUSE,
                     id="already-at-min-pauses"),
        pytest.param(IncidentKind.NODE_UNRESPONSIVE, ["node-0", "node-1"], 1, ["spare-0"], Action.REPLACE_NODE,
                     id="a-spare-comes-before-shrinking"),
        pytest.param(IncidentKind.CRASH, ["node-0", "node-1"], 1, [], Action.RESTART,
                     id="a-crash-never-shrinks"),
    ],
)
def test_shrink_to_min_nodes(kind: IncidentKind, nodes: list[str], min_nodes: int, spares: list[str],
                             action: Action) -> None:
    spec = parse_spec({"entrypoint": ["python", "train.py"], "nodes": ["node-0", "node-1", "node-2"],
                       "min_nodes": min_nodes})

    decision = decide(kind, "node-1", spec, nodes, spares, RecoveryBudget(), NOW)

    assert decision.action is action, decision.reason
    if action is Action.SHRINK:
        assert f"continue on {len(nodes) - 1} nodes" in decision.reason


def _ref(reshardable: bool, world_size: int = 3) -> CheckpointRef:
    return CheckpointRef(step=40, manifest_key="runs/r/step-00000040/manifest.json", bucket="b",
                         world_size=world_size, reshardable=reshardable)


@pytest.mark.parametrize(
    ("kind", "spares", "newest", "action"),
    [
        pytest.param(IncidentKind.NODE_UNRESPONSIVE, [], _ref(False), Action.PAUSE,
                     id="lost-node-pauses-rather-than-shrink-onto-a-torch-save-of-dtensors"),
        pytest.param(IncidentKind.GPU_UNHEALTHY, [], _ref(False), Action.PAUSE, id="bad-gpu-too"),
        pytest.param(IncidentKind.NODE_UNRESPONSIVE, [], _ref(True), Action.SHRINK, id="a-dcp-checkpoint-shrinks"),
        pytest.param(IncidentKind.NODE_UNRESPONSIVE, [], None, Action.SHRINK,
                     id="no-checkpoint-yet-shrinks-and-starts-fresh"),
        pytest.param(IncidentKind.NODE_UNRESPONSIVE, ["spare-0"], _ref(False), Action.REPLACE_NODE,
                     id="a-spare-keeps-the-world-size"),
        pytest.param(IncidentKind.CRASH, [], _ref(False), Action.RESTART, id="a-crash-restarts-in-place"),
    ],
)
def test_a_checkpoint_that_cannot_be_resharded_is_never_shrunk_onto(
        kind: IncidentKind, spares: list[str], newest: CheckpointRef | None, action: Action) -> None:
    spec = parse_spec({"entrypoint": ["python", "train.py"], "nodes": ["node-0", "node-1", "node-2"],
                       "min_nodes": 1})

    decision = decide(kind, "node-1", spec, ["node-0", "node-1", "node-2"], spares, RecoveryBudget(), NOW,
                      newest=newest)

    assert decision.action is action, decision.reason
    if action is Action.PAUSE:
        # Why, and what to do about it.
        assert "the newest checkpoint (step 40) is a per-rank torch.save of sharded tensors" in decision.reason
        assert "written by 3 ranks, which cannot be resharded onto 2" in decision.reason
        assert "`resume`" in decision.reason and 'checkpoint_format="auto"' in decision.reason


def test_a_run_grows_back_only_onto_a_checkpoint_that_reshards() -> None:
    assert may_change_world_size(None)
    assert may_change_world_size(_ref(True))
    assert not may_change_world_size(_ref(False))


def test_zero_restart_budget_stops_on_the_first_crash() -> None:
    decision = decide(IncidentKind.CRASH, "node-0", _spec(max_restarts=0), NODES, [], RecoveryBudget(), NOW)

    assert decision.action is Action.STOP
    assert "restarts.max_restarts=0" in decision.reason


@pytest.mark.parametrize(
    ("exit_code", "kind"),
    [(78, IncidentKind.USER_ERROR), (1, IncidentKind.CRASH), (-9, IncidentKind.CRASH),
     (0, IncidentKind.CRASH), (None, IncidentKind.CRASH), (137, IncidentKind.CRASH)],
)
def test_classify_exit(exit_code: int | None, kind: IncidentKind) -> None:
    assert classify_exit(exit_code) is kind


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (Phase.VALIDATING, Phase.RESERVING),
        (Phase.RESERVING, Phase.RESTORING),
        (Phase.RESTORING, Phase.LAUNCHING),
        (Phase.RESTORING, Phase.RESTORING),
        (Phase.LAUNCHING, Phase.RUNNING),
        (Phase.RUNNING, Phase.RECOVERING),
        (Phase.RECOVERING, Phase.RESTORING),
        (Phase.RUNNING, Phase.FINISHING),
        (Phase.FINISHING, Phase.COMPLETED),
        (Phase.RUNNING, Phase.FAILED),
        (Phase.RUNNING, Phase.PAUSED),
        (Phase.RECOVERING, Phase.PAUSED),
        (Phase.PAUSED, Phase.RESTORING),
        (Phase.PAUSED, Phase.FAILED),
    ],
)
def test_next_phase_allows(current: Phase, new: Phase) -> None:
    assert next_phase(current, new) is new


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (Phase.COMPLETED, Phase.RUNNING),
        (Phase.FAILED, Phase.RESTORING),
        (Phase.COMPLETED, Phase.FAILED),
        (Phase.VALIDATING, Phase.LAUNCHING),
        (Phase.RUNNING, Phase.COMPLETED),
        (Phase.RECOVERING, Phase.RUNNING),
        (Phase.PAUSED, Phase.RUNNING),
        (Phase.PAUSED, Phase.COMPLETED),
    ],
)
def test_next_phase_refuses(current: Phase, new: Phase) -> None:
    with pytest.raises(IllegalTransition, match=f"phase {current.value} cannot move to {new.value}"):
        next_phase(current, new)


def test_every_phase_has_a_row_and_only_terminal_phases_are_dead_ends() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(Phase)
    dead_ends = {phase for phase, allowed in ALLOWED_TRANSITIONS.items() if not allowed}
    assert dead_ends == {Phase.COMPLETED, Phase.FAILED}
    assert all(Phase.FAILED in allowed for phase, allowed in ALLOWED_TRANSITIONS.items() if allowed)


SIG = "train.py:142 in main: ValueError: loss is nan"


def _crash(attempt: int, signature: str | None = SIG, kind: IncidentKind = IncidentKind.CRASH,
           action: Action = Action.RESTART) -> Incident:
    return Incident(kind=kind, attempt=attempt, signature=signature, action=action)


@pytest.mark.parametrize(
    ("earlier", "incident", "streak"),
    [
        pytest.param([], _crash(1), 1, id="first-crash-with-a-traceback"),
        pytest.param([_crash(1)], _crash(2), 2, id="same-failure-next-attempt"),
        pytest.param([_crash(1), _crash(2)], _crash(3), 3, id="three-in-a-row"),
        pytest.param([_crash(1, "other.py:1 in f: KeyError: 'x'")], _crash(2), 1, id="another-failure"),
        pytest.param([_crash(1), _crash(2, kind=IncidentKind.HANG, signature=None)], _crash(3), 1,
                     id="a-hang-in-between-breaks-it"),
        pytest.param([_crash(1)], _crash(3), 1, id="not-consecutive-attempts"),
        pytest.param([_crash(1), _crash(1, kind=IncidentKind.STRAGGLER, signature=None, action=Action.REPORT)],
                     _crash(2), 2, id="a-reported-straggler-is-skipped"),
        pytest.param([_crash(1)], _crash(2, signature=None), 0, id="killed-by-a-signal-has-no-signature"),
        pytest.param([_crash(1)], _crash(2, kind=IncidentKind.HANG), 0, id="only-crashes-count"),
    ],
)
def test_same_failure_streak(earlier: list[Incident], incident: Incident, streak: int) -> None:
    assert same_failure_streak(incident, earlier) == streak


@pytest.mark.parametrize(
    ("limit", "attempts", "action"),
    [
        pytest.param(2, 1, Action.RESTART, id="first-time-relaunches"),
        pytest.param(2, 2, Action.STOP, id="second-time-stops"),
        pytest.param(0, 5, Action.RESTART, id="zero-never-stops-for-it"),
    ],
)
def test_the_same_failure_again_stops_the_run_before_the_budget_is_spent(limit: int, attempts: int,
                                                                          action: Action) -> None:
    spec = parse_spec({"entrypoint": ["python", "train.py"], "nodes": NODES,
                       "restarts": {"max_same_failure": limit}})
    decision = decide(IncidentKind.CRASH, "node-0", spec, NODES, [], RecoveryBudget(same_failure_attempts=attempts),
                      NOW)
    assert decision.action is action
    if action is Action.STOP:
        assert f"the same failure on {attempts} attempts in a row" in decision.reason


# ---------------------------------------------------------- issue 40 finding 10: a rank's own figures, bounded
def _replacing_stragglers(every_s: float, times: int) -> list[tuple[Action, bool]]:
    """A script that reports one rank slow for ever, judged persisted every `every_s`: each decision's action and
    whether it cordons the node in the pool. Spares as many as it takes; each replacement swaps one in."""
    nodes, spares = list(NODES), [f"spare-{i}" for i in range(times)]
    replaced_at: list[float] = []
    decisions = []
    for index in range(times):
        now = NOW + index * every_s
        decision = decide(IncidentKind.STRAGGLER, nodes[1], _spec(), nodes, spares,
                          RecoveryBudget(straggler_replaced_at=tuple(replaced_at)), now, persisted=True)
        decisions.append((decision.action, decision.action is Action.REPLACE_NODE and decision.cordon))
        if decision.action is Action.REPLACE_NODE:
            replaced_at.append(now)
            nodes[1] = spares.pop(0)
    return decisions


def test_a_script_reporting_its_rank_slow_cannot_cordon_a_node_per_spare() -> None:
    """Issue 40 finding 10: a rank's own `compute_s` drove straggler replacement and a pool-wide cordon, so a
    script could cordon as many healthy nodes as it had spares, one every few windows."""
    decisions = _replacing_stragglers(every_s=60.0, times=4)

    assert decisions[0] == (Action.REPLACE_NODE, False)  # moved off this run; the pool keeps the node
    assert decisions[1:] == [(Action.REPORT, False)] * 3  # one replacement per STRAGGLER_REPLACE_EVERY_S


def test_straggler_replacements_never_outnumber_the_runs_own_nodes() -> None:
    decisions = _replacing_stragglers(every_s=STRAGGLER_REPLACE_EVERY_S, times=4)

    assert [action for action, _ in decisions] == [Action.REPLACE_NODE] * len(NODES) + [Action.REPORT] * 2
    assert not any(cordon for _, cordon in decisions)


def test_a_node_fault_still_cordons_its_node() -> None:
    decision = decide(IncidentKind.GPU_UNHEALTHY, "node-1", _spec(), NODES, ["spare-0"], RecoveryBudget(), NOW)
    assert (decision.action, decision.cordon) == (Action.REPLACE_NODE, True)
