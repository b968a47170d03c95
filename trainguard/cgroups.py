"""One cgroup (v2) per run on each node, so fencing a run kills all of it.

A rank is user code: it may start processes of its own in new sessions (`setsid`, a daemonizing data service),
which a signal to the rank's process group never reaches, and which outlive their parent once reparented. The
agent puts every process it starts for a run (ranks, parked processes, the standby) into the run's cgroup as it
starts it, and a process cannot leave it without write access to the cgroup root (root's). When the run leaves
the node (it ended, went on without it, or is fenced as an orphan), `cgroup.kill` ends everything in it at once.

The run's cgroups live under the agent's own: `<cgroup2 mount><agent's cgroup>/trainguard-<node>/<run>`, so a
systemd unit with `Delegate=yes` or a Kubernetes pod that gives the agent its cgroup is all it needs. Where
there is no writable cgroup2 hierarchy (a container without one), fencing falls back to process groups and
the rank's process tree, and says so once in the agent's log.

A process is moved in by the agent right after `exec` succeeded (`subprocess.Popen` returns then): the new
program is still starting (an interpreter takes tens of milliseconds before user code runs), long before it
can fork anything; its children already forked, if any, are moved with it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from pathlib import Path

from trainguard.procs import children

log = logging.getLogger(__name__)

CGROUPS_ENV = "TRAINGUARD_CGROUPS"
"""`off` makes an agent fence by process group and tree only (unit tests, a host whose cgroups another manager
owns)."""

KILL_WAIT_S = 2.0
"""How long `kill` waits for the kernel to empty a run's cgroup before it removes what it can."""


def _cgroup2_mount(mounts: str) -> Path | None:
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def _own_cgroup(cgroup: str) -> str:
    """This process's cgroup v2 path (the `0::` line of /proc/self/cgroup), `/` when it has none."""
    for line in cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return "/"


def run_cgroup_name(workflow_id: str) -> str:
    """A run's cgroup folder: readable, and safe for any workflow id (a hash keeps distinct ids apart)."""
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in workflow_id)[:64].lstrip(".") or "run"
    return f"{readable}-{hashlib.sha256(workflow_id.encode()).hexdigest()[:12]}"


class RunCgroups:
    """The cgroups of the runs one node agent starts processes for."""

    def __init__(self, node: str, workdir: Path, base: Path | None | bool = True) -> None:
        """`base`: the folder the runs' cgroups are made in; True finds it (under the agent's own cgroup, named
        after the node and its agent's `workdir`, so two stacks on one host never share it), None or False: no
        cgroups (fencing by process group and tree)."""
        self.node = node
        if base is True and os.environ.get(CGROUPS_ENV, "").lower() in ("off", "0", "no", "false"):
            base = None
        self.base: Path | None = self._discover(f"{node}@{workdir}") if base is True else (base or None)

    @staticmethod
    def _discover(node: str) -> Path | None:
        try:
            mount = _cgroup2_mount(Path("/proc/self/mounts").read_text())
            own = _own_cgroup(Path("/proc/self/cgroup").read_text())
        except OSError:
            return None
        if mount is None:
            log.warning("no cgroup2 hierarchy on %s: a run's processes are fenced by process group and tree only",
                        node)
            return None
        base = mount / own.lstrip("/") / f"trainguard-{run_cgroup_name(node)}"
        if not os.access(base.parent, os.W_OK):
            log.warning("cannot make cgroups under %s: a run's processes are fenced by process group and tree only",
                        base.parent)
            return None
        return base  # made at the first join, removed once empty

    @property
    def available(self) -> bool:
        return self.base is not None

    def path(self, workflow_id: str) -> Path | None:
        return self.base / run_cgroup_name(workflow_id) if self.base is not None else None

    def kill_all(self) -> int:
        """End every run's processes here (the agent stops: nothing it started may outlive it)."""
        if self.base is None:
            return 0
        killed = 0
        for name in self.runs():
            killed += self._kill_path(self.base / name)
        self.close()
        return killed

    def join(self, workflow_id: str, pid: int) -> bool:
        """Move `pid` (and any children it already has) into the run's cgroup; False where there are none."""
        path = self.path(workflow_id)
        if path is None:
            return False
        try:
            path.mkdir(parents=True, exist_ok=True)
            procs = path / "cgroup.procs"
            pending = [pid]
            while pending:
                current = pending.pop()
                try:
                    procs.write_text(str(current))
                except ProcessLookupError:
                    continue  # exited already
                pending.extend(children(current))
            return True
        except OSError as error:
            log.warning("could not put pid %d of %s in its cgroup %s: %s", pid, workflow_id, path, error)
            return False

    def pids(self, workflow_id: str) -> list[int]:
        """Every process in the run's cgroup (its sub-cgroups included)."""
        path = self.path(workflow_id)
        return _pids_in(path) if path is not None and path.is_dir() else []

    def kill(self, workflow_id: str) -> int:
        """SIGKILL everything in the run's cgroup and remove it. Returns how many processes were in it."""
        path = self.path(workflow_id)
        return self._kill_path(path) if path is not None else 0

    def _kill_path(self, path: Path) -> int:
        if not path.is_dir():
            return 0
        found = _pids_in(path)
        killer = path / "cgroup.kill"
        try:
            if killer.exists():
                killer.write_text("1")  # the kernel kills the whole subtree, forks in flight included
            else:
                raise OSError("no cgroup.kill (kernel before 5.14)")
        except OSError:
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + KILL_WAIT_S
        while _pids_in(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        for folder in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                             reverse=True) + [path]:
            try:
                folder.rmdir()
            except OSError:
                pass  # still emptying (zombies not reaped yet): the next kill removes it
        self.close()
        return len(found)

    def runs(self) -> list[str]:
        """The run cgroups' folder names here (what `kill_all` ends)."""
        if self.base is None or not self.base.is_dir():
            return []
        return [p.name for p in self.base.iterdir() if p.is_dir()]


    def remove_empty(self) -> None:
        """Remove the run cgroups no process is left in (runs that finished, attempts stopped), and the agent's
        folder once none is left: the host keeps no cgroup of a run that is over."""
        if self.base is None or not self.base.is_dir():
            return
        for name in self.runs():
            path = self.base / name
            if not _pids_in(path):
                for folder in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                                     reverse=True) + [path]:
                    try:
                        folder.rmdir()
                    except OSError:
                        pass
        self.close()

    def close(self) -> None:
        """Remove the agent's folder of run cgroups once empty (the agent stops): nothing is left behind."""
        if self.base is not None:
            try:
                self.base.rmdir()
            except OSError:
                pass  # a run's cgroup still holds processes being reaped


def _pids_in(path: Path) -> list[int]:
    found: list[int] = []
    for procs in path.rglob("cgroup.procs"):
        try:
            found.extend(int(p) for p in procs.read_text().split())
        except (OSError, ValueError):
            continue
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> int:
    """Signal `pid`'s descendants (found through /proc, whatever session or group they made), deepest first.
    The fallback for a node without cgroups: a child that daemonized (reparented to init) escapes it."""
    tree: list[int] = []
    pending = [pid]
    while pending:
        current = pending.pop()
        for child in children(current):
            tree.append(child)
            pending.append(child)
    for child in reversed(tree):
        try:
            os.kill(child, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return len(tree)
