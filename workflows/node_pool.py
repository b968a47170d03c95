"""`NodePool`: the long-lived node inventory that every run leases its nodes from.

Node agents register with it when they start; runs acquire their nodes (and spares) from it and release
them when they end, so two concurrent runs never get the same node; a cordon recorded here persists across
runs until an operator lifts it or the node's agent comes back healthy (a repaired node); a drained node
leaves after its current run. One instance per namespace, workflow id `trainguard-node-pool`.

The rules are pure functions of the pool state (`grant`, `release`, ...), table-tested without a server.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from trainguard.models import (
        AcquireNodesRequest,
        AcquireNodesResult,
        NodeRequest,
        PoolNode,
        PoolStatus,
        RegisterNodeRequest,
    )

POOL_WORKFLOW_ID = "trainguard-node-pool"
POOL_WORKFLOW_TYPE = "NodePool"
# Each request adds a handful of events; continue as new long before Temporal's limits.
POOL_HISTORY_EVENTS = 5_000

# ---------------------------------------------------------------------------------------- pure rules


def register(nodes: dict[str, PoolNode], request: RegisterNodeRequest, now: float) -> None:
    """An agent (re)started. A cordoned node whose agent comes back healthy is repaired: schedulable again."""
    current = nodes.get(request.node) or PoolNode(node=request.node)
    current.host, current.registered_at, current.healthy = request.host, now, request.healthy
    if current.cordoned is not None and request.healthy and current.leased_to is None:
        current.cordoned = current.cordoned_at = None
    if not request.healthy and current.cordoned is None:
        current.cordoned, current.cordoned_at = "GPU checks failed at registration", now
    current.draining = False
    nodes[request.node] = current


def grant(nodes: dict[str, PoolNode], request: AcquireNodesRequest) -> AcquireNodesResult:
    """All of the run's nodes or none; spares that are free come along. Idempotent for the same run."""
    cordoned = {n: nodes[n].cordoned or "" for n in request.nodes if n in nodes and nodes[n].cordoned}
    cordoned.update({n: "draining" for n in request.nodes if n in nodes and nodes[n].draining})
    busy = {n: nodes[n].leased_to or "" for n in request.nodes
            if n in nodes and nodes[n].leased_to not in (None, request.run_id)}
    unregistered = [n for n in request.nodes if n not in nodes]
    if cordoned or busy or unregistered:
        return AcquireNodesResult(granted=False, cordoned=cordoned, busy=busy, unregistered=unregistered)
    spares = [n for n in request.spares if n in nodes and not nodes[n].cordoned and not nodes[n].draining
              and nodes[n].leased_to in (None, request.run_id)]
    for node in [*request.nodes, *spares]:
        nodes[node].leased_to = request.run_id
    return AcquireNodesResult(granted=True, spares=spares)


def release(nodes: dict[str, PoolNode], run_id: str, node: str | None = None) -> list[str]:
    """Free the run's nodes (or one of them); draining nodes leave the pool. Returns the nodes freed."""
    freed = [n for n, state in nodes.items() if state.leased_to == run_id and node in (None, n)]
    for name in freed:
        nodes[name].leased_to = None
        if nodes[name].draining:
            del nodes[name]
    return freed


def cordon(nodes: dict[str, PoolNode], node: str, reason: str, now: float) -> None:
    state = nodes.setdefault(node, PoolNode(node=node))
    state.cordoned, state.cordoned_at = reason or "cordoned", now


def uncordon(nodes: dict[str, PoolNode], node: str) -> None:
    if node not in nodes:
        raise ValueError(f"node {node!r} is not in the pool")
    nodes[node].cordoned = nodes[node].cordoned_at = None


def drain(nodes: dict[str, PoolNode], node: str) -> None:
    """No new leases; the node leaves when its current run releases it (at once if it is free)."""
    if node not in nodes:
        raise ValueError(f"node {node!r} is not in the pool")
    if nodes[node].leased_to is None:
        del nodes[node]
    else:
        nodes[node].draining = True


# ------------------------------------------------------------------------------------------- workflow


@workflow.defn(name=POOL_WORKFLOW_TYPE)
class NodePool:
    def __init__(self) -> None:
        self._nodes: dict[str, PoolNode] = {}

    @workflow.run
    async def run(self, carried: PoolStatus | None = None) -> None:
        for node in (carried.nodes if carried else []):
            self._nodes[node.node] = node
        await workflow.wait_condition(
            lambda: workflow.info().get_current_history_length() > POOL_HISTORY_EVENTS
            or workflow.info().is_continue_as_new_suggested()
        )
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(PoolStatus(nodes=list(self._nodes.values())))

    def _now(self) -> float:
        return workflow.now().timestamp()

    @workflow.query
    def nodes(self) -> PoolStatus:
        return PoolStatus(nodes=sorted(self._nodes.values(), key=lambda n: n.node))

    @workflow.update
    def register(self, request: RegisterNodeRequest) -> PoolNode:
        register(self._nodes, request, self._now())
        return self._nodes[request.node]

    @workflow.update
    def acquire(self, request: AcquireNodesRequest) -> AcquireNodesResult:
        return grant(self._nodes, request)

    @workflow.update
    def release(self, request: NodeRequest) -> list[str]:
        return release(self._nodes, request.run_id or "", request.node)

    @release.validator
    def _validate_release(self, request: NodeRequest) -> None:
        if not request.run_id:
            raise ValueError("release needs run_id")

    @workflow.update
    def cordon(self, request: NodeRequest) -> PoolNode:
        assert request.node is not None
        cordon(self._nodes, request.node, request.reason, self._now())
        if request.run_id is not None:
            release(self._nodes, request.run_id, request.node)
        return self._nodes[request.node]

    @workflow.update
    def uncordon(self, request: NodeRequest) -> PoolNode:
        assert request.node is not None
        uncordon(self._nodes, request.node)
        return self._nodes[request.node]

    @workflow.update
    def drain(self, request: NodeRequest) -> PoolStatus:
        assert request.node is not None
        drain(self._nodes, request.node)
        return self.nodes()

    @cordon.validator
    def _validate_cordon(self, request: NodeRequest) -> None:
        if not request.node:
            raise ValueError("cordon needs node")

    @uncordon.validator
    def _validate_uncordon(self, request: NodeRequest) -> None:
        self._validate_known(request)

    @drain.validator
    def _validate_drain(self, request: NodeRequest) -> None:
        self._validate_known(request)

    def _validate_known(self, request: NodeRequest) -> None:
        if not request.node or request.node not in self._nodes:
            raise ValueError(f"node {request.node!r} is not in the pool (nodes: {', '.join(sorted(self._nodes))})")
