"""Chaos soak: keep small training runs going while the controller, node agents, Temporal and SeaweedFS die.

    python -m infra.chaos_soak [--minutes 10] [--seed N] [--json .bench/soak.json] [--pools 1]

Issue: "A controller that survives anything". On a private dev stack (Temporal dev server, SeaweedFS, a
controller, agents `node-0`..`node-2`, under `.bench/soak-<random>` on free ports from 33000) the soak

1. runs every job of its catalogue once with no fault: the baselines (`final_state_digest` per job);
2. for `--minutes`, keeps runs of the example trainer going, one after another: 2 nodes x 1 rank with the
   third node of the pool as the run's spare (runs rotate which node is the spare). Runs lease their nodes
   from the node pool exclusively, so one pool of 3 nodes carries one such run at a time; `--pools N`
   gives the stack N pools (3N nodes) and N runs at once. It kills one component at a time, chosen at
   random (seeded; each kind once per shuffled round), by SIGKILL or gracefully by SIGTERM (half each), and
   brings it back with `DevStack.up` (it restarts only what is missing):
   - the controller worker;
   - a node agent, mostly of a node a run trains on (killed, its ranks live on and are adopted by the new
     agent; stopped, it stops its ranks and the run relaunches on the same nodes once it is back);
   - the Temporal server (it restarts on its SQLite file);
   - SeaweedFS (`weed mini`, on its data dir: commits and uploads wait for it).
   The pace follows recovery: after each kill the soak waits for the component to be back (always), then for
   every run to train again (a step past the one it was at, or past its resume point in a new attempt) and
   a seeded `--gap`, but no longer than the slot `--kills-per-hour` gives a kill (15 s at the default 240):
   past it the next kill lands in the runs' recovery, as overlapping failures do, and is counted. A loaded
   machine thus gets more kills during recovery, never a kill on a component still starting. A run that
   pauses is left to heal itself; only if it is still paused after `operator_grace_s` does the soak resume it
   as an operator would, and before a run starts it uncordons a node of its pool an earlier run cordoned;
   both are counted (expected: none);
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

It prints counts and writes a JSON report (`--json`: counts with kills by component and signal, kills an hour
and recovery times, every kill, every run, the seed); the exit status is 1 when an invariant fails. The
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
from pathlib import Path
from typing import Any

from infra import harness
from infra.harness import scan_ranks
from infra.soak_chaos import Chaos
from infra.soak_model import (BENCH_DIR, CODE_DIRS, COMPONENTS, DEFAULT_JSON, POLL_S, POOL_SIZE, PORT_SEARCH_START,
                              REPO, RPC_TIMEOUT_S, Job, RunRecord, SoakConfig, SoakReport, pool_nodes, soak_spec)
from infra.soak_sampler import RankSampler
from infra.soak_verdict import SoakVerdict

__all__ = ["COMPONENTS", "Job", "RankSampler", "Soak", "SoakConfig", "SoakReport", "main", "run_soak", "scan_ranks"]
"""What the soak's test and `make soak` use; the parts live in `infra.soak_model` (catalogue, config, specs,
records), `infra.soak_sampler` (the duplicate-rank watch), `infra.soak_chaos` (kills) and
`infra.soak_verdict` (checks and report)."""


def snapshot_code(destination: Path) -> Path:
    """A copy of the code the stack runs, so edits made during the soak do not reach restarted workers."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in CODE_DIRS:
        shutil.copytree(REPO / name, destination / name, ignore=ignore)
    return destination



# --------------------------------------------------------------------------------------------- the soak


