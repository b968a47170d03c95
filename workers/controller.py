"""The controller worker: `TrainingRun` workflows and the activities that touch S3 and the inventory.

    python -m workers.controller        (settings from the environment, see trainguard/settings.py)
"""

from __future__ import annotations

import asyncio
import logging

from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
from temporalio.service import RPCError
from temporalio.worker import Worker, WorkerDeploymentConfig

from activities.checkpoint_store import MANIFEST_KEY_ENV, StoreActivities, manifest_key_from_env
from activities.nodes import NodeActivities, PoolActivities, RegistrationActivities, pool_handle
from activities.peers import PEER_TOKEN_ENV, peer_token
from activities.scheduler import SchedulerActivities
from workers.slurm_drains import SlurmDrainWatch, keep_watching
from trainguard import TASK_QUEUE
from trainguard.connect import connect
from trainguard.search_attributes import ensure_registered
from trainguard.settings import Settings
from trainguard.versioning import UNVERSIONED, claim_first_version, controller_build_id
from workers.common import GRACEFUL_SHUTDOWN, STICKY_SCHEDULE_TO_START, setup_logging, stop_event
from workflows.node_pool import NodePool
from workflows.node_calls import NodeCalls
from workflows.node_group import NodeGroupWatch
from workflows.rank_log import ReadRankLog
from workflows.training_run import TrainingRun

log = logging.getLogger("trainguard.controller")

WORKFLOW_TASK_POLLS = 20
"""Workflow-task polls the controller keeps open (the SDK's default is 5)."""

WORKFLOW_TASK_SLOTS = 20
"""Workflow tasks the controller works on at once (the SDK's default is 100). They share one Python process
(the GIL): 100 at once made each of 100 runs' first tasks take longer than Temporal's 10 s workflow task
timeout on two loaded cores, so every one was timed out and redone, and none of the runs got to lease its
nodes in 300 s (`make bench-pool`). Fewer at once finish each in its own CPU time."""


def deployment_config(settings: Settings) -> WorkerDeploymentConfig | None:
    """Worker versioning, on unless `TRAINGUARD_BUILD_ID=unversioned`: runs are pinned to the build that started
    them (their node groups with them), so a new build takes only new runs and every history replays on the code
    that wrote it. The build is `TRAINGUARD_BUILD_ID`, else derived from the workflow code
    (`trainguard.versioning`). The node pool, which lives forever, moves to a new build when it is promoted
    (`trainguard controller promote`: docs/operations/upgrades.md)."""
    build_id = controller_build_id(settings)
    if build_id is None:
        return None
    return WorkerDeploymentConfig(
        version=WorkerDeploymentVersion(deployment_name=settings.deployment, build_id=build_id),
        use_worker_versioning=True, default_versioning_behavior=VersioningBehavior.PINNED)


async def take_first_version(client, config: WorkerDeploymentConfig | None) -> None:
    """A first deploy makes its own build current (new runs would otherwise wait for unversioned workers); a
    later build only says how it is promoted. Errors are logged, not raised: the controller serves its pinned
    runs whatever the routing."""
    if config is None:
        log.info("worker versioning off (TRAINGUARD_BUILD_ID=%s): every run replays on this build", UNVERSIONED)
        return
    version = config.version
    try:
        current = await claim_first_version(client, version.deployment_name, version.build_id)
    except RPCError as error:
        log.error("could not make build %s current in worker deployment %s (%s: %s): new runs may wait; run "
                  "`trainguard controller promote --build-id %s`, or set TRAINGUARD_BUILD_ID=%s on a server "
                  "without worker deployments", version.build_id, version.deployment_name, error.status.name,
                  error.message, version.build_id, UNVERSIONED)
        return
    if current == version.build_id:
        log.info("build %s of worker deployment %s is current: new runs start on it", version.build_id,
                 version.deployment_name)
    else:
        log.warning("build %s polls beside the current build %s of worker deployment %s: it takes only the runs "
                    "pinned to it until promoted (`trainguard controller promote --build-id %s`)",
                    version.build_id, current or "(unversioned workers)", version.deployment_name, version.build_id)


def build_worker(client, task_queue: str = TASK_QUEUE,
                 settings: Settings | None = None, token: str | None = None,
                 manifest_key: bytes | None = None) -> Worker:
    """`token`: the pool's peer token registrations are checked with, and node records and relaunch decisions
    tagged with (default `TRAINGUARD_PEER_TOKEN`; without one the pool takes any well-formed registration, and
    records and decisions go unchecked and untagged). `manifest_key`: what tags the manifests this controller
    commits and checks the ones it restores (default `TRAINGUARD_MANIFEST_KEY`; without one manifests go
    untagged and any is restored)."""
    secret = manifest_key if manifest_key is not None else manifest_key_from_env()
    if secret is None:
        log.warning("%s is not set: manifests are not tagged, and a manifest planted in the store cannot be told "
                    "from one this controller committed", MANIFEST_KEY_ENV)
    pool_token = token if token is not None else peer_token()
    if pool_token is None:
        log.warning("%s is not set: node records and relaunch decisions in the store are not tagged, and one "
                    "planted there cannot be told from an agent's or this controller's", PEER_TOKEN_ENV)
    store = StoreActivities(secret, pool_token)
    registrations = RegistrationActivities(pool_token)
    nodes = NodeActivities(client)
    pool = PoolActivities(client)
    scheduler = SchedulerActivities()  # TRAINGUARD_SCHEDULER; an unknown value stops the controller at start
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[TrainingRun, NodePool, NodeCalls, NodeGroupWatch, ReadRankLog],
        activities=[
            store.find_checkpoint,
            store.commit_checkpoints,
            store.publish_attempt,
            nodes.find_node_agents,
            nodes.find_agents_back,
            pool.acquire_nodes,
            pool.release_nodes,
            pool.cordon_node,
            registrations.verify_registration,
            scheduler.notify_scheduler,
        ],
        sticky_queue_schedule_to_start_timeout=STICKY_SCHEDULE_TO_START,
        graceful_shutdown_timeout=GRACEFUL_SHUTDOWN,
        # A large run's node groups make bursts of workflow tasks (64 children answering at once): with the
        # SDK's 5 polls, tasks queued past the sticky timeout and were replayed from scratch elsewhere.
        max_concurrent_workflow_task_polls=WORKFLOW_TASK_POLLS,
        max_concurrent_workflow_tasks=WORKFLOW_TASK_SLOTS,
        deployment_config=deployment_config(settings or Settings.from_env()),
    )


async def main() -> None:
    setup_logging("controller")
    client = await connect()
    await ensure_registered(client)
    settings = Settings.from_env()
    worker = build_worker(client, settings=settings)
    stop = stop_event()
    log.info("controller polling task queue %s", TASK_QUEUE)
    drains = SlurmDrainWatch.from_env(client)  # TRAINGUARD_SCHEDULER=slurm: an operator's drain moves runs off
    async with worker:
        await take_first_version(client, deployment_config(settings))  # before the pool starts: on this build
        await pool_handle(client)  # the node inventory exists from the first controller on
        # Restarted, with an error logged, should it ever end while the controller runs (`keep_watching`).
        watching = asyncio.create_task(keep_watching(drains, stop)) if drains else None
        await stop.wait()
        if watching:
            await watching
    log.info("controller stopped")


if __name__ == "__main__":
    asyncio.run(main())
