"""The pool's `register` update is guarded (issue 27 item 6): it had no validator, so it lifted an operator's
cordon, made phantom nodes (three of them broke every `num_nodes` run), and pointed a node's peer address at a
listener, which then received the pool's peer token on the next restore."""

from __future__ import annotations

import asyncio
import base64
import re
import uuid

import pytest
from temporalio import activity
from temporalio.client import WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from activities.nodes import RegistrationActivities
from activities.scheduler import NotifySchedulerInput, NotifySchedulerResult
from trainguard.models import AcquireNodesRequest, NodeRequest, PoolNode, RegisterNodeRequest, RegistrationVerdict
from trainguard.pool import REGISTRATION_MAX_SKEW_S, check_registration, registration_proof, signed_registration
from workflows.node_pool import NodePool
from workflows.pool_rules import (UNHEALTHY_AT_REGISTRATION, cordon, grant, operator_cordon, register,
                                  registration_problem)

TOKEN = "pool-token-0123456789abcdef"
NOW = 1_800_000_000.0


def _request(**fields: object) -> RegisterNodeRequest:
    return RegisterNodeRequest(**{"node": "node-0", "host": "10.0.0.5", "peer_url": "http://10.0.0.5:7300",
                                  **fields})


# ---------------------------------------------------------------------------------------- what is well formed


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        pytest.param({}, "", id="an-agent's-own"),
        pytest.param({"host": "", "peer_url": ""}, "", id="no-host-no-peer-tier"),
        pytest.param({"host": "gpu-17.cluster.example", "peer_url": "http://gpu-17.cluster.example:1"}, "",
                     id="dns-name"),
        pytest.param({"host": "fd00::5", "peer_url": "http://[fd00::5]:7300"}, "", id="ipv6"),
        pytest.param({"node": "Node_X"}, "node 'Node_X'", id="phantom-not-a-node-id"),
        pytest.param({"node": "node-0\n"}, "node 'node-0\\n'", id="phantom-trailing-newline"),
        pytest.param({"node": "n" * 64}, "at most 63", id="phantom-too-long"),
        pytest.param({"node": ""}, "node ''", id="phantom-empty"),
        pytest.param({"host": "10.0.0.5; rm -rf /", "peer_url": ""}, "neither an IP address", id="host-syntax"),
        pytest.param({"host": "a" * 254, "peer_url": ""}, "more than 253", id="host-size"),
        pytest.param({"peer_url": "http://10.6.6.6:7300"}, "on the node's own host", id="peer-on-another-host"),
        pytest.param({"peer_url": "http://10.0.0.5:7300@10.6.6.6:80"}, "own host", id="peer-userinfo-trick"),
        pytest.param({"peer_url": "http://10.0.0.5:7300/x"}, "own host", id="peer-with-a-path"),
        pytest.param({"peer_url": "https://10.0.0.5:7300"}, "own host", id="peer-other-scheme"),
        pytest.param({"peer_url": "http://10.0.0.5:0"}, "own host", id="peer-port-0"),
        pytest.param({"peer_url": "http://10.0.0.5:99999"}, "own host", id="peer-port-too-big"),
        pytest.param({"host": "", "peer_url": "http://10.0.0.5:7300"}, "own host", id="peer-without-host"),
        pytest.param({"labels": {"gpu": "h100\n"}}, "label 'gpu'", id="label-value-newline"),
        pytest.param({"labels": {"-gpu": "h100"}}, "label '-gpu'", id="label-key-syntax"),
        pytest.param({"labels": {"k": "v" * 64}}, "label 'k'", id="label-value-size"),
        pytest.param({"labels": {f"k{i}": "v" for i in range(33)}}, "33 labels", id="too-many-labels"),
        pytest.param({"proof": "zz" * 32, "signed_at_ms": 1}, "not an HMAC", id="proof-syntax"),
        pytest.param({"proof": "", "signed_at_ms": 1}, "both or neither", id="a-time-without-proof"),
    ],
)
def test_a_registration_is_well_formed_or_refused_naming_the_field(fields: dict[str, object], problem: str) -> None:
    found = registration_problem(_request(**fields), None)
    assert (problem in found and found) if problem else found == ""


