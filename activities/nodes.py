"""Controller-side activities about the node inventory."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from temporalio import activity
from temporalio.client import Client

from activities import names
from activities.models import FindNodeAgentsInput, FindNodeAgentsResult
from activities.scheduler import SCHEDULER_ENV
from trainguard.models import (AcquireManyRequest, AcquireManyResult, AcquireNodesRequest, AcquireNodesResult,
                               AgentsBackInput, AgentsBackResult, NodeRequest, PoolNode, RegisterNodeRequest,
                               RegistrationVerdict, ReleaseManyRequest, ReleaseManyResult)
from trainguard.pool import (  # noqa: F401 - the pool client helpers live in the public package; re-exported
    AGENT_LOOKUPS_IN_FLIGHT,
    check_registration,
    POOL_BUSY_FIRST_RETRY_S,
    POOL_BUSY_MAX_RETRY_S,
    has_pollers,
    missing_agents,
    peer_urls,
    pool_handle,
    pool_nodes,
    pool_update,
    register_node,
)
from trainguard.search_attributes import registered
from trainguard.settings import FLAG_TRUE


AGENT_RETURN_WAIT_S = 60.0
"""How long `find_node_agents` waits for nodes registered in the pool whose agents do not poll right now: a
restarting agent is back within seconds, and after a Temporal restart no agent shows as polling until it polls
again. A run starting then must not fail its spec over a node it knows. A node the pool has never seen is
reported at once: a misspelt node fails its spec without the wait."""
AGENT_RETURN_POLL_S = 2.0


DEV_SLURM_ENV = "TRAINGUARD_DEV_SLURM"
"""Set for the controller of a dev stack in Slurm mode (`trainguard dev up --slurm`), which starts no agents."""


def no_agent_hint(environ: Mapping[str, str]) -> str | None:
    """What a run whose nodes have no agent is told beyond that, from the controller's environment: where agents
    come from when the stack or the cluster does not start them itself. None when nothing is known."""
    if environ.get(DEV_SLURM_ENV, "").strip().lower() in FLAG_TRUE:
        return ("the dev stack is in Slurm mode (`trainguard dev up --slurm`), which starts no node agents: Slurm "
                "jobs do, on the nodes they are given (`sbatch examples/slurm/train.sbatch` starts the agents and "
                "its run). To run this spec on agents the stack starts itself: `trainguard dev down`, then "
                "`trainguard dev up` without --slurm")
    if environ.get(SCHEDULER_ENV, "").strip().lower() == "slurm":
        return ("the controller runs with TRAINGUARD_SCHEDULER=slurm, where node agents come from Slurm jobs: run "
                "on the nodes of a job that started agents on them (`sbatch examples/slurm/train.sbatch` does both)")
    return None


class NodeActivities:
    def __init__(self, client: Client, environ: Mapping[str, str] | None = None) -> None:
        self.client = client
        self.no_agent_hint = no_agent_hint(os.environ if environ is None else environ)

    @activity.defn(name=names.FIND_NODE_AGENTS)
    async def find_node_agents(self, request: FindNodeAgentsInput) -> FindNodeAgentsResult:
        """Which of the nodes have no agent polling their queue (as the server saw it recently), once the
        registered ones among them had `AGENT_RETURN_WAIT_S` to come back."""
        missing = await missing_agents(self.client, request.nodes, request.max_idle_s)
        known = {n.node for n in await pool_nodes(self.client)} if missing else set()
        waiting = [node for node in missing if node in known]
        deadline = time.monotonic() + AGENT_RETURN_WAIT_S
        while waiting and time.monotonic() < deadline:
            activity.heartbeat()
            await asyncio.sleep(AGENT_RETURN_POLL_S)
            back = set(waiting) - set(await missing_agents(self.client, waiting, request.max_idle_s))
            missing = [node for node in missing if node not in back]
            waiting = [node for node in waiting if node not in back]
        return FindNodeAgentsResult(missing=missing, search_attributes=await registered(self.client),
                                    no_agent_hint=self.no_agent_hint if missing else None)

    @activity.defn(name=names.FIND_AGENTS_BACK)
    async def find_agents_back(self, request: AgentsBackInput) -> AgentsBackResult:
        """Which nodes' agents have not come back since `since`: a restarted agent registers in the pool at
        start, healthy and uncordoned (a poller alone says nothing: the server remembers an agent's polls for a
        minute after it left). An agent another Slurm job started is not this run's node come back."""
        pool = {n.node: n for n in await pool_nodes(self.client)}
        return AgentsBackResult(away=[node for node in request.nodes if (found := pool.get(node)) is None
                                      or found.registered_at < request.since or not found.healthy
                                      or found.cordoned is not None
                                      or request.slurm_job not in (None, found.slurm_job)])


