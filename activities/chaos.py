"""Chaos, in one place: the faults of the field, carried out on demand by the node agent itself.

`inject_fault` (the activity) kills, stops, slows or hangs a rank, fails the node's GPU check, takes the
whole node down, or corrupts a committed shard (`corrupt_shard`). Hangs other than SIGSTOP are carried out by
the rank's own helper (`inject_hang`), and so are the numerical faults, a flipped bit in a parameter and a NaN
loss (`inject_numeric`). An agent started with `--no-chaos` refuses them all.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from activities.checkpoint_layout import object_name, shard_objects, step_of
from activities.store_reads import read_manifest
from activities.evidence import evidence_base
from activities.health import NodeHealth
from activities.models import SLOW_DUTY_MAX, SLOW_DUTY_MIN, InjectFaultInput, InjectFaultResult, ShardInfo
from activities.rank_records import AttemptRecord, RankBook, RankProcess, kill_group, log
from trainguard import evidence as channel
from trainguard.error_types import ErrorType
from trainguard.evidence import mode_of as hang_mode_of
from trainguard.faults import NUMERIC, SIGNALLED, FaultKind, choices as fault_choices
from trainguard.protocol import RunLayout
from trainguard.settings import s3_client


class RankChaos:
    """The agent's side of `inject_fault`."""

    def __init__(self, book: RankBook, health: NodeHealth, enabled: bool = True) -> None:
        self.book = book
        self.node = book.node
        self.health = health
        """The node's GPU health, shared with the watch: an injected GPU fault fails its next check."""
        self.chaos = enabled
        """False for an agent started with `--no-chaos`: every fault is refused."""
        self._slowdowns: dict[int, asyncio.Task[None]] = {}
        """Pid -> the duty cycle that slows it (`slow`)."""

    @activity.defn(name=names.INJECT_FAULT)
    async def inject_fault(self, request: InjectFaultInput) -> InjectFaultResult:
        """Chaos, carried out by the agent itself: the faults of the field, on demand."""
        if not self.chaos:
            raise ApplicationError(f"chaos is switched off on node {self.node} (agent started with --no-chaos)",
                                   type=ErrorType.CHAOS_DISABLED, non_retryable=True)
        now = time.time()
        if request.recurring and request.fault != FaultKind.BITFLIP:
            raise ApplicationError(f"recurring is for bitflip only, not {request.fault}", type=ErrorType.BAD_FAULT,
                                   non_retryable=True)
        if request.fault == FaultKind.GPU:
            self.health.inject("GPU has fallen off the bus (injected by trainguard chaos)", now)
            return InjectFaultResult(node=self.node, rank=-1, pid=os.getpid(), injected_at=now)
        if request.fault == FaultKind.CORRUPT:
            if not request.bucket or not request.manifest_key:
                raise ApplicationError("corrupt needs the checkpoint's bucket and manifest key",
                                       type=ErrorType.BAD_FAULT,
                                       non_retryable=True)
            layout = RunLayout.of(self.book.workdir, request.workflow_id)
            shard = await asyncio.to_thread(corrupt_shard, request.bucket, request.manifest_key, self.node,
                                            request.rank, layout.local_step_dir(step_of(request.manifest_key)))
            return InjectFaultResult(node=self.node, rank=shard.rank, pid=-1, injected_at=now,
                                     step=step_of(shard.key))
        if request.fault == FaultKind.NODE_DOWN:
            # Reply first, then die with every rank: the machine is gone as far as the run can tell.
            asyncio.get_running_loop().call_later(0.3, self._die)
            record = self.book.record(request.workflow_id)
            if record is not None:
                for rank in record.ranks:
                    record.faults.setdefault(rank, now)
            return InjectFaultResult(node=self.node, rank=-1, pid=os.getpid(), injected_at=now)
        record = self.book.record(request.workflow_id)
        live = {r: p for r, p in (record.ranks.items() if record else []) if not p.poll()}
        if not live:
            raise ApplicationError(
                f"no live rank of {request.workflow_id} on node {self.node}",
                type=ErrorType.NO_SUCH_RANK, non_retryable=True
            )
        rank = request.rank if request.rank is not None else min(live)
        if rank not in live:
            raise ApplicationError(
                f"rank {rank} is not running on node {self.node} (running: {sorted(live)})",
                type=ErrorType.NO_SUCH_RANK,
                non_retryable=True,
            )
        assert record is not None
        pid = live[rank].pid
        if request.fault == FaultKind.SLOW:
            duty = request.slow_duty
            if not SLOW_DUTY_MIN <= duty <= SLOW_DUTY_MAX:
                raise ApplicationError(f"slow_duty {duty:g} is out of range: give {SLOW_DUTY_MIN} to {SLOW_DUTY_MAX}",
                                       type=ErrorType.BAD_FAULT, non_retryable=True)
            self._slowdowns[pid] = asyncio.create_task(self._duty_cycle(live[rank], duty))
            log.info("chaos: slowing rank %d (pid %d) on %s, stopped %.0f%% of the time", rank, pid, self.node,
                     duty * 100)
            return InjectFaultResult(node=self.node, rank=rank, pid=pid, injected_at=now)
        if request.fault in NUMERIC:  # carried out by the rank's own helper, on the model it fingerprints
            await asyncio.to_thread(inject_numeric, RunLayout.of(self.book.workdir, request.workflow_id), record,
                                    rank, request.fault)
            if request.recurring:
                self.health.flips_bits = True
                self.health.flipped.add((record.workflow_id, record.chain_id, record.attempt))
            injected_at = record.faults.setdefault(rank, now)
            log.info("chaos: %s rank %d (pid %d) of %s on %s", request.fault, rank, pid, request.workflow_id,
                     self.node)
            return InjectFaultResult(node=self.node, rank=rank, pid=pid, injected_at=injected_at)
        mode = hang_mode_of(request.fault)
        if mode is not None and mode != "stop":  # carried out by the rank's own helper
            await asyncio.to_thread(inject_hang, RunLayout.of(self.book.workdir, request.workflow_id), record, rank,
                                    mode)
            injected_at = record.faults.setdefault(rank, now)
            log.info("chaos: hang --mode %s rank %d (pid %d) of %s on %s", mode, rank, pid, request.workflow_id,
                     self.node)
            return InjectFaultResult(node=self.node, rank=rank, pid=pid, injected_at=injected_at)
        signals: dict[str, signal.Signals] = {FaultKind.CRASH: signal.SIGKILL, FaultKind.HANG: signal.SIGSTOP}
        if request.fault not in SIGNALLED:
            raise ApplicationError(
                f"unknown fault {request.fault!r}; expected one of {fault_choices()}",
                type=ErrorType.BAD_FAULT, non_retryable=True,
            )
        injected_at = record.faults.setdefault(rank, now)
        # Signal the rank's own process only: a real fault hits one process, not its group.
        try:
            os.kill(pid, signals[request.fault])
        except ProcessLookupError:
            pass
        log.info("chaos: %s rank %d (pid %d) of %s on %s", request.fault, rank, pid, request.workflow_id, self.node)
        return InjectFaultResult(node=self.node, rank=rank, pid=pid, injected_at=injected_at)

    @staticmethod
    async def _duty_cycle(proc: RankProcess, duty: float, period_s: float = 0.1) -> None:
        """Stop and continue a rank so it runs only (1 - duty) of the time: a slow GPU, a noisy neighbour."""
        try:
            while not proc.poll():
                os.kill(proc.pid, signal.SIGSTOP)
                await asyncio.sleep(period_s * duty)
                os.kill(proc.pid, signal.SIGCONT)
                await asyncio.sleep(period_s * (1 - duty))
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _die(self) -> None:
        for record in self.book.attempts.values():
            for proc in [*record.ranks.values(), *([record.standby] if record.standby else [])]:
                if not proc.poll():
                    kill_group(proc.pid, signal.SIGKILL)
        for pool in self.book.parking.values():
            for parked in pool.processes:
                if not parked.proc.poll():
                    kill_group(parked.proc.pid, signal.SIGKILL)
        log.warning("chaos: node-down on %s: agent and ranks killed", self.node)
        os.kill(os.getpid(), signal.SIGKILL)