def test_a_signed_registration_no_newer_than_the_nodes_last_is_a_replay() -> None:
    nodes: dict[str, PoolNode] = {}
    first = signed_registration(_request(), TOKEN, NOW)
    assert registration_problem(first, None) == ""
    register(nodes, first, now=1.0)
    assert "replayed" in registration_problem(first, nodes["node-0"])
    assert registration_problem(signed_registration(_request(), TOKEN, NOW + 1), nodes["node-0"]) == ""


# ------------------------------------------------------------------------------------- an operator's cordon


@pytest.mark.parametrize(
    ("reason", "by", "lifted"),
    [
        pytest.param("fan failure", None, False, id="an-operator's"),
        pytest.param("cordoned by an operator", None, False, id="an-operator's-default-reason"),
        pytest.param("gpu_fault: XID 79", "run-1", True, id="a-run's-for-a-failure"),
        pytest.param(UNHEALTHY_AT_REGISTRATION, None, True, id="the-pool's-for-a-failed-gpu-check"),
    ],
)
def test_a_healthy_registration_never_lifts_an_operators_cordon(reason: str, by: str | None, lifted: bool) -> None:
    nodes = {"a": PoolNode(node="a")}
    cordon(nodes, "a", reason, now=10.0, by=by)
    assert operator_cordon(nodes["a"]) is not lifted
    register(nodes, RegisterNodeRequest(node="a", healthy=True), now=20.0)
    assert (nodes["a"].cordoned is None) is lifted
    assert grant(nodes, AcquireNodesRequest(run_id="r", nodes=["a"])).granted is lifted


def test_histories_before_the_guard_replay_as_they_ran() -> None:
    nodes = {"a": PoolNode(node="a")}
    cordon(nodes, "a", "fan failure", now=10.0)
    register(nodes, RegisterNodeRequest(node="a", healthy=True), now=20.0, keep_operator_cordon=False)
    assert nodes["a"].cordoned is None


# --------------------------------------------------------------------------------------------- the proof


@pytest.mark.parametrize(
    ("token", "tamper", "accepted", "why"),
    [
        pytest.param(TOKEN, {}, True, "", id="signed-with-the-pools-token"),
        pytest.param(None, {}, False, "unsigned", id="unsigned"),
        pytest.param("another-pools-token-0123", {}, False, "does not match", id="another-token"),
        pytest.param(TOKEN, {"peer_url": "http://10.0.0.5:7301"}, False, "does not match", id="peer-url-changed"),
        pytest.param(TOKEN, {"healthy": False}, False, "does not match", id="health-changed"),
        pytest.param(TOKEN, {"labels": {"gpu": "h200"}}, False, "does not match", id="labels-changed"),
        pytest.param(TOKEN, {"node": "node-1"}, False, "does not match", id="another-node"),
    ],
)
def test_the_controller_accepts_only_a_registration_signed_with_its_token(
        token: str | None, tamper: dict[str, object], accepted: bool, why: str) -> None:
    request = signed_registration(_request(labels={"gpu": "h100"}), token, NOW).model_copy(update=tamper)
    verdict = check_registration(request, TOKEN, NOW)
    assert (verdict.accepted, verdict.authenticated) == (accepted, accepted) and why in verdict.why


@pytest.mark.parametrize("skew_s", [-REGISTRATION_MAX_SKEW_S - 1, REGISTRATION_MAX_SKEW_S + 1])
def test_an_old_or_future_proof_is_refused(skew_s: float) -> None:
    verdict = check_registration(signed_registration(_request(), TOKEN, NOW + skew_s), TOKEN, NOW)
    assert not verdict.accepted and "clock" in verdict.why


def test_without_a_token_on_the_controller_registrations_are_taken_unauthenticated() -> None:
    verdict = check_registration(_request(), None, NOW)
    assert verdict.accepted and not verdict.authenticated and "not authenticated" in verdict.why


def test_the_proof_is_a_tag_not_the_token() -> None:
    request = signed_registration(_request(), TOKEN, NOW)
    assert TOKEN not in request.model_dump_json() and request.proof == registration_proof(TOKEN, request)


# ------------------------------------------------------------------------------- the workflow, end to end


@activity.defn(name="notify_scheduler")
async def notify_scheduler(request: NotifySchedulerInput) -> NotifySchedulerResult:
    return NotifySchedulerResult()



