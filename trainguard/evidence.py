"""The evidence channel between a node agent and its ranks: one owner for the names, files and shapes both
sides use (the rank helper in `trainguard.rank`, the agent in `activities.evidence`).

When a node judges a hang, the run asks every node for evidence before anything is stopped. The agent asks
each of its ranks for two things:

- its Python stacks, every thread: the agent sends `EVIDENCE_SIGNAL`, for which the helper registered
  `faulthandler` (a C-level handler: it writes even while the rank's main thread is blocked in C, or holds
  the GIL). The stacks are appended to `<base>.stacks`;
- its collective position: the agent writes a request id to `<base>.request`, and the helper's evidence
  thread answers in `<base>.answer.json` with torch's Flight Recorder status of its process groups (collectives
  enqueued and completed), read in the rank itself. The thread runs while the main thread waits in a
  collective, sleeps on a lock or in a read (each releases the GIL); a rank that is stopped or holds the GIL
  in C does not answer, and its process state says why.

Chaos hangs (`trainguard chaos hang --mode ...`) are carried out by the helper too: the agent writes the mode
to `<base>.chaos.json`, and the rank acts on it at its next step (`python`, `io`) or its next gradient
all-reduce (`skip-collective`, which needs the script to hand its DDP model to `RankRun.hook_ddp`). So are the
numerical faults (`trainguard chaos bitflip|nan`, `NUMERIC_MODES`), on the model the script handed to
`RankRun.fingerprint`.

This module imports nothing heavy: the rank helper loads it in every rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.protocol import ENV_EVIDENCE_BASE
from trainguard.safe_files import read_regular, replace_file
from trainguard.faults import FaultKind

BASE_ENV = ENV_EVIDENCE_BASE
"""Set by the agent for each rank: the path prefix of the rank's evidence files."""

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
"""torch's Flight Recorder is on when this is set before the process group is made (gloo and NCCL both
record in torch 2.13). The agent sets it unless the spec's env does."""
FR_BUFFER_DEFAULT = "64"
"""Entries kept per process: the answer needs only the per-group status, not a long trace."""

EVIDENCE_SIGNAL = signal.SIGUSR2
"""The signal the helper's faulthandler dumps all threads' stacks on. Sent only to ranks whose helper
registered it (the `<base>.answer.json` or `<base>.ready` file exists): its default action would end a rank
that did not."""

HANG_MODES = ("stop", "python", "skip-collective", "io")
"""`stop`: SIGSTOP (the process cannot run at all); `python`: the rank blocks forever in Python (a lock that
is never released) while its process keeps running; `skip-collective`: the rank skips the gradient
all-reduce its peers enter (it never issues it) and waits in its backward pass, so its peers wait in the
collective it skipped; `io`: the rank blocks in a read that never returns."""

NUMERIC_MODES = ("bitflip", "nan")
"""Chaos the helper carries out on the model `RankRun.fingerprint` was given, at the rank's next step: `bitflip`
flips one bit of one parameter element (after the optimizer step: a silent data corruption), `nan` makes the next
forward pass's output, so the loss and gradients, NaN (a numerical fault)."""

REQUEST_POLL_S = 0.02
"""How often the helper's evidence thread looks for a request (a stat): the answer comes within this."""


def fault_name(mode: str) -> str:
    """The `inject_fault` fault for a hang mode: `hang` for `stop` (as before), else `hang-<mode>`."""
    if mode not in HANG_MODES:
        raise ValueError(f"unknown hang mode {mode!r}; expected one of {', '.join(HANG_MODES)}")
    return FaultKind.HANG if mode == "stop" else FaultKind(f"hang-{mode}")


def mode_of(fault: str) -> str | None:
    """The hang mode of an `inject_fault` fault name, None if it is no hang."""
    if fault == FaultKind.HANG:
        return "stop"
    mode = fault.removeprefix("hang-")
    return mode if fault.startswith("hang-") and mode in HANG_MODES else None


@dataclass(frozen=True, slots=True)
class Paths:
    base: Path

    @property
    def ready(self) -> Path:
        """Written once the helper registered its signal handler and started its thread."""
        return self.base.with_name(self.base.name + ".ready")

    @property
    def stacks(self) -> Path:
        return self.base.with_name(self.base.name + ".stacks")

    @property
    def request(self) -> Path:
        return self.base.with_name(self.base.name + ".request")

    @property
    def answer(self) -> Path:
        return self.base.with_name(self.base.name + ".answer.json")

    @property
    def chaos(self) -> Path:
        return self.base.with_name(self.base.name + ".chaos.json")


