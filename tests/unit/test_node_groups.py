"""Node groups at the size of thousands of nodes: a live node whose agent a busy Temporal matches to its
launching watch, or its check at reservation, only after the schedule-to-start timeout gets one more chance
when the run asks for it, and fails when it does not (a small run: the node is gone)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from datetime import timedelta
from uuid import uuid4

import pytest
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.models import (
    CheckNodeInput,
    CheckNodeResult,
    GpuHealth,
    HealthSpec,
    LaunchRanksInput,
    WatchEvent,
    WatchEventKind,
    WatchRanksInput,
)
from trainguard import node_task_queue
from workflows import node_calls, node_group
from workflows.node_calls import NodeCalls
from workflows.node_group import NodeGroupWatch
from workflows.node_group_models import (
    GroupStarted,
    NodeCall,
    NodeCallKind,
    NodeCallsInput,
    NodeCallsResult,
    NodeGroupWatchInput,
    NodeGroupWatchResult,
)

NODES = ["a-0", "a-1"]
"""a-0 is the master (launched by an activity of its own); a-1 launches from its watch."""


@activity.defn(name="watch_ranks")
async def finished_watch(request: WatchRanksInput) -> WatchEvent:
    return WatchEvent(kind=WatchEventKind.FINISHED, node=request.node, detected_at=time.time(), step=10)


@activity.defn(name="check_node")
async def healthy_check(request: CheckNodeInput) -> CheckNodeResult:
    return CheckNodeResult(node=request.node, host=f"{request.node}.test", gpu=GpuHealth())


async def _until_a_call_timed_out(env: WorkflowEnvironment, workflow_id: str) -> None:
    """Real time passes (polling history unlocks no time skipping) until one of the workflow's activities timed
    out waiting for an agent."""
    handle = env.client.get_workflow_handle(workflow_id)
    for _ in range(200):
        await asyncio.sleep(0.05)
        try:
            events = [e.event_type async for e in handle.fetch_history_events()]
        except RPCError:  # not started yet
            continue
        if EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT in events:
            return
    pytest.fail(f"no activity of {workflow_id} timed out")


@workflow.defn(name="GroupParent")
class GroupParent:
    """Stands in for the run: receives the group's `group_started` signal."""

    @workflow.run
    async def run(self, request: NodeGroupWatchInput) -> NodeGroupWatchResult:
        return await workflow.execute_child_workflow(NodeGroupWatch.run, request, id=f"{workflow.info().workflow_id}/g")

    @workflow.signal
    def group_started(self, started: GroupStarted) -> None:
        pass


def _request(parent: str, second_chance: bool) -> NodeGroupWatchInput:
    launch = LaunchRanksInput(workflow_id="wf", attempt=2, node="", node_rank=0, num_nodes=2, ranks_per_node=1,
                              master_addr="a-0", master_port=29500, entrypoint=["python", "train.py"])
    return NodeGroupWatchInput(run_workflow_id=parent, group=0, nodes=NODES, starters=[], launch=launch,
                               launched=[NODES[0]], launch_second_chance=second_chance,
                               watch=WatchRanksInput(workflow_id="wf", attempt=2, node="", health=HealthSpec()))


@pytest.mark.parametrize("second_chance", [True, False], ids=["thousands-of-nodes", "small-run"])
async def test_a_node_matched_late_to_its_launching_watch_launches_there_again(
        env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch, second_chance: bool) -> None:
    """A launching watch no agent started in time: a server busy with a burst of thousands of them, or an agent
    killed as its run launched and back only after the schedule-to-start timeout. A large run schedules it once
    more unasked; a small run asks the node, and its agent answering, launches there again: no live node lost."""
    # Real time, not skipped (the test never waits on a result until the late agent polls): a 2 s wait to be
    # matched, and the workflows unsandboxed so they see it.
    monkeypatch.setattr(node_group, "BURST_SCHEDULE_TO_START", timedelta(seconds=2))
    monkeypatch.setattr(node_group, "NODE_SCHEDULE_TO_START", timedelta(seconds=2))
    checked: list[str] = []

    @activity.defn(name="check_node")
    async def check(request: CheckNodeInput) -> CheckNodeResult:
        checked.append(request.node)
        return await healthy_check(request)

    queue = f"tq-{uuid4()}"
    parent = f"group-{uuid4()}"
    async with Worker(env.client, task_queue=queue, workflows=[GroupParent, NodeGroupWatch],
                      workflow_runner=UnsandboxedWorkflowRunner()), \
            Worker(env.client, task_queue=node_task_queue(NODES[0]), activities=[finished_watch, check]):
        handle = await env.client.start_workflow(GroupParent.run, _request(parent, second_chance), id=parent,
                                                 task_queue=queue, result_type=NodeGroupWatchResult)
        await _until_a_call_timed_out(env, f"{parent}/g")  # a-1's agent polls only after that
        async with Worker(env.client, task_queue=node_task_queue(NODES[1]), activities=[finished_watch, check]):
            result = await handle.result()
    assert result.lost == []
    assert sorted(e.node for e in result.finished) == NODES
    assert checked == ([] if second_chance else [NODES[1]])


