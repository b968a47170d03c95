"""Reading a process's /proc/PID/stat: whether it still runs, and in what state.

A PID can be recycled, so "still the process we started" is its start time (in clock ticks since boot)
compared with the one recorded at launch.
"""

from __future__ import annotations

import os
from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """The fields after the command name (state first, then ppid, ...; start time at index 19), None once
    the process is gone. Splitting after the last ')' survives command names with spaces or parentheses."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str:
    """The state letter (`R`, `S`, `D`, `T`, `Z`, ...), `?` when the process is gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else "?"


def start_time(pid: int) -> str | None:
    """The start time of a running `pid`; None once it has exited (a zombie has exited)."""
    fields = stat_fields(pid)
    return fields[19] if fields and fields[0] != "Z" else None


CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
TREE_MAX_PROCESSES = 4096
"""A rank's process tree is read up to this many processes: a fork bomb cannot make the agent walk forever."""


def children(pid: int) -> list[int]:
    """The live children of every thread of `pid` (/proc/PID/task/TID/children), [] once it is gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            found.extend(int(child) for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except (OSError, ValueError):
            continue
    return found


def _io_bytes(pid: int) -> int | None:
    """`rchar` + `wchar` of /proc/PID/io: every byte read and written, files, pipes and sockets alike; None where
    the agent may not read it (another user's process, without root)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/io").read_text().splitlines() if ":" in line)
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


def _runqueue_wait_s(pid: int) -> float:
    """Seconds the main thread of `pid` spent runnable, waiting for a CPU (the second field of /proc/PID/schedstat,
    the thread group leader's); 0 where the kernel does not keep it. The main thread only: a rank blocked on a
    lock still has threads that wake every few milliseconds (its helper's evidence thread, gloo's), and on a
    loaded machine each wake-up waits in the run queue, which would read as a rank wanting a CPU."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def tree_usage(pid: int) -> tuple[float, int | None, float, bool] | None:
    """CPU seconds (user + system, reaped children's included), bytes read and written, and seconds its main
    threads spent waiting for a CPU, by `pid` and every live descendant (data loader workers, a compile's workers, a
    save's writer), and whether `pid`'s main thread is running or runnable now (`R`); None once `pid` is gone. Bytes are
    None when any of the tree's cannot be read."""
    cpu_ticks, io_total, waited = 0, 0, 0.0
    running = False
    io_known = True
    pending, seen = [pid], 0
    while pending and seen < TREE_MAX_PROCESSES:
        current = pending.pop()
        fields = stat_fields(current)
        if fields is None:
            if current == pid:
                return None
            continue  # a descendant that just exited: its time moves to its parent's reaped children
        seen += 1
        running = running or (current == pid and fields[0] == "R")
        try:
            cpu_ticks += sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
        except (IndexError, ValueError):
            pass
        waited += _runqueue_wait_s(current)
        io = _io_bytes(current)
        if io is None:
            io_known = False
        else:
            io_total += io
        pending.extend(children(current))
    return cpu_ticks / CLOCK_TICKS_PER_S, io_total if io_known else None, waited, running
