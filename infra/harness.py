"""The one harness of the tests, the benchmarks and the chaos soak.

- `PrivateStack`: a dev stack of its own (free ports from a start, its own folder), the client's
  environment pointed at it while it runs; on the way out (errors included) it is stopped, what outlived
  `down` is listed (and ranks killed), its logs kept if asked, its folder removed.
- `scoped_environ`: environment variables set for a block and put back after it.
- `make_spec`: a small run of the example trainer.
- Rank scanning, through the agent-to-rank contract (`trainguard.protocol`): from the agents' records
  (`nodes/<node>/runs/<run>/ranks.json`: what the agents say they started), and from /proc by the environment
  every agent gives its ranks (workflow id, node, attempt, a checkpoint folder under the stack's home: what
  really runs, whatever the records say).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from trainguard import protocol
from trainguard.procs import stat_fields

if TYPE_CHECKING:
    from trainguard.devstack import DevStack

REPO = Path(__file__).resolve().parents[1]
ADDRESS_ENV = "TRAINGUARD_TEMPORAL_ADDRESS"
"""What the client (`trainguard.settings`) connects to: a private stack points it at itself while it runs."""


def _quiet(_line: str) -> None:
    pass


# ----------------------------------------------------------------------------------------- environment
def set_environ(updates: Mapping[str, str | None]) -> dict[str, str | None]:
    """Set (None: remove) variables; returns their old values for `restore_environ`."""
    saved = {key: os.environ.get(key) for key in updates}
    for key, value in updates.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return saved


def restore_environ(saved: Mapping[str, str | None]) -> None:
    set_environ(saved)


@contextmanager
def scoped_environ(updates: Mapping[str, str | None]) -> Iterator[None]:
    """Set environment variables for the block (None: remove one), then put the old values back."""
    saved = set_environ(updates)
    try:
        yield
    finally:
        restore_environ(saved)


# ----------------------------------------------------------------------------------------------- spec
def make_spec(prefix: str, steps: int = 60, every: int = 20, nodes: tuple[str, ...] = ("node-0", "node-1"),
              spares: tuple[str, ...] = (), ranks_per_node: int = 1, step_time: float = 0.05, hidden: int = 64,
              keep_last: int = 2, **extra: Any) -> dict[str, Any]:
    """A small run of the example trainer: about 10 s here, most of it torch imports. The step time is a
    sleep: it changes how long the run takes, not its final state. `extra` replaces top-level fields."""
    spec: dict[str, Any] = {
        "entrypoint": ["python", "examples/train.py", "--steps", str(steps), "--step-time", str(step_time),
                       "--hidden", str(hidden)],
        "nodes": list(nodes),
        "spare_nodes": list(spares),
        "ranks_per_node": ranks_per_node,
        "checkpoint": {"prefix": prefix, "every_steps": every, "keep_last": keep_last},
        # Generous hang bounds: machines are shared and a GC pause must not read as a hang.
        "health": {"hang_floor_s": 5.0},
    }
    spec.update(extra)
    return spec


@dataclass(frozen=True, slots=True, kw_only=True)
class Irregular:
    """The long phases of a run of `examples/irregular.py` (its flags; see the script). The defaults are one
    short run with every pattern in it: two evaluations, a rank-0 save and an epoch boundary."""

    steps: int = 60
    """Training steps in total. Default 60."""
    step_time: float = 0.05
    """Simulated compute per step, seconds. Default 0.05."""
    jitter: float = 0.5
    """Each step's compute varies by +- this fraction, by (step, rank). Default 0.5."""
    eval_every: int = 25
    """Steps between evaluations (every rank, real forward passes, no step reported). Default 25."""
    eval_s: float = 10.0
    """Length of an evaluation, seconds: five times the default `health.hang_floor_s`. Default 10."""
    save_every: int = 40
    """Steps between rank 0's synchronous saves (its peers wait in the next all-reduce). Default 40."""
    save_s: float = 5.0
    """Length of a save, seconds. Default 5."""
    epoch_steps: int = 30
    """Steps per epoch: each epoch starts the DataLoader's workers again. Default 30."""
    workers: int = 2
    """DataLoader workers per rank. Default 2."""
    worker_start_s: float = 2.0
    """CPU seconds each worker spends starting, each epoch. Default 2."""
    first_step_s: float = 2.0
    """Extra seconds of each process's first step. Default 2."""
    name_phases: bool = False
    """Name the phases with `run.phase` (where the rank helper has it). Default off: unnamed phases must pass."""

    def argv(self) -> list[str]:
        """The entrypoint that runs these phases."""
        flags = {"--steps": self.steps, "--step-time": self.step_time, "--jitter": self.jitter,
                 "--eval-every": self.eval_every, "--eval-s": self.eval_s, "--save-every": self.save_every,
                 "--save-s": self.save_s, "--epoch-steps": self.epoch_steps, "--workers": self.workers,
                 "--worker-start-s": self.worker_start_s, "--first-step-s": self.first_step_s}
        argv = ["python", "examples/irregular.py", *(str(x) for pair in flags.items() for x in pair)]
        return argv + (["--name-phases"] if self.name_phases else [])


