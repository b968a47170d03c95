"""The contract between a node agent and the rank processes it starts: the one owner of its names.

The agent (`activities.rank_launch`, `activities.rank_watch`) and the rank helper (`trainguard.rank`) run in
different processes, often of different versions during an upgrade, and talk only through environment variables
and small JSON files in the run's directory on the node. Every name and every JSON shape they share is defined
here, once, with a reader and a writer, so neither side retypes a key. The dev stack, the client, the report
and the test and benchmark harness read the same files through the same models.

Standard library only: the rank helper imports it inside the user's training script.

Files of one run on one node (`RunLayout`), under `<agent workdir>/runs/<safe workflow id>/`:

```
ranks.json                                 AttemptFile: the agent's record of the ranks it launched
attempt-NNNN/progress/rank-NNNNN.json      Progress: a rank's heartbeat (and its finish)
attempt-NNNN/checkpoint-request.json       CheckpointRequest: an operator's `checkpoint_now`
attempt-NNNN/standby.json                  StandbyRole: the role the agent gives the standby process
attempt-NNNN/progress/standby-mark.json    StandbyMark: the attempt's ranks call `trainguard.rank.standby()`
parked/park-NNNNNN.json                    StandbyRole: the role the agent gives a parked process (warm relaunch)
parked/park-NNNNNN.mark.json               StandbyMark: the parked process waits in `standby()`
parked-logs/park-NNNNNN.log                a parked process's stdout and stderr until it takes a role
attempt-NNNN/logs/rank-NNNNN.log           a rank's stdout and stderr
attempt-NNNN/evidence/rank-NNNNN.*         a rank's hang-evidence files (`trainguard.evidence`)
attempt-NNNN/incidents/incident-rank-NNNNN.txt  the agent's copy of a rank's stacks at a hang
rejoin/rank-NNNNN.json                     Rejoin: the new process group of an in-process restart
checkpoints/step-NNNNNNNN/rank-NNNNN.*     a rank's local checkpoint shard and its meta file
```

JSON keys and defaults here are wire format: a new field gets a default and is optional on reading, so an
agent reads the files of an older rank helper and the other way round.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.safe_files import read_json, write_json

# ------------------------------------------------------------------------------------------- environment
ENV_ATTEMPT = "TRAINGUARD_ATTEMPT"
"""The attempt (launch) the rank belongs to, from 1."""
ENV_PROGRESS_FILE = "TRAINGUARD_PROGRESS_FILE"
"""Where the rank writes its `Progress`. Its presence is what makes a rank managed by trainguard."""
ENV_CHECKPOINT_DIR = "TRAINGUARD_CHECKPOINT_DIR"
"""The node-local folder the rank saves checkpoint shards under (`step-NNNNNNNN/`)."""
ENV_CHECKPOINT_EVERY = "TRAINGUARD_CHECKPOINT_EVERY"
"""The spec's `checkpoint.every_steps` (0: never)."""
DEFAULT_CHECKPOINT_EVERY_STEPS = 50
"""`checkpoint.every_steps` when a spec does not say: the spec's default and the launch input's, one number.
A rank started without `ENV_CHECKPOINT_EVERY` (plain torchrun) checkpoints never (0)."""
ENV_CHECKPOINT_REQUEST_FILE = "TRAINGUARD_CHECKPOINT_REQUEST_FILE"
"""Where the agent writes a `CheckpointRequest`."""
ENV_RESTORE_STEP = "TRAINGUARD_RESTORE_STEP"
"""The step the attempt resumes from (0: a fresh start)."""
ENV_RESTORE_DIR = "TRAINGUARD_RESTORE_DIR"
"""The verified checkpoint step folder the rank restores from; unset for a fresh start."""
ENV_REJOIN_TIMEOUT_S = "TRAINGUARD_REJOIN_TIMEOUT_S"
"""Set when the run has in-process restarts on: how long a live rank waits for its new process group."""
ENV_REJOIN_FILE = "TRAINGUARD_REJOIN_FILE"
"""Where the agent writes this rank's `Rejoin`."""
ENV_JOIN = "TRAINGUARD_JOIN"
"""`1`: the process replaces a rank that died and takes its state from a live peer."""
ENV_STANDBY_FILE = "TRAINGUARD_STANDBY_FILE"
"""Set only for a standby or parked process: where it waits for its `StandbyRole`."""
ENV_STANDBY_MARK = "TRAINGUARD_STANDBY_MARK"
"""Where `trainguard.rank.standby()` writes its `StandbyMark` when called: the handshake that tells the agent
the script parks, so it never starts ahead of need a script that would run on without waiting."""
ENV_WORKFLOW_ID = "TRAINGUARD_WORKFLOW_ID"
"""The run's workflow id (for the rank's own logs, and for harnesses that find ranks in /proc)."""
ENV_NODE = "TRAINGUARD_NODE"
"""The node the rank runs on."""
ENV_EVIDENCE_BASE = "TRAINGUARD_EVIDENCE_BASE"
"""The path prefix of the rank's evidence files (`trainguard.evidence`)."""
ENV_LOSS_SPIKE_RATIO = "TRAINGUARD_LOSS_SPIKE_RATIO"
"""The spec's `health.loss_spike_ratio`: a loss the script reports at least this many times its recent median is
a numerical fault."""
ENV_FINGERPRINT_EVERY = "TRAINGUARD_FINGERPRINT_EVERY"
"""The spec's `health.fingerprint_every_steps`: a rank whose script called `run.fingerprint(model)` reports the
fingerprint of its replicated state every this many steps (0: never)."""

