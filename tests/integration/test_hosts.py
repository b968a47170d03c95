"""Hosts mode: every node agent and its ranks in a network namespace of its own, on a bridge of the stack's.

Nodes reach Temporal, the store and each other only over that bridge, each from an address of its own, so
what loopback hides shows here: the rendezvous address every rank is given, peer shards fetched from another
host, packets that vanish (a `tc` drop on one end of a node's link, not a forwarder that stalls), one
direction of a link lost, an agent coming back under another address. Every run ends with the digest of
the same job run without a fault, and `dev down` leaves no namespace, link or rule behind.

Skipped, with the reason, where namespaces cannot be made (not root, no `ip`/`tc`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack, StackConfig, _start_time
from trainguard.ports import Ports, free_port_base
from trainguard.hosts import Direction, unavailable_reason
from trainguard.models import Action, IncidentKind, Phase, RunResult
from trainguard.protocol import RunLayout
from trainguard.settings import Settings

from .conftest import (REPO, RUN_TIMEOUT_S, activity_failures, checkpointed, live_rank_pids, make_spec,
                       restart_agent, wait_until)

NODES = ("node-0", "node-1", "node-2")
REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"hosts mode unavailable: {REASON}")
FENCE_TIMEOUT_S = 90
"""After a cut heals, the cut-off node's ranks of the old attempt must be gone within this: its agent asks the
run about ranks no watch looked at for 30 s (checked every 5 s), on a shared 2-core machine."""


@pytest.fixture(scope="module")
def hosts_stack() -> Iterator[DevStack]:
    home = REPO / ".pytest-stack" / f"hosts-{uuid.uuid4().hex[:8]}"
    config = StackConfig(home=home, ports=Ports.from_base(free_port_base(27600, len(NODES))), nodes=NODES,
                         code_dir=REPO, hosts=True)
    dev = DevStack(config)
    try:
        dev.up(echo=lambda _line: None)
        yield dev
    finally:
        pids = [json.loads(p.read_text()) for p in dev.run_dir.glob("*.json") if p.name != "hosts.json"]
        dev.down(echo=lambda _line: None)
        survivors = [p["argv"] for p in pids if _start_time(p["pid"]) == p["start_time"]]
        leftovers = config.network.leftovers()
        if os.environ.get("TRAINGUARD_TEST_LOGS"):
            shutil.copytree(dev.log_dir, Path(os.environ["TRAINGUARD_TEST_LOGS"]) / home.name, dirs_exist_ok=True)
        shutil.rmtree(home, ignore_errors=True)
        assert not survivors, f"processes survived dev down: {survivors}"
        assert not leftovers, f"namespaces or links survived dev down: {leftovers}"


@pytest.fixture(scope="module")
async def hosts_client(hosts_stack: DevStack) -> AsyncIterator[TrainguardClient]:
    yield await TrainguardClient.connect(Settings.from_env({**os.environ, **hosts_stack.client_env()}))


async def _baseline(client: TrainguardClient, nodes: tuple[str, ...]) -> RunResult:
    run_id = await client.start_run(make_spec(f"hosts-base-{uuid.uuid4().hex[:6]}", nodes=nodes),
                                    workflow_id=f"it-hosts-base-{uuid.uuid4().hex[:6]}")
    return await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
async def baseline3(hosts_client: TrainguardClient) -> RunResult:
    """The three-host job with no fault."""
    return await _baseline(hosts_client, NODES)


@pytest.fixture(scope="module")
async def baseline2(hosts_client: TrainguardClient) -> RunResult:
    """The two-host job with no fault (which node holds which rank does not change its digest)."""
    return await _baseline(hosts_client, ("node-0", "node-1"))


def run_id(kind: str) -> str:
    return f"it-hosts-{kind}-{uuid.uuid4().hex[:6]}"


def ranks_record(stack: DevStack, node: str, workflow_id: str) -> dict[str, Any]:
    """The node agent's record of its ranks for the run: its last attempt, the master address it was given."""
    return json.loads(RunLayout.of(stack.home / "nodes" / node, workflow_id).ranks_file.read_text())


async def no_rank_survives(stack: DevStack) -> None:
    deadline = time.monotonic() + FENCE_TIMEOUT_S
    while live_rank_pids(stack):
        assert time.monotonic() < deadline, f"ranks still alive: {live_rank_pids(stack)}"
        await asyncio.sleep(0.5)


