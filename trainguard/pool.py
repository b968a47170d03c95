"""Client-side calls about the node inventory: which agents poll their queues, and the node pool workflow.

The CLI, the Python client and the dev stack use these as the controller's activities do, so they live in the
public package (`activities.nodes` imports them from here)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import random
import re
import time
from typing import Any, TypeVar

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from trainguard import POOL_WORKFLOW_ID, POOL_WORKFLOW_TYPE, TASK_QUEUE, node_task_queue
from trainguard.models import PoolNode, PoolStatus, RegisterNodeRequest, RegistrationVerdict

T = TypeVar("T")


LOOKUP_BUSY_FIRST_RETRY_S = 0.1
LOOKUP_BUSY_MAX_RETRY_S = 2.0
"""A namespace refuses requests past its rate limit (RESOURCE_EXHAUSTED, "namespace rate limit exceeded"):
looking up 4,096 nodes' queues at a run's start, beside the agents' heartbeats, reached it on the dev server,
and the lookup failed the reservation. Refused lookups are asked again soon, jittered and backing off."""


STARTING_SERVER_ERRORS = frozenset({"CANCELLED", "UNAVAILABLE", "DEADLINE_EXCEEDED"})
"""What a Temporal server just started may answer a lookup for a moment ("context canceled" at load 8): not
ready yet. A caller with a deadline (`DevStack.up`) asks again."""


async def has_pollers(client: Client, task_queue: str, kind: TaskQueueType.ValueType, max_idle_s: float) -> bool:
    """Whether a worker polled `task_queue` within `max_idle_s` (as the server saw it)."""
    from temporalio.service import RPCError, RPCStatusCode

    request = DescribeTaskQueueRequest(namespace=client.namespace, task_queue=TaskQueue(name=task_queue),
                                       task_queue_type=kind)
    delay = LOOKUP_BUSY_FIRST_RETRY_S
    while True:
        try:
            response = await client.workflow_service.describe_task_queue(request)
            break
        except RPCError as error:
            if error.status is not RPCStatusCode.RESOURCE_EXHAUSTED:
                raise
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(LOOKUP_BUSY_MAX_RETRY_S, delay * 2)
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


async def pool_handle(client: Client):
    """The node pool workflow, started on first use (a second start just finds the running one)."""
    from temporalio.common import WorkflowIDConflictPolicy

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


# ------------------------------------------------------------------------ registration proofs (the contract)
# An agent signs its registration with the pool's peer token; the controller checks it in an activity
# (`activities.nodes.RegistrationActivities`) with its own copy, since the pool workflow cannot read a secret. Both
# sides build the signed bytes here.

REGISTRATION_PROOF_CONTEXT = b"trainguard-register-v1\n"
"""Prefixes the signed bytes, so a registration's tag is never valid as any other message keyed with the token."""
REGISTRATION_MAX_SKEW_S = 300.0
"""How far a registration's signing time may be from the controller's clock: it bounds how long a tag copied
out of the pool's history can be replayed (the pool refuses one not newer than the node's last, too)."""
PROOF_PATTERN = re.compile(r"[0-9a-f]{64}")


def peer_url_of(host: str, port: int) -> str:
    """The peer address an agent on `host` serves its shards at (brackets round an IPv6 address): the only one
    the pool takes in its registration."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def registration_message(request: RegisterNodeRequest) -> bytes:
    """The bytes a registration's proof signs: every field the pool acts on, in one canonical JSON."""
    fields = {"node": request.node, "host": request.host, "healthy": request.healthy, "peer_url": request.peer_url,
              "labels": dict(sorted(request.labels.items())), "signed_at_ms": request.signed_at_ms}
    if request.slurm_job is not None:  # signed only when set: agents outside Slurm sign what they always did
        fields["slurm_job"] = request.slurm_job
    return REGISTRATION_PROOF_CONTEXT + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def registration_proof(token: str, request: RegisterNodeRequest) -> str:
    return hmac.new(token.encode(), registration_message(request), hashlib.sha256).hexdigest()


