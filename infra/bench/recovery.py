"""Recovery benchmark: trainguard against torchrun --max-restarts and NVIDIA's ft_launcher, on the same job
and the same faults.

    python -m infra.bench.recovery [--faults crash,hang,slow,gpu,node-down] [--launchers torchrun,ft_launcher]
                                   [--steps 400] [--json .bench/recovery.json] [--skip-torchrun] [--hosts]

Measured side by side in one run, on this machine, for a 2-rank gloo job of `examples/train.py`
(`--steps 400 --step-time 0.1 --hidden 64`, a checkpoint every 50 steps), each fault hitting rank 1 (node-1)
once training has passed step `--fault-step` (120) and, for trainguard, its node agents have parked the processes
for the next relaunch (the run's steady state; `parked_wait_s` says how long that took, at most 120 s):

- crash: SIGKILL of the rank; hang: SIGSTOP of the rank; slow: the rank stopped 80% of every 0.1 s (a GPU at
  a fifth of its speed); gpu: node-1's GPU check reports an XID; node-down: node-1's agent dies with its ranks.

1. trainguard: a private dev stack (Temporal dev server, SeaweedFS, controller, agents `node-0`, `node-1`,
   and `node-2` as the spare of the node faults slow, gpu and node-down) under `.bench/stack-<random>` on
   free ports from 32000. The fault goes through `TrainguardClient.inject_fault`, carried out by node-1's
   agent. Figures come from the run's result: the incident's `detection_s` (fault to detection) and
   `recovery_s` (detection to the first training step of the next attempt; for a straggler, of the
   replacement that follows the report), and the run's goodput and wall time. Default health settings
   (hang floor 2 s, straggler ratio 1.5 over 2 checkpoint intervals). After a node fault the benchmark
   repairs node-1 (a fresh agent, uncordoned) before the next one.
2. torchrun: `torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d` with
   `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (the configuration that restarts reliably here, see PLATFORM.md)
   running the same script with a local checkpoint (`--local-checkpoint-dir`, same cadence) and the
   process-group timeout a user would set (`--pg-timeout-s 60`). The benchmark finds rank 1's worker in
   /proc (by a marker variable it sets, `RANK=1`, the launcher's pid as parent) and sends the signals
   itself. Detection is the launcher's first reaction in its log (`Sending process N closing signal SIGTERM`
   to the survivors, else `Worker group FAILED`; output timestamped on arrival, `LOGLEVEL=INFO`); recovery
   is the first step of the next attempt in the trainer's `--progress-file` (rank 0 appends `step unix-time
   restart-count` per step). Goodput is computed as trainguard computes it: steps x mean step time of the
   final attempt / wall time. gpu and node-down are not measured for the launchers (see TORCHRUN_UNMEASURED).
3. ft_launcher (nvidia-resiliency-ext, the `bench` extra): the same as torchrun, plus its rank monitors with
   a 5 s heartbeat timeout (the trainer's `--ft-heartbeat` sends one per step); a hang is detected at its
   `Did not get subsequent heartbeat` line.
4. `--hosts`: the lost-node rows again on a second private stack in hosts mode (`trainguard.hosts`: every
   agent and its ranks in a network namespace of its own, on a bridge; needs root), as `trainguard/hosts`
   beside the loopback `trainguard` row: node-down (node-1's agent dies with its ranks) and partition (every
   packet node-1 sends or is sent is dropped, `tc` blackhole on both ends of its link; healed, its agent
   restarted and uncordoned afterwards).
5. The floor: the same 2 ranks started cold by plain torchrun with a local checkpoint present, time from
   launch to the first training step. No recovery can beat a cold start of the job it restarts.

This is a benchmark, not a test: it prints figures and writes them to JSON; it never asserts a time.
Every process it starts is killed (process groups, and workers found by the marker) and every file it
writes but `.bench/recovery.json` is removed, also on errors (`--keep-logs` keeps the launchers' output and
the stack's logs under `.bench/recovery-logs/`). torch's temporary files go to a TMPDIR under `.bench/`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.procs import stat_fields

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"
DEFAULT_JSON = BENCH_DIR / "recovery.json"
PORT_SEARCH_START = 32000
NODES = ("node-0", "node-1")
FAULT_NODE = "node-1"
FAULT_RANK = 1
TORCHRUN_MAX_RESTARTS = 3
TORCHRUN_PG_TIMEOUT_S = 60.0
MARK_VAR = "TG_BENCH_MARK"
DETECTED = re.compile(r"closing signal|Worker group (FAILED|UNHEALTHY)|Did not get subsequent heartbeat")
"""The launcher noticed a failed worker: torchrun's agent signals the others to close (first), then logs the
failure; ft_launcher's rank monitor first logs the missing heartbeat of a hung rank."""
FT_HEARTBEAT_TIMEOUT_S = 5.0
"""ft_launcher's rank heartbeat timeout: the 5 s of the issue's comparison (NVIDIA's examples use 180-300 s)."""
FT_INITIAL_HEARTBEAT_TIMEOUT_S = 120.0
"""Before the first heartbeat (imports, rendezvous, restore): generous, like trainguard's start-up grace."""
LAUNCHERS = ("torchrun", "ft_launcher")
TORCHRUN_EVENTS = re.compile(r"Worker group (FAILED|UNHEALTHY)|Stopping worker group|closing signal|"
                             r"Rendezvous'ing worker group|Starting worker group|ChildFailedError|"
                             r"Unable to shutdown process|timed out|Connection reset|Timed out")