# ------------------------------------------------------------------------------------------- node pool


class RegistrationActivities:
    """The controller's check of a registration's proof, for the pool workflow (which cannot read a secret)."""

    def __init__(self, token: str | None, clock: Callable[[], float] = time.time) -> None:
        self.token, self.clock = token, clock
        """The pool's peer token as the controller read it at start (`TRAINGUARD_PEER_TOKEN`); None: none."""

    @activity.defn(name=names.VERIFY_REGISTRATION)
    async def verify_registration(self, request: RegisterNodeRequest) -> RegistrationVerdict:
        """Whether the agent that sent `request` holds the pool's token (and signed it lately). A local activity
        of the pool: the verdict enters its history, the token never does."""
        verdict = check_registration(request, self.token, self.clock())
        if not verdict.accepted:
            activity.logger.warning("registration of %s (host %s) refused: %s", request.node, request.host,
                                    verdict.why)
        return verdict


POOL_BATCH_MAX_NODES = 16_384
"""Node names one batched update carries at most: about 200 KB of JSON, under Temporal's 256 KB payload
warning (a 4,096-node lease and its spares fit four times)."""


class PoolBatcher:
    """Leases (or releases) asked while one is on its way to the pool go together in the next update (a group
    commit): 100 runs starting at once cost a few updates instead of 100 queued behind Temporal's 10 updates in
    flight per execution, and a few events in the pool's history instead of hundreds. One update of a kind is in
    flight at a time per controller process; a lone request goes as the single update it always was."""

    def __init__(self, client: Client, single: str, many: str, wrap: Callable[[list[Any]], Any],
                 many_type: type[Any], unwrap: Callable[[Any], list[Any]], single_type: type[Any]) -> None:
        self.client, self.single, self.many = client, single, many
        self.wrap, self.many_type, self.unwrap, self.single_type = wrap, many_type, unwrap, single_type
        self.waiting: list[tuple[Any, asyncio.Future[Any]]] = []
        self.flushing: asyncio.Task[None] | None = None

    async def submit(self, request: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting.append((request, future))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.create_task(self._flush())
        return await future

    def _take(self) -> list[tuple[Any, asyncio.Future[Any]]]:
        batch: list[tuple[Any, asyncio.Future[Any]]] = []
        names = 0
        while self.waiting and (not batch or names + _names(self.waiting[0][0]) <= POOL_BATCH_MAX_NODES):
            names += _names(self.waiting[0][0])
            batch.append(self.waiting.pop(0))
        return batch

    async def _flush(self) -> None:
        while self.waiting:
            batch = [(r, f) for r, f in self._take() if not f.done()]  # a cancelled activity's request is dropped
            if not batch:
                continue
            try:
                results = await self._send([r for r, _ in batch])
            except Exception as error:  # noqa: BLE001 - every waiting activity gets it, and retries as before
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)

    async def _send(self, requests: list[Any]) -> list[Any]:
        from temporalio.client import WorkflowUpdateFailedError

        if len(requests) > 1:
            try:
                return self.unwrap(await pool_update(self.client, self.many, self.wrap(requests), self.many_type))
            except WorkflowUpdateFailedError as error:  # a pool still on a build without batches: one by one
                activity.logger.info("batched %s refused (%s): one by one", self.many, error.cause or error)
        return [await pool_update(self.client, self.single, r, self.single_type) for r in requests]


