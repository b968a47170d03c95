"""The hang-evidence channel never lets a rank choose what the agent (root) reads or writes (issue 40 finding 1).

A rank owns its `evidence/` folder and writes its own progress file. The agent asks it for stacks and a position
only at the paths it set in the rank's environment at launch (the launching attempt's, for a rank carried alive
through an in-process restart), opens nothing there through a link, keeps its own copy of the stacks in a folder
the rank cannot write, and sends the store only redacted stacks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from activities.evidence import EvidenceActivities, ask_positions, collect_local, evidence_env
from activities.rank_records import AttemptRecord, RankBook, RankProcess
from trainguard import protocol
from trainguard.procs import start_time
from trainguard.protocol import RunLayout

AGENT_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY"
"""Stands in for the S3 secret in the agent's starting environment (`/proc/<agent>/environ`)."""

# A rank with the helper's evidence channel: a heartbeat every 20 ms, nothing else.
HELPER_RANK = """
import time
from trainguard import rank as tg
run = tg.init()
step = 0
while True:
    step += 1
    run.step_done(step)
    time.sleep(0.02)
"""


def _spawn(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for popen in started:
        if popen.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()


def _quiet_rank(tmp_path: Path, processes: list[subprocess.Popen[bytes]], claims: str) -> tuple[RunLayout,
                                                                                                 AttemptRecord]:
    """Rank 0 of attempt 1, a process without a helper whose progress file names `claims` as its evidence."""
    layout = RunLayout.of(tmp_path / "agent", "wf")
    layout.progress_dir(1).mkdir(parents=True)
    (layout.attempt_dir(1) / "evidence").mkdir()
    popen = _spawn(["sleep", "60"])
    processes.append(popen)
    protocol.Progress(rank=0, step=3, time=time.time(), pid=popen.pid, evidence=claims).write(
        layout.progress_file(1, 0))
    record = AttemptRecord("wf", 1, "127.0.0.1", 1, 0, time.time())
    record.ranks[0] = RankProcess(0, popen.pid, start_time(popen.pid), popen)
    return layout, record


def test_the_agent_never_writes_or_reads_where_a_ranks_progress_file_points(
        tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    elsewhere = tmp_path / "root-only"
    elsewhere.mkdir(mode=0o700)
    claimed = elsewhere / "victim"
    Path(f"{claimed}.stacks").write_text("THE ROOT-ONLY FILE'S TEXT\n")
    Path(f"{claimed}.answer.json").write_text(json.dumps({"request": "x"}))
    layout, record = _quiet_rank(tmp_path, processes, claims=str(claimed))

    found, texts = collect_local("node-0", layout, record)
    asked = ask_positions(layout, record, {0})

    assert not Path(f"{claimed}.request").exists()  # root created nothing in a folder the rank chose
    assert "ROOT-ONLY" not in texts[0] and not found[0].answered and asked == {0: None}


def test_links_planted_in_the_evidence_folder_make_the_agent_read_and_write_nothing_through_them(
        tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    agent_stand_in = _spawn(["sleep", "60"], env={"PATH": os.environ["PATH"], "S3_SECRET": AGENT_SECRET})
    processes.append(agent_stand_in)
    base = Path(evidence_env(RunLayout.of(tmp_path / "agent", "wf"), 1, 0, {})["TRAINGUARD_EVIDENCE_BASE"])
    layout, record = _quiet_rank(tmp_path, processes, claims=str(base))  # its true base: it lies in its links
    folder = layout.attempt_dir(1) / "evidence"
    if os.geteuid() == 0:  # as the agent hands it over (`RankLaunch._rank_folders`)
        import pwd
        nobody = pwd.getpwnam("nobody")
        os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    base.with_name(f"{base.name}.ready").write_text(str(record.ranks[0].pid))
    base.with_name(f"{base.name}.stacks").symlink_to(f"/proc/{agent_stand_in.pid}/environ")
    root_only = tmp_path / "authorized_keys"
    root_only.write_text("root's own line\n")
    root_only.chmod(0o600)
    (folder / "incident-rank-00000.txt").symlink_to(root_only)
    uploaded: dict[str, str] = {}

    async def gather() -> None:
        activities = EvidenceActivities(RankBook("node-0", tmp_path / "agent"),
                                        uploader=lambda _bucket, key, text: uploaded.__setitem__(key, text))
        await activities.gather(record, layout, "bucket", "runs/wf")
        while activities._uploads:
            await next(iter(activities._uploads))

    import asyncio
    asyncio.run(gather())

    assert root_only.read_text() == "root's own line\n"  # never written through the rank's link
    everything = "".join(uploaded.values()) + "".join(
        p.read_text(errors="replace") for p in layout.root.rglob("*") if p.is_file() and not p.is_symlink())
    assert AGENT_SECRET not in everything  # the agent's environ was never read through the rank's link
    kept = [p for p in layout.root.rglob("incident-rank-00000.txt") if not p.is_symlink()]
    assert len(kept) == 1 and "rank 0 on node-0" in kept[0].read_text()  # the agent's own copy, kept
    assert (kept[0].parent.stat().st_uid, kept[0].parent.stat().st_mode & 0o022) == (os.getuid(), 0)
    assert list(uploaded) == ["runs/wf/incidents/1/rank-00000.txt"]


async def test_the_stacks_sent_to_the_store_are_redacted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from activities import evidence
    from activities.models import RankEvidence

    layout = RunLayout.of(tmp_path / "agent", "wf")
    record = AttemptRecord("wf", 1, "127.0.0.1", 1, 0, time.time())
    stacks = (f'rank 0 on node-0\n\n  File "/code/train.py", line 9 in main\nAWS_SECRET_ACCESS_KEY={AGENT_SECRET}\n'
              "HF_TOKEN=hf_notheldbytheagentbutsecret\n")
    monkeypatch.setattr(evidence, "collect_local", lambda *_: ([RankEvidence(node="node-0", rank=0)], {0: stacks}))
    uploaded: dict[str, str] = {}
    activities = EvidenceActivities(RankBook("node-0", tmp_path / "agent"),
                                    uploader=lambda _bucket, key, text: uploaded.__setitem__(key, text))

    await activities.gather(record, layout, "bucket", "runs/wf")
    while activities._uploads:
        await next(iter(activities._uploads))

    sent = uploaded["runs/wf/incidents/1/rank-00000.txt"]
    assert 'File "/code/train.py", line 9 in main' in sent  # the stacks themselves go
    assert AGENT_SECRET not in sent and "hf_notheldbytheagentbutsecret" not in sent and "[redacted]" in sent


async def test_a_rank_kept_alive_by_an_in_process_restart_is_asked_at_its_launching_attempts_paths(
        tmp_path: Path) -> None:
    from activities.models import LaunchRanksInput, RejoinRanksInput
    from workers.node_agent import node_ranks

    script = tmp_path / "rank.py"
    script.write_text(HELPER_RANK)
    agent = node_ranks("node-a", tmp_path / "agent", "127.0.0.1", tmp_path)
    layout = RunLayout.of(tmp_path / "agent", "wf")
    try:
        await agent.launch.launch_ranks(LaunchRanksInput(
            workflow_id="wf", chain_id="c1", attempt=1, node="node-a", node_rank=0, num_nodes=1, ranks_per_node=1,
            entrypoint=[sys.executable, str(script)]))
        deadline = time.monotonic() + 30
        while (protocol.read_progress(layout.progress_file(1, 0)) or protocol.Progress(0, 0, 0)).step < 2:
            assert time.monotonic() < deadline, "the rank never reported"
            time.sleep(0.05)
        await agent.launch.rejoin_ranks(RejoinRanksInput(
            workflow_id="wf", chain_id="c1", attempt=2, from_attempt=1, node="node-a", node_rank=0, num_nodes=1,
            ranks_per_node=1, entrypoint=[sys.executable, str(script)], rejoin_timeout_s=30.0))
        record = agent.book.record("wf")
        assert record is not None and record.attempt == 2 and record.survivors == {0}

        found, _ = collect_local("node-a", layout, record)
        assert found[0].answered and found[0].step is not None and found[0].step >= 2
        # An agent that restarts reads the launching attempt back from its ranks.json.
        again = RankBook("node-a", tmp_path / "agent").record("wf")
        assert again is not None and again.attempt == 2
        assert ask_positions(layout, again, {0})[0] is not None
    finally:
        await agent.book.stop_all(grace_s=0.5)