def make_irregular_spec(prefix: str, phases: Irregular = Irregular(), every: int = 20,
                        nodes: tuple[str, ...] = ("node-0", "node-1"), ranks_per_node: int = 2,
                        **extra: Any) -> dict[str, Any]:
    """A healthy run of `examples/irregular.py` (2 nodes x 2 ranks by default) with the spec's default health
    settings, as a user would start it: no bound is widened for it. `extra` replaces top-level fields."""
    spec: dict[str, Any] = {
        "entrypoint": phases.argv(),
        "nodes": list(nodes),
        "ranks_per_node": ranks_per_node,
        "checkpoint": {"prefix": prefix, "every_steps": every, "keep_last": 2},
    }
    spec.update(extra)
    return spec


# ------------------------------------------------------------------------------------- private stacks
@dataclass(frozen=True, slots=True)
class Component:
    """A process the stack started, from its pidfile."""

    name: str
    pid: int
    start_time: str | None
    argv0: str = ""


def started_components(stack: DevStack) -> list[Component]:
    """Every component the stack's pidfiles name (read before `down`, which removes them)."""
    found = []
    for pidfile in sorted(stack.run_dir.glob("*.json")):
        with suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(pidfile.read_text())
            found.append(Component(pidfile.stem, int(record["pid"]), record.get("start_time"),
                                   str((record.get("argv") or [""])[0])))
    return found


class PrivateStack:
    """A dev stack of one test session, test module or benchmark. Use it as a context manager (it returns
    the `DevStack`), or call `start` and `stop` (from a thread, in async code)."""

    def __init__(self, home: Path, nodes: tuple[str, ...], port_start: int, *, code_dir: Path = REPO,
                 tls: bool = False, hosts: bool = False, echo: Callable[[str], None] = _quiet,
                 up: Callable[[DevStack], None] | None = None, env: Mapping[str, str | None] | None = None,
                 keep_logs: Path | None = None, timings: dict[str, float] | None = None,
                 labels: Mapping[str, Mapping[str, str]] | None = None, keep_home: bool = False) -> None:
        from trainguard.devstack import DevStack, StackConfig
        from trainguard.run_as import RUN_AS_ENV
        from trainguard.ports import Ports, free_port_base

        self.keep_home = keep_home
        """`stop` leaves the data dir for the next stack on the same home (a change of mode, a restart)."""
        self.home = home
        self.config = StackConfig(home=home, ports=Ports.from_base(free_port_base(port_start, len(nodes))),
                                  nodes=nodes, code_dir=code_dir, tls=tls, hosts=hosts,
                                  run_as=os.environ.get(RUN_AS_ENV),  # CI names the ranks' own user
                                  **({"labels": {n: dict(v) for n, v in labels.items()}} if labels else {}))
        self.stack = DevStack(self.config)
        self.echo = echo
        self._up = up or (lambda dev: dev.up(echo=echo))
        self.env = {ADDRESS_ENV: self.config.temporal_address, **(env or {})}
        """Set while the stack runs (with TLS, the client needs `stack.client_env()` on top)."""
        self.keep_logs = keep_logs
        self.timings = timings if timings is not None else {}
        """`stack_up_s` and `stack_down_s`."""
        self.leftovers: list[str] = []
        """After `stop`: components still running after `down` (`name (pid N)`); none expected."""
        self.leftover_ranks: list[RankProc] = []
        """After `stop`: rank processes of the stack that outlived `down` (killed by pid); none expected."""
        self._saved: dict[str, str | None] | None = None

    def start(self) -> DevStack:
        self._saved = set_environ(self.env)
        began = time.monotonic()
        self._up(self.stack)
        self.timings["stack_up_s"] = round(time.monotonic() - began, 3)
        return self.stack

    def stop(self) -> None:
        """Stop everything, also after a failed `start`; idempotent."""
        started = started_components(self.stack)
        began = time.monotonic()
        try:
            self.stack.down(echo=self.echo)
        finally:
            self.timings["stack_down_s"] = round(time.monotonic() - began, 3)
            self.leftovers = [f"{c.name} (pid {c.pid}: {c.argv0})" for c in started if alive(c.pid, c.start_time)]
            self.leftover_ranks = scan_ranks(self.home)
            kill_ranks(self.leftover_ranks)
            self._remove_run_cgroups()
            if self._saved is not None:
                restore_environ(self._saved)
                self._saved = None
            if self.keep_logs is not None:
                with suppress(OSError):
                    shutil.copytree(self.stack.log_dir, self.keep_logs, dirs_exist_ok=True)
            if not self.keep_home:
                shutil.rmtree(self.home, ignore_errors=True)

    def _remove_run_cgroups(self) -> None:
        """The cgroups this stack's agents made for their runs (named after each node's workdir, so only this
        stack's): whatever is still in one is this stack's and is killed, then they are removed. An agent that
        was SIGKILLed (chaos, a Slurm job's end) could not remove its own."""
        from trainguard.cgroups import RunCgroups

        for node in self.config.nodes:
            RunCgroups(node, (nodes_dir(self.home) / node).resolve()).kill_all()

    def __enter__(self) -> DevStack:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


