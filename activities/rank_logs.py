"""A rank's own words about why it failed: the tail of its log, and a signature of the failure in it.

A rank's stdout and stderr go to `$TRAINGUARD_HOME/nodes/<node>/runs/<run>/attempt-NNNN/logs/rank-NNNNN.log`
on its node (`RunLayout.log_file`). When a rank exits, the node agent reads the end of that file so the
incident carries the traceback instead of only `exited with code 1`, and a signature of the failure (the
exception line and the frame that raised it), so the run can tell a script that fails the same way on every
attempt from a fault a relaunch fixes.
"""

from __future__ import annotations

import re
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from trainguard.error_types import ErrorType
from trainguard.redact import redact
# The read's models are the client's too: defined in trainguard.models, re-exported here.
from trainguard.models import LOG_CHUNK_MAX_BYTES, ReadRankLogInput, ReadRankLogResult  # noqa: F401 - re-exported

TAIL_MAX_LINES = 20
"""Lines of a rank's log an incident carries: a Python traceback of a few frames and its exception."""
TAIL_MAX_BYTES = 2048
"""...and at most this many bytes of them: incidents travel in the status query, the result and every
continue-as-new, whose payloads Temporal warns about past 256 KB."""

_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$")
"""`ValueError: bad shape`, `torch.OutOfMemoryError: ...`, `KeyboardInterrupt`: how Python ends a traceback."""
_FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")
"""torch prefixes what a rank prints after its process group is up with `[rank1]: ` (`[default1]:` under
torchrun's log tee)."""
_VOLATILE = re.compile(r"0x[0-9a-fA-F]+|\b\d{4,}\b|\[[0-9a-fA-F:.]+\]:\d+")
"""Parts of a message that differ between attempts of the same failure: addresses, pids, ports."""
SIGNATURE_MAX_CHARS = 300


def read_tail(path: Path, max_lines: int = TAIL_MAX_LINES, max_bytes: int = TAIL_MAX_BYTES) -> str:
    """The last `max_lines` lines of `path`, at most `max_bytes` of them (cut at a line start), as text,
    redacted (`trainguard.redact`: a rank may print any secret it finds, and the tail goes to the history);
    empty when the file is missing or unreadable (a log is evidence, never a reason to fail a watch)."""
    return redact(_tail(path, max_lines, max_bytes))


def _tail(path: Path, max_lines: int, max_bytes: int) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes * 4))
            data = handle.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", errors="replace").splitlines()[-max_lines:]
    while lines and len("\n".join(lines).encode()) > max_bytes:
        lines = lines[1:]
    if not lines and data:  # one line longer than max_bytes: its end
        return data.decode("utf-8", errors="replace")[-max_bytes:].strip()
    return "\n".join(lines).strip("\n")


def failure_signature(tail: str) -> str | None:
    """What identifies this failure across attempts: the last exception line of the traceback in `tail`,
    with the innermost frame before it (`train.py:87 in main: ValueError: loss is nan`), addresses, pids and
    ports masked. None when the tail holds no Python exception (a signal, a silent exit): nothing shows that
    a relaunch would fail the same way."""
    lines = [_RANK_PREFIX.sub("", line.rstrip()) for line in tail.splitlines()]
    for index in range(len(lines) - 1, -1, -1):
        line = lines[index].strip()
        if not _EXCEPTION_LINE.match(line):
            continue
        frame = next((m for m in (_FRAME_LINE.match(x) for x in reversed(lines[:index])) if m), None)
        if frame is None:
            return None  # a line that looks like an exception, outside any traceback: a log message
        where = f"{Path(frame['file']).name}:{frame['line']} in {frame['func']}"
        return _VOLATILE.sub("N", f"{where}: {line}")[:SIGNATURE_MAX_CHARS]
    return None


def exception_line(tail: str) -> str | None:
    """The last exception line of the traceback in `tail` (`ValueError: loss is nan`), for an incident's
    one-line detail."""
    for line in reversed(tail.splitlines()):
        line = _RANK_PREFIX.sub("", line.strip())
        if _EXCEPTION_LINE.match(line):
            return line[:SIGNATURE_MAX_CHARS]
    return None


# ------------------------------------------------------------------------- reading a log from its node

class RankLogActivities:
    """Reads a rank's log on its node for `trainguard run logs` (the files never leave the node otherwise)."""

    def __init__(self, node: str, workdir: Path) -> None:
        self.node = node
        self.workdir = workdir

    @activity.defn(name=names.READ_RANK_LOG)
    async def read_rank_log(self, request: ReadRankLogInput) -> ReadRankLogResult:
        """A chunk of one rank's log: read-only, so any retry is harmless."""
        from trainguard.protocol import RunLayout

        layout = RunLayout.of(self.workdir, request.workflow_id)
        attempt = request.attempt
        if attempt is None:
            found = sorted(int(p.parent.parent.name.removeprefix("attempt-"))
                           for p in layout.root.glob(f"attempt-*/logs/{layout.log_file(1, request.rank).name}"))
            if not found:
                raise ApplicationError(f"node {self.node} has no log of rank {request.rank} of {request.workflow_id}",
                                       type=ErrorType.NO_SUCH_LOG, non_retryable=True)
            attempt = found[-1]
        path = layout.log_file(attempt, request.rank)
        try:
            with path.open("rb") as handle:
                size = handle.seek(0, 2)
                start = (max(0, size - request.tail_bytes) if request.tail_bytes is not None
                         else min(request.offset, size))
                handle.seek(start)
                data = handle.read(request.max_bytes)
        except FileNotFoundError:
            raise ApplicationError(f"node {self.node} has no log of rank {request.rank} of {request.workflow_id} "
                                   f"attempt {attempt} ({path})",
                                   type=ErrorType.NO_SUCH_LOG, non_retryable=True) from None
        # Redacted: the chunk is this activity's result, in the history of whatever asked for it. Offsets stay
        # the file's.
        return ReadRankLogResult(node=self.node, rank=request.rank, path=str(path), attempt=attempt,
                                 text=redact(data.decode("utf-8", errors="replace")),
                                 next_offset=start + len(data), size=size)