def signed_registration(request: RegisterNodeRequest, token: str | None, now_s: float | None = None,
                        ) -> RegisterNodeRequest:
    """`request` signed now with the pool's peer token; unsigned when the agent has none."""
    if not token:
        return request.model_copy(update={"signed_at_ms": 0, "proof": ""})
    signed = request.model_copy(update={"signed_at_ms": int((time.time() if now_s is None else now_s) * 1000),
                                        "proof": ""})
    return signed.model_copy(update={"proof": registration_proof(token, signed)})


def check_registration(request: RegisterNodeRequest, token: str | None, now_s: float) -> RegistrationVerdict:
    """The controller's verdict on a registration's proof, with its own copy of the pool's token (`token`)."""
    if not token:
        return RegistrationVerdict(accepted=True, why="the controller has no TRAINGUARD_PEER_TOKEN: "
                                                      "registrations are not authenticated")
    if not request.proof:
        return RegistrationVerdict(accepted=False, why="unsigned: the pool requires the agent to hold its "
                                                       "TRAINGUARD_PEER_TOKEN (the controller has one)")
    if not hmac.compare_digest(request.proof, registration_proof(token, request)):
        return RegistrationVerdict(accepted=False, why="the proof does not match: the agent's "
                                                       "TRAINGUARD_PEER_TOKEN is not the controller's")
    skew = request.signed_at_ms / 1000 - now_s
    if abs(skew) > REGISTRATION_MAX_SKEW_S:
        return RegistrationVerdict(accepted=False, why=f"signed {abs(skew):.0f} s {'after' if skew > 0 else 'before'}"
                                   f" the controller's clock, more than {REGISTRATION_MAX_SKEW_S:.0f} s: an old "
                                   "registration replayed, or clocks out of sync (run NTP)")
    return RegistrationVerdict(accepted=True, authenticated=True)


async def register_node(client: Client, node: str, host: str, healthy: bool, peer_url: str = "",
                        labels: dict[str, str] | None = None, token: str | None = None,
                        slurm_job: int | None = None) -> PoolNode:
    """Register (or re-register) `node` in the pool, signed with the pool's peer token `token` when given;
    `slurm_job`: the Slurm job whose step started the agent."""
    request = RegisterNodeRequest(node=node, host=host, healthy=healthy, peer_url=peer_url, labels=labels or {},
                                  slurm_job=slurm_job)
    return await pool_update(client, "register", signed_registration(request, token), PoolNode)


async def peer_urls(client: Client) -> dict[str, str]:
    """Node -> its agent's shard server, as the agents registered them in the pool."""
    return {n.node: n.peer_url for n in await pool_nodes(client) if n.peer_url}


async def pool_nodes(client: Client) -> list[PoolNode]:
    """The pool's nodes; empty when the pool has not started yet."""
    from temporalio.service import RPCError

    try:
        status = await client.get_workflow_handle(POOL_WORKFLOW_ID).query("nodes", result_type=PoolStatus)
    except RPCError:
        return []
    return status.nodes


AGENT_WAIT_POLL_S = 1.0
"""How often `wait_for_agents` asks again: agents take seconds to start (Python imports, NVML)."""
REGISTRATION_CLOCK_SLACK_S = 5.0
"""Registrations are stamped with the workflow clock; this much skew against the caller's is allowed."""


def agents_not_ready(nodes: list[str], pool: list[PoolNode], missing: list[str], since: float) -> list[str]:
    """Nodes whose agent has not both polled its task queue and registered in the pool since `since`: either
    alone can be left from an earlier job on the node (a poller is remembered about a minute, a registration
    for ever)."""
    registered = {entry.node: entry.registered_at for entry in pool}
    return [n for n in nodes if n in missing or registered.get(n, 0.0) < since - REGISTRATION_CLOCK_SLACK_S]


async def wait_for_agents(client: Client, nodes: list[str], since: float, timeout_s: float) -> list[str]:
    """Wait until every node's agent is up (`agents_not_ready`); the nodes still missing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        waiting = agents_not_ready(nodes, await pool_nodes(client), await missing_agents(client, nodes), since)
        if not waiting or time.monotonic() >= deadline:
            return waiting
        await asyncio.sleep(AGENT_WAIT_POLL_S)
