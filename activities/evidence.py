"""Node-agent side of hang evidence: ask every local rank for its stacks and collective position before
anything is stopped, and keep the full stacks with the run in the store. The channel itself (files, signal,
shapes) is `trainguard.evidence`; chaos hangs carried out through it are `activities.chaos.inject_hang`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from temporalio import activity

from activities import names
from activities.models import CollectEvidenceInput, CollectEvidenceResult, RankEvidence, WatchCheckpoints
from trainguard import evidence as channel
from trainguard.procs import state as process_state
from trainguard.protocol import RunLayout
from trainguard.safe_files import read_regular, replace_file
from trainguard.redact import redact, redact_model

if TYPE_CHECKING:
    from activities.rank_records import AttemptRecord, RankBook

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 0.5
"""How long the agent waits for its ranks' answers and stack dumps. A helper answers within
`channel.REQUEST_POLL_S`; one that has not by then is stopped, or holds the GIL in C (its state and its stacks,
written by a C-level handler, still tell)."""

STACKS_SETTLE_S = 0.05
"""A stack dump is complete once its file has not grown for this long."""

STACKS_UPLOAD_RETRY_S = 30.0
"""The full stacks are uploaded beside the recovery, never in its way: a store that is out is tried again
for this long, then the stacks stay on the node (its log says where)."""

PEER_HANG_REPORT_DELAY_S = 20.0
"""In a run whose groups stand (thousands of nodes), a watch whose hang evidence shows every local rank waiting in
a collective for a peer holds its report this long, and takes up the run's relaunch instead if it comes first:
the node whose rank is to blame (stopped, outside the collective, not answering) reports at once, and that one
report relaunches the run. When all 4,096 nodes' watches reported at once, their completions, their groups'
reports and the watches started again cost a 4,096-node run 24 s before its relaunch (`make bench-nodes`); a
relaunch there is published within about 10 s and read within `decision_every_s` (4.1 s). A culprit's node that
cannot report (its agent gone) still has the hang reported by its peers, this much later. The held node's full
stacks are in the store already (`evidence_key`)."""

STUCK_STATES = frozenset({"T", "t", "D", "Z"})
"""Process states of a rank that cannot run (stopped, traced, in uninterruptible I/O, defunct)."""


def waits_on_a_peer(evidence: list[RankEvidence]) -> bool:
    """Every local rank answered from inside a collective: this node's ranks wait for a rank elsewhere, and
    nothing here is to blame for the hang."""
    return bool(evidence) and all(e.answered and e.in_collective is True and e.state not in STUCK_STATES
                                  for e in evidence)

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def stacks_key(run_prefix: str, attempt: int, rank: int) -> str:
    """The store key of one rank's stacks for the hang that ended `attempt`: `<run>/incidents/<attempt>/`."""
    return f"{run_prefix.rstrip('/')}/incidents/{attempt}/rank-{rank:05d}.txt"


def innermost_frames(stacks: str) -> str:
    """One line from a faulthandler dump: the main thread's innermost frame and, when that is library code,
    the innermost frame of the script that called it (`train.py:171 in main`).

    faulthandler lists threads newest first, so the main thread is the last block."""
    blocks = [b for b in re.split(r"\n\s*\n|\n(?=(?:Current thread|Thread) 0x)", stacks.strip()) if b.strip()]
    blocks = [b for b in blocks if _FRAME.search(b) or "thread 0x" in b.lower()]
    if not blocks:
        return ""
    frames = [m for m in (_FRAME.match(line) for line in blocks[-1].splitlines()) if m]
    if not frames:
        return ""
    shown = [frames[0]]
    own = next((m for m in frames if not _library(m["file"])), None)
    if own is not None and own is not frames[0]:
        shown.append(own)
    return " < ".join(f"{Path(m['file']).name}:{m['line']} in {m['func']}" for m in shown)


def _library(path: str) -> bool:
    parts = Path(path).parts
    return "site-packages" in parts or "trainguard" in parts or path.startswith("<") or "/lib/python" in path


STACKS_MAX_BYTES = 1 << 20
"""The most the agent reads of one rank's stacks dump: a faulthandler dump is about 3 KiB a thread (100 frames
at most each), so this holds hundreds of threads; a rank whose file grows past it is cut there."""

READY_MAX_BYTES = 64
"""A `ready` file holds a pid."""


def evidence_base(layout: RunLayout, record: AttemptRecord, rank: int) -> Path | None:
    """Where `rank`'s helper keeps its evidence files: where the agent told it to at launch (`evidence_env`), in
    the attempt its process was launched in (a rank carried over by an in-process restart keeps that attempt's),
    never a path the rank wrote (its progress file is its own: it would send root's reads and writes anywhere).
    None when the rank has no evidence channel (its helper wrote no `ready` file there)."""
    proc = record.ranks.get(rank)
    attempt = proc.launch_attempt if proc is not None and proc.launch_attempt else record.attempt
    base = layout.evidence_base(attempt, rank)
    return base if read_regular(channel.Paths(base).ready, READY_MAX_BYTES) is not None else None