@dataclass(slots=True)
class Position:
    """A rank's collective position, as its helper answers it."""

    request: str = ""
    """The request id this answers."""
    step: int = -1
    """Steps the rank had reported done."""
    collectives_enqueued: int | None = None
    """Collectives the rank has entered (Flight Recorder's last enqueued sequence id, summed over its process
    groups); None without the Flight Recorder."""
    collectives_completed: int | None = None
    in_collective: bool | None = None
    """Entered a collective that has not completed; None when not known."""
    collective: str = ""
    """The newest collective it entered (e.g. `gloo:all_reduce`)."""
    source: str = ""
    """`flight-recorder`, or why the position is not known."""
    chaos: str = ""
    """A chaos hang mode this rank carries out, if any."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Position:
        data = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__slots__})


def write_atomic(path: Path, text: str) -> None:
    """Whole or not at all, and never through a link a rank planted in its evidence folder (the agent writes
    requests and chaos there as root): `trainguard.safe_files.replace_file`."""
    replace_file(path, text.encode())


ANSWER_MAX_BYTES = 64 << 10
"""The most the agent reads of an answer: a `Position` is a few hundred bytes."""


def read_answer(paths: Paths) -> Position | None:
    """A rank's answer as the agent reads it: a regular file only, never through a link nor from a FIFO
    (`trainguard.safe_files.read_regular`), so a rank's answer file can neither block nor redirect the read."""
    data = read_regular(paths.answer, ANSWER_MAX_BYTES)
    if data is None:
        return None
    try:
        found = Position.from_json(data.decode())
    except (ValueError, TypeError, AttributeError):
        return None
    counts = (found.collectives_enqueued, found.collectives_completed)
    typed = (isinstance(found.request, str) and type(found.step) is int
             and all(c is None or type(c) is int for c in counts)
             and (found.in_collective is None or isinstance(found.in_collective, bool))
             and all(isinstance(t, str) for t in (found.collective, found.source, found.chaos))
             and isinstance(found.extra, dict))
    return found if typed else None  # a rank's answer of other shapes is no answer, never the agent's error


