"""The node pool's rules, pure functions of its state (`NodePool` in workflows/node_pool.py applies them).

Who may register and how a registration changes a node (a healthy one lifts a cordon a run or a failed GPU check
set, never an operator's), which nodes a run is granted (named nodes, or a count by label selector, never a node
another run holds), and how release, cordon, uncordon and drain change a node. No I/O and no clock: times are
arguments, and tests/unit/test_node_pool.py and test_pool_registration.py table them.
"""

from __future__ import annotations

import ipaddress
import re

from trainguard.models import AcquireNodesRequest, AcquireNodesResult, PoolNode, RegisterNodeRequest
from trainguard.pool import PROOF_PATTERN, peer_url_of
from trainguard.spec import LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN, MAX_NODE_LABELS, RunSpec, is_node_id, selector_text


UNHEALTHY_AT_REGISTRATION = "GPU checks failed at registration"
MAX_HOST_CHARS = 253
"""A DNS name's longest."""
HOST_NAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*")


def operator_cordon(state: PoolNode) -> bool:
    """Whether the node's cordon is an operator's: not a run's (`cordoned_by` names it) and not the pool's own
    for GPU checks that failed at registration. Only an operator lifts it (`trainguard nodes uncordon`)."""
    return state.cordoned is not None and state.cordoned_by is None and state.cordoned != UNHEALTHY_AT_REGISTRATION


def register(nodes: dict[str, PoolNode], request: RegisterNodeRequest, now: float,
             keep_operator_cordon: bool = True) -> None:
    """An agent (re)started. A cordoned node whose agent comes back healthy is repaired: schedulable again,
    unless an operator cordoned it (`keep_operator_cordon`; False only replaying histories before it)."""
    current = nodes.get(request.node) or PoolNode(node=request.node)
    current.host, current.registered_at, current.healthy = request.host, now, request.healthy
    current.peer_url = request.peer_url
    current.labels = dict(request.labels)
    current.slurm_job = request.slurm_job
    current.signed_at_ms = max(current.signed_at_ms, request.signed_at_ms)
    if current.cordoned is not None and request.healthy and current.leased_to is None \
            and not (keep_operator_cordon and operator_cordon(current)):
        current.cordoned = current.cordoned_at = current.cordoned_by = None
    if not request.healthy and current.cordoned is None:
        current.cordoned, current.cordoned_at = UNHEALTHY_AT_REGISTRATION, now
    current.draining = False
    nodes[request.node] = current


def host_problem(host: str) -> str:
    """Why `host` is not an address a peer can reach the node at (an IP address or a DNS name); empty if it is."""
    if len(host) > MAX_HOST_CHARS:
        return f"host has {len(host)} characters, more than {MAX_HOST_CHARS}"
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        pass
    return "" if HOST_NAME.fullmatch(host) else f"host {host!r} is neither an IP address nor a DNS name"


def registration_problem(request: RegisterNodeRequest, current: PoolNode | None) -> str:
    """Why the pool refuses `request` (empty when it takes it): a malformed node id, host, peer address or label,
    a peer address on another host than the node's own (it once pointed a node's peers, and the pool's token
    they send, at a listener), or a signed registration no newer than the node's last (a replayed one)."""
    if not is_node_id(request.node):
        return f"node {request.node[:80]!r}: lowercase letters, digits and '-', at most 63 characters"
    if request.host and (problem := host_problem(request.host)):
        return problem
    if request.peer_url:
        port = request.peer_url.rpartition(":")[2]
        if not request.host or not port.isdigit() or not 0 < int(port) < 65536 \
                or request.peer_url != peer_url_of(request.host, int(port)):
            return (f"peer_url {request.peer_url[:300]!r}: must be http://HOST:PORT on the node's own host "
                    f"{request.host!r}")
    if len(request.labels) > MAX_NODE_LABELS:
        return f"{len(request.labels)} labels, more than {MAX_NODE_LABELS}"
    for key, value in request.labels.items():
        if not re.fullmatch(LABEL_KEY_PATTERN, key) or not re.fullmatch(LABEL_VALUE_PATTERN, value):
            return f"label {key[:80]!r}={value[:80]!r}: at most 63 of letters, digits, '-', '_', '.' ('/' in keys)"
    if request.proof and not PROOF_PATTERN.fullmatch(request.proof):
        return "proof: not an HMAC-SHA256 in hex"
    if request.signed_at_ms < 0 or (request.proof == "") != (request.signed_at_ms == 0):
        return "signed_at_ms and proof: both or neither"
    if current is not None and request.signed_at_ms and request.signed_at_ms <= current.signed_at_ms:
        return (f"signed at {request.signed_at_ms} ms, not after the node's latest registration "
                f"({current.signed_at_ms} ms): a replayed registration")
    return ""


