"""The controller worker: `TrainingRun` workflows and the activities that touch S3 and the inventory.

    python -m workers.controller        (settings from the environment, see trainguard/settings.py)
"""

from __future__ import annotations

import asyncio
import logging

from temporalio.worker import Worker

from activities.checkpoints import StoreActivities
from activities.nodes import NodeActivities, PoolActivities, pool_handle
from activities.scheduler import SchedulerActivities
from trainguard import TASK_QUEUE
from trainguard.connect import connect
from trainguard.search_attributes import ensure_registered
from workers.common import GRACEFUL_SHUTDOWN, STICKY_SCHEDULE_TO_START, setup_logging, stop_event
from workflows.node_pool import NodePool
from workflows.node_group import NodeCalls, NodeGroupWatch
from workflows.training_run import TrainingRun

log = logging.getLogger("trainguard.controller")


def build_worker(client, task_queue: str = TASK_QUEUE) -> Worker:  # type: ignore[no-untyped-def]
    store = StoreActivities()
    nodes = NodeActivities(client)
    pool = PoolActivities(client)
    scheduler = SchedulerActivities()  # TRAINGUARD_SCHEDULER; an unknown value stops the controller at start
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[TrainingRun, NodePool, NodeCalls, NodeGroupWatch],
        activities=[
            store.find_checkpoint,
            store.commit_checkpoint,
            store.commit_checkpoints,
            store.prune_checkpoints,
            nodes.find_node_agents,
            pool.acquire_nodes,
            pool.release_nodes,
            pool.cordon_node,
            scheduler.notify_scheduler,
        ],
        sticky_queue_schedule_to_start_timeout=STICKY_SCHEDULE_TO_START,
        graceful_shutdown_timeout=GRACEFUL_SHUTDOWN,
    )


async def main() -> None:
    setup_logging("controller")
    client = await connect()
    await ensure_registered(client)
    worker = build_worker(client)
    stop = stop_event()
    log.info("controller polling task queue %s", TASK_QUEUE)
    async with worker:
        await pool_handle(client)  # the node inventory exists from the first controller on
        await stop.wait()
    log.info("controller stopped")


if __name__ == "__main__":
    asyncio.run(main())