JOIN_YES = "1"

# ------------------------------------------------------------------------------------------- exit codes
EXIT_NO_RETRY = 78
"""Exit with this code (EX_CONFIG) for an error a restart cannot fix: the run stops with your message
instead of spending its restart budget."""

# ------------------------------------------------------------------------------------------- file names
RUNS_DIR = "runs"
TMP_DIR = "tmp"
"""Beside `RUNS_DIR` in an agent's workdir: each run's scratch folder (`RunLayout.tmp_dir`)."""
RANKS_FILE = "ranks.json"
CHAIN_FILE = "chain"
PROGRESS_DIR = "progress"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_REQUEST_FILE = "checkpoint-request.json"
STANDBY_FILE = "standby.json"
STANDBY_LOG = "standby.log"
STANDBY_MARK_FILE = "standby-mark.json"
PARKED_DIR = "parked"
PARKED_LOGS_DIR = "parked-logs"
EVIDENCE_DIR = "evidence"
INCIDENTS_DIR = "incidents"
REJOIN_DIR = "rejoin"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(workflow_id: str) -> str:
    """A directory name for a workflow id: readable, and distinct even when two ids sanitize alike."""
    cleaned = _UNSAFE.sub("_", workflow_id)[:80].lstrip(".") or "run"
    if cleaned == workflow_id:
        return cleaned
    return f"{cleaned}-{hashlib.sha256(workflow_id.encode()).hexdigest()[:8]}"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of_dir_name(name: str) -> int | None:
    """The step a `step_dir_name` names; None for anything else. A rank writes into its checkpoint folder what
    it likes (a `step-latest` symlink): whoever lists the folder skips what is not a step, never fails on it."""
    digits = name.removeprefix("step-")
    return int(digits) if digits != name and digits.isascii() and digits.isdigit() else None


def rank_name(rank: int) -> str:
    """`rank-NNNNN`: the stem of every per-rank file."""
    return f"rank-{rank:05d}"


def rank_of_name(stem: str) -> int | None:
    """The rank a `rank_name` stem names; None for anything else (a rank's own `rank-best.json`)."""
    digits = stem.removeprefix("rank-")
    return int(digits) if digits != stem and digits.isascii() and digits.isdigit() else None


def shard_name(rank: int) -> str:
    """A `torch.save` checkpoint shard."""
    return f"{rank_name(rank)}.pt"


def shard_meta_name(rank: int) -> str:
    """A shard's meta file (size, sha256): written last, so a shard without it is not written yet."""
    return f"{rank_name(rank)}.json"


