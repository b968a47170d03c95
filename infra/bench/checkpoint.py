"""Checkpoint benchmark: what a checkpoint costs training, and how fast shards move to and from S3.

    python -m infra.bench.checkpoint [--size-mib 256] [--repeats 3] [--json .bench/checkpoint.json]

Measured side by side in one run, on this machine:

1. Training stall per checkpoint. A model state of `--size-mib` float32 (a few large parameter tensors plus
   an Adam-like optimizer state twice their size) is saved with the rank helper's `RankRun.save` (in-memory
   snapshot, background write), against a synchronous `torch.save` + fsync of the same state to the same
   disk, and against the floor: the in-memory copy alone (`trainguard.rank._snapshot`). While the
   background write runs, a synthetic training step (a single-threaded matmul) keeps running, so the hidden
   cost of the overlap (steps slowed by the writer) is measured too, not only the stall.
2. Upload and download throughput of the shard `RankRun.save` wrote (the same bytes every time) through
   trainguard's own code path (`NodeCheckpointActivities._upload_one` / `._download_one`, timed with their
   sha256 of every byte, computed as the bytes stream through, and their store look-ups) against raw boto3
   `upload_file` / `download_file` with the same `TransferConfig`, to the same private SeaweedFS, in
   alternating order. A sha256 pass over the file is also timed alone: what the checksum costs on its own.
3. Replicated state saved once: a 4-rank DDP job (2 nodes x 2 ranks, every rank holding the same
   `--ddp-size-mib` state) checkpoints one step through the product's path: each rank's `RankRun.save`, each
   node agent's `upload_step` (its ranks' shards, every byte checked against its rank's sha256, then the
   node's record last; the two nodes at once), then one pass of the controller's committer
   (`StoreActivities.commit_checkpoints`: the nodes' records read, the manifest written last, retention
   applied). Before: every rank saves (`tg.init()`); after: `tg.init(replicated=True)`, rank 0 writes the one
   shard and the others record it as theirs. Bytes uploaded (the step's shard objects in the store) and commit
   time (from the saves to the manifest), the two modes alternating.

This is a benchmark, not a test: it prints figures and never asserts a time. Targets are shown with
whether this run met them. Everything it starts (SeaweedFS) is stopped and its files removed on the way out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import platform
import secrets
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.bench.checkpoint_figures import (
    DDP_NODES,
    DDP_RANKS_PER_NODE,
    MB,
    STEP_MATRIX,
    ReplicatedSamples,
    StallSamples,
    TransferSamples,
    replicated_figures,
    report,
    stall_figures,
    transfer_figures,
    write_json,
)
from infra.harness import PrivateStack, scoped_environ

if TYPE_CHECKING:
    from trainguard.devstack import DevStack

log = logging.getLogger("infra.bench.checkpoint")

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"
DEFAULT_JSON = BENCH_DIR / "checkpoint.json"
BUCKET = "trainguard"
PORT_SEARCH_START = 31000
IDLE_STEPS = 8
"""Steps timed just before each async save: the reference the steps overlapping its write are held to."""
WRITE_TIMEOUT_S = 300.0
BENCH_STEP = 1
"""The step the transfer part's keys claim (trainguard reads the step back from a shard's key)."""
BENCH_RUN = "bench"
"""The workflow id the DDP part's ranks, agents and committer act for."""


# ------------------------------------------------------------------------------------- the model state


def make_state(size_mib: int) -> dict[str, Any]:
    """A state dict of about `size_mib` MiB of float32, shaped like `{"model": ..., "optim": ...}` of Adam.

    A third is parameters (four equal tensors), two thirds the optimizer's `exp_avg` and `exp_avg_sq`.
    """
    import torch

    per_tensor = max(1, (size_mib << 20) // 4 // 12)
    generator = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(per_tensor, generator=generator) for i in range(4)}
    optim_state = {
        i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(per_tensor, generator=generator),
            "exp_avg_sq": torch.rand(per_tensor, generator=generator)}
        for i in range(4)
    }
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2, 3]}]
    optim = {"state": optim_state, "param_groups": groups}
    return {"model": model, "optim": optim}


