"""The recovery benchmark's baselines: the same job under plain torchrun (`--max-restarts`) and under NVIDIA's
ft_launcher, the same faults sent to rank 1's worker by signal, and the floor (a cold start of the same 2 ranks
from a local checkpoint). `infra.bench.recovery` says what is measured and how; this is how it is done.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

from infra.bench.recovery_report import FAULT_RANK, REPO, SLOW_DUTY, Floor, Measurement, say
from trainguard.procs import stat_fields

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
TORCHRUN_EVENTS = re.compile(r"Worker group (FAILED|UNHEALTHY)|Stopping worker group|closing signal|"
                             r"Rendezvous'ing worker group|Starting worker group|ChildFailedError|"
                             r"Unable to shutdown process|timed out|Connection reset|Timed out")
SIGNALS = {"crash": signal.SIGKILL, "hang": signal.SIGSTOP}
TORCHRUN_UNMEASURED = {
    "gpu": "not measured: torchrun has no GPU health check; the job runs on until the GPU fails outright",
    "node-down": "not measured: a node-down takes torchrun's own agent with it; in a multi-node job the "
                 "survivors wait for the lost node at rendezvous (no spare is taken)",
}


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
        self.proc = subprocess.Popen(  # argv list
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