def _names(request: Any) -> int:
    return len(getattr(request, "nodes", ()) or ()) + len(getattr(request, "spares", ()) or ()) + 1


CHOSEN_AGENT_CHECKS = 3
"""Leases by count asked again without the chosen nodes no agent polls: the pool remembers every node that
ever registered, and one whose agent is gone (a smaller dev stack, a retired machine) must not be chosen. Each
retry excludes every silent node found so far, so a few suffice; what is still silent then fails its check."""


async def acquire_live_nodes(client: Client, request: AcquireNodesRequest,
                             lease_of: Callable[[AcquireNodesRequest], Awaitable[AcquireNodesResult]] | None = None,
                             ) -> AcquireNodesResult:
    """The pool's lease (through `lease_of`, default a single update); nodes it chose by count whose agent does
    not poll are excluded and the lease asked again (the pool gives the run's lease on them back)."""
    lease_of = lease_of or (lambda r: pool_update(client, "acquire", r, AcquireNodesResult))
    for _ in range(CHOSEN_AGENT_CHECKS):
        lease = await lease_of(request)
        named = {*request.nodes, *request.spares}
        chosen = [n for n in [*lease.nodes, *lease.spares] if n not in named]
        if not lease.granted or not chosen or not (silent := await missing_agents(client, chosen)):
            return lease
        activity.logger.info("no agent polls %s: leasing others", ", ".join(silent))
        request = request.model_copy(update={"exclude": [*request.exclude, *silent]})
    return lease


# ---------------------------------------------------------------------------------- closed runs' leases


RECLAIM_AFTER_CLOSED_S = 45.0
"""A closed run's nodes are taken back this long after it closed, not at once: its ranks may still run until
each agent fences them (`workers.node_agent`: ranks no watch looked at for `ORPHAN_IDLE_S` (30 s), checked every
`ORPHAN_CHECK_INTERVAL_S` (5 s)), and a run launched beside them would share their GPUs."""
RECLAIM_RECHECK_S = 30.0
"""A lessee found running (or closed too recently) is described again no sooner than this: a run waiting for
its nodes asks the pool every 2 s, and each ask must not cost a describe per lessee."""
RECLAIM_RUNS_PER_LEASE = 16
"""Lessees one lease describes at most: a count request names at most `BUSY_SHOWN` (10) busy nodes' runs, a
named one every busy node's; more are described on the run's next ask."""
RECLAIM_DESCRIBE_TIMEOUT_S = 10.0
"""One describe; a lessee Temporal does not answer for is kept (an outage must not take a live run's nodes)."""


def lessees_to_check(busy: Iterable[str], run_id: str, checked: dict[str, float], now: float) -> list[str]:
    """The runs holding nodes a lease wanted that are due a look (`RECLAIM_RECHECK_S` since the last), in
    order, at most `RECLAIM_RUNS_PER_LEASE`; never the asking run."""
    due = [r for r in dict.fromkeys(busy) if r and r != run_id and now - checked.get(r, -RECLAIM_RECHECK_S)
           >= RECLAIM_RECHECK_S]
    return due[:RECLAIM_RUNS_PER_LEASE]


def reclaimable(running: bool, closed_at: float | None, now: float) -> bool:
    """Whether a lessee's nodes go back to the pool: its workflow is closed (terminated, failed, cancelled,
    timed out, completed without releasing), or gone from Temporal (`closed_at` None: past retention), for
    at least `RECLAIM_AFTER_CLOSED_S`."""
    return not running and (closed_at is None or now - closed_at >= RECLAIM_AFTER_CLOSED_S)


