"""Hosts mode of the dev stack: every node agent, with its ranks, in a network namespace of its own.

    trainguard dev up --hosts          (or TRAINGUARD_DEV_HOSTS=1)

The stack makes one Linux bridge and, per node, a network namespace joined to it by a veth pair, with an
address of its own on the bridge's /24. Temporal and the store run in one more namespace, the services host
(`.2`), so a node reaches them, and the other nodes, only over the bridge, as a host reaches others over its
NIC. The host's own namespace has the bridge's address (`.1`): the controller, the CLI and the tests reach
the services from there. Nothing else is routed: the namespaces have no default route, the bridge no uplink.
(The Temporal dev server advertises its internal services at 127.0.0.1 whatever `--ip` it binds, so it
listens on every address of the services namespace, which are its loopback and its bridge address only.)

Every name is derived from the stack's port base (`tg<base>-`): two stacks never touch each other's
namespaces or links, and `dev down` removes exactly those with its own prefix, never by a general pattern.

Partitions drop packets with `tc` on a veth end (the `blackhole` qdisc: everything that would leave that end
vanishes, nothing is refused or reset): on the node's end for what the node sends, on the bridge's end for
what is sent to it. A link can also be taken down. Kernels with `netem` could drop a share of the packets;
the one measured here has no netem, no `gact` drop action and no nft/iptables binary, and `blackhole`, which
needs only `CONFIG_NET_SCHED`, is what it has.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

IP_TIMEOUT_S = 10.0
"""One `ip`/`tc` call: a netlink request answers in milliseconds; a stuck one must not hang `up` or `down`."""
TEARDOWN_WAIT_S = 5.0
"""The kernel frees a deleted namespace's links in the background: how long `down` waits to see them go."""
SERVICES = "services"
"""The services host's name among `HostsNetwork`'s members; its namespace and links have their own tag (`s`)."""
FIRST_NODE_HOST = 10
"""Node i's first address is the subnet's host number 10 + i (the host's bridge address is 1, the services 2)."""
READDRESS_FROM = 100
"""A node given a new address (an agent coming back elsewhere) takes the first free host number from here."""


class Direction(str, Enum):
    """Which packets of one node a partition drops."""

    BOTH = "both"
    OUTBOUND = "outbound"
    """What the node sends (to Temporal, the store, other nodes): dropped at its own end of the veth."""
    INBOUND = "inbound"
    """What is sent to the node: dropped at the bridge's end of its veth."""


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)  # argv
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or f'exit {result.returncode}'}")
    return result


def unavailable_reason() -> str | None:
    """Why hosts mode cannot run here (not root, no `ip` or `tc`, no namespaces in the kernel), or None.
    It makes and removes one namespace of its own (`tgprobe<pid>`) to know."""
    if os.geteuid() != 0:
        return "hosts mode needs root (network namespaces, veth pairs and a bridge)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"hosts mode needs iproute2's `{tool}`, not found on PATH"
    probe = f"tgprobe{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"hosts mode cannot make a network namespace: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def subnet_for(base: int) -> ipaddress.IPv4Network:
    """The stack's /24: 10.<base high byte>.<base low byte>.0/24, distinct for every port base."""
    if not 0 < base < 65536:
        raise ValueError(f"port base {base}: must be a port number")
    return ipaddress.IPv4Network(f"10.{base >> 8}.{base & 0xFF}.0/24")


ROUTE_TYPES = frozenset({"unicast", "local", "broadcast", "multicast", "throw", "unreachable", "prohibit",
                         "blackhole", "nat", "anycast"})


def overlapping_route(routes: str, subnet: ipaddress.IPv4Network, own_device: str) -> str | None:
    """The first route of `ip -4 -o route show` output that overlaps `subnet` on a device other than ours
    (`10.0.0.0/8 dev eth1`), or None. The default route overlaps everything and is not counted."""
    for line in routes.splitlines():
        words = line.split()
        if words and words[0] in ROUTE_TYPES:
            words = words[1:]
        if not words or words[0] == "default":
            continue
        try:
            network = ipaddress.IPv4Network(words[0], strict=False)
        except ValueError:
            continue
        device = words[words.index("dev") + 1] if "dev" in words[:-1] else "?"
        if network.overlaps(subnet) and device != own_device:
            return f"{network} dev {device}"
    return None