SIGNALS = {"crash": signal.SIGKILL, "hang": signal.SIGSTOP}
FAULTS = ("crash", "hang", "slow", "gpu", "node-down")
INCIDENT_KINDS = {"crash": "crash", "hang": "hang", "slow": "straggler", "gpu": "gpu_unhealthy",
                  "node-down": "node_unresponsive", "partition": "node_unresponsive"}
"""The incident each fault should produce."""
NODE_FAULTS = frozenset({"slow", "gpu", "node-down", "partition"})
"""Faults trainguard answers by replacing the node: its runs get a spare (`node-2`)."""
SPARE = "node-2"
HOSTS_FAULTS = ("node-down", "partition")
"""The lost-node rows `--hosts` measures in hosts mode; `partition` exists only there (packets dropped)."""
HOSTS_SYSTEM = "trainguard/hosts"
SLOW_DUTY = 0.8
"""`slow`: rank 1 is stopped 80% of every 0.1 s (a GPU running at a fifth of its speed)."""
TORCHRUN_UNMEASURED = {
    "gpu": "not measured: torchrun has no GPU health check; the job runs on until the GPU fails outright",
    "node-down": "not measured: a node-down takes torchrun's own agent with it; in a multi-node job the "
                 "survivors wait for the lost node at rendezvous (no spare is taken)",
}


def say(line: str) -> None:
    print(line, flush=True)


def machine(load_before: tuple[float, float, float],
            load_after: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """What every benchmark's JSON says of the machine it ran on (the load shows what else shared it)."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_before": load_before, "loadavg_after": load_after or os.getloadavg()}


def write_results(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    say(f"wrote {path}")


# ------------------------------------------------------------------------------------------- results


@dataclass(slots=True)
class Measurement:
    """One fault under one system."""

    fault: str
    system: str
    detection_s: float | None = None
    """Fault to detection (trainguard: the incident; torchrun: its agent's first reaction in its log, the
    `closing signal SIGTERM` to the surviving workers, or `Worker group FAILED`)."""
    restart_s: float | None = None
    """Detection to the first training step of the next attempt."""
    time_to_recover_s: float | None = None
    """Fault to the first training step of the next attempt (detection_s + restart_s)."""
    goodput: float | None = None
    wall_s: float | None = None
    steps_completed: int | None = None
    completed: bool = False
    fault_step: int | None = None
    """Step the job had reached when the fault was sent."""
    resumed_step: int | None = None
    attempts: int | None = None
    mean_step_s: float | None = None
    note: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    """torchrun's log lines about the failure and restart, seconds after the fault."""
    workflow_id: str | None = None
    """trainguard: the run, for its history (`trainguard run report`)."""
    restore_tier: str | None = None
    recovery_path: str | None = None
    digest: str | None = None
    """trainguard: the run's final_state_digest."""
    parked_wait_s: float | None = None
    """trainguard: how long the fault waited, once the run passed `--fault-step`, for every node's agent to have
    its processes parked for the next relaunch (None: it did not wait, or they never parked)."""


@dataclass(slots=True)
class Floor:
    cold_start_s: float | None = None
    """Launch of plain torchrun to the first training step, with a local checkpoint present."""
    resumed_step: int | None = None
    note: str = ""


# -------------------------------------------------------------------------------------- processes


def _proc_environ(pid: int) -> dict[bytes, bytes]:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split(b"=", 1) for item in data.split(b"\0") if b"=" in item)


