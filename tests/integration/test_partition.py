"""A network partition: one node agent is cut off from Temporal while its run trains. The run goes on without
it (a spare takes its place), nothing of the old attempt keeps training once the cut heals, and the node
rejoins the pool and trains again after an operator lifts its cordon.

The cut is a forwarder between that agent and the Temporal server that stops moving bytes, as a dropped
link does (connections hang, nothing is refused): the agent's control-plane link, the one trainguard
depends on. Its ranks keep their direct links to their peers, as on a cluster whose management network fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import IncidentKind, RunResult

from .conftest import RUN_TIMEOUT_S, checkpointed, live_rank_pids, make_spec, wait_until

NODE = "node-p"


class Link:
    """A TCP forwarder that can be cut: while cut, accepted connections and bytes in flight are held, not
    refused or reset, until the link heals (or forever)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> Link:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._open.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await source.read(65536):
                await self._open.wait()
                sink.write(data)
                await sink.drain()
        sink.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture
async def cut_off_agent(stack: DevStack, client: TrainguardClient) -> AsyncIterator[Link]:
    """A fourth node agent, `node-p`, whose every Temporal connection goes through a `Link`."""
    link = await Link(stack.config.ports.temporal).start()
    workdir = stack.home / "nodes" / NODE
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**stack.worker_env(), "TRAINGUARD_TEMPORAL_ADDRESS": f"127.0.0.1:{link.port}"}
    await asyncio.to_thread(stack._spawn, f"agent-{NODE}", [
        sys.executable, "-m", "workers.node_agent", "--node", NODE, "--workdir", str(workdir), "--host", "127.0.0.1",
        "--code-dir", str(stack.config.code_dir), "--allow", str(Path(sys.executable).parent),
    ], env=env, cwd=stack.config.code_dir)
    try:
        deadline = time.monotonic() + 60
        while not any(n.node == NODE for n in await client.nodes()):
            assert time.monotonic() < deadline, f"{NODE} never registered in the pool"
            await asyncio.sleep(0.5)
        yield link
    finally:
        link.heal()
        await asyncio.to_thread(stack.stop, [f"agent-{NODE}"], lambda _line: None)
        await link.close()
        with contextlib.suppress(Exception):
            await client.uncordon(NODE)


@pytest.mark.slow  # ~45 s; a lost node's replacement runs in make test (test_training_run)
async def test_a_cut_off_node_is_replaced_and_rejoins_after_the_cut_heals(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack, cut_off_agent: Link
) -> None:
    rid = await client.start_run(make_spec(prefix, nodes=("node-0", NODE), spares=("node-2",)),
                                 workflow_id=f"it-partition-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, checkpointed)
    cut_off_agent.cut()

    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    lost = [i for i in result.incidents if i.kind is IncidentKind.NODE_UNRESPONSIVE]
    assert [i.node for i in lost] == [NODE], result.incidents  # noticed once, on the cut-off node
    status = (await client.status(rid)).status
    assert status.nodes == ["node-0", "node-2"] and status.cordoned == [NODE]
    assert result.final_state_digest == baseline.final_state_digest

    # The cut heals: no rank of the old attempt trains on beside the finished run (no split brain).
    cut_off_agent.heal()
    deadline = time.monotonic() + 60
    while live_rank_pids(stack):
        assert time.monotonic() < deadline, f"ranks still alive after the cut healed: {live_rank_pids(stack)}"
        await asyncio.sleep(0.5)

    # An operator lifts the cordon; the node trains again.
    await client.uncordon(NODE)
    again = await client.start_run(make_spec(f"{prefix}-again", nodes=(NODE, "node-0")),
                                   workflow_id=f"it-partition-again-{uuid.uuid4().hex[:6]}")
    rejoined = await asyncio.wait_for(client.result(again), RUN_TIMEOUT_S)
    assert rejoined.incidents == [] and rejoined.final_state_digest == baseline.final_state_digest
