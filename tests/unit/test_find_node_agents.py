"""A run's start asks which of its nodes have no agent polling: a known node whose agent is restarting (or whose
polls Temporal forgot in a restart of its own) is waited for, a node the pool has never seen is reported at once."""

from __future__ import annotations

import pytest
from temporalio.testing import ActivityEnvironment

from activities import nodes
from activities.models import FindNodeAgentsInput
from trainguard.models import PoolNode


@pytest.fixture
def agents(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Node -> how many more lookups find no poller for it (a node absent from the pool never polls)."""
    away: dict[str, int] = {}

    async def missing_agents(_client: object, wanted: list[str], _idle: float = 90.0) -> list[str]:
        gone = [node for node in wanted if away.get(node, 0) > 0]
        for node in gone:
            away[node] -= 1
        return gone

    async def pool_nodes(_client: object) -> list[PoolNode]:
        return [PoolNode(node=node) for node in ("node-0", "node-1")]

    async def registered(_client: object) -> bool:
        return True

    monkeypatch.setattr(nodes, "missing_agents", missing_agents)
    monkeypatch.setattr(nodes, "pool_nodes", pool_nodes)
    monkeypatch.setattr(nodes, "registered", registered)
    monkeypatch.setattr(nodes, "AGENT_RETURN_POLL_S", 0.0)
    return away


async def find(*wanted: str) -> list[str]:
    activity = nodes.NodeActivities(client=None)  # type: ignore[arg-type]
    return (await ActivityEnvironment().run(activity.find_node_agents, FindNodeAgentsInput(nodes=list(wanted)))).missing


async def test_a_registered_node_whose_agent_is_restarting_is_not_missing(agents: dict[str, int]) -> None:
    agents["node-1"] = 3  # no poller for its first three lookups: its agent (or Temporal) restarts
    assert await find("node-0", "node-1") == []


async def test_a_node_the_pool_never_saw_is_missing_at_once(agents: dict[str, int],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    agents["node-typo"] = 10**6
    monkeypatch.setattr(nodes, "AGENT_RETURN_WAIT_S", 3600.0)  # were it waited for, the test would hang
    assert await find("node-0", "node-typo") == ["node-typo"]
    assert agents["node-typo"] == 10**6 - 1  # looked up once


async def test_a_registered_node_that_stays_away_is_missing_after_the_wait(agents: dict[str, int],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    agents["node-1"] = 10**6
    monkeypatch.setattr(nodes, "AGENT_RETURN_WAIT_S", 0.05)
    assert await find("node-0", "node-1") == ["node-1"]


@pytest.mark.parametrize(("environ", "fragments"), [
    ({"TRAINGUARD_DEV_SLURM": "1", "TRAINGUARD_SCHEDULER": "slurm"},
     ["the dev stack is in Slurm mode (`trainguard dev up --slurm`), which starts no node agents: Slurm jobs do",
      "`sbatch examples/slurm/train.sbatch`", "`trainguard dev down`, then `trainguard dev up` without --slurm"]),
    ({"TRAINGUARD_SCHEDULER": "slurm"},
     ["TRAINGUARD_SCHEDULER=slurm, where node agents come from Slurm jobs", "`sbatch examples/slurm/train.sbatch`"]),
])
async def test_nodes_without_agents_under_slurm_are_told_where_agents_come_from(
        agents: dict[str, int], environ: dict[str, str], fragments: list[str]) -> None:
    """A dev stack in Slurm mode starts no agents: the quickstart on it failed with `no node agent polls ...
    (unknown node)` alone."""
    agents["node-typo"] = 10**6
    activity = nodes.NodeActivities(client=None, environ=environ)  # type: ignore[arg-type]

    found = await ActivityEnvironment().run(activity.find_node_agents, FindNodeAgentsInput(nodes=["node-typo"]))

    assert found.missing == ["node-typo"] and found.no_agent_hint is not None
    for fragment in fragments:
        assert fragment in found.no_agent_hint


@pytest.mark.parametrize(("environ", "wanted"), [({}, "node-typo"), ({"TRAINGUARD_DEV_SLURM": "1"}, "node-0")])
async def test_no_hint_without_slurm_or_without_missing_nodes(
        agents: dict[str, int], environ: dict[str, str], wanted: str) -> None:
    agents["node-typo"] = 10**6
    activity = nodes.NodeActivities(client=None, environ=environ)  # type: ignore[arg-type]

    found = await ActivityEnvironment().run(activity.find_node_agents, FindNodeAgentsInput(nodes=[wanted]))

    assert found.no_agent_hint is None
