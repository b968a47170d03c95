"""A run's calls to its nodes: one contract per kind of call, and the `NodeCalls` child that makes them.

Each per-node operation (check, download, launch, rejoin, stop, checkpoint request, hang evidence) is one
activity on each node's agent, named by its `NodeCallKind`, with the input and result models, timeouts and retry
policy of its row in `CALLS`. A run fans a call out over groups of `NODES_PER_GROUP` nodes, a `NodeCalls` child
per group (a run whose calls fit in one group makes them itself, through `call_nodes`): Temporal allows 2,000
pending activities per execution, and a 1,024-node run that stopped every node itself hung at its first crash.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from activities.models import (CheckNodeInput, CheckNodeResult, CollectEvidenceInput, CollectEvidenceResult,
                                   DownloadShardsInput, DownloadShardsResult, LaunchRanksInput, LaunchRanksResult,
                                   RejoinRanksInput, RejoinRanksResult, RequestCheckpointInput,
                                   RequestCheckpointResult, StopRanksInput, StopRanksResult)
    from trainguard import NODE_CALLS_WORKFLOW, node_task_queue
    from trainguard.error_types import ErrorType, non_retryable
    from workflows.node_group_models import NodeCall, NodeCallKind, NodeCallsInput, NodeCallsResult, NodeOutcome

NODES_PER_GROUP = 64
"""Nodes per `NodeCalls` child (a `NodeGroupWatch` takes `WATCH_NODES_PER_GROUP`). A group
keeps at most one activity per node pending, and a 4,096-node call 64 children: both far inside the 2,000 limit,
with room for growth. Fewer, larger groups would put more events in one history; more, smaller ones more
children in the run's."""

NODE_SCHEDULE_TO_START = timedelta(seconds=10)
"""Node-pinned activities: a dead agent never starts them; notice that instead of waiting forever. A live agent
polls all the time and starts one in milliseconds; 10 s, like the watch's heartbeat timeout, means it is gone."""

BURST_SCHEDULE_TO_START = timedelta(seconds=30)
"""...but where a call reaches every node of a run at once and nothing waits on a dead node being noticed
fast (the check at reservation, a relaunch's launching watches, just after every node answered the stop),
thousands of activities queue together, and on a small Temporal the last is matched to its agent seconds
later: at 1,024 nodes on a loaded two-core dev server, checks waited past 10 s and live nodes read as dead.
The stop keeps 10 s: a node that does not start it is how a crash that was a lost node's symptom is told
(fan-out slots keep its queue short)."""

CHECK_NODE_TIMEOUT = timedelta(seconds=30)
"""An NVML query and a reply; anything slower is a sick node."""

LAUNCH_TIMEOUT = timedelta(minutes=2)
"""Spawning processes takes milliseconds; minutes means the node is in trouble."""

STOP_TIMEOUT = timedelta(seconds=60)
"""SIGTERM, a grace period, then SIGKILL of whole process groups, and reaping them."""

TRANSFER_TIMEOUT = timedelta(minutes=30)
TRANSFER_HEARTBEAT_TIMEOUT = timedelta(minutes=2)
TRANSFER_SCHEDULE_TO_CLOSE = timedelta(hours=2)
"""Download retries stop after this: long enough to ride out a store outage."""

EVIDENCE_TIMEOUT = timedelta(seconds=5)
"""Asking a node's ranks for their stacks and position takes half a second at most (`ANSWER_TIMEOUT_S`)."""

EVIDENCE_RETRY = RetryPolicy(maximum_attempts=1)
"""Evidence is asked once: the recovery waits on it, and a node that cannot answer is evidence too."""

NODE_CALL_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5),
                              maximum_attempts=3)
"""A node call that fails three times is a node problem; more retries would only delay the remedy."""

TRANSFER_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), backoff_coefficient=2.0,
                             maximum_interval=timedelta(seconds=30),
                             non_retryable_error_types=non_retryable(
                                 ErrorType.CORRUPT_CHECKPOINT, ErrorType.NO_LOCAL_SHARDS, ErrorType.BAD_SPEC))
"""S3 outages heal: retry with backoff (bounded by TRANSFER_SCHEDULE_TO_CLOSE); bad bytes never heal."""

@dataclass(frozen=True)
class NodeCallContract:
    """One kind of node call: the activity's input and result models, its timeouts and its retry policy."""

    input: type[BaseModel]
    result: type[BaseModel]
    start_to_close: timedelta
    retry: RetryPolicy
    heartbeat: timedelta | None = None
    schedule_to_close: timedelta | None = None
    schedule_to_start: timedelta = NODE_SCHEDULE_TO_START