def inject_hang(layout: RunLayout, record: AttemptRecord, rank: int, mode: str) -> None:
    """Have the rank's helper carry out a hang (`python`, `io`, `skip-collective`). `stop` is SIGSTOP, sent
    by the agent itself."""
    base = evidence_base(layout, record, rank)
    if base is None:
        raise ApplicationError(
            f"rank {rank} has no trainguard rank helper evidence channel (its script does not call "
            f"trainguard.rank.init(), or has not called it yet): hang --mode {mode} needs it; --mode stop "
            f"works on any rank", type=ErrorType.BAD_FAULT, non_retryable=True)
    paths = channel.Paths(base)
    if mode == "skip-collective" and not _hooked(paths, record.ranks[rank].pid):
        raise ApplicationError(
            f"rank {rank}'s script does not route its all-reduce through the helper (call run.hook_ddp(ddp) "
            f"after wrapping the model in DDP): hang --mode skip-collective needs it",
            type=ErrorType.BAD_FAULT, non_retryable=True)
    channel.write_atomic(paths.chaos, json.dumps({"mode": mode, "at": time.time()}))


def inject_numeric(layout: RunLayout, record: AttemptRecord, rank: int, fault: str) -> None:
    """Have the rank's helper flip a bit of a parameter after its next step (`bitflip`), or make its next loss
    and gradients NaN (`nan`), on the model its script handed to `run.fingerprint`."""
    base = evidence_base(layout, record, rank)
    paths = channel.Paths(base) if base is not None else None
    if paths is None or not _asked(paths, "fingerprinted"):
        raise ApplicationError(
            f"rank {rank}'s script does not hand its model to the rank helper (call run.fingerprint(model) after "
            f"wrapping it): chaos {fault} acts on that model", type=ErrorType.BAD_FAULT, non_retryable=True)
    channel.write_atomic(paths.chaos, json.dumps({"mode": str(fault), "at": time.time()}))