ATTEMPT_DIR_PREFIX = "attempt-"


def attempt_dir_name(attempt: int) -> str:
    return f"{ATTEMPT_DIR_PREFIX}{attempt:04d}"


@dataclass(frozen=True, slots=True)
class RunLayout:
    """One run's files on one node."""

    root: Path

    @classmethod
    def of(cls, workdir: Path, workflow_id: str) -> RunLayout:
        return cls(workdir / RUNS_DIR / safe_name(workflow_id))

    @property
    def ranks_file(self) -> Path:
        """The agent's record of the ranks it launched (attempt, pids), for fencing and reconciling."""
        return self.root / RANKS_FILE

    @property
    def chain_file(self) -> Path:
        """The chain (first execution) of the run whose attempts the folders hold: a run started again under
        the same id counts attempts from 1 again, and must not read the last execution's files as its own."""
        return self.root / CHAIN_FILE

    def attempt_dir(self, attempt: int) -> Path:
        return self.root / attempt_dir_name(attempt)

    def attempt_dirs(self) -> list[Path]:
        """Every attempt's folder there is, oldest first."""
        return sorted(p for p in self.root.glob(f"{ATTEMPT_DIR_PREFIX}*") if p.is_dir())

    def progress_dir(self, attempt: int) -> Path:
        return self.attempt_dir(attempt) / PROGRESS_DIR

    def progress_file(self, attempt: int, rank: int) -> Path:
        return self.progress_dir(attempt) / f"{rank_name(rank)}.json"

    def checkpoint_request_file(self, attempt: int) -> Path:
        """An operator's `checkpoint_now`: the step every rank of the attempt saves at."""
        return self.attempt_dir(attempt) / CHECKPOINT_REQUEST_FILE

    def standby_file(self, attempt: int) -> Path:
        """The role (a rank's environment) the agent gives the attempt's standby process when a rank dies."""
        return self.attempt_dir(attempt) / STANDBY_FILE

    def standby_mark(self, attempt: int) -> Path:
        """Written by the attempt's ranks as they pass `trainguard.rank.standby()`: the run's script parks."""
        return self.progress_dir(attempt) / STANDBY_MARK_FILE  # a folder the ranks may write into

    @property
    def parked_dir(self) -> Path:
        """The run's parked processes' files (`park_file`), the run's on this node across attempts."""
        return self.root / PARKED_DIR

    @property
    def parked_logs_dir(self) -> Path:
        """The parked processes' logs (`park_log_path`): a folder only the agent writes."""
        return self.root / PARKED_LOGS_DIR

    def park_file(self, number: int) -> Path:
        """Where parked process `number` waits for its role; its mark and log sit beside it."""
        return self.parked_dir / f"park-{number:06d}.json"

    def rejoin_file(self, rank: int) -> Path:
        """Where the agent tells a live rank whose peers failed which process group to join next."""
        return self.root / REJOIN_DIR / f"{rank_name(rank)}.json"

    def evidence_dir(self, attempt: int) -> Path:
        """The attempt's ranks' hang-evidence files (`trainguard.evidence`): a folder the ranks write."""
        return self.attempt_dir(attempt) / EVIDENCE_DIR

    def evidence_base(self, attempt: int, rank: int) -> Path:
        """The path prefix of the evidence files of `rank` launched in `attempt` (`ENV_EVIDENCE_BASE`)."""
        return self.evidence_dir(attempt) / rank_name(rank)

    def incident_file(self, attempt: int, rank: int) -> Path:
        """The agent's copy of `rank`'s stacks for the hang that ended `attempt`, in a folder only the agent
        writes: never in `evidence_dir`, where a rank's link would take the agent's write elsewhere."""
        return self.attempt_dir(attempt) / INCIDENTS_DIR / f"incident-{rank_name(rank)}.txt"

    def logs_dir(self, attempt: int) -> Path:
        return self.attempt_dir(attempt) / LOGS_DIR

    def log_file(self, attempt: int, rank: int) -> Path:
        return self.logs_dir(attempt) / f"{rank_name(rank)}.log"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    def local_step_dir(self, step: int) -> Path:
        return self.checkpoint_dir / step_dir_name(step)

    def restore_dir(self, step: int) -> Path:
        return self.root / "restore" / step_dir_name(step)

    @property
    def tmp_dir(self) -> Path:
        """The ranks' TMPDIR (and HOME when they run as another user): `<workdir>/tmp/<12 hex of the run>`, short
        whatever the run id. Python's multiprocessing binds an AF_UNIX socket under TMPDIR (107 bytes at most,
        its own names take 32), and a DataLoader's workers need it: under a long run id the worker failed to
        start and its rank waited forever."""
        return self.root.parent.parent / TMP_DIR / hashlib.sha256(self.root.name.encode()).hexdigest()[:12]


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


