"""The controller's watch on Slurm: an operator's drain moves a run off the node, and a job whose batch host was
lost is ended once its run is.

An operator's `scontrol update nodename=X state=drain` moves the run that holds X off it at its next checkpoint, as
`trainguard run drain RUN --node X` would (the run's `drain_node` update; a spare takes X's place).

A job loses its batch script with its batch host (node 0 of the allocation): the run goes on inside the job
(`--no-kill`) and completes, but nothing is left to end the job, which would hold its nodes until its time limit.
So a running job whose batch host is no longer among its nodes, and whose run (`slurm-<job id>`, the example
script's id) is over, is cancelled (`scancel`), but only when that run recorded the job as its own at its start
and the job marks itself trainguard's (`trainguard.slurm_job`): anyone may start a run named after any job.
Jobs with no such run are never touched.

On with the scheduler hook (`TRAINGUARD_SCHEDULER=slurm`). One `sinfo --json` every `DRAIN_POLL_S` answers for
every node: one RPC to slurmctld a poll however large the cluster, where an agent asking for its own node would
make one per node. Drains whose reason starts with `activities.scheduler.SLURM_REASON_PREFIX` are trainguard's
own cordons, already acted on: skipped. Several controllers may watch at once: the update is idempotent, and
one refused (the node already left the run) is only logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.exceptions import TemporalError
from temporalio.service import RPCError, RPCStatusCode

from activities.scheduler import COMMAND_TIMEOUT_S, SCHEDULER_ENV, SLURM_REASON_PREFIX
from trainguard.pool import pool_nodes
from trainguard.slurm_job import not_the_runs_job

log = logging.getLogger(__name__)

DRAIN_POLL_S = 5.0
"""How often Slurm is asked. A drain is acted on at the run's next checkpoint anyway (tens of seconds to
minutes apart): 5 s adds little to that, and costs slurmctld one cheap RPC."""

POLL_BACKOFF_MAX_S = 60.0
"""The longest wait between looks while looks keep failing (slurmctld or Temporal away, an answer the watch cannot
read): the wait doubles from `DRAIN_POLL_S` up to this, so an outage of hours costs slurmctld and the log one
try a minute, and the watch is back within a minute of the cause going."""

EXPECTED_TROUBLE = (OSError, subprocess.SubprocessError, ValueError, TemporalError)
"""What the world causes (a command missing or timing out, JSON cut short, Temporal away, an update timed out):
logged as one line. Anything else is a bug, logged with its traceback; the watch goes on either way."""

DRAIN_STATES = frozenset({"DRAIN", "DRAINING", "DRAINED"})


def operator_drains(sinfo: Mapping[str, Any]) -> dict[str, str]:
    """Node -> reason, for every node `sinfo --json` shows drained (or draining) by someone other than trainguard."""
    from trainguard.dev_slurm import node_states

    return {node: info["reason"] for node, info in node_states(dict(sinfo)).items()
            if DRAIN_STATES & set(info["state"]) and not info["reason"].startswith(SLURM_REASON_PREFIX)}


def _slurm_json(argv: list[str]) -> dict[str, Any]:
    done = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                          check=True)
    return dict(json.loads(done.stdout))


def expand_hostlist(expression: str) -> list[str]:
    """Slurm's hostlist (`node-[0-2,5],gpu07`) as names: ranges keep their zero padding (`gpu[08-10]`)."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", expression):
        found = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            items = [text]
            if ranges:
                items = []
                for item in ranges.split(","):
                    low, _, high = item.partition("-")
                    items += [f"{text}{n:0{len(low)}d}" for n in range(int(low), int(high or low) + 1)]
            found = [head + item for head in found for item in items]
        names += [name for name in found if name]
    return names


def headless_jobs(squeue: Mapping[str, Any]) -> list[int]:
    """Running jobs whose batch host is no longer one of their nodes: their batch script died with it."""
    return [int(job["job_id"]) for job in squeue.get("jobs", [])
            if str(job.get("job_state", "")).upper() == "RUNNING" and job.get("batch_host")
            and job["batch_host"] not in expand_hostlist(str(job.get("nodes", "")))]


