"""The replica-group benchmark's gap measure (infra/bench/groups.py): what it reads from the ranks' step logs."""

from __future__ import annotations

from pathlib import Path

from infra.bench.groups import GroupFault, GroupsRun, _gaps


def _log(home: Path, group: int, node: str, attempt: int, times: list[float]) -> None:
    folder = home / "nodes" / node / "runs" / f"r-group-{group}" / f"attempt-{attempt}" / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rank-0.log").write_text("".join(f"step {i} at {t}\n" for i, t in enumerate(times)))


def test_a_pause_under_way_at_detection_is_split_at_it(tmp_path: Path) -> None:
    # a 2x straggler in group 1 holds group 0 to 2 s steps until it is found at 30.5; group 0's pause from 29 to
    # 31.8 is 1.5 s of the straggler's pace and 1.3 s of the recovery; group 1 is back at 32
    _log(tmp_path, 0, "node-0", 0, [*range(10, 22), 23, 25, 27, 29, 31.8, 32.8, 33.8])
    _log(tmp_path, 1, "node-1", 0, [*range(10, 22), 23, 25, 27, 29])
    _log(tmp_path, 1, "node-4", 1, [32.0, 33.0])
    fault = GroupFault(fault="slow", group=1, node="node-1", injected_at=21.0, detected_at=30.5)
    run = GroupsRun(system="test", faults=[fault])
    _gaps(run, tmp_path, "r")
    assert fault.healthy_step_s == 1.0
    assert fault.healthy_gap_s == 1.3 and fault.gap_ratio == 1.3
    assert fault.undetected_gap_s == 2.0
