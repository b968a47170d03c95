"""Node-agent activities that touch rank processes: launch, watch, stop, inject faults.

Every activity is idempotent. Launches are fenced by attempt: the node records the newest attempt it has
seen for each run, kills ranks of older attempts before starting new ones, and refuses a late launch of an
older attempt, so ranks of attempt k never run beside attempt k+1.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.models import (
    DownloadShardsInput,
    DownloadShardsResult,
    SLOW_DUTY_MAX,
    SLOW_DUTY_MIN,
    NodeCheckpointRecord,
    WatchCheckpoints,
    InjectFaultInput,
    InjectFaultResult,
    LaunchRanksInput,
    LaunchRanksResult,
    RankEvidence,
    RankGroupInput,
    RejoinRanksInput,
    RejoinRanksResult,
    RequestCheckpointInput,
    RequestCheckpointResult,
    StopRanksInput,
    StopRanksResult,
    WatchEvent,
    WatchEventKind,
    WatchRanksInput,
)
from activities.checkpoints import corrupt_shard, step_of
from activities.evidence import evidence_env, inject_hang
from activities.health import NodeHealth
from activities.paths import RunLayout
from activities.progress import COLLECTIVE_WAIT_GRACE_S, RankReport, complete_steps, find_hung_rank
from activities.rank_logs import exception_line, failure_signature, read_tail
from trainguard.evidence import mode_of as hang_mode_of
from trainguard import protocol
from trainguard.error_types import ErrorType
from trainguard.faults import SIGNALLED, FaultKind, choices as fault_choices
from trainguard.procs import start_time
from trainguard.procs import state as process_state
from trainguard.spec import exec_env_refused, exec_problems

log = logging.getLogger(__name__)

# Variables of the agent's own environment that ranks must not inherit: storage credentials belong to the
# agent (it uploads), never to user code; so do the pool's peer token and Temporal's keys.
_SECRET_ENV_PREFIXES = ("AWS_", "TRAINGUARD_S3_", "TEMPORAL_", "TRAINGUARD_PEER_TOKEN", "TRAINGUARD_CODEC_KEY",
                        "TRAINGUARD_API_KEY", "TRAINGUARD_TLS_KEY")

SPEC_ERRNOS = frozenset({errno.E2BIG, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOEXEC, errno.ENOTDIR,
                         errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG})
"""Exec failures the spec caused (too big, no such program, not executable, not a program): the run's fault,
a non-retryable `BadSpec`. Any other (EMFILE, ENOMEM, EAGAIN) is the node's, and is retried."""

UPLOAD_RETRY_S = 5.0
"""A watch's upload that failed on a store error is tried again after this long (the store may be out;
the committer waits for the step meanwhile)."""

FINAL_UPLOAD_MARGIN_S = 30.0
"""A finished node retries its last uploads against a store that is out until this long past the watch's
`max_duration_s` (its start-to-close timeout leaves 60 s): the last checkpoint is the one a rerun resumes from."""

Uploader = Callable[[str, int, WatchCheckpoints, int, "dict[int, float]", int, str], Awaitable[NodeCheckpointRecord]]
"""(workflow id, attempt, where, step, rank compute times, node step, chain id) -> the node record written."""
Downloader = Callable[[DownloadShardsInput], Awaitable[DownloadShardsResult]]

DOWNLOAD_RETRY_INITIAL_S = 2.0
DOWNLOAD_RETRY_MAX_S = 30.0
"""A watch that launches retries a download the store fails as the transfer policy would (2 s doubling to
30 s): an outage heals; bad bytes (a non-retryable error) never do, and fail the watch at once."""
"""(workflow id, attempt, target, step, rank compute times, node step) -> the node record written."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exited (code unknown: the agent restarted since launch)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _log_fields(log_path: Path, rank: int, exit_code: int | None, reported: str | None = None) -> dict[str, object]:
    """What a rank's exit event says about it from its log: the tail, and, for an exit the rank chose (a
    positive code: an exception, `sys.exit`), the failure's signature and its exception in the detail. An
    error the rank helper itself reported (`reported`, e.g. a checkpoint step it skipped) is named first."""
    tail = read_tail(log_path)
    chosen = exit_code is not None and exit_code > 0
    exception = reported or (exception_line(tail) if chosen else None)
    detail = f"rank {rank} {describe_exit(exit_code)}" + (f": {exception}" if exception else "")
    return {"detail": detail, "log_path": str(log_path), "log_tail": tail,
            "failure_signature": failure_signature(tail) if chosen else None}


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


def _upload_key(record: AttemptRecord, step: int) -> tuple[str, str, int, int]:
    """An upload is one step of one attempt of one run: a rerun of a closed workflow id starts again at attempt
    1, and its chain id tells its uploads from the earlier run's."""
    return record.workflow_id, record.chain_id, record.attempt, step


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


