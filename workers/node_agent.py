"""The node agent: one per training node, polling `trainguard-node-<node-id>`.

    python -m workers.node_agent --node node-0 --workdir /var/lib/trainguard [--host 10.0.0.5] [--run-as USER]

It launches, watches and stops this node's ranks, checks its GPUs, and moves its checkpoint shards to and
from S3. It never imports torch (its own memory stays small). On SIGTERM it stops its ranks before exiting:
ranks never outlive their agent.

Its secrets (S3 keys, the peer token, Temporal's keys) leave its environment once it has connected
(`trainguard.settings.hold_agent_secrets`), and ranks run as another, unprivileged user (`--run-as`), so they
can read neither the agent's environment nor its memory (`trainguard.run_as`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.worker import Worker

from activities.chaos import RankChaos
from activities.checkpoint_transfers import NodeCheckpointActivities
from activities.evidence import EvidenceActivities
from activities.health import HealthActivities, NodeHealth
from activities.lighthouse import Lighthouses
from activities.nodes import peer_urls, register_node
from activities.peers import PEER_TOKEN_ENV, ShardServer, peer_token
from activities.rank_launch import RankLaunch
from activities.rank_logs import RankLogActivities
from activities.rank_parking import SPARE_CHECK_S
from activities.rank_records import RankBook
from activities.rank_watch import Decisions, Downloader, Fingerprinter, Pacer, RankWatch, Uploader
from trainguard import node_task_queue
from trainguard.connect import connect
from trainguard.run_as import RUN_AS_ENV, RunAs, run_as_from
from trainguard.settings import env_flag, hold_agent_secrets
from trainguard.spec import ENV_NAME_PATTERN, EXEC_ENV_PATTERNS, NODE_LABELS_ENV, is_node_id, parse_labels
from workers.agent_workdir import UnsafeWorkdir, prepare_workdir
from workers.common import GRACEFUL_SHUTDOWN, setup_logging, stop_event
from workers.job_fence import FenceOtherJobsRuns, JobFence, agent_job
from workers.redaction import RedactNodeResults

log = logging.getLogger("trainguard.node_agent")

HEARTBEAT_INTERVAL_S = float(os.environ.get("TRAINGUARD_HEARTBEAT_INTERVAL_S", "1.0"))
"""How often a watch's progress (each rank's step) reaches Temporal, for `trainguard run status` and the
client's live steps. A watch now lasts minutes, so without this the SDK would send it only every 8 s (0.8 x the
heartbeat timeout). Each send is an RPC, never a history event. A run of more than 200 nodes asks its watches
for fewer (`WatchRanksInput.heartbeat_every_s`: 200 a second for the whole run), whatever this is."""


AGENT_POLLS = 2
"""Activity polls an agent keeps open on its queue (the SDK's default is 5). A watch runs for the whole attempt
and holds no poll; the node's other calls (a check, a stop, evidence) come one or two at a time. Every open poll
counts against the namespace's concurrent-poller limit (1,200 per frontend on a self-hosted server by default,
`frontend.namespaceCount`; 20,000 on Temporal Cloud): 4,096 agents at 5 each would be 20,480."""


@dataclass(frozen=True, slots=True)
class NodeRanks:
    """A node agent's rank activities, each holding the node's one `RankBook` (its attempts and processes)."""

    book: RankBook
    launch: RankLaunch
    """`launch_ranks`, `rejoin_ranks`, `stop_ranks`."""
    watch: RankWatch
    """`watch_ranks`, `request_checkpoint`."""
    chaos: RankChaos
    """`inject_fault`."""
    evidence: EvidenceActivities
    """`collect_evidence`; a watch that judges a hang takes the same evidence with its event."""


def node_ranks(node: str, workdir: Path, host: str, code_dir: Path, health: NodeHealth | None = None,
               allowed: tuple[str, ...] = ("*",), chaos: bool = True, allowed_env: frozenset[str] = frozenset(),
               uploader: Uploader | None = None, downloader: Downloader | None = None,
               decisions: Decisions | None = None, run_as: RunAs | None = None,
               pacer: Pacer | None = None, fingerprinter: Fingerprinter | None = None) -> NodeRanks:
    """The rank activities of one node agent around one book: the book adopts the ranks a previous agent on
    this workdir left running, and every activity sees the attempts the others launch."""
    health = health or NodeHealth()
    book = RankBook(node, workdir)
    launch = RankLaunch(book, host, code_dir, allowed=allowed, allowed_env=allowed_env, run_as=run_as)
    evidence = EvidenceActivities(book)
    watch = RankWatch(book, launch, health, uploader=uploader, downloader=downloader, decisions=decisions,
                      hang_evidence=evidence.for_watch, pacer=pacer, fingerprinter=fingerprinter)
    return NodeRanks(book=book, launch=launch, watch=watch, chaos=RankChaos(book, health, enabled=chaos),
                     evidence=evidence)


def build_worker(client, node: str, workdir: Path, host: str, code_dir: Path,
                 allowed: tuple[str, ...] = ("*",), chaos: bool = True,
                 peer_tier: bool = True, allowed_env: frozenset[str] = frozenset(),
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 run_as: RunAs | None = None, slurm_job: int | None = None,
                 token: str | None = None) -> tuple[Worker, RankBook]:
    """`token`: the pool's peer token this agent tags its node records with and checks the run's relaunch
    decisions against (default `TRAINGUARD_PEER_TOKEN`; without one records go untagged, decisions unchecked)."""
    node_health = NodeHealth()
    node_health.xid.start()  # XID events as they happen; without NVML it starts nothing
    checkpoints = NodeCheckpointActivities(node, workdir, (lambda: peer_urls(client)) if peer_tier else None,
                                           token=token if token is not None else peer_token())
    ranks = node_ranks(node, workdir, host, code_dir, node_health, allowed=allowed, chaos=chaos,
                       allowed_env=allowed_env, uploader=checkpoints.upload_step,
                       downloader=checkpoints.download_shards, decisions=checkpoints.read_decision,
                       pacer=checkpoints.write_pace, fingerprinter=checkpoints.write_fingerprints,
                       run_as=run_as)
    health = HealthActivities(node, host, node_health)
    logs = RankLogActivities(node, workdir)
    lighthouses = Lighthouses(node, workdir, host)
    worker = Worker(
        client,
        task_queue=node_task_queue(node),
        activities=[
            ranks.launch.launch_ranks,
            ranks.launch.rejoin_ranks,
            ranks.launch.stop_ranks,
            ranks.launch.park_ranks,
            ranks.watch.watch_ranks,
            ranks.watch.request_checkpoint,
            ranks.chaos.inject_fault,
            ranks.evidence.collect_evidence,
            checkpoints.download_shards,
            health.check_node,
            logs.read_rank_log,
            lighthouses.start_lighthouse,
            lighthouses.keep_lighthouse,
            lighthouses.stop_lighthouse,
        ],
        max_concurrent_activities=64,
        max_concurrent_activity_task_polls=AGENT_POLLS,
        graceful_shutdown_timeout=GRACEFUL_SHUTDOWN,
        max_heartbeat_throttle_interval=timedelta(seconds=heartbeat_interval_s),
        # Every result and failure leaves the node redacted, whichever activity or field carries a rank's text.
        # An agent of Slurm job J acts for no run of another job (one that outlived its job, on J's nodes).
        interceptors=[RedactNodeResults(), FenceOtherJobsRuns(JobFence(slurm_job, lambda wid: run_memo(client, wid)))],
    )
    return worker, ranks.book


ORPHAN_CHECK_INTERVAL_S = 5.0
ORPHAN_IDLE_S = 30.0
"""Ranks no watch has looked at for this long are checked against their run: longer than a controller
restart or a continue-as-new takes to watch them again, so a healthy run is asked rarely."""


async def run_memo(client, workflow_id: str) -> dict[str, Any] | None:
    """The memo of run `workflow_id` (its current execution); None when Temporal has no such run."""
    from temporalio.service import RPCError, RPCStatusCode

    try:
        return await (await client.get_workflow_handle(workflow_id).describe()).memo()
    except RPCError as error:
        if error.status is RPCStatusCode.NOT_FOUND:
            return None
        raise


async def fence_orphans(client, ranks: RankBook) -> None:
    """Every `ORPHAN_CHECK_INTERVAL_S`: `check_orphans`."""
    while True:
        await asyncio.sleep(ORPHAN_CHECK_INTERVAL_S)
        await check_orphans(client, ranks)
        await check_parked_spares(client, ranks)


async def check_orphans(client, ranks: RankBook, idle_s: float = ORPHAN_IDLE_S) -> int:
    """The run's workflow is the authority on which ranks should live. Ranks that no watch has looked at
    for `idle_s` are checked against it: if the run has ended, moved to a newer attempt, or left this node
    (a partition that has healed, after the run replaced the node), they are stopped, so no stale attempt
    trains beside the new one. While Temporal cannot be reached nothing is stopped: an outage of the
    control plane must not kill training. Returns how many ranks it stopped."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError

    from trainguard.models import RunStatus

    stopped = 0
    for record in ranks.unwatched(idle_s):
        handle = client.get_workflow_handle(record.workflow_id)
        try:
            described = await asyncio.wait_for(handle.describe(), timeout=10)
            if described.status is not WorkflowExecutionStatus.RUNNING:
                stopped += await ranks.fence(record, f"the run is {described.status.name.lower()}")
                continue
            status = await asyncio.wait_for(handle.query("status", result_type=RunStatus), timeout=10)
        except (TimeoutError, RPCError) as error:
            log.info("cannot check %s with its workflow yet (%s); keeping its ranks", record.workflow_id,
                     getattr(error, "message", None) or type(error).__name__)
            continue
        if ranks.node not in status.nodes:
            stopped += await ranks.fence(record, f"the run went on without this node (on {', '.join(status.nodes)})")
        elif status.attempt > record.attempt:
            stopped += await ranks.fence(record, f"the run is at attempt {status.attempt}", leaving=False)
    return stopped


