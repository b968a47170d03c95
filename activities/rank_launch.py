"""Launch and stop a node's ranks: `launch_ranks`, `rejoin_ranks` (an in-process restart) and `stop_ranks`.

A launch hands each rank to a process of the run parked here ahead of need when it has one
(`activities.rank_parking`: a warm relaunch) and starts the others cold.

Launches are fenced by attempt: the node records the newest attempt it has seen for each run, kills ranks of
older attempts before starting new ones, and refuses a late launch of an older attempt, so ranks of attempt k
never run beside attempt k+1. A spec is user input: only programs the agent's `--allow` list names run, and
whatever of it the node cannot use is the spec's fault (`activities.launch_errors`), never the node's.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from activities.evidence import evidence_env
from activities.launch_errors import classify_launch_error, spec_error, spec_values, working_dir
from activities.models import (
    LaunchRanksInput,
    LaunchRanksResult,
    RankGroupInput,
    RejoinRanksInput,
    RejoinRanksResult,
    StopRanksInput,
    StopRanksResult,
)
from activities.parking_models import ParkRanksInput, ParkRanksResult
from activities.rank_parking import ParkedProcess, Parking, park_key
from activities.rank_records import AttemptRecord, RankBook, RankProcess, log, read_report
from trainguard import protocol
from trainguard.error_types import ErrorType
from trainguard.models import StopReason
from trainguard.procs import start_time
from trainguard.protocol import RunLayout
from trainguard.run_as import PopenUser, RunAs
from trainguard.safe_files import open_append
from trainguard.settings import held_secret_values
from trainguard.spec import exec_env_refused, exec_problems

# Variables of the agent's own environment that ranks must not inherit: storage credentials belong to the
# agent (it uploads), never to user code; so do the pool's peer token and Temporal's keys. They cover
# `trainguard.settings.AGENT_SECRET_ENV`; a variable holding the value of a held secret under another name
# is left out too.
_SECRET_ENV_PREFIXES = ("AWS_", "TRAINGUARD_S3_", "TEMPORAL_", "TRAINGUARD_PEER_TOKEN", "TRAINGUARD_CODEC_KEY",
                        "TRAINGUARD_API_KEY", "TRAINGUARD_TLS_KEY", "TRAINGUARD_MANIFEST_KEY")


def inherited_env(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, str]:
    """What ranks inherit of the agent's environment (`environ`, default `os.environ`): all but its secrets."""
    held = set(held_secret_values())
    return {k: v for k, v in (os.environ if environ is None else environ).items()
            if not k.startswith(_SECRET_ENV_PREFIXES) and v.strip() not in held}


def _program_path(path: str) -> Path:
    """`path` made absolute with its directories resolved as the kernel resolves them (so `..` and symlinked
    folders cannot lead a check astray), its last part kept: a venv's `python` is a symlink to be run as such."""
    absolute = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)  # no lexical `..` folding
    head, tail = os.path.split(absolute)
    return Path(os.path.realpath(head)) / tail


_RUN_LEAVES = frozenset({StopReason.RUN_ENDED, StopReason.DRAIN, StopReason.OPERATOR_PAUSE,
                         StopReason.INCIDENT_PAUSE})
"""Stops after which the run relaunches nothing on this node soon (it ended, the node leaves it, or it waits for
an operator): its parked processes go with its ranks. A stop for a relaunch keeps them for it; a node an incident
takes out of the run loses them at the agent's orphan check (`workers.node_agent.check_orphans`)."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]



def forget_other_chains(layout: RunLayout, chain_id: str) -> None:
    """A launch of a chain other than the one the run's folder last held (the same run id started again: a
    requeued Slurm job's `run start --resume`) removes that chain's attempt folders, whose progress, checkpoint
    requests, logs and evidence would read as the new chain's (it counts attempts from 1 again: a resumed run was
    judged hung on the last execution's progress). Shards stay: a restore verifies each against its manifest."""
    if not chain_id:
        return
    try:
        known = layout.chain_file.read_text()
    except OSError:
        known = None  # a fresh folder, or one an agent before chain files wrote: nothing to tell apart
    if known == chain_id:
        return
    if known is not None:
        stale = layout.attempt_dirs()
        for folder in stale:
            shutil.rmtree(folder, ignore_errors=True)
            if folder.exists():
                log.warning("could not remove all of %s: chain %s's files may read as chain %s's", folder, known,
                            chain_id)
        if stale:
            log.info("%s: %d attempt folders of chain %s removed for chain %s", layout.root.name, len(stale),
                     known, chain_id)
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.chain_file.write_text(chain_id)