class Soak(SoakVerdict):
    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.seed = config.seed if config.seed is not None else random.SystemRandom().randrange(1, 2**31)
        self.rng = random.Random(self.seed)
        self.nodes = pool_nodes(config.pools)
        self.t0 = time.monotonic()
        self.t0_wall = time.time()
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
            if status.phase is not Phase.PAUSED:
                record.paused_since_s = None
            elif record.paused_since_s is None:
                record.paused_since_s = self.clock()
                self.say(f"paused {record.workflow_id}: {status.reason}")
            # A paused run heals itself once its agents are back; the soak acts as the operator only if it
            # has not after a grace, and counts it.
            elif self.clock() - record.paused_since_s > self.config.operator_grace_s and self._stack_whole():
                try:
                    resume = self.client.resume(record.workflow_id, "soak: every agent is back")
                    await asyncio.wait_for(resume, RPC_TIMEOUT_S)
                    record.resumes += 1
                    record.paused_since_s = None
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
        """Kill; wait for the component to be back, then for every run to recover and a short seeded gap, but
        no longer than the slot `kills_per_hour` gives each kill: the next kill then lands in the recovery
        (counted). Never before the component is back, so a loaded machine gets its kills later, not on
        top of components still starting."""
        assert self.chaos is not None
        slot_s = 3600.0 / self.config.kills_per_hour if self.config.kills_per_hour > 0 else None
        wait = self.config.first_kill_s
        while True:
            await asyncio.sleep(max(0.0, min(wait, until - self.clock())))
            if self.clock() >= until:
                return
            before = await self._progress(self.active())
            busy = sorted({n for w in self.active() for n in self.runs[w].current_nodes})
            struck = time.monotonic()
            kill = await self.chaos.strike(self.chaos.next_component(), busy)
            bound = self.config.recovery_timeout_s if slot_s is None else max(0.0, slot_s - (time.monotonic() - struck))
            gap = self.rng.uniform(*self.config.gap_s)
            if await self._recovered(before, time.monotonic() + bound):
                kill.recovery_s = round(time.monotonic() - struck, 1)
                wait = gap if slot_s is None else min(gap, max(0.0, slot_s - (time.monotonic() - struck)))
            else:
                wait = 0.0
                if slot_s is None:
                    self.say(f"runs not recovered {bound:.0f}s after killing {kill.target}")

    async def _progress(self, workflow_ids: list[str]) -> dict[str, tuple[int, int]]:
        """(attempt, live step) of each run that answers; a run that does not is left out."""
        found: dict[str, tuple[int, int]] = {}
        for workflow_id in workflow_ids:
            try:
                view = await asyncio.wait_for(self.client.status(workflow_id), RPC_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - server or controller restarting
                continue
            found[workflow_id] = (view.status.attempt, view.live_step)
        return found

    async def _recovered(self, before: dict[str, tuple[int, int]], deadline: float) -> bool:
        """Every run of `before` finished, or trains again: a step past the one it was at, or, in a new
        attempt, a step past the one it resumed from."""
        from trainguard.models import Phase

        waiting = dict(before)
        while waiting:
            if time.monotonic() > deadline:
                return False
            for workflow_id, (attempt, step) in list(waiting.items()):
                if self.runs[workflow_id].outcome != "running":
                    del waiting[workflow_id]
                    continue
                try:
                    view = await asyncio.wait_for(self.client.status(workflow_id), RPC_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - server or controller restarting
                    continue
                status = view.status
                if view.execution_status != "RUNNING" or status.phase is Phase.COMPLETED or (
                        status.phase is Phase.RUNNING and (view.live_step > step or (
                            status.attempt > attempt and view.live_step > status.resumed_step))):
                    del waiting[workflow_id]
            if waiting:
                await asyncio.sleep(POLL_S)
        return True

    async def sample_ranks(self, stop: asyncio.Event) -> None:
        assert self.sampler is not None
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.sampler.sample)
            except Exception as error:  # noqa: BLE001 - a sampling error must not end the soak
                self.errors.append(f"sampler: {type(error).__name__}: {error}")
            try:
                await asyncio.wait_for(stop.wait(), POLL_S)
            except TimeoutError:
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
    parser.add_argument("--gap", type=float, nargs=2, default=(0.5, 3.0), metavar=("MIN_S", "MAX_S"),
                        help="seconds between the runs having recovered from a kill and the next (default 0.5 3)")
    parser.add_argument("--kills-per-hour", type=float, default=240.0, metavar="N",
                        help="the least kill rate: a kill's wait for the runs' recovery ends after 3600/N s, "
                             "and the next kill lands in the recovery (counted); 0: always wait (default 240)")
    parser.add_argument("--recovery-timeout", type=float, default=180.0, metavar="S",
                        help="most seconds to wait for the runs to recover after a kill (default 180)")
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
                        recovery_timeout_s=args.recovery_timeout, kills_per_hour=args.kills_per_hour,
                        snapshot=not args.no_snapshot, keep_logs=args.keep_logs)
    try:
        report = asyncio.run(_main(config))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("soak interrupted: stack stopped and removed", file=sys.stderr)
        return 130
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
