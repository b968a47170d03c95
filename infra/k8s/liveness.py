"""Liveness probe for trainguard's workers, which serve no HTTP: is `python -m MODULE` still running?

    python /app/infra/k8s/liveness.py workers.controller        exit 0: alive; exit 1: gone, zombie or stopped

A worker that exits takes its container with it (tini exits with it), so Kubernetes restarts it anyway; the
probe adds the cases an exit does not cover: the worker stopped (SIGSTOP, a frozen cgroup) or left a zombie.
Matching `python -m MODULE` at the start of a command line skips tini's own (`tini -- python -m ...`)
and this probe's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEAD_STATES = frozenset("ZTtXx")
"""/proc/<pid>/stat states of a process that will not poll again: zombie, stopped, traced, dead."""


def runs_module(cmdline: bytes, module: str) -> bool:
    args = cmdline.rstrip(b"\0").split(b"\0")
    return (len(args) >= 3 and os.path.basename(args[0]).startswith(b"python")
            and args[1] == b"-m" and args[2] == module.encode())


def process_state(stat: str) -> str:
    # The command name in parentheses may itself contain ") ": the state follows the last one.
    return stat.rsplit(")", 1)[1].split()[0]


def alive(module: str, proc: Path = Path("/proc")) -> bool:
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (runs_module((entry / "cmdline").read_bytes(), module)
                    and process_state((entry / "stat").read_text()) not in DEAD_STATES):
                return True
        except (OSError, IndexError):
            continue  # the process ended while we looked
    return False


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: liveness.py MODULE")
    sys.exit(0 if alive(sys.argv[1]) else 1)
