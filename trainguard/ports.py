"""The dev stack's ports: one base number, each component at a fixed offset from it, and the search for a base
whose every port is free (private stacks of tests, benchmarks and the soak never meet a developer's stack)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from trainguard.hosts import bridge_exists

DEFAULT_NUM_NODES = 3
"""The dev stack's nodes (`trainguard.devstack.DEFAULT_NODES`)."""

ADMIN_GRPC_OFFSET = 10_000
"""SeaweedFS's gRPC-port convention (HTTP port + 10000), which its admin's plugin worker assumes."""


@dataclass(frozen=True, slots=True)
class Ports:
    temporal: int = 7233
    ui: int = 8233
    http: int = 7243
    server_metrics: int = 7244
    temporal_tls: int = 7443
    """The mutual-TLS front of the Temporal server, with `tls` on."""
    s3: int = 8333
    s3_grpc: int = 18333
    master: int = 9333
    master_grpc: int = 19333
    volume: int = 8080
    volume_grpc: int = 18080
    filer: int = 8888
    filer_grpc: int = 18888
    admin: int = 23646
    admin_grpc: int = 33646
    metrics: int = 9464
    """Prometheus metrics of the controller; node agents use the ports after it, one each."""

    @classmethod
    def from_base(cls, base: int | None) -> Ports:
        """`TRAINGUARD_PORT_BASE` moves every port to base + offset, so two stacks can coexist."""
        if base is None:
            return cls()
        names = [f for f in cls.__dataclass_fields__]
        ports = {name: base + index for index, name in enumerate(names)}
        # `weed mini`'s plugin worker dials the admin server at its HTTP port + 10000 whatever
        # `-admin.port.grpc` says: anywhere else, it logs "connection refused" every few seconds.
        ports["admin_grpc"] = ports["admin"] + ADMIN_GRPC_OFFSET
        if ports["admin_grpc"] > 65_535:
            raise ValueError(f"TRAINGUARD_PORT_BASE={base} is too high: the stack needs ports up to "
                             f"{ports['admin_grpc']} (at most {65_535 - ADMIN_GRPC_OFFSET - names.index('admin')})")
        return cls(**ports)

    def weed_grpc_ports(self) -> list[int]:
        return [self.s3_grpc, self.master_grpc, self.volume_grpc, self.filer_grpc, self.admin_grpc]


SLURM_PORT_OFFSET = 30
"""A dev Slurm cluster's ports (`trainguard dev up --slurm`): slurmctld at the stack's base + 30, its slurmds
after it, inside the 50 ports each base of `free_port_base` steps over."""
MAX_SLURM_NODES = 16


def slurm_ports(ports: Ports, num_nodes: int) -> tuple[int, list[int]]:
    """(slurmctld's port, each emulated node's slurmd port) of the stack whose Temporal is at `ports.temporal`."""
    if num_nodes > MAX_SLURM_NODES:
        raise ValueError(f"a dev Slurm cluster has at most {MAX_SLURM_NODES} nodes ({num_nodes} asked)")
    ctld = ports.temporal + SLURM_PORT_OFFSET
    return ctld, [ctld + 1 + index for index in range(num_nodes)]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def free_port_base(start: int, num_nodes: int = DEFAULT_NUM_NODES, step: int = 50, stop: int = 55_000) -> int:
    """The first base from `start` whose stack would find every port free, the node agents' metrics ports
    included, and no SeaweedFS socket left in /tmp on its ports: a private stack (tests, benchmarks, the
    soak) that never meets a developer's `trainguard dev up` or another private stack.

    `TRAINGUARD_PORT_SEARCH_OFFSET` shifts `start`, so suites run side by side from two checkouts do not race
    for the same first free base between its check and its bind."""
    start += int(os.environ.get("TRAINGUARD_PORT_SEARCH_OFFSET", "0"))
    for base in range(start, stop, step):
        ports = Ports.from_base(base)
        every = [getattr(ports, name) for name in Ports.__dataclass_fields__]
        every += [ports.metrics + 1 + index for index in range(num_nodes)]
        ctld, slurmds = slurm_ports(ports, min(num_nodes, MAX_SLURM_NODES))
        every += [ctld, *slurmds]
        stale = any(any(Path("/tmp").glob(f"seaweedfs-*-{port}.sock")) for port in ports.weed_grpc_ports())
        stale = stale or bridge_exists(ports.temporal)  # a hosts-mode stack listens on its bridge, not loopback
        if not stale and all(_port_free(port) for port in every):
            return base
    raise RuntimeError(f"no free port range between {start} and {stop}")


