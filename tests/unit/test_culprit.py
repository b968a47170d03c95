"""The culprit rule: which rank caused a hang, from every rank's evidence (table-tested, no processes)."""

from __future__ import annotations

import pytest

from activities.evidence import innermost_frames
from activities.models import RankEvidence
from activities.progress import RankReport, find_hung_rank
from trainguard.evidence import fault_name, mode_of
from trainguard.spec import HealthSpec
from workflows.culprit import pick_culprit


def ev(rank: int, state: str = "S", entered: int | None = 20, completed: int | None = 18,
       inside: bool | None = True, answered: bool = True, where: str = "") -> RankEvidence:
    return RankEvidence(node=f"node-{rank // 2}", rank=rank, state=state, answered=answered,
                        collectives_enqueued=entered, collectives_completed=completed, in_collective=inside,
                        collective="gloo:all_reduce", innermost=where or f"w{rank}")


CASES = [
    # (name, evidence, the watch's pick, culprit, rule)
    ("stopped rank, even inside a collective", [ev(0), ev(1), ev(2, "T"), ev(3)], 0, 2, "process-state"),
    ("uninterruptible I/O", [ev(0), ev(1, "D", inside=False), ev(2), ev(3)], 3, 1, "process-state"),
    ("not inside while peers are", [ev(0), ev(1), ev(2), ev(3, entered=18, inside=False)], 0, 3,
     "outside-collective"),
    ("two outside: the one behind", [ev(0), ev(1, entered=19, inside=False), ev(2, entered=18, inside=False),
                                     ev(3)], 0, 2, "outside-collective"),
    ("all inside (async completion lags): behind in sequence", [ev(0), ev(1, entered=19), ev(2), ev(3)], 0, 1,
     "behind-in-sequence"),
    ("alone without an answer while peers wait inside",
     [ev(0), ev(1), ev(2, answered=False, entered=None, completed=None, inside=None), ev(3)], 0, 2, "no-answer"),
    ("nothing tells them apart: the watch's pick", [ev(0), ev(1), ev(2), ev(3)], 1, 1, "silent-longest"),
    ("no Flight Recorder, all sleep: the watch's pick",
     [ev(r, entered=None, completed=None, inside=None) for r in range(4)], 2, 2, "silent-longest"),
    ("an exited rank is no culprit", [ev(0, "exited", inside=False), ev(1), ev(2, entered=19), ev(3)], 0, 2,
     "behind-in-sequence"),
    ("equal candidates: the watch's pick among them", [ev(0, inside=False), ev(1), ev(2, inside=False), ev(3)], 2,
     2, "outside-collective"),
]


@pytest.mark.parametrize(("evidence", "watched", "culprit", "rule"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_pick_culprit(evidence: list[RankEvidence], watched: int, culprit: int, rule: str) -> None:
    found = pick_culprit(evidence, watched, f"node-{watched // 2}")
    assert (found.rank, found.rule) == (culprit, rule)
    assert found.node == f"node-{culprit // 2}"
    assert found.evidence.startswith(f"rank {culprit} ") and f"w{culprit}" in found.evidence


def test_pick_culprit_names_where_the_peers_wait() -> None:
    found = pick_culprit([ev(0, where="graph.py:979 in _engine_run_backward < train.py:143 in main"),
                          ev(1, entered=19, inside=False, where="evidence.py:250 in hang_in_python")], 0, "node-0")
    first, second = found.evidence.splitlines()
    assert "hang_in_python" in first
    assert "1 of 1 peers wait inside gloo:all_reduce #20" in second and "_engine_run_backward" in second


def test_pick_culprit_without_any_evidence_keeps_the_watchs_rank() -> None:
    found = pick_culprit([], 3, "node-1")
    assert (found.rank, found.node, found.rule) == (3, "node-1", "silent-longest")


DUMP = """Thread 0x00007f7bb93266c0 (most recent call first):
  File "/work/trainguard/evidence.py", line 205 in _answer_requests
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f7bda46db80 (most recent call first):
  File "/work/trainguard/evidence.py", line 248 in hang_in_python
  File "/work/trainguard/rank.py", line 197 in step_done
  File "/work/examples/train.py", line 157 in main
  File "/work/examples/train.py", line 180 in <module>
"""


def test_innermost_frames_shows_the_main_threads_innermost_and_the_script_frame_calling_it() -> None:
    assert innermost_frames(DUMP) == "evidence.py:248 in hang_in_python < train.py:157 in main"
    assert innermost_frames("") == ""


def test_hang_modes_map_to_fault_names_and_back() -> None:
    assert [fault_name(m) for m in ("stop", "python", "skip-collective", "io")] == [
        "hang", "hang-python", "hang-skip-collective", "hang-io"]
    assert [mode_of(f) for f in ("hang", "hang-io", "hang-nope", "crash")] == ["stop", "io", None, None]
    with pytest.raises(ValueError, match="expected one of"):
        fault_name("spin")


def test_without_the_collective_grace_a_sleeping_rank_is_hung_at_its_bound() -> None:
    health = HealthSpec(hang_floor_s=2.0)
    reports = {0: RankReport(rank=0, step=10, time=100.0, step_time_s=0.1)}
    assert find_hung_rank(reports, {0}, 0, 0.0, 102.5, health, {0: "S"}) is None  # grace: 3 s
    assert find_hung_rank(reports, {0}, 0, 0.0, 102.5, health, {0: "S"}, grace_s=0.0) == (0, 2.5)


def test_run_report_prints_each_hangs_evidence_and_every_ranks_stored_stacks() -> None:
    from trainguard.models import Incident, IncidentKind
    from trainguard.report import render_stacks

    hang = Incident(kind=IncidentKind.HANG, node="node-1", rank=3, attempt=2,
                    evidence="rank 3 is not inside a collective\n3 of 3 peers wait inside gloo:all_reduce #9",
                    evidence_key="s3://trainguard/runs/r/incidents/2/")
    asked: list[str] = []

    def read(url: str) -> list[tuple[str, str]]:
        asked.append(url)
        return [("runs/r/incidents/2/rank-00003.txt", "rank 3 on node-1\n  File \"train.py\", line 9 in main\n")]

    text = render_stacks([(4, hang)], read)
    assert asked == ["s3://trainguard/runs/r/incidents/2/"]
    assert "incident 4: hang, culprit rank 3 on node-1" in text
    assert "  3 of 3 peers wait inside gloo:all_reduce #9" in text
    assert "--- runs/r/incidents/2/rank-00003.txt" in text and 'line 9 in main' in text

    def down(url: str) -> list[tuple[str, str]]:
        raise OSError("store unreachable")

    assert "stacks not readable: store unreachable" in render_stacks([(1, hang)], down)


def test_a_stopped_rank_without_stacks_is_said_to_be_stopped_not_at_no_stacks() -> None:
    stopped = RankEvidence(rank=1, node="node-1", state="T", answered=False)
    waiting = RankEvidence(rank=0, node="node-0", state="S", answered=True, in_collective=True, collective="allreduce",
                           collectives_enqueued=7, innermost="train.py:88 in step")
    culprit = pick_culprit([waiting, stopped], fallback_rank=0, fallback_node="node-0")
    assert culprit.rank == 1 and culprit.rule == "process-state"
    first = culprit.evidence.splitlines()[0]
    assert first == "rank 1 is stopped (a process that is stopped cannot give its stacks)", first
