"""Chaos soak: keep small training runs going while the controller, node agents and the Temporal server die.

    python -m infra.chaos_soak [--minutes 10] [--seed N] [--json .bench/soak.json] [--pools 1]

Issue: "A controller that survives anything". On a private dev stack (Temporal dev server, SeaweedFS, a
controller, agents `node-0`..`node-2`, under `.bench/soak-<random>` on free ports from 33000) the soak

1. runs every job of its catalogue once with no fault: the baselines (`final_state_digest` per job);
2. for `--minutes`, keeps runs of the example trainer going, one after another: 2 nodes x 1 rank with the
   third node of the pool as the run's spare (runs rotate which node is the spare). Runs lease their nodes
   from the node pool exclusively, so one pool of 3 nodes carries one such run at a time; `--pools N`
   gives the stack N pools (3N nodes) and N runs at once. At random, seeded intervals it kills one
   component and brings it back with `DevStack.up` (it restarts only what is missing), waiting between
   kills long enough for the runs to recover:
   - the controller worker: SIGKILL;
   - a node agent, mostly of a node a run trains on: SIGKILL (its ranks live on and are adopted by the
     new agent; the run sees the node as unresponsive once the watch's heartbeat times out, and replaces
     it with its spare, cordoning it, or, with no spare left, pauses);
   - the Temporal server: SIGTERM (it restarts on its SQLite file);
   and acts as the operator would once every agent is back: resumes a paused run, uncordons a node a run
   cordoned (its agent is back, so the node is repaired);
3. waits for every run to finish and checks the invariants:
   - every run completed (none failed, none left unfinished);
   - no duplicate rank sets: sampled about once a second during the soak, no node ever has live rank
     processes of two different attempts of one run at once (found in /proc by the environment the agent
     gives its ranks, and confirmed by re-reading the older process after the newer one was seen), and
     while the ranks an agent's record (`nodes/*/runs/*/ranks.json`: attempt, pid + /proc start time)
     names are alive, every live rank of that run on that node is of the recorded attempt;
   - no incident counted twice: a result's incidents have distinct (kind, node, rank, attempt) (straggler
     reports excepted: a straggler is reported again when it comes back, by design);
   - no checkpoint lost: the final checkpoint's manifest exists in S3, and so does the manifest of every
     step the run reported committed (status queries during the soak) that retention must keep
     (steps >= the oldest of the newest `keep_last` committed ones); a step of the cadence near the end
     that was never committed at all is reported as skipped (a warning, not an invariant);
   - every completed run ends with its job's baseline `final_state_digest` (bit-identical).

The stack runs a snapshot of the working tree's code (`trainguard/`, `workflows/`, `activities/`,
`workers/`, `examples/`, copied under the stack's home at the start and put first on `PYTHONPATH`), so a
controller restarted mid-soak runs the code the soak started with, not an edit made since
(`--no-snapshot` runs the repository itself).

It prints counts and writes a JSON report (`--json`); the exit status is 1 when an invariant fails. The
stack is always stopped (`DevStack.down`) and its directory deleted, also on errors, Ctrl-C or SIGTERM.
Ranks of a killed agent that outlived everything are found by their environment and killed by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra import harness
from infra.harness import RankProc, scan_ranks
from infra.harness import alive as _alive

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / ".bench"
DEFAULT_JSON = BENCH_DIR / "soak.json"
PORT_SEARCH_START = 33000
POOL_SIZE = 3
COMPONENTS = ("controller", "agent", "temporal")
CODE_DIRS = ("trainguard", "workflows", "activities", "workers", "examples")
BUCKET = "trainguard"
KEEP_LAST = 2
HIDDEN = 64

POLL_S = 1.0
"""How often each run's status is read (committed steps, phase) and the ranks are sampled."""
RPC_TIMEOUT_S = 10.0
"""A describe, query or update that takes longer is retried (the server or the controller may be down)."""
KILL_WAIT_S = 30.0
"""A signalled process that has not exited after this long gets SIGKILL."""
UP_ATTEMPTS = 3
"""`DevStack.up` after a kill waits up to a minute per try; a loaded machine may need another."""
RESTART_DELAY_S = 1.0
"""Seconds a killed component stays down before it is brought back."""
AGENT_ON_BUSY_NODE = 0.75
"""Share of agent kills aimed at a node a run trains on; the rest hit any node (spares, idle ones)."""


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
    gap_s: tuple[float, float] = (15.0, 30.0)
    """Seconds between one component being back and the next kill (uniform, seeded)."""
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
    """controller, agent or temporal."""
    target: str
    """The dev stack's name for it: controller, agent-node-1, temporal."""
    at_s: float
    """Seconds into the soak."""
    signal: str
    pid: int | None = None
    down_s: float = 0.0
    """Signal to the component being back (DevStack.up returned)."""
    error: str | None = None


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


