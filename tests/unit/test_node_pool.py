"""The node pool's rules, as pure functions of its state."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio import activity
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.scheduler import NotifySchedulerInput, NotifySchedulerResult, SchedulerAction
from trainguard.models import AcquireNodesRequest, NodeRequest, PoolNode, RegisterNodeRequest
from workflows.node_pool import NodePool, cordon, drain, grant, register, release, uncordon


def pool(*names: str) -> dict[str, PoolNode]:
    return {n: PoolNode(node=n) for n in names}


def test_a_run_gets_all_its_nodes_and_the_free_spares() -> None:
    nodes = pool("a", "b", "c", "d")
    nodes["d"].leased_to = "other"
    result = grant(nodes, AcquireNodesRequest(run_id="r1", nodes=["a", "b"], spares=["c", "d"]))
    assert result.granted and result.spares == ["c"]
    assert [nodes[n].leased_to for n in "abcd"] == ["r1", "r1", "r1", "other"]


def test_granting_is_idempotent_for_the_same_run() -> None:
    nodes = pool("a", "b")
    request = AcquireNodesRequest(run_id="r1", nodes=["a", "b"])
    assert grant(nodes, request).granted and grant(nodes, request).granted


@pytest.mark.parametrize(
    ("setup", "field", "expected"),
    [
        (lambda n: setattr(n["b"], "leased_to", "r0"), "busy", {"b": "r0"}),
        (lambda n: setattr(n["b"], "cordoned", "xid"), "cordoned", {"b": "xid"}),
        (lambda n: setattr(n["b"], "draining", True), "cordoned", {"b": "draining"}),
        (lambda n: n.pop("b"), "unregistered", ["b"]),
    ],
)
def test_all_or_nothing(setup, field: str, expected) -> None:  # type: ignore[no-untyped-def]
    nodes = pool("a", "b")
    setup(nodes)
    result = grant(nodes, AcquireNodesRequest(run_id="r1", nodes=["a", "b"]))
    assert not result.granted and getattr(result, field) == expected
    assert nodes["a"].leased_to is None  # nothing half-leased


def test_release_frees_the_runs_nodes_and_a_draining_node_leaves() -> None:
    nodes = pool("a", "b", "c")
    grant(nodes, AcquireNodesRequest(run_id="r1", nodes=["a", "b"]))
    drain(nodes, "b")
    assert nodes["b"].draining  # still serving its run
    assert release(nodes, "r1") == ["a", "b"]
    assert sorted(nodes) == ["a", "c"] and nodes["a"].leased_to is None


def test_drain_of_a_free_node_removes_it_now() -> None:
    nodes = pool("a")
    drain(nodes, "a")
    assert nodes == {}


def test_cordon_persists_until_uncordon_or_a_healthy_reregistration() -> None:
    nodes = pool("a")
    cordon(nodes, "a", "node_unresponsive", now=10.0)
    assert not grant(nodes, AcquireNodesRequest(run_id="r", nodes=["a"])).granted
    register(nodes, RegisterNodeRequest(node="a", healthy=False), now=20.0)
    assert nodes["a"].cordoned == "node_unresponsive"  # back, but not healthy: stays out
    register(nodes, RegisterNodeRequest(node="a", healthy=True), now=30.0)
    assert nodes["a"].cordoned is None  # repaired
    cordon(nodes, "a", "operator", now=40.0)
    uncordon(nodes, "a")
    assert grant(nodes, AcquireNodesRequest(run_id="r", nodes=["a"])).granted


@pytest.mark.parametrize(
    ("registered_at", "healthy", "lost_since", "stands"),
    [
        pytest.param(5.0, True, 10.0, True, id="registered-before-it-was-lost"),
        pytest.param(15.0, True, 10.0, False, id="registered-again-since-the-run-last-heard-from-it"),
        pytest.param(15.0, False, 10.0, True, id="back-but-unhealthy"),
        pytest.param(15.0, True, None, True, id="not-a-lost-node-cordon"),
    ],
)
def test_a_lost_nodes_cordon_stands_only_if_its_agent_did_not_come_back(
        registered_at: float, healthy: bool, lost_since: float | None, stands: bool) -> None:
    nodes = pool("a")
    register(nodes, RegisterNodeRequest(node="a", healthy=True), now=1.0)
    register(nodes, RegisterNodeRequest(node="a", healthy=healthy), now=registered_at)
    nodes["a"].cordoned = None  # whatever the registration decided: only the cordon is under test

    assert cordon(nodes, "a", "node_unresponsive: lost", now=20.0, lost_since=lost_since, by="run-1") is stands
    assert (nodes["a"].cordoned, nodes["a"].cordoned_by) == (
        ("node_unresponsive: lost", "run-1") if stands else (None, None))
    assert grant(nodes, AcquireNodesRequest(run_id="r2", nodes=["a"])).granted is not stands


def test_unhealthy_registration_cordons_and_unknown_nodes_are_refused() -> None:
    nodes: dict[str, PoolNode] = {}
    register(nodes, RegisterNodeRequest(node="a", healthy=False), now=1.0)
    assert nodes["a"].cordoned
    with pytest.raises(ValueError, match="not in the pool"):
        uncordon(nodes, "zz")


# ------------------------------------------------------------- the workflow: the scheduler hears of lifted cordons


async def test_a_lifted_cordon_is_passed_on_to_the_cluster_scheduler(env: WorkflowEnvironment) -> None:
    told: list[NotifySchedulerInput] = []

    @activity.defn(name="notify_scheduler")
    async def notify_scheduler(request: NotifySchedulerInput) -> NotifySchedulerResult:
        told.append(request)
        return NotifySchedulerResult()

    queue = f"pool-{uuid.uuid4()}"
    async with Worker(env.client, task_queue=queue, workflows=[NodePool], activities=[notify_scheduler]):
        handle = await env.client.start_workflow(NodePool.run, id=queue, task_queue=queue)
        for name in ("node-0", "node-1"):
            await handle.execute_update(NodePool.register, RegisterNodeRequest(node=name))
        await handle.execute_update(NodePool.cordon, NodeRequest(node="node-0", reason="XID 79"))
        await handle.execute_update(NodePool.cordon, NodeRequest(node="node-1", reason="lost"))
        await handle.execute_update(NodePool.uncordon, NodeRequest(node="node-0"))  # an operator
        await handle.execute_update(NodePool.register, RegisterNodeRequest(node="node-1"))  # repaired
        await handle.execute_update(NodePool.uncordon, NodeRequest(node="node-1"))  # nothing to lift
        for _ in range(200):
            if len(told) >= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # a third notice, were there one, would be here by now
        await handle.terminate()

    assert [(t.node, t.action) for t in told] == [("node-0", SchedulerAction.UNCORDON),
                                                  ("node-1", SchedulerAction.UNCORDON)]


def test_the_pool_carries_thousands_of_nodes_across_continue_as_new_in_one_small_payload() -> None:
    from temporalio.contrib.pydantic import pydantic_data_converter

    from trainguard.models import PoolNode, PoolStatus

    nodes = [PoolNode(node=f"node-{i:04d}", host=f"10.0.{i // 256}.{i % 256}", registered_at=1_795_000_000.5 + i,
                      leased_to=f"run-{i // 512}", peer_url=f"http://10.0.{i // 256}.{i % 256}:7300",
                      cordoned="XID 79" if i % 97 == 0 else None) for i in range(4096)]
    [payload] = pydantic_data_converter.payload_converter.to_payloads([PoolStatus.pack(nodes)])
    plain = len(PoolStatus(nodes=nodes).model_dump_json())
    assert len(payload.data) < 256 * 1024 < plain, (len(payload.data), plain)
    [carried] = pydantic_data_converter.payload_converter.from_payloads([payload], [PoolStatus])
    assert carried.all_nodes() == nodes