# --------------------------------------------------------------------------------------------- progress
@dataclass(slots=True)
class Progress:
    """A rank's heartbeat, rewritten (atomically) at most every 50 ms and at each save and finish. The
    agent's watch reads it to judge hangs, stragglers and finishes."""

    rank: int
    step: int
    """Steps completed."""
    time: float
    """Unix time of the report."""
    attempt: int = 1
    pid: int = 0
    step_time_s: float | None = None
    """Moving average of the rank's recent step times; None before its second step."""
    compute_s: float | None = None
    """The median of the rank's recent compute times per step (outside collectives), when the script reports it."""
    timed_steps: int = 0
    """How many step times the averages are over."""
    evidence: str | None = None
    """The rank's evidence path prefix (see `ENV_EVIDENCE_BASE`), when its evidence channel runs."""
    saving: bool = False
    """The rank is taking its in-memory checkpoint snapshot."""
    error: str | None = None
    """Why the rank stopped itself (the rank helper's own checks, e.g. a checkpoint step it did not save)."""
    finished: bool = False
    """The rank's last report: training is done (see `digest`, `mean_step_s`)."""
    digest: str | None = None
    """At finish: the model's `state_digest`."""
    mean_step_s: float | None = None
    """At finish: the mean of all the rank's timed steps."""
    phase: str | None = None
    """The phase the script named and is in now (`RankRun.phase`)."""
    phase_since: float | None = None
    """Unix time the named phase began."""
    phase_expected_s: float | None = None
    """The named phase's expected length, when the script gave one."""
    phase_s: dict[str, float] | None = None
    """Seconds spent in each named phase so far (this process's), for the run report."""
    fingerprints: list[list[Any]] | None = None
    """The rank's newest fingerprints of its replicated state, oldest first (`trainguard.numerics.Fingerprint`
    as JSON: step, value, group): a few, so a report the 50 ms bound skipped loses none."""
    numerical: dict[str, Any] | None = None
    """A numerical fault the rank saw in the loss its script reported: {"step", "loss", "detail", "at"} (the first;
    `at`: unix time the rank saw it)."""

    _ALWAYS = ("rank", "pid", "attempt", "step", "time", "step_time_s", "compute_s", "timed_steps")

    def to_json(self) -> dict[str, Any]:
        """Always the heartbeat's fields; the others only when set (and at finish, `digest` and
        `mean_step_s` even when None), as the rank helper has always written them."""
        payload: dict[str, Any] = {name: getattr(self, name) for name in self._ALWAYS}
        if self.evidence is not None:
            payload["evidence"] = self.evidence
        if self.saving:
            payload["saving"] = True
        if self.error is not None:
            payload["error"] = self.error
        if self.phase is not None:
            payload.update(phase=self.phase, phase_since=self.phase_since, phase_expected_s=self.phase_expected_s)
        if self.phase_s:
            payload["phase_s"] = self.phase_s
        if self.fingerprints:
            payload["fingerprints"] = self.fingerprints
        if self.numerical is not None:
            payload["numerical"] = self.numerical
        if self.finished:
            payload.update(finished=True, digest=self.digest, mean_step_s=self.mean_step_s)
        return payload

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Progress:
        """Raises KeyError, TypeError or ValueError for a payload that is not a progress report."""
        return cls(
            rank=int(data["rank"]), step=int(data["step"]), time=float(data["time"]),
            attempt=int(data.get("attempt", 1)), pid=int(data.get("pid", 0)),
            step_time_s=_optional_float(data.get("step_time_s")), compute_s=_optional_float(data.get("compute_s")),
            timed_steps=int(data.get("timed_steps") or 0), evidence=data.get("evidence"),
            saving=bool(data.get("saving")), error=data.get("error"), finished=bool(data.get("finished")),
            digest=data.get("digest"), mean_step_s=_optional_float(data.get("mean_step_s")),
            phase=_phase_name(data.get("phase")), phase_since=_optional_float(data.get("phase_since")),
            phase_expected_s=_optional_float(data.get("phase_expected_s")), phase_s=_phase_times(data.get("phase_s")),
            fingerprints=_list_of_lists(data.get("fingerprints")), numerical=_numerical(data.get("numerical")),
        )

    def write(self, path: Path) -> None:
        write_json(path, self.to_json())


