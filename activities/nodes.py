"""Controller-side activities about the node inventory."""

from __future__ import annotations

from temporalio import activity
from temporalio.client import Client

from activities.models import FindNodeAgentsInput, FindNodeAgentsResult
from trainguard.models import AcquireNodesRequest, AcquireNodesResult, NodeRequest, PoolNode
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


class PoolActivities:
    """Controller-side activities a run uses to lease, release and cordon nodes in the pool."""

    def __init__(self, client: Client) -> None:
        self.client = client

    @activity.defn(name="acquire_nodes")
    async def acquire_nodes(self, request: AcquireNodesRequest) -> AcquireNodesResult:
        """Lease the run's nodes (all or none) and whichever of its spares are free. Idempotent per run."""
        return await pool_update(self.client, "acquire", request, AcquireNodesResult)

    @activity.defn(name="release_nodes")
    async def release_nodes(self, request: NodeRequest) -> list[str]:
        """Give the run's nodes (or one of them) back to the pool. Idempotent."""
        return await pool_update(self.client, "release", request, list[str])

    @activity.defn(name="cordon_node")
    async def cordon_node(self, request: NodeRequest) -> PoolNode:
        """Take a failed node out of the pool (and out of the run's lease) until it is repaired."""
        return await pool_update(self.client, "cordon", request, PoolNode)