def kept_logs_dir(home: Path) -> Path | None:
    """Where `TRAINGUARD_TEST_LOGS` (a folder to keep a failed CI run's stack logs in) wants this stack's."""
    base = os.environ.get("TRAINGUARD_TEST_LOGS")
    return Path(base) / home.name if base else None


# ------------------------------------------------------------------------------------------------ ranks


def stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a pid, None once gone."""
    fields = stat_fields(pid)
    return (fields[0], fields[19]) if fields else None


def alive(pid: int, start_time: str | None) -> bool:
    """The process `pid` started at `start_time` still runs (a zombie has exited)."""
    found = stat(pid)
    return found is not None and found[0] != "Z" and (start_time is None or found[1] == start_time)


def nodes_dir(home: Path) -> Path:
    """Where a dev stack's agents keep their working directories, one a node."""
    return home / "nodes"


def agent_records(home: Path) -> list[tuple[str, protocol.AttemptFile]]:
    """Every agent record of the stack at `home`, with its node."""
    return list(protocol.node_attempt_files(nodes_dir(home)))


def live_rank_pids(home: Path) -> list[int]:
    """Rank (and standby) processes the stack's node agents recorded that are still alive."""
    return [item.pid for _node, record in agent_records(home) for item in record.processes()
            if item.start_time and alive(item.pid, item.start_time)]


@dataclass(frozen=True, slots=True)
class RankProc:
    """A live rank process of a stack, as /proc shows it."""

    pid: int
    start_time: str
    workflow_id: str
    node: str
    attempt: int
    rank: int


def scan_ranks(home: Path) -> list[RankProc]:
    """Live rank processes of this stack, from /proc: the agent gives every rank its workflow id, node and
    attempt in the environment, and a checkpoint directory under the stack's home."""
    marker = f"{protocol.ENV_CHECKPOINT_DIR}={home}{os.sep}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker not in raw:
            continue
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        state = stat(pid)
        if state is None or state[0] == "Z":
            continue
        try:
            found.append(RankProc(pid, state[1], env[protocol.ENV_WORKFLOW_ID.encode()].decode(),
                                  env[protocol.ENV_NODE.encode()].decode(), int(env[protocol.ENV_ATTEMPT.encode()]),
                                  int(env.get(b"RANK", b"-1"))))
        except (KeyError, ValueError):
            continue
    return found


def kill_ranks(procs: list[RankProc]) -> None:
    """SIGKILL rank processes by pid, their process group first (ranks lead their own)."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            with suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)
