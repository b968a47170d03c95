"""Warm relaunch: processes of a run's script parked on this node ahead of need, one per local rank.

A relaunch (a crash, a hang, a GPU fault, a spare's, a shrink's, a grow's) starts new ranks on every node that
stays in the run. Started cold, each pays for the interpreter and its imports (`import torch` and the script's
own: seconds, tens with transformers) before its first step. So the agent keeps, for each run it serves, one
process per local rank already started with the run's entrypoint, environment and working directory, waiting in
`trainguard.rank.standby()`: imports done, before `init_process_group` and before touching a GPU. A launch hands
each rank's role (its environment, its log) to a parked process (`RankLaunch.launch_ranks`) and starts cold only
the ranks it has none for.

Parking is a handshake, never a guess: the agent parks for a run only once the current attempt's ranks wrote
their `StandbyMark` (they called `standby()`), so a script that never calls it is never started ahead of need and
always starts cold. Parked processes are started again in the background, once the attempt they served has made
its first step (their imports would otherwise take CPU from the relaunch itself), and killed, by process group,
when the run ends, leaves the node, changes what it runs, or the agent stops. They are recorded in the run's
`ranks.json` beside its ranks, so `trainguard dev down` and an agent that restarts find them by PID.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from temporalio.exceptions import ApplicationError

from activities.rank_records import AttemptRecord, RankBook, RankProcess, kill_group, log
from trainguard import protocol
from trainguard.procs import start_time
from trainguard.protocol import RunLayout

PARK_POLL_S = 0.5
"""How often a run's keeper looks at its parked processes and at the attempt they serve."""

PARK_AFTER_LAUNCH_MAX_S = 60.0
"""Parked processes are started again after the attempt's first step, or this long after its launch at the
latest (an attempt that restores a large checkpoint may take longer to its first step)."""

SPARE_CHECK_S = 20.0
"""How often the agent asks Temporal whether a run it parks processes for on a spare is still open
(`workers.node_agent.check_parked_spares`): the safety net for a run that vanished without telling (terminated),
one describe per spare pool every 20 s. With its 10 s describe timeout, a terminated run's parked processes are
gone before the pool gives its nodes to another run (`activities.nodes.RECLAIM_AFTER_CLOSED_S`, 45 s): user code
of one run never shares a node with the next."""

MAX_PARK_FAILURES = 3
"""A run whose parked processes exit this many times without taking a role (their imports fail where the
ranks' did not, say) parks no more on this node: its relaunches start cold, as they did before parking."""

Starter = Callable[[Path], subprocess.Popen[bytes]]
"""Starts the run's entrypoint as a parked process waiting for the given role file (`RankLaunch._start`)."""


def park_key(chain_id: str, entrypoint: list[str], cwd: Path, env: dict[str, str], user: str | None) -> str:
    """What a parked process was started with: a launch that would start anything else cannot use it."""
    what = json.dumps([chain_id, entrypoint, str(cwd), sorted(env.items()), user])
    return hashlib.sha256(what.encode()).hexdigest()[:16]


@dataclass
class ParkedProcess:
    number: int
    proc: RankProcess
    role_file: Path
    started_at: float = field(default_factory=time.monotonic)

    def waiting(self) -> bool:
        """It reached `standby()` and waits there for its role."""
        mark = protocol.StandbyMark.read(protocol.mark_path(self.role_file))
        return mark is not None and mark.parked and mark.pid == self.proc.pid