SPARE_DESCRIBE_TIMEOUT_S = 10.0
"""A spare's describe of its run that takes longer is tried at its next check (Temporal is restarting)."""


async def check_parked_spares(client, ranks: RankBook,
                              every_s: float = SPARE_CHECK_S) -> int:
    """The safety net for processes parked on this spare for a run that vanished without telling (terminated:
    no stop reached the spare): each spare's pool asks Temporal every `every_s` whether its run is still open,
    and goes once it is not. While Temporal cannot be reached nothing is closed. Returns how many pools closed."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError

    closed = 0
    for pool in ranks.spare_parking(every_s):
        try:
            described = await asyncio.wait_for(client.get_workflow_handle(pool.workflow_id).describe(),
                                           timeout=SPARE_DESCRIBE_TIMEOUT_S)
        except (TimeoutError, RPCError) as error:
            log.info("cannot check %s with its workflow yet (%s); keeping its parked processes", pool.workflow_id,
                     getattr(error, "message", None) or type(error).__name__)
            continue
        pool.checked_at = time.monotonic()
        if described.status is not WorkflowExecutionStatus.RUNNING:
            log.warning("the run %s is %s: closing its processes parked on spare %s", pool.workflow_id,
                        described.status.name.lower(), ranks.node)
            await ranks.close_parking(pool.workflow_id)
            if pool.workflow_id not in ranks.attempts:  # nothing of it runs here: whatever it left goes too
                await asyncio.to_thread(ranks.cgroups.kill, pool.workflow_id)
            closed += 1
    return closed


def run_as_problem(run_as: RunAs, workdir: Path, code_dir: Path, allowed: tuple[str, ...]) -> str | None:
    """Why ranks as `run_as` could not run here (the agent cannot switch users, or a folder they need is
    closed to them), or None. Checked at start: otherwise every launch would fail, each as if the spec's."""
    if os.geteuid() != 0:
        return (f"--run-as {run_as.name}: the agent runs as uid {os.geteuid()}, and only root can start ranks as "
                f"another user; run the agent as root, or leave --run-as out")
    needs = [(workdir, os.X_OK, "--workdir"), (code_dir, os.R_OK | os.X_OK, "--code-dir")]
    for program in (a for a in allowed if a != "*"):
        needs += [(Path(program), os.X_OK, "--allow"), (Path(os.path.realpath(program)), os.X_OK, "--allow")]
    for path, need, option in needs:
        closed = run_as.unreachable(path, need)
        if closed is not None:
            return (f"{option} {path}: ranks run as {run_as.name} (uid {run_as.uid}) cannot reach it: {closed} is "
                    f"missing or closed to that user; open it (e.g. chmod o+x on a folder), or choose other paths")
    return None


