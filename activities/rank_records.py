"""The agent's rank processes and its book of each run's attempt on this node.

`RankBook` is the one piece of state the node's rank activities share: its attempts, adopted again after an
agent restart, saved as each changes, and stopped together (ranks never outlive their agent). Launch and stop
(`activities.rank_launch`), the watch (`activities.rank_watch`) and chaos (`activities.chaos`) are activity
classes of their own, each holding a reference to the node's one book; `workers.node_agent` builds them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from activities.progress import RankReport
from trainguard import protocol
from trainguard.cgroups import RunCgroups, kill_tree
from trainguard.procs import start_time
from trainguard.protocol import RunLayout
from trainguard.safe_files import write_json

if TYPE_CHECKING:
    from activities.rank_parking import RunParking

log = logging.getLogger("activities.ranks")
"""The agent's rank logs keep the name they always had, whichever part of it logs."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exited (code unknown: the agent restarted since launch)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class RankProcess:
    rank: int
    pid: int
    start_time: str | None
    popen: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    exited: bool = False
    exited_at: float | None = None
    """Unix time of the exit: stamped by `stamp_exit` as it happens for our own children, else when first
    seen. Across nodes, it tells which rank failed first, the one the others failed because of."""
    launch_attempt: int = 0
    """The attempt whose environment the process was started with, or given as its role: its evidence files
    are that attempt's (`activities.evidence.evidence_base`), kept through in-process restarts. 0: unknown,
    the attempt of the record it is in."""

    def poll(self) -> bool:
        """True once the process has exited (its code in `exit_code` when it was our child)."""
        if self.exited:
            return True
        if self.popen is not None:
            code = self.popen.poll()
            if code is None:
                return False
            self.exit_code, self.exited = code, True
        elif start_time(self.pid) != self.start_time:
            self.exited = True
        if self.exited and self.exited_at is None:
            self.exited_at = time.time()
        return self.exited

    def stamp_exit(self) -> None:
        """Block (in a thread of its own) until this child exits, without reaping it, and note the time."""
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # already reaped by `poll`, which stamped it
        if self.exited_at is None:
            self.exited_at = time.time()


@dataclass
class AttemptRecord:
    workflow_id: str
    attempt: int
    master_addr: str
    master_port: int
    start_step: int
    launched_at: float
    ranks: dict[int, RankProcess] = field(default_factory=dict)
    chain_id: str = ""
    first_step_at: float | None = None
    faults: dict[int, float] = field(default_factory=dict)
    """Chaos faults injected into this attempt: rank -> unix time."""
    survivors: set[int] = field(default_factory=set)
    """After an in-process restart: the ranks carried over alive from the attempt before."""
    standby: RankProcess | None = None
    """With in-process restarts on: a process of the entrypoint already started (torch imported), waiting in
    `trainguard.rank.standby()` to take the place of a rank that dies."""
    last_watched: float = field(default_factory=time.monotonic)
    """When a watch of this attempt last ran here: a run that stops watching may have moved on without us."""
    restore_tiers: list[str] = field(default_factory=list)
    """Where a watch's download for this launch found the shards (`local`, `peer`, `s3`): its events say so."""

    def to_json(self, parked: list[protocol.ProcessEntry] | None = None) -> dict[str, object]:
        """`ranks.json` (`trainguard.protocol.AttemptFile`), with the run's `parked` processes here."""
        return protocol.AttemptFile(
            workflow_id=self.workflow_id, attempt=self.attempt, master_addr=self.master_addr,
            master_port=self.master_port, start_step=self.start_step, launched_at=self.launched_at,
            chain_id=self.chain_id,
            ranks=[protocol.ProcessEntry(p.pid, p.start_time, p.rank, p.launch_attempt) for p in self.ranks.values()],
            survivors=sorted(self.survivors), restore_tiers=self.restore_tiers,
            standby=None if self.standby is None else protocol.ProcessEntry(self.standby.pid, self.standby.start_time),
            parked=parked or [],
        ).to_json()

    @classmethod
    def from_json(cls, data: dict) -> AttemptRecord:
        file = protocol.AttemptFile.from_json(data)
        record = cls(
            workflow_id=file.workflow_id, attempt=file.attempt, master_addr=file.master_addr,
            master_port=file.master_port, start_step=file.start_step, launched_at=file.launched_at,
            chain_id=file.chain_id, survivors=set(file.survivors), restore_tiers=file.restore_tiers,
        )
        if file.standby is not None:
            record.standby = RankProcess(-1, file.standby.pid, file.standby.start_time)
        for item in file.ranks:
            record.ranks[item.rank] = RankProcess(item.rank, item.pid, item.start_time,
                                                  launch_attempt=item.launch_attempt)
        return record


def kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # ranks lead their own process group (start_new_session)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("no permission to signal process group %s", pid)


def read_report(path: Path) -> RankReport | None:
    data = protocol.read_progress(path)
    if data is None:
        return None
    return RankReport(
        rank=data.rank,
        step=data.step,
        time=data.time,
        step_time_s=data.step_time_s,
        saving=data.saving,
        finished=data.finished,
        compute_s=data.compute_s,
        error=data.error,
        phase=data.phase,
        phase_since=data.phase_since,
        phase_expected_s=data.phase_expected_s,
        fingerprints=data.fingerprints,
        numerical=data.numerical,
    )


def read_finish(path: Path) -> protocol.Finish:
    return protocol.read_finish(path)


class RankBook:
    """What one node agent knows of the ranks it runs: each run's attempt on this node and its processes. One
    per node agent, shared by reference by its launch (`activities.rank_launch`), watch
    (`activities.rank_watch`), chaos (`activities.chaos`) and evidence activities, which keep no attempts of
    their own."""

    def __init__(self, node: str, workdir: Path) -> None:
        self.node = node
        self.workdir = workdir
        self.attempts: dict[str, AttemptRecord] = {}
        """Workflow id -> the newest attempt of that run this node has launched."""
        self.parking: dict[str, RunParking] = {}
        """Workflow id -> the run's processes parked here for its next relaunch (`activities.rank_parking`)."""
        self.cgroups = RunCgroups(node, workdir)
        """One cgroup per run here: every process started for it joins it, and fencing kills all of it."""
        self._reconcile()

    def _reconcile(self) -> None:
        """After an agent restart: adopt the ranks it had launched that are still alive."""
        runs = self.workdir / protocol.RUNS_DIR
        if not runs.is_dir():
            return
        for ranks_file in runs.glob(f"*/{protocol.RANKS_FILE}"):
            try:
                record = AttemptRecord.from_json(json.loads(ranks_file.read_text()))
            except (OSError, ValueError, KeyError):
                continue
            parked = protocol.read_attempt_file(ranks_file)
            for item in parked.parked if parked is not None else []:
                # Parked processes exit when their agent goes; one that has not yet got that far goes now.
                if item.start_time and start_time(item.pid) == item.start_time:
                    kill_group(item.pid, signal.SIGKILL)
            if record.attempt == 0 and not record.ranks and record.standby is None:
                ranks_file.unlink(missing_ok=True)  # a spare's parked processes only (`save_parking`): gone
                continue
            alive = [p for p in record.ranks.values() if not p.poll()]
            if alive:
                log.info("adopting %d live ranks of %s attempt %d", len(alive), record.workflow_id, record.attempt)
            self.attempts[record.workflow_id] = record

    def record(self, workflow_id: str) -> AttemptRecord | None:
        return self.attempts.get(workflow_id)

    def save(self, record: AttemptRecord) -> None:
        """Write `record`'s `ranks.json`, so an agent that restarts adopts its ranks."""
        layout = RunLayout.of(self.workdir, record.workflow_id)
        layout.root.mkdir(parents=True, exist_ok=True)
        pool = self.parking.get(record.workflow_id)
        write_json(layout.ranks_file, record.to_json(pool.entries() if pool is not None else None))

    def save_parking(self, workflow_id: str) -> None:
        """Write the run's `ranks.json` after its parked processes changed. On a spare (no attempt of the run
        here) it lists them alone, as attempt 0 with no ranks; with none left it goes."""
        record = self.attempts.get(workflow_id)
        if record is not None:
            self.save(record)
            return
        layout = RunLayout.of(self.workdir, workflow_id)
        pool = self.parking.get(workflow_id)
        if pool is None or not pool.processes:
            layout.ranks_file.unlink(missing_ok=True)
            return
        layout.root.mkdir(parents=True, exist_ok=True)
        protocol.AttemptFile(workflow_id=workflow_id, attempt=0, master_addr="", master_port=0, start_step=0,
                             launched_at=time.time(), parked=pool.entries()).write(layout.ranks_file)

    def spare_parking(self, every_s: float) -> list[RunParking]:
        """Spares' pools whose run was last found open `every_s` ago or more: to be asked again."""
        now = time.monotonic()
        return [p for p in self.parking.values() if p.spare and not p.closed and now - p.checked_at >= every_s]

    def unwatched(self, idle_s: float) -> list[AttemptRecord]:
        """Attempts with live ranks that no watch has looked at for `idle_s`: after a partition heals (or a
        long controller outage), ranks of an attempt the run has since replaced elsewhere."""
        now = time.monotonic()
        return [r for r in self.attempts.values() if now - r.last_watched > idle_s and (
            any(not p.poll() for p in r.ranks.values()) or (r.standby is not None and not r.standby.poll())
            or (r.workflow_id in self.parking and not self.parking[r.workflow_id].spare))]

    async def close_parking(self, workflow_id: str) -> int:
        """Kill the run's parked processes here (the run ended, left this node, or runs something else)."""
        pool = self.parking.pop(workflow_id, None)
        if pool is None:
            return 0
        closed = await pool.close()
        self.save_parking(workflow_id)
        if closed:
            log.info("stopped %d parked processes of %s on %s", closed, workflow_id, self.node)
        return closed

    async def stop_standby(self, record: AttemptRecord) -> None:
        standby, record.standby = record.standby, None
        if standby is not None and not standby.poll():
            kill_group(standby.pid, signal.SIGKILL)  # it holds no state: no grace
            if standby.popen is not None:
                await asyncio.to_thread(standby.popen.wait)
            else:
                while not standby.poll():
                    await asyncio.sleep(0.02)
        if standby is not None:
            self.save(record)

    async def stop(self, record: AttemptRecord, grace_s: float) -> int:
        """Stop `record`'s ranks (whole process groups) and its standby: SIGTERM, then SIGKILL after the
        grace. Returns how many ranks were still running."""
        await self.stop_standby(record)
        live = [p for p in record.ranks.values() if not p.poll()]
        for proc in live:
            kill_group(proc.pid, signal.SIGCONT)  # a stopped (hung) rank cannot act on SIGTERM
            kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not all(p.poll() for p in live):
            await asyncio.sleep(0.05)
        for proc in live:
            # The whole group, so children a rank spawned (data loader workers) go too, and its whole tree,
            # so a child that made a session of its own goes too.
            kill_tree(proc.pid)
            kill_group(proc.pid, signal.SIGKILL)
        for proc in live:
            if proc.popen is not None:
                await asyncio.to_thread(proc.popen.wait)
            else:
                while not proc.poll():
                    await asyncio.sleep(0.02)
        self.cgroups.remove_empty()
        return len(live)

    async def fence(self, record: AttemptRecord, why: str, leaving: bool = True) -> int:
        """Stop an attempt's ranks that its run no longer counts on (unless a newer attempt took its place);
        `leaving`: the run has ended or gone on without this node, so its parked processes go too."""
        if self.attempts.get(record.workflow_id) is not record:
            return 0
        if leaving:
            await self.close_parking(record.workflow_id)
        stopped = await self.stop(record, grace_s=2.0)
        if leaving:  # whatever else the run started here (a daemonized child) goes with it
            escaped = await asyncio.to_thread(self.cgroups.kill, record.workflow_id)
            if escaped:
                log.warning("fenced %d more processes of %s in its cgroup on %s", escaped, record.workflow_id,
                            self.node)
        if stopped:
            log.warning("fenced %d ranks of %s attempt %d on %s: %s", stopped, record.workflow_id,
                        record.attempt, self.node, why)
        return stopped

    async def stop_all(self, grace_s: float = 2.0) -> int:
        """Stop every rank this agent runs (on agent shutdown): ranks must never outlive their agent."""
        stopped = 0
        for workflow_id in list(self.parking):
            await self.close_parking(workflow_id)
        for record in list(self.attempts.values()):
            stopped += await self.stop(record, grace_s)
        await asyncio.to_thread(self.cgroups.kill_all)
        return stopped