def _ready_pid(paths: channel.Paths) -> str:
    data = read_regular(paths.ready, READY_MAX_BYTES)
    return data.decode(errors="replace").strip() if data is not None else ""


def _size(path: Path) -> int:
    """The size of a regular file, never through a link (0 for anything else): `lstat` neither follows nor
    opens, so a FIFO or a device costs nothing."""
    try:
        info = os.lstat(path)
    except OSError:
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0


def _read_from(path: Path, offset: int) -> str:
    """What a rank's helper appended to its stacks file from `offset`, at most `STACKS_MAX_BYTES`: a regular
    file only, never through a link, never blocking (`read_regular`)."""
    data = read_regular(path, STACKS_MAX_BYTES, offset=offset, whole=False)
    return data.decode(errors="replace") if data is not None else ""


def collect_local(node: str, layout: RunLayout, record: AttemptRecord,
                  clock: Callable[[], float] = time.monotonic) -> tuple[list[RankEvidence], dict[int, str]]:
    """Every local rank's evidence, and its full stacks text (rank -> text). Blocking: run it in a thread."""
    request = uuid.uuid4().hex
    asked: dict[int, tuple[channel.Paths, int]] = {}
    states: dict[int, str] = {}
    for rank, proc in sorted(record.ranks.items()):
        states[rank] = "exited" if proc.poll() else (process_state(proc.pid) or "?")
        base = evidence_base(layout, record, rank)
        if base is None:
            continue
        paths = channel.Paths(base)
        offset = _size(paths.stacks)
        try:
            channel.write_atomic(paths.request, request)
        except OSError:
            continue
        asked[rank] = (paths, offset)
        if _ready_pid(paths) == str(proc.pid) and states[rank] not in ("exited", "Z", "T", "t"):
            try:
                os.kill(proc.pid, channel.EVIDENCE_SIGNAL)  # its own process only: the helper's handler
            except ProcessLookupError:
                pass
    deadline = clock() + ANSWER_TIMEOUT_S
    answers: dict[int, channel.Position] = {}
    sizes = {rank: -1 for rank in asked}
    settled_at: dict[int, float] = {}
    while clock() < deadline:
        for rank, (paths, _offset) in asked.items():
            if rank not in answers:
                found = channel.read_answer(paths)
                if found is not None and found.request == request:
                    answers[rank] = found
            size = _size(paths.stacks)
            if size != sizes[rank]:
                sizes[rank], settled_at[rank] = size, clock()
        dumped = all(sizes[r] > asked[r][1] and clock() - settled_at[r] >= STACKS_SETTLE_S for r in asked
                     if states[r] not in ("exited", "Z", "T", "t"))
        if dumped and all(r in answers for r in asked if states[r] not in ("exited", "Z", "T", "t")):
            break
        time.sleep(0.01)
    evidence: list[RankEvidence] = []
    texts: dict[int, str] = {}
    for rank in sorted(record.ranks):
        stacks = _read_from(asked[rank][0].stacks, asked[rank][1]) if rank in asked else ""
        position = answers.get(rank)
        texts[rank] = _stacks_text(node, rank, states[rank], position, stacks)
        evidence.append(RankEvidence(
            node=node, rank=rank, state=states[rank], answered=position is not None,
            step=position.step if position else None,
            collectives_enqueued=position.collectives_enqueued if position else None,
            collectives_completed=position.collectives_completed if position else None,
            in_collective=position.in_collective if position else None,
            collective=position.collective if position else "",
            innermost=innermost_frames(stacks)))
    return evidence, texts


def ask_positions(layout: RunLayout, record: AttemptRecord, ranks: set[int],
                  clock: Callable[[], float] = time.monotonic) -> dict[int, channel.Position | None]:
    """Where each of `ranks` waits, from its helper's evidence thread (no signal, no stacks: a quiet rank is
    asked this while the watch judges it, `activities.rank_activity`). None for a rank that did not answer
    within `ANSWER_TIMEOUT_S` (stopped, holding the GIL in C, or without the evidence channel). Blocking."""
    request = uuid.uuid4().hex
    asked: dict[int, channel.Paths] = {}
    for rank in sorted(ranks):
        base = evidence_base(layout, record, rank)
        if base is None:
            continue
        paths = channel.Paths(base)
        try:
            channel.write_atomic(paths.request, request)
        except OSError:
            continue
        asked[rank] = paths
    answers: dict[int, channel.Position | None] = {rank: None for rank in ranks}
    deadline = clock() + ANSWER_TIMEOUT_S
    while asked and clock() < deadline:
        for rank, paths in list(asked.items()):
            found = channel.read_answer(paths)
            if found is not None and found.request == request:
                answers[rank] = found
                del asked[rank]
        if asked:
            time.sleep(0.01)
    return answers