REGISTER_RETRY_S = 2.0
"""The pool answers once a controller runs; until then keep asking (agents may start first)."""
REGISTER_REFUSED_RETRY_S = 30.0
"""A registration the pool refused (a token that is not the controller's, a clock out of sync) is asked again
this much later: an operator fixes the cause, and each refusal costs the pool's history a few events."""


async def register_until_done(client, node: str, host: str,
                              peer_url: str = "", labels: dict[str, str] | None = None,
                              token: str | None = None, slurm_job: int | None = None) -> None:
    """Join the node pool, reporting GPU health (a cordoned node that comes back healthy is repaired, unless an
    operator cordoned it), where its shard server is, its labels (for runs that choose nodes by
    `node_selector`) and the Slurm job that started it, signed with the pool's peer token `token` (each try
    signed anew)."""
    from temporalio.client import WorkflowUpdateFailedError

    healthy = (await asyncio.to_thread(NodeHealth().check)).healthy
    while True:
        try:
            state = await asyncio.wait_for(register_node(client, node, host, healthy, peer_url, labels, token,
                                                         slurm_job),
                                           timeout=30)
            log.info("registered %s in the node pool (cordoned: %s)", node, state.cordoned or "no")
            return
        except WorkflowUpdateFailedError as error:
            log.error("the node pool refused %s's registration, asking again in %.0f s: %s", node,
                      REGISTER_REFUSED_RETRY_S, error.cause or error)
            await asyncio.sleep(REGISTER_REFUSED_RETRY_S)
        except Exception as error:  # noqa: BLE001 - retried until the controller answers
            log.warning("registering %s in the node pool failed, retrying: %s", node, error)
            await asyncio.sleep(REGISTER_RETRY_S)


