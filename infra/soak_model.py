"""The chaos soak's catalogue, configuration, job specs and records (`infra.chaos_soak` runs the soak)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra import harness

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / ".bench"
DEFAULT_JSON = BENCH_DIR / "soak.json"
PORT_SEARCH_START = 33000
POOL_SIZE = 3
COMPONENTS = ("controller", "agent", "temporal", "seaweedfs")
CODE_DIRS = ("trainguard", "workflows", "activities", "workers", "examples")
BUCKET = "trainguard"
KEEP_LAST = 2
HIDDEN = 64

POLL_S = 1.0
"""How often each run's status is read (committed steps, phase) and the ranks are sampled."""
RPC_TIMEOUT_S = 10.0
"""A describe, query or update that takes longer is retried (the server or the controller may be down)."""


def pool_nodes(pools: int) -> tuple[str, ...]:
    return tuple(f"node-{i}" for i in range(POOL_SIZE * pools))


@dataclass(frozen=True, slots=True)
class Job:
    """One training job of the catalogue: the example trainer with `steps` steps, a checkpoint every `every`.
    `steps` is a multiple of `every`, so the final step is committed and retention's survivors are known."""

    steps: int
    every: int

    @property
    def name(self) -> str:
        return f"s{self.steps}e{self.every}"


DEFAULT_JOBS = (Job(60, 10), Job(90, 15), Job(120, 20))


@dataclass
class SoakConfig:
    minutes: float = 10.0
    seed: int | None = None
    json_path: Path | None = DEFAULT_JSON
    pools: int = 1
    """Pools of 3 nodes; each carries one run at a time (2 nodes + its spare)."""
    gap_s: tuple[float, float] = (0.5, 3.0)
    """Seconds between the runs having recovered from one kill and the next kill (uniform, seeded)."""
    kills_per_hour: float = 240.0
    """The least kill rate: after a kill, the wait for the runs' recovery ends 3600/N s after it, and the next
    kill lands in the recovery (counted in `kills_before_recovery`). 0: always wait (`recovery_timeout_s`)."""
    recovery_timeout_s: float = 180.0
    """With `kills_per_hour` 0: how long the chaos waits for the runs to recover before it strikes again."""
    operator_grace_s: float = 120.0
    """How long a paused run is left to heal itself (its agents are back) before the soak resumes it as an
    operator would; every such resume is counted."""
    first_kill_s: float = 8.0
    """Seconds from the start of the chaos to the first kill: runs are launched by then."""
    jobs: tuple[Job, ...] = DEFAULT_JOBS
    step_time: float = 0.15
    """Simulated compute per step: a sleep, so it sets how long runs train, not their final state."""
    drain_timeout_s: float = 600.0
    """After the chaos: how long to wait for the runs still going to finish."""
    snapshot: bool = True
    """Run the stack on a copy of the code taken at the start (see the module docstring)."""
    keep_logs: Path | None = None
    """Copy the stack's logs (controller, agents, Temporal, S3) here before its directory is deleted."""
    echo: Callable[[str], None] = field(default=lambda line: print(line, flush=True))


# ------------------------------------------------------------------------------------------ the job spec


def make_spec(prefix: str, **fields: Any) -> dict[str, Any]:
    """A small run of the example trainer (`infra.harness.make_spec`, as the integration tests run it)."""
    return harness.make_spec(prefix, hidden=HIDDEN, keep_last=KEEP_LAST, **fields)


def soak_spec(prefix: str, job: Job, nodes: tuple[str, ...], spares: tuple[str, ...],
              step_time: float) -> dict[str, Any]:
    """The soak's runs: budgets wide enough that only a real bug stops a run (the soak tests survival, not
    the restart budget), and a straggler ratio no CPU-starved but healthy rank reaches."""
    return make_spec(prefix, steps=job.steps, every=job.every, nodes=nodes, spares=spares,
                     step_time=step_time,
                     health={"hang_floor_s": 10.0, "straggler_ratio": 20.0},
                     restarts={"max_restarts": 50, "max_restarts_without_checkpoint": 10})


def manifest_key(prefix: str, workflow_id: str, step: int) -> str:
    return f"{prefix}/{workflow_id}/step-{step:08d}/manifest.json"


# --------------------------------------------------------------------------------------------- records


@dataclass
class Kill:
    component: str
    """controller, agent, temporal or seaweedfs."""
    target: str
    """The dev stack's name for it: controller, agent-node-1, temporal, s3."""
    at_s: float
    """Seconds into the soak."""
    signal: str
    pid: int | None = None
    down_s: float = 0.0
    """Signal to the component being back (DevStack.up returned)."""
    error: str | None = None
    recovery_s: float | None = None
    """Signal to every run that trained through it training again (a step past the one it was at) or
    finished; None: the next kill came first (see `SoakConfig.kills_per_hour`)."""


@dataclass
class RunRecord:
    workflow_id: str
    job: str
    nodes: list[str]
    spares: list[str]
    prefix: str
    baseline: bool = False
    started_at_s: float = 0.0
    committed_seen: set[int] = field(default_factory=set)
    phases_seen: list[str] = field(default_factory=list)
    current_nodes: list[str] = field(default_factory=list)
    """The nodes the run's current attempt uses (after any replacement), from its status."""
    resumes: int = 0
    """Times the soak resumed the run as an operator (it stayed paused past `operator_grace_s`)."""
    paused_since_s: float | None = None
    """Soak clock when the run was first seen paused (None: not paused)."""
    outcome: str = "running"
    """running, completed, failed, unfinished."""
    reason: str | None = None
    attempts: int = 0
    incidents: list[dict[str, Any]] = field(default_factory=list)
    final_step: int | None = None
    final_digest: str | None = None
    wall_s: float = 0.0
    duplicate_incidents: list[list[Any]] = field(default_factory=list)
    lost_steps: list[int] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    """Checkpoint steps near the end never committed (a skipped checkpoint, not a lost one)."""
    manifests_left: list[int] = field(default_factory=list)
    digest_ok: bool | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["committed_seen"] = sorted(self.committed_seen)
        return data


@dataclass
class Duplicate:
    workflow_id: str
    node: str
    attempts: list[int]
    pids: dict[str, list[int]]
    at_s: float


@dataclass
class SoakReport:
    ok: bool
    counts: dict[str, Any]
    failures: list[str]
    lines: list[str]
    data: dict[str, Any]