class LeaseReclaimer:
    """Frees the leases of closed runs that a lease finds in its way. A run that ends releases its nodes; a run
    terminated (`temporal workflow terminate`, a parent's close policy) never does, and its nodes stayed leased
    forever. Bounded (a few describes per lease, each lessee at most every `RECLAIM_RECHECK_S`) and idempotent
    (a release of a run holding nothing frees nothing)."""

    def __init__(self, client: Client, release: Callable[[NodeRequest], Awaitable[list[str]]],
                 clock: Callable[[], float] = time.time) -> None:
        self.client, self.release, self.clock = client, release, clock
        self.checked: dict[str, float] = {}

    async def reclaim(self, lease: AcquireNodesResult, run_id: str) -> list[str]:
        """Free the nodes of the closed runs among `lease.busy`'s lessees; returns the nodes freed."""
        now = self.clock()
        due = lessees_to_check(lease.busy.values(), run_id, self.checked, now)
        freed: list[str] = []
        for lessee, (running, closed_at) in zip(due, await asyncio.gather(*(self._state(r) for r in due))):
            self.checked[lessee] = now
            if running is None or not reclaimable(running, closed_at, now):
                continue
            nodes = await self.release(NodeRequest(run_id=lessee))
            activity.logger.warning("run %s is closed and still held %s: given back to the pool",
                                    lessee, ", ".join(nodes) or "nothing")
            freed += nodes
        if len(self.checked) > 16 * RECLAIM_RUNS_PER_LEASE:  # forget old looks: a long-lived controller
            self.checked = {r: t for r, t in self.checked.items() if now - t < RECLAIM_RECHECK_S}
        return freed

    async def _state(self, lessee: str) -> tuple[bool | None, float | None]:
        """(running, close time) of the lessee's latest execution; (None, None) when Temporal did not say."""
        from temporalio.client import WorkflowExecutionStatus
        from temporalio.service import RPCError, RPCStatusCode

        try:
            described = await asyncio.wait_for(self.client.get_workflow_handle(lessee).describe(),
                                               RECLAIM_DESCRIBE_TIMEOUT_S)
        except RPCError as error:
            return (False, None) if error.status is RPCStatusCode.NOT_FOUND else (None, None)
        except TimeoutError:
            return None, None
        open_ = described.status in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW)
        return open_, described.close_time.timestamp() if described.close_time else None


class PoolActivities:
    """Controller-side activities a run uses to lease, release and cordon nodes in the pool."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.leases = PoolBatcher(client, "acquire", "acquire_many", lambda rs: AcquireManyRequest(requests=rs),
                                  AcquireManyResult, lambda r: r.results, AcquireNodesResult)
        self.releases = PoolBatcher(client, "release", "release_many", lambda rs: ReleaseManyRequest(requests=rs),
                                    ReleaseManyResult, lambda r: r.results, list[str])
        self.reclaimer = LeaseReclaimer(client, self.releases.submit)

    @activity.defn(name=names.ACQUIRE_NODES)
    async def acquire_nodes(self, request: AcquireNodesRequest) -> AcquireNodesResult:
        """Lease the run's nodes (all or none) and whichever of its spares are free. Idempotent per run. Nodes
        in the way that closed runs still hold are given back first (`LeaseReclaimer`), and the lease asked
        again."""
        lease = await self._lease(request)
        if not lease.granted and lease.busy and await self.reclaimer.reclaim(lease, request.run_id):
            lease = await self._lease(request)
        return lease

    async def _lease(self, request: AcquireNodesRequest) -> AcquireNodesResult:
        if request.num_nodes or request.num_spares:
            return await acquire_live_nodes(self.client, request, self.leases.submit)
        return await self.leases.submit(request)

    @activity.defn(name=names.RELEASE_NODES)
    async def release_nodes(self, request: NodeRequest) -> list[str]:
        """Give the run's nodes (or one of them) back to the pool. Idempotent."""
        return await self.releases.submit(request)

    @activity.defn(name=names.CORDON_NODE)
    async def cordon_node(self, request: NodeRequest) -> PoolNode:
        """Take a failed node out of the pool (and out of the run's lease) until it is repaired."""
        return await pool_update(self.client, "cordon", request, PoolNode)
