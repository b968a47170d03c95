"""The controller's watch on Slurm's own drains: an operator's `scontrol update nodename=X state=drain` moves the
run that holds X off it at its next checkpoint, as `trainguard run drain RUN --node X` would (the run's
`drain_node` update; a spare takes X's place).

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
import subprocess
from collections.abc import Mapping
from typing import Any

from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from activities.scheduler import COMMAND_TIMEOUT_S, SCHEDULER_ENV, SLURM_REASON_PREFIX
from trainguard.pool import pool_nodes

log = logging.getLogger(__name__)

DRAIN_POLL_S = 5.0
"""How often Slurm is asked. A drain is acted on at the run's next checkpoint anyway (tens of seconds to
minutes apart): 5 s adds little to that, and costs slurmctld one cheap RPC."""

DRAIN_STATES = frozenset({"DRAIN", "DRAINING", "DRAINED"})


def operator_drains(sinfo: Mapping[str, Any]) -> dict[str, str]:
    """Node -> reason, for every node `sinfo --json` shows drained (or draining) by someone other than trainguard."""
    from trainguard.dev_slurm import node_states

    return {node: info["reason"] for node, info in node_states(dict(sinfo)).items()
            if DRAIN_STATES & set(info["state"]) and not info["reason"].startswith(SLURM_REASON_PREFIX)}


def _sinfo(executable: str) -> dict[str, Any]:
    done = subprocess.run([executable, "--json"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,  # noqa: S603
                          check=True)
    return dict(json.loads(done.stdout))


class SlurmDrainWatch:
    """Polls Slurm and asks each run holding an operator-drained node to move off it, once per drain."""

    def __init__(self, client: Client, executable: str = "sinfo") -> None:
        self.client = client
        self.executable = executable
        self.told: set[tuple[str, str]] = set()
        """(node, run) pairs already asked, forgotten when the node is no longer drained: a later drain counts."""

    @classmethod
    def from_env(cls, client: Client, environ: Mapping[str, str] | None = None) -> SlurmDrainWatch | None:
        env = os.environ if environ is None else environ
        return cls(client) if env.get(SCHEDULER_ENV, "").strip().lower() == "slurm" else None

    async def poll(self) -> list[tuple[str, str]]:
        """One look at Slurm; returns the (node, run) pairs asked to move this time."""
        drains = operator_drains(await asyncio.to_thread(_sinfo, self.executable))
        self.told = {(node, run) for node, run in self.told if node in drains}
        if not drains:
            return []
        from trainguard.client import TrainguardClient

        asked = []
        for entry in await pool_nodes(self.client):
            run = entry.leased_to
            if entry.node not in drains or not run or (entry.node, run) in self.told:
                continue
            self.told.add((entry.node, run))
            reason = f"Slurm drain: {drains[entry.node] or 'no reason given'}"
            try:
                await TrainguardClient(self.client).drain_node(run, entry.node, reason)
            except (WorkflowUpdateFailedError, RPCError) as error:
                log.warning("%s drained in Slurm (%s): run %s refused to move off it: %s", entry.node, reason, run,
                            getattr(error, "cause", None) or error)
                continue
            log.info("%s drained in Slurm (%s): run %s moves off it at its next checkpoint", entry.node, reason, run)
            asked.append((entry.node, run))
        return asked

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.poll()
            except (OSError, subprocess.SubprocessError, ValueError, RPCError) as error:
                log.warning("Slurm drain watch: %s", error)  # slurmctld or Temporal briefly away: next poll
            try:
                await asyncio.wait_for(stop.wait(), DRAIN_POLL_S)
            except asyncio.TimeoutError:
                pass
