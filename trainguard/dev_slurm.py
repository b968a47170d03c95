"""A single-host Slurm cluster for `trainguard dev up --slurm`: one slurmctld and one `slurmd -N <node>` per
emulated node, with a munged of its own, all under the stack's home (`<home>/slurm`: slurm.conf, the munge key's
copy, spool, state and logs). Every daemon runs in the foreground, started and recorded by PID like the stack's
other components (`DevStack._spawn`); `stop` cancels every job first (their steps stop the node agents they
started), then stops the daemons, then kills by PID anything still carrying this cluster's `SLURM_CONF`.

Clients (sbatch, scontrol, srun inside jobs, the controller's scheduler hook) reach this cluster through
`SLURM_CONF=<home>/slurm/slurm.conf`; the conf names the munged socket (`AuthInfo=socket=...`).

Needs root (slurmd runs jobs as their submitter; munged runs as the `munge` user) and Debian's packages
`SLURM_PACKAGES` (`make slurm-install`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.ports import Ports, slurm_ports

SLURM_PACKAGES = ("slurm-wlm", "slurmctld", "slurmd", "munge", "slurm-client")
"""Debian 12's packages (Slurm 22.05): what `make slurm-install` puts in with apt-get."""
SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "scontrol", "sbatch", "srun", "squeue", "scancel", "sinfo")
SLURM_CONF_ENV = "SLURM_CONF"
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_USER = "munge"
DEFAULT_NUM_NODES = 4
SLURMD_TIMEOUT_S = 30
"""slurmctld marks a silent slurmd's node down after this (and pings every third of it): PLATFORM.md's figure,
down* about 35 s after a slurmd is killed. Tests pass a shorter one."""
READY_TIMEOUT_S = 60.0
JOBS_GONE_TIMEOUT_S = 60.0
"""`stop` waits this long after `scancel` for every job's steps to end (KillWait, then SIGKILL)."""


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (packages missing, not root): the message says what to install or change."""


def unavailable_reason(which: Callable[[str], str | None] = shutil.which, sbin: Path = Path("/usr/sbin")) -> str | None:
    """Why a dev Slurm cluster cannot start on this machine, or None when it can (`which` and `sbin`: where
    programs are looked for; the daemons live in /usr/sbin, often off a user's PATH)."""
    missing = [b for b in SLURM_BINARIES if which(b) is None and not (sbin / b).exists()]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found): install Debian's packages "
                f"{' '.join(SLURM_PACKAGES)} (as root: `make slurm-install`)")
    if os.geteuid() != 0:
        return "a dev Slurm cluster needs root: slurmd runs jobs as their submitter and munged as `munge`"
    if not MUNGE_KEY.exists():
        return f"{MUNGE_KEY} is missing: reinstall the munge package"
    try:
        import pwd

        pwd.getpwnam(MUNGE_USER)
    except KeyError:
        return f"no user {MUNGE_USER!r}: reinstall the munge package"
    return None


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass(frozen=True, slots=True)
class SlurmCluster:
    """The cluster of one dev stack: its folders, its slurm.conf, and the client commands pointed at it."""

    home: Path
    """`<stack home>/slurm`."""
    nodes: tuple[str, ...]
    ports: Ports
    slurmd_timeout_s: int = SLURMD_TIMEOUT_S

    # ------------------------------------------------------------------------------------------ files
    @property
    def conf(self) -> Path:
        return self.home / "slurm.conf"

    @property
    def munge_dir(self) -> Path:
        return self.home / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket.2"

    @property
    def log_dir(self) -> Path:
        return self.home / "log"

    def env(self) -> dict[str, str]:
        """What a client of this cluster (sbatch, scontrol, the controller's hook) needs in its environment."""
        return {SLURM_CONF_ENV: str(self.conf)}

    def components(self) -> list[str]:
        return ["munged", "slurmctld", *(f"slurmd-{n}" for n in self.nodes)]

    def conf_text(self) -> str:
        ctld, slurmd = slurm_ports(self.ports, len(self.nodes))
        home = self.home
        lines = [
            "# Written by `trainguard dev up --slurm` (trainguard/dev_slurm.py): one host, emulated nodes.",
            f"ClusterName=tg{self.ports.temporal}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # A requeued job reruns once its old credential expires: 10 s, not the default 120 s.
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=1",
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            "KillWait=10",
            "InactiveLimit=0",
            "MinJobAge=300",
            "SlurmdParameters=config_overrides",
            f"StateSaveLocation={home / 'state'}",
            f"SlurmdSpoolDir={home / 'spool'}/%n",
            f"SlurmctldPidFile={home / 'run'}/slurmctld.pid",
            f"SlurmdPidFile={home / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.log_dir}/slurmctld.log",
            f"SlurmdLogFile={self.log_dir}/slurmd-%n.log",
            *(f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 RealMemory=1000"
              for node, port in zip(self.nodes, slurmd)),
            f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        return "\n".join(lines) + "\n"

    def prepare(self) -> None:
        """The folders, the munge key's copy (owned by `munge`, as munged demands) and slurm.conf."""
        import pwd

        munge = pwd.getpwnam(MUNGE_USER)
        for sub in ("state", "spool", "run", "log"):
            (self.home / sub).mkdir(parents=True, exist_ok=True)
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        self.munge_dir.chmod(0o755)  # clients (root) connect to the socket; munged refuses a group/world-writable dir
        key = self.munge_dir / "munge.key"
        if not key.exists():
            shutil.copyfile(MUNGE_KEY, key)
        key.chmod(0o600)
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        os.chown(key, munge.pw_uid, munge.pw_gid)
        self.conf.write_text(self.conf_text())

    def munged_argv(self) -> list[str]:
        d = self.munge_dir
        return ["setpriv", f"--reuid={MUNGE_USER}", f"--regid={MUNGE_USER}", "--init-groups",
                _sbin("munged"), "--foreground", f"--socket={self.munge_socket}", f"--key-file={d / 'munge.key'}",
                f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"]

    def slurmctld_argv(self) -> list[str]:
        return [_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)]

    def slurmd_argv(self, node: str) -> list[str]:
        return [_sbin("slurmd"), "-D", "-N", node, "-f", str(self.conf)]

    # --------------------------------------------------------------------------------------- commands
    def run(self, *argv: str, check: bool = True, timeout_s: float = 20.0) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (`scontrol`, `sbatch`, ...) against this cluster."""
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=check,
                              env={**os.environ, **self.env()})

    def node_states(self) -> dict[str, dict[str, Any]]:
        """Node -> `{"state": ["IDLE", "DRAIN", ...], "reason": ...}` from `sinfo --json` (one RPC for all)."""
        return node_states(json.loads(self.run("sinfo", "--json").stdout))

    def jobs(self) -> list[dict[str, Any]]:
        """Every job slurmctld still knows (pending, running, completing; finished ones for MinJobAge)."""
        return list(json.loads(self.run("squeue", "--json", "--states=all").stdout).get("jobs", []))

    def live_jobs(self) -> list[int]:
        done = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                "OUT_OF_MEMORY"}
        return [int(j["job_id"]) for j in self.jobs() if str(j.get("job_state", "")).upper() not in done]

    def wait_idle(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            try:
                states = self.node_states()
                last = states
                # Every slurmd registered; a node drained (by trainguard or an operator) stays drained.
                if set(states) == set(self.nodes) and all(
                        "NOT_RESPONDING" not in s["state"] and ("DOWN" not in s["state"] or "DRAIN" in s["state"])
                        for s in states.values()):
                    return
            except (subprocess.SubprocessError, ValueError) as error:
                last = error
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not up within {timeout_s:.0f}s: {last}; see {self.log_dir}")

    def stray_processes(self) -> list[int]:
        """Live processes of this cluster's jobs: its slurmstepds, and every task of a job (node agents, ranks,
        batch scripts: they carry `SLURM_JOB_ID`), whose environment names this cluster's slurm.conf. Found from
        /proc, never by name; a shell that merely exported `SLURM_CONF` (`trainguard dev env`) is not one."""
        marker = f"{SLURM_CONF_ENV}={self.conf}".encode()
        stepd = os.path.realpath(_sbin("slurmstepd"))
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if marker not in environ or stat.rsplit(")", 1)[-1].split()[0] == "Z":
                continue
            try:
                exe = os.readlink(f"/proc/{entry.name}/exe")
            except OSError:
                exe = ""
            if exe == stepd or any(item.startswith(b"SLURM_JOB_ID=") for item in environ):
                found.append(int(entry.name))
        return found

    def cancel_jobs(self, echo: Callable[[str], None]) -> None:
        """scancel every job and wait until slurmctld has none live and no step or task of them runs."""
        try:
            jobs = self.live_jobs()
        except (subprocess.SubprocessError, ValueError, OSError):
            return  # slurmctld is not answering: the PID sweep in `stop` still finds what jobs left
        if jobs:
            self.run("scancel", *map(str, jobs), check=False)
            echo(f"slurm: cancelled jobs {', '.join(map(str, jobs))}")
        deadline = time.monotonic() + JOBS_GONE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if not self.live_jobs():
                    return
            except (subprocess.SubprocessError, ValueError, OSError):
                return
            time.sleep(0.3)
        echo(f"slurm: jobs still live after {JOBS_GONE_TIMEOUT_S:.0f}s; their processes are killed by PID")

    def kill_strays(self, daemons: set[int]) -> list[int]:
        """SIGKILL every process of this cluster that is not one of its recorded daemons; returns their PIDs."""
        strays = [p for p in self.stray_processes() if p not in daemons]
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return strays


def node_states(sinfo: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`sinfo --json` -> node -> `{"state": [...], "reason": ...}`, states upper-case: Slurm 22.05 gives a
    base `state` (`idle`, `down`) and `state_flags` (`DRAIN`, `NOT_RESPONDING`); later versions one list."""
    found: dict[str, dict[str, Any]] = {}
    for node in sinfo.get("nodes", []):
        state = node.get("state")
        states = [str(s) for s in state] if isinstance(state, list) else [str(state)] if state else []
        states += [str(f) for f in node.get("state_flags") or []]
        found[node["name"]] = {"state": [s.upper() for s in states], "reason": node.get("reason") or ""}
    return found


