"""The node agent's workdir (issue 40 finding 6d): the job script's default `/tmp/trainguard-$SLURM_JOB_ID` is a
name anyone can create first; the agent must not start on a folder another user made or can write."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from workers import node_agent
from workers.agent_workdir import UnsafeWorkdir, prepare_workdir


OTHER_UID = 4242
"""A user other than the test's (and than root)."""


class Connected(Exception):
    """The agent went on to connect: it accepted the workdir."""


def start_agent(monkeypatch: pytest.MonkeyPatch, workdir: Path) -> str:
    """Start the agent on `workdir` as far as its checks go; what it printed when it refused."""

    async def connect() -> None:
        raise Connected

    monkeypatch.setattr(node_agent, "connect", connect)
    monkeypatch.setattr(node_agent, "setup_logging", lambda *_: None)
    monkeypatch.setattr(sys, "argv", ["node_agent", "--node", "node-0", "--workdir", str(workdir), "--allow", "*",
                                      "--run-as", ""])
    import asyncio

    with pytest.raises(SystemExit) as exited:
        asyncio.run(node_agent.main())
    assert exited.value.code == 2
    return str(exited.value)


def test_agent_refuses_a_workdir_others_can_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    planted = tmp_path / "trainguard-4243"  # made ahead by someone else, open to all
    planted.mkdir()
    os.chmod(planted, 0o777)
    start_agent(monkeypatch, planted / "node-0")
    assert "writable by group or others" in capsys.readouterr().err


def test_agent_creates_its_workdir_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    workdir = tmp_path / "trainguard-4243" / "node-0"
    with pytest.raises(Connected):
        import asyncio

        monkeypatch.setattr(node_agent, "connect", _raise_connected)
        monkeypatch.setattr(node_agent, "setup_logging", lambda *_: None)
        monkeypatch.setattr(sys, "argv", ["node_agent", "--node", "node-0", "--workdir", str(workdir), "--allow",
                                          "*", "--run-as", ""])
        asyncio.run(node_agent.main())
    for folder in (workdir, workdir.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


async def _raise_connected() -> None:
    raise Connected


def test_a_workdir_another_user_made_in_a_shared_folder_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    planted = shared / "trainguard-4243"
    planted.mkdir(mode=0o755)
    if os.geteuid() == 0:  # root (CI): the folder becomes another user's
        os.chown(planted, OTHER_UID, OTHER_UID)
        maker, agent = OTHER_UID, 0
    else:  # the folder is ours: the agent is told it runs as someone else
        maker, agent = os.geteuid(), OTHER_UID
    with pytest.raises(UnsafeWorkdir, match=f"{planted} belongs to uid {maker}, not to the agent's user"):
        prepare_workdir(planted / "node-0", uid=agent)
    assert not (planted / "node-0").exists()


def test_a_workdir_of_its_own_under_an_operators_folder_is_taken(tmp_path: Path) -> None:
    workdir = prepare_workdir(tmp_path / "agent" / "node-0", ranks_as_other_user=True)
    assert stat.S_IMODE(workdir.stat().st_mode) == 0o711  # ranks as another user pass through, never list
    assert prepare_workdir(workdir) == workdir  # the agent's own, again after a restart
