"""A run's TorchFT lighthouse on the node agent that hosts it: started once, kept alive, stopped with the run.

`start_lighthouse` starts `python -m trainguard.lighthouse` in a session of its own and answers its address; a
retry finds it running (its PID and start time are in the run's folder) and answers the same. `keep_lighthouse`
runs for the run's whole life: it heartbeats, starts the lighthouse again on the same port if it died, and stops
it when cancelled. `stop_lighthouse` stops it wherever the keeper is not (the run ending after its keeper was
lost). Every call is idempotent; every process is found by the PID its start recorded, never by a name.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from activities.lighthouse_models import LighthouseAddress, LighthouseInput
from trainguard import procs
from trainguard.error_types import ErrorType
from trainguard.lighthouse import EXIT_NO_TORCHFT, NO_TORCHFT
from trainguard.protocol import safe_name
from trainguard.safe_files import open_append, read_json, read_regular, write_json

log = logging.getLogger("trainguard.lighthouse")

LIGHTHOUSES_DIR = "lighthouses"
READY_TIMEOUT_S = 60.0
"""How long a started lighthouse may take to serve (it imports TorchFT, and torch with it: seconds)."""
KEEP_POLL_S = 0.5
"""How often the keeper looks at its lighthouse: a dead one is started again within this."""
STOP_GRACE_S = 5.0


class Lighthouses:
    """The lighthouses this node hosts, one per run, each in `<workdir>/lighthouses/<run>/`."""

    def __init__(self, node: str, workdir: Path, host: str) -> None:
        self.node, self.workdir, self.host = node, workdir, host
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        """The lighthouses this agent started, by PID: reaped once they exit (an agent restarted since leaves
        them to init, which reaps them)."""
        self._starting: dict[Path, asyncio.Lock] = {}
        """One lock per run's folder, held from "is it running?" to its state file's write: a retried start and
        the keeper's restart racing after a death would otherwise both start one, and orphan the one whose state
        was overwritten."""

    def _folder(self, workflow_id: str) -> Path:
        folder = self.workdir / LIGHTHOUSES_DIR / safe_name(workflow_id)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _reap(self) -> None:
        for pid, popen in list(self._children.items()):
            if popen.poll() is not None:
                del self._children[pid]

    def _running(self, folder: Path) -> dict | None:
        self._reap()
        state = read_json(folder / "state.json")
        if not isinstance(state, dict) or not isinstance(state.get("pid"), int):
            return None
        if procs.start_time(state["pid"]) != state.get("start_time"):
            return None  # exited (or its PID is another process's now)
        return state

    async def _start(self, request: LighthouseInput) -> dict:
        folder = self._folder(request.workflow_id)
        async with self._starting.setdefault(folder, asyncio.Lock()):
            if (state := self._running(folder)) is not None:
                return state
            return await self._spawn(request, folder)

    async def _spawn(self, request: LighthouseInput, folder: Path) -> dict:
        previous = read_json(folder / "state.json")
        port = previous.get("port", 0) if isinstance(previous, dict) else 0  # the groups know this address
        ready = folder / "address"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "trainguard.lighthouse", "--port", str(port), "--host", self.host,
                "--min-replicas", str(request.min_replicas), "--ready-file", str(ready),
                "--heartbeat-timeout-ms", str(request.heartbeat_timeout_ms),
                "--join-timeout-ms", str(request.join_timeout_ms)]
        log_file = open_append(folder / "lighthouse.log")
        try:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "RUST_LOG": "warn"})
        finally:
            log_file.close()
        self._children[popen.pid] = popen
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (address := read_regular(ready)) is None:
            if popen.poll() is not None:
                tail = (read_regular(folder / "lighthouse.log") or b"")[-400:].decode(errors="replace").strip()
                if popen.returncode == EXIT_NO_TORCHFT:
                    raise ApplicationError(f"replica_groups on node {self.node}: {NO_TORCHFT}",
                                           type=ErrorType.BAD_SPEC, non_retryable=True)
                raise ApplicationError(f"the lighthouse exited {popen.returncode} on node {self.node}: {tail}")
            if time.monotonic() > deadline:
                self._kill(popen.pid)
                raise ApplicationError(f"the lighthouse did not serve within {READY_TIMEOUT_S:g} s on {self.node}")
            await asyncio.sleep(0.1)
        text = address.decode().strip()
        state = {"pid": popen.pid, "start_time": procs.start_time(popen.pid), "address": text,
                 "port": int(text.rsplit(":", 1)[1])}
        write_json(folder / "state.json", state)
        log.info("lighthouse of %s serving at %s (pid %d)", request.workflow_id, text, popen.pid)
        return state

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)  # its own session: the lighthouse and anything it started
        except ProcessLookupError:
            pass

    async def _stop(self, folder: Path) -> None:
        if (state := self._running(folder)) is None:
            return
        pid = state["pid"]
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while procs.start_time(pid) == state["start_time"] and time.monotonic() < deadline:
            self._reap()
            await asyncio.sleep(0.05)
        self._kill(pid)
        self._reap()

    def _address(self, state: dict) -> LighthouseAddress:
        return LighthouseAddress(node=self.node, address=state["address"], pid=state["pid"])

    @activity.defn(name=names.START_LIGHTHOUSE)
    async def start_lighthouse(self, request: LighthouseInput) -> LighthouseAddress:
        """The run's lighthouse serving on this node (started if it is not), and its address."""
        return self._address(await self._start(request))

    @activity.defn(name=names.KEEP_LIGHTHOUSE)
    async def keep_lighthouse(self, request: LighthouseInput) -> None:
        """Until cancelled: start the run's lighthouse again (same port) whenever it is gone; then stop it."""
        folder = self._folder(request.workflow_id)
        restarts = 0
        try:
            while True:
                if self._running(folder) is None:
                    await self._start(request)
                    restarts += 1
                activity.heartbeat(restarts)
                await asyncio.sleep(KEEP_POLL_S)
        except asyncio.CancelledError:
            await self._stop(folder)
            raise

    @activity.defn(name=names.STOP_LIGHTHOUSE)
    async def stop_lighthouse(self, request: LighthouseInput) -> None:
        """Stop the run's lighthouse on this node, if it runs."""
        await self._stop(self._folder(request.workflow_id))