def marked_pids(mark: str) -> list[int]:
    """Every live process carrying our marker variable (torchrun and its workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        if _proc_environ(int(entry)).get(MARK_VAR.encode()) == mark.encode():
            stat = stat_fields(int(entry))
            if stat is not None and stat[0] != "Z":
                found.append(int(entry))
    return found


def find_worker(mark: str, parent: int, rank: int) -> tuple[int, int] | None:
    """(pid, restart count) of the newest live worker of `rank` that torchrun `parent` started."""
    best: tuple[int, int] | None = None
    for pid in marked_pids(mark):
        stat = stat_fields(pid)
        env = _proc_environ(pid)
        if stat is None or int(stat[1]) != parent or env.get(b"RANK") != str(rank).encode():
            continue
        try:
            if b"train.py" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue  # ft_launcher's rank monitors carry the rank too
        except OSError:
            continue
        restart = int(env.get(b"TORCHELASTIC_RESTART_COUNT", b"0"))
        if best is None or restart > best[1]:
            best = (pid, restart)
    return best


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Torchrun:
    """One job of the example trainer under plain torchrun or NVIDIA's ft_launcher (nvidia-resiliency-ext,
    torchrun plus per-rank heartbeat monitors), its output timestamped line by line on arrival."""

    def __init__(self, work: Path, name: str, train_args: list[str], max_restarts: int, log: Path,
                 launcher: str = "torchrun") -> None:
        self.work = work
        self.mark = f"{name}-{secrets.token_hex(6)}"
        self.ckpt_dir = work / "ckpt"
        self.progress = work / f"{name}.progress"
        self.tmp = work / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.lines: list[tuple[float, str]] = []
        self.log_path = log
        if launcher == "ft_launcher":
            command = [str(Path(sys.executable).parent / "ft_launcher"),
                       "--ft-initial-rank-heartbeat-timeout", f"{FT_INITIAL_HEARTBEAT_TIMEOUT_S:g}",
                       "--ft-rank-heartbeat-timeout", f"{FT_HEARTBEAT_TIMEOUT_S:g}"]
            train_args = [*train_args, "--ft-heartbeat"]
        else:
            torchrun = Path(sys.executable).parent / "torchrun"
            command = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
        self.argv = [
            *command, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "examples/train.py", *train_args,
            "--local-checkpoint-dir", str(self.ckpt_dir), "--pg-timeout-s", f"{TORCHRUN_PG_TIMEOUT_S:g}",
            "--progress-file", str(self.progress),
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.ended: float | None = None
        self._reader: threading.Thread | None = None

    def env(self) -> dict[str, str]:
        reserved = ("TRAINGUARD_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(reserved)}
        env.update({
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", "TMPDIR": str(self.tmp),
            "LOGLEVEL": "INFO", "PYTHONUNBUFFERED": "1", MARK_VAR: self.mark,
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        })
        return env

    def start(self) -> None:
        self.progress.unlink(missing_ok=True)
        self.started = time.time()
        self.proc = subprocess.Popen(  # noqa: S603 - argv list
            self.argv, cwd=REPO, env=self.env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.open("a") as log:
            log.write(f"# {time.time():.6f} {' '.join(self.argv)}\n")
            for raw in self.proc.stdout:
                now = time.time()
                text = raw.decode(errors="replace").rstrip("\n")
                self.lines.append((now, text))
                log.write(f"{now:.6f} {text}\n")
                log.flush()

    def steps(self) -> list[tuple[int, float, int]]:
        """(step, unix time, restart count) of every complete progress line of rank 0."""
        try:
            text = self.progress.read_text()
        except OSError:
            return []
        rows = []
        for line in text.split("\n")[:-1]:
            parts = line.split()
            if len(parts) == 3:
                with suppress(ValueError):
                    rows.append((int(parts[0]), float(parts[1]), int(parts[2])))
        return rows

    def wait(self, timeout_s: float) -> int | None:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self.ended = time.time()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        """SIGKILL torchrun's group and every worker carrying our marker (workers have their own sessions)."""
        for _ in range(3):
            pids = marked_pids(self.mark)
            if self.proc is not None and self.proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in pids:
                with suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if self.proc is not None:
                with suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=5)
            deadline = time.monotonic() + 5
            while marked_pids(self.mark) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not marked_pids(self.mark):
                break
        if self._reader is not None:
            self._reader.join(timeout=5)


# -------------------------------------------------------------------------------------- torchrun


def train_args(opts: argparse.Namespace, steps: int | None = None,
               step_time: float | None = None) -> list[str]:
    return ["--steps", str(steps if steps is not None else opts.steps),
            "--step-time", f"{opts.step_time if step_time is None else step_time:g}",
            "--hidden", str(opts.hidden), "--local-checkpoint-every", str(opts.every)]