def state_bytes(state: Any) -> int:
    """Bytes of tensor data in a nested state."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


class TrainingStep:
    """A stand-in for a training step: one single-threaded matmul, outside the GIL like real kernels."""

    def __init__(self, side: int = STEP_MATRIX) -> None:
        import torch

        generator = torch.Generator().manual_seed(1)
        self._a = torch.randn(side, side, generator=generator)
        self._b = torch.randn(side, side, generator=generator)
        self._out = torch.empty(side, side)

    def __call__(self) -> float:
        import torch

        started = time.perf_counter()
        torch.mm(self._a, self._b, out=self._out)
        return time.perf_counter() - started


# ---------------------------------------------------------------------------------- part 1: the stall


def _sync_save(state: dict[str, Any], path: Path) -> float:
    """The baseline: a blocking torch.save of the live state, flushed and fsynced. Returns seconds."""
    import torch

    started = time.perf_counter()
    with path.open("wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def _floor_copy(state: dict[str, Any]) -> float:
    """The floor: the in-memory copy `RankRun.save` makes before it returns. Returns seconds."""
    from trainguard.rank import _snapshot

    started = time.perf_counter()
    copy = _snapshot(state)
    elapsed = time.perf_counter() - started
    del copy
    return elapsed


def measure_stall(state: dict[str, Any], work: Path, repeats: int) -> StallSamples:
    """Floor, async and sync saves of `state`, `repeats` times each in a rotating order."""
    from trainguard import protocol
    from trainguard.rank import RankRun

    checkpoint_dir = work / "checkpoints"
    progress = work / "progress" / "rank-00000.json"
    progress.parent.mkdir(parents=True, exist_ok=True)
    environ = {
        protocol.ENV_PROGRESS_FILE: str(progress),
        protocol.ENV_CHECKPOINT_DIR: str(checkpoint_dir),
        protocol.ENV_CHECKPOINT_EVERY: "1",
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    run = RankRun(environ=environ)
    step = TrainingStep()
    step()  # warm up the kernel
    samples = StallSamples()
    # One untimed round of each kind first: allocator, page cache, torch.save's first call, the writer thread.
    _floor_copy(state)
    warmup = work / "warmup.pt"
    _sync_save(state, warmup)
    warmup.unlink()
    run.save(0, state)
    run._wait_for_writer()

    def async_save(index: int) -> None:
        step_no = index + 1
        idle = statistics.median(step() for _ in range(IDLE_STEPS))
        samples.idle_step_s.append(idle)
        started = time.perf_counter()
        reported = run.save(step_no, state)
        samples.async_s.append(time.perf_counter() - started)
        samples.async_reported_s.append(reported)
        returned_at = time.time()
        # Training goes on while the writer runs: time those steps against idle ones. The meta file is
        # written last, so its appearance is the end of the write (the node agent watches for it too).
        meta_path = checkpoint_dir / f"step-{step_no:08d}" / "rank-00000.json"
        writer = getattr(run, "_writer", None)
        deadline = time.monotonic() + WRITE_TIMEOUT_S

        def writing() -> bool:
            alive = writer is None or writer.is_alive()
            return alive and not meta_path.exists() and time.monotonic() < deadline

        during: list[float] = []
        while writing():
            during.append(step())
        run._wait_for_writer()  # raises if the background write failed
        samples.write_s.append(max(0.0, meta_path.stat().st_mtime - returned_at))
        samples.slowdown_s.append(max(0.0, sum(during) - len(during) * idle))
        samples.step_inflation.append(statistics.mean(during) / idle if during else 1.0)
        for older in checkpoint_dir.glob("step-*"):
            if older.name != f"step-{step_no:08d}":
                shutil.rmtree(older)
        samples.shard = meta_path.with_name("rank-00000.pt")
        samples.shard_meta = json.loads(meta_path.read_text())

    def sync_save(index: int) -> None:
        path = work / f"sync-{index}.pt"
        samples.sync_s.append(_sync_save(state, path))
        path.unlink()

    def floor(_index: int) -> None:
        samples.floor_s.append(_floor_copy(state))

    dcp_run = RankRun(environ={**environ, protocol.ENV_CHECKPOINT_DIR: str(work / "dcp-checkpoints")},
                      checkpoint_format="dcp")
    _one_rank_group(work)
    dcp_run.save(0, state)  # untimed: the group, DCP's first plan
    dcp_run._wait_for_writer()

    def dcp_save(index: int) -> None:
        started = time.perf_counter()
        dcp_run.save(index + 1, state)
        samples.dcp_s.append(time.perf_counter() - started)
        dcp_run._wait_for_writer()
        samples.dcp_write_s.append(time.perf_counter() - started - samples.dcp_s[-1])
        shutil.rmtree(work / "dcp-checkpoints" / f"step-{index + 1:08d}")

    kinds: list[Callable[[int], None]] = [floor, async_save, sync_save, dcp_save]
    for index in range(repeats):
        for offset in range(len(kinds)):
            kind = kinds[(index + offset) % len(kinds)]
            kind(index)
        log.info("stall repeat %d/%d: copy %.3fs, async %.3fs, sync %.3fs, dcp %.3fs", index + 1, repeats,
                 samples.floor_s[-1], samples.async_s[-1], samples.sync_s[-1], samples.dcp_s[-1])
    run.finish()
    dcp_run.finish()
    import torch.distributed as dist

    dist.destroy_process_group()
    return samples


def _one_rank_group(work: Path) -> None:
    """DCP's collectives need a process group: this process alone, on gloo, through a file store."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{work / 'pg-store'}", rank=0, world_size=1)


