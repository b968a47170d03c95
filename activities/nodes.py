"""Controller-side activities about the node inventory."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from temporalio import activity
from temporalio.client import Client

from activities.models import FindNodeAgentsInput, FindNodeAgentsResult
from trainguard.models import (AcquireManyRequest, AcquireManyResult, AcquireNodesRequest, AcquireNodesResult,
                               NodeRequest, PoolNode, ReleaseManyRequest, ReleaseManyResult)
from trainguard.pool import (  # noqa: F401 - the pool client helpers live in the public package; re-exported
    AGENT_LOOKUPS_IN_FLIGHT,
    POOL_BUSY_FIRST_RETRY_S,
    POOL_BUSY_MAX_RETRY_S,
    has_pollers,
    missing_agents,
    peer_urls,
    pool_handle,
    pool_nodes,
    pool_update,
    register_node,
)
from trainguard.search_attributes import registered


class NodeActivities:
    def __init__(self, client: Client) -> None:
        self.client = client

    @activity.defn(name="find_node_agents")
    async def find_node_agents(self, request: FindNodeAgentsInput) -> FindNodeAgentsResult:
        """Which of the nodes have no agent polling their queue (as the server saw it recently)."""
        return FindNodeAgentsResult(
            missing=await missing_agents(self.client, request.nodes, request.max_idle_s),
            search_attributes=await registered(self.client),
        )


# ------------------------------------------------------------------------------------------- node pool


POOL_BATCH_MAX_NODES = 16_384
"""Node names one batched update carries at most: about 200 KB of JSON, under Temporal's 256 KB payload
warning (a 4,096-node lease and its spares fit four times)."""


class PoolBatcher:
    """Leases (or releases) asked while one is on its way to the pool go together in the next update (a group
    commit): 100 runs starting at once cost a few updates instead of 100 queued behind Temporal's 10 updates in
    flight per execution, and a few events in the pool's history instead of hundreds. One update of a kind is in
    flight at a time per controller process; a lone request goes as the single update it always was."""

    def __init__(self, client: Client, single: str, many: str, wrap: Callable[[list[Any]], Any],
                 many_type: type[Any], unwrap: Callable[[Any], list[Any]], single_type: type[Any]) -> None:
        self.client, self.single, self.many = client, single, many
        self.wrap, self.many_type, self.unwrap, self.single_type = wrap, many_type, unwrap, single_type
        self.waiting: list[tuple[Any, asyncio.Future[Any]]] = []
        self.flushing: asyncio.Task[None] | None = None

    async def submit(self, request: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting.append((request, future))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.create_task(self._flush())
        return await future

    def _take(self) -> list[tuple[Any, asyncio.Future[Any]]]:
        batch, names = [], 0
        while self.waiting and (not batch or names + _names(self.waiting[0][0]) <= POOL_BATCH_MAX_NODES):
            names += _names(self.waiting[0][0])
            batch.append(self.waiting.pop(0))
        return batch

    async def _flush(self) -> None:
        while self.waiting:
            batch = [(r, f) for r, f in self._take() if not f.done()]  # a cancelled activity's request is dropped
            if not batch:
                continue
            try:
                results = await self._send([r for r, _ in batch])
            except Exception as error:  # noqa: BLE001 - every waiting activity gets it, and retries as before
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)

    async def _send(self, requests: list[Any]) -> list[Any]:
        from temporalio.client import WorkflowUpdateFailedError

        if len(requests) > 1:
            try:
                return self.unwrap(await pool_update(self.client, self.many, self.wrap(requests), self.many_type))
            except WorkflowUpdateFailedError as error:  # a pool still on a build without batches: one by one
                activity.logger.info("batched %s refused (%s): one by one", self.many, error.cause or error)
        return [await pool_update(self.client, self.single, r, self.single_type) for r in requests]


def _names(request: Any) -> int:
    return len(getattr(request, "nodes", ()) or ()) + len(getattr(request, "spares", ()) or ()) + 1


CHOSEN_AGENT_CHECKS = 3
"""Leases by count asked again without the chosen nodes no agent polls: the pool remembers every node that
ever registered, and one whose agent is gone (a smaller dev stack, a retired machine) must not be chosen. Each
retry excludes every silent node found so far, so a few suffice; what is still silent then fails its check."""


async def acquire_live_nodes(client: Client, request: AcquireNodesRequest,
                             lease_of: Callable[[AcquireNodesRequest], Awaitable[AcquireNodesResult]] | None = None,
                             ) -> AcquireNodesResult:
    """The pool's lease (through `lease_of`, default a single update); nodes it chose by count whose agent does
    not poll are excluded and the lease asked again (the pool gives the run's lease on them back)."""
    lease_of = lease_of or (lambda r: pool_update(client, "acquire", r, AcquireNodesResult))
    for _ in range(CHOSEN_AGENT_CHECKS):
        lease = await lease_of(request)
        named = {*request.nodes, *request.spares}
        chosen = [n for n in [*lease.nodes, *lease.spares] if n not in named]
        if not lease.granted or not chosen or not (silent := await missing_agents(client, chosen)):
            return lease
        activity.logger.info("no agent polls %s: leasing others", ", ".join(silent))
        request = request.model_copy(update={"exclude": [*request.exclude, *silent]})
    return lease


class PoolActivities:
    """Controller-side activities a run uses to lease, release and cordon nodes in the pool."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.leases = PoolBatcher(client, "acquire", "acquire_many", lambda rs: AcquireManyRequest(requests=rs),
                                  AcquireManyResult, lambda r: r.results, AcquireNodesResult)
        self.releases = PoolBatcher(client, "release", "release_many", lambda rs: ReleaseManyRequest(requests=rs),
                                    ReleaseManyResult, lambda r: r.results, list[str])

    @activity.defn(name="acquire_nodes")
    async def acquire_nodes(self, request: AcquireNodesRequest) -> AcquireNodesResult:
        """Lease the run's nodes (all or none) and whichever of its spares are free. Idempotent per run."""
        if request.num_nodes or request.num_spares:
            return await acquire_live_nodes(self.client, request, self.leases.submit)
        return await self.leases.submit(request)

    @activity.defn(name="release_nodes")
    async def release_nodes(self, request: NodeRequest) -> list[str]:
        """Give the run's nodes (or one of them) back to the pool. Idempotent."""
        return await self.releases.submit(request)

    @activity.defn(name="cordon_node")
    async def cordon_node(self, request: NodeRequest) -> PoolNode:
        """Take a failed node out of the pool (and out of the run's lease) until it is repaired."""
        return await pool_update(self.client, "cordon", request, PoolNode)