@dataclass
class RunParking:
    """One run's parked processes on this node."""

    workflow_id: str
    key: str
    layout: RunLayout
    ranks_per_node: int
    start: Starter
    processes: list[ParkedProcess] = field(default_factory=list)
    failures: int = 0
    """Parked processes that exited without taking a role."""
    next_number: int = 0
    keeper: asyncio.Task[None] | None = None
    closed: bool = False
    spare: bool = False
    """Parked on a spare the run holds (`Parking.park_spare`): no attempt of the run here yet. The launch that
    brings the spare into the run takes them and keeps the pool from then on (`Parking.keep`)."""
    checked_at: float = field(default_factory=time.monotonic)
    """When the agent last found the run of a spare's pool open (monotonic)."""

    def take(self) -> ParkedProcess | None:
        """A live parked process for a rank, one that waits in `standby()` already first; None when none is
        left. One still importing is taken too: it reaches `standby()` sooner than a cold start would."""
        self.reap()
        if not self.processes:
            return None
        self.processes.sort(key=lambda p: (not p.waiting(), p.number))
        return self.processes.pop(0)

    def reap(self) -> None:
        """Forget parked processes that exited on their own (each a failure: it had no role yet)."""
        gone = [p for p in self.processes if p.proc.poll()]
        for parked in gone:
            self.failures += 1
            log.warning("parked process %d of %s exited (%s) before it was needed; see %s", parked.proc.pid,
                        self.workflow_id, parked.proc.exit_code, protocol.park_log_path(parked.role_file))
            self.processes.remove(parked)
            _remove_files(parked.role_file)

    def entries(self) -> list[protocol.ProcessEntry]:
        return [protocol.ProcessEntry(p.proc.pid, p.proc.start_time) for p in self.processes]

    def fill(self) -> int:
        """Start parked processes up to one per local rank. Returns how many it started."""
        started = 0
        self.layout.parked_dir.mkdir(parents=True, exist_ok=True)
        while len(self.processes) < self.ranks_per_node and self.failures < MAX_PARK_FAILURES:
            self.next_number += 1
            role_file = self.layout.park_file(self.next_number)
            _remove_files(role_file)
            try:
                popen = self.start(role_file)
            except ApplicationError as error:
                self.failures = MAX_PARK_FAILURES
                log.warning("no parked processes for %s: %s", self.workflow_id, error)
                break
            proc = RankProcess(-1, popen.pid, start_time(popen.pid), popen)
            self.processes.append(ParkedProcess(self.next_number, proc, role_file))
            started += 1
        return started

    async def close(self) -> int:
        """Kill every parked process (it holds no state: no grace) and wait for it. Returns how many."""
        self.closed = True
        if self.keeper is not None and self.keeper is not asyncio.current_task():
            self.keeper.cancel()
        parked, self.processes = self.processes, []
        for item in parked:
            if not item.proc.poll():
                kill_group(item.proc.pid, signal.SIGKILL)
        for item in parked:
            if item.proc.popen is not None:
                await asyncio.to_thread(item.proc.popen.wait)
            else:
                while not item.proc.poll():
                    await asyncio.sleep(0.02)
            _remove_files(item.role_file)
        return len(parked)


def _remove_files(role_file: Path) -> None:
    """The role and mark files (the log stays: it may say why a parked process exited)."""
    for path in (role_file, protocol.mark_path(role_file)):
        path.unlink(missing_ok=True)