# ------------------------------------------------------------------------------------ part 2: transfer


def _start_store(dev: DevStack) -> None:
    dev._start_s3()
    dev._ensure_bucket(BUCKET)


@contextmanager
def private_store() -> Iterator[DevStack]:
    """A SeaweedFS of our own under .bench/, with the bucket made; stopped and removed on the way out."""
    home = BENCH_DIR / f"stack-{secrets.token_hex(4)}"
    private = PrivateStack(home, (), PORT_SEARCH_START, up=_start_store)
    log.info("starting SeaweedFS in %s", home)
    with private as dev:
        log.info("S3 store answered after %.1fs at %s", private.timings["stack_up_s"], dev.config.s3_endpoint)
        yield dev
    if private.leftovers:
        log.error("still running after dev down: %s", private.leftovers)
    log.info("SeaweedFS stopped, %s removed", home.name)


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure_transfer(dev: DevStack, shard: Path, meta: dict[str, Any], work: Path,
                     repeats: int) -> TransferSamples:
    """Upload and download `shard` through trainguard and through raw boto3, alternating which goes first."""
    creds = dev.credentials()
    endpoint = dev.config.s3_endpoint
    environ = {
        "TRAINGUARD_S3_ENDPOINT": endpoint,
        "AWS_ACCESS_KEY_ID": creds["access_key"],
        "AWS_SECRET_ACCESS_KEY": creds["secret_key"],
        "AWS_REGION": "us-east-1",
    }
    with scoped_environ(environ):
        return _measure_transfer(endpoint, creds, shard, meta, work, repeats)