def _hooked(paths: channel.Paths, pid: int, timeout_s: float = 1.0) -> bool:
    """Ask the rank's helper whether its DDP all-reduce goes through `hook_ddp`."""
    return _asked(paths, "ddp_hooked", timeout_s)


def _asked(paths: channel.Paths, flag: str, timeout_s: float = 1.0) -> bool:
    """Ask the rank's helper for one flag of its answer (`Position.extra`); False when it does not answer."""
    request = uuid.uuid4().hex
    channel.write_atomic(paths.request, request)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = channel.read_answer(paths)
        if found is not None and found.request == request:
            return bool(found.extra.get(flag))
        time.sleep(0.02)
    return False


def corrupt_shard(bucket: str, manifest_key: str, node: str, rank: int | None, local_step_dir: Path) -> ShardInfo:
    """Chaos: flip one byte of a committed shard this node wrote, in the store and in the node's local copy.
    The object keeps its size and sha256 metadata, as silent corruption would: only the checksum of the
    bytes, at restore, can tell. Returns the shard it damaged."""
    client = s3_client()
    manifest = read_manifest(client, bucket, manifest_key)
    if manifest is None:
        raise ApplicationError(f"no manifest at {manifest_key}", type=ErrorType.NO_SUCH_CHECKPOINT, non_retryable=True)
    mine = [obj for s in manifest.shards if s.node == node and rank in (None, s.rank)
            for _, obj in shard_objects(s)]
    if not mine:
        raise ApplicationError(f"step {manifest.step} has no shard {'' if rank is None else f'of rank {rank} '}"
                               f"written by node {node}", type=ErrorType.NO_SUCH_RANK, non_retryable=True)
    shard = mine[0]
    head = client.head_object(Bucket=bucket, Key=shard.key)
    body = bytearray(client.get_object(Bucket=bucket, Key=shard.key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=shard.key, Body=bytes(body), Metadata=head.get("Metadata", {}))
    local = local_step_dir / object_name(shard.key)
    if local.exists():
        with local.open("r+b") as handle:
            handle.seek(local.stat().st_size // 2)
            byte = handle.read(1)
            handle.seek(-1, 1)
            handle.write(bytes([byte[0] ^ 0xFF]))
    log.warning("chaos: flipped a byte of %s (rank %d) in the store and on %s", shard.key, shard.rank, node)
    return shard