def _stacks_text(node: str, rank: int, state: str, position: channel.Position | None, stacks: str) -> str:
    head = [f"rank {rank} on {node}, process state {state}"]
    if position is None:
        head.append("no answer to the position request (stopped, exited, or holding the GIL in C)")
    else:
        head.append(f"step {position.step}; collectives entered {position.collectives_enqueued}, completed "
                    f"{position.collectives_completed}, inside one: {position.in_collective} "
                    f"({position.collective or '-'}; {position.source})")
    return "\n".join(head) + "\n\n" + (stacks.strip() or "(no stacks: the rank could not run its handler)") + "\n"


class EvidenceActivities:
    """Hang evidence on one node; reads the attempts in the node's `RankBook`."""

    def __init__(self, book: RankBook, uploader: Callable[[str, str, str], None] | None = None) -> None:
        self.book = book
        self.uploader = uploader or _put_text
        """(bucket, key, text): a PUT to the store."""
        self._uploads: set[asyncio.Task[None]] = set()

    @activity.defn(name=names.COLLECT_EVIDENCE)
    async def collect_evidence(self, request: CollectEvidenceInput) -> CollectEvidenceResult:
        """Every local rank's stacks and collective position, before anything is stopped. Idempotent: a
        retry asks again (the ranks are still where they were, or gone)."""
        record = self.book.record(request.workflow_id)
        if record is None or record.attempt != request.attempt:
            return CollectEvidenceResult(node=self.book.node)
        layout = RunLayout.of(self.book.workdir, request.workflow_id)
        found = await self.gather(record, layout, request.bucket, request.run_prefix)
        # Redacted like a watch's event: a rank names its own frames, and the result goes to the history.
        return redact_model(CollectEvidenceResult(node=self.book.node, ranks=found))

    async def for_watch(self, record: AttemptRecord, layout: RunLayout,
                        target: WatchCheckpoints | None) -> list[RankEvidence]:
        """`RankWatch.hang_evidence`: the evidence a watch that judged a hang returns with its event, the
        stacks stored where the run's checkpoints are."""
        return await self.gather(record, layout, target.bucket if target else None,
                                 target.run_prefix if target else "")

    async def gather(self, record: AttemptRecord, layout: RunLayout, bucket: str | None,
                     run_prefix: str) -> list[RankEvidence]:
        """Every local rank's evidence; its full stacks kept on the node (in a folder only the agent writes)
        and, with `bucket`, uploaded beside. Both redacted: a rank's frames and what it appended are its own text,
        and the agent's secrets or a token the rank printed must not reach the store."""
        found, texts = await asyncio.to_thread(collect_local, self.book.node, layout, record)
        for item in found:
            text = redact(texts[item.rank])
            local = layout.incident_file(record.attempt, item.rank)
            try:
                local.parent.mkdir(parents=True, exist_ok=True)
                replace_file(local, text.encode())
            except OSError as error:
                log.warning("stacks of rank %d not kept at %s: %s", item.rank, local, error)
            if bucket:
                item.stacks_key = stacks_key(run_prefix, record.attempt, item.rank)
                task = asyncio.ensure_future(self._upload(bucket, item.stacks_key, text, local))
                self._uploads.add(task)
                task.add_done_callback(self._uploads.discard)
        return found

    async def _upload(self, bucket: str, key: str, text: str, local: Path) -> None:
        until = time.monotonic() + STACKS_UPLOAD_RETRY_S
        while True:
            try:
                await asyncio.to_thread(self.uploader, bucket, key, text)
                return
            except Exception as error:  # noqa: BLE001 - the store's any failure: retry, then keep it local
                if time.monotonic() > until:
                    log.warning("stacks for s3://%s/%s not uploaded (%s); kept at %s", bucket, key, error, local)
                    return
                await asyncio.sleep(2.0)


def _put_text(bucket: str, key: str, text: str) -> None:
    from trainguard.settings import s3_client

    s3_client().put_object(Bucket=bucket, Key=key, Body=text.encode(), ContentType="text/plain; charset=utf-8")


def evidence_env(layout: RunLayout, attempt: int, rank: int, spec_env: dict[str, Any]) -> dict[str, str]:
    """What a rank's environment gets for the evidence channel: its base path, and the Flight Recorder on
    unless the spec set its size itself."""
    env = {channel.BASE_ENV: str(layout.evidence_base(attempt, rank))}
    if channel.FR_BUFFER_ENV not in spec_env:
        env[channel.FR_BUFFER_ENV] = channel.FR_BUFFER_DEFAULT
    return env