async def test_the_pool_takes_only_guarded_registrations(env: WorkflowEnvironment) -> None:
    queue = f"pool-{uuid.uuid4()}"
    verifier = RegistrationActivities(TOKEN)
    async with Worker(env.client, task_queue=queue, workflows=[NodePool],
                      activities=[verifier.verify_registration, notify_scheduler]):
        handle = await env.client.start_workflow(NodePool.run, id=queue, task_queue=queue)

        async def registered(request: RegisterNodeRequest, token: str | None = TOKEN) -> PoolNode:
            signed = signed_registration(request, token)
            return await handle.execute_update(NodePool.register, signed, result_type=PoolNode)

        async def refused(request: RegisterNodeRequest, token: str | None = TOKEN) -> str:
            with pytest.raises(WorkflowUpdateFailedError) as error:
                await registered(request, token)
            return str(error.value.cause)

        assert (await registered(_request())).peer_url == "http://10.0.0.5:7300"
        assert "unsigned" in await refused(_request(peer_url="http://10.0.0.5:7400"), token=None)
        assert "does not match" in await refused(_request(peer_url="http://10.0.0.5:7400"),
                                                 token="another-pools-token-0123")
        assert "own host" in await refused(_request(peer_url="http://10.6.6.6:7300"))
        for phantom in ("Phantom", "x" * 64, "node-9\n"):
            assert "registration refused" in await refused(_request(node=phantom, host="", peer_url=""))

        await handle.execute_update(NodePool.cordon, NodeRequest(node="node-0", reason="fan failure"))
        assert (await registered(_request(healthy=True))).cordoned == "fan failure"  # the operator's stands
        await handle.execute_update(NodePool.cordon, NodeRequest(node="node-0", reason="XID 79", run_id="run-1"))
        assert (await registered(_request(healthy=True))).cordoned is None  # a run's: repaired, as before

        status = await handle.query(NodePool.nodes)
        history = (await handle.fetch_history()).to_json()
        await handle.terminate()
    payloads = b"".join(base64.b64decode(d) for d in re.findall(r'"data":\s*"([A-Za-z0-9+/=]*)"', history))
    assert b'"proof":"' in payloads and b'"authenticated":true' in payloads  # what is there: tags, verdicts
    assert TOKEN.encode() not in payloads and TOKEN not in history  # the token never is
    assert [n.node for n in status.nodes] == ["node-0"]  # no phantom
    assert status.nodes[0].peer_url == "http://10.0.0.5:7300"  # no refused address taken


async def test_registrations_checked_side_by_side_leave_a_history_that_replays(env: WorkflowEnvironment) -> None:
    """A full restart of the stack: every agent registers at once and one check is slow. The pool's history must
    replay (a check in a local activity wrote one that did not: the pool failed every workflow task after)."""
    verifier = RegistrationActivities(TOKEN)

    @activity.defn(name="verify_registration")
    async def slow_for_node_0(request: RegisterNodeRequest) -> RegistrationVerdict:
        if request.node == "node-0":
            await asyncio.sleep(0.5)
        return await verifier.verify_registration(request)

    queue = f"pool-{uuid.uuid4()}"
    nodes = [_request(node=f"node-{i}", host=f"10.0.0.{i + 5}", peer_url=f"http://10.0.0.{i + 5}:7300")
             for i in range(4)]
    async with Worker(env.client, task_queue=queue, workflows=[NodePool],
                      activities=[slow_for_node_0, notify_scheduler]):
        handle = await env.client.start_workflow(NodePool.run, id=queue, task_queue=queue)

        async def registered(request: RegisterNodeRequest, after_s: float) -> PoolNode:
            await asyncio.sleep(after_s)
            return await handle.execute_update(NodePool.register, signed_registration(request, TOKEN),
                                               result_type=PoolNode)

        done = await asyncio.gather(*(registered(r, 0.0 if i == 0 else 0.2) for i, r in enumerate(nodes)))
        history = await handle.fetch_history()
        await handle.terminate()

    assert [n.node for n in done] == [r.node for r in nodes]
    checks = [e for e in history.events if e.HasField("activity_task_scheduled_event_attributes")]
    assert len(checks) == len(nodes), "each proof checked by an activity, its result an event of its own"
    await Replayer(workflows=[NodePool], data_converter=pydantic_data_converter).replay_workflow(history)