def _measure_transfer(endpoint: str, creds: dict[str, str], shard: Path, meta: dict[str, Any], work: Path,
                      repeats: int) -> TransferSamples:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    from activities.checkpoint_layout import manifest_key, step_prefix
    from activities.checkpoint_transfers import PART_SIZE_BYTES, TRANSFER_CONCURRENCY, NodeCheckpointActivities
    from activities.models import ShardInfo
    from trainguard.protocol import shard_name
    from trainguard.safe_load import sha256_file
    from trainguard.settings import s3_client

    raw = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id=creds["access_key"], aws_secret_access_key=creds["secret_key"],
        config=Config(s3={"addressing_style": "path"}),
    )
    config = TransferConfig(multipart_threshold=PART_SIZE_BYTES,
                            multipart_chunksize=PART_SIZE_BYTES,
                            max_concurrency=TRANSFER_CONCURRENCY, use_threads=True)
    node = NodeCheckpointActivities("bench", work / "node")
    # Newer _upload_one also takes the step's manifest key (it refuses to overwrite a committed shard).
    upload_takes_manifest = "manifest" in inspect.signature(node._upload_one).parameters
    upload_digest: Callable[[Path], object] = sha256_file  # what both directions compute on the way
    prefix = f"bench/{secrets.token_hex(4)}"
    samples = TransferSamples(size_bytes=shard.stat().st_size, upload_digest=upload_digest.__name__)

    def info(key: str) -> ShardInfo:
        return ShardInfo(rank=0, key=key, size_bytes=meta["size_bytes"], sha256=meta["sha256"], node="bench")

    def tg_up(run_prefix: str, key: str) -> float:
        extra = (manifest_key(run_prefix, BENCH_STEP),) if upload_takes_manifest else ()
        return _timed(lambda: node._upload_one(BUCKET, shard, info(key), *extra))

    def raw_up(_run_prefix: str, key: str) -> float:
        return _timed(lambda: raw.upload_file(str(shard), BUCKET, key, Config=config))

    def tg_down(key: str, into: Path) -> float:
        into.mkdir(parents=True)
        # No local copy on this "node": every byte comes from the store, as the raw download's do.
        return _timed(lambda: node._download_one(BUCKET, into, info(key), work / "no-local-tier"))

    def raw_down(key: str, into: Path) -> float:
        into.mkdir(parents=True)
        return _timed(lambda: raw.download_file(BUCKET, key, str(into / shard.name), Config=config))

    def one_round(tag: str, tg_first: bool) -> tuple[float, float, float, float]:
        # Keys in trainguard's layout (<run prefix>/step-00000001/rank-00000.pt), one run prefix per side.
        prefixes = {who: f"{prefix}/{tag}-{who}" for who in ("tg", "raw")}
        keys = {who: step_prefix(p, BENCH_STEP) + shard_name(0) for who, p in prefixes.items()}
        ups = [("tg", tg_up), ("raw", raw_up)]
        downs = [("tg", tg_down), ("raw", raw_down)]
        if not tg_first:
            ups.reverse()
            downs.reverse()
        up = {who: fn(prefixes[who], keys[who]) for who, fn in ups}
        down = {who: fn(keys[who], work / f"{tag}-{who}") for who, fn in downs}
        for who in ("tg", "raw"):
            shutil.rmtree(work / f"{tag}-{who}")
            raw.delete_object(Bucket=BUCKET, Key=keys[who])
        return up["tg"], up["raw"], down["tg"], down["raw"]

    # Connections, credentials and the store's first volume, untimed.
    s3_client().head_bucket(Bucket=BUCKET)
    raw.head_bucket(Bucket=BUCKET)
    one_round("warmup", tg_first=True)
    for index in range(repeats):
        tg_first = index % 2 == 0
        up_tg, up_raw, down_tg, down_raw = one_round(f"r{index}", tg_first)
        samples.upload_tg_s.append(up_tg)
        samples.upload_raw_s.append(up_raw)
        samples.download_tg_s.append(down_tg)
        samples.download_raw_s.append(down_raw)
        samples.upload_digest_s.append(_timed(lambda: upload_digest(shard)))
        samples.sha256_s.append(_timed(lambda: sha256_file(shard)))
        log.info("transfer repeat %d/%d (%s first): up tg %.2fs raw %.2fs, down tg %.2fs raw %.2fs",
                 index + 1, repeats, "trainguard" if tg_first else "raw", up_tg, up_raw, down_tg, down_raw)
    return samples