# ----------------------------------------------------------------------------------------- /proc reading
# Rank processes are found by `infra.harness` (the agents' records and /proc).


class RankSampler:
    """Samples the live ranks of the stack, looking for two attempts of one run alive on a node at once."""

    def __init__(self, home: Path, clock: Callable[[], float]) -> None:
        self.home = home
        self.clock = clock
        self.samples = 0
        self.record_samples = 0
        self.duplicates: list[Duplicate] = []
        self.record_mismatches: list[dict[str, Any]] = []
        self.cross_node_samples = 0
        """Samples where a run had live ranks of two attempts on different nodes: a killed agent's orphans
        on a node the run has left, beside the newer attempt. Expected briefly by design (an unreachable
        node is fenced by its agent at its next launch; the orphans die when their peers are stopped).
        Reported, not an invariant."""
        self.cross_node_longest_s = 0.0
        self._cross_since: dict[str, float] = {}
        self._seen: set[tuple[Any, ...]] = set()

    def sample(self) -> None:
        procs = scan_ranks(self.home)
        self.samples += 1
        by_run_node: dict[tuple[str, str], list[RankProc]] = {}
        for proc in procs:
            by_run_node.setdefault((proc.workflow_id, proc.node), []).append(proc)
        for (workflow_id, node), group in sorted(by_run_node.items()):
            attempts = sorted({p.attempt for p in group})
            if len(attempts) < 2:
                continue
            # Confirm: an older attempt's process is still alive now that a newer one has been seen alive
            # (the scan reads processes one by one; an old rank may have exited between two reads).
            newest = attempts[-1]
            older_alive = [p for p in group if p.attempt < newest and _alive(p.pid, p.start_time)]
            newer_alive = [p for p in group if p.attempt == newest and _alive(p.pid, p.start_time)]
            if not older_alive or not newer_alive:
                continue
            key = ("node", workflow_id, node, tuple(attempts))
            if key not in self._seen:
                self._seen.add(key)
                self.duplicates.append(Duplicate(
                    workflow_id, node, attempts,
                    {str(a): sorted(p.pid for p in group if p.attempt == a) for a in attempts},
                    round(self.clock(), 1)))

        # Across nodes (informational).
        by_run: dict[str, set[int]] = {}
        for proc in procs:
            by_run.setdefault(proc.workflow_id, set()).add(proc.attempt)
        now = self.clock()
        overlapping = {w for w, attempts in by_run.items() if len(attempts) > 1}
        if overlapping:
            self.cross_node_samples += 1
        for workflow_id in overlapping:
            since = self._cross_since.setdefault(workflow_id, now)
            self.cross_node_longest_s = max(self.cross_node_longest_s, round(now - since, 1))
        for workflow_id in list(self._cross_since):
            if workflow_id not in overlapping:
                del self._cross_since[workflow_id]

        # The agents' own records: while the ranks a record names are alive, every live process of that run
        # on that node belongs to the recorded attempt.
        for node, record in harness.agent_records(self.home):
            self.record_samples += 1
            ranks = record.ranks
            if not any(_alive(i.pid, i.start_time) for i in ranks):
                continue
            strays = [p for p in by_run_node.get((record.workflow_id, node), [])
                      if p.attempt != record.attempt and _alive(p.pid, p.start_time)]
            # Re-read: the recorded ranks may have been fenced (and the record moved on) meanwhile.
            if not strays or not any(_alive(i.pid, i.start_time) for i in ranks):
                continue
            key = ("record", record.workflow_id, node, record.attempt,
                   tuple(sorted({p.attempt for p in strays})))
            if key not in self._seen:
                self._seen.add(key)
                self.record_mismatches.append({
                    "workflow_id": record.workflow_id, "node": node,
                    "recorded_attempt": record.attempt,
                    "stray_attempts": sorted({p.attempt for p in strays}),
                    "stray_pids": sorted(p.pid for p in strays), "at_s": round(self.clock(), 1)})


