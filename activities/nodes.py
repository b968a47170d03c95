"""Controller-side activities about the node inventory."""

from __future__ import annotations

import time

from temporalio import activity
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from activities.models import FindNodeAgentsInput, FindNodeAgentsResult
from trainguard import node_task_queue
from trainguard.search_attributes import registered


async def has_pollers(client: Client, task_queue: str, kind: TaskQueueType.ValueType, max_idle_s: float) -> bool:
    """Whether a worker polled `task_queue` within `max_idle_s` (as the server saw it)."""
    response = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(namespace=client.namespace, task_queue=TaskQueue(name=task_queue),
                                 task_queue_type=kind)
    )
    now = time.time()
    return any(now - p.last_access_time.ToSeconds() <= max_idle_s for p in response.pollers)


async def missing_agents(client: Client, nodes: list[str], max_idle_s: float = 90.0) -> list[str]:
    return [
        node for node in nodes
        if not await has_pollers(client, node_task_queue(node), TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY, max_idle_s)
    ]


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
