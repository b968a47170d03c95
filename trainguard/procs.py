"""Reading a process's /proc/PID/stat: whether it still runs, and in what state.

A PID can be recycled, so "still the process we started" is its start time (in clock ticks since boot)
compared with the one recorded at launch.
"""

from __future__ import annotations

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