# ------------------------------------------------------------------------------------------- the stack




def snapshot_code(destination: Path) -> Path:
    """A copy of the code the stack runs, so edits made during the soak do not reach restarted workers."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in CODE_DIRS:
        shutil.copytree(REPO / name, destination / name, ignore=ignore)
    return destination


def _quiet(_line: str) -> None:
    return None


class Chaos:
    """Kills a component of the stack and brings it back."""

    def __init__(self, stack: Any, nodes: tuple[str, ...], rng: random.Random, clock: Callable[[], float],
                 say: Callable[[str], None]) -> None:
        self.stack = stack
        self.nodes = nodes
        self.rng = rng
        self.clock = clock
        self.say = say
        self.kills: list[Kill] = []
        self.busy = False
        """A component is down or coming back: operator actions wait for the stack to be whole."""
        self._cycle: list[str] = []

    def next_component(self) -> str:
        """Every kind in turn, shuffled per round, so a short soak still hits each of them."""
        if not self._cycle:
            self._cycle = list(COMPONENTS)
            self.rng.shuffle(self._cycle)
        return self._cycle.pop()

    async def strike(self, component: str, busy_nodes: list[str] | None = None) -> Kill:
        """Kill `component`; an agent is mostly one of `busy_nodes` (a node a run trains on), sometimes any
        (a spare or an idle node)."""
        if component == "agent":
            aim = busy_nodes if busy_nodes and self.rng.random() < AGENT_ON_BUSY_NODE else list(self.nodes)
            node = self.rng.choice(aim)
            target, sig = f"agent-{node}", signal.SIGKILL
        elif component == "controller":
            target, sig = "controller", signal.SIGKILL
        else:
            target, sig = "temporal", signal.SIGTERM
        kill = Kill(component, target, round(self.clock(), 1), sig.name)
        self.kills.append(kill)
        self.busy = True
        started = time.monotonic()
        try:
            kill.pid = await self._signal(target, sig)
            await asyncio.sleep(RESTART_DELAY_S)
            await self.restore()
        except Exception as error:  # noqa: BLE001 - recorded; the soak goes on and the invariants judge
            kill.error = f"{type(error).__name__}: {error}"
        finally:
            kill.down_s = round(time.monotonic() - started, 1)
            self.busy = False
        self.say(f"killed {target} ({sig.name}, pid {kill.pid}); back after {kill.down_s:.1f}s"
                 + (f"  ERROR {kill.error}" if kill.error else ""))
        return kill

    async def restore(self) -> None:
        for attempt in range(1, UP_ATTEMPTS + 1):
            try:
                await asyncio.to_thread(self.stack.up, _quiet)
                return
            except RuntimeError:
                if attempt == UP_ATTEMPTS:
                    raise
                await asyncio.sleep(2.0)

    async def _signal(self, target: str, sig: signal.Signals) -> int | None:
        pidfile = self.stack.run_dir / f"{target}.json"
        try:
            record = json.loads(pidfile.read_text())
        except (OSError, ValueError):
            return None
        pid = record["pid"]
        if not _alive(pid, record["start_time"]):
            return None
        os.kill(pid, sig)
        deadline = time.monotonic() + KILL_WAIT_S
        while _alive(pid, record["start_time"]):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + KILL_WAIT_S
            await asyncio.sleep(0.05)
        _reap(pid)
        return pid


def _reap(pid: int) -> None:
    """The stack's components are our children: collect a killed one's exit status."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


# --------------------------------------------------------------------------------------------- the soak


@dataclass
class SoakReport:
    ok: bool
    counts: dict[str, Any]
    failures: list[str]
    lines: list[str]
    data: dict[str, Any]


