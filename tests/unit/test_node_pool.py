"""The node pool's rules, as pure functions of its state."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio import activity
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.nodes import RegistrationActivities
from activities.scheduler import NotifySchedulerInput, NotifySchedulerResult, SchedulerAction
from trainguard.models import AcquireNodesRequest, NodeRequest, PoolNode, RegisterNodeRequest
from workflows.node_pool import NodePool
from workflows.pool_rules import cordon, drain, grant, register, release, uncordon


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


def test_a_runs_cordon_persists_until_uncordon_or_a_healthy_reregistration() -> None:
    nodes = pool("a")
    cordon(nodes, "a", "node_unresponsive", now=10.0, by="run-1")
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
    async with Worker(env.client, task_queue=queue, workflows=[NodePool],
                      activities=[notify_scheduler, RegistrationActivities(None).verify_registration]):
        handle = await env.client.start_workflow(NodePool.run, id=queue, task_queue=queue)
        for name in ("node-0", "node-1"):
            await handle.execute_update(NodePool.register, RegisterNodeRequest(node=name))
        await handle.execute_update(NodePool.cordon, NodeRequest(node="node-0", reason="XID 79"))
        await handle.execute_update(NodePool.cordon, NodeRequest(node="node-1", reason="lost", run_id="run-1"))
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


# ------------------------------------------------------------------------------- by count and label


def labelled(**labels: str) -> dict[str, PoolNode]:
    """Nodes n1..n12 (n2 before n10), the even ones labelled `labels`."""
    return {f"n{i}": PoolNode(node=f"n{i}", labels=dict(labels) if i % 2 == 0 else {}) for i in range(1, 13)}


def test_a_count_takes_free_schedulable_matching_nodes_in_natural_order_then_spares() -> None:
    nodes = labelled(gpu="h100")
    nodes["n2"].cordoned = "xid"
    nodes["n4"].leased_to = "other"
    nodes["n6"].draining = True
    result = grant(nodes, AcquireNodesRequest(run_id="r", nodes=[], num_nodes=2, num_spares=1,
                                              selector={"gpu": "h100"}))
    assert result.granted and result.nodes == ["n8", "n10"] and result.spares == ["n12"]
    assert sorted(n for n, s in nodes.items() if s.leased_to == "r") == ["n10", "n12", "n8"]


def test_a_retried_count_lease_gets_the_same_nodes_and_spares() -> None:
    nodes = labelled()
    request = AcquireNodesRequest(run_id="r", nodes=[], num_nodes=3, num_spares=2)
    first = grant(nodes, request)
    nodes["n13"] = PoolNode(node="n13")  # a node free now, that sorts first, must not reshuffle the lease
    nodes["n0"] = PoolNode(node="n0")
    again = grant(nodes, request)
    assert (again.nodes, again.spares) == (first.nodes, first.spares) == (["n1", "n2", "n3"], ["n4", "n5"])


def test_a_count_waits_while_other_runs_hold_the_nodes_it_needs() -> None:
    nodes = labelled(zone="a")
    for name in ("n2", "n4", "n6", "n8", "n10"):
        nodes[name].leased_to = "other"
    result = grant(nodes, AcquireNodesRequest(run_id="r", nodes=[], num_nodes=2, selector={"zone": "a"}))
    assert not result.granted and not result.unsatisfiable
    assert result.busy == {n: "other" for n in ("n2", "n4", "n6", "n8", "n10")}
    assert nodes["n12"].leased_to is None  # nothing half-leased


@pytest.mark.parametrize(
    ("selector", "num_nodes", "expected"),
    [
        ({"gpu": "h100"}, 1, "num_nodes 1: no node in the pool matching node_selector gpu=h100 (12 nodes; "
                             "labels in the pool: zone=a)"),
        ({"zone": "a"}, 7, "num_nodes 7: the pool has 5 schedulable nodes matching node_selector zone=a "
                           "(6 in all; cordoned or draining: n4)"),
        ({}, 13, "num_nodes 13: the pool has 11 schedulable nodes (12 in all; cordoned or draining: n4)"),
    ],
)
def test_a_count_the_pool_cannot_meet_says_why(selector: dict[str, str], num_nodes: int, expected: str) -> None:
    nodes = labelled(zone="a")
    nodes["n4"].cordoned = "xid"
    nodes["n6"].leased_to = "other"  # busy counts as waiting, not as missing
    result = grant(nodes, AcquireNodesRequest(run_id="r", nodes=[], num_nodes=num_nodes, selector=selector))
    assert not result.granted and result.unsatisfiable == expected


def test_excluded_nodes_are_given_back_and_others_chosen() -> None:
    nodes = labelled()
    grant(nodes, AcquireNodesRequest(run_id="r", nodes=[], num_nodes=2))
    result = grant(nodes, AcquireNodesRequest(run_id="r", nodes=[], num_nodes=2, exclude=["n1"]))
    assert result.nodes == ["n2", "n3"] and nodes["n1"].leased_to is None


def test_a_cordoned_named_node_is_replaced_by_a_free_spare_only_when_asked() -> None:
    nodes = pool("a", "b", "s1", "s2")
    nodes["b"].cordoned = "fan failure"
    named = AcquireNodesRequest(run_id="r", nodes=["a", "b"], spares=["s1", "s2"])
    assert not grant(nodes, named).granted  # as before `replace_cordoned`
    result = grant(nodes, named.model_copy(update={"replace_cordoned": True}))
    assert result.granted and result.nodes == ["a", "s1"] and result.spares == ["s2"]
    assert result.replaced == {"b": "s1"} and nodes["b"].leased_to is None


def test_named_nodes_with_spares_chosen_by_count_and_too_few_spares_for_the_cordoned() -> None:
    nodes = labelled(zone="a")
    nodes["n1"].cordoned = nodes["n3"].cordoned = "xid"
    request = AcquireNodesRequest(run_id="r", nodes=["n1", "n3", "n5"], num_spares=1, selector={"zone": "a"},
                                  replace_cordoned=True)
    result = grant(nodes, request)
    assert not result.granted and result.cordoned == {"n1": "xid", "n3": "xid"}
    assert all(s.leased_to is None for s in nodes.values())
    result = grant(nodes, request.model_copy(update={"num_spares": 3}))
    assert result.nodes == ["n2", "n4", "n5"] and result.spares == ["n6"]


def test_registration_records_the_labels_and_the_latest_replaces_them() -> None:
    nodes: dict[str, PoolNode] = {}
    register(nodes, RegisterNodeRequest(node="a", labels={"gpu": "h100", "zone": "a"}), now=1.0)
    assert nodes["a"].labels == {"gpu": "h100", "zone": "a"}
    register(nodes, RegisterNodeRequest(node="a", labels={"gpu": "h100"}), now=2.0)
    assert nodes["a"].labels == {"gpu": "h100"}


async def test_leases_asked_together_go_to_the_pool_in_few_updates_and_each_gets_its_own(
        env: WorkflowEnvironment) -> None:
    from temporalio.common import WorkflowIDConflictPolicy

    from activities.nodes import PoolActivities
    from trainguard.models import AcquireNodesResult, PoolStatus
    from trainguard import POOL_WORKFLOW_ID

    queue = f"pool-{uuid.uuid4()}"
    names = [f"n{i}" for i in range(40)]
    async with Worker(env.client, task_queue=queue, workflows=[NodePool]):
        handle = await env.client.start_workflow(NodePool.run, PoolStatus(nodes=[PoolNode(node=n) for n in names]),
                                                 id=POOL_WORKFLOW_ID, task_queue=queue,
                                                 id_conflict_policy=WorkflowIDConflictPolicy.TERMINATE_EXISTING)
        pool = PoolActivities(env.client)
        leases: list[AcquireNodesResult] = await asyncio.gather(*(
            pool.leases.submit(AcquireNodesRequest(run_id=f"r{i}", nodes=names[2 * i:2 * i + 2]))
            for i in range(20)))
        freed = await asyncio.gather(*(pool.releases.submit(NodeRequest(run_id=f"r{i}")) for i in range(20)))
        updates = sum([e.HasField("workflow_execution_update_accepted_event_attributes")
                       async for e in handle.fetch_history_events()])
        status = await handle.query(NodePool.nodes)
        await handle.terminate()

    assert all(lease.granted for lease in leases), [l for l in leases if not l.granted]
    assert [sorted(f) for f in freed] == [names[2 * i:2 * i + 2] for i in range(20)]  # each run its own
    assert updates <= 6, updates  # 40 one by one before batches
    assert all(n.leased_to is None for n in status.nodes)