class SlurmDrainWatch:
    """Polls Slurm: asks each run holding an operator-drained node to move off it, once per drain, and ends the
    jobs whose batch host was lost once their runs are over."""

    def __init__(self, client: Client, executable: str = "sinfo", squeue: str = "squeue",
                 scancel: str = "scancel", poll_s: float = DRAIN_POLL_S,
                 max_backoff_s: float = POLL_BACKOFF_MAX_S) -> None:
        self.client = client
        self.poll_s, self.max_backoff_s = poll_s, max_backoff_s
        """Seconds between looks, and the longest wait while they keep failing (`POLL_BACKOFF_MAX_S`)."""
        self.executable, self.squeue, self.scancel = executable, squeue, scancel
        self.told: set[tuple[str, str]] = set()
        """(node, run) pairs already asked, forgotten when the node is no longer drained: a later drain counts."""
        self.settled: set[int] = set()
        """Headless jobs already cancelled, or with no trainguard run: never looked at again."""
        self.not_ours: set[tuple[int, datetime]] = set()
        """(job, its run's start) of headless jobs whose over run did not record them as its own: said once."""

    @classmethod
    def from_env(cls, client: Client, environ: Mapping[str, str] | None = None) -> SlurmDrainWatch | None:
        env = os.environ if environ is None else environ
        return cls(client) if env.get(SCHEDULER_ENV, "").strip().lower() == "slurm" else None

    async def poll(self) -> list[tuple[str, str]]:
        """One look at Slurm; returns the (node, run) pairs asked to move this time."""
        drains = operator_drains(await asyncio.to_thread(_slurm_json, [self.executable]))
        self.told = {(node, run) for node, run in self.told if node in drains}
        if not drains:
            return []
        from trainguard.client import TrainguardClient

        asked = []
        for entry in await pool_nodes(self.client):
            run = entry.leased_to
            if entry.node not in drains or not run or (entry.node, run) in self.told:
                continue
            reason = f"Slurm drain: {drains[entry.node] or 'no reason given'}"
            try:
                await TrainguardClient(self.client).drain_node(run, entry.node, reason)
            except WorkflowUpdateFailedError as error:
                self.told.add((entry.node, run))  # refused: the run's answer stands, asking again changes nothing
                log.warning("%s drained in Slurm (%s): run %s refused to move off it: %s", entry.node, reason, run,
                            error.cause or error)
                continue
            except Exception as error:  # noqa: BLE001 - a timeout or an outage: asked again at the next look
                _log_trouble(f"{entry.node} drained in Slurm ({reason}): asking run {run} to move off it", error)
                continue
            self.told.add((entry.node, run))
            log.info("%s drained in Slurm (%s): run %s moves off it at its next checkpoint", entry.node, reason, run)
            asked.append((entry.node, run))
        return asked

    async def end_headless_jobs(self) -> list[int]:
        """Cancel each running job that lost its batch host and whose run is over. Returns the jobs cancelled."""
        squeue = await asyncio.to_thread(_slurm_json, [self.squeue, "--states=RUNNING"])
        entries = {int(job["job_id"]): job for job in squeue.get("jobs", [])}
        cancelled = []
        for job in headless_jobs(squeue):
            if job in self.settled:
                continue
            try:
                description = await self.client.get_workflow_handle(f"slurm-{job}").describe()
            except RPCError as error:
                if error.status is RPCStatusCode.NOT_FOUND:
                    self.settled.add(job)  # not a trainguard job: not ours to end
                    continue
                raise
            status = description.status
            if status is WorkflowExecutionStatus.RUNNING:
                continue  # the run goes on inside the job
            # A run id is only a name: anyone may start `slurm-<any job>`. End the job only if the run recorded
            # this very job as the one it was started from, and the job marks itself trainguard's.
            why_not = not_the_runs_job(entries[job], await description.memo(), description.start_time)
            if why_not is not None:
                if (job, description.start_time) not in self.not_ours:
                    self.not_ours.add((job, description.start_time))
                    log.warning("Slurm job %d lost its batch host and run slurm-%d is over, but the job is not the "
                                "run's to end (%s): left to its owner", job, job, why_not)
                continue
            await asyncio.to_thread(subprocess.run, [self.scancel, str(job)], capture_output=True, check=True,
                                    timeout=COMMAND_TIMEOUT_S)
            self.settled.add(job)
            log.info("Slurm job %d lost its batch host and its run slurm-%d is over (%s): cancelled it", job, job,
                     status.name.lower() if status else "gone")
            cancelled.append(job)
        return cancelled

    async def look(self) -> bool:
        """One look at drains, then one at headless jobs, each whatever the other did: True when both went
        through. A failure is logged (`_log_trouble`), never raised: the caller only waits longer."""
        ok = True
        for what, step in (("looking for drained nodes", self.poll), ("looking for headless jobs",
                                                                      self.end_headless_jobs)):
            try:
                await step()
            except Exception as error:  # noqa: BLE001 - whatever Slurm or Temporal answered, the watch goes on
                _log_trouble(what, error)
                ok = False
        return ok

    async def run(self, stop: asyncio.Event) -> None:
        """Look every `poll_s` until `stop`; while looks fail, wait twice as long each time, up to
        `max_backoff_s`."""
        failures = 0
        while not stop.is_set():
            failures = 0 if await self.look() else min(failures + 1, 32)
            try:
                await asyncio.wait_for(stop.wait(), min(self.poll_s * 2 ** failures, self.max_backoff_s))
            except TimeoutError:
                pass


def _log_trouble(what: str, error: BaseException) -> None:
    expected = isinstance(error, EXPECTED_TROUBLE)
    log.warning("Slurm watch: %s failed (%s: %s); it looks again", what, type(error).__name__,
                getattr(error, "cause", None) or error, exc_info=None if expected else error)


async def keep_watching(watch: SlurmDrainWatch, stop: asyncio.Event) -> None:
    """The controller's hold on its watch: `watch.run` until `stop`. Should it end or raise before (a bug no
    look caught), that is logged as an error and the watch restarted after `watch.max_backoff_s`: drains and
    cancels never stop quietly while the controller runs."""
    while not stop.is_set():
        try:
            await watch.run(stop)
        except Exception:  # logged whole; the restart is the remedy
            log.exception("Slurm watch stopped: restarting it in %.0fs", watch.max_backoff_s)
        else:
            if not stop.is_set():
                log.error("Slurm watch ended before the controller stopped: restarting it in %.0fs",
                          watch.max_backoff_s)
        try:
            await asyncio.wait_for(stop.wait(), watch.max_backoff_s)
        except TimeoutError:
            pass