def duty_cycle(pid: int, duty: float, stop: threading.Event, period_s: float = 0.1) -> None:
    """Stop and continue a process so it runs (1 - duty) of the time, as trainguard's `slow` chaos does."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(period_s * duty)
            os.kill(pid, signal.SIGCONT)
            time.sleep(period_s * (1 - duty))
    except ProcessLookupError:
        pass
    finally:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def torchrun_fault(opts: argparse.Namespace, fault: str, work: Path, log: Path,
                   system: str = "torchrun") -> Measurement:
    result = Measurement(fault=fault, system=system)
    if fault in TORCHRUN_UNMEASURED:
        result.note = TORCHRUN_UNMEASURED[fault].replace("torchrun", system)
        return result
    slowing = threading.Event()
    job = Torchrun(work / f"{system}-{fault}", f"{system}-{fault}", train_args(opts), TORCHRUN_MAX_RESTARTS,
                   log, launcher=system)
    timeout_s = 120 + 3 * opts.steps * opts.step_time + (3 * TORCHRUN_PG_TIMEOUT_S if fault == "hang" else 0)
    try:
        job.start()
        deadline = time.time() + timeout_s
        fault_at: float | None = None
        fault_restart = 0
        while time.time() < deadline:
            rows = job.steps()
            if rows and rows[-1][0] >= opts.fault_step:
                found = find_worker(job.mark, job.proc.pid, FAULT_RANK) if job.proc else None
                if found is None:
                    time.sleep(0.05)
                    continue
                pid, fault_restart = found
                result.fault_step = rows[-1][0]
                fault_at = time.time()
                if fault == "slow":
                    threading.Thread(target=duty_cycle, args=(pid, SLOW_DUTY, slowing), daemon=True).start()
                    say(f"  {system} slow: rank {FAULT_RANK} (pid {pid}) stopped {SLOW_DUTY:.0%} of the time "
                        f"from step {result.fault_step}")
                else:
                    os.kill(pid, SIGNALS[fault])
                    say(f"  {system} {fault}: sent {SIGNALS[fault].name} to rank {FAULT_RANK} (pid {pid}) "
                        f"at step {result.fault_step}")
                break
            if job.proc is not None and job.proc.poll() is not None:
                break
            time.sleep(0.05)
        if fault_at is None:
            result.note = "the job ended or timed out before the fault could be sent"
            return result
        code = job.wait(max(1.0, deadline - time.time()))
        if code is None:
            result.note = f"torchrun did not finish within {timeout_s:.0f}s; killed"
        elif code != 0:
            result.note = f"torchrun exited {code}"
        end = job.ended or time.time()
        result.wall_s = round(end - job.started, 3)
        detection = next((t for t, text in job.lines
                          if t >= fault_at and not text.startswith("[rank") and DETECTED.search(text)), None)
        result.events = [{"after_fault_s": round(t - fault_at, 3), "line": text[:300]}
                         for t, text in job.lines if t >= fault_at and TORCHRUN_EVENTS.search(text)][:40]
        rows = job.steps()
        first_new = next(((s, t, r) for s, t, r in rows if r > fault_restart and t >= fault_at), None)
        if detection is not None:
            result.detection_s = round(detection - fault_at, 3)
        else:
            result.note = (result.note + "; " if result.note else "") + f"{system} logged no failure"
            if fault == "slow":
                # Goodput here uses the slowed run's own mean step, so it hides the slowdown: read the wall time.
                result.note += ": the job ran at the slow rank's pace to the end (compare wall times)"
        if first_new is not None:
            result.time_to_recover_s = round(first_new[1] - fault_at, 3)
            result.resumed_step = first_new[0] - 1
            if detection is not None:
                result.restart_s = round(first_new[1] - detection, 3)
        if rows:
            final_restart = rows[-1][2]
            final = [(s, t) for s, t, r in rows if r == final_restart]
            gaps = [b[1] - a[1] for a, b in zip(final, final[1:]) if b[0] == a[0] + 1]
            result.attempts = final_restart + 1
            result.steps_completed = rows[-1][0]
            result.completed = code == 0 and rows[-1][0] == opts.steps
            if gaps and result.wall_s:
                result.mean_step_s = round(sum(gaps) / len(gaps), 6)
                useful = result.steps_completed * result.mean_step_s
                result.goodput = round(min(1.0, useful / result.wall_s), 4)
        return result
    finally:
        slowing.set()
        job.kill()


def torchrun_floor(opts: argparse.Namespace, work: Path, log: Path) -> Floor:
    """A cold start of the same 2 ranks from a local checkpoint: launch to first training step."""
    floor = Floor()
    home = work / "floor"
    # The checkpoint: the same job's state at `every` steps (no simulated compute, so it takes seconds).
    prep = Torchrun(home, "floor-prep", train_args(opts, steps=opts.every, step_time=0.0), 0, log)
    try:
        prep.start()
        code = prep.wait(180)
    finally:
        prep.kill()
    if code != 0 or not (prep.ckpt_dir / "ckpt.pt").exists():
        floor.note = f"preparing the checkpoint failed (exit {code})"
        return floor
    job = Torchrun(home, "floor", train_args(opts), 0, log)
    try:
        job.start()
        deadline = time.time() + 180
        while time.time() < deadline and not job.steps() and job.proc is not None and job.proc.poll() is None:
            time.sleep(0.02)
        rows = job.steps()
        if rows:
            floor.cold_start_s = round(rows[0][1] - job.started, 3)
            floor.resumed_step = rows[0][0] - 1
        else:
            floor.note = "no training step seen"
    finally:
        job.kill()
    return floor


# ------------------------------------------------------------------------------------- trainguard


def trainguard_spec(opts: argparse.Namespace, prefix: str, fault: str) -> dict[str, Any]:
    return {
        "entrypoint": ["python", "examples/train.py", "--steps", str(opts.steps), "--step-time",
                       f"{opts.step_time:g}", "--hidden", str(opts.hidden)],
        "nodes": list(NODES),
        "spare_nodes": [SPARE] if fault in NODE_FAULTS else [],
        "ranks_per_node": 1,
        "checkpoint": {"prefix": prefix, "every_steps": opts.every},
    }


async def trainguard_faults(opts: argparse.Namespace, faults: list[str], dev: Any,
                            system: str = "trainguard") -> list[Measurement]:
    from trainguard.client import TrainguardClient
    from trainguard.settings import Settings

    client = await TrainguardClient.connect(Settings.from_env({**os.environ, **dev.client_env()}))
    results = []
    for fault in faults:
        # A partition drops node-1's packets at its link (hosts mode); every other fault goes through its agent.
        cut = (lambda: dev.config.network.partition(FAULT_NODE)) if fault == "partition" else None
        try:
            measured = await trainguard_fault(client, opts, fault, dev.config.home, system, cut=cut)
        except Exception as error:  # noqa: BLE001 - one failed measurement must not lose the others
            measured = Measurement(fault=fault, system=system, note=f"error: {error!r}"[:300])
        if fault == "partition":
            dev.config.network.heal(FAULT_NODE)
        if fault in NODE_FAULTS:
            await repair(client, dev, FAULT_NODE)
        say(f"  -> {summary(measured)}")
        results.append(measured)
    return results


async def repair(client: Any, dev: Any, node: str) -> None:
    """What an operator does after a node fault: a fresh agent (the injected XID is gone), then uncordon."""
    await asyncio.to_thread(dev.restart, f"agent-{node}", lambda _line: None)
    await client.uncordon(node)


PARKED_WAIT_MAX_S = 120.0
"""The longest a trainguard fault waits for the run's parked processes: a run in its steady state has them (its
agents park them after the attempt's first step; a quiet machine takes 2-4 s to, a machine at load 20 half a
minute), and real faults come minutes to days into a run, not seconds."""


def parked_ready(home: Path, run_id: str) -> bool:
    """Every node of the run has its processes for the next relaunch parked, waiting in `tg.standby()`."""
    from trainguard.protocol import RunLayout, StandbyMark, read_attempt_file

    for node in NODES:
        layout = RunLayout.of(home / "nodes" / node, run_id)
        record = read_attempt_file(layout.ranks_file)
        if record is None or not record.parked:
            return False
        pids = {p.pid for p in record.parked}
        marks = [StandbyMark.read(f) for f in layout.parked_dir.glob("park-*.mark.json")]
        if len({m.pid for m in marks if m is not None and m.parked and m.pid in pids}) < len(pids):
            return False
    return True


def rank_step(home: Path, node: str, run_id: str, attempt: int, rank: int) -> int | None:
    """The step a rank last reported, read straight from its progress file on the node agent's disk.

    The run's status (watch heartbeats) lags by seconds; this is how the fault is sent at the same step
    as torchrun's, which the benchmark watches the same way (its trainer's progress file).
    """
    from trainguard.protocol import RunLayout, read_progress

    progress = read_progress(RunLayout.of(home / "nodes" / node, run_id).progress_file(attempt, rank))
    return progress.step if progress is not None else None


async def trainguard_fault(client: Any, opts: argparse.Namespace, fault: str, home: Path,
                           system: str = "trainguard", spec_changes: dict[str, Any] | None = None,
                           cut: Any = None) -> Measurement:
    """One run of the job with `fault` sent once it passes `opts.fault_step`. `spec_changes` are merged into
    the spec's sections (e.g. `{"restarts": {"in_process": True}}`). `cut`: what makes the fault instead of
    the agent (a partition: the agent cannot be asked to cut itself off)."""
    from temporalio.service import RPCError

    result = Measurement(fault=fault, system=system)
    tag = secrets.token_hex(4)
    spec = trainguard_spec(opts, f"bench-recovery-{fault}-{tag}", fault)
    for section, changes in (spec_changes or {}).items():
        spec[section] = {**spec.get(section, {}), **changes}
    run_id = await client.start_run(spec, workflow_id=f"bench-recovery-{fault}-{tag}")
    result.workflow_id = run_id
    timeout_s = 180 + 3 * opts.steps * opts.step_time
    deadline = time.monotonic() + timeout_s
    finished = False
    passed_at: float | None = None
    try:
        attempt: int | None = None
        last_status = 0.0
        failed_queries = 0
        while time.monotonic() < deadline:
            if attempt is None or time.monotonic() - last_status > 2.0:
                last_status = time.monotonic()
                try:
                    view = await client.status(run_id)
                except RPCError as error:  # a query waits on a workflow task: a busy controller times it out
                    failed_queries += 1
                    say(f"  trainguard {fault}: status query failed ({error.message}); retrying")
                    await asyncio.sleep(0.5)
                    continue
                if view.execution_status != "RUNNING":
                    result.note = f"the run ended before the fault: {view.status.reason}"
                    return result
                if view.status.phase.value == "running":
                    attempt = view.status.attempt
            step = rank_step(home, "node-0", run_id, attempt, 0) if attempt else None
            if step is not None and step >= opts.fault_step and passed_at is None:
                passed_at = time.monotonic()
            if passed_at is not None and time.monotonic() - passed_at < PARKED_WAIT_MAX_S \
                    and not parked_ready(home, run_id):
                await asyncio.sleep(0.1)  # the steady state: the relaunch it measures is served warm
                continue
            if step is not None and step >= opts.fault_step:
                if parked_ready(home, run_id):
                    assert passed_at is not None
                    result.parked_wait_s = round(time.monotonic() - passed_at, 2)
                if cut is not None:
                    await asyncio.to_thread(cut)
                    what = f"every packet to and from {FAULT_NODE} dropped"
                else:
                    injected = await client.inject_fault(run_id, fault, FAULT_NODE, slow_duty=SLOW_DUTY)
                    what = f"{fault} of rank {injected.rank} (pid {injected.pid}) on {FAULT_NODE}"
                landed = rank_step(home, "node-0", run_id, attempt, 0) if attempt else None
                result.fault_step = landed if landed is not None else step
                say(f"  {system} {fault}: {what}; rank 0 at step {step} when asked, {result.fault_step} when done")
                break
            await asyncio.sleep(0.02)
        else:
            result.note = f"step {opts.fault_step} not reached within {timeout_s:.0f}s"
            return result
        if failed_queries:
            result.note = f"{failed_queries} status queries timed out before the fault"
        outcome = await asyncio.wait_for(client.result(run_id), max(1.0, deadline - time.monotonic()))
        finished = True
        incidents = list(outcome.incidents)
        wanted = INCIDENT_KINDS[fault]
        # A straggler is reported first, then replaced when it persists: the figure is the replacement's.
        incident = next((i for i in reversed(incidents) if i.kind.value == wanted),
                        incidents[0] if incidents else None)
        others = [i.kind.value for i in incidents if i is not incident]
        if incident is None:
            result.note = "no incident recorded"
        else:
            if incident.kind.value != wanted:
                kind = f"incident kind {incident.kind.value}"
                result.note = f"{result.note}; {kind}" if result.note else kind
            result.detection_s = incident.detection_s
            result.restart_s = incident.recovery_s
            if incident.detection_s is not None and incident.recovery_s is not None:
                result.time_to_recover_s = round(incident.detection_s + incident.recovery_s, 3)
            first = next((i for i in incidents if i.kind.value == wanted), incident)
            if first is not incident and first.detection_s is not None and result.time_to_recover_s is not None:
                # A straggler: detected when first reported, recovered once the spare replaced it.
                result.detection_s = first.detection_s
                result.restart_s = round(result.time_to_recover_s - first.detection_s, 3)
            if (incident.detection_s is None and incident.recovery_s is not None and incidents[0] is not incident
                    and incidents[0].detection_s is not None):
                # A lost node found at the stop after its peers' hang (a partition): the run noticed at the
                # first incident; the node's recovery_s runs from its own, later, detection.
                first = incidents[0]
                fault_at = first.detected_at - first.detection_s
                result.detection_s = first.detection_s
                result.time_to_recover_s = round(incident.detected_at + incident.recovery_s - fault_at, 3)
                result.restart_s = round(result.time_to_recover_s - first.detection_s, 3)
            result.resumed_step = incident.resumed_step
            result.restore_tier, result.recovery_path = incident.restore_tier, incident.recovery_path
        if others:
            extra = f"other incidents: {', '.join(others)}"
            result.note = f"{result.note}; {extra}" if result.note else extra
        result.goodput = outcome.goodput
        result.wall_s = outcome.wall_s
        result.steps_completed = outcome.steps_completed
        result.completed = outcome.steps_completed == opts.steps
        result.attempts = outcome.attempts
        result.mean_step_s = outcome.mean_step_s
        result.digest = outcome.final_state_digest
        return result
    except asyncio.TimeoutError:
        result.note = f"the run did not finish within {timeout_s:.0f}s"
        return result
    finally:
        if not finished:
            with suppress(Exception):
                await client.cancel(run_id)


NVML_STANDIN = Path(__file__).resolve().parent / "nvml_standin"
"""A stand-in `pynvml` (`infra/bench/nvml_standin/pynvml.py`) for the gpu fault: the agents subscribe to its XID
events as to a real NVML's, and chaos raises its XID there, so detection is measured on the path a real
XID takes (the event wait, then the watch's next poll). No GPU here."""


@contextmanager
def _nvml_standin(on: bool) -> Iterator[None]:
    """With `on`, the stack's processes import the stand-in NVML (first on PYTHONPATH) while it starts."""
    saved = os.environ.get("PYTHONPATH")
    if on:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(NVML_STANDIN), saved) if p)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def run_trainguard(opts: argparse.Namespace, faults: list[str], work: Path,
                   hosts: bool = False) -> tuple[list[Measurement], dict[str, Any]]:
    from infra.bench.stack import private_stack

    nodes = (*NODES, SPARE) if NODE_FAULTS & set(faults) else NODES
    info: dict[str, Any] = {"nvml": "stand-in event set (infra/bench/nvml_standin)" if "gpu" in faults else "none"}
    name = "hosts-stack" if hosts else "stack"
    with _nvml_standin("gpu" in faults), private_stack(name, nodes, PORT_SEARCH_START, echo=lambda line: say(f"  {name}: {line}"),
                       keep_logs=work / f"{name}-logs" if opts.keep_logs else None, timings=info, hosts=hosts) as dev:
        info.update(home=str(dev.home), port_base=dev.config.ports.temporal,
                    weed_grpc_ports=dev.config.ports.weed_grpc_ports(), hosts=hosts)
        if hosts:
            info["addresses"] = {node: dev.node_address(node) for node in nodes}
        say(f"  {name} up in {info['stack_up_s']:.1f}s on port base {dev.config.ports.temporal}")
        system = HOSTS_SYSTEM if hosts else "trainguard"
        return asyncio.run(trainguard_faults(opts, faults, dev, system)), info


