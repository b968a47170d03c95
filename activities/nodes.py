"""Controller-side activities about the node inventory."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from temporalio import activity
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from activities.models import FindNodeAgentsInput, FindNodeAgentsResult
from trainguard import node_task_queue
from trainguard.models import (AcquireManyRequest, AcquireManyResult, AcquireNodesRequest, AcquireNodesResult,
                               NodeRequest, PoolNode, RegisterNodeRequest, ReleaseManyRequest, ReleaseManyResult)
from trainguard.search_attributes import registered

T = TypeVar("T")


async def has_pollers(client: Client, task_queue: str, kind: TaskQueueType.ValueType, max_idle_s: float) -> bool:
    """Whether a worker polled `task_queue` within `max_idle_s` (as the server saw it)."""
    response = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(namespace=client.namespace, task_queue=TaskQueue(name=task_queue),
                                 task_queue_type=kind)
    )
    now = time.time()
    return any(now - p.last_access_time.ToSeconds() <= max_idle_s for p in response.pollers)


AGENT_LOOKUPS_IN_FLIGHT = 32
"""Task-queue descriptions asked at once: 4,096 nodes one after the other took seconds of a run's start."""


async def missing_agents(client: Client, nodes: list[str], max_idle_s: float = 90.0) -> list[str]:
    limit = asyncio.Semaphore(AGENT_LOOKUPS_IN_FLIGHT)

    async def polled(node: str) -> bool:
        async with limit:
            return await has_pollers(client, node_task_queue(node), TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
                                     max_idle_s)

    found = await asyncio.gather(*(polled(n) for n in nodes))
    return [node for node, ok in zip(nodes, found) if not ok]


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


async def pool_handle(client: Client):  # type: ignore[no-untyped-def]
    """The node pool workflow, started on first use (a second start just finds the running one)."""
    from temporalio.common import WorkflowIDConflictPolicy

    from trainguard import TASK_QUEUE
    from workflows.node_pool import POOL_WORKFLOW_ID, POOL_WORKFLOW_TYPE

    return await client.start_workflow(
        POOL_WORKFLOW_TYPE, None, id=POOL_WORKFLOW_ID, task_queue=TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )


POOL_BUSY_FIRST_RETRY_S = 0.05
POOL_BUSY_MAX_RETRY_S = 1.0
"""Temporal admits 10 updates in flight per execution and refuses the rest with RESOURCE_EXHAUSTED: 100 runs
starting at once, or thousands of agents registering, are refused most of the time. Each update takes
milliseconds, so ask again soon (jittered, so the refused do not come back together); the activity's own
retry policy (seconds of backoff) would serialize the start of many runs."""


async def pool_update(client: Client, name: str, request: Any, result_type: type[T]) -> T:
    """An update on the node pool, asked again while the pool has too many updates in flight. The pool is
    started only when it is not there: asking the server to start it before every update was a round trip
    each, of the ones 100 runs starting together queue for."""
    from temporalio.service import RPCError, RPCStatusCode

    from workflows.node_pool import POOL_WORKFLOW_ID

    handle = client.get_workflow_handle(POOL_WORKFLOW_ID)
    delay = POOL_BUSY_FIRST_RETRY_S
    while True:
        try:
            return await handle.execute_update(name, request, result_type=result_type)
        except RPCError as error:
            if error.status is RPCStatusCode.NOT_FOUND:
                handle = await pool_handle(client)
                continue
            if error.status is not RPCStatusCode.RESOURCE_EXHAUSTED:
                raise
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(POOL_BUSY_MAX_RETRY_S, delay * 2)


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


async def register_node(client: Client, node: str, host: str, healthy: bool, peer_url: str = "",
                        labels: dict[str, str] | None = None) -> PoolNode:
    return await pool_update(client, "register",
                             RegisterNodeRequest(node=node, host=host, healthy=healthy, peer_url=peer_url,
                                                 labels=labels or {}), PoolNode)


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


async def peer_urls(client: Client) -> dict[str, str]:
    """Node -> its agent's shard server, as the agents registered them in the pool."""
    return {n.node: n.peer_url for n in await pool_nodes(client) if n.peer_url}


async def pool_nodes(client: Client) -> list[PoolNode]:
    """The pool's nodes; empty when the pool has not started yet."""
    from temporalio.service import RPCError

    from trainguard.models import PoolStatus
    from workflows.node_pool import POOL_WORKFLOW_ID

    try:
        status = await client.get_workflow_handle(POOL_WORKFLOW_ID).query("nodes", result_type=PoolStatus)
    except RPCError:
        return []
    return status.nodes


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
