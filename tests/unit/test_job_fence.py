"""A run that outlives its Slurm job does not relaunch onto the next job's agents (issue 40 finding 6c): agents
register with their job, a run of job J takes no agent of another job as its node come back, and an agent of
job K acts for no run of another job."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from activities import nodes as node_activities
from activities.models import CheckNodeInput
from trainguard.models import AgentsBackInput, PoolNode, RegisterNodeRequest
from trainguard.pool import check_registration, signed_registration
from trainguard.slurm_job import job_memo
from workers import node_agent
from workers.job_fence import NOT_THIS_JOBS_RUN, FenceOtherJobsRuns, JobFence
from workflows.pool_rules import register

RUN_OF_4242 = job_memo({"SLURM_JOB_ID": "4242", "SLURM_JOB_USER": "alice"})


class Ran:
    """The activity behind the fence: records that it ran."""

    def __init__(self) -> None:
        self.calls = 0

    async def execute_activity(self, input: Any) -> str:
        self.calls += 1
        return "checked"


class Input:
    def __init__(self, workflow_id: str) -> None:
        self.args, self.fn = [CheckNodeInput(workflow_id=workflow_id, node="node-0")], self.execute

    def execute(self) -> None:
        """Stands for the activity function (its name is logged)."""


async def through_fence(agent_job: int | None, memos: dict[str, Any]) -> tuple[Ran, Any]:
    async def memo_of(workflow_id: str) -> Any:
        return memos.get(workflow_id)

    ran = Ran()
    fenced = FenceOtherJobsRuns(JobFence(agent_job, memo_of)).intercept_activity(ran)  # type: ignore[arg-type]
    try:
        return ran, await fenced.execute_activity(Input("slurm-4242"))  # type: ignore[arg-type]
    except ApplicationError as error:
        return ran, error


async def test_an_agent_of_the_next_job_acts_for_no_run_of_the_last() -> None:
    ran, answer = await through_fence(4243, {"slurm-4242": RUN_OF_4242})
    assert ran.calls == 0
    assert isinstance(answer, ApplicationError) and answer.type == NOT_THIS_JOBS_RUN and answer.non_retryable
    assert "belongs to Slurm job 4242, and this node's agent to job 4243" in str(answer)


@pytest.mark.parametrize("agent_job, memo", [(4242, RUN_OF_4242), (4243, {}), (None, RUN_OF_4242)])
async def test_an_agent_acts_for_its_own_jobs_runs_and_unfenced_ones(agent_job: int | None, memo: Any) -> None:
    ran, answer = await through_fence(agent_job, {"slurm-4242": memo})
    assert ran.calls == 1 and answer == "checked"


async def test_an_agent_of_another_job_is_not_the_runs_node_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    async def pool_nodes(_client: object) -> list[PoolNode]:  # node-0's agent is back, started by job 4243
        return [PoolNode(node="node-0", registered_at=200.0, slurm_job=4243),
                PoolNode(node="node-1", registered_at=200.0, slurm_job=4242)]

    monkeypatch.setattr(node_activities, "pool_nodes", pool_nodes)
    back = await node_activities.NodeActivities(client=None).find_agents_back(  # type: ignore[arg-type]
        AgentsBackInput(nodes=["node-0", "node-1"], since=100.0, slurm_job=4242))
    assert back.away == ["node-0"]


def test_an_agent_registers_with_its_job_and_the_proof_covers_it() -> None:
    signed = signed_registration(RegisterNodeRequest(node="node-0", host="10.0.0.5", slurm_job=4243), "token",
                                 now_s=1000.0)
    nodes: dict[str, PoolNode] = {}
    register(nodes, signed, now=1000.0)
    assert nodes["node-0"].slurm_job == 4243
    assert check_registration(signed, "token", 1000.0).accepted
    assert not check_registration(signed.model_copy(update={"slurm_job": 4242}), "token", 1000.0).accepted


def test_the_agent_fences_by_the_job_that_started_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built: dict[str, Any] = {}

    class Built(Exception):
        pass

    async def connect() -> object:
        return object()

    def build_worker(*_args: Any, **kwargs: Any) -> Any:
        built.update(kwargs)
        raise Built

    monkeypatch.setattr(node_agent, "connect", connect)
    monkeypatch.setattr(node_agent, "build_worker", build_worker)
    monkeypatch.setattr(node_agent, "hold_agent_secrets", lambda: None)
    monkeypatch.setattr(node_agent, "setup_logging", lambda component: None)
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    monkeypatch.delenv(node_agent.RUN_AS_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", ["node_agent", "--node", "node-0", "--workdir", str(tmp_path / "work"),
                                      "--allow", "*", "--peer-port", "-1"])
    import asyncio

    with pytest.raises(Built):
        asyncio.run(node_agent.main())
    assert built["slurm_job"] == 4243