class Soak:
    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.seed = config.seed if config.seed is not None else random.SystemRandom().randrange(1, 2**31)
        self.rng = random.Random(self.seed)
        self.nodes = pool_nodes(config.pools)
        self.t0 = time.monotonic()
        self.runs: dict[str, RunRecord] = {}
        self.baselines: dict[str, RunRecord] = {}
        self.errors: list[str] = []
        self.uncordons = 0
        self.leftovers: list[str] = []
        """Processes still alive after `DevStack.down` (killed then; none expected)."""
        self.stack: Any = None
        self.client: Any = None
        self.chaos: Chaos | None = None
        self.sampler: RankSampler | None = None
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._launches = [0] * config.pools

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def say(self, line: str) -> None:
        self.config.echo(f"[{self.clock():7.1f}s] {line}")

    # ---------------------------------------------------------------------------------- run handling
    async def start(self, pool: int, job: Job, baseline: bool = False) -> RunRecord:
        members = self.nodes[POOL_SIZE * pool:POOL_SIZE * (pool + 1)]
        turn = self._launches[pool]
        self._launches[pool] += 1
        # Rotate which node is the spare, so every node carries runs and every agent kill hits some.
        nodes = (members[turn % 3], members[(turn + 1) % 3])
        spares = () if baseline else (members[(turn + 2) % 3],)
        tag = uuid.uuid4().hex[:6]
        index = len(self.runs) + len(self.baselines)
        workflow_id = f"soak-{'base' if baseline else 'run'}-{index:03d}-{job.name}-{tag}"
        prefix = f"soak-{tag}"
        spec = soak_spec(prefix, job, nodes, spares, self.config.step_time)
        record = RunRecord(workflow_id, job.name, list(nodes), list(spares), prefix, baseline,
                           round(self.clock(), 1), current_nodes=list(nodes))
        await self._make_schedulable(members)
        while True:
            try:
                await asyncio.wait_for(self.client.start_run(spec, workflow_id=workflow_id), RPC_TIMEOUT_S)
                break
            except Exception as error:  # noqa: BLE001 - the server may be restarting
                from temporalio.exceptions import WorkflowAlreadyStartedError

                if isinstance(error, WorkflowAlreadyStartedError):
                    break  # a start whose reply was lost
                await asyncio.sleep(1.0)
        (self.baselines if baseline else self.runs)[workflow_id] = record
        self._followers[workflow_id] = asyncio.ensure_future(self.follow(record))
        if not baseline:
            self.say(f"started {workflow_id} on {','.join(nodes)} (spare {spares[0]})")
        return record

    async def follow(self, record: RunRecord) -> None:
        """Watch one run to its end: committed steps and phases from its status; resume it when paused."""
        from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

        from trainguard.models import Phase, RunResult, RunStatus

        handle = self.client.handle(record.workflow_id)
        while True:
            try:
                description = await asyncio.wait_for(handle.describe(), RPC_TIMEOUT_S)
                if description.status is not WorkflowExecutionStatus.RUNNING:
                    break
                status = await asyncio.wait_for(handle.query("status", result_type=RunStatus), RPC_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - server or controller restarting: ask again
                await asyncio.sleep(POLL_S)
                continue
            if status.latest_checkpoint is not None:
                record.committed_seen.add(status.latest_checkpoint.step)
            if status.nodes:
                record.current_nodes = list(status.nodes)
            if not record.phases_seen or record.phases_seen[-1] != status.phase.value:
                record.phases_seen.append(status.phase.value)
            if status.phase is Phase.PAUSED and self._stack_whole():
                try:
                    resume = self.client.resume(record.workflow_id, "soak: every agent is back")
                    await asyncio.wait_for(resume, RPC_TIMEOUT_S)
                    record.resumes += 1
                    self.say(f"resumed {record.workflow_id} (paused: {status.reason})")
                except Exception:  # noqa: BLE001 - retried at the next poll
                    pass
            await asyncio.sleep(POLL_S)

        typed = self.client.client.get_workflow_handle(record.workflow_id, result_type=RunResult)
        while True:
            try:
                result = await asyncio.wait_for(typed.result(), RPC_TIMEOUT_S * 3)
                break
            except WorkflowFailureError as error:
                record.outcome = "failed"
                cause: BaseException | None = error.cause
                while cause is not None and cause.__cause__ is not None:
                    cause = cause.__cause__
                record.reason = str(cause or error)
                self.say(f"FAILED {record.workflow_id}: {record.reason}")
                return
            except Exception:  # noqa: BLE001 - server restarting
                await asyncio.sleep(POLL_S)
        record.outcome = "completed"
        record.attempts = result.attempts
        record.incidents = [i.model_dump(mode="json") for i in result.incidents]
        record.final_step = result.final_checkpoint.step if result.final_checkpoint else None
        record.final_digest = result.final_state_digest
        record.wall_s = result.wall_s
        if result.final_checkpoint is not None:
            record.committed_seen.add(result.final_checkpoint.step)
        if not record.baseline:
            kinds = Counter(i.kind.value for i in result.incidents)
            self.say(f"completed {record.workflow_id}: {result.steps_completed} steps, "
                     f"{result.attempts} attempts, incidents {dict(kinds) or 'none'}")

    def _stack_whole(self) -> bool:
        if self.chaos is not None and self.chaos.busy:
            return False
        return all(self.stack.status().values())

    async def _make_schedulable(self, members: tuple[str, ...]) -> None:
        """The operator's part before a run starts: a node an earlier run cordoned (its agent was killed) is
        repaired once its agent is back; lift the cordon, or the run would fail on it at once."""
        while True:
            while not self._stack_whole():
                await asyncio.sleep(0.5)
            try:
                nodes = await asyncio.wait_for(self.client.nodes(), RPC_TIMEOUT_S)
                for node in nodes:
                    if node.node in members and node.cordoned:
                        await asyncio.wait_for(self.client.uncordon(node.node), RPC_TIMEOUT_S)
                        self.uncordons += 1
                        self.say(f"uncordoned {node.node} (cordoned: {node.cordoned[:90]})")
                return
            except Exception:  # noqa: BLE001 - server or controller restarting: ask again
                await asyncio.sleep(1.0)

    # ------------------------------------------------------------------------------------------ phases
    async def run_baselines(self) -> None:
        self.say(f"baselines: {', '.join(j.name for j in self.config.jobs)} (no faults)")
        pools = self.config.pools

        async def pool_baselines(pool: int) -> list[RunRecord]:
            done = []
            for job in self.config.jobs[pool::pools]:
                record = await self.start(pool, job, baseline=True)
                await self._followers[record.workflow_id]
                done.append(record)
            return done

        for records in await asyncio.gather(*(pool_baselines(p) for p in range(pools))):
            for record in records:
                if record.outcome != "completed" or not record.final_digest:
                    raise RuntimeError(f"baseline {record.workflow_id} did not complete: {record.reason}")
                self.say(f"baseline {record.job}: digest {record.final_digest[:16]}..., {record.wall_s:.1f}s")

    async def keep_runs_going(self, pool: int, until: float) -> None:
        """One run at a time on the pool: its 2 nodes and its spare are leased exclusively."""
        while self.clock() < until:
            record = await self.start(pool, self.rng.choice(self.config.jobs))
            follower = self._followers[record.workflow_id]
            while not follower.done() and self.clock() < until:
                await asyncio.sleep(0.5)

    async def make_chaos(self, until: float) -> None:
        assert self.chaos is not None
        wait = self.config.first_kill_s
        while True:
            await asyncio.sleep(max(0.0, min(wait, until - self.clock())))
            if self.clock() >= until:
                return
            busy = sorted({n for w in self.active() for n in self.runs[w].current_nodes})
            await self.chaos.strike(self.chaos.next_component(), busy)
            wait = self.rng.uniform(*self.config.gap_s)

    async def sample_ranks(self, stop: asyncio.Event) -> None:
        assert self.sampler is not None
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.sampler.sample)
            except Exception as error:  # noqa: BLE001 - a sampling error must not end the soak
                self.errors.append(f"sampler: {type(error).__name__}: {error}")
            try:
                await asyncio.wait_for(stop.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass

    def active(self) -> list[str]:
        return [w for w, r in self.runs.items() if r.outcome == "running"]

    async def drain(self) -> None:
        pending = [self._followers[w] for w in self.active()]
        if not pending:
            return
        self.say(f"chaos over: waiting for {len(pending)} runs to finish")
        _done, still = await asyncio.wait(pending, timeout=self.config.drain_timeout_s)
        for workflow_id in self.active():
            self.runs[workflow_id].outcome = "unfinished"
            self.runs[workflow_id].reason = f"not finished {self.config.drain_timeout_s:.0f}s after the chaos"
        for task in still:
            task.cancel()

    # --------------------------------------------------------------------------------------- checks
    async def check_runs(self) -> None:
        s3 = self.stack.s3()
        baseline_digest = {r.job: r.final_digest for r in self.baselines.values()}
        jobs = {j.name: j for j in self.config.jobs}
        for record in self.runs.values():
            if record.outcome != "completed":
                continue
            keys = [(i["kind"], i["node"], i["rank"], i["attempt"]) for i in record.incidents
                    if i["kind"] != "straggler"]
            record.duplicate_incidents = [list(k) for k, n in Counter(keys).items() if n > 1]

            job = jobs[record.job]
            listing = await asyncio.to_thread(_manifest_steps, s3, record.prefix, record.workflow_id)
            record.manifests_left = sorted(listing)
            # Retention keeps the newest `keep_last` committed checkpoints: every step seen committed from
            # the oldest of those on must still have its manifest, the final checkpoint's included.
            committed = record.committed_seen | listing
            oldest_kept = min(sorted(committed)[-KEEP_LAST:], default=0)
            must_exist = {s for s in record.committed_seen if s >= oldest_kept}
            if record.final_step is not None:
                must_exist.add(record.final_step)
            lost = set()
            for step in sorted(must_exist):
                # The listing first; a HEAD of the very key has the last word.
                if step not in listing and not await asyncio.to_thread(
                        _exists, s3, manifest_key(record.prefix, record.workflow_id, step)):
                    lost.add(step)
            record.lost_steps = sorted(lost)
            # Not a lost commit, but worth knowing: a step of the cadence near the end that was never
            # committed at all (the final one, or one between the survivors), so a fault there would have
            # resumed from further back.
            cadence = range(max(job.every, oldest_kept), job.steps + 1, job.every)
            record.skipped_steps = sorted(s for s in cadence if s not in committed) or (
                [job.steps] if record.final_step != job.steps else [])
            expected = baseline_digest.get(record.job)
            record.digest_ok = record.final_digest is not None and record.final_digest == expected

    def report(self) -> SoakReport:
        assert self.chaos is not None and self.sampler is not None
        runs = list(self.runs.values())
        kills = Counter(k.component for k in self.chaos.kills)
        kill_errors = [k for k in self.chaos.kills if k.error]
        completed = [r for r in runs if r.outcome == "completed"]
        failed = [r for r in runs if r.outcome == "failed"]
        unfinished = [r for r in runs if r.outcome in ("unfinished", "running")]
        incidents = Counter(i["kind"] for r in completed for i in r.incidents)
        duplicate_incidents = sum(len(r.duplicate_incidents) for r in completed)
        lost = sum(len(r.lost_steps) for r in completed)
        skipped = sum(len(r.skipped_steps) for r in completed)
        mismatched = [r for r in completed if not r.digest_ok]
        duplicates = len(self.sampler.duplicates) + len(self.sampler.record_mismatches)
        commits_seen = sum(len(r.committed_seen) for r in completed)
        resumes = sum(r.resumes for r in runs)
        counts = {
            "seed": self.seed,
            "chaos_minutes": self.config.minutes,
            "kills": {c: kills.get(c, 0) for c in COMPONENTS},
            "kills_total": len(self.chaos.kills),
            "kill_errors": len(kill_errors),
            "runs_started": len(runs),
            "runs_completed": len(completed),
            "runs_failed": len(failed),
            "runs_unfinished": len(unfinished),
            "resumes_after_pause": resumes,
            "uncordons": self.uncordons,
            "incidents": dict(sorted(incidents.items())),
            "duplicate_rank_sets": duplicates,
            "duplicate_incidents": duplicate_incidents,
            "rank_samples": self.sampler.samples,
            "cross_node_stale_samples": self.sampler.cross_node_samples,
            "cross_node_stale_longest_s": self.sampler.cross_node_longest_s,
            "commits_observed": commits_seen,
            "checkpoints_lost": lost,
            "checkpoints_skipped": skipped,
            "digest_mismatches": len(mismatched),
        }
        failures = []
        if not runs:
            failures.append("no run was started")
        if failed:
            failures.append(f"{len(failed)} runs failed: "
                            + "; ".join(f"{r.workflow_id}: {r.reason}" for r in failed))
        if unfinished:
            failures.append(f"{len(unfinished)} runs unfinished: "
                            + ", ".join(r.workflow_id for r in unfinished))
        if duplicates:
            found = [asdict(d) for d in self.sampler.duplicates] + self.sampler.record_mismatches
            failures.append(f"{duplicates} duplicate rank sets: {found}")
        if duplicate_incidents:
            failures.append("incidents counted twice: " + "; ".join(
                f"{r.workflow_id}: {r.duplicate_incidents}" for r in completed if r.duplicate_incidents))
        if lost:
            failures.append("checkpoints lost: " + "; ".join(
                f"{r.workflow_id}: steps {r.lost_steps} (left: {r.manifests_left})"
                for r in completed if r.lost_steps))
        if mismatched:
            failures.append("final state differs from the baseline: "
                            + ", ".join(r.workflow_id for r in mismatched))
        if self.leftovers:
            failures.append(f"processes left after the stack was stopped: {', '.join(self.leftovers)}")
        if kill_errors:
            failures.append("components that did not come back: " + "; ".join(
                f"{k.target} at {k.at_s}s: {k.error}" for k in kill_errors))
        lines = [
            f"soak: {self.config.minutes:g} min of chaos, seed {self.seed}, "
            f"{self.config.pools} pool(s) of 3 nodes "
            f"({len(self.nodes)} nodes), jobs {', '.join(j.name for j in self.config.jobs)}",
            "kills: " + " ".join(f"{c}={kills.get(c, 0)}" for c in COMPONENTS)
            + f" (total {len(self.chaos.kills)}, {len(kill_errors)} did not come back)",
            f"runs: started={len(runs)} completed={len(completed)} failed={len(failed)} "
            f"unfinished={len(unfinished)} "
            f"(operator: {resumes} resumes after a pause, {self.uncordons} uncordons)",
            "incidents: " + (" ".join(f"{k}={v}" for k, v in sorted(incidents.items())) or "none")
            + f"; counted twice: {duplicate_incidents}",
            f"duplicates found: {duplicates} (rank samples {self.sampler.samples}; "
            f"live ranks of an older attempt "
            f"on a node the run had left: {self.sampler.cross_node_samples} samples, "
            f"longest {self.sampler.cross_node_longest_s}s)",
            f"checkpoints lost: {lost} (committed steps observed: {commits_seen}); "
            f"final state digest mismatches: {len(mismatched)}",
            *([f"warning: {skipped} checkpoints never committed (skipped, not lost): " + "; ".join(
                f"{r.workflow_id}: steps {r.skipped_steps} (manifests left: {r.manifests_left})"
                for r in completed if r.skipped_steps)] if skipped else []),
            "result: " + ("PASS" if not failures else "FAIL"),
            *(f"  - {f}" for f in failures),
        ]
        data = {
            "counts": counts,
            "ok": not failures,
            "failures": failures,
            "config": {"minutes": self.config.minutes, "seed": self.seed, "pools": self.config.pools,
                       "gap_s": list(self.config.gap_s), "jobs": [j.name for j in self.config.jobs],
                       "step_time": self.config.step_time, "nodes": list(self.nodes), "keep_last": KEEP_LAST,
                       "snapshot": self.config.snapshot, "home": str(self.stack.home)},
            "leftovers": self.leftovers,
            "kills": [asdict(k) for k in self.chaos.kills],
            "baselines": [r.to_json() for r in self.baselines.values()],
            "runs": [r.to_json() for r in runs],
            "duplicates": [asdict(d) for d in self.sampler.duplicates],
            "record_mismatches": self.sampler.record_mismatches,
            "errors": self.errors,
        }
        return SoakReport(not failures, counts, failures, lines, data)

    # ------------------------------------------------------------------------------------------- main
    async def run(self) -> SoakReport:
        from trainguard.client import TrainguardClient

        home = BENCH_DIR / f"soak-{secrets.token_hex(4)}"
        home.mkdir(parents=True)
        code_dir, env = REPO, {}
        if self.config.snapshot:
            code_dir = snapshot_code(home / "code")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code_dir), os.environ.get("PYTHONPATH")) if p)
        private = harness.PrivateStack(home, self.nodes, PORT_SEARCH_START, code_dir=code_dir, env=env,
                                       keep_logs=self.config.keep_logs)
        config, self.stack = private.config, private.stack
        stop_sampling = asyncio.Event()
        sampling: asyncio.Task[None] | None = None
        try:
            self.say(f"stack in {home} (Temporal {config.temporal_address}, S3 {config.s3_endpoint}), "
                     f"seed {self.seed}")
            await asyncio.to_thread(private.start)
            self.client = await TrainguardClient.connect()
            self.chaos = Chaos(self.stack, self.nodes, self.rng, self.clock, self.say)
            self.sampler = RankSampler(home, self.clock)
            sampling = asyncio.ensure_future(self.sample_ranks(stop_sampling))
            await self.run_baselines()

            until = self.clock() + self.config.minutes * 60
            self.say(f"chaos for {self.config.minutes:g} min on {self.config.pools} pool(s)")
            await asyncio.gather(self.make_chaos(until),
                                 *(self.keep_runs_going(p, until) for p in range(self.config.pools)))
            await self.drain()
            stop_sampling.set()
            await sampling
            await self.check_runs()
        finally:
            stop_sampling.set()
            if sampling is not None and not sampling.done():
                sampling.cancel()
            for task in self._followers.values():
                task.cancel()
            try:
                await asyncio.to_thread(private.stop)
            finally:
                self.leftovers = private.leftovers + [f"rank {p.rank} of {p.workflow_id} (pid {p.pid})"
                                                      for p in private.leftover_ranks]
        report = self.report()
        for line in report.lines:
            self.config.echo(line)
        if self.config.json_path is not None:
            path = Path(self.config.json_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report.data, indent=2, default=str))
            self.config.echo(f"report: {path}")
        return report


