"""The node pool on the real stack: leases keep concurrent runs apart, cordons outlive runs."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.client import WorkflowFailureError

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import Phase

from .conftest import RUN_TIMEOUT_S, make_spec, wait_until


async def test_two_concurrent_runs_never_share_a_node(client: TrainguardClient, prefix: str) -> None:
    first = await client.start_run(make_spec(prefix, steps=30), workflow_id=f"it-pool-a-{uuid.uuid4().hex[:6]}")
    await wait_until(client, first, lambda v: v.status.phase is Phase.RUNNING)
    second = await client.start_run(make_spec(prefix, steps=30), workflow_id=f"it-pool-b-{uuid.uuid4().hex[:6]}")
    view = await wait_until(client, second, lambda v: "leased to" in (v.status.reason or ""))
    assert first in (view.status.reason or "")
    leases = {n.node: n.leased_to for n in await client.nodes()}
    assert leases["node-0"] == leases["node-1"] == first

    await asyncio.wait_for(client.result(first), RUN_TIMEOUT_S)
    result = await asyncio.wait_for(client.result(second), RUN_TIMEOUT_S)  # got the nodes once freed
    assert result.steps_completed == 30
    assert all(n.leased_to is None for n in await client.nodes())


async def test_a_cordon_outlives_runs_until_an_operator_lifts_it(client: TrainguardClient, prefix: str) -> None:
    await client.cordon("node-1", reason="fan failure")
    try:
        rid = await client.start_run(make_spec(prefix, steps=20), workflow_id=f"it-cordon-{uuid.uuid4().hex[:6]}")
        with pytest.raises(WorkflowFailureError) as failure:
            await asyncio.wait_for(client.result(rid), 60)
        message = str(failure.value.cause)
        assert "nodes.1 'node-1' is cordoned (fan failure)" in message
    finally:
        await client.uncordon("node-1")
    rid = await client.start_run(make_spec(prefix, steps=20), workflow_id=f"it-uncordon-{uuid.uuid4().hex[:6]}")
    assert (await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)).steps_completed == 20


# About 70 s (the lease goes back once the closed run's agents had time to fence its ranks): `make test-slow`.
# tests/unit/test_lease_reclaim.py keeps the rules in `make test`.
@pytest.mark.slow
async def test_a_terminated_runs_nodes_go_to_the_next_run(client: TrainguardClient, prefix: str) -> None:
    """Issue 27 item 7: a terminated run never releases its lease; the next run waited "leased to ..." until it
    failed. Now the lease it finds in its way is described, and a closed run's nodes are given back."""
    from activities.nodes import RECLAIM_AFTER_CLOSED_S

    first = await client.start_run(make_spec(prefix, steps=100_000), workflow_id=f"it-leak-{uuid.uuid4().hex[:6]}")
    await wait_until(client, first, lambda v: v.status.phase is Phase.RUNNING)
    await client.client.get_workflow_handle(first).terminate("issue 27 item 7")
    assert {n.node: n.leased_to for n in await client.nodes()}["node-0"] == first  # the leak

    second = await client.start_run(make_spec(prefix, steps=20), workflow_id=f"it-after-leak-{uuid.uuid4().hex[:6]}")
    view = await wait_until(client, second, lambda v: f"leased to {first}" in (v.status.reason or ""))
    assert view.status.phase is not Phase.RUNNING  # waits while the terminated run's ranks are fenced
    result = await asyncio.wait_for(client.result(second), RECLAIM_AFTER_CLOSED_S + RUN_TIMEOUT_S)
    assert result.steps_completed == 20
    assert all(n.leased_to is None for n in await client.nodes())


async def test_registration_is_validated_authenticated_and_never_lifts_an_operators_cordon(
        client: TrainguardClient, stack: DevStack) -> None:
    """Issue 27 item 6, on the real stack (its controller and agents hold the stack's peer token): `register`
    lifted an operator's cordon, made phantom nodes, and took a peer address at a listener for node-0."""
    from temporalio.client import WorkflowUpdateFailedError

    from activities.nodes import register_node

    before = {n.node: n for n in await client.nodes()}
    token = stack.peer_token()

    async def refused(node: str, peer_url: str, token: str | None) -> str:
        with pytest.raises(WorkflowUpdateFailedError) as error:
            await register_node(client.client, node, "127.0.0.1", True, peer_url, token=token)
        return str(error.value.cause)

    assert "unsigned" in await refused("node-0", "http://127.0.0.1:9", None)
    assert "does not match" in await refused("node-0", "http://127.0.0.1:9", "not-the-pools-token-0123456789")
    assert "own host" in await refused("node-0", "http://10.6.6.6:7300", token)
    for phantom in ("Phantom-1", "node-0\n", "p" * 64):
        assert "registration refused" in await refused(phantom, "", token)

    node = before["node-2"]
    await client.cordon("node-2", reason="fan failure")
    try:
        state = await register_node(client.client, "node-2", node.host, True, node.peer_url, node.labels, token=token)
        assert state.cordoned == "fan failure"  # a healthy, authenticated agent does not lift an operator's cordon
    finally:
        await client.uncordon("node-2")
    after = {n.node: n for n in await client.nodes()}
    assert sorted(after) == sorted(before)  # no phantom
    assert after["node-0"].peer_url == before["node-0"].peer_url  # no listener took node-0's peers
