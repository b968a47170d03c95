"""The watch: `watch_ranks` follows this node's ranks and returns on the first event (exit, hang, checkpoint
ready, all finished); beside it, it uploads the complete steps and, for a relaunch, downloads and launches first.

What the watch judges (is a rank hung, which steps are complete, which exit is a failure) is pure, in
`activities.progress`; this module reads the files and processes those judgements need.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from activities.evidence import PEER_HANG_REPORT_DELAY_S, waits_on_a_peer
from activities.health import GpuActivity, NodeHealth
from activities.models import (
    AttemptDecision,
    DownloadShardsInput,
    DownloadShardsResult,
    LaunchRanksInput,
    NodeCheckpointRecord,
    RankEvidence,
    RequestCheckpointInput,
    RequestCheckpointResult,
    WatchCheckpoints,
    WatchEvent,
    WatchEventKind,
    WatchRanksInput,
)
from activities.chaos import inject_numeric
from activities.evidence import ask_positions
from activities.fingerprint_models import FingerprintRecord
from activities.fingerprints import write_interval_s
from activities.progress import (
    COLLECTIVE_WAIT_GRACE_S,
    RankReport,
    complete_steps,
    failed_rank,
    new_fingerprints,
    numerical_fault,
    fault_time,
    first_step_time,
    process_state_words,
    slowest_step,
)
from activities.rank_activity import AttemptActivity, GapBook, describe, hung as hung_rank
from activities.pace import PaceWindow
from activities.pace_models import PaceRecord
from activities.rank_launch import RankLaunch
from activities.rank_logs import exception_line, failure_signature, read_tail
from activities.rank_records import AttemptRecord, RankBook, describe_exit, log, read_finish, read_report
from trainguard import protocol
from trainguard.error_types import ErrorType
from trainguard.faults import FaultKind
from trainguard.models import short_cause
from trainguard.procs import state as process_state
from trainguard.protocol import RunLayout
from trainguard.redact import redact_model

Uploader = Callable[[str, int, WatchCheckpoints, int, "dict[int, float]", int, str], Awaitable[NodeCheckpointRecord]]
"""(workflow id, attempt, where, step, rank compute times, node step, chain id) -> the node record written."""
Downloader = Callable[[DownloadShardsInput], Awaitable[DownloadShardsResult]]
Decisions = Callable[[WatchCheckpoints], AttemptDecision | None]
"""Reads the run's newest `AttemptDecision` from the store, blocking (`NodeCheckpointActivities.read_decision`)."""
Pacer = Callable[[WatchCheckpoints, PaceRecord], Awaitable[None]]
"""Writes this node's `PaceRecord` to the store (`NodeCheckpointActivities.write_pace`)."""
Fingerprinter = Callable[[WatchCheckpoints, FingerprintRecord], Awaitable[None]]
"""Writes this node's `FingerprintRecord` to the store (`NodeCheckpointActivities.write_fingerprints`)."""
HangEvidence = Callable[[AttemptRecord, RunLayout, WatchCheckpoints | None], Awaitable[list[RankEvidence]]]

UPLOAD_ERROR_REPORT_S = 60.0
"""A node whose uploads keep failing tells its run (a KEEPALIVE with `upload_error`) at most this often: the
run's status names the error within a minute, and a long outage costs its history one event per node a minute."""

UPLOAD_RETRY_S = 5.0
"""A watch's upload that failed on a store error is tried again after this long (the store may be out;
the committer waits for the step meanwhile)."""

FINAL_UPLOAD_MARGIN_S = 30.0
"""A finished node retries its last uploads against a store that is out until this long past the watch's
`max_duration_s` (its start-to-close timeout leaves 60 s): the last checkpoint is the one a rerun resumes from."""

DOWNLOAD_RETRY_INITIAL_S = 2.0
DOWNLOAD_RETRY_MAX_S = 30.0
"""A watch that launches retries a download the store fails as the transfer policy would (2 s doubling to
30 s): an outage heals; bad bytes (a non-retryable error) never do, and fail the watch at once."""


