"""What a replica-group run's ranks log (examples/train_ft.py --log-steps), read from a stack's node folders (the
benchmark's readers, infra/bench/groups.py): each step's time, and each rank's final digest."""

from __future__ import annotations

from pathlib import Path

from infra.bench.groups import DIGEST_LINE, rank_logs, steps
from trainguard.client import RunView
from trainguard.models import RunResult

__all__ = ["DIGEST_LINE", "MAX_GAP_S", "check_groups", "group_ready", "longest_gap", "rank_logs", "steps"]

MAX_GAP_S = 2.0
"""Issue 42's bound on a healthy group's longest pause between two steps while another group recovers."""


def longest_gap(text: str) -> float:
    taken = steps(text)
    return max((b - a for (_, a), (_, b) in zip(taken, taken[1:])), default=0.0)


def group_ready(view: RunView, group: int, attempt: int, min_step: int) -> bool:
    if len(view.groups) <= group:
        return False
    status = view.groups[group]
    ranks = [s for s in view.groups[group].rank_steps.values() if s is not None]
    return status.status.attempt == attempt and len(ranks) == 2 and min(ranks) >= min_step


def check_groups(home: Path, run_id: str, result: RunResult, total: int) -> str:
    """Of a run of examples/ft.json where group 1 crashed on node-1 and group 0 lost node-0 to the spare node-3,
    while group 2 on node-2 stepped on: no rank paused longer than `MAX_GAP_S` between two steps; group 2 ran one
    attempt to the last step; each relaunched group's first step was past its checkpoint (healed from a live
    peer); every rank of every group ended on one digest, which this returns."""
    resumed = {i.group: i.resumed_step or 0 for i in result.incidents}
    logs = {g: rank_logs(home, run_id, g) for g in range(3)}
    assert sorted(logs[0]) == [("node-0", 1), ("node-3", 2)] and sorted(logs[1]) == [("node-1", 1), ("node-1", 2)] \
        and sorted(logs[2]) == [("node-2", 1)], {g: sorted(found) for g, found in logs.items()}
    for group, attempts in logs.items():
        for (node, attempt), texts in attempts.items():
            for text in texts:
                assert longest_gap(text) <= MAX_GAP_S, (group, node, attempt, longest_gap(text))
    for text in logs[2][("node-2", 1)]:  # one attempt that steps on to the last step (a step it sat out, it heals)
        taken = [step for step, _ in steps(text)]
        assert taken[-1] == total and all(a < b for a, b in zip(taken, taken[1:])), taken[-5:]
    for group, node in ((0, "node-3"), (1, "node-1")):
        for text in logs[group][(node, 2)]:
            first = steps(text)[0][0]
            assert first > resumed[group] + 1, f"group {group} resumed at {first}: not healed from a live peer"
    finals = [DIGEST_LINE.findall(t) for g, n, a in ((0, "node-3", 2), (1, "node-1", 2), (2, "node-2", 1))
              for t in logs[g][(n, a)]]
    assert len(finals) == 6 and all(finals) and len({d[-1] for d in finals}) == 1, finals
    return finals[0][-1]
