"""What `infra/slurm/trainguard.sbatch` needs from Python: the run spec for the allocation, and a wait until
every allocated node's agent is up.

    python infra/slurm/slurm_job.py spec --template T --output F [--spares N] [--ranks-per-node R] \
        [--entrypoint-json '["python", "train.py"]'] NODE... [-- ENTRYPOINT...]
    python infra/slurm/slurm_job.py wait-agents --since UNIX_TIME [--timeout-s 300] NODE...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.models import PoolNode
from trainguard.spec import RunSpec, SpecError, parse_spec

POLL_INTERVAL_S = 2.0
"""How often the wait asks Temporal again: agents take seconds to start (Python imports, NVML)."""

CLOCK_SLACK_S = 5.0
"""Registrations are stamped with the workflow clock; allow this much skew against the batch host's."""


def build_spec(template: dict[str, Any], hosts: Sequence[str], num_spares: int = 0,
               entrypoint: Sequence[str] | None = None, ranks_per_node: int | None = None) -> RunSpec:
    """The template with the allocation's nodes (the last `num_spares` held back as spares) and the
    entrypoint filled in. Node ids are the Slurm node names, lowercased, as the agents name themselves."""
    nodes = [host.strip().lower() for host in hosts if host.strip()]
    if not nodes:
        raise SpecError("no nodes: the allocation's node list is empty")
    if not 0 <= num_spares < len(nodes):
        raise SpecError(f"spares: {num_spares} spares leave no node to train on ({len(nodes)} nodes allocated)")
    spec = dict(template)
    spec["nodes"] = nodes[: len(nodes) - num_spares]
    spec["spare_nodes"] = nodes[len(nodes) - num_spares:]
    if entrypoint:
        spec["entrypoint"] = list(entrypoint)
    if ranks_per_node is not None:
        spec["ranks_per_node"] = ranks_per_node
    if "entrypoint" not in spec:
        raise SpecError("entrypoint: give it as arguments, TRAINGUARD_ENTRYPOINT or in the template")
    return parse_spec(spec)


def not_ready(nodes: Sequence[str], pool: Sequence[PoolNode], missing: Sequence[str], since: float) -> list[str]:
    """Nodes whose agent has not both polled its task queue and registered in the pool since `since`.

    Either alone could be left over from an earlier job on the same node: a poller is remembered for about
    a minute, a registration for ever."""
    registered = {entry.node: entry.registered_at for entry in pool}
    return [node for node in nodes
            if node in missing or registered.get(node, 0.0) < since - CLOCK_SLACK_S]


async def wait_agents(nodes: Sequence[str], since: float, timeout_s: float) -> list[str]:
    """Wait until every node's agent is up; returns the nodes still missing when `timeout_s` runs out."""
    from activities.nodes import missing_agents, pool_nodes
    from trainguard.connect import connect

    client = await connect()
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        waiting = not_ready(nodes, await pool_nodes(client), await missing_agents(client, list(nodes)), since)
        if not waiting or time.monotonic() >= deadline:
            return waiting
        line = f"waiting for node agents: {', '.join(waiting)}"
        if line != last:
            print(line, file=sys.stderr, flush=True)
            last = line
        await asyncio.sleep(POLL_INTERVAL_S)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    spec = sub.add_parser("spec", help="write the run spec for the allocation's nodes")
    spec.add_argument("--template", type=Path, required=True, help="spec JSON without nodes (and entrypoint)")
    spec.add_argument("--output", type=Path, required=True)
    spec.add_argument("--spares", type=int, default=0, help="allocated nodes held back as spares (the last N)")
    spec.add_argument("--ranks-per-node", type=int, help="overrides the template's ranks_per_node")
    spec.add_argument("--entrypoint-json", help="the entrypoint as a JSON list (when no `-- ARGV` is given)")
    spec.add_argument("nodes", nargs="+", help="allocated hosts (`scontrol show hostnames`)")
    wait = sub.add_parser("wait-agents", help="wait until every node's agent polls and has registered")
    wait.add_argument("--since", type=float, required=True, help="unix time the agents were started")
    wait.add_argument("--timeout-s", type=float, default=300.0)
    wait.add_argument("nodes", nargs="+")

    args_list = list(sys.argv[1:] if argv is None else argv)
    entrypoint: list[str] = []
    if "--" in args_list:
        split = args_list.index("--")
        args_list, entrypoint = args_list[:split], args_list[split + 1:]
    args = parser.parse_args(args_list)

    if args.command == "spec":
        try:
            if not entrypoint and args.entrypoint_json:
                entrypoint = json.loads(args.entrypoint_json)
                if not isinstance(entrypoint, list) or not all(isinstance(a, str) for a in entrypoint):
                    raise SpecError("TRAINGUARD_ENTRYPOINT: expected a JSON list of strings")
            run_spec = build_spec(json.loads(args.template.read_text()), args.nodes, args.spares,
                                  entrypoint, args.ranks_per_node)
        except (SpecError, ValueError) as error:  # json.JSONDecodeError is a ValueError
            print(f"spec: {error}", file=sys.stderr)
            return 2
        args.output.write_text(run_spec.model_dump_json(indent=2, exclude_defaults=True) + "\n")
        print(f"{args.output}: {len(run_spec.nodes)} nodes x {run_spec.ranks_per_node} ranks, "
              f"{len(run_spec.spare_nodes)} spares", file=sys.stderr)
        return 0

    nodes = [node.lower() for node in args.nodes]
    waiting = asyncio.run(wait_agents(nodes, args.since, args.timeout_s))
    if waiting:
        print(f"node agents not up after {args.timeout_s:.0f}s: {', '.join(waiting)}", file=sys.stderr)
        return 1
    print(f"node agents up: {', '.join(nodes)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # As in trainguard's CLI: exit without interpreter finalization, which the Temporal SDK's native
    # runtime threads can turn into an abort after a successful wait.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
