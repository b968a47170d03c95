"""The chaos soak, CI-sized: about 1.5 minutes of killing the controller, node agents and the Temporal server
under a stream of small runs, on the soak's own private stack (the session `stack` is left alone: the soak
kills and restarts components).

The full soak is `make soak` (`python -m infra.chaos_soak --minutes 10`); this runs the same coroutine with
a shorter chaos phase and two jobs, so it stays under about 3 minutes here.
"""

from __future__ import annotations

from pathlib import Path

from infra.chaos_soak import COMPONENTS, Job, SoakConfig, run_soak, scan_ranks

CHAOS_MINUTES = 1.5
JOBS = (Job(60, 10), Job(80, 20))


async def test_runs_survive_killed_controller_agents_and_server(tmp_path: Path) -> None:
    lines: list[str] = []
    config = SoakConfig(
        minutes=CHAOS_MINUTES,
        seed=20261129,
        json_path=tmp_path / "soak.json",
        jobs=JOBS,
        step_time=0.1,
        # A kill every 12-16 s once the last one is back: each kind twice in 1.5 minutes, with time between
        # them for a run to notice a lost node (10 s heartbeat timeout) and relaunch.
        gap_s=(12.0, 16.0),
        first_kill_s=6.0,
        # A run that never finishes fails the test instead of hanging it.
        drain_timeout_s=150.0,
        echo=lines.append,
    )
    report = await run_soak(config)
    log = "\n".join(lines)
    counts = report.counts

    assert report.ok, f"{report.failures}\n{log}"
    assert all(counts["kills"][kind] >= 1 for kind in COMPONENTS), log
    assert counts["kill_errors"] == 0, log
    assert counts["runs_started"] >= 2, log
    assert counts["runs_completed"] == counts["runs_started"], log
    assert counts["runs_failed"] == 0 and counts["runs_unfinished"] == 0, log
    assert counts["duplicate_rank_sets"] == 0, log
    assert counts["duplicate_incidents"] == 0, log
    assert counts["checkpoints_lost"] == 0, log
    assert counts["commits_observed"] > 0, log
    assert counts["digest_mismatches"] == 0, log
    assert counts["rank_samples"] > 0, log

    # Nothing is left behind: no process, no stack directory.
    home = Path(report.data["config"]["home"])
    assert report.data["leftovers"] == []
    assert not home.exists()
    assert scan_ranks(home) == []
    assert (tmp_path / "soak.json").exists()