# ----------------------------------------------------------------------------------------- report


def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def summary(m: Measurement) -> str:
    goodput = None if m.goodput is None else m.goodput * 100
    return (f"{m.system} {m.fault}: detection {_fmt(m.detection_s)} s, restart {_fmt(m.restart_s)} s, "
            f"time to recover {_fmt(m.time_to_recover_s)} s, goodput {_fmt(goodput, '{:.1f}%')}, "
            f"wall {_fmt(m.wall_s, '{:.1f}')} s{'; ' + m.note if m.note else ''}")


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 3)


def report(results: list[Measurement], floor: Floor | None) -> tuple[list[str], dict[str, Any]]:
    lines = [f"{'fault':<9} {'system':<16} {'detection_s':>11} {'restart_s':>9} {'time_to_recover_s':>17} "
             f"{'goodput':>8} {'wall_s':>7} {'fault@':>6} {'resumed':>7} {'done':>4}  note"]
    for m in results:
        lines.append(
            f"{m.fault:<9} {m.system:<16} {_fmt(m.detection_s):>11} {_fmt(m.restart_s):>9} "
            f"{_fmt(m.time_to_recover_s):>17} "
            f"{_fmt(None if m.goodput is None else m.goodput * 100, '{:.1f}%'):>8} "
            f"{_fmt(m.wall_s, '{:.1f}'):>7} {_fmt(m.fault_step, '{}'):>6} {_fmt(m.resumed_step, '{}'):>7} "
            f"{'yes' if m.completed else 'no':>4}  {m.note}")
    ratios: dict[str, Any] = {}
    floor_s = floor.cold_start_s if floor else None
    if floor is not None:
        lines.append(f"floor: cold start of the 2 ranks from a local checkpoint (plain torchrun, launch to "
                     f"first "
                     f"step) {_fmt(floor_s)} s{'  ' + floor.note if floor.note else ''}")
    lines.append("ratios (baseline / trainguard for times: >1 means trainguard is faster; "
                 "trainguard / baseline for goodput):")
    for fault in dict.fromkeys(m.fault for m in results):
        tg = next((m for m in results if m.fault == fault and m.system == "trainguard"), None)
        entry: dict[str, Any] = {}
        for base in [m for m in results if m.fault == fault and m.system in LAUNCHERS]:
            if tg is None:
                continue
            versus = {
                "detection": _ratio(base.detection_s, tg.detection_s),
                "time_to_recover": _ratio(base.time_to_recover_s, tg.time_to_recover_s),
                "restart": _ratio(base.restart_s, tg.restart_s),
                "wall": _ratio(base.wall_s, tg.wall_s),
                "goodput": _ratio(tg.goodput, base.goodput),
            }
            entry[base.system] = versus
            lines.append(f"  {fault} vs {base.system}: detection {_fmt(versus['detection'])}x, time to recover "
                         f"{_fmt(versus['time_to_recover'])}x, restart {_fmt(versus['restart'])}x, wall "
                         f"{_fmt(versus['wall'])}x, goodput {_fmt(versus['goodput'])}x")
        for m in [m for m in results if m.fault == fault]:
            if floor_s and m.time_to_recover_s is not None:
                entry[f"{m.system}_restart_over_floor"] = _ratio(m.restart_s, floor_s)
                entry[f"{m.system}_time_to_recover_over_floor"] = _ratio(m.time_to_recover_s, floor_s)
                lines.append(f"  {fault}: {m.system} restart / floor "
                             f"{_fmt(entry[f'{m.system}_restart_over_floor'])}x, time to recover / floor "
                             f"{_fmt(entry[f'{m.system}_time_to_recover_over_floor'])}x")
        ratios[fault] = entry
    return lines, ratios


