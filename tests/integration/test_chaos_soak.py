"""The chaos soak, CI-sized: about 1.5 minutes of killing the controller, node agents, Temporal and SeaweedFS
under a stream of small runs, on the soak's own private stack (the session `stack` is left alone: the soak
kills and restarts components).

The full soak is `make soak` (`python -m infra.chaos_soak --minutes 10`); this runs the same coroutine with
a shorter chaos phase and two jobs, so it stays under about 3 minutes here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.chaos_soak import COMPONENTS, Job, SoakConfig, run_soak, scan_ranks

pytestmark = pytest.mark.slow

CHAOS_MINUTES = 1.5
JOBS = (Job(60, 10), Job(80, 20))


async def test_runs_survive_killed_controller_agents_and_server(tmp_path: Path) -> None:
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        print(line, flush=True)  # shown by pytest when the test fails

    config = SoakConfig(
        minutes=CHAOS_MINUTES,
        seed=20261129,
        json_path=tmp_path / "soak.json",
        jobs=JOBS,
        step_time=0.1,
        # 6-10 s after the runs recovered from the last kill: each of the four kinds at least once.
        gap_s=(6.0, 10.0),
        first_kill_s=6.0,
        # A run that never finishes fails the test instead of hanging it.
        drain_timeout_s=150.0,
        echo=echo,
        keep_logs=tmp_path / "logs",  # controller, agents, Temporal: for a failure's post-mortem
    )
    report = await run_soak(config)
    log = "\n".join(lines)
    counts = report.counts

    assert report.ok, f"{report.failures}\n{log}\n(stack logs: {tmp_path / 'logs'})"
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


def test_the_sampler_sees_two_attempts_of_a_run_on_one_node(tmp_path: Path) -> None:
    """The duplicate check is not vacuous: stand-in ranks of attempts 1 and 2 of one run on node-1 are
    caught (and attempt 3 alone on another node is only an informational cross-node overlap)."""
    import os
    import signal
    import subprocess
    import sys

    from infra.chaos_soak import RankSampler
    from trainguard import protocol

    home = tmp_path / "home"

    def fake_rank(node: str, attempt: int) -> subprocess.Popen[bytes]:
        checkpoints = home / "nodes" / node / "runs" / "run-x" / "checkpoints"
        env = {**os.environ, protocol.ENV_CHECKPOINT_DIR: str(checkpoints), protocol.ENV_WORKFLOW_ID: "run-x",
               protocol.ENV_NODE: node, protocol.ENV_ATTEMPT: str(attempt), "RANK": "0"}
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                                start_new_session=True)

    procs = [fake_rank("node-1", 1), fake_rank("node-1", 2), fake_rank("node-2", 3)]
    try:
        record = home / "nodes" / "node-1" / "runs" / "run-x" / "ranks.json"
        record.parent.mkdir(parents=True)
        start = Path(f"/proc/{procs[1].pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        protocol.AttemptFile(workflow_id="run-x", attempt=2, master_addr="127.0.0.1", master_port=1, start_step=0,
                             launched_at=0.0, ranks=[protocol.ProcessEntry(procs[1].pid, start, 0)]).write(record)
        sampler = RankSampler(home, clock=lambda: 0.0)
        sampler.sample()
        found = [(d.workflow_id, d.node, d.attempts) for d in sampler.duplicates]
        assert found == [("run-x", "node-1", [1, 2])]
        assert [(m["recorded_attempt"], m["stray_attempts"]) for m in sampler.record_mismatches] == [(2, [1])]
        assert sampler.cross_node_samples == 1

        procs[0].kill()
        procs[0].wait()
        again = RankSampler(home, clock=lambda: 0.0)
        again.sample()
        assert again.duplicates == [] and again.record_mismatches == []
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