PHASE_NAME_MAX = 64
"""A named phase's name is cut to this many characters: it is shown in status and carried in heartbeats."""
PHASES_MAX = 32
"""At most this many distinct phase names are kept per rank (the first ones): a script that names phases from
data (a step number in the name) cannot grow what the agent reads and reports."""


def _phase_name(value: Any) -> str | None:
    return str(value)[:PHASE_NAME_MAX] if value else None


def _phase_times(value: Any) -> dict[str, float] | None:
    if not isinstance(value, dict):
        return None
    return {str(name)[:PHASE_NAME_MAX]: float(seconds) for name, seconds in list(value.items())[:PHASES_MAX]}


FINGERPRINTS_KEPT = 4
"""A progress report carries at most this many of the rank's newest fingerprints."""


def _list_of_lists(value: Any) -> list[list[Any]] | None:
    if not isinstance(value, list):
        return None
    return [item for item in value[-FINGERPRINTS_KEPT:] if isinstance(item, list)] or None


def _numerical(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    return {"step": int(value.get("step", -1)), "loss": _optional_float(value.get("loss")),
            "detail": str(value.get("detail", ""))[:500], "at": _optional_float(value.get("at"))}


def read_progress(path: Path) -> Progress | None:
    """A rank's last progress report, or None when there is none yet (or it cannot be read)."""
    data = read_json(path)
    if not isinstance(data, dict):
        return None
    try:
        return Progress.from_json(data)
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class Finish:
    """What a finished rank reports: the model's digest and its mean step time (both None when unknown)."""

    digest: str | None = None
    mean_step_s: float | None = None
    phase_s: dict[str, float] | None = None
    """Seconds the rank spent in each named phase."""


def read_finish(path: Path) -> Finish:
    """The finish in a rank's progress file; an empty `Finish` when the rank wrote none (it exited first)."""
    progress = read_progress(path)
    if progress is None:
        return Finish()
    return Finish(digest=progress.digest, mean_step_s=progress.mean_step_s, phase_s=progress.phase_s)


# ------------------------------------------------------------------------------------- agent to ranks
@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    """An operator's `checkpoint_now`: every rank of the attempt saves at `step`."""

    step: int

    def write(self, path: Path) -> None:
        write_json(path, {"step": self.step})

    @classmethod
    def read(cls, path: Path) -> CheckpointRequest | None:
        data = read_json(path)
        try:
            return cls(step=int(data["step"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class Rejoin:
    """An in-process restart, to a live rank: the process group to join next and the new attempt's files."""

    attempt: int
    master_addr: str
    master_port: int
    world_size: int
    progress_file: str
    checkpoint_request_file: str

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "master_addr": self.master_addr, "master_port": self.master_port,
                "world_size": self.world_size, "progress_file": self.progress_file,
                "checkpoint_request_file": self.checkpoint_request_file}

    def write(self, path: Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> Rejoin | None:
        """The rank's rejoin, or None when the agent has written none (or not whole yet)."""
        data = read_json(path)
        try:
            return cls(attempt=int(data["attempt"]), master_addr=str(data["master_addr"]),
                       master_port=int(data["master_port"]), world_size=int(data["world_size"]),
                       progress_file=str(data["progress_file"]),
                       checkpoint_request_file=str(data["checkpoint_request_file"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class StandbyRole:
    """What a standby or parked process becomes: the environment of the rank it is (or replaces)."""

    env: dict[str, str]
    log_file: str | None = None
    """The rank's log: the process sends its stdout and stderr there from now on (None: where they went)."""

    def write(self, path: Path) -> None:
        write_json(path, {"env": self.env, **({"log_file": self.log_file} if self.log_file else {})})

    @classmethod
    def read(cls, path: Path) -> StandbyRole | None:
        data = read_json(path)
        try:
            log_file = data.get("log_file")
            return cls(env={str(k): str(v) for k, v in data["env"].items()},
                       log_file=None if log_file is None else str(log_file))
        except (KeyError, TypeError, AttributeError):
            return None


def mark_path(role_file: Path) -> Path:
    """The `StandbyMark` of the process waiting for `role_file`."""
    return role_file.with_name(f"{role_file.stem}.mark.json")


def park_log_path(role_file: Path) -> Path:
    """The log of the parked process waiting for `role_file` (`RunLayout.park_file`): in the run's
    `parked-logs/`, the agent's, never beside the role in `parked/`, which the run-as user writes (the agent opens
    the log as root, and a link planted there under the next, predictable, number would take its writes)."""
    return RunLayout(role_file.parent.parent).parked_logs_dir / f"{role_file.stem}.log"


@dataclass(frozen=True, slots=True)
class StandbyMark:
    """`trainguard.rank.standby()` was called: by a rank started as itself, or by a process now waiting for
    its role (`parked`)."""

    pid: int
    parked: bool = False

    def write(self, path: Path) -> None:
        write_json(path, {"pid": self.pid, "parked": self.parked})

    @classmethod
    def read(cls, path: Path) -> StandbyMark | None:
        data = read_json(path)
        try:
            return cls(pid=int(data["pid"]), parked=bool(data.get("parked")))
        except (KeyError, TypeError, ValueError):
            return None


# ----------------------------------------------------------------------------- the agent's attempt record
@dataclass(frozen=True, slots=True)
class ProcessEntry:
    """One process the agent started: its pid and /proc start time (a pid alone may be reused)."""

    pid: int
    start_time: str | None
    rank: int = -1
    """-1 for the standby process."""
    launch_attempt: int = 0
    """The attempt whose environment the rank runs with (it was launched, or given its role, in it): a rank kept
    alive by an in-process restart keeps its evidence files there. 0: the record's own attempt."""


@dataclass(slots=True)
class AttemptFile:
    """`ranks.json`: the attempt a node runs for one run, and the processes it started for it. The agent
    rereads it after a restart to adopt its live ranks; harnesses and `dev down` read it to find them."""

    workflow_id: str
    attempt: int
    master_addr: str
    master_port: int
    start_step: int
    launched_at: float
    chain_id: str = ""
    ranks: list[ProcessEntry] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    restore_tiers: list[str] = field(default_factory=list)
    standby: ProcessEntry | None = None
    parked: list[ProcessEntry] = field(default_factory=list)
    """The run's processes parked on this node for its next relaunch (warm relaunch)."""

    def processes(self) -> list[ProcessEntry]:
        """The ranks, the standby and the parked processes: everything of the run here that may be alive."""
        return [*self.ranks, *([self.standby] if self.standby is not None else []), *self.parked]

    def to_json(self) -> dict[str, Any]:
        return {
            "workflow_id": self.workflow_id,
            "attempt": self.attempt,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "start_step": self.start_step,
            "launched_at": self.launched_at,
            "chain_id": self.chain_id,
            "ranks": [{"rank": p.rank, "pid": p.pid, "start_time": p.start_time,
                       **({"launch_attempt": p.launch_attempt} if p.launch_attempt else {})} for p in self.ranks],
            "survivors": sorted(self.survivors),
            "restore_tiers": self.restore_tiers,
            "standby": None if self.standby is None else {"pid": self.standby.pid,
                                                          "start_time": self.standby.start_time},
            "parked": [{"pid": p.pid, "start_time": p.start_time} for p in self.parked],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptFile:
        """Raises KeyError, TypeError or ValueError for a record that is not one."""
        standby = data.get("standby")
        return cls(
            workflow_id=data["workflow_id"], attempt=data["attempt"], master_addr=data["master_addr"],
            master_port=data["master_port"], start_step=data["start_step"], launched_at=data["launched_at"],
            chain_id=data.get("chain_id", ""),
            ranks=[ProcessEntry(item["pid"], item["start_time"], item["rank"], int(item.get("launch_attempt") or 0))
                   for item in data["ranks"]],
            survivors=list(data.get("survivors", [])), restore_tiers=list(data.get("restore_tiers", [])),
            standby=ProcessEntry(standby["pid"], standby["start_time"]) if standby else None,
            parked=[ProcessEntry(item["pid"], item["start_time"]) for item in data.get("parked", [])],
        )

    def write(self, path: Path) -> None:
        write_json(path, self.to_json())


def read_attempt_file(path: Path) -> AttemptFile | None:
    data = read_json(path)
    try:
        return AttemptFile.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def attempt_files(workdir: Path) -> Iterator[tuple[Path, AttemptFile]]:
    """Every readable `ranks.json` under one agent's working directory, with its path."""
    for path in sorted(workdir.glob(f"{RUNS_DIR}/*/{RANKS_FILE}")):
        record = read_attempt_file(path)
        if record is not None:
            yield path, record


def node_attempt_files(nodes_dir: Path) -> Iterator[tuple[str, AttemptFile]]:
    """Every agent record of a stack whose agents work in `<nodes_dir>/<node>/` (the dev stack's layout),
    with the node's name."""
    for workdir in sorted(p for p in nodes_dir.glob("*") if p.is_dir()):
        for _path, record in attempt_files(workdir):
            yield workdir.name, record


# ----------------------------------------------------------------------------------- the watch heartbeat
@dataclass(frozen=True, slots=True)
class WatchHeartbeat:
    """The details a `watch_ranks` activity heartbeats: the client reads each rank's live step from them
    (per-step progress never enters history)."""

    node: str
    attempt: int
    steps: dict[int, int | None] | None = None
    """Each local rank's last reported step (None: no report yet); None while downloading or uploading."""
    downloading: bool = False
    """The watch is downloading the shards its launch restores from."""
    uploading: int | None = None
    """The watch is finishing the uploads of this many checkpoint steps."""
    phases: dict[int, str] | None = None
    """Local ranks in a long phase, in words (`busy 12.3s (eval)`, `waiting 8.0s (a collective)`)."""

    def to_json(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"node": self.node, "attempt": self.attempt}
        if self.steps is not None:
            payload["steps"] = {str(rank): step for rank, step in self.steps.items()}
        if self.downloading:
            payload["downloading"] = True
        if self.uploading is not None:
            payload["uploading"] = self.uploading
        if self.phases:
            payload["phases"] = {str(rank): text for rank, text in self.phases.items()}
        return payload

    @classmethod
    def from_json(cls, data: Any) -> WatchHeartbeat | None:
        """The heartbeat in a watch's decoded details, or None for details that are not one."""
        if not isinstance(data, dict):
            return None
        try:
            steps = data.get("steps")
            return cls(
                node=str(data["node"]), attempt=int(data["attempt"]),
                steps=None if steps is None else {int(r): (None if s is None else int(s)) for r, s in steps.items()},
                downloading=bool(data.get("downloading")),
                uploading=None if data.get("uploading") is None else int(data["uploading"]),
                phases={int(r): str(t) for r, t in data["phases"].items()} if data.get("phases") else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