BUSY_SHOWN = 10
"""Busy nodes a count request that must wait names (of thousands): enough to say whose runs it waits for."""


def node_order(name: str) -> tuple[object, ...]:
    """Natural order, so a count takes node-2 before node-10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def matches(node: PoolNode, selector: dict[str, str]) -> bool:
    return all(node.labels.get(key) == value for key, value in selector.items())


def _schedulable(state: PoolNode) -> bool:
    return state.cordoned is None and not state.draining


def choose(nodes: dict[str, PoolNode], run_id: str, count: int, selector: dict[str, str],
           exclude: set[str]) -> list[str]:
    """Up to `count` free, schedulable nodes carrying `selector`'s labels, outside `exclude`: those the run
    already holds first (so a retried lease chooses the same), then in natural order."""
    free = [n for n, state in nodes.items() if n not in exclude and _schedulable(state) and matches(state, selector)
            and state.leased_to in (None, run_id)]
    free.sort(key=lambda n: (nodes[n].leased_to != run_id, node_order(n)))
    return free[:count]


def shortfall(nodes: dict[str, PoolNode], request: AcquireNodesRequest) -> str:
    """Why `num_nodes` can never be granted as the pool stands (empty when waiting for other runs can help)."""
    which = f" matching node_selector {selector_text(request.selector)}" if request.selector else ""
    matching = [n for n, state in nodes.items() if matches(state, request.selector) and n not in request.exclude]
    if not matching:
        seen = sorted({f"{k}={v}" for state in nodes.values() for k, v in state.labels.items()})
        labels = f"; labels in the pool: {', '.join(seen)}" if seen else "; no node has labels"
        return (f"num_nodes {request.num_nodes}: no node in the pool{which} ({len(nodes)} nodes"
                f"{labels if request.selector else ''})")
    usable = [n for n in matching if _schedulable(nodes[n])]
    if len(usable) >= request.num_nodes:
        return ""
    out = sorted((n for n in matching if not _schedulable(nodes[n])), key=node_order)
    return (f"num_nodes {request.num_nodes}: the pool has {len(usable)} schedulable node"
            f"{'' if len(usable) == 1 else 's'}{which} "
            f"({len(matching)} in all" + (f"; cordoned or draining: {', '.join(out)}" if out else "") + ")")


def grant(nodes: dict[str, PoolNode], request: AcquireNodesRequest) -> AcquireNodesResult:
    """All of the run's nodes or none; spares that are free come along. Idempotent for the same run.

    Nodes are named (`nodes`) or counted (`num_nodes`, chosen by `choose`); so are spares (`spares`, plus up
    to `num_spares` chosen). With `replace_cordoned`, a named node that is cordoned or draining is replaced by
    a granted spare, when there are enough."""
    for node in request.exclude:
        if node in nodes and nodes[node].leased_to == request.run_id:
            nodes[node].leased_to = None
    if request.num_nodes:
        return _grant_count(nodes, request)
    cordoned = {n: nodes[n].cordoned or "" for n in request.nodes if n in nodes and nodes[n].cordoned}
    cordoned.update({n: "draining" for n in request.nodes if n in nodes and nodes[n].draining})
    busy = {n: nodes[n].leased_to or "" for n in request.nodes
            if n in nodes and nodes[n].leased_to not in (None, request.run_id)}
    unregistered = [n for n in request.nodes if n not in nodes]
    if busy or unregistered or (cordoned and not request.replace_cordoned):
        return AcquireNodesResult(granted=False, cordoned=cordoned, busy=busy, unregistered=unregistered)
    spares = [n for n in request.spares if n in nodes and _schedulable(nodes[n])
              and nodes[n].leased_to in (None, request.run_id)]
    if request.num_spares:
        taken = {*request.nodes, *request.spares, *request.exclude}
        spares += choose(nodes, request.run_id, request.num_spares, request.selector, taken)
    if len(cordoned) > len(spares):
        return AcquireNodesResult(granted=False, cordoned=cordoned)
    replaced = {n: spares.pop(0) for n in request.nodes if n in cordoned}
    for node in cordoned:
        if nodes[node].leased_to == request.run_id:  # leased when it was not cordoned yet: given back
            nodes[node].leased_to = None
    chosen = [replaced.get(n, n) for n in request.nodes]
    for node in [*chosen, *spares]:
        nodes[node].leased_to = request.run_id
    return AcquireNodesResult(granted=True, spares=spares, nodes=chosen, replaced=replaced)


def pool_request(spec: RunSpec, named: AcquireNodesRequest) -> AcquireNodesRequest:
    """`named` (the spec's named nodes and spares) with what the spec asks the pool to choose by count and
    label, and a spare for any named node found cordoned."""
    return named.model_copy(update={"num_nodes": spec.num_nodes or 0, "num_spares": spec.num_spares,
                                    "selector": dict(spec.node_selector), "replace_cordoned": True})


def _grant_count(nodes: dict[str, PoolNode], request: AcquireNodesRequest) -> AcquireNodesResult:
    if problem := shortfall(nodes, request):
        return AcquireNodesResult(granted=False, unsatisfiable=problem)
    exclude = set(request.exclude)
    chosen = choose(nodes, request.run_id, request.num_nodes + request.num_spares, request.selector, exclude)
    if len(chosen) < request.num_nodes:
        busy = [n for n in sorted(nodes, key=node_order) if n not in exclude and _schedulable(nodes[n])
                and matches(nodes[n], request.selector) and nodes[n].leased_to not in (None, request.run_id)]
        return AcquireNodesResult(granted=False, busy={n: nodes[n].leased_to or "" for n in busy[:BUSY_SHOWN]})
    picked, spares = chosen[:request.num_nodes], chosen[request.num_nodes:]
    picked.sort(key=node_order)
    for node in chosen:
        nodes[node].leased_to = request.run_id
    return AcquireNodesResult(granted=True, nodes=picked, spares=spares)


def release(nodes: dict[str, PoolNode], run_id: str, node: str | None = None) -> list[str]:
    """Free the run's nodes (or one of them); draining nodes leave the pool. Returns the nodes freed."""
    freed = [n for n, state in nodes.items() if state.leased_to == run_id and node in (None, n)]
    for name in freed:
        nodes[name].leased_to = None
        if nodes[name].draining:
            del nodes[name]
    return freed


def cordon(nodes: dict[str, PoolNode], node: str, reason: str, now: float, lost_since: float | None = None,
           by: str | None = None) -> bool:
    """Keep `node` out of leases with `reason`; True when the cordon stands. A run's cordon for a node it
    lost (`lost_since`: when it last heard from it) does not stand if the node's agent has registered, healthy,
    since then: the node came back before the run noticed it gone, and a stale heartbeat timeout must not keep
    it out of every later run."""
    state = nodes.setdefault(node, PoolNode(node=node))
    if lost_since is not None and state.healthy and state.registered_at > lost_since:
        return False
    state.cordoned, state.cordoned_at, state.cordoned_by = reason or "cordoned", now, by
    return True


def uncordon(nodes: dict[str, PoolNode], node: str) -> None:
    if node not in nodes:
        raise ValueError(f"node {node!r} is not in the pool")
    nodes[node].cordoned = nodes[node].cordoned_at = nodes[node].cordoned_by = None


def drain(nodes: dict[str, PoolNode], node: str) -> None:
    """No new leases; the node leaves when its current run releases it (at once if it is free)."""
    if node not in nodes:
        raise ValueError(f"node {node!r} is not in the pool")
    if nodes[node].leased_to is None:
        del nodes[node]
    else:
        nodes[node].draining = True


# ------------------------------------------------------------------------------------------- workflow
