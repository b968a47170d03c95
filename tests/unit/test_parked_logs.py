"""A parked process cannot make the agent (root) write through a link it planted (issue 40 finding 2).

`parked/` is the run-as user's: parked processes write their marks there. The agent once opened the next parked
process's log there in append mode (its number is predictable), and wrote roles through a temporary file of a
predictable name: a link planted under either name made root append to, or overwrite, a file of root's.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from activities import rank_parking
from activities.models import LaunchRanksInput
from activities.parking_models import ParkRanksInput
from trainguard import protocol
from trainguard.protocol import RunLayout
from workers.node_agent import NodeRanks, node_ranks

PARKS = """
import os
from trainguard import rank as tg
print("importing", os.getpid(), flush=True)
tg.standby(poll_s=0.01)
"""


@pytest.fixture
async def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[NodeRanks]:
    monkeypatch.setattr(rank_parking, "PARK_POLL_S", 0.05)
    ranks = node_ranks("node-a", tmp_path / "agent", "127.0.0.1", tmp_path)
    yield ranks
    await ranks.book.stop_all(grace_s=0.5)


def _root_only(tmp_path: Path) -> Path:
    """A stand-in for `/root/.ssh/authorized_keys`."""
    path = tmp_path / "authorized_keys"
    path.write_text("root's own line\n")
    path.chmod(0o600)
    return path


async def test_links_planted_for_the_next_park_logs_take_no_write_of_roots(agent: NodeRanks, tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path / "agent", "wf")
    layout.parked_dir.mkdir(parents=True)
    victim = _root_only(tmp_path)
    for number in (1, 2, 3):  # what an earlier parked process of the run, as the run-as user, could leave
        (layout.parked_dir / f"park-{number:06d}.log").symlink_to(victim)
    script = tmp_path / "train.py"
    script.write_text(PARKS)

    await agent.launch.park_ranks(ParkRanksInput(workflow_id="wf", node="node-a", launch=LaunchRanksInput(
        workflow_id="wf", chain_id="c1", attempt=1, node="node-a", node_rank=0, num_nodes=1, ranks_per_node=2,
        entrypoint=[sys.executable, str(script)])))
    pool = agent.book.parking["wf"]
    logs = [protocol.park_log_path(p.role_file) for p in pool.processes]
    deadline = time.monotonic() + 60
    while not all(p.waiting() for p in pool.processes):
        assert time.monotonic() < deadline, "the parked processes never reached standby()"
        await asyncio.sleep(0.05)

    assert victim.read_text() == "root's own line\n"
    assert len(logs) == 2 and all(not log.is_symlink() and "importing" in log.read_text() for log in logs)
    for log in logs:  # where the agent writes them, nothing but root can plant a link
        assert (log.parent.stat().st_uid, log.parent.stat().st_mode & 0o022) == (os.getuid(), 0)


def test_a_role_is_never_written_through_a_link_planted_under_its_temporary_name(tmp_path: Path) -> None:
    parked = tmp_path / "parked"
    parked.mkdir()
    victim = _root_only(tmp_path)
    role_file = parked / "park-000001.json"
    (parked / f".{role_file.name}.{os.getpid()}.tmp").symlink_to(victim)  # the name the agent's pid gave away

    protocol.StandbyRole({"RANK": "3"}, log_file="/x/rank-00003.log").write(role_file)

    assert victim.read_text() == "root's own line\n"
    assert not role_file.is_symlink()
    assert protocol.StandbyRole.read(role_file) == protocol.StandbyRole({"RANK": "3"}, log_file="/x/rank-00003.log")