class Parking:
    """The node's parked processes, one `RunParking` per run, kept in the node's `RankBook`."""

    def __init__(self, book: RankBook) -> None:
        self.book = book

    def pool(self, workflow_id: str, key: str) -> RunParking | None:
        """The run's parked processes if they were started for what `key` describes."""
        pool = self.book.parking.get(workflow_id)
        return pool if pool is not None and pool.key == key and not pool.closed else None

    async def keep(self, record: AttemptRecord, key: str, ranks_per_node: int, start: Starter) -> None:
        """After a launch of `record`: keep the run's parked processes (for `key`) from now on. A pool
        started for something else is closed first."""
        pool = self.book.parking.get(record.workflow_id)
        if pool is not None and (pool.key != key or pool.closed):
            await self.book.close_parking(record.workflow_id)
            pool = None
        if pool is not None and pool.spare:  # the spare joined the run: its pool is kept as any run node's
            pool.spare = False
            if pool.keeper is not None:
                pool.keeper.cancel()
            pool.keeper = None
        if pool is None:
            pool = RunParking(record.workflow_id, key, RunLayout.of(self.book.workdir, record.workflow_id),
                              ranks_per_node, start)
            self.book.parking[record.workflow_id] = pool
        pool.ranks_per_node = ranks_per_node
        if pool.keeper is None or pool.keeper.done():
            pool.keeper = asyncio.ensure_future(self._keep(pool))

    async def park_spare(self, workflow_id: str, key: str, ranks_per_node: int, start: Starter) -> tuple[int, bool]:
        """On a spare the run holds: park the run's processes now (for what `key` describes), so the launch that
        brings the spare in is warm. Idempotent: a pool parked for `key` already is kept. Returns how many are
        parked and whether they were already."""
        pool = self.book.parking.get(workflow_id)
        if pool is not None and pool.key == key and not pool.closed:
            if not pool.spare:  # parked while the node was in the run, which left it (and took it back as a spare)
                pool.spare = True
                if pool.keeper is not None:
                    pool.keeper.cancel()
                pool.keeper = asyncio.ensure_future(self._keep_spare(pool))
            return len(pool.processes), True
        if pool is not None:
            await self.book.close_parking(workflow_id)
        pool = RunParking(workflow_id, key, RunLayout.of(self.book.workdir, workflow_id), ranks_per_node, start,
                          spare=True)
        self.book.parking[workflow_id] = pool
        pool.fill()
        self.book.save_parking(workflow_id)
        pool.keeper = asyncio.ensure_future(self._keep_spare(pool))
        log.info("parked %d processes of %s on spare %s for its relaunch", len(pool.processes), workflow_id,
                 self.book.node)
        return len(pool.processes), False

    async def _keep_spare(self, pool: RunParking) -> None:
        """Replace a spare's parked processes that exit, until the spare joins the run or the pool is closed
        (the run ended or released the spare, the agent found the run closed, the agent stops)."""
        try:
            while not pool.closed and pool.spare:
                pool.reap()
                if len(pool.processes) < pool.ranks_per_node and pool.fill():
                    self.book.save_parking(pool.workflow_id)
                await asyncio.sleep(PARK_POLL_S)
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - a keeper that fails leaves the spare's relaunch cold, never the run broken
            log.exception("keeping parked processes of %s on a spare failed", pool.workflow_id)

    async def _keep(self, pool: RunParking) -> None:
        """Fill the pool once the attempt it serves has started, and close it when the run's ranks here are
        done or another chain of the workflow id runs here."""
        try:
            while not pool.closed:
                record = self.book.record(pool.workflow_id)
                if record is None or _finished(record, pool.layout):
                    await self.book.close_parking(pool.workflow_id)
                    return
                pool.reap()
                if len(pool.processes) < pool.ranks_per_node and _may_park(record, pool.layout):
                    if pool.fill():
                        log.info("parked %d processes of %s on %s for its next relaunch", len(pool.processes),
                                 pool.workflow_id, self.book.node)
                        self.book.save(record)
                await asyncio.sleep(PARK_POLL_S)
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - a keeper that fails leaves relaunches cold, never the run broken
            log.exception("keeping parked processes of %s failed", pool.workflow_id)


def _may_park(record: AttemptRecord, layout: RunLayout) -> bool:
    """The attempt's ranks run, called `standby()` (the handshake), and made their first step (or took long
    to): parked processes started now take no CPU from a relaunch's own start."""
    if not record.ranks or any(p.poll() for p in record.ranks.values()):
        return False  # a relaunch is coming: it starts cold what the pool cannot serve, without contention
    if protocol.StandbyMark.read(layout.standby_mark(record.attempt)) is None:
        return False
    if time.time() - record.launched_at > PARK_AFTER_LAUNCH_MAX_S or record.first_step_at is not None:
        return True
    reports = [protocol.read_progress(layout.progress_file(record.attempt, rank)) for rank in record.ranks]
    return all(r is not None and r.step > record.start_step for r in reports)


def _finished(record: AttemptRecord, layout: RunLayout) -> bool:
    """Every rank of the attempt here exited after reporting its finish: the run needs no relaunch here."""
    if not record.ranks or not all(p.poll() for p in record.ranks.values()):
        return False
    reports = [protocol.read_progress(layout.progress_file(record.attempt, rank)) for rank in record.ranks]
    return all(r is not None and r.finished for r in reports)