def _tmp_entries() -> set[str]:
    try:
        return set(os.listdir("/tmp"))
    except OSError:
        return set()


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, of {', '.join(FAULTS)} (default all)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per run (default 400)")
    parser.add_argument("--step-time", type=float, default=0.1, help="trainer --step-time (default 0.1)")
    parser.add_argument("--hidden", type=int, default=64, help="trainer --hidden (default 64)")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps (default 50)")
    parser.add_argument("--fault-step", type=int, default=120, help="inject once training passes this step")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON,
                        help=f"results file (default {DEFAULT_JSON})")
    parser.add_argument("--skip-torchrun", action="store_true",
                        help="trainguard only (still measures the floor)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        help="the baselines, of torchrun, ft_launcher (default both; ft_launcher needs "
                             "nvidia-resiliency-ext, in the bench extra)")
    parser.add_argument("--skip-trainguard", action="store_true", help="torchrun and the floor only")
    parser.add_argument("--hosts", action="store_true",
                        help=f"also measure the lost-node rows ({', '.join(HOSTS_FAULTS)}) in hosts mode: each node "
                             "in a network namespace of its own (needs root)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep torchrun output and the stack's logs under .bench/recovery-logs")
    opts = parser.parse_args(argv)
    faults = [f.strip() for f in opts.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if opts.hosts:
        from trainguard.hosts import unavailable_reason

        if reason := unavailable_reason():
            parser.error(f"--hosts: {reason}")
    if unknown:
        parser.error(f"unknown fault(s): {', '.join(unknown)} (known: {', '.join(FAULTS)})")
    if not 0 < opts.fault_step < opts.steps:
        parser.error("--fault-step must be between 0 and --steps")
    launchers = [name.strip() for name in opts.launchers.split(",") if name.strip()]
    if unknown_launchers := [name for name in launchers if name not in LAUNCHERS]:
        parser.error(f"unknown launcher(s): {', '.join(unknown_launchers)} (known: {', '.join(LAUNCHERS)})")
    if "ft_launcher" in launchers and not (Path(sys.executable).parent / "ft_launcher").exists():
        say("ft_launcher not installed (pip install -e '.[bench]'): measuring torchrun only")
        launchers.remove("ft_launcher")

    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    work = BENCH_DIR / f"recovery-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    log = work / "torchrun.log"
    tmp_before = _tmp_entries()
    load_before = os.getloadavg()
    started = time.monotonic()
    results: list[Measurement] = []
    floor: Floor | None = None
    stack_info: dict[str, Any] = {}
    say(f"recovery benchmark: {len(faults)} fault(s) {faults}, 2 ranks gloo, {opts.steps} steps x "
        f"{opts.step_time:g}s, checkpoint every {opts.every}, fault after step {opts.fault_step}; "
        f"{os.cpu_count()} CPUs, load {load_before[0]:.2f}")
    try:
        if not opts.skip_trainguard:
            say("trainguard: private dev stack")
            tg_results, stack_info = run_trainguard(opts, faults, work)
            results.extend(tg_results)
        if opts.hosts and not opts.skip_trainguard:
            say("trainguard: private dev stack in hosts mode")
            hosts_results, stack_info["hosts_stack"] = run_trainguard(opts, list(HOSTS_FAULTS), work, hosts=True)
            results.extend(hosts_results)
        say("floor: cold start from a local checkpoint under plain torchrun")
        floor = torchrun_floor(opts, work, log)
        say(f"  floor {_fmt(floor.cold_start_s)} s {floor.note}")
        for system in ([] if opts.skip_torchrun else launchers):
            for fault in faults:
                say(f"{system}: {fault}")
                try:
                    measured = torchrun_fault(opts, fault, work, log, system)
                except Exception as error:  # noqa: BLE001 - one failed measurement must not lose the others
                    measured = Measurement(fault=fault, system=system, note=f"error: {error!r}"[:300])
                say(f"  -> {summary(measured)}")
                results.append(measured)
    finally:
        if opts.keep_logs:
            keep = BENCH_DIR / "recovery-logs"
            keep.mkdir(exist_ok=True)
            for item in (log, work / "stack-logs", work / "hosts-stack-logs"):
                if item.exists():
                    target = keep / item.name
                    if item.is_dir():
                        shutil.copytree(item, target, dirs_exist_ok=True)
                    else:
                        shutil.copy2(item, target)
        shutil.rmtree(work, ignore_errors=True)

    order = {f: i for i, f in enumerate(dict.fromkeys([*faults, *(HOSTS_FAULTS if opts.hosts else ())]))}
    systems = ["trainguard", HOSTS_SYSTEM, *LAUNCHERS]
    results.sort(key=lambda m: (order[m.fault], systems.index(m.system)))
    lines, ratios = report(results, floor)
    new_tmp = sorted(_tmp_entries() - tmp_before)
    stack_socks = tuple(f"-{port}.sock" for port in [*stack_info.get("weed_grpc_ports", []),
                                                     *stack_info.get("hosts_stack", {}).get("weed_grpc_ports", [])])
    ours = [n for n in new_tmp if n.startswith(("torchelastic_", "torchinductor_"))
            or (n.startswith("seaweedfs-") and n.endswith(stack_socks))]
    load_after = os.getloadavg()
    say("")
    for line in lines:
        say(line)
    say(f"total {time.monotonic() - started:.0f}s; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} "
        f"after (other jobs may share the CPUs)")
    if ours:
        say(f"warning: new entries in /tmp that look like ours: {ours}")
    payload = {
        "benchmark": "recovery",
        "config": {"faults": faults, "steps": opts.steps, "step_time": opts.step_time, "hidden": opts.hidden,
                   "checkpoint_every": opts.every, "fault_step": opts.fault_step, "nodes": list(NODES),
                   "fault_node": FAULT_NODE, "fault_rank": FAULT_RANK, "hosts": opts.hosts,
                   "torchrun": {"max_restarts": TORCHRUN_MAX_RESTARTS, "pg_timeout_s": TORCHRUN_PG_TIMEOUT_S,
                                "rdzv_backend": "c10d", "share_rdzv_store": False}},
        "machine": machine(load_before, load_after),
        "stack": stack_info,
        "results": [asdict(m) for m in results],
        "floor": asdict(floor) if floor else None,
        "ratios": ratios,
        "table": lines,
        "new_tmp_entries": new_tmp,
        "total_s": round(time.monotonic() - started, 3),
    }
    write_results(opts.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
