"""Where a node agent keeps a run's files. Nodes share no disk: shards travel between nodes through S3."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(workflow_id: str) -> str:
    """A directory name for a workflow id: readable, and distinct even when two ids sanitize alike."""
    cleaned = _UNSAFE.sub("_", workflow_id)[:80].lstrip(".") or "run"
    if cleaned == workflow_id:
        return cleaned
    return f"{cleaned}-{hashlib.sha256(workflow_id.encode()).hexdigest()[:8]}"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def shard_meta_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


@dataclass(frozen=True, slots=True)
class RunLayout:
    """One run's files on one node."""

    root: Path

    @classmethod
    def of(cls, workdir: Path, workflow_id: str) -> RunLayout:
        return cls(workdir / "runs" / safe_name(workflow_id))

    @property
    def ranks_file(self) -> Path:
        """The agent's record of the ranks it launched (attempt, pids), for fencing and reconciling."""
        return self.root / "ranks.json"

    def attempt_dir(self, attempt: int) -> Path:
        return self.root / f"attempt-{attempt:04d}"

    def progress_file(self, attempt: int, rank: int) -> Path:
        return self.attempt_dir(attempt) / "progress" / f"rank-{rank:05d}.json"

    def checkpoint_request_file(self, attempt: int) -> Path:
        """An operator's `checkpoint_now`: the step every rank of the attempt saves at."""
        return self.attempt_dir(attempt) / "checkpoint-request.json"

    def standby_file(self, attempt: int) -> Path:
        """The role (a rank's environment) the agent gives the attempt's standby process when a rank dies."""
        return self.attempt_dir(attempt) / "standby.json"

    def rejoin_file(self, rank: int) -> Path:
        """Where the agent tells a live rank whose peers failed which process group to join next."""
        return self.root / "rejoin" / f"rank-{rank:05d}.json"

    def log_file(self, attempt: int, rank: int) -> Path:
        return self.attempt_dir(attempt) / "logs" / f"rank-{rank:05d}.log"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    def local_step_dir(self, step: int) -> Path:
        return self.checkpoint_dir / step_dir_name(step)

    def restore_dir(self, step: int) -> Path:
        return self.root / "restore" / step_dir_name(step)

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"
