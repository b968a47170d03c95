"""The node pool's rules, as pure functions of its state."""

from __future__ import annotations

import pytest

from trainguard.models import AcquireNodesRequest, PoolNode, RegisterNodeRequest
from workflows.node_pool import cordon, drain, grant, register, release, uncordon


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


def test_unhealthy_registration_cordons_and_unknown_nodes_are_refused() -> None:
    nodes: dict[str, PoolNode] = {}
    register(nodes, RegisterNodeRequest(node="a", healthy=False), now=1.0)
    assert nodes["a"].cordoned
    with pytest.raises(ValueError, match="not in the pool"):
        uncordon(nodes, "zz")