def _manifest_steps(s3: Any, prefix: str, workflow_id: str) -> set[int]:
    steps = set()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/{workflow_id}/")
    for page in pages:
        for item in page.get("Contents", []):
            parts = item["Key"].rsplit("/", 2)
            if len(parts) == 3 and parts[2] == "manifest.json" and parts[1].startswith("step-"):
                steps.add(int(parts[1][len("step-"):]))
    return steps


def _exists(s3: Any, key: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        s3.head_object(Bucket=BUCKET, Key=key)
        return True
    except ClientError:
        return False


async def run_soak(config: SoakConfig) -> SoakReport:
    """The soak's main coroutine: stack up, baselines, chaos, drain, checks, stack down. A failed invariant
    does not raise: see `SoakReport.ok` and `.failures`."""
    return await Soak(config).run()


async def _main(config: SoakConfig) -> SoakReport:
    # SIGTERM (a timeout, a CI runner) cancels the soak like Ctrl-C does, so the stack is always stopped.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await run_soak(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.chaos_soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of chaos (default 10)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the kill schedule (default: random, printed)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON,
                        help=f"report file (default {DEFAULT_JSON.relative_to(REPO)})")
    parser.add_argument("--pools", type=int, default=1,
                        help="pools of 3 nodes, each carrying one run at a time (default 1)")
    parser.add_argument("--gap", type=float, nargs=2, default=(15.0, 30.0), metavar=("MIN_S", "MAX_S"),
                        help="seconds between a component being back and the next kill (default 15 30)")
    parser.add_argument("--step-time", type=float, default=0.15,
                        help="the trainer's simulated compute per step, seconds (default 0.15)")
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                        help="copy the stack's logs (controller, agents, Temporal) to DIR at the end")
    parser.add_argument("--no-snapshot", action="store_true",
                        help="run the stack on the repository's code itself, not a copy taken at the start")
    args = parser.parse_args(argv)
    if args.pools < 1 or args.minutes <= 0 or not 0 < args.gap[0] <= args.gap[1]:
        parser.error("--pools >= 1, --minutes > 0 and 0 < MIN_S <= MAX_S")
    config = SoakConfig(minutes=args.minutes, seed=args.seed, json_path=args.json, pools=args.pools,
                        gap_s=(args.gap[0], args.gap[1]), step_time=args.step_time,
                        snapshot=not args.no_snapshot, keep_logs=args.keep_logs)
    try:
        report = asyncio.run(_main(config))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("soak interrupted: stack stopped and removed", file=sys.stderr)
        return 130
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