async def main() -> None:
    parser = argparse.ArgumentParser(description="trainguard node agent")
    parser.add_argument("--node", required=True, help="this node's id (task queue trainguard-node-<id>)")
    parser.add_argument("--workdir", required=True, type=Path, help="node-local directory for ranks and shards")
    parser.add_argument("--host", default="127.0.0.1", help="address peers reach this node's ranks at")
    parser.add_argument("--code-dir", type=Path, default=Path.cwd(),
                        help="default working directory of ranks (default: current directory)")
    parser.add_argument("--allow", action="append", default=[],
                        help="a program, or a directory of programs, ranks may be started with (repeatable; "
                             "'*' allows anything). Also TRAINGUARD_ALLOWED_ENTRYPOINTS, separated by ':'. "
                             "Nothing is allowed by default.")
    parser.add_argument("--allow-env", action="append", default=[], metavar="NAME",
                        help="an env name a run spec may set although it changes what ranks run or load "
                             f"({', '.join(EXEC_ENV_PATTERNS[:4])}, ...: see trainguard.spec.EXEC_ENV_PATTERNS) "
                             "(repeatable). Also TRAINGUARD_ALLOWED_ENV, separated by ','. None by default.")
    parser.add_argument("--peer-port", type=int, default=int(os.environ.get("TRAINGUARD_PEER_PORT", "0")),
                        help="port this agent serves its checkpoint shards to other nodes on (the peer tier; "
                             f"only to requests with the pool's {PEER_TOKEN_ENV}, and only when this agent has "
                             "it); 0 picks a free one, -1 serves none. Also TRAINGUARD_PEER_PORT")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="a label this node registers in the pool with, which runs choose nodes by "
                             f"(`node_selector`), e.g. gpu=h100 (repeatable). Also {NODE_LABELS_ENV}, "
                             "separated by ','. None by default.")
    try:
        chaos_on = env_flag("TRAINGUARD_CHAOS", True)
    except ValueError as error:
        parser.error(str(error))
    parser.add_argument("--no-chaos", action="store_true", default=not chaos_on,
                        help="refuse fault injection (production); also TRAINGUARD_CHAOS=off (any case)")
    parser.add_argument("--run-as", default=os.environ.get(RUN_AS_ENV, ""), metavar="USER",
                        help="the unprivileged user ranks run as (a name or uid; the agent must be root), so they "
                             "cannot read the agent's environment, memory or secrets. Also "
                             f"{RUN_AS_ENV}. Unset, ranks run as the agent's own user.")
    args = parser.parse_args()
    allowed = tuple(args.allow) + tuple(
        p for p in os.environ.get("TRAINGUARD_ALLOWED_ENTRYPOINTS", "").split(os.pathsep) if p)
    if not allowed:
        parser.error("no entrypoint is allowed: pass --allow PROGRAM_OR_DIR (or --allow '*')")
    if not is_node_id(args.node):
        parser.error(f"--node {args.node!r}: lowercase letters, digits and '-', at most 63 characters")
    allowed_env = frozenset(args.allow_env) | frozenset(
        n.strip() for n in os.environ.get("TRAINGUARD_ALLOWED_ENV", "").split(",") if n.strip())
    if bad := sorted(n for n in allowed_env if not ENV_NAME_PATTERN.match(n)):
        parser.error(f"--allow-env {bad[0]!r}: not an environment variable name")
    try:
        labels = parse_labels(args.label or os.environ.get(NODE_LABELS_ENV, ""))
    except ValueError as error:
        parser.error(f"--label: {error}")
    try:
        token = peer_token()
    except ValueError as error:
        parser.error(str(error))
    try:
        run_as = run_as_from(args.run_as)
    except ValueError as error:
        parser.error(str(error))
    setup_logging(f"node-agent[{args.node}]")
    try:
        args.workdir = prepare_workdir(args.workdir, ranks_as_other_user=run_as is not None)
    except UnsafeWorkdir as error:
        parser.error(str(error))
    if run_as is None:
        log.warning("ranks run as this agent's own user (uid %d): they can read its environment and secrets "
                    "(/proc/<agent>/environ); start the agent as root with --run-as USER (%s)", os.geteuid(),
                    RUN_AS_ENV)
    elif problem := run_as_problem(run_as, args.workdir.resolve(), args.code_dir.resolve(), allowed):
        parser.error(problem)
    job = agent_job(os.environ)
    client = await connect()
    # Connected (the client has read Temporal's keys): the secrets leave the environment for memory.
    hold_agent_secrets()
    server = None
    if args.peer_port >= 0 and token is None:
        log.warning("peer tier off on %s: no %s in the environment (give every agent of the pool the same one)",
                    args.node, PEER_TOKEN_ENV)
    elif args.peer_port >= 0 and token is not None:
        server = ShardServer(args.workdir, args.host, token, args.peer_port).start()
    worker, ranks = build_worker(client, args.node, args.workdir.resolve(), args.host, args.code_dir.resolve(),
                                 allowed=allowed, chaos=not args.no_chaos, peer_tier=server is not None,
                                 allowed_env=allowed_env, run_as=run_as, slurm_job=job, token=token)
    stop = stop_event()
    log.info("node agent %s polling %s%s", args.node, node_task_queue(args.node),
             f" (ranks run as {run_as.name}, uid {run_as.uid})" if run_as else "")
    try:
        async with worker:
            registration = asyncio.create_task(
                register_until_done(client, args.node, args.host, server.url if server else "", labels, token,
                                    job))
            fencing = asyncio.create_task(fence_orphans(client, ranks))
            await stop.wait()
            registration.cancel()
            fencing.cancel()
    finally:
        stopped = await ranks.stop_all(grace_s=2.0)
        if server is not None:
            server.stop()
        log.info("node agent %s stopped (%d ranks stopped)", args.node, stopped)


if __name__ == "__main__":
    asyncio.run(main())