class RankLaunch:
    """Start, restart in process, and stop the ranks of a run's attempt on this node."""

    def __init__(self, book: RankBook, host: str, code_dir: Path, allowed: tuple[str, ...] = ("*",),
                 allowed_env: frozenset[str] = frozenset(), run_as: RunAs | None = None) -> None:
        self.book = book
        self.node = book.node
        self.host = host
        """The address peers reach this node's ranks at (a rendezvous this node hosts listens there)."""
        self.code_dir = code_dir
        """The ranks' directory when a spec names none (`--code-dir`)."""
        self.allowed = allowed
        """Programs, or folders of programs, a spec's entrypoint may name (`--allow`; `*` for any)."""
        self.allowed_env = allowed_env
        """Env names of `EXEC_ENV_PATTERNS` this node's operator lets a spec set (`--allow-env`)."""
        self.run_as = run_as
        """The user ranks run as (`--run-as`); None runs them as the agent's own user, secrets in reach."""
        self.parking = Parking(book)
        """The runs' processes parked on this node for their next launch."""

    @activity.defn(name=names.LAUNCH_RANKS)
    async def launch_ranks(self, request: LaunchRanksInput) -> LaunchRanksResult:
        """Start this node's ranks for one attempt, with torchrun's environment and a fresh rendezvous."""
        current = self.book.record(request.workflow_id)
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
            stopped = await self.book.stop(current, grace_s=1.0)
            if stopped:
                log.info("fenced %d ranks of %s attempt %d", stopped, request.workflow_id, current.attempt)

        cwd = working_dir(request.working_dir, self.code_dir, self.node, self.run_as)
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
        self.book.attempts[request.workflow_id] = record
        layout = RunLayout.of(self.book.workdir, request.workflow_id)
        forget_other_chains(layout, request.chain_id)
        drop_uncommitted_shards(layout, request.restore_step)
        layout.logs_dir(request.attempt).mkdir(parents=True, exist_ok=True)
        self._rank_folders(layout, request.attempt)
        extra = {protocol.ENV_RESTORE_STEP: str(request.restore_step),
                 protocol.ENV_STANDBY_MARK: str(layout.standby_mark(request.attempt))}
        if request.restore_dir:
            extra[protocol.ENV_RESTORE_DIR] = request.restore_dir
        if request.rejoin_timeout_s is not None:
            extra[protocol.ENV_REJOIN_TIMEOUT_S] = str(request.rejoin_timeout_s)
        key = park_key(request.chain_id, request.entrypoint, cwd, request.env,
                       self.run_as.name if self.run_as is not None else None)
        pool = self.parking.pool(request.workflow_id, key)
        warm = []
        for local_rank in range(request.ranks_per_node):
            parked = pool.take() if pool is not None else None
            if parked is not None:
                self._hand_off(record, layout, request, local_rank, extra, parked)
                warm.append(parked.proc.pid)
            else:
                await self._spawn(record, layout, request, cwd, local_rank, extra)
        if request.rejoin_timeout_s is not None:
            self._start_standby(record, layout, request, cwd)
        await self.parking.keep(record, key, request.ranks_per_node, lambda role_file: self._park(
            layout, request, cwd, role_file))
        log.info(
            "launched ranks %s of %s attempt %d on %s (rendezvous %s:%d; %d from parked processes)",
            sorted(record.ranks), request.workflow_id, request.attempt, self.node, master_addr, master_port,
            len(warm),
        )
        return LaunchRanksResult(
            node=self.node, master_addr=master_addr, master_port=master_port,
            pids=[p.pid for p in record.ranks.values()],
        )

    @activity.defn(name=names.PARK_RANKS)
    async def park_ranks(self, request: ParkRanksInput) -> ParkRanksResult:
        """On a spare the run holds: park the run's processes (its launch template's entrypoint, env and working
        directory, one per local rank) so the launch that brings this node into the run hands its ranks to them.
        Idempotent: a pool parked for the same launch already is kept; a node that runs the run's ranks parks
        for it from its launches, as any run node does."""
        template = request.launch
        current = self.book.record(request.workflow_id)
        if (current is not None and current.chain_id == template.chain_id
                and any(not p.poll() for p in current.ranks.values())):
            return ParkRanksResult()
        cwd = working_dir(template.working_dir, self.code_dir, self.node, self.run_as)
        template = template.model_copy(update={"entrypoint": self._check_allowed(template, cwd), "node": self.node})
        layout = RunLayout.of(self.book.workdir, request.workflow_id)
        layout.tmp_dir.mkdir(parents=True, exist_ok=True)
        if self.run_as is not None:
            self.run_as.own(layout.tmp_dir)
        key = park_key(template.chain_id, template.entrypoint, cwd, template.env,
                       self.run_as.name if self.run_as is not None else None)
        parked, already = await self.parking.park_spare(
            request.workflow_id, key, template.ranks_per_node,
            lambda role_file: self._park(layout, template, cwd, role_file))
        return ParkRanksResult(parked=parked, already=already)

    def _rank_folders(self, layout: RunLayout, attempt: int) -> None:
        """The folders ranks of `attempt` write into (progress, shards, temporary files, hang evidence), made,
        and given to the run-as user. Logs are the agent's: it opens each rank's log and hands it over open."""
        folders = (layout.progress_dir(attempt), layout.checkpoint_dir, layout.tmp_dir, layout.evidence_dir(attempt))
        for path in folders:
            path.mkdir(parents=True, exist_ok=True)
        if self.run_as is not None:
            self.run_as.own(*folders)

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
            protocol.ENV_FINGERPRINT_EVERY: str(request.fingerprint_every),
            protocol.ENV_LOSS_SPIKE_RATIO: repr(request.loss_spike_ratio),
            protocol.ENV_CHECKPOINT_REQUEST_FILE: str(layout.checkpoint_request_file(record.attempt)),
            protocol.ENV_REJOIN_FILE: str(layout.rejoin_file(rank)),
            **evidence_env(layout, record.attempt, rank, request.env),
            **extra,
        }

    def _start(self, layout: RunLayout, request: RankGroupInput, cwd: Path, log_path: Path,
               env: dict[str, str]) -> subprocess.Popen[bytes]:
        """The entrypoint in a session of its own (so its whole tree can be signalled), as the run-as user,
        without the agent's secrets in its environment."""
        full = inherited_env()
        if self.run_as is not None:
            # The agent's HOME is not theirs to write: caches (torch, pip, matplotlib) go to the run's tmp.
            full.update({"HOME": str(layout.tmp_dir), "USER": self.run_as.name, "LOGNAME": self.run_as.name})
        full.setdefault("OMP_NUM_THREADS", "1")
        full.update(request.env)
        full.update({"TMPDIR": str(layout.tmp_dir), protocol.ENV_WORKFLOW_ID: request.workflow_id,
                     protocol.ENV_NODE: self.node, **env})
        log_file = open_append(log_path)
        try:
            popen = subprocess.Popen(  # an argv list, never a shell string
                request.entrypoint,
                cwd=cwd,
                env=full,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **(self.run_as.popen_args() if self.run_as is not None else PopenUser()),
            )
            self.book.cgroups.join(request.workflow_id, popen.pid)  # before it can fork: fencing kills all of it
            return popen
        except Exception as error:
            if classify_launch_error(error) is None:
                raise  # the node's (EMFILE, ENOMEM, EAGAIN): retried
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
            await self.book.stop(record, grace_s=0.5)
            raise
        self._track(record, rank, popen.pid, popen)

    def _track(self, record: AttemptRecord, rank: int, pid: int, popen: subprocess.Popen[bytes] | None) -> None:
        record.ranks[rank] = RankProcess(rank, pid, start_time(pid), popen, launch_attempt=record.attempt)
        threading.Thread(target=record.ranks[rank].stamp_exit, name=f"rank-{rank}-exit", daemon=True).start()
        self.book.save(record)

    def _hand_off(self, record: AttemptRecord, layout: RunLayout, request: RankGroupInput, local_rank: int,
                  extra: dict[str, str], parked: ParkedProcess) -> None:
        """Give a parked process the role of one rank of `record`'s attempt: the environment a cold start
        would have had, and the rank's log. It takes the role within `standby()`'s poll."""
        rank = request.node_rank * request.ranks_per_node + local_rank
        log_file = layout.log_file(record.attempt, rank)
        log_file.touch()
        if self.run_as is not None:
            self.run_as.own(log_file)  # it opens the log itself, as the run-as user
        env = self._rank_env(record, layout, request, local_rank, extra)
        protocol.StandbyRole(env, log_file=str(log_file)).write(parked.role_file)
        self._track(record, rank, parked.proc.pid, parked.proc.popen)

    def _park(self, layout: RunLayout, request: RankGroupInput, cwd: Path,
              role_file: Path) -> subprocess.Popen[bytes]:
        """The run's entrypoint started ahead of need, to wait in `standby()` for `role_file`."""
        if self.run_as is not None:
            self.run_as.own(layout.parked_dir)  # it writes its mark there
        layout.parked_logs_dir.mkdir(parents=True, exist_ok=True)  # the agent's: it opens the logs as root
        return self._start(layout, request, cwd, protocol.park_log_path(role_file),
                           {protocol.ENV_STANDBY_FILE: str(role_file),
                            protocol.ENV_STANDBY_MARK: str(protocol.mark_path(role_file))})

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
        self.book.save(record)

    @activity.defn(name=names.REJOIN_RANKS)
    async def rejoin_ranks(self, request: RejoinRanksInput) -> RejoinRanksResult:
        """In-process restart on this node: tell its live ranks which new process group to join, and start
        its dead ranks again as joiners that take their state from a live peer. Idempotent: a retry finds the
        node already on the new attempt and answers the same."""
        current = self.book.record(request.workflow_id)
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
        cwd = working_dir(request.working_dir, self.code_dir, self.node, self.run_as)
        request = request.model_copy(update={"entrypoint": self._check_allowed(request, cwd)})
        layout = RunLayout.of(self.book.workdir, request.workflow_id)
        alive = {r: p for r, p in current.ranks.items() if not p.poll()}
        reports = [read_report(layout.progress_file(current.attempt, r)) for r in alive]
        steps = [r.step for r in reports if r is not None]
        master_addr = request.master_addr or self.host
        record = AttemptRecord(
            workflow_id=request.workflow_id, attempt=request.attempt, master_addr=master_addr,
            master_port=request.master_port or _free_port(self.host),
            start_step=min(steps) if steps else current.start_step, launched_at=time.time(),
            ranks=dict(alive), chain_id=request.chain_id, survivors=set(alive),
        )
        for path in (layout.logs_dir(record.attempt), layout.rejoin_file(0).parent):
            path.mkdir(parents=True, exist_ok=True)
        self._rank_folders(layout, record.attempt)
        self.book.attempts[request.workflow_id] = record
        self.book.save(record)
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
        key = park_key(request.chain_id, request.entrypoint, cwd, request.env,
                       self.run_as.name if self.run_as is not None else None)
        pool = self.parking.pool(request.workflow_id, key)
        for local_rank in range(request.ranks_per_node):
            rank = request.node_rank * request.ranks_per_node + local_rank
            if rank in alive:
                continue
            extra = {protocol.ENV_JOIN: protocol.JOIN_YES, protocol.ENV_RESTORE_STEP: str(record.start_step),
                     protocol.ENV_REJOIN_TIMEOUT_S: str(request.rejoin_timeout_s),
                     protocol.ENV_STANDBY_MARK: str(layout.standby_mark(record.attempt))}
            parked = pool.take() if pool is not None and standby is None else None
            if standby is not None:
                # The standby has the interpreter and torch loaded: give it this rank's role.
                env = self._rank_env(record, layout, request, local_rank, extra)
                protocol.StandbyRole(env).write(layout.standby_file(current.attempt))
                self._track(record, rank, standby.pid, standby.popen)
                standby, used_standby = None, True
            elif parked is not None:
                self._hand_off(record, layout, request, local_rank, extra, parked)
                used_standby = True
            else:
                await self._spawn(record, layout, request, cwd, local_rank, extra)
        record.standby = standby
        if record.standby is None:
            self._start_standby(record, layout, request, cwd)
        await self.parking.keep(record, key, request.ranks_per_node, lambda role_file: self._park(
            layout, request, cwd, role_file))
        log.info("in-process restart of %s attempt %d -> %d on %s: kept ranks %s, restarted %s%s (group %s:%d)",
                 request.workflow_id, request.from_attempt, record.attempt, self.node, sorted(alive),
                 sorted(set(record.ranks) - set(alive)), " (warm: a standby or parked process)" if used_standby else "",
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
            return spec_error(message, self.node)

        problems = exec_problems(request.entrypoint, request.env, request.working_dir)
        if problems:
            raise bad_spec("; ".join(problems))
        refused = [name for name in request.env if exec_env_refused(name, self.allowed_env)]
        if refused:
            raise bad_spec("; ".join(
                f"env.{name}: changes what the ranks run or load, which this node's --allow list decides; "
                f"leave it out, or ask the node's operator to allow it with --allow-env {name}" for name in refused))
        name = request.entrypoint[0]
        with spec_values("entrypoint.0", self.node):
            if os.sep in name:
                found: str | None = str(cwd / name)  # as exec would see it: relative to the ranks' directory
            else:
                found = shutil.which(name, path=os.environ.get("PATH", os.defpath))  # the agent's PATH
            if found is None or not os.path.isfile(found) or not os.access(found, os.X_OK):
                raise bad_spec(f"entrypoint.0: {name!r} is no executable program here (a bare name is looked up "
                               f"with the agent's own PATH, never the spec's env.PATH)")
            program = _program_path(found)
            target = Path(os.path.realpath(found))
        if "*" not in self.allowed:
            # Both the path as named (a venv's python is a symlink) and its target may match.
            candidates = {program, target}
            roots = {p for allowed in self.allowed for p in (_program_path(allowed), Path(os.path.realpath(allowed)))}
            if not any(path == root or root in path.parents for path in candidates for root in roots):
                raise ApplicationError(
                    f"entrypoint {name!r} is not allowed on node {self.node} (allowed: {', '.join(self.allowed)}); "
                    f"ask the node's operator to add it with --allow",
                    type=ErrorType.ENTRYPOINT_NOT_ALLOWED,
                    non_retryable=True,
                )
        return [str(program), *request.entrypoint[1:]]

    @activity.defn(name=names.STOP_RANKS)
    async def stop_ranks(self, request: StopRanksInput) -> StopRanksResult:
        """Stop the run's ranks on this node (whole process groups): SIGTERM, then SIGKILL after the grace."""
        record = self.book.record(request.workflow_id)
        if request.attempt is None or request.reason in _RUN_LEAVES:
            await self.book.close_parking(request.workflow_id)  # no relaunch here to keep them for
        if record is None or (request.attempt is not None and record.attempt > request.attempt):
            return StopRanksResult(stopped=0)
        return StopRanksResult(stopped=await self.book.stop(record, request.grace_s))


def drop_uncommitted_shards(layout: RunLayout, restore_step: int) -> None:
    """Local shards newer than the restored step belong to a dead attempt: the new attempt will write its own,
    and must never report the old ones as its checkpoint. What else the ranks left in the folder (a
    `step-latest` symlink) is theirs, and left alone."""
    if not layout.checkpoint_dir.is_dir():
        return
    for entry in layout.checkpoint_dir.glob("step-*"):
        step = protocol.step_of_dir_name(entry.name)
        if step is None or step <= restore_step:
            continue
        if entry.is_symlink() or not entry.is_dir():
            entry.unlink(missing_ok=True)  # never followed: rmtree of a link's target would reach outside
        else:
            shutil.rmtree(entry, ignore_errors=True)