# ----------------------------------------------------------------------------- part 3: replicated state


def _ddp_checkpoint(state: dict[str, Any], work: Path, run_prefix: str, replicated: bool, step: int,
                    samples: ReplicatedSamples, mode: str) -> None:
    """Every rank of the 4-rank job saves `step`; each node's agent uploads its ranks' shards and writes its node
    record (`upload_step`, the two nodes at once); then one pass of the controller's committer writes the
    manifest (`commit_checkpoints`). Both activities run here, outside Temporal, as a worker would run them."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from temporalio.testing import ActivityEnvironment

    from activities.checkpoint_layout import NODE_RECORDS, manifest_key, step_prefix
    from activities.checkpoint_store import StoreActivities
    from activities.checkpoint_transfers import NodeCheckpointActivities
    from activities.models import CommitCheckpointsInput, WatchCheckpoints
    from trainguard import protocol
    from trainguard.rank import RankRun
    from trainguard.settings import s3_client

    world = DDP_NODES * DDP_RANKS_PER_NODE
    node_dirs = {n: work / mode / f"node-{n}" for n in range(DDP_NODES)}
    runs = []
    for rank in range(world):
        node_dir = node_dirs[rank // DDP_RANKS_PER_NODE]
        progress = node_dir / "progress" / f"rank-{rank:05d}.json"
        progress.parent.mkdir(parents=True, exist_ok=True)
        # Saved where the node's agent looks for its ranks' shards.
        checkpoints = protocol.RunLayout.of(node_dir, BENCH_RUN).checkpoint_dir
        runs.append(RankRun({protocol.ENV_PROGRESS_FILE: str(progress), protocol.ENV_CHECKPOINT_DIR: str(checkpoints),
                             protocol.ENV_CHECKPOINT_EVERY: str(step), "RANK": str(rank), "WORLD_SIZE": str(world)},
                            replicated=replicated))
    # Four processes save at once in a real job: here four threads (the snapshot copy releases the GIL).
    barrier = threading.Barrier(world)

    def save(run: RankRun) -> None:
        barrier.wait()
        run.save(step, state)
        run.finish()  # waits for the background write: the meta file is there

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=world) as pool:
        list(pool.map(save, runs))
    written = time.perf_counter()
    target = WatchCheckpoints(bucket=BUCKET, run_prefix=run_prefix)
    agents = [NodeCheckpointActivities(f"node-{n}", node_dirs[n]) for n in range(DDP_NODES)]

    async def upload() -> None:
        await asyncio.gather(*(ActivityEnvironment().run(agent.upload_step, BENCH_RUN, 1, target, step, {}, step)
                               for agent in agents))

    asyncio.run(upload())
    uploaded = time.perf_counter()
    committer = CommitCheckpointsInput(bucket=BUCKET, run_prefix=run_prefix, workflow_id=BENCH_RUN, attempt=1,
                                       min_attempt=1, world_size=world, num_nodes=DDP_NODES, after_step=step - 1,
                                       max_duration_s=0.0, poll_interval_s=0.0)
    result = asyncio.run(ActivityEnvironment().run(StoreActivities().commit_checkpoints, committer))
    committed = time.perf_counter()
    if [c.ref.step for c in result.commits] != [step]:
        raise RuntimeError(f"the committer did not commit step {step}: {result}")
    client = s3_client()
    prefix = step_prefix(run_prefix, step)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    data = [o for o in listed if o["Key"] != manifest_key(run_prefix, step)
            and not o["Key"].startswith(f"{prefix}{NODE_RECORDS}/")]
    samples.stored_bytes[mode].append(sum(o["Size"] for o in data))
    samples.objects[mode].append(len(data))
    samples.commit_s[mode].append(committed - started)
    samples.write_s[mode].append(written - started)
    samples.upload_s[mode].append(uploaded - written)
    for obj in listed:
        client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    shutil.rmtree(work / mode, ignore_errors=True)


def measure_replicated(dev: DevStack, work: Path, size_mib: int, repeats: int) -> ReplicatedSamples:
    """The 4-rank DDP checkpoint, every rank saving and replicated, alternating which goes first."""
    creds = dev.credentials()
    environ = {"TRAINGUARD_S3_ENDPOINT": dev.config.s3_endpoint, "AWS_ACCESS_KEY_ID": creds["access_key"],
               "AWS_SECRET_ACCESS_KEY": creds["secret_key"], "AWS_REGION": "us-east-1"}
    state = make_state(size_mib)
    samples = ReplicatedSamples()
    prefix = f"bench/ddp-{secrets.token_hex(4)}"
    with scoped_environ(environ):
        _ddp_checkpoint(state, work, f"{prefix}/warmup", False, 1, ReplicatedSamples(), "every")  # untimed
        for index in range(repeats):
            modes = [("every", False), ("once", True)]
            if index % 2:
                modes.reverse()
            for mode, replicated in modes:
                _ddp_checkpoint(state, work, f"{prefix}/r{index}-{mode}", replicated, index + 1, samples, mode)
            log.info("replicated repeat %d/%d: every rank %.1f MB in %.2fs, once %.1f MB in %.2fs", index + 1,
                     repeats, samples.stored_bytes["every"][-1] / MB, samples.commit_s["every"][-1],
                     samples.stored_bytes["once"][-1] / MB, samples.commit_s["once"][-1])
    return samples


# --------------------------------------------------------------------------------------------- main


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m infra.bench.checkpoint",
        description="What a checkpoint costs training, and how fast shards move to and from S3.",
    )
    parser.add_argument("--size-mib", type=int, default=256, help="model + optimizer state in MiB (256)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per figure (3)")
    parser.add_argument("--ddp-size-mib", type=int, default=64,
                        help="each rank's state in the 4-rank DDP part, MiB (64: 256 MiB saved by every rank)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file ({DEFAULT_JSON})")
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeats < 1 or args.ddp_size_mib < 1:
        parser.error("--size-mib, --ddp-size-mib and --repeats must be at least 1")
    return args


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # so the finally blocks stop the store


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    logging.getLogger("botocore").setLevel(logging.WARNING)
    load_start = os.getloadavg()[0]
    # One intra-op thread, like a rank under torchrun here; set before torch is imported.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    import torch

    from activities.checkpoint_transfers import PART_SIZE_BYTES, TRANSFER_CONCURRENCY

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    work = BENCH_DIR / f"run-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    started = time.monotonic()
    try:
        state = make_state(args.size_mib)
        log.info("state: %.0f MiB in tensors; measuring the stall", state_bytes(state) / (1 << 20))
        stall = measure_stall(state, work, args.repeats)
        del state
        if stall.shard is None:
            raise RuntimeError("RankRun.save wrote no shard")
        with private_store() as dev:
            transfer = measure_transfer(dev, stall.shard, stall.shard_meta, work, args.repeats)
            log.info("4-rank DDP checkpoints of %d MiB per rank, every rank saving and replicated",
                     args.ddp_size_mib)
            replicated = measure_replicated(dev, work, args.ddp_size_mib, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    context = {
        "size_mib": args.size_mib,
        "ddp_size_mib": args.ddp_size_mib,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "torch": torch.__version__.split("+")[0],
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "part_size_mib": PART_SIZE_BYTES >> 20,
        "transfer_concurrency": TRANSFER_CONCURRENCY,
        "shard_bytes": transfer.size_bytes,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg()[0],
        "wall_s": round(time.monotonic() - started, 1),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    figures = (stall_figures(stall, args.size_mib) + transfer_figures(transfer)
               + replicated_figures(replicated, args.ddp_size_mib))
    write_json(args.json, figures, context)
    report(figures, context)
    log.info("wrote %s (%.0fs)", args.json, context["wall_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
