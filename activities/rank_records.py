"""The agent's rank processes and its in-memory record of each run's attempt on this node.

`RankBook` holds what one node agent knows (its attempts, its uploads, its slowdowns) and the bookkeeping
every other part uses: reconcile after an agent restart, find and save an attempt's record. Launch and stop
(`activities.rank_launch`), the watch (`activities.rank_watch`) and chaos (`activities.chaos`) build on it;
`activities.ranks.RankActivities` puts them together.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from activities.health import NodeHealth
from activities.models import AttemptDecision, DownloadShardsInput, DownloadShardsResult, NodeCheckpointRecord, RankEvidence, \
    WatchCheckpoints
from activities.paths import RunLayout
from activities.progress import RankReport
from trainguard import protocol
from trainguard.procs import start_time

log = logging.getLogger("activities.ranks")
"""The agent's rank logs keep the name they always had, whichever part of it logs."""

Uploader = Callable[[str, int, WatchCheckpoints, int, "dict[int, float]", int, str], Awaitable[NodeCheckpointRecord]]
"""(workflow id, attempt, where, step, rank compute times, node step, chain id) -> the node record written."""
Downloader = Callable[[DownloadShardsInput], Awaitable[DownloadShardsResult]]


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

    def to_json(self) -> dict[str, object]:
        """`ranks.json` (`trainguard.protocol.AttemptFile`)."""
        return protocol.AttemptFile(
            workflow_id=self.workflow_id, attempt=self.attempt, master_addr=self.master_addr,
            master_port=self.master_port, start_step=self.start_step, launched_at=self.launched_at,
            chain_id=self.chain_id,
            ranks=[protocol.ProcessEntry(p.pid, p.start_time, p.rank) for p in self.ranks.values()],
            survivors=sorted(self.survivors), restore_tiers=self.restore_tiers,
            standby=None if self.standby is None else protocol.ProcessEntry(self.standby.pid, self.standby.start_time),
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
            record.ranks[item.rank] = RankProcess(item.rank, item.pid, item.start_time)
        return record



def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # ranks lead their own process group (start_new_session)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("no permission to signal process group %s", pid)


def _read_report(path: Path) -> RankReport | None:
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
    )


def _read_finish(path: Path) -> protocol.Finish:
    return protocol.read_finish(path)


def _write_json(path: Path, payload: object) -> None:
    """Whole or not at all (ranks and agents read these while they change)."""
    protocol.write_json(path, payload)


class RankBook:
    """What one node agent knows of the ranks it runs, and its bookkeeping. One instance per node agent."""

    def __init__(self, node: str, workdir: Path, host: str, code_dir: Path, health: NodeHealth | None = None,
                 allowed: tuple[str, ...] = ("*",), chaos: bool = True,
                 allowed_env: frozenset[str] = frozenset(), uploader: Uploader | None = None,
                 downloader: Downloader | None = None,
                 decisions: Callable[[WatchCheckpoints], AttemptDecision | None] | None = None) -> None:
        self.node = node
        self.decisions = decisions
        """Reads the run's newest `AttemptDecision` from the store (`NodeCheckpointActivities.read_decision`),
        blocking: a watch that follows decisions takes up a relaunch there."""
        self.downloader = downloader
        """Downloads the shards a launch restores from (`NodeCheckpointActivities.download_shards`)."""
        self.uploader = uploader
        """Uploads a complete local step and writes its node record (`NodeCheckpointActivities.upload_step`)."""
        self._uploads: dict[tuple[str, str, int, int], asyncio.Task[NodeCheckpointRecord]] = {}
        """`_upload_key` -> its upload, started by a watch and outliving it."""
        self._upload_failed_at: dict[tuple[str, str, int, int], float] = {}
        self.allowed = allowed
        self.allowed_env = allowed_env
        """Env names of `EXEC_ENV_PATTERNS` this node's operator lets a spec set (`--allow-env`)."""
        self.chaos = chaos
        self.workdir = workdir
        self.host = host
        self.code_dir = code_dir
        self.health = health or NodeHealth()
        self._attempts: dict[str, AttemptRecord] = {}
        self._slowdowns: dict[int, asyncio.Task[None]] = {}
        self.hang_evidence: Callable[[AttemptRecord, RunLayout, WatchCheckpoints | None],
                                     Awaitable[list[RankEvidence]]] | None = None
        """Set by `EvidenceActivities`: a watch that judges a hang takes its ranks' evidence with it."""
        self._reconcile()

    # ------------------------------------------------------------------------------- bookkeeping
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
            alive = [p for p in record.ranks.values() if not p.poll()]
            if alive:
                log.info("adopting %d live ranks of %s attempt %d", len(alive), record.workflow_id, record.attempt)
            self._attempts[record.workflow_id] = record

    def _record(self, workflow_id: str) -> AttemptRecord | None:
        return self._attempts.get(workflow_id)

    def _save_record(self, record: AttemptRecord) -> None:
        layout = RunLayout.of(self.workdir, record.workflow_id)
        layout.root.mkdir(parents=True, exist_ok=True)
        _write_json(layout.ranks_file, record.to_json())

    def unwatched(self, idle_s: float) -> list[AttemptRecord]:
        """Attempts with live ranks that no watch has looked at for `idle_s`: after a partition heals (or a
        long controller outage), ranks of an attempt the run has since replaced elsewhere."""
        now = time.monotonic()
        return [r for r in self._attempts.values() if now - r.last_watched > idle_s and (
            any(not p.poll() for p in r.ranks.values()) or (r.standby is not None and not r.standby.poll()))]