async def test_a_node_whose_agent_never_starts_its_launching_watch_nor_answers_is_lost_and_never_started(
        env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node is gone: its launching watch is not started in time, nor is the check that asks it. It launched
    nothing, so a spare may take its place in the attempt."""
    monkeypatch.setattr(node_group, "BURST_SCHEDULE_TO_START", timedelta(seconds=1))
    monkeypatch.setattr(node_group, "NODE_SCHEDULE_TO_START", timedelta(seconds=1))
    monkeypatch.setattr(node_group, "SILENT_CHECK_SCHEDULE_TO_START", timedelta(seconds=1))
    queue, parent = f"tq-{uuid4()}", f"group-{uuid4()}"
    async with Worker(env.client, task_queue=queue, workflows=[GroupParent, NodeGroupWatch],
                      workflow_runner=UnsandboxedWorkflowRunner()), \
            Worker(env.client, task_queue=node_task_queue(NODES[0]), activities=[finished_watch, healthy_check]):
        result = await env.client.execute_workflow(GroupParent.run, _request(parent, False), id=parent,
                                                   task_queue=queue, result_type=NodeGroupWatchResult)
    assert [lost.node for lost in result.lost] == [NODES[1]]
    assert result.lost[0].never_started


@pytest.mark.parametrize("second_chance", [True, False], ids=["thousands-of-nodes", "small-run"])
async def test_a_launching_watch_never_heard_from_launches_again_on_a_node_that_is_there(
        env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch, second_chance: bool) -> None:
    """A launching watch that times out on its heartbeat before its first one: a busy Temporal recorded it as
    started and never delivered it, or its agent was killed (or Temporal restarted) in the launch's first
    seconds. A large run schedules it once more unasked; a small run asks the node, and its agent answering,
    launches there again (a launch adopts ranks of its attempt already running): no live node is lost."""
    monkeypatch.setattr(node_group, "watch_heartbeat_timeout", lambda _every: timedelta(seconds=1))
    delivered: list[tuple[str, bool]] = []
    checked: list[str] = []

    @activity.defn(name="watch_ranks")
    async def lost_then_delivered(request: WatchRanksInput) -> WatchEvent:
        delivered.append((request.node, request.launch is not None))
        if request.node == NODES[1] and len([d for d in delivered if d[0] == NODES[1]]) == 1:
            await asyncio.Event().wait()  # never heard from: silent until cancelled
        return WatchEvent(kind=WatchEventKind.FINISHED, node=request.node, detected_at=time.time(), step=10)

    @activity.defn(name="check_node")
    async def check(request: CheckNodeInput) -> CheckNodeResult:
        checked.append(request.node)
        return await healthy_check(request)

    queue, parent = f"tq-{uuid4()}", f"group-{uuid4()}"
    async with Worker(env.client, task_queue=queue, workflows=[GroupParent, NodeGroupWatch],
                      workflow_runner=UnsandboxedWorkflowRunner()), \
            Worker(env.client, task_queue=node_task_queue(NODES[0]), activities=[lost_then_delivered, check]), \
            Worker(env.client, task_queue=node_task_queue(NODES[1]), activities=[lost_then_delivered, check]):
        result = await env.client.execute_workflow(GroupParent.run, _request(parent, second_chance), id=parent,
                                                   task_queue=queue, result_type=NodeGroupWatchResult)
    assert result.lost == [] and sorted(e.node for e in result.finished) == NODES
    assert [d for d in delivered if d[0] == NODES[1]] == [(NODES[1], True), (NODES[1], True)]
    assert checked == ([] if second_chance else [NODES[1]])


@pytest.mark.parametrize("second_chance", [True, False], ids=["thousands-of-nodes", "small-run"])
async def test_a_check_matched_late_gets_a_second_chance_only_when_asked(
        env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch, second_chance: bool) -> None:
    options = node_calls.CALLS[NodeCallKind.CHECK]
    monkeypatch.setitem(node_calls.CALLS, NodeCallKind.CHECK,
                        dataclasses.replace(options, schedule_to_start=timedelta(seconds=2)))
    queue, calls_id = f"tq-{uuid4()}", f"calls-{uuid4()}"
    request = NodeCallsInput(kind=NodeCallKind.CHECK, summary="check {node}", second_chance=second_chance,
                             calls=[NodeCall(node=n, input=CheckNodeInput(workflow_id="wf", node=n).model_dump(mode="json"))
                                    for n in NODES])
    async with Worker(env.client, task_queue=queue, workflows=[NodeCalls], workflow_runner=UnsandboxedWorkflowRunner()), \
            Worker(env.client, task_queue=node_task_queue(NODES[0]), activities=[healthy_check]):
        handle = await env.client.start_workflow(NodeCalls.run, request, id=calls_id, task_queue=queue,
                                                 result_type=NodeCallsResult)
        await _until_a_call_timed_out(env, calls_id)  # a-1's agent polls late
        async with Worker(env.client, task_queue=node_task_queue(NODES[1]), activities=[healthy_check]):
            result = await handle.result()
    answered = [o.node for o in result.outcomes if o.result is not None]
    assert answered == (NODES if second_chance else NODES[:1])


def test_a_run_of_thousands_of_nodes_heartbeats_a_bounded_number_of_times_a_second() -> None:
    from workflows.node_group import HEARTBEATS_PER_S, watch_heartbeat_every_s, watch_heartbeat_timeout

    assert watch_heartbeat_every_s(HEARTBEATS_PER_S) is None  # every poll, as the agent throttles it
    assert watch_heartbeat_timeout(None) == timedelta(seconds=10)
    for nodes in (1024, 4096, 16384):
        every = watch_heartbeat_every_s(nodes)
        assert every is not None and nodes / every == pytest.approx(HEARTBEATS_PER_S, rel=0.01)
        assert watch_heartbeat_timeout(every) >= timedelta(seconds=max(10.0, 3 * every))
    assert watch_heartbeat_timeout(watch_heartbeat_every_s(4096)) == timedelta(seconds=61.44)


def test_a_launching_burst_of_thousands_of_nodes_may_wait_in_proportion_to_be_matched() -> None:
    from workflows.node_calls import BURST_SCHEDULE_TO_START
    from workflows.node_group import LAUNCH_BURST_STARTS_PER_S, launch_wait_s

    assert launch_wait_s(1024) == BURST_SCHEDULE_TO_START.total_seconds()
    assert launch_wait_s(4096) == pytest.approx(4096 / LAUNCH_BURST_STARTS_PER_S)
    assert launch_wait_s(4096) > BURST_SCHEDULE_TO_START.total_seconds()


@pytest.mark.parametrize("launching", [False, True], ids=["watch", "launching-watch"])
@pytest.mark.parametrize("silent_every_time", [False, True], ids=["server-or-agent-restarted", "broken-watch"])
async def test_a_watch_gone_silent_on_a_node_whose_agent_answers_is_watched_again(
        env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch, silent_every_time: bool, launching: bool) -> None:
    """A watch that heartbeated, then timed out on its heartbeat (the Temporal server restarted, or its agent was
    killed and a new one adopted the ranks): the node is asked, and its agent answering, the node is watched
    again, not lost. A watch that keeps going silent while the agent answers is a lost node after all."""
    monkeypatch.setattr(node_group, "watch_heartbeat_timeout", lambda _every: timedelta(seconds=1))
    monkeypatch.setattr(node_group, "MAX_SILENT_REWATCHES", 2)
    delivered: list[str] = []
    launched: list[str] = []

    @activity.defn(name="watch_ranks")
    async def silent_then_finished(request: WatchRanksInput) -> WatchEvent:
        delivered.append(request.node)
        if request.launch is not None:
            launched.append(request.node)
        if request.node == NODES[1] and (silent_every_time or delivered.count(NODES[1]) == 1):
            activity.heartbeat({"node": request.node, "attempt": request.attempt, "steps": {"1": 5}})
            await asyncio.Event().wait()  # its heartbeats are lost from here on
        return WatchEvent(kind=WatchEventKind.FINISHED, node=request.node, detected_at=time.time(), step=10)

    request = _request(f"group-{uuid4()}", False)
    if not launching:  # else a-1 launches from its watch, and heartbeated a step: it had launched
        request = request.model_copy(update={"launch": None, "launched": []})
    queue = f"tq-{uuid4()}"
    async with Worker(env.client, task_queue=queue, workflows=[GroupParent, NodeGroupWatch],
                      workflow_runner=UnsandboxedWorkflowRunner()), \
            Worker(env.client, task_queue=node_task_queue(NODES[0]), activities=[silent_then_finished, healthy_check]), \
            Worker(env.client, task_queue=node_task_queue(NODES[1]), activities=[silent_then_finished, healthy_check]):
        result = await env.client.execute_workflow(GroupParent.run, request, id=request.run_workflow_id,
                                                   task_queue=queue, result_type=NodeGroupWatchResult)
    if silent_every_time:
        [lost] = result.lost
        assert lost.node == NODES[1] and "stopped heartbeating" in lost.detail
        assert delivered.count(NODES[1]) == 3  # the first watch and two more
    else:
        assert result.lost == [] and sorted(e.node for e in result.finished) == NODES
        assert delivered.count(NODES[1]) == 2
    assert launched == ([NODES[1]] if launching else [])  # launched once, not again