def _program_path(path: str) -> Path:
    """`path` made absolute with its directories resolved as the kernel resolves them (so `..` and symlinked
    folders cannot lead a check astray), its last part kept: a venv's `python` is a symlink to be run as such."""
    absolute = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)  # no lexical `..` folding
    head, tail = os.path.split(absolute)
    return Path(os.path.realpath(head)) / tail


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RankActivities:
    """Rank processes on one node. One instance per node agent."""

    def __init__(self, node: str, workdir: Path, host: str, code_dir: Path, health: NodeHealth | None = None,
                 allowed: tuple[str, ...] = ("*",), chaos: bool = True,
                 allowed_env: frozenset[str] = frozenset(), uploader: Uploader | None = None,
                 downloader: Downloader | None = None) -> None:
        self.node = node
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

    async def _stop_standby(self, record: AttemptRecord) -> None:
        standby, record.standby = record.standby, None
        if standby is not None and not standby.poll():
            _kill_group(standby.pid, signal.SIGKILL)  # it holds no state: no grace
            if standby.popen is not None:
                await asyncio.to_thread(standby.popen.wait)
            else:
                while not standby.poll():
                    await asyncio.sleep(0.02)
        if standby is not None:
            self._save_record(record)

    async def _stop_record(self, record: AttemptRecord, grace_s: float) -> int:
        await self._stop_standby(record)
        live = [p for p in record.ranks.values() if not p.poll()]
        for proc in live:
            _kill_group(proc.pid, signal.SIGCONT)  # a stopped (hung) rank cannot act on SIGTERM
            _kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not all(p.poll() for p in live):
            await asyncio.sleep(0.05)
        for proc in live:
            # The whole group, so children a rank spawned (data loader workers) go too.
            _kill_group(proc.pid, signal.SIGKILL)
        for proc in live:
            if proc.popen is not None:
                await asyncio.to_thread(proc.popen.wait)
            else:
                while not proc.poll():
                    await asyncio.sleep(0.02)
        return len(live)

    def unwatched(self, idle_s: float) -> list[AttemptRecord]:
        """Attempts with live ranks that no watch has looked at for `idle_s`: after a partition heals (or a
        long controller outage), ranks of an attempt the run has since replaced elsewhere."""
        now = time.monotonic()
        return [r for r in self._attempts.values() if now - r.last_watched > idle_s and (
            any(not p.poll() for p in r.ranks.values()) or (r.standby is not None and not r.standby.poll()))]

    async def fence(self, record: AttemptRecord, why: str) -> int:
        """Stop an attempt's ranks that its run no longer counts on (unless a newer attempt took its place)."""
        if self._attempts.get(record.workflow_id) is not record:
            return 0
        stopped = await self._stop_record(record, grace_s=2.0)
        if stopped:
            log.warning("fenced %d ranks of %s attempt %d on %s: %s", stopped, record.workflow_id,
                        record.attempt, self.node, why)
        return stopped

    async def stop_all(self, grace_s: float = 2.0) -> int:
        """Stop every rank this agent runs (on agent shutdown): ranks must never outlive their agent."""
        stopped = 0
        for record in list(self._attempts.values()):
            stopped += await self._stop_record(record, grace_s)
        return stopped

    # -------------------------------------------------------------------------------- activities
    @activity.defn(name="launch_ranks")
    async def launch_ranks(self, request: LaunchRanksInput) -> LaunchRanksResult:
        """Start this node's ranks for one attempt, with torchrun's environment and a fresh rendezvous."""
        current = self._record(request.workflow_id)
        same_run = current is not None and current.chain_id == request.chain_id
        if current is not None and same_run and current.attempt > request.attempt:
            raise ApplicationError(
                f"node {self.node} already runs attempt {current.attempt} of {request.workflow_id}; "
                f"refusing stale attempt {request.attempt}",
                type=ErrorType.STALE_ATTEMPT,
                non_retryable=True,
            )
        if (current is not None and same_run and current.attempt == request.attempt
                and any(not p.poll() for p in current.ranks.values())):
            # A retried launch (worker crash, lost completion): adopt what is running, start nothing twice.
            return LaunchRanksResult(
                node=self.node,
                master_addr=current.master_addr,
                master_port=current.master_port,
                pids=[p.pid for p in current.ranks.values()],
                adopted=True,
            )
        if current is not None:
            stopped = await self._stop_record(current, grace_s=1.0)
            if stopped:
                log.info("fenced %d ranks of %s attempt %d", stopped, request.workflow_id, current.attempt)

        cwd = self._working_dir(request.working_dir)
        request = request.model_copy(update={"entrypoint": self._check_allowed(request, cwd)})
        master_addr = request.master_addr or self.host
        master_port = request.master_port or _free_port(self.host)
        record = AttemptRecord(
            workflow_id=request.workflow_id,
            attempt=request.attempt,
            master_addr=master_addr,
            master_port=master_port,
            start_step=request.restore_step,
            launched_at=time.time(),
            chain_id=request.chain_id,
        )
        self._attempts[request.workflow_id] = record
        layout = RunLayout.of(self.workdir, request.workflow_id)
        self._drop_uncommitted_shards(layout, request.restore_step)
        for path in (layout.progress_dir(request.attempt), layout.logs_dir(request.attempt),
                     layout.checkpoint_dir, layout.tmp_dir):
            path.mkdir(parents=True, exist_ok=True)
        extra = {protocol.ENV_RESTORE_STEP: str(request.restore_step)}
        if request.restore_dir:
            extra[protocol.ENV_RESTORE_DIR] = request.restore_dir
        if request.rejoin_timeout_s is not None:
            extra[protocol.ENV_REJOIN_TIMEOUT_S] = str(request.rejoin_timeout_s)
        for local_rank in range(request.ranks_per_node):
            await self._spawn(record, layout, request, cwd, local_rank, extra)
        if request.rejoin_timeout_s is not None:
            self._start_standby(record, layout, request, cwd)
        log.info(
            "launched ranks %s of %s attempt %d on %s (rendezvous %s:%d)",
            sorted(record.ranks), request.workflow_id, request.attempt, self.node, master_addr, master_port,
        )
        return LaunchRanksResult(
            node=self.node, master_addr=master_addr, master_port=master_port,
            pids=[p.pid for p in record.ranks.values()],
        )

    def _working_dir(self, working_dir: str | None) -> Path:
        try:
            cwd = Path(working_dir) if working_dir else self.code_dir
            exists = cwd.is_dir()
        except ValueError:  # a NUL byte: a spec this agent's own check below names
            exists = False
        if not exists:
            raise ApplicationError(
                f"working_dir {working_dir!r} does not exist on node {self.node}: name a directory every node "
                f"of the run has", type=ErrorType.BAD_SPEC, non_retryable=True)
        return cwd

    def _rank_env(self, record: AttemptRecord, layout: RunLayout, request: RankGroupInput,
                  local_rank: int, extra: dict[str, str]) -> dict[str, str]:
        """torchrun's environment for one rank of `record`'s attempt, plus trainguard's."""
        rank = request.node_rank * request.ranks_per_node + local_rank
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "GROUP_RANK": str(request.node_rank),
            "WORLD_SIZE": str(request.num_nodes * request.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(request.ranks_per_node),
            "MASTER_ADDR": record.master_addr,
            "MASTER_PORT": str(record.master_port),
            protocol.ENV_ATTEMPT: str(record.attempt),
            protocol.ENV_PROGRESS_FILE: str(layout.progress_file(record.attempt, rank)),
            protocol.ENV_CHECKPOINT_DIR: str(layout.checkpoint_dir),
            protocol.ENV_CHECKPOINT_EVERY: str(request.checkpoint_every),
            protocol.ENV_CHECKPOINT_REQUEST_FILE: str(layout.checkpoint_request_file(record.attempt)),
            protocol.ENV_REJOIN_FILE: str(layout.rejoin_file(rank)),
            **evidence_env(layout, record.attempt, rank, request.env),
            **extra,
        }

    def _start(self, layout: RunLayout, request: RankGroupInput, cwd: Path, log_path: Path,
               env: dict[str, str]) -> subprocess.Popen[bytes]:
        """The entrypoint in a session of its own (so its whole tree can be signalled), without the agent's
        secrets in its environment."""
        full = {k: v for k, v in os.environ.items() if not k.startswith(_SECRET_ENV_PREFIXES)}
        full.setdefault("OMP_NUM_THREADS", "1")
        full.update(request.env)
        full.update({"TMPDIR": str(layout.tmp_dir), protocol.ENV_WORKFLOW_ID: request.workflow_id,
                     protocol.ENV_NODE: self.node, **env})
        log_file = log_path.open("ab")
        try:
            return subprocess.Popen(  # noqa: S603 - an argv list, never a shell string
                request.entrypoint,
                cwd=cwd,
                env=full,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except (ValueError, TypeError, OSError) as error:
            # ValueError: a NUL byte, a lone surrogate; OSError: what exec refused. A spec's fault is the
            # run's, never the node's: only an exec failure the node caused is left to retry.
            if isinstance(error, OSError) and error.errno not in SPEC_ERRNOS:
                raise
            field = {errno.E2BIG: "entrypoint and env"}.get(getattr(error, "errno", None) or 0, "entrypoint.0")
            if not isinstance(error, OSError):
                field = "entrypoint, env or working_dir"
            raise ApplicationError(
                f"{field}: cannot start entrypoint {request.entrypoint[0]!r} on node {self.node}: {error}",
                type=ErrorType.BAD_SPEC,
                non_retryable=True,
            ) from None
        finally:
            log_file.close()

    async def _spawn(self, record: AttemptRecord, layout: RunLayout, request: RankGroupInput,
                     cwd: Path, local_rank: int, extra: dict[str, str]) -> None:
        """Start one rank of `record`'s attempt and record it before anything else can happen."""
        rank = request.node_rank * request.ranks_per_node + local_rank
        env = self._rank_env(record, layout, request, local_rank, extra)
        try:
            popen = self._start(layout, request, cwd, layout.log_file(record.attempt, rank), env)
        except Exception:
            # No half-started attempt: a retried launch would adopt the ranks that did start as the whole.
            await self._stop_record(record, grace_s=0.5)
            raise
        self._track(record, rank, popen.pid, popen)

    def _track(self, record: AttemptRecord, rank: int, pid: int, popen: subprocess.Popen[bytes] | None) -> None:
        record.ranks[rank] = RankProcess(rank, pid, start_time(pid), popen)
        threading.Thread(target=record.ranks[rank].stamp_exit, name=f"rank-{rank}-exit", daemon=True).start()
        self._save_record(record)

    def _start_standby(self, record: AttemptRecord, layout: RunLayout, request: RankGroupInput,
                       cwd: Path) -> None:
        """One process of the entrypoint, started now so a rank that dies later is replaced without paying
        for the interpreter and its imports: it waits in `trainguard.rank.standby()` for the role file."""
        path = layout.standby_file(record.attempt)
        path.unlink(missing_ok=True)
        try:
            popen = self._start(layout, request, cwd, layout.logs_dir(record.attempt) / protocol.STANDBY_LOG,
                                {protocol.ENV_STANDBY_FILE: str(path)})
        except ApplicationError as error:
            log.warning("no standby process on %s: %s", self.node, error)
            return
        record.standby = RankProcess(-1, popen.pid, start_time(popen.pid), popen)
        self._save_record(record)

    @activity.defn(name="rejoin_ranks")
    async def rejoin_ranks(self, request: RejoinRanksInput) -> RejoinRanksResult:
        """In-process restart on this node: tell its live ranks which new process group to join, and start
        its dead ranks again as joiners that take their state from a live peer. Idempotent: a retry finds the
        node already on the new attempt and answers the same."""
        current = self._record(request.workflow_id)
        if current is not None and current.chain_id == request.chain_id and current.attempt == request.attempt:
            return RejoinRanksResult(node=self.node, master_addr=current.master_addr,
                                     master_port=current.master_port, survivors=sorted(current.survivors),
                                     joiners=sorted(set(current.ranks) - current.survivors),
                                     step=current.start_step if current.survivors else None)
        if current is None or current.chain_id != request.chain_id or current.attempt != request.from_attempt:
            raise ApplicationError(
                f"node {self.node} does not run attempt {request.from_attempt} of {request.workflow_id} "
                f"(it runs {current.attempt if current else 'nothing'}): nothing to keep, relaunch instead",
                type=ErrorType.NO_SUCH_ATTEMPT, non_retryable=True)
        cwd = self._working_dir(request.working_dir)
        request = request.model_copy(update={"entrypoint": self._check_allowed(request, cwd)})
        layout = RunLayout.of(self.workdir, request.workflow_id)
        alive = {r: p for r, p in current.ranks.items() if not p.poll()}
        reports = [_read_report(layout.progress_file(current.attempt, r)) for r in alive]
        steps = [r.step for r in reports if r is not None]
        master_addr = request.master_addr or self.host
        record = AttemptRecord(
            workflow_id=request.workflow_id, attempt=request.attempt, master_addr=master_addr,
            master_port=request.master_port or _free_port(self.host),
            start_step=min(steps) if steps else current.start_step, launched_at=time.time(),
            ranks=dict(alive), chain_id=request.chain_id, survivors=set(alive),
        )
        for path in (layout.progress_dir(record.attempt), layout.logs_dir(record.attempt),
                     layout.rejoin_file(0).parent):
            path.mkdir(parents=True, exist_ok=True)
        self._attempts[request.workflow_id] = record
        self._save_record(record)
        world_size = request.num_nodes * request.ranks_per_node
        for rank in sorted(alive):
            # The live rank moves its progress to the new attempt's file, as a fresh launch would write it.
            protocol.Rejoin(attempt=record.attempt, master_addr=record.master_addr,
                            master_port=record.master_port, world_size=world_size,
                            progress_file=str(layout.progress_file(record.attempt, rank)),
                            checkpoint_request_file=str(layout.checkpoint_request_file(record.attempt)),
                            ).write(layout.rejoin_file(rank))
        standby = current.standby if current.standby is not None and not current.standby.poll() else None
        current.standby = None  # it moves to the new attempt's record: as a rank, or to be stopped with it
        used_standby = False
        for local_rank in range(request.ranks_per_node):
            rank = request.node_rank * request.ranks_per_node + local_rank
            if rank in alive:
                continue
            extra = {protocol.ENV_JOIN: protocol.JOIN_YES, protocol.ENV_RESTORE_STEP: str(record.start_step),
                     protocol.ENV_REJOIN_TIMEOUT_S: str(request.rejoin_timeout_s)}
            if standby is not None:
                # The standby has the interpreter and torch loaded: give it this rank's role.
                env = self._rank_env(record, layout, request, local_rank, extra)
                protocol.StandbyRole(env).write(layout.standby_file(current.attempt))
                self._track(record, rank, standby.pid, standby.popen)
                standby, used_standby = None, True
            else:
                await self._spawn(record, layout, request, cwd, local_rank, extra)
        record.standby = standby
        if record.standby is None:
            self._start_standby(record, layout, request, cwd)
        log.info("in-process restart of %s attempt %d -> %d on %s: kept ranks %s, restarted %s%s (group %s:%d)",
                 request.workflow_id, request.from_attempt, record.attempt, self.node, sorted(alive),
                 sorted(set(record.ranks) - set(alive)), " (one from the standby)" if used_standby else "",
                 record.master_addr, record.master_port)
        return RejoinRanksResult(node=self.node, master_addr=record.master_addr, master_port=record.master_port,
                                 survivors=sorted(alive), joiners=sorted(set(record.ranks) - set(alive)),
                                 step=min(steps) if steps else None)

    def _check_allowed(self, request: RankGroupInput, cwd: Path) -> list[str]:
        """Run only programs this agent's own configuration allows (`--allow`): a spec is user input. The
        program is found with this agent's own PATH (a bare name) or in the ranks' working directory (a relative
        path), never with the spec's `env.PATH`, and the argv returned names it by that absolute path: the
        program checked is the program executed. Env names that would change what runs or what it loads
        (`EXEC_ENV_PATTERNS`) need this node's operator's `--allow-env`."""
        def bad_spec(message: str) -> ApplicationError:
            return ApplicationError(f"{message} (node {self.node})", type=ErrorType.BAD_SPEC, non_retryable=True)

        problems = exec_problems(request.entrypoint, request.env, request.working_dir)
        if problems:
            raise bad_spec("; ".join(problems))
        refused = [name for name in request.env if exec_env_refused(name, self.allowed_env)]
        if refused:
            raise bad_spec("; ".join(
                f"env.{name}: changes what the ranks run or load, which this node's --allow list decides; "
                f"leave it out, or ask the node's operator to allow it with --allow-env {name}" for name in refused))
        name = request.entrypoint[0]
        if os.sep in name:
            found: str | None = str(cwd / name)  # as exec would see it: relative to the ranks' directory
        else:
            found = shutil.which(name, path=os.environ.get("PATH", os.defpath))  # the agent's PATH
        if found is None or not os.path.isfile(found) or not os.access(found, os.X_OK):
            raise bad_spec(f"entrypoint.0: {name!r} is no executable program here (a bare name is looked up with "
                           f"the agent's own PATH, never the spec's env.PATH)")
        program = _program_path(found)
        if "*" not in self.allowed:
            # Both the path as named (a venv's python is a symlink) and its target may match.
            candidates = {program, Path(os.path.realpath(found))}
            roots = {p for allowed in self.allowed for p in (_program_path(allowed), Path(os.path.realpath(allowed)))}
            if not any(path == root or root in path.parents for path in candidates for root in roots):
                raise ApplicationError(
                    f"entrypoint {name!r} is not allowed on node {self.node} (allowed: {', '.join(self.allowed)}); "
                    f"ask the node's operator to add it with --allow",
                    type=ErrorType.ENTRYPOINT_NOT_ALLOWED,
                    non_retryable=True,
                )
        return [str(program), *request.entrypoint[1:]]

    @activity.defn(name="stop_ranks")
    async def stop_ranks(self, request: StopRanksInput) -> StopRanksResult:
        """Stop the run's ranks on this node (whole process groups): SIGTERM, then SIGKILL after the grace."""
        record = self._record(request.workflow_id)
        if record is None or (request.attempt is not None and record.attempt > request.attempt):
            return StopRanksResult(stopped=0)
        return StopRanksResult(stopped=await self._stop_record(record, request.grace_s))

    @activity.defn(name="request_checkpoint")
    async def request_checkpoint(self, request: RequestCheckpointInput) -> RequestCheckpointResult:
        """Report where this node's ranks are; with a step, ask them to checkpoint at it. Idempotent."""
        record = self._record(request.workflow_id)
        if record is None or record.attempt != request.attempt:
            raise ApplicationError(f"node {self.node} runs no attempt {request.attempt} of {request.workflow_id}",
                                   type=ErrorType.NO_SUCH_ATTEMPT, non_retryable=True)
        layout = RunLayout.of(self.workdir, request.workflow_id)
        reports = [r for r in (_read_report(layout.progress_file(record.attempt, rank)) for rank in record.ranks) if r]
        if request.step is not None:
            protocol.CheckpointRequest(request.step).write(layout.checkpoint_request_file(record.attempt))
        times = [r.step_time_s for r in reports if r.step_time_s]
        return RequestCheckpointResult(node=self.node, step=max((r.step for r in reports), default=-1),
                                       step_time_s=max(times) if times else None)

    @activity.defn(name="inject_fault")
    async def inject_fault(self, request: InjectFaultInput) -> InjectFaultResult:
        """Chaos, carried out by the agent itself: the faults of the field, on demand."""
        if not self.chaos:
            raise ApplicationError(f"chaos is switched off on node {self.node} (agent started with --no-chaos)",
                                   type=ErrorType.CHAOS_DISABLED, non_retryable=True)
        now = time.time()
        if request.fault == FaultKind.GPU:
            self.health.inject("GPU has fallen off the bus (injected by trainguard chaos)", now)
            return InjectFaultResult(node=self.node, rank=-1, pid=os.getpid(), injected_at=now)
        if request.fault == FaultKind.CORRUPT:
            if not request.bucket or not request.manifest_key:
                raise ApplicationError("corrupt needs the checkpoint's bucket and manifest key",
                                       type=ErrorType.BAD_FAULT,
                                       non_retryable=True)
            layout = RunLayout.of(self.workdir, request.workflow_id)
            shard = await asyncio.to_thread(corrupt_shard, request.bucket, request.manifest_key, self.node,
                                            request.rank, layout.local_step_dir(step_of(request.manifest_key)))
            return InjectFaultResult(node=self.node, rank=shard.rank, pid=-1, injected_at=now,
                                     step=step_of(shard.key))
        if request.fault == FaultKind.NODE_DOWN:
            # Reply first, then die with every rank: the machine is gone as far as the run can tell.
            asyncio.get_running_loop().call_later(0.3, self._die)
            record = self._record(request.workflow_id)
            if record is not None:
                for rank in record.ranks:
                    record.faults.setdefault(rank, now)
            return InjectFaultResult(node=self.node, rank=-1, pid=os.getpid(), injected_at=now)
        record = self._record(request.workflow_id)
        live = {r: p for r, p in (record.ranks.items() if record else []) if not p.poll()}
        if not live:
            raise ApplicationError(
                f"no live rank of {request.workflow_id} on node {self.node}",
                type=ErrorType.NO_SUCH_RANK, non_retryable=True
            )
        rank = request.rank if request.rank is not None else min(live)
        if rank not in live:
            raise ApplicationError(
                f"rank {rank} is not running on node {self.node} (running: {sorted(live)})",
                type=ErrorType.NO_SUCH_RANK,
                non_retryable=True,
            )
        assert record is not None
        pid = live[rank].pid
        if request.fault == FaultKind.SLOW:
            duty = request.slow_duty
            if not SLOW_DUTY_MIN <= duty <= SLOW_DUTY_MAX:
                raise ApplicationError(f"slow_duty {duty:g} is out of range: give {SLOW_DUTY_MIN} to {SLOW_DUTY_MAX}",
                                       type=ErrorType.BAD_FAULT, non_retryable=True)
            self._slowdowns[pid] = asyncio.create_task(self._duty_cycle(live[rank], duty))
            log.info("chaos: slowing rank %d (pid %d) on %s, stopped %.0f%% of the time", rank, pid, self.node,
                     duty * 100)
            return InjectFaultResult(node=self.node, rank=rank, pid=pid, injected_at=now)
        mode = hang_mode_of(request.fault)
        if mode is not None and mode != "stop":  # carried out by the rank's own helper
            await asyncio.to_thread(inject_hang, RunLayout.of(self.workdir, request.workflow_id), record, rank,
                                    mode)
            injected_at = record.faults.setdefault(rank, now)
            log.info("chaos: hang --mode %s rank %d (pid %d) of %s on %s", mode, rank, pid, request.workflow_id,
                     self.node)
            return InjectFaultResult(node=self.node, rank=rank, pid=pid, injected_at=injected_at)
        signals = {FaultKind.CRASH: signal.SIGKILL, FaultKind.HANG: signal.SIGSTOP}
        if request.fault not in SIGNALLED:
            raise ApplicationError(
                f"unknown fault {request.fault!r}; expected one of {fault_choices()}",
                type=ErrorType.BAD_FAULT, non_retryable=True,
            )
        injected_at = record.faults.setdefault(rank, now)
        # Signal the rank's own process only: a real fault hits one process, not its group.
        try:
            os.kill(pid, signals[request.fault])
        except ProcessLookupError:
            pass
        log.info("chaos: %s rank %d (pid %d) of %s on %s", request.fault, rank, pid, request.workflow_id, self.node)
        return InjectFaultResult(node=self.node, rank=rank, pid=pid, injected_at=injected_at)

    @staticmethod
    async def _duty_cycle(proc: RankProcess, duty: float, period_s: float = 0.1) -> None:
        """Stop and continue a rank so it runs only (1 - duty) of the time: a slow GPU, a noisy neighbour."""
        try:
            while not proc.poll():
                os.kill(proc.pid, signal.SIGSTOP)
                await asyncio.sleep(period_s * duty)
                os.kill(proc.pid, signal.SIGCONT)
                await asyncio.sleep(period_s * (1 - duty))
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _die(self) -> None:
        for record in self._attempts.values():
            for proc in [*record.ranks.values(), *([record.standby] if record.standby else [])]:
                if not proc.poll():
                    _kill_group(proc.pid, signal.SIGKILL)
        log.warning("chaos: node-down on %s: agent and ranks killed", self.node)
        os.kill(os.getpid(), signal.SIGKILL)

    @activity.defn(name="watch_ranks")
    async def watch_ranks(self, request: WatchRanksInput) -> WatchEvent:
        """Watch this node's ranks; return on the first event (exit, hang, checkpoint ready, all finished).
        With `request.launch`, launch the attempt's ranks here first (downloading their shards first with
        `request.download`), unless this node already runs that attempt."""
        if request.launch is not None:
            await self._launch_from_watch(request, request.launch)
        record = self._record(request.workflow_id)
        if record is None or record.attempt != request.attempt:
            raise ApplicationError(
                f"node {self.node} has no ranks of {request.workflow_id} attempt {request.attempt}",
                type=ErrorType.NO_SUCH_ATTEMPT,
                non_retryable=True,
            )
        layout = RunLayout.of(self.workdir, request.workflow_id)
        health = request.health
        started = time.monotonic()
        next_gpu_check = started + health.gpu_check_interval_s
        alive_reported = -1
        local_ranks = set(record.ranks)
        next_heartbeat = 0.0
        while True:
            now = time.time()
            reports = {r: _read_report(layout.progress_file(record.attempt, r)) for r in local_ranks}
            if record.first_step_at is None and any(
                rep is not None and rep.step > record.start_step for rep in reports.values()
            ):
                record.first_step_at = min(
                    rep.time for rep in reports.values() if rep is not None and rep.step > record.start_step
                )
            steps = [rep.step if rep else record.start_step for rep in reports.values()]
            node_step = min(steps) if steps else -1
            if time.monotonic() >= next_heartbeat:  # a large run's watches heartbeat less often
                next_heartbeat = time.monotonic() + (request.heartbeat_every_s or 0.0)
                activity.heartbeat(protocol.WatchHeartbeat(
                    node=self.node, attempt=record.attempt,
                    steps={r: (rep.step if rep else None) for r, rep in reports.items()}).to_json())

            def event(kind: WatchEventKind, **fields: object) -> WatchEvent:
                return WatchEvent(kind=kind, node=self.node, detected_at=now, first_step_at=record.first_step_at,
                                  step=node_step, restore_tiers=record.restore_tiers, **fields)  # type: ignore[arg-type]

            ready = complete_steps(self._saved_steps(layout), local_ranks, max(request.reported_step,
                                                                                 record.start_step))
            compute = {r: rep.compute_s for r, rep in reports.items() if rep is not None and rep.compute_s}
            if ready and request.checkpoints is None:
                return event(WatchEventKind.CHECKPOINT_READY, checkpoint_steps=ready, rank_compute_s=compute)
            if ready and request.checkpoints is not None:
                self._upload_ready(record, request.checkpoints, ready, compute, node_step)
            if request.report_start and record.first_step_at is not None:
                return event(WatchEventKind.STARTED)

            if self.health.injected is not None or time.monotonic() >= next_gpu_check:
                next_gpu_check = time.monotonic() + health.gpu_check_interval_s
                gpu = await asyncio.to_thread(self.health.check)
                if gpu.available and not gpu.healthy:
                    return event(WatchEventKind.GPU_UNHEALTHY, detail=gpu.detail,
                                 fault_at=self.health.injected_at)

            for rank in sorted(local_ranks):
                proc = record.ranks[rank]
                if proc.poll() and proc.exit_code not in (0,) and not (reports[rank] and reports[rank].finished):
                    report = reports[rank]
                    fault_at = record.faults.get(rank) or (report.time if report else record.launched_at)
                    return event(WatchEventKind.RANK_EXITED, rank=rank, exit_code=proc.exit_code,
                                 fault_at=fault_at, occurred_at=record.faults.get(rank) or proc.exited_at,
                                 **_log_fields(layout.log_file(record.attempt, rank), rank, proc.exit_code,
                                               report.error if report else None))

            if all(record.ranks[r].poll() for r in local_ranks):
                # Every rank here is done: nothing is left for a standby to replace.
                await self._stop_standby(record)
                first = min(local_ranks)
                finish = _read_finish(layout.progress_file(record.attempt, first))
                if request.checkpoints is not None:  # FINISHED: the node's checkpoints are in the store
                    await self._upload_all(record, request.checkpoints, ready, compute, node_step,
                                           until=started + request.max_duration_s + FINAL_UPLOAD_MARGIN_S)
                return event(WatchEventKind.FINISHED, state_digest=finish.digest,
                             mean_step_s=finish.mean_step_s)

            record.last_watched = time.monotonic()
            running = {r for r in local_ranks if not record.ranks[r].poll()}
            if len(running) != alive_reported:
                alive_reported = len(running)
                activity.metric_meter().create_gauge("trainguard_ranks_alive", "Rank processes alive").set(
                    alive_reported, {"node": self.node})
            states = {r: process_state(record.ranks[r].pid) for r in running}
            hung = find_hung_rank(reports, running, record.start_step, record.launched_at, now, health, states,
                                  grace_s=0.0 if request.evidence else COLLECTIVE_WAIT_GRACE_S)
            if hung is not None:
                rank, silent = hung
                report = reports[rank]
                state = {"T": "stopped", "t": "stopped", "D": "in uninterruptible I/O", "Z": "defunct"}.get(
                    states[rank], "alive")
                fault_at = record.faults.get(rank) or (report.time if report else record.launched_at)
                log_path = layout.log_file(record.attempt, rank)
                evidence = (await self.hang_evidence(record, layout, request.checkpoints)
                            if request.evidence_with_event and self.hang_evidence is not None else [])
                return event(WatchEventKind.HANG, rank=rank, fault_at=fault_at, evidence=evidence,
                             occurred_at=record.faults.get(rank), log_path=str(log_path),
                             log_tail=read_tail(log_path),
                             detail=f"rank {rank} made no progress for {silent:.1f}s (last step "
                                    f"{report.step if report else 'none'}; process {state})")

            if time.monotonic() - started > request.max_duration_s:
                return event(WatchEventKind.KEEPALIVE)
            await asyncio.sleep(health.poll_interval_s)

    async def _launch_from_watch(self, request: WatchRanksInput, launch: LaunchRanksInput) -> None:
        """The launch a relaunch's watch carries: idempotent by attempt, as `launch_ranks` is (a watch started
        again after a keepalive or a controller restart launches nothing twice)."""
        current = self._record(request.workflow_id)
        if current is not None and current.chain_id == launch.chain_id and current.attempt >= launch.attempt:
            return  # launched already; a newer attempt here fails the watch just below (NoSuchAttempt)
        tiers: list[str] = []
        if request.download is not None:
            restored = await self._download_for_launch(request.download, request.download_timeout_s)
            launch = launch.model_copy(update={"restore_dir": restored.restore_dir})
            tiers = sorted(set(restored.tiers.values()))
        await self.launch_ranks(launch)
        record = self._record(request.workflow_id)
        if record is not None and tiers:
            record.restore_tiers = tiers
            self._save_record(record)

    async def _download_for_launch(self, request: DownloadShardsInput, timeout_s: float) -> DownloadShardsResult:
        """Download as `download_shards` does, heartbeating the watch meanwhile (one shard can take longer
        than the watch's heartbeat timeout), retrying what the store fails until `timeout_s`."""
        if self.downloader is None:
            raise ApplicationError(f"node {self.node} has no checkpoint tier to restore from",
                                   type=ErrorType.NO_LOCAL_SHARDS, non_retryable=True)
        deadline, delay = time.monotonic() + timeout_s, DOWNLOAD_RETRY_INITIAL_S
        while True:
            task = asyncio.ensure_future(self.downloader(request))
            while not task.done():
                activity.heartbeat(protocol.WatchHeartbeat(node=self.node, attempt=request.attempt, downloading=True).to_json())
                await asyncio.wait([task], timeout=1.0)
            error = task.exception()
            if error is None:
                return task.result()
            if (isinstance(error, ApplicationError) and error.non_retryable) or time.monotonic() + delay > deadline:
                raise error
            log.warning("download for attempt %d of %s failed, retrying in %.0fs: %s", request.attempt,
                        request.workflow_id, delay, error)
            resume = time.monotonic() + delay
            while time.monotonic() < resume:  # the watch's heartbeat timeout is shorter than the backoff
                activity.heartbeat(protocol.WatchHeartbeat(node=self.node, attempt=request.attempt, downloading=True).to_json())
                await asyncio.sleep(min(1.0, resume - time.monotonic()))
            delay = min(DOWNLOAD_RETRY_MAX_S, delay * 2)

    def _upload_ready(self, record: AttemptRecord, target: WatchCheckpoints, steps: list[int],
                      compute: dict[int, float], node_step: int) -> None:
        """Start the upload of every complete local step not uploaded yet (or whose upload failed more than
        `UPLOAD_RETRY_S` ago and can heal). The upload runs beside the watch, which keeps polling."""
        if self.uploader is None:
            return
        for old in [k for k, t in self._uploads.items() if k[0] == record.workflow_id and t.done()
                    and k[1:3] != (record.chain_id, record.attempt)]:
            del self._uploads[old]  # an earlier attempt's: nothing asks about it again
            self._upload_failed_at.pop(old, None)
        for step in steps:
            key = _upload_key(record, step)
            task = self._uploads.get(key)
            if task is not None and not task.done():
                continue
            if task is not None:
                error = task.exception()
                if error is None:
                    continue
                if isinstance(error, ApplicationError) and error.non_retryable:
                    continue  # bad bytes never heal: the step stays uncommitted, an older one restores
                if time.monotonic() - self._upload_failed_at.get(key, 0.0) < UPLOAD_RETRY_S:
                    continue
            self._uploads[key] = asyncio.ensure_future(self._upload(record, target, step, compute, node_step))

    async def _upload(self, record: AttemptRecord, target: WatchCheckpoints, step: int,
                      compute: dict[int, float], node_step: int) -> NodeCheckpointRecord:
        assert self.uploader is not None
        key = _upload_key(record, step)
        try:
            return await self.uploader(record.workflow_id, record.attempt, target, step, compute, node_step,
                                       record.chain_id)
        except BaseException as error:
            self._upload_failed_at[key] = time.monotonic()
            log.warning("upload of step %d of %s attempt %d failed: %s", step, record.workflow_id,
                        record.attempt, error)
            raise

    async def _upload_all(self, record: AttemptRecord, target: WatchCheckpoints, steps: list[int],
                          compute: dict[int, float], node_step: int, until: float) -> None:
        """The ranks are done: upload every complete step not uploaded yet, retrying a store that is out
        until `until` (monotonic), heartbeating meanwhile, so the run's last checkpoint is not lost to an
        outage that ends after its last step."""
        while time.monotonic() < until:
            self._upload_ready(record, target, steps, compute, node_step)
            tasks = [self._uploads[key] for key in (_upload_key(record, s) for s in steps) if key in self._uploads]
            pending = [t for t in tasks if not t.done()]
            retryable = [t for t in tasks if t.done() and (error := t.exception()) is not None
                         and not (isinstance(error, ApplicationError) and error.non_retryable)]
            if not pending and not retryable:
                return
            activity.heartbeat(protocol.WatchHeartbeat(node=self.node, attempt=record.attempt, uploading=len(pending)).to_json())
            if pending:
                await asyncio.wait(pending, timeout=1.0)
            else:
                await asyncio.sleep(1.0)
        log.warning("%s attempt %d: the store is still out; finishing without the last uploads",
                    record.workflow_id, record.attempt)

    @staticmethod
    def _drop_uncommitted_shards(layout: RunLayout, restore_step: int) -> None:
        """Local shards newer than the restored step belong to a dead attempt: the new attempt will write
        its own, and must never report the old ones as its checkpoint."""
        if not layout.checkpoint_dir.is_dir():
            return
        for step_dir in layout.checkpoint_dir.glob("step-*"):
            if int(step_dir.name.removeprefix("step-")) > restore_step:
                shutil.rmtree(step_dir, ignore_errors=True)

    @staticmethod
    def _saved_steps(layout: RunLayout) -> dict[int, set[int]]:
        saved: dict[int, set[int]] = {}
        if not layout.checkpoint_dir.is_dir():
            return saved
        for step_dir in layout.checkpoint_dir.iterdir():
            if not step_dir.name.startswith("step-"):
                continue
            step = int(step_dir.name.removeprefix("step-"))
            saved[step] = {int(p.stem.removeprefix("rank-")) for p in step_dir.glob("rank-*.json")}
        return saved

