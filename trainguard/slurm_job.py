"""Which Slurm job a run belongs to: recorded by the run's start inside the job, checked before the controller
acts on the job.

A run id `slurm-<job id>` says nothing by itself: anyone who may start a workflow can name one after any job.
So `trainguard run start` inside a Slurm job records the job in the run's memo (`job_memo`: the job id, its
user and cluster, from the environment Slurm gives the batch script), and the job script marks the job itself
(`#SBATCH --comment=trainguard`, which only the job's owner or an admin can set). The controller ends a job
(`workers.slurm_drains`) only when `not_the_runs_job` finds nothing against it: the run recorded that very job,
the job marks itself trainguard's, user and cluster match, and the run started after the job did (job ids
restart at 1 with a fresh slurmctld state).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError

SLURM_JOB_MEMO = "slurm_job"
"""The run's memo key holding the `SlurmJob` its start was made from."""

JOB_COMMENT = "trainguard"
"""The comment the job script gives its job (`#SBATCH --comment=trainguard`, examples/slurm/train.sbatch): the
job's own word that trainguard may end it. A copied job script must keep it, or its job is never cancelled."""

START_SLACK_S = 5.0
"""How much earlier than its job a run may seem to start and still be the job's: slurmctld's clock and
Temporal's differ a little. A run older than that was started before the job existed, by another job."""


class SlurmJob(BaseModel):
    """The Slurm job a run was started from, as its batch script's environment named it."""

    job_id: int
    user: str = ""
    """`SLURM_JOB_USER`; empty when Slurm did not say."""
    cluster: str = ""
    """`SLURM_CLUSTER_NAME`; empty when Slurm did not say."""


def job_memo(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The memo a run started in this environment records: `{SLURM_JOB_MEMO: SlurmJob}` inside a Slurm job
    (`SLURM_JOB_ID` set to a number), None outside one."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id.isdigit():
        return None
    job = SlurmJob(job_id=int(job_id), user=env.get("SLURM_JOB_USER", "").strip(),
                   cluster=env.get("SLURM_CLUSTER_NAME", "").strip())
    return {SLURM_JOB_MEMO: job.model_dump()}


def recorded_job(memo: Mapping[str, Any]) -> SlurmJob | None:
    """The job a run's memo records, None when it records none (or something that is not one)."""
    try:
        return SlurmJob.model_validate(memo[SLURM_JOB_MEMO])
    except (KeyError, ValidationError):
        return None


def _number(value: Any) -> float | None:
    """A number of `squeue --json`, in 22.05's shape (`123`) or later versions' (`{"set": true, "number": 123}`)."""
    if isinstance(value, dict):
        value = value.get("number") if value.get("set", True) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def not_the_runs_job(job: Mapping[str, Any], memo: Mapping[str, Any], run_started: datetime) -> str | None:
    """Why the job `squeue --json` shows (`job`) is not the one the run whose memo and start time are given
    belongs to; None when it is."""
    recorded = recorded_job(memo)
    job_id = _number(job.get("job_id"))
    if recorded is None:
        return "its run recorded no Slurm job (it was not started by `trainguard run start` inside one)"
    if job_id is None or recorded.job_id != int(job_id):
        return f"its run was started from job {recorded.job_id}"
    if str(job.get("comment") or "") != JOB_COMMENT:
        return f"the job does not mark itself trainguard's (#SBATCH --comment={JOB_COMMENT})"
    user = str(job.get("user_name") or "")
    if recorded.user and user and recorded.user != user:
        return f"its run was started by {recorded.user}, the job is {user}'s"
    cluster = str(job.get("cluster") or "")
    if recorded.cluster and cluster and recorded.cluster != cluster:
        return f"its run was started on cluster {recorded.cluster}, the job runs on {cluster}"
    started = _number(job.get("start_time"))
    if started and run_started.timestamp() < started - START_SLACK_S:
        return "its run started before the job did (an earlier job with the same id)"
    return None