def flight_recorder_position() -> tuple[int | None, int | None, str, str]:
    """(enqueued, completed, newest collective's name, source) from torch's Flight Recorder, in this process."""
    if os.environ.get(FR_BUFFER_ENV) in (None, "", "0"):
        return None, None, "", f"Flight Recorder off ({FR_BUFFER_ENV} unset)"
    if "torch" not in sys.modules:
        return None, None, "", "no torch in this rank"
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None, None, "", "no torch.distributed"
    dump = getattr(c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None, None, "", "this torch has no Flight Recorder dump"
    try:
        trace = json.loads(dump(True, False))
    except Exception as error:  # noqa: BLE001 - any failure of the dump is "unknown", never a crash
        return None, None, "", f"Flight Recorder dump failed: {error}"
    enqueued = completed = 0
    for status in (trace.get("pg_status") or {}).values():
        enqueued += max(0, int(status.get("last_enqueued_collective", -1)))
        completed += max(0, int(status.get("last_completed_collective", -1)))
    entries = trace.get("entries") or []
    name = str(entries[-1].get("profiling_name", "")) if entries else ""
    return enqueued, completed, name, "flight-recorder"


def in_collective(enqueued: int | None, completed: int | None, ddp_hooked: bool = False, hook_entered: int = 0,
                  hook_completed: int = 0) -> bool | None:
    """Whether a rank is inside a collective now; None when nothing tells.

    Flight Recorder alone (enqueued > completed) is right for collectives that are waited on, but it marks
    an asynchronous one complete only when someone waits on its work object, and DDP's gradient all-reduce
    is waited on through its future instead: after a few steps every DDP rank reads as inside. So a rank
    whose DDP all-reduce goes through `hook_ddp` is inside while one of the hook's all-reduces has not come
    back (counted by the hook itself, exact at any moment). Its other collectives (a barrier, an explicit
    all-reduce) are still in the Flight Recorder's sequence count, which the culprit rule falls back to."""
    if ddp_hooked:
        return hook_entered > hook_completed
    if enqueued is None or completed is None:
        return None
    return enqueued > completed


# ------------------------------------------------------------------------------------------ rank side


class RankChannel:
    """The rank's end: registers the stack dump, answers position requests from a thread, and carries out
    chaos hangs. Made by `trainguard.rank.RankRun` in every managed rank."""

    def __init__(self, base: Path) -> None:
        self.paths = Paths(base)
        self.step = -1
        self.skip_collectives = False
        """Set by a `skip-collective` chaos: `hook_ddp`'s hook skips the next all-reduce."""
        self.ddp_hooked = False
        self.hook_entered = 0
        """Gradient all-reduces `allreduce_hook` issued; only the thread that runs DDP's backward adds to it."""
        self.hook_completed = 0
        """...and of those, the ones whose result came back; only the communication thread adds to it."""
        self.fingerprinted = False
        """The script handed its model to `RankRun.fingerprint`: numerical chaos has a model to act on."""
        self.numeric_chaos = ""
        """A `NUMERIC_MODES` chaos asked for and not yet carried out (`RankRun` carries it out and clears it)."""
        self._chaos_mtime = 0.0
        self._mode = ""
        self._stacks_file: Any = None

    def start(self) -> RankChannel:
        import faulthandler
        import threading

        self.paths.stacks.parent.mkdir(parents=True, exist_ok=True)
        self._stacks_file = self.paths.stacks.open("a")  # kept open: faulthandler writes to its descriptor
        faulthandler.register(EVIDENCE_SIGNAL, file=self._stacks_file, all_threads=True, chain=False)
        threading.Thread(target=self._answer_requests, name="trainguard-evidence", daemon=True).start()
        self.paths.ready.write_text(str(os.getpid()))
        return self

    def position(self, request: str) -> Position:
        enqueued, completed, name, source = flight_recorder_position()
        inside = in_collective(enqueued, completed, self.ddp_hooked, self.hook_entered, self.hook_completed)
        if self.ddp_hooked:
            source = f"{source}; inside from the DDP hook"
        return Position(request=request, step=self.step, collectives_enqueued=enqueued,
                        collectives_completed=completed, in_collective=inside, collective=name, source=source,
                        chaos=self._mode, extra={"ddp_hooked": self.ddp_hooked, "hook_entered": self.hook_entered,
                                                 "hook_completed": self.hook_completed,
                                                 "fingerprinted": self.fingerprinted})

    def _answer_requests(self) -> None:
        import time

        answered = ""
        while True:
            try:
                request = self.paths.request.read_text().strip()
            except OSError:
                request = ""
            if request and request != answered:
                write_atomic(self.paths.answer, self.position(request).to_json())
                answered = request
            time.sleep(REQUEST_POLL_S)

    # ------------------------------------------------------------------------------------- chaos
    def on_step(self, step: int) -> None:
        """Called at every reported step: note it, and carry out a chaos hang the agent asked for."""
        self.step = step
        try:
            mtime = self.paths.chaos.stat().st_mtime
        except OSError:
            return
        if mtime == self._chaos_mtime:
            return
        self._chaos_mtime = mtime
        try:
            mode = json.loads(self.paths.chaos.read_text())["mode"]
        except (OSError, ValueError, KeyError):
            return
        if mode in NUMERIC_MODES:
            self.numeric_chaos = mode
            return
        self._mode = mode
        if mode == "python":
            hang_in_python()
        elif mode == "io":
            hang_in_io()
        elif mode == "skip-collective":
            self.skip_collectives = True

    def allreduce_hook(self, state, bucket):  # DDP refuses other annotations
        """DDP comm hook: torch's own all-reduce (numerics unchanged), skipped once chaos says so."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self.skip_collectives:
            skip_collective()
        future = allreduce_hook(state, bucket)
        self.hook_entered += 1
        return future.then(self._hook_done)

    def _hook_done(self, future):
        """The all-reduce's result came back (or failed): the rank is out of it. Passes the value on as is."""
        self.hook_completed += 1
        return future.value()


def skip_collective() -> None:
    """chaos hang --mode skip-collective: the rank never issues the all-reduce its peers have entered, and
    waits in its backward pass for a result that cannot come (a collective skipped on one rank only)."""
    import threading

    threading.Event().wait()  # never returns


def hang_in_python() -> None:
    """chaos hang --mode python: a deadlock, the lock taken twice; the process stays alive and sleeping."""
    import threading

    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns


def hang_in_io() -> None:
    """chaos hang --mode io: a read from a pipe whose writer never writes (a stuck mount or socket)."""
    reader, _writer = os.pipe()
    os.read(reader, 1)  # never returns
