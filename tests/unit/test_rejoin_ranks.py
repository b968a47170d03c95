"""The node agent's half of an in-process restart: live ranks are kept and told the new group, dead ones
are started again as joiners, and a retried call changes nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from activities.models import LaunchRanksInput, RejoinRanksInput, StopRanksInput
from trainguard.procs import start_time
from trainguard.protocol import RunLayout
from workers.node_agent import NodeRanks, node_ranks

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[NodeRanks]:
    ranks = node_ranks("node-a", tmp_path, "127.0.0.1", tmp_path)
    yield ranks
    await ranks.book.stop_all(grace_s=0.5)


def _rejoin(**changes: object) -> RejoinRanksInput:
    fields: dict[str, object] = dict(workflow_id="wf", chain_id="c1", attempt=2, from_attempt=1, node="node-a",
                                     node_rank=0, num_nodes=1, ranks_per_node=2, entrypoint=SLEEPER,
                                     rejoin_timeout_s=30.0)
    fields.update(changes)
    return RejoinRanksInput(**fields)  # type: ignore[arg-type]


async def test_live_ranks_are_kept_and_the_dead_one_restarts_as_a_joiner(agent: NodeRanks,
                                                                        tmp_path: Path) -> None:
    launched = await agent.launch.launch_ranks(LaunchRanksInput(
        workflow_id="wf", chain_id="c1", attempt=1, node="node-a", node_rank=0, num_nodes=1, ranks_per_node=2,
        entrypoint=SLEEPER, rejoin_timeout_s=30.0))
    live_pid, dead_pid = launched.pids
    layout = RunLayout.of(tmp_path, "wf")
    standby_pid = json.loads(layout.ranks_file.read_text())["standby"]["pid"]
    assert standby_pid not in launched.pids
    os.kill(dead_pid, signal.SIGKILL)
    while start_time(dead_pid) is not None:  # a zombie counts as gone
        await asyncio.sleep(0.01)

    result = await agent.launch.rejoin_ranks(_rejoin())

    assert (result.survivors, result.joiners) == ([0], [1])
    assert result.master_port != launched.master_port  # a fresh group, never the broken one's port
    told = json.loads(layout.rejoin_file(0).read_text())
    assert (told["attempt"], told["master_port"], told["world_size"]) == (2, result.master_port, 2)
    assert told["progress_file"] == str(layout.progress_file(2, 0))
    assert not layout.rejoin_file(1).exists()  # the joiner learns its group from its environment
    record = json.loads(layout.ranks_file.read_text())
    pids = {item["rank"]: item["pid"] for item in record["ranks"]}
    assert record["attempt"] == 2 and pids[0] == live_pid and pids[1] != dead_pid
    # The standby took rank 1's place: told its role, not started anew; a fresh standby waits behind it.
    assert pids[1] == standby_pid
    role = json.loads(layout.standby_file(1).read_text())["env"]
    assert (role["RANK"], role["TRAINGUARD_JOIN"], role["MASTER_PORT"]) == ("1", "1", str(result.master_port))
    assert record["standby"]["pid"] not in (standby_pid, live_pid)

    again = await agent.launch.rejoin_ranks(_rejoin())  # a retry after a lost completion
    assert (again.survivors, again.joiners, again.master_port) == ([0], [1], result.master_port)
    assert {item["pid"] for item in json.loads(layout.ranks_file.read_text())["ranks"]} == set(pids.values())

    await agent.launch.stop_ranks(StopRanksInput(workflow_id="wf", node="node-a", attempt=2))
    for pid in [*pids.values(), record["standby"]["pid"]]:  # the standby goes with the ranks
        assert start_time(pid) is None


async def test_a_node_not_running_the_attempt_refuses_so_the_run_relaunches(agent: NodeRanks) -> None:
    with pytest.raises(ApplicationError) as refused:
        await agent.launch.rejoin_ranks(_rejoin())
    assert refused.value.type == "NoSuchAttempt" and refused.value.non_retryable
    await agent.launch.launch_ranks(LaunchRanksInput(
        workflow_id="wf", chain_id="c1", attempt=3, node="node-a", node_rank=0, num_nodes=1, ranks_per_node=1,
        entrypoint=SLEEPER))
    with pytest.raises(ApplicationError, match="runs 3"):
        await agent.launch.rejoin_ranks(_rejoin(from_attempt=1, attempt=2))