CALLS: dict[NodeCallKind, NodeCallContract] = {
    NodeCallKind.CHECK: NodeCallContract(CheckNodeInput, CheckNodeResult, CHECK_NODE_TIMEOUT, NODE_CALL_RETRY,
                                         schedule_to_start=BURST_SCHEDULE_TO_START),
    NodeCallKind.DOWNLOAD: NodeCallContract(DownloadShardsInput, DownloadShardsResult, TRANSFER_TIMEOUT,
                                            TRANSFER_RETRY, TRANSFER_HEARTBEAT_TIMEOUT, TRANSFER_SCHEDULE_TO_CLOSE),
    NodeCallKind.LAUNCH: NodeCallContract(LaunchRanksInput, LaunchRanksResult, LAUNCH_TIMEOUT, NODE_CALL_RETRY),
    NodeCallKind.REJOIN: NodeCallContract(RejoinRanksInput, RejoinRanksResult, LAUNCH_TIMEOUT, NODE_CALL_RETRY),
    NodeCallKind.STOP: NodeCallContract(StopRanksInput, StopRanksResult, STOP_TIMEOUT, NODE_CALL_RETRY),
    NodeCallKind.REQUEST_CHECKPOINT: NodeCallContract(RequestCheckpointInput, RequestCheckpointResult,
                                                      CHECK_NODE_TIMEOUT, NODE_CALL_RETRY),
    NodeCallKind.COLLECT_EVIDENCE: NodeCallContract(CollectEvidenceInput, CollectEvidenceResult, EVIDENCE_TIMEOUT,
                                                    EVIDENCE_RETRY),
}
"""Every node call a run makes, one row each: `RunNodes.fan_out` checks a call's input and reads its answer here."""

T = TypeVar("T")


def groups_of(nodes: list[T], size: int = NODES_PER_GROUP) -> list[list[T]]:
    """Consecutive groups of at most `size` nodes, in order."""
    return [nodes[start : start + size] for start in range(0, len(nodes), size)]

def not_started(error: ActivityError) -> bool:
    """The activity timed out before any agent started it."""
    return isinstance(error.cause, TimeoutError) and error.cause.type is TimeoutType.SCHEDULE_TO_START

def node_failure(node: str, error: ActivityError) -> NodeOutcome:
    cause: BaseException | None = error.cause
    while cause is not None and cause.__cause__ is not None and not isinstance(cause, ApplicationError):
        cause = cause.__cause__
    kind = cause.type if isinstance(cause, ApplicationError) else None
    details = cause.details if isinstance(cause, ApplicationError) else ()
    away = details[0] if kind == ErrorType.AGENT_SHUTDOWN and details and isinstance(details[0], (int, float)) \
        else None
    return NodeOutcome(node=node, error=str(cause or error), error_type=kind, away_since=away)

# --------------------------------------------------------------------------------------- workflows


SANDBOXED = False
"""`NodeCalls` and `NodeGroupWatch` run outside the workflow sandbox. A 4,096-node relaunch starts 256 watch
groups at once, and each sandboxed start built a sandbox of its own: unsandboxed, the controller's CPU for the
whole `make bench-nodes` run at 4,096 nodes fell from 65.6 s to 37.9 s (wall 317 s to 281 s). They are small and
call nothing but the workflow API and this module (no clock, no randomness, no I/O); the replay tests replay
their recorded histories as they do the run's."""

@workflow.defn(name=NODE_CALLS_WORKFLOW, sandboxed=SANDBOXED)
class NodeCalls:
    """One per-node activity on each node of a group, in parallel; every node's result or failure."""

    @workflow.run
    async def run(self, request: NodeCallsInput) -> NodeCallsResult:
        return await call_nodes(request)


async def call_nodes(request: NodeCallsInput) -> NodeCallsResult:
    """Each call's activity, in parallel, from the calling workflow (a `NodeCalls` child, or a run whose
    calls fit in one group); every node's result or failure, in the calls' order."""
    options = CALLS[request.kind]

    async def call(one: NodeCall, chances: int) -> NodeOutcome:
        try:
            result = await workflow.execute_activity(
                request.kind.value, one.input,
                task_queue=node_task_queue(one.node),
                start_to_close_timeout=options.start_to_close,
                schedule_to_close_timeout=options.schedule_to_close,
                schedule_to_start_timeout=options.schedule_to_start,
                heartbeat_timeout=options.heartbeat,
                retry_policy=options.retry,
                result_type=dict,
                summary=request.summary.replace("{node}", one.node),
            )
        except ActivityError as error:
            if chances > 1 and not_started(error):
                workflow.logger.warning("%s did not start %s in time: scheduled again", one.node, request.kind.value)
                return await call(one, chances - 1)
            return node_failure(one.node, error)
        return NodeOutcome(node=one.node, result=result)

    chances = 2 if request.second_chance else 1
    return NodeCallsResult(outcomes=list(await asyncio.gather(*(call(c, chances) for c in request.calls))))
