"""A node agent a Slurm job started acts only for runs of that job.

Agents poll `trainguard-node-<node>`, a queue named after the node alone. When a run outlives its Slurm job
(its agents gone with the job), the next job on the same nodes starts agents that poll the same queues: the
old run's relaunch, node check or download would land on the new job's agents and run the old job's code in
the new job's allocation. So an agent records its job (`SLURM_JOB_ID`) at start, registers in the pool with it
(`RegisterNodeRequest.slurm_job`), and refuses every activity of a run whose start recorded another job
(`trainguard.slurm_job`, the run's memo) with a non-retryable `NotThisJobsRun`. A run that records no job
(started outside Slurm) and an agent outside Slurm are not fenced: neither names a job to compare.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from temporalio.exceptions import ApplicationError
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from trainguard.error_types import ErrorType
from trainguard.slurm_job import recorded_job

log = logging.getLogger(__name__)

AGENT_JOB_ENV = "SLURM_JOB_ID"
"""Set by Slurm in every step of a job: the job the agent belongs to."""
NOT_THIS_JOBS_RUN = ErrorType.NOT_THIS_JOBS_RUN
"""The error type an agent refuses another job's run with: not retried, the same agent would refuse again."""

MemoOf = Callable[[str], Awaitable[Mapping[str, Any] | None]]
"""A run's memo by workflow id (None when there is no such run)."""


def agent_job(environ: Mapping[str, str]) -> int | None:
    """The Slurm job whose step started this agent; None outside Slurm."""
    value = environ.get(AGENT_JOB_ENV, "").strip()
    return int(value) if value.isdigit() else None


class JobFence:
    """Which runs an agent of Slurm job `job` may act for; each run's job is looked up once (its memo)."""

    def __init__(self, job: int | None, memo_of: MemoOf) -> None:
        self.job, self.memo_of = job, memo_of
        self.jobs: dict[str, int | None] = {}
        """Workflow id -> the Slurm job its start recorded (None: none)."""

    async def refusal(self, workflow_id: str) -> str | None:
        """Why this agent must not act for run `workflow_id`; None when it may."""
        if self.job is None:
            return None
        if workflow_id not in self.jobs:
            memo = await self.memo_of(workflow_id)
            job = recorded_job(memo or {})
            self.jobs[workflow_id] = job.job_id if job is not None else None
        run_job = self.jobs[workflow_id]
        if run_job is None or run_job == self.job:
            return None
        return (f"run {workflow_id} belongs to Slurm job {run_job}, and this node's agent to job {self.job}: a run "
                f"that outlived its job does not take over the next job's nodes (start it again in a job of its "
                f"own)")


class FenceOtherJobsRuns(Interceptor):
    """A node agent worker's interceptor: activities for a run of another Slurm job fail, not retried."""

    def __init__(self, fence: JobFence) -> None:
        self.fence = fence

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _FencedActivity(next, self.fence)


class _FencedActivity(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, fence: JobFence) -> None:
        super().__init__(next)
        self.fence = fence

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        workflow_id = getattr(input.args[0], "workflow_id", None) if input.args else None
        if isinstance(workflow_id, str) and (why := await self.fence.refusal(workflow_id)):
            log.warning("refused %s: %s", input.fn.__name__, why)
            raise ApplicationError(why, type=ErrorType.NOT_THIS_JOBS_RUN, non_retryable=True)
        return await super().execute_activity(input)