PROBE = """
import errno, sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))
    print(200)
except urllib.error.HTTPError as error:
    print(error.code)
except (urllib.error.URLError, OSError) as error:
    reason = getattr(error, "reason", error)
    print("timeout" if isinstance(reason, TimeoutError) else errno.errorcode.get(getattr(reason, "errno", 0), reason))
"""


DROPPED = ("timeout", "EHOSTUNREACH")
"""What a request to a cut-off node gets: no answer, or, once its neighbour entry has expired, no route (its
ARP replies are dropped too). Never a refusal: nothing answers for it."""


async def answer_from(stack: DevStack, node: str, url: str, timeout_s: float = 2.0) -> str:
    """What an HTTP GET of `url` from inside `node`'s namespace gets: a status code, `timeout` (the packets
    vanished) or the errno's name (`ECONNREFUSED`, `ENETUNREACH`)."""
    proc = await asyncio.create_subprocess_exec(
        *stack.config.network.exec_prefix(node), sys.executable, "-c", PROBE, url, str(timeout_s),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return out.decode().strip()


async def test_three_nodes_on_three_addresses_reach_each_other_only_over_the_bridge(
    hosts_client: TrainguardClient, hosts_stack: DevStack
) -> None:
    addresses = {node: hosts_stack.node_address(node) for node in NODES}
    assert len(set(addresses.values())) == 3 and not any(a.startswith("127.") for a in addresses.values())
    pool = {n.node: n for n in await hosts_client.nodes()}
    assert {node: pool[node].host for node in NODES} == addresses  # each advertises its own address
    shard_server = pool["node-1"].peer_url + "/runs/no-run/step-00000001/rank-00000.pt"
    assert shard_server.startswith(f"http://{addresses['node-1']}:")
    network = hosts_stack.config.network

    assert await answer_from(hosts_stack, "node-2", shard_server) == "401"  # another host's agent answers
    # Nothing outside the stack's subnet is routed from a node (TEST-NET-1, RFC 5737).
    assert await answer_from(hosts_stack, "node-2", "http://192.0.2.1:80/") == "ENETUNREACH"
    network.partition("node-1", Direction.BOTH)
    try:
        assert await answer_from(hosts_stack, "node-2", shard_server) in DROPPED  # never refused
        network.heal("node-1")
        assert await answer_from(hosts_stack, "node-2", shard_server) == "401"
        network.partition("node-1", Direction.INBOUND)  # its answers leave; nothing reaches it
        assert network.dropped("node-1") == ["inbound"]
        assert await answer_from(hosts_stack, "node-2", shard_server) in DROPPED
    finally:
        network.heal("node-1")
    assert network.dropped("node-1") == [] and await answer_from(hosts_stack, "node-2", shard_server) == "401"


@pytest.mark.slow
async def test_three_hosts_recover_a_crash_with_the_masters_own_address(
    hosts_client: TrainguardClient, hosts_stack: DevStack, baseline3: RunResult, prefix: str
) -> None:
    addresses = {node: hosts_stack.node_address(node) for node in NODES}
    rid = await hosts_client.start_run(make_spec(prefix, nodes=NODES), workflow_id=run_id("crash"))
    await wait_until(hosts_client, rid, checkpointed)
    await hosts_client.inject_fault(rid, "crash", "node-1")
    result = await asyncio.wait_for(hosts_client.result(rid), RUN_TIMEOUT_S)

    crashes = [i for i in result.incidents if i.kind is IncidentKind.CRASH]
    assert [i.node for i in crashes] == ["node-1"], (result.incidents, await activity_failures(hosts_client, rid))
    assert result.final_state_digest == baseline3.final_state_digest
    # Every node's ranks of the last attempt were told to meet at the master node's own address.
    records = {node: ranks_record(hosts_stack, node, rid) for node in NODES}
    assert {r["attempt"] for r in records.values()} == {result.attempts}
    assert {node: r["master_addr"] for node, r in records.items()} == dict.fromkeys(NODES, addresses["node-0"])


@pytest.mark.slow
async def test_the_peer_tier_fetches_a_shard_from_another_host(
    hosts_client: TrainguardClient, hosts_stack: DevStack, baseline2: RunResult, prefix: str
) -> None:
    rid = await hosts_client.start_run(make_spec(prefix, spares=("node-2",)), workflow_id=run_id("peer"))
    await wait_until(hosts_client, rid, checkpointed)
    await hosts_client.inject_fault(rid, "gpu", "node-1")
    try:
        result = await asyncio.wait_for(hosts_client.result(rid), RUN_TIMEOUT_S)
    finally:
        await restart_agent(hosts_stack, "node-1")  # a repaired node: the injected XID is gone
    gpu = [i for i in result.incidents if i.kind is IncidentKind.GPU_UNHEALTHY]
    assert [(i.node, i.action) for i in gpu] == [("node-1", Action.REPLACE_NODE)], result.incidents
    # node-2 (10.x.x.12) read rank 1's shard from node-1 (10.x.x.11) over the bridge; node-0 its own copy.
    assert gpu[0].restore_tier == "local+peer", gpu[0]
    assert result.final_state_digest == baseline2.final_state_digest


async def _partitioned_run(client: TrainguardClient, stack: DevStack, baseline: RunResult, prefix: str,
                           direction: Direction) -> None:
    """node-1 loses `direction` of its packets while it trains with node-0; node-2 is the spare."""
    rid = await client.start_run(make_spec(prefix, spares=("node-2",)), workflow_id=run_id(f"cut-{direction.value}"))
    await wait_until(client, rid, checkpointed)
    network = stack.config.network
    network.partition("node-1", direction)
    try:
        assert network.dropped("node-1") == (["outbound", "inbound"] if direction is Direction.BOTH
                                             else [direction.value])
        result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
        # The run went on without node-1 while it was cut off, and never blamed node-0's blocked ranks.
        lost = [i for i in result.incidents if i.kind is IncidentKind.NODE_UNRESPONSIVE]
        assert lost and {i.node for i in lost} == {"node-1"}, result.incidents
        assert all(i.node != "node-0" or i.kind is not IncidentKind.NODE_UNRESPONSIVE for i in result.incidents)
        status = (await client.status(rid)).status
        assert (status.nodes, status.cordoned) == (["node-0", "node-2"], ["node-1"])
        assert result.final_state_digest == baseline.final_state_digest
    finally:
        network.heal("node-1")
    try:
        # Healed: nothing of the old attempt trains on, on node-1 or anywhere (no split brain).
        await no_rank_survives(stack)
        assert network.dropped("node-1") == []
    finally:
        await client.uncordon("node-1")


@pytest.mark.slow
async def test_a_partition_that_drops_a_nodes_packets_then_heals(
    hosts_client: TrainguardClient, hosts_stack: DevStack, baseline2: RunResult, prefix: str
) -> None:
    await _partitioned_run(hosts_client, hosts_stack, baseline2, prefix, Direction.BOTH)


@pytest.mark.slow
async def test_a_one_way_partition_the_node_speaks_but_never_hears(
    hosts_client: TrainguardClient, hosts_stack: DevStack, baseline2: RunResult, prefix: str
) -> None:
    await _partitioned_run(hosts_client, hosts_stack, baseline2, prefix, Direction.INBOUND)


@pytest.mark.slow
async def test_an_agent_restarted_under_a_new_address_is_the_next_attempts_master(
    hosts_client: TrainguardClient, hosts_stack: DevStack, baseline2: RunResult, prefix: str
) -> None:
    old = hosts_stack.node_address("node-1")
    rid = await hosts_client.start_run(make_spec(prefix, nodes=("node-1", "node-0")), workflow_id=run_id("readdress"))
    await wait_until(hosts_client, rid, checkpointed)
    assert ranks_record(hosts_stack, "node-0", rid)["master_addr"] == old
    await hosts_client.inject_fault(rid, "node-down", "node-1")
    await wait_until(hosts_client, rid, lambda v: v.status.phase is Phase.PAUSED, timeout_s=60)
    new = await asyncio.to_thread(hosts_stack.readdress, "node-1", lambda _line: None)
    assert new != old
    pool = {n.node: n for n in await hosts_client.nodes()}
    assert pool["node-1"].host == new and pool["node-1"].peer_url.startswith(f"http://{new}:")
    await hosts_client.resume(rid, reason="node-1 came back under a new address")

    result = await asyncio.wait_for(hosts_client.result(rid), RUN_TIMEOUT_S)
    lost = [i for i in result.incidents if i.kind is IncidentKind.NODE_UNRESPONSIVE]
    assert [(i.node, i.action) for i in lost] == [("node-1", Action.PAUSE)], result.incidents
    assert result.final_state_digest == baseline2.final_state_digest
    # The relaunch met at node-1's new address, the one its agent advertises now.
    assert {ranks_record(hosts_stack, n, rid)["master_addr"] for n in ("node-0", "node-1")} == {new}
    await no_rank_survives(hosts_stack)
