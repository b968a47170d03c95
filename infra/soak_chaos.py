"""The soak's chaos: kill a component of the private stack (the controller, a node agent, the Temporal
server, SeaweedFS), by SIGKILL or gracefully (SIGTERM), and bring it back with `DevStack.up`."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

from infra.harness import alive as _alive
from infra.soak_model import COMPONENTS, Kill

KILL_WAIT_S = 30.0
"""A signalled process that has not exited after this long gets SIGKILL."""
UP_ATTEMPTS = 3
"""`DevStack.up` after a kill waits up to a minute per try; a loaded machine may need another."""
RESTART_DELAY_S = 1.0
"""Seconds a killed component stays down before it is brought back."""
AGENT_ON_BUSY_NODE = 0.75
"""Share of agent kills aimed at a node a run trains on; the rest hit any node (spares, idle ones)."""
GRACEFUL_SHARE = 0.5
"""Share of kills that are a graceful stop (SIGTERM: an upgrade, a redeploy, a failover); the rest SIGKILL."""
TARGET = {"controller": "controller", "temporal": "temporal", "seaweedfs": "s3"}
"""The dev stack's name for each component but the agents (`agent-<node>`)."""



def _quiet(_line: str) -> None:
    return None


class Chaos:
    """Kills a component of the stack and brings it back."""

    def __init__(self, stack: Any, nodes: tuple[str, ...], rng: random.Random, clock: Callable[[], float],
                 say: Callable[[str], None]) -> None:
        self.stack = stack
        self.nodes = nodes
        self.rng = rng
        self.clock = clock
        self.say = say
        self.kills: list[Kill] = []
        self.busy = False
        """A component is down or coming back: operator actions wait for the stack to be whole."""
        self._cycle: list[str] = []

    def next_component(self) -> str:
        """Every kind in turn, shuffled per round, so a short soak still hits each of them."""
        if not self._cycle:
            self._cycle = list(COMPONENTS)
            self.rng.shuffle(self._cycle)
        return self._cycle.pop()

    async def strike(self, component: str, busy_nodes: list[str] | None = None) -> Kill:
        """Kill `component`; an agent is mostly one of `busy_nodes` (a node a run trains on), sometimes any
        (a spare or an idle node)."""
        if component == "agent":
            aim = busy_nodes if busy_nodes and self.rng.random() < AGENT_ON_BUSY_NODE else list(self.nodes)
            target = f"agent-{self.rng.choice(aim)}"
        else:
            target = TARGET[component]
        sig = signal.SIGTERM if self.rng.random() < GRACEFUL_SHARE else signal.SIGKILL
        kill = Kill(component, target, round(self.clock(), 1), sig.name)
        self.kills.append(kill)
        self.busy = True
        started = time.monotonic()
        try:
            kill.pid = await self._signal(target, sig)
            await asyncio.sleep(RESTART_DELAY_S)
            await self.restore()
        except Exception as error:  # noqa: BLE001 - recorded; the soak goes on and the invariants judge
            kill.error = f"{type(error).__name__}: {error}"
        finally:
            kill.down_s = round(time.monotonic() - started, 1)
            self.busy = False
        self.say(f"killed {target} ({sig.name}, pid {kill.pid}); back after {kill.down_s:.1f}s"
                 + (f"  ERROR {kill.error}" if kill.error else ""))
        return kill

    async def restore(self) -> None:
        for attempt in range(1, UP_ATTEMPTS + 1):
            try:
                await asyncio.to_thread(self.stack.up, _quiet)
                return
            except Exception:  # a start-up check failed (a server just back cancels a query): again
                if attempt == UP_ATTEMPTS:
                    raise
                await asyncio.sleep(2.0)

    async def _signal(self, target: str, sig: signal.Signals) -> int | None:
        pidfile = self.stack.run_dir / f"{target}.json"
        try:
            record = json.loads(pidfile.read_text())
        except (OSError, ValueError):
            return None
        pid = record["pid"]
        if not _alive(pid, record["start_time"]):
            return None
        os.kill(pid, sig)
        deadline = time.monotonic() + KILL_WAIT_S
        while _alive(pid, record["start_time"]):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + KILL_WAIT_S
            await asyncio.sleep(0.05)
        _reap(pid)
        return pid


def _reap(pid: int) -> None:
    """The stack's components are our children: collect a killed one's exit status."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