def _log_fields(log_path: Path, rank: int, exit_code: int | None, reported: str | None = None) -> dict[str, object]:
    """What a rank's exit event says about it from its log: the tail, and, for an exit the rank chose (a
    positive code: an exception, `sys.exit`), the failure's signature and its exception in the detail. An
    error the rank helper itself reported (`reported`, e.g. a checkpoint step it skipped) is named first."""
    tail = read_tail(log_path)
    chosen = exit_code is not None and exit_code > 0
    exception = reported or (exception_line(tail) if chosen else None)
    if exception:
        exception = short_cause(exception)  # the whole error is in the tail
    detail = f"rank {rank} {describe_exit(exit_code)}" + (f": {exception}" if exception else "")
    return {"detail": detail, "log_path": str(log_path), "log_tail": tail,
            "failure_signature": failure_signature(tail) if chosen else None}



def _upload_key(record: AttemptRecord, step: int) -> tuple[str, str, int, int]:
    """An upload is one step of one attempt of one run: a rerun of a closed workflow id starts again at attempt
    1, and its chain id tells its uploads from the earlier run's."""
    return record.workflow_id, record.chain_id, record.attempt, step



class RankWatch:
    """Watch a run's attempt on this node, with the checkpoint transfers the watch carries."""

    def __init__(self, book: RankBook, launch: RankLaunch, health: NodeHealth | None = None,
                 uploader: Uploader | None = None, downloader: Downloader | None = None,
                 decisions: Decisions | None = None, hang_evidence: HangEvidence | None = None,
                 pacer: Pacer | None = None, fingerprinter: Fingerprinter | None = None) -> None:
        self.book = book
        self.node = book.node
        self.launch = launch
        """The node's launch: a relaunch's watch launches its ranks itself."""
        self.health = health or NodeHealth()
        self.uploader = uploader
        """Uploads a complete local step and writes its node record (`NodeCheckpointActivities.upload_step`)."""
        self.downloader = downloader
        """Downloads the shards a launch restores from (`NodeCheckpointActivities.download_shards`)."""
        self.decisions = decisions
        """A watch that follows decisions takes up a relaunch the run published in the store."""
        self.hang_evidence = hang_evidence
        """`EvidenceActivities.for_watch`: a watch that judges a hang takes its ranks' evidence with it."""
        self.pacer = pacer
        """Writes the node's ranks' pace once a straggler window, for the committer to compare."""
        self._pace: dict[str, tuple[str, int, PaceWindow]] = {}
        """Run -> (chain, attempt, its window): outlives the watches of one attempt."""
        self._pace_writes: dict[str, asyncio.Task[None]] = {}
        self.fingerprinter = fingerprinter
        """Writes the node's ranks' newest fingerprints when new ones come, for the committer to compare replicas."""
        self._fingerprints: dict[str, tuple[str, int, dict[int, int], float]] = {}
        """Run -> (chain, attempt, rank -> newest fingerprinted step written, monotonic time of that write)."""
        self._fingerprint_writes: dict[str, asyncio.Task[None]] = {}
        self._flips: set[asyncio.Task[None]] = set()
        self._uploads: dict[tuple[str, str, int, int], asyncio.Task[NodeCheckpointRecord]] = {}
        """`_upload_key` -> its upload, started by a watch and outliving it."""
        self._upload_failed_at: dict[tuple[str, str, int, int], float] = {}
        self._upload_error: dict[str, str] = {}
        """Run -> the last failed upload's error, until an upload of the run succeeds."""
        self._upload_error_told: dict[str, float] = {}
        """Run -> when a watch last told the run of it (monotonic)."""
        self.gpu_activity = GpuActivity()
        """Which rank processes NVML saw using a GPU lately: a quiet rank whose kernels run is busy."""
        self._gaps: dict[str, GapBook] = {}
        """Run -> the gaps between steps its ranks here took, learned (outlives the watches of one attempt)."""
        self._activity: dict[str, tuple[str, int, AttemptActivity]] = {}
        """Run -> (chain, attempt, what its quiet ranks here are doing)."""

    @activity.defn(name=names.WATCH_RANKS)
    async def watch_ranks(self, request: WatchRanksInput) -> WatchEvent:
        """Watch this node's ranks; return on the first event (exit, hang, checkpoint ready, all finished).
        With `request.launch`, launch the attempt's ranks here first (downloading their shards first with
        `request.download`), unless this node already runs that attempt."""
        if request.launch is not None:
            await self._launch_from_watch(request, request.launch)
        record = self.book.record(request.workflow_id)
        follow = request.follow_decisions and request.checkpoints is not None
        # A watch that follows decisions watches whatever attempt of the run the node runs: an older one until it
        # takes up the newer (a watch started again just before its node read the decision), a newer one on.
        if record is None or (record.attempt != request.attempt and not follow):
            raise ApplicationError(
                f"node {self.node} has no ranks of {request.workflow_id} attempt {request.attempt}",
                type=ErrorType.NO_SUCH_ATTEMPT,
                non_retryable=True,
            )
        layout = RunLayout.of(self.book.workdir, request.workflow_id)
        health = request.health
        started = time.monotonic()
        next_gpu_check = started + health.gpu_check_interval_s
        alive_reported = -1
        local_ranks = set(record.ranks)
        next_heartbeat = started + request.first_heartbeat_s()
        next_decision = started
        report_start = request.report_start
        decision: AttemptDecision | None = None
        held: tuple[AttemptRecord, float, WatchEvent] | None = None
        """A hang whose evidence shows this node's ranks waiting for a peer's, held until the time given."""
        while True:
            if activity.is_worker_shutdown():
                # Said before its ranks stop with it: their exits must not read as a crash, nor the agent's
                # absence as a lost node. The run waits for the agent to come back.
                raise ApplicationError(f"node agent on {self.node} is shutting down (an upgrade or a restart)",
                                       time.time(), type=ErrorType.AGENT_SHUTDOWN, non_retryable=True)
            read_now = follow and time.monotonic() >= next_decision
            if read_now:
                assert request.checkpoints is not None
                next_decision = time.monotonic() + request.decision_every_s
                decision = await self._read_decision(request.checkpoints)
                if decision is not None and self._takes_up(decision, record):
                    await self._take_up(request, decision, record)
            latest = self.book.record(request.workflow_id) if follow else None
            if latest is not None and latest is not record and latest.attempt > record.attempt:
                # A newer attempt launched here (taken up just above, or by the master's own launch): watch it.
                assert request.checkpoints is not None
                launched_here = record.attempt
                record, local_ranks, alive_reported = latest, set(latest.ranks), -1
                if not read_now:  # launched by the master's own activity: is the decision out yet?
                    decision = await self._read_decision(request.checkpoints)
                report_start = (decision is None or decision.attempt < record.attempt
                                or self.node in (decision.starters or ()))
                log.info("%s: watch of attempt %d follows attempt %d", request.workflow_id, launched_here,
                         record.attempt)
            if follow and request.after_attempt is not None and record.attempt <= request.after_attempt:
                # Reported already: wait for the next attempt, heartbeating, or for the word that it is not ours.
                if time.monotonic() >= next_heartbeat:
                    next_heartbeat = time.monotonic() + (request.heartbeat_every_s or 0.0)
                    activity.heartbeat(protocol.WatchHeartbeat(node=self.node, attempt=record.attempt).to_json())
                leaving = decision is not None and decision.attempt > record.attempt and self.node in decision.leaving
                if leaving or time.monotonic() - started > request.max_duration_s:
                    return WatchEvent(kind=WatchEventKind.KEEPALIVE, node=self.node, detected_at=time.time(),
                                      attempt=record.attempt)
                await asyncio.sleep(min(health.poll_interval_s, request.decision_every_s))
                continue
            now = time.time()
            reports = {r: read_report(layout.progress_file(record.attempt, r)) for r in local_ranks}
            watching = self._attempt_activity(record, request)
            if record.first_step_at is None:
                record.first_step_at = first_step_time(reports, record.start_step)
            node_step = slowest_step(reports, record.start_step)
            if request.checkpoints is not None:
                self._keep_pace(record, request.checkpoints, health.straggler_window_s, reports, node_step, now)
                self._keep_fingerprints(record, request.checkpoints, health.straggler_window_s, reports, now)
            if self.health.flips_bits:
                self._flip_again(record, layout, reports)
            if time.monotonic() >= next_heartbeat:  # a large run's watches heartbeat less often
                next_heartbeat = time.monotonic() + (request.heartbeat_every_s or 0.0)
                activity.heartbeat(protocol.WatchHeartbeat(
                    node=self.node, attempt=record.attempt,
                    steps={r: (rep.step if rep else None) for r, rep in reports.items()},
                    phases={r: describe(v) for r, v in watching.long_phases().items()}).to_json())

            def event(kind: WatchEventKind, **fields: object) -> WatchEvent:
                # Redacted of the agent's secrets and secret-looking values: ranks write what its texts carry.
                return redact_model(WatchEvent(
                    kind=kind, node=self.node, detected_at=now, first_step_at=record.first_step_at, step=node_step,  # noqa: B023 - called in this turn only
                    restore_tiers=record.restore_tiers, attempt=record.attempt if follow else None,  # noqa: B023 - as above
                    gaps=dict(watching.gaps.gaps), **fields))  # noqa: B023 - as above

            ready = complete_steps(self._saved_steps(layout), local_ranks, max(request.reported_step,
                                                                                 record.start_step))
            compute = {r: rep.compute_s for r, rep in reports.items() if rep is not None and rep.compute_s}
            if ready and request.checkpoints is None:
                return event(WatchEventKind.CHECKPOINT_READY, checkpoint_steps=ready, rank_compute_s=compute)
            if ready and request.checkpoints is not None:
                self._upload_ready(record, request.checkpoints, ready, compute, node_step)
            if report_start and record.first_step_at is not None:
                # Whether the script parks: the run then parks its processes on its spares too.
                return event(WatchEventKind.STARTED,
                             standby=protocol.StandbyMark.read(layout.standby_mark(record.attempt)) is not None)

            if self.health.injected is not None or time.monotonic() >= next_gpu_check:
                next_gpu_check = time.monotonic() + health.gpu_check_interval_s
                gpu = await asyncio.to_thread(self.health.check)
                if gpu.available and not gpu.healthy:
                    return event(WatchEventKind.GPU_UNHEALTHY, detail=gpu.detail,
                                 fault_at=self.health.injected_at)

            failed = failed_rank({r: record.ranks[r].exit_code for r in sorted(local_ranks)
                                  if record.ranks[r].poll()}, reports)
            if failed is not None:
                proc, report = record.ranks[failed], reports[failed]
                return event(WatchEventKind.RANK_EXITED, rank=failed, exit_code=proc.exit_code,
                             fault_at=fault_time(record.faults.get(failed), report, record.launched_at),
                             occurred_at=record.faults.get(failed) or proc.exited_at,
                             **_log_fields(layout.log_file(record.attempt, failed), failed, proc.exit_code,
                                           report.error if report else None))

            numerical = numerical_fault(reports)
            if numerical is not None:
                rank, fault = numerical
                # When the rank saw it: a NaN spreads through the next all-reduce, so peers see theirs a step
                # later, and the earliest is the step to roll back past.
                return event(WatchEventKind.NUMERICAL_FAULT, rank=rank, fault_step=int(fault["step"]),
                             fault_at=record.faults.get(rank),
                             occurred_at=record.faults.get(rank) or fault.get("at") or now,
                             detail=f"rank {rank} at step {fault['step']}: {fault['detail']}")

            if all(record.ranks[r].poll() for r in local_ranks):
                # Every rank here is done: nothing is left for a standby to replace, nor to relaunch warm.
                await self.book.stop_standby(record)
                await self.book.close_parking(record.workflow_id)
                first = min(local_ranks)
                finish = read_finish(layout.progress_file(record.attempt, first))
                if request.checkpoints is not None:  # FINISHED: the node's checkpoints are in the store
                    await self._upload_all(record, request.checkpoints, ready, compute, node_step,
                                           until=started + request.max_duration_s + FINAL_UPLOAD_MARGIN_S)
                return event(WatchEventKind.FINISHED, state_digest=finish.digest,
                             mean_step_s=finish.mean_step_s, phase_s=self._phase_times(layout, record))

            record.last_watched = time.monotonic()
            running = {r for r in local_ranks if not record.ranks[r].poll()}
            if len(running) != alive_reported:
                alive_reported = len(running)
                activity.metric_meter().create_gauge("trainguard_ranks_alive", "Rank processes alive").set(
                    alive_reported, {"node": self.node})
            if held is not None and held[0] is record:  # its report held: sent once due, or the relaunch came
                if time.monotonic() >= held[1]:
                    return held[2]
                await asyncio.sleep(min(health.poll_interval_s, request.decision_every_s))
                continue
            states = {r: process_state(record.ranks[r].pid) for r in running}
            verdicts = await watching.judge(
                reports, {r: record.ranks[r].pid for r in running}, states, record.start_step, record.launched_at,
                now, health,
                lambda ranks: ask_positions(layout, record, ranks),  # noqa: B023 - asked in this turn only
                grace_s=0.0 if request.evidence else COLLECTIVE_WAIT_GRACE_S)
            hung = hung_rank(verdicts)
            if hung is not None:
                rank, silent = hung
                report = reports[rank]
                state = process_state_words(states[rank])
                fault_at = fault_time(record.faults.get(rank), report, record.launched_at)
                log_path = layout.log_file(record.attempt, rank)
                evidence = (await self.hang_evidence(record, layout, request.checkpoints)
                            if request.evidence_with_event and self.hang_evidence is not None else [])
                found = event(WatchEventKind.HANG, rank=rank, fault_at=fault_at, evidence=evidence,
                              occurred_at=record.faults.get(rank), log_path=str(log_path),
                              log_tail=read_tail(log_path),
                              detail=f"rank {rank} made no progress for {silent:.1f}s (last step "
                                     f"{report.step if report else 'none'}; process {state}; "
                                     f"{verdicts[rank].where or 'idle outside any collective'})")
                if not (follow and waits_on_a_peer(evidence)):
                    return found
                log.info("%s: attempt %d hangs, every rank here waits for a peer: reported in %.0fs unless the "
                         "run relaunches first", request.workflow_id, record.attempt, PEER_HANG_REPORT_DELAY_S)
                held = (record, time.monotonic() + PEER_HANG_REPORT_DELAY_S, found)
                continue

            trouble = self._upload_trouble(record.workflow_id)
            if trouble is not None:
                return event(WatchEventKind.KEEPALIVE, upload_error=trouble)
            if time.monotonic() - started > request.max_duration_s:
                return event(WatchEventKind.KEEPALIVE)
            await asyncio.sleep(health.poll_interval_s)

    def _attempt_activity(self, record: AttemptRecord, request: WatchRanksInput) -> AttemptActivity:
        """What this attempt's quiet ranks are doing, kept across the watch's polls (and the watches of one
        attempt); its gaps learned across the run's attempts, and from the run's (`learned_gaps`)."""
        gaps = self._gaps.setdefault(f"{record.workflow_id}/{record.chain_id}", GapBook())
        gaps.merge(request.learned_gaps)
        kept = self._activity.get(record.workflow_id)
        if kept is None or kept[:2] != (record.chain_id, record.attempt):
            kept = (record.chain_id, record.attempt, AttemptActivity(gaps, gpu_busy=self.gpu_activity.busy_pids))
            self._activity[record.workflow_id] = kept
        return kept[2]

    @staticmethod
    def _phase_times(layout: RunLayout, record: AttemptRecord) -> dict[str, float]:
        """Seconds in each named phase, the longest local rank's (ranks of one run spend phases together)."""
        times: dict[str, float] = {}
        for rank in record.ranks:
            for name, seconds in (read_finish(layout.progress_file(record.attempt, rank)).phase_s or {}).items():
                times[name] = round(max(seconds, times.get(name, 0.0)), 3)
        return times

    def _keep_pace(self, record: AttemptRecord, target: WatchCheckpoints, window_s: float,
                   reports: dict[int, RankReport | None], node_step: int, now: float) -> None:
        """Sample the ranks' compute per step; once a window, write their means to the store (not awaited: a slow
        store must not hold the watch, and a write still under way skips the window)."""
        if self.pacer is None:
            return
        kept = self._pace.get(record.workflow_id)
        if kept is None or kept[:2] != (record.chain_id, record.attempt):
            kept = (record.chain_id, record.attempt, PaceWindow(window_s, now))
            self._pace[record.workflow_id] = kept
        window = kept[2]
        window.observe(now, reports)
        writing = self._pace_writes.get(record.workflow_id)
        if writing is not None and not writing.done():
            return
        means = window.due(now)
        if means is None:
            return
        pace = PaceRecord(node=self.node, attempt=record.attempt, chain_id=record.chain_id, window_end=now,
                          window_s=window_s, rank_compute_s=means, step=node_step)
        self._pace_writes[record.workflow_id] = asyncio.ensure_future(self._write_pace(target, pace))

    def _keep_fingerprints(self, record: AttemptRecord, target: WatchCheckpoints, window_s: float,
                           reports: dict[int, RankReport | None], now: float) -> None:
        """When a local rank reported a fingerprint newer than the last written, write the ranks' newest to the
        store, at most every `write_interval_s` (not awaited, as the pace)."""
        if self.fingerprinter is None:
            return
        kept = self._fingerprints.get(record.workflow_id)
        if kept is None or kept[:2] != (record.chain_id, record.attempt):
            kept = (record.chain_id, record.attempt, {}, 0.0)
        written, last = kept[2], kept[3]
        writing = self._fingerprint_writes.get(record.workflow_id)
        if (writing is not None and not writing.done()) or time.monotonic() - last < write_interval_s(window_s):
            self._fingerprints[record.workflow_id] = kept
            return
        found = new_fingerprints(reports, written)
        if found is None:
            self._fingerprints[record.workflow_id] = kept
            return
        steps = {rank: max(int(item[0]) for item in items) for rank, items in found.items()}
        self._fingerprints[record.workflow_id] = (record.chain_id, record.attempt, steps, time.monotonic())
        fingerprints = FingerprintRecord(node=self.node, attempt=record.attempt, chain_id=record.chain_id,
                                         written_at=now, ranks=found)
        self._fingerprint_writes[record.workflow_id] = asyncio.ensure_future(
            self._write_fingerprints(target, fingerprints))

    def _flip_again(self, record: AttemptRecord, layout: RunLayout, reports: dict[int, RankReport | None]) -> None:
        """A sick GPU (`chaos bitflip --recurring`): once in each attempt, as soon as a local rank fingerprinted
        (its helper has the model to flip a bit of), its first such rank flips one, as chaos `bitflip` does."""
        key = (record.workflow_id, record.chain_id, record.attempt)
        ranks = sorted(r for r, report in reports.items() if report is not None and report.fingerprints)
        if key in self.health.flipped or not ranks:
            return
        self.health.flipped.add(key)
        log.info("chaos: the GPU of %s flips a bit again: rank %d of %s attempt %d", self.node, ranks[0],
                 record.workflow_id, record.attempt)
        flip = asyncio.ensure_future(self._flip(layout, record, ranks[0]))
        self._flips.add(flip)  # held until done: the loop keeps only a weak reference
        flip.add_done_callback(self._flips.discard)

    async def _flip(self, layout: RunLayout, record: AttemptRecord, rank: int) -> None:
        try:
            await asyncio.to_thread(inject_numeric, layout, record, rank, FaultKind.BITFLIP)
        except Exception as error:  # noqa: BLE001 - chaos: the run goes on without this flip
            log.warning("the recurring bitflip on %s failed: %s", self.node, error)

    async def _write_fingerprints(self, target: WatchCheckpoints, fingerprints: FingerprintRecord) -> None:
        assert self.fingerprinter is not None
        try:
            await self.fingerprinter(target, fingerprints)
        except Exception as error:  # noqa: BLE001 - an outage: the next new fingerprint writes again
            log.warning("writing the fingerprints of %s attempt %d failed: %s", target.run_prefix,
                        fingerprints.attempt, error)

    async def _write_pace(self, target: WatchCheckpoints, pace: PaceRecord) -> None:
        assert self.pacer is not None
        try:
            await self.pacer(target, pace)
        except Exception as error:  # noqa: BLE001 - an outage: the next window writes again
            log.warning("writing the pace of %s attempt %d failed: %s", target.run_prefix, pace.attempt, error)

    async def _read_decision(self, target: WatchCheckpoints) -> AttemptDecision | None:
        """The run's newest decision from the store; None when there is none, or the store cannot say now (the
        watch reads it again at its next turn)."""
        if self.decisions is None:
            return None
        try:
            return await asyncio.to_thread(self.decisions, target)
        except Exception as error:  # noqa: BLE001 - an outage: the next read may answer
            log.warning("reading the run's decision from %s/%s failed: %s", target.bucket, target.run_prefix, error)
            return None

    def _takes_up(self, decision: AttemptDecision, record: AttemptRecord) -> bool:
        """A decision this node takes up in place: of its run (this chain), newer than what it runs, and its own
        to take (not a node leaving the run, nor one launched by an activity of its own)."""
        return (decision.workflow_id == record.workflow_id and decision.chain_id == record.chain_id
                and decision.attempt > record.attempt and self.node not in decision.leaving
                and self.node not in decision.launched and decision.launch is not None)

    async def _take_up(self, request: WatchRanksInput, decision: AttemptDecision, record: AttemptRecord) -> None:
        """Launch the decision's attempt here at this node's rank, downloading its shards first, as a launching
        watch would (the launch stops this node's ranks of older attempts first)."""
        per_node = len(record.ranks)
        node_rank = min(record.ranks) // per_node if per_node else 0
        download = None if decision.download is None else decision.download.model_copy(update={
            "node": self.node, "ranks": list(range(node_rank * per_node, (node_rank + 1) * per_node))})
        log.info("%s: taking up attempt %d in place (node rank %d)", decision.workflow_id, decision.attempt, node_rank)
        assert decision.launch is not None  # `_takes_up`
        await self._launch_from_watch(request.model_copy(update={"download": download}),
                                      decision.launch.model_copy(update={"node": self.node, "node_rank": node_rank}))

    async def _launch_from_watch(self, request: WatchRanksInput, launch: LaunchRanksInput) -> None:
        """The launch a relaunch's watch carries: idempotent by attempt, as `launch_ranks` is (a watch started
        again after a keepalive or a controller restart launches nothing twice)."""
        current = self.book.record(request.workflow_id)
        if current is not None and current.chain_id == launch.chain_id and current.attempt >= launch.attempt:
            return  # launched already; a newer attempt here fails the watch just below (NoSuchAttempt)
        tiers: list[str] = []
        if request.download is not None:
            restored = await self._download_for_launch(request.download, request.download_timeout_s)
            launch = launch.model_copy(update={"restore_dir": restored.restore_dir})
            tiers = sorted(set(restored.tiers.values()))
        await self.launch.launch_ranks(launch)
        record = self.book.record(request.workflow_id)
        if record is not None and tiers:
            record.restore_tiers = tiers
            self.book.save(record)

    async def _download_for_launch(self, request: DownloadShardsInput, timeout_s: float) -> DownloadShardsResult:
        """Download as `download_shards` does, heartbeating the watch meanwhile (one shard can take longer
        than the watch's heartbeat timeout), retrying what the store fails until `timeout_s`."""
        if self.downloader is None:
            raise ApplicationError(f"node {self.node} has no checkpoint tier to restore from",
                                   type=ErrorType.NO_LOCAL_SHARDS, non_retryable=True)
        deadline, delay = time.monotonic() + timeout_s, DOWNLOAD_RETRY_INITIAL_S
        while True:
            task = asyncio.ensure_future(self.downloader(request))
            while not task.done():
                activity.heartbeat(protocol.WatchHeartbeat(node=self.node, attempt=request.attempt,
                                                           downloading=True).to_json())
                await asyncio.wait([task], timeout=1.0)
            error = task.exception()
            if error is None:
                return task.result()
            if (isinstance(error, ApplicationError) and error.non_retryable) or time.monotonic() + delay > deadline:
                raise error
            log.warning("download for attempt %d of %s failed, retrying in %.0fs: %s", request.attempt,
                        request.workflow_id, delay, error)
            resume = time.monotonic() + delay
            while time.monotonic() < resume:  # the watch's heartbeat timeout is shorter than the backoff
                activity.heartbeat(protocol.WatchHeartbeat(node=self.node, attempt=request.attempt,
                                                           downloading=True).to_json())
                await asyncio.sleep(min(1.0, resume - time.monotonic()))
            delay = min(DOWNLOAD_RETRY_MAX_S, delay * 2)

    def _upload_ready(self, record: AttemptRecord, target: WatchCheckpoints, steps: list[int],
                      compute: dict[int, float], node_step: int) -> None:
        """Start the upload of every complete local step not uploaded yet (or whose upload failed more than
        `UPLOAD_RETRY_S` ago and can heal). The upload runs beside the watch, which keeps polling."""
        if self.uploader is None:
            return
        for old in [k for k, t in self._uploads.items() if k[0] == record.workflow_id and t.done()
                    and k[1:3] != (record.chain_id, record.attempt)]:
            del self._uploads[old]  # an earlier attempt's: nothing asks about it again
            self._upload_failed_at.pop(old, None)
        for step in steps:
            key = _upload_key(record, step)
            task = self._uploads.get(key)
            if task is not None and not task.done():
                continue
            if task is not None:
                error = task.exception()
                if error is None:
                    continue
                if isinstance(error, ApplicationError) and error.non_retryable:
                    continue  # bad bytes never heal: the step stays uncommitted, an older one restores
                if time.monotonic() - self._upload_failed_at.get(key, 0.0) < UPLOAD_RETRY_S:
                    continue
            self._uploads[key] = asyncio.ensure_future(self._upload(record, target, step, compute, node_step))

    async def _upload(self, record: AttemptRecord, target: WatchCheckpoints, step: int,
                      compute: dict[int, float], node_step: int) -> NodeCheckpointRecord:
        assert self.uploader is not None
        key = _upload_key(record, step)
        try:
            uploaded = await self.uploader(record.workflow_id, record.attempt, target, step, compute, node_step,
                                           record.chain_id)
        except BaseException as error:
            self._upload_failed_at[key] = time.monotonic()
            if not isinstance(error, asyncio.CancelledError):
                self._upload_error[record.workflow_id] = f"{type(error).__name__}: {error}"[:300]
            log.warning("upload of step %d of %s attempt %d failed: %s", step, record.workflow_id,
                        record.attempt, error)
            raise
        self._upload_error.pop(record.workflow_id, None)
        return uploaded

    def _upload_trouble(self, workflow_id: str) -> str | None:
        """The run's failing uploads, when it is time to tell the run again (`UPLOAD_ERROR_REPORT_S`)."""
        error = self._upload_error.get(workflow_id)
        told = self._upload_error_told.get(workflow_id)
        if error is None or (told is not None and time.monotonic() - told < UPLOAD_ERROR_REPORT_S):
            return None
        self._upload_error_told[workflow_id] = time.monotonic()
        return error

    async def _upload_all(self, record: AttemptRecord, target: WatchCheckpoints, steps: list[int],
                          compute: dict[int, float], node_step: int, until: float) -> None:
        """The ranks are done: upload every complete step not uploaded yet, retrying a store that is out
        until `until` (monotonic), heartbeating meanwhile, so the run's last checkpoint is not lost to an
        outage that ends after its last step."""
        while time.monotonic() < until:
            self._upload_ready(record, target, steps, compute, node_step)
            tasks = [self._uploads[key] for key in (_upload_key(record, s) for s in steps) if key in self._uploads]
            pending = [t for t in tasks if not t.done()]
            retryable = [t for t in tasks if t.done() and (error := t.exception()) is not None
                         and not (isinstance(error, ApplicationError) and error.non_retryable)]
            if not pending and not retryable:
                return
            activity.heartbeat(protocol.WatchHeartbeat(node=self.node, attempt=record.attempt,
                                                       uploading=len(pending)).to_json())
            if pending:
                await asyncio.wait(pending, timeout=1.0)
            else:
                await asyncio.sleep(1.0)
        log.warning("%s attempt %d: the store is still out; finishing without the last uploads",
                    record.workflow_id, record.attempt)

    @staticmethod
    def _saved_steps(layout: RunLayout) -> dict[int, set[int]]:
        """Step -> the ranks whose shard of it is written (its meta file, written last, is there). Entries
        that name no step or rank (a rank's own `step-latest`) are skipped."""
        saved: dict[int, set[int]] = {}
        if not layout.checkpoint_dir.is_dir():
            return saved
        for step_dir in layout.checkpoint_dir.iterdir():
            step = protocol.step_of_dir_name(step_dir.name)
            if step is None:
                continue
            ranks = {protocol.rank_of_name(p.stem) for p in step_dir.glob("rank-*.json")}
            saved[step] = {r for r in ranks if r is not None}
        return saved

    @activity.defn(name=names.REQUEST_CHECKPOINT)
    async def request_checkpoint(self, request: RequestCheckpointInput) -> RequestCheckpointResult:
        """Report where this node's ranks are; with a step, ask them to checkpoint at it. Idempotent."""
        record = self.book.record(request.workflow_id)
        if record is None or record.attempt != request.attempt:
            raise ApplicationError(f"node {self.node} runs no attempt {request.attempt} of {request.workflow_id}",
                                   type=ErrorType.NO_SUCH_ATTEMPT, non_retryable=True)
        layout = RunLayout.of(self.book.workdir, request.workflow_id)
        reports = [r for r in (read_report(layout.progress_file(record.attempt, rank)) for rank in record.ranks) if r]
        if request.step is not None:
            protocol.CheckpointRequest(request.step).write(layout.checkpoint_request_file(record.attempt))
        times = [r.step_time_s for r in reports if r.step_time_s]
        return RequestCheckpointResult(node=self.node, step=max((r.step for r in reports), default=-1),
                                       step_time_s=max(times) if times else None)
