"""One `TRAINGUARD_HOME`, the dev stack brought up in each mode in turn (loopback, hosts, TLS): every time its
store accepts a checkpoint-sized multipart upload and still holds what the modes before it wrote. And `trainguard
dev up` on a home in use: the mode asked for, or a refusal saying what to run while another mode runs there.

Hosts mode is skipped, with the reason, where network namespaces cannot be made (not root, no `ip`); Slurm mode,
where Slurm cannot run (TLS mode stands in for it then).
"""

from __future__ import annotations

import io
import shutil
import time
import uuid
from collections.abc import Iterator

import boto3
import pytest
from boto3.s3.transfer import TransferConfig

from infra.harness import PrivateStack, alive, started_components
from trainguard import cli
from trainguard import dev_slurm
from trainguard.devstack import DevStack
from trainguard.hosts import unavailable_reason
from trainguard.ports import free_port_base

from .conftest import REPO

pytestmark = pytest.mark.integration

PART_BYTES = 5 << 20
CHECKPOINT_BYTES = 3 * PART_BYTES
"""A shard of a few parts: the upload goes through the store's volume server, not the filer's inline store."""


def _upload(dev: DevStack, key: str) -> list[str]:
    creds = dev.credentials()
    s3 = boto3.client("s3", endpoint_url=dev.config.s3_endpoint, region_name="us-east-1",
                      aws_access_key_id=creds["access_key"], aws_secret_access_key=creds["secret_key"])
    s3.upload_fileobj(io.BytesIO(b"x" * CHECKPOINT_BYTES), "trainguard", key,
                      Config=TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES))
    listed = s3.list_objects_v2(Bucket="trainguard", Prefix="modes/").get("Contents", [])
    return sorted(o["Key"] for o in listed if o["Size"] == CHECKPOINT_BYTES)


@pytest.mark.slow  # ~45 s: four stack restarts
def test_the_store_accepts_uploads_after_every_change_of_mode_on_one_home() -> None:
    """`weed mini` kept the address of the mode before in its saved options: after `dev up --hosts` on a home
    first used in loopback mode, every upload failed with InternalError and no checkpoint ever committed."""
    home = REPO / ".pytest-stack" / f"modes-{uuid.uuid4().hex[:8]}"
    modes = [("loopback", {}), ("hosts", {"hosts": True}), ("tls", {"tls": True}), ("loopback again", {})]
    if unavailable_reason() is not None:
        modes = [m for m in modes if m[0] != "hosts"]
    written: list[str] = []
    try:
        for name, flags in modes:
            private = PrivateStack(home, ("node-0",), 27700, keep_home=True, **flags)
            with private as dev:
                key = f"modes/{name.replace(' ', '-')}.bin"
                written.append(key)
                assert _upload(dev, key) == sorted(written), f"after bringing the stack up in {name} mode"
            assert not private.leftovers, f"processes survived dev down in {name} mode: {private.leftovers}"
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def cli_home(monkeypatch: pytest.MonkeyPatch) -> Iterator[DevStack]:
    """A home and free ports for `trainguard dev` commands run as a user would, one node; everything they started
    is stopped at the end and checked gone."""
    home = REPO / ".pytest-stack" / f"cli-modes-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TRAINGUARD_HOME", str(home))
    monkeypatch.setenv("TRAINGUARD_PORT_BASE", str(free_port_base(27900, 1)))
    monkeypatch.setenv("TRAINGUARD_DEV_NODES", "node-0")
    monkeypatch.setenv("TRAINGUARD_DEV_SLURMD_TIMEOUT_S", "10")
    for name in cli.MODE_ENV.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TRAINGUARD_TEMPORAL_ADDRESS", raising=False)
    stack = DevStack()
    try:
        yield stack
    finally:
        seen = started_components(stack)
        cli.main(["dev", "down"])
        left = [f"{c.name} (pid {c.pid})" for c in seen if alive(c.pid, c.start_time)]
        shutil.rmtree(home, ignore_errors=True)
        assert not left, f"processes survived dev down: {left}"


def _running(capsys: pytest.CaptureFixture[str]) -> set[str]:
    capsys.readouterr()
    assert cli.main(["dev", "status"]) == 0
    return {line.split()[0] for line in capsys.readouterr().out.splitlines() if "running (pid" in line}


def test_dev_up_brings_up_the_mode_asked_for_and_refuses_another_while_one_runs(
        cli_home: DevStack, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's path: `dev up --slurm`, `dev down`, then the quickstart's `dev up` came up in Slurm mode again,
    with no node agent, and every run failed at once with `no node agent polls trainguard-node-node-0`."""
    other, other_part = (("--slurm", "slurmctld") if dev_slurm.unavailable_reason() is None
                         else ("--tls", "temporal-tls"))
    text = {"--slurm": "Slurm mode", "--tls": "TLS mode"}[other]
    began = time.monotonic()

    assert cli.main(["dev", "up", other]) == 0
    assert cli.main(["dev", "up"]) == 2
    assert (f"the stack at {cli_home.home} is up in {text}, not plain mode: run `trainguard dev down` first, then "
            f"`trainguard dev up`") in capsys.readouterr().err
    assert other_part in _running(capsys)  # found in its mode without the flag
    assert cli.main(["dev", "down"]) == 0

    assert cli.main(["dev", "up"]) == 0
    running = _running(capsys)
    assert "agent-node-0" in running and other_part not in running
    assert cli.main(["dev", "up", other]) == 2
    assert f"is up in plain mode, not {text}" in capsys.readouterr().err
    print(f"{other} and plain stacks in turn on one home: {time.monotonic() - began:.1f}s")