# -------------------------------------------------------------------------------------- the dev stack's
def check_available() -> None:
    """Raise `SlurmUnavailable` saying what to install or change, when a cluster cannot start here."""
    reason = unavailable_reason()
    if reason:
        raise SlurmUnavailable(reason)


def start_cluster(stack: Any, echo: Callable[[str], None]) -> None:
    """Bring up `stack.slurm` beside the stack's Temporal and store (`DevStack.up` in slurm mode)."""
    check_available()
    cluster: SlurmCluster = stack.slurm
    cluster.prepare()
    stack._spawn("munged", cluster.munged_argv())
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not cluster.munge_socket.exists():
        if time.monotonic() > deadline or not stack._alive("munged"):
            raise RuntimeError(f"munged did not start; see {stack.log_dir}/munged.log and {cluster.munge_dir}")
        time.sleep(0.05)
    env = {**os.environ, **cluster.env()}
    stack._spawn("slurmctld", cluster.slurmctld_argv(), env=env)
    for node in cluster.nodes:
        stack._spawn(f"slurmd-{node}", cluster.slurmd_argv(node), env=env)
    cluster.wait_idle()
    echo(f"Slurm: {len(cluster.nodes)} nodes ({', '.join(cluster.nodes)}) idle; clients need "
         f"{SLURM_CONF_ENV}={cluster.conf}")


def stop_cluster(stack: Any, echo: Callable[[str], None]) -> None:
    """Cancel every job, stop the daemons by PID, then kill by PID whatever the cluster's jobs left."""
    cluster: SlurmCluster = stack.slurm
    if not cluster.conf.exists():
        return
    if stack._alive("slurmctld"):
        cluster.cancel_jobs(echo)
    # Every slurmd recorded, whatever nodes this stack's settings name now.
    stack.stop(sorted(p.stem for p in stack.run_dir.glob("slurmd-*.json")), echo)
    stack.stop(["slurmctld"], echo)
    stack.stop(["munged"], echo)
    killed = cluster.kill_strays(set())
    if killed:
        echo(f"slurm: killed {len(killed)} processes its jobs left (pids {', '.join(map(str, killed))})")
