"""The embedded stack with TLS on (`trainguard dev up --tls`): workers, the client and the CLI reach Temporal
only over mutual TLS, with the same settings they would use against a Temporal cluster; a run trains and
completes through it; a connection without TLS, or without a client certificate, is refused.

A stack of its own (two nodes), so the session's plain stack is left alone.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import pytest
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client
from temporalio.service import TLSConfig

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.settings import Settings

from .conftest import RUN_TIMEOUT_S, make_spec, own_stack

NODES = ("node-0", "node-1")


@pytest.fixture(scope="module")
async def tls_stack() -> AsyncIterator[DevStack]:
    async with own_stack("tls", NODES, 29100, tls=True) as dev:
        yield dev


async def test_a_run_trains_and_completes_over_mutual_tls(tls_stack: DevStack, prefix: str) -> None:
    env = tls_stack.client_env()
    assert env["TRAINGUARD_TEMPORAL_ADDRESS"].endswith(f":{tls_stack.config.ports.temporal_tls}")
    client = await TrainguardClient.connect(Settings.from_env({**os.environ, **env}))
    rid = await client.start_run(make_spec(prefix, steps=30, every=10), workflow_id=f"it-tls-{uuid.uuid4().hex[:6]}")
    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert result.steps_completed == 30 and result.incidents == [] and result.final_checkpoint is not None

    # The CLI, with the same settings from its environment.
    shown = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "trainguard.cli", "run", "status", rid],
                                    env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "completed" in shown.stdout.lower()


async def test_plain_text_and_certificate_less_connections_are_refused(tls_stack: DevStack) -> None:
    address = tls_stack.config.temporal_address
    with pytest.raises(Exception):  # noqa: B017 - whatever the transport says, it must not connect
        await asyncio.wait_for(Client.connect(address), 20)
    certs = tls_stack.certs
    with pytest.raises(Exception):  # noqa: B017
        await asyncio.wait_for(Client.connect(address, tls=TLSConfig(server_root_ca_cert=certs.ca.read_bytes())), 20)
    # With the client certificate it connects (the control for the two refusals above).
    settings = Settings.from_env({**os.environ, **tls_stack.client_env()})
    client = await Client.connect(address, tls=settings.tls_config())
    info = await client.workflow_service.get_system_info(GetSystemInfoRequest())
    assert info.server_version
