"""Hosts mode's names, addresses and checks: pure, no namespace is made here."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from trainguard.cli import build_parser
from trainguard.devstack import StackConfig
from trainguard.ports import Ports
from trainguard.hosts import SERVICES, HostsNetwork, overlapping_route, subnet_for

NODES = ("node-0", "node-1", "node-2")


def network(base: int, tmp_path: Path, nodes: tuple[str, ...] = NODES) -> HostsNetwork:
    return HostsNetwork(base, nodes, tmp_path / "hosts.json")


def test_every_name_carries_the_stacks_prefix_and_fits_an_interface_name(tmp_path: Path) -> None:
    net = network(65535, tmp_path, tuple(f"n{i}" for i in range(100)))
    members = [SERVICES, *net.nodes]
    links = [net.bridge, *(net.host_link(m) for m in members), *(net.node_link(m) for m in members)]
    namespaces = [net.namespace(m) for m in members]
    assert all(name.startswith("tg65535-") for name in [*links, *namespaces])
    assert max(len(name) for name in links) <= 15  # IFNAMSIZ - 1: a longer link name is refused
    assert len(set(links)) == len(links) and len(set(namespaces)) == len(namespaces)


def test_no_stacks_prefix_is_the_start_of_anothers(tmp_path: Path) -> None:
    # Base 2710's cleanup must never take base 27100's links ("tg2710" is a prefix of "tg27100br").
    short, long = network(2710, tmp_path), network(27100, tmp_path)
    assert not long.bridge.startswith(short.prefix) and not long.namespace("node-0").startswith(short.prefix)


def test_each_port_base_has_its_own_subnet_and_every_member_its_own_address(tmp_path: Path) -> None:
    assert subnet_for(27100) != subnet_for(27150) != subnet_for(7233)
    net = network(27100, tmp_path)
    assert net.subnet == ipaddress.IPv4Network("10.105.220.0/24")
    addresses = [net.gateway, net.services_address, *(net.address(n) for n in NODES)]
    assert addresses == ["10.105.220.1", "10.105.220.2", "10.105.220.10", "10.105.220.11", "10.105.220.12"]
    with pytest.raises(ValueError, match="port base"):
        subnet_for(70000)


def test_an_unknown_node_or_one_named_like_the_services_host_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a node of this stack"):
        network(27100, tmp_path).namespace("node-9")
    with pytest.raises(ValueError, match="services"):
        network(27100, tmp_path, ("node-0", SERVICES))


def test_a_recorded_address_survives_and_names_its_base(tmp_path: Path) -> None:
    net = network(27100, tmp_path)
    net._save({"node-1": "10.105.220.100"})
    assert net.address("node-1") == "10.105.220.100" and net.address("node-0") == "10.105.220.10"
    assert network(27150, tmp_path).recorded_base() == 27100  # `down` finds the prefix it was made with


@pytest.mark.parametrize(("routes", "clash"), [
    ("default via 192.0.2.1 dev eth0\n192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2\n", None),
    ("10.0.0.0/8 dev wg0 scope link\n", "10.0.0.0/8 dev wg0"),
    ("10.105.220.0/24 dev tg27100-br proto kernel scope link src 10.105.220.1\n", None),  # our own bridge
    ("10.105.220.128/25 via 192.0.2.9 dev eth0\n", "10.105.220.128/25 dev eth0"),
    ("10.105.221.0/24 dev eth1\n", None),
    ("blackhole 10.105.220.0/24 proto static\n", "10.105.220.0/24 dev ?"),  # a route type first
])
def test_a_subnet_the_host_routes_elsewhere_is_refused(routes: str, clash: str | None) -> None:
    assert overlapping_route(routes, subnet_for(27100), "tg27100-br") == clash


def test_hosts_mode_from_the_environment_and_the_command_line(tmp_path: Path) -> None:
    config = StackConfig.from_env({"TRAINGUARD_DEV_HOSTS": "1", "TRAINGUARD_PORT_BASE": "27100",
                                   "TRAINGUARD_HOME": str(tmp_path)})
    assert config.hosts and config.ports == Ports.from_base(27100)
    assert config.temporal_address == "10.105.220.2:27100" and config.s3_endpoint.startswith("http://10.105.220.2:")
    assert config.network.prefix == "tg27100-"
    loopback = StackConfig.from_env({"TRAINGUARD_HOME": str(tmp_path)})
    assert not loopback.hosts and loopback.temporal_address == "127.0.0.1:7233"
    assert build_parser().parse_args(["dev", "up", "--hosts"]).hosts