@dataclass(frozen=True, slots=True)
class HostsNetwork:
    """The namespaces, links and addresses of one stack, and what makes, cuts and removes them."""

    base: int
    """The stack's port base (its Temporal port): every name and the subnet derive from it."""
    nodes: tuple[str, ...]
    state_file: Path
    """Where each node's current address is kept (`run/hosts.json`), so a restarted agent keeps its own."""

    def __post_init__(self) -> None:
        if SERVICES in self.nodes:
            raise ValueError(f"hosts mode: no node may be named {SERVICES!r}, the services host's name")

    # ----------------------------------------------------------------------------------------- names
    @property
    def prefix(self) -> str:
        return f"tg{self.base}-"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return subnet_for(self.base)

    @property
    def gateway(self) -> str:
        """The bridge's address in the host's namespace: where the controller, the CLI and tests are."""
        return str(self.subnet.network_address + 1)

    @property
    def services_address(self) -> str:
        """The services host's address: where Temporal (its UI) and the store listen."""
        return str(self.subnet.network_address + 2)

    def _tag(self, member: str) -> str:
        """A short tag for a member's link names (interface names have at most 15 characters)."""
        if member == SERVICES:
            return "s"
        if member not in self.nodes:
            raise ValueError(f"{member!r} is not a node of this stack ({', '.join(self.nodes)})")
        return str(self.nodes.index(member))

    def namespace(self, member: str) -> str:
        """`tg<base>-n-<node>`, or `tg<base>-s` for the services host."""
        self._tag(member)  # a node of this stack, or the services host
        return f"{self.prefix}s" if member == SERVICES else f"{self.prefix}n-{member}"

    def host_link(self, member: str) -> str:
        """The bridge's end of the member's veth, in the host's namespace."""
        return f"{self.prefix}h{self._tag(member)}"

    def node_link(self, member: str) -> str:
        """The member's end, inside its namespace: the interface its agent and ranks use (GLOO_SOCKET_IFNAME)."""
        return f"{self.prefix}n{self._tag(member)}"

    def default_address(self, member: str) -> str:
        if member == SERVICES:
            return self.services_address
        return str(self.subnet.network_address + FIRST_NODE_HOST + int(self._tag(member)))

    def _addresses(self) -> dict[str, str]:
        try:
            return dict(json.loads(self.state_file.read_text())["addresses"])
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def recorded_base(self) -> int | None:
        """The port base the state file was written for (a stack brought up with another base than now)."""
        try:
            return int(json.loads(self.state_file.read_text())["base"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def address(self, node: str) -> str:
        """The address the node's agent advertises (`--host`): its own on the bridge."""
        if node == SERVICES:
            return self.services_address
        return self._addresses().get(node) or self.default_address(node)

    def exec_prefix(self, node: str) -> list[str]:
        """What runs a command inside the node's namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    # ----------------------------------------------------------------------------------- make it
    def setup(self) -> None:
        """Make the bridge and every node's namespace, veth and address; what exists already is kept."""
        self._check_subnet_free()
        if not self._link_exists(self.bridge):
            # No STP and no forwarding delay: a port forwards as soon as it is up.
            _run(["ip", "link", "add", self.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0"])
        _run(["ip", "addr", "replace", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        addresses = self._addresses()
        for node in (SERVICES, *self.nodes):
            namespace, host, inner = self.namespace(node), self.host_link(node), self.node_link(node)
            if namespace not in self.namespaces():
                _run(["ip", "netns", "add", namespace])
            if not self._link_exists(host):
                _run(["ip", "link", "add", host, "type", "veth", "peer", "name", inner, "netns", namespace])
            _run(["ip", "link", "set", host, "master", self.bridge, "up"])
            inside = ["ip", "-n", namespace]
            _run([*inside, "link", "set", "lo", "up"])
            wanted = f"{self.address(node)}/{self.subnet.prefixlen}"
            # Left alone when it has it already: a running agent's connections survive another `up`.
            if f" {wanted} " not in _run([*inside, "-4", "-o", "addr", "show", "dev", inner]).stdout:
                _run([*inside, "addr", "flush", "dev", inner])
                _run([*inside, "addr", "add", wanted, "dev", inner])
            _run([*inside, "link", "set", inner, "up"])
            if node != SERVICES:
                addresses.setdefault(node, self.address(node))
        self._save(addresses)

    def readdress(self, node: str) -> str:
        """Give the node a new address (its agent must be restarted to advertise it); returns it."""
        taken = {*self._addresses().values(), *(self.default_address(n) for n in self.nodes), self.gateway,
                 self.services_address}
        new = next(str(self.subnet.network_address + n) for n in range(READDRESS_FROM, 255)
                   if str(self.subnet.network_address + n) not in taken)
        inside = ["ip", "-n", self.namespace(node)]
        _run([*inside, "addr", "flush", "dev", self.node_link(node)])
        _run([*inside, "addr", "add", f"{new}/{self.subnet.prefixlen}", "dev", self.node_link(node)])
        self._save({**self._addresses(), node: new})
        return new

    def _save(self, addresses: dict[str, str]) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps({"base": self.base, "prefix": self.prefix, "addresses": addresses}))

    def _check_subnet_free(self) -> None:
        """Refuse a subnet the host already routes elsewhere: our bridge would shadow a real network."""
        clash = overlapping_route(_run(["ip", "-4", "-o", "route", "show"]).stdout, self.subnet, self.bridge)
        if clash:
            raise HostsUnavailable(f"hosts mode would use {self.subnet}, but the host routes {clash}: "
                                   "pick another TRAINGUARD_PORT_BASE")

    # ------------------------------------------------------------------------------- partitions
    def partition(self, node: str, direction: Direction = Direction.BOTH) -> None:
        """Drop the node's packets, all of them or one direction's, until `heal`."""
        direction = Direction(direction)
        if direction in (Direction.BOTH, Direction.OUTBOUND):
            _run([*self._in(node), "tc", "qdisc", "replace", "dev", self.node_link(node), "root", "blackhole"])
        if direction in (Direction.BOTH, Direction.INBOUND):
            _run(["tc", "qdisc", "replace", "dev", self.host_link(node), "root", "blackhole"])

    def heal(self, node: str) -> None:
        """Packets of the node flow again (both directions; its link up)."""
        for argv in ([*self._in(node), "tc", "qdisc", "del", "dev", self.node_link(node), "root"],
                     ["tc", "qdisc", "del", "dev", self.host_link(node), "root"]):
            _run(argv, check=False)  # no qdisc of ours there: nothing to heal
        _run(["ip", "link", "set", self.host_link(node), "up"])

    def link_down(self, node: str) -> None:
        """Take the bridge's end of the node's veth down: the node has no carrier until `heal`."""
        _run(["ip", "link", "set", self.host_link(node), "down"])

    def dropped(self, node: str) -> list[str]:
        """Which directions of the node are dropped now (`tc` on its two ends), for status and tests."""
        dropped = []
        if "blackhole" in _run([*self._in(node), "tc", "qdisc", "show", "dev", self.node_link(node)]).stdout:
            dropped.append(Direction.OUTBOUND.value)
        if "blackhole" in _run(["tc", "qdisc", "show", "dev", self.host_link(node)]).stdout:
            dropped.append(Direction.INBOUND.value)
        return dropped

    def _in(self, node: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(node)]

    # --------------------------------------------------------------------------------- remove it
    def namespaces(self) -> list[str]:
        """This stack's namespaces (by its prefix)."""
        if shutil.which("ip") is None:
            return []
        listed = _run(["ip", "netns", "list"], check=False).stdout.splitlines()
        return [name for line in listed if (name := line.split(" ", 1)[0]).startswith(self.prefix)]

    def links(self) -> list[str]:
        """This stack's links in the host's namespace (the bridge, the bridge's veth ends), by its prefix."""
        if shutil.which("ip") is None:
            return []
        found = []
        for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
            match = re.match(r"\d+:\s+([^:@\s]+)", line)
            if match and match.group(1).startswith(self.prefix):
                found.append(match.group(1))
        return found

    def leftovers(self) -> list[str]:
        return [*self.links(), *(f"netns {n}" for n in self.namespaces())]

    def teardown(self, echo: Callable[[str], None] = print) -> list[str]:
        """Remove every namespace and link with this stack's prefix (their qdiscs go with them); what is
        still there after `TEARDOWN_WAIT_S` is returned (empty: all gone). Run its processes down first."""
        links = self.links()
        # Veth ends first (each takes its peer in the namespace with it at once), the bridge last.
        for link in sorted(links, key=lambda name: name == self.bridge):
            _run(["ip", "link", "del", link], check=False)
        namespaces = self.namespaces()
        for namespace in namespaces:
            _run(["ip", "netns", "del", namespace], check=False)
        if links or namespaces:
            echo(f"hosts: removed {len(namespaces)} namespaces and {len(links)} links ({self.prefix}*)")
        self.state_file.unlink(missing_ok=True)
        deadline = time.monotonic() + TEARDOWN_WAIT_S
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def _link_exists(self, name: str) -> bool:
        return Path("/sys/class/net", name).exists()


def bridge_exists(base: int) -> bool:
    """Whether a hosts-mode stack on this port base has its bridge up: `free_port_base` skips such a base."""
    return Path("/sys/class/net", f"tg{base}-br").exists()
