"""The one harness of the tests, the benchmarks and the chaos soak: finding a private stack's rank processes.

Ranks are found two ways, both through the agent-to-rank contract (`trainguard.protocol`):
- from the agents' records (`nodes/<node>/runs/<run>/ranks.json`): what the agents say they started;
- from /proc, by the environment every agent gives its ranks (workflow id, node, attempt, and a checkpoint
  folder under the stack's home): what really runs, whatever the records say.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainguard import protocol
from trainguard.procs import stat_fields


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
