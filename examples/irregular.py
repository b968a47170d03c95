"""A healthy, irregular trainer: long phases between steps, as real training scripts have.

    python examples/irregular.py --steps 120            # under trainguard, or torchrun (gloo on CPU)

The model, optimizer and batches of `examples/train.py` (whose helpers it imports), trained the same way, so
with the same `--steps`, `--hidden`, `--batch-size` and world size it ends with train.py's digest, whatever
its phases; a run resumed from any committed checkpoint ends bit-identical to one that never failed. Between
steps, without calling `run.step_done`, it does what real scripts do:

- `--eval-every N --eval-s S`: every N steps every rank runs real forward passes (no_grad, CPU) on held-out
  batches for about S seconds, then all-reduces the evaluation loss.
- `--save-every N --save-s S`: every N steps rank 0 alone saves synchronously (a real `torch.save` to a file
  under `--scratch`, then serializing again for about S seconds: `save_pretrained` to a network file system)
  while its peers wait for it in the next step's gradient all-reduce.
- `--epoch-steps N --workers W`: batches come from a `torch.utils.data.DataLoader` with W workers and
  `persistent_workers=False`, so every epoch starts its workers again; each worker spends
  `--worker-start-s` of CPU opening its "remote shards" before its first batch.
- `--jitter F`: each step's simulated compute varies by +-F of `--step-time`, pseudo-randomly from (step,
  rank), so different ranks are slow on different steps; `compute_s` tells `run.step_done`.
- `--first-step-s S`: the first step this process trains takes S seconds more (lazy init, a compile).
- `--name-phases`: wrap evaluation, save and epoch start in `run.phase(...)` where the rank helper has it.
  Without it the script never names a phase: trainguard must judge it right without being told.

Every phase's length is wall-clock, so the run's length does not grow with the machine's load.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from train import batch_for, build_model, simulate_compute  # examples/train.py, beside this script
from trainguard import rank as tg

HELD_OUT_FIRST_STEP = 1_000_000
"""Batches are seeded from the step (`batch_for`); evaluation reads steps this far out, never trained on."""
EVAL_BATCH_SIZE = 1024
"""Rows per evaluation forward pass: large enough that a pass is real work, not Python overhead."""
JITTER_SEED = 7_919
"""Keeps the jitter's stream apart from the batches' (both are seeded from step and rank)."""
LOADER_SEED = 4_242
"""Seeds the DataLoader's own generator, so starting its workers never draws from torch's global RNG."""
SHARD_BYTES = 1 << 16
"""What a worker hashes over and over to stand in for opening a remote shard (CPU, not sleep)."""


def busy_for(seconds: float, work: Callable[[], object]) -> int:
    """Call `work` until `seconds` of wall-clock time have passed (at least once). Returns the calls made."""
    deadline = time.monotonic() + seconds
    calls = 0
    while True:
        work()
        calls += 1
        if time.monotonic() >= deadline:
            return calls


def open_shards(seconds: float, _worker_id: int) -> None:
    """A DataLoader worker's start: real CPU work for `seconds`, as opening and indexing remote shards is."""
    block = os.urandom(SHARD_BYTES)
    busy_for(seconds, lambda: hashlib.sha256(block).digest())


class EpochSlice(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Steps `first`..`end - 1` of an epoch, one whole batch an item, each derived from (step, rank) alone: the
    workers that build them change nothing in them, so a resumed epoch yields the same batches."""

    def __init__(self, first: int, end: int, rank: int, batch_size: int) -> None:
        self.first, self.end, self.rank, self.batch_size = first, end, rank, batch_size

    def __len__(self) -> int:
        return self.end - self.first

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_for(self.first + index, self.rank, self.batch_size, torch.device("cpu"))


def open_epoch(step: int, args: argparse.Namespace, rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches from `step` to the end of its epoch, through fresh DataLoader workers."""
    per_epoch = args.epoch_steps or args.steps
    end = min(args.steps, (step // per_epoch + 1) * per_epoch)
    loader = DataLoader(EpochSlice(step, end, rank, args.batch_size), batch_size=None, shuffle=False,
                        num_workers=args.workers, persistent_workers=False,
                        worker_init_fn=partial(open_shards, args.worker_start_s) if args.workers else None,
                        generator=torch.Generator().manual_seed(LOADER_SEED))
    return iter(loader)


def jittered(step_time: float, jitter: float, step: int, rank: int) -> float:
    """`step_time` scaled by a factor in [1 - jitter, 1 + jitter], fixed by (step, rank)."""
    factor = random.Random(JITTER_SEED * 1_000_003 + 1_000_003 * step + rank).uniform(-jitter, jitter)
    return max(0.0, step_time * (1.0 + factor))


def evaluate(model: nn.Module, rank: int, seconds: float) -> tuple[float, int]:
    """Forward passes on held-out batches for about `seconds`, then the mean loss over every rank's passes
    (an all-reduce). Returns (mean loss, passes of this rank)."""
    totals = torch.zeros(2, dtype=torch.float64)  # loss sum, passes
    with torch.no_grad():
        def one_pass() -> None:
            inputs, targets = batch_for(HELD_OUT_FIRST_STEP + int(totals[1].item()), rank, EVAL_BATCH_SIZE,
                                        torch.device("cpu"))
            totals[0] += nn.functional.mse_loss(model(inputs), targets).item()
            totals[1] += 1

        busy_for(seconds, one_pass)
    passes = int(totals[1].item())
    dist.all_reduce(totals)
    return totals[0].item() / max(1.0, totals[1].item()), passes


def save_synchronously(model: nn.Module, path: Path, seconds: float) -> int:
    """Rank 0's own save: the model to `path` (written, flushed, fsynced), then serialized again until about
    `seconds` have passed. Returns the bytes of one copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        torch.save(model.state_dict(), handle)
        handle.flush()
        os.fsync(handle.fileno())
    busy_for(seconds, lambda: torch.save(model.state_dict(), io.BytesIO()))
    return path.stat().st_size


def due(step: int, every: int) -> bool:
    return every > 0 and step > 0 and step % every == 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="training steps in total (default 120)")
    parser.add_argument("--step-time", type=float, default=0.05,
                        help="simulated compute per step in seconds, on top of the real step (default 0.05)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden width (default 64)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations; 0: none (default 50)")
    parser.add_argument("--eval-s", type=float, default=10.0, help="length of an evaluation, seconds (default 10)")
    parser.add_argument("--save-every", type=int, default=80,
                        help="steps between rank 0's synchronous saves; 0: none (default 80)")
    parser.add_argument("--save-s", type=float, default=4.0, help="length of a save, seconds (default 4)")
    parser.add_argument("--scratch", type=Path, default=None,
                        help="folder of rank 0's saves (default: the rank's TMPDIR)")
    parser.add_argument("--epoch-steps", type=int, default=60,
                        help="steps per epoch; every epoch starts the DataLoader's workers again; 0: one epoch "
                             "(default 60)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank; 0: none (default 2)")
    parser.add_argument("--worker-start-s", type=float, default=2.0,
                        help="CPU seconds each worker spends starting, per epoch (default 2)")
    parser.add_argument("--jitter", type=float, default=0.5,
                        help="each step's compute varies by +- this fraction of --step-time (default 0.5)")
    parser.add_argument("--first-step-s", type=float, default=2.0,
                        help="extra seconds of the first step this process trains (default 2)")
    parser.add_argument("--name-phases", action="store_true",
                        help="name evaluation, save and epoch start with run.phase(...) where the helper has it")
    args = parser.parse_args()
    if args.steps < 1 or not 0 <= args.jitter <= 1 or min(args.eval_s, args.save_s, args.worker_start_s,
                                                           args.first_step_s, args.step_time) < 0 \
            or min(args.eval_every, args.save_every, args.epoch_steps, args.workers) < 0:
        print("--steps must be at least 1, --jitter within [0, 1], and no count or length negative", flush=True)
        raise SystemExit(tg.EXIT_NO_RETRY)
    return args


def main() -> None:
    args = parse_args()
    tg.standby()  # as examples/train.py: a process started ahead of need waits here for its rank
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")

    run = tg.init()
    helper_phase = getattr(run, "phase", None) if args.name_phases else None

    def phase(name: str, expected_s: float) -> AbstractContextManager[object]:
        return helper_phase(name, expected_s=expected_s) if helper_phase is not None else contextlib.nullcontext()

    model = build_model(args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = run.restore()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    # As examples/train.py: buckets in their first layout, so a resumed run sums gradients in the same order.
    ddp = run.hook_ddp(DistributedDataParallel(model, find_unused_parameters=True))
    scratch = args.scratch or Path(tempfile.gettempdir())
    save_path = scratch / f"irregular-save-{os.getpid()}.pt"

    loss = torch.zeros(())
    step = run.start_step
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
    first = True
    while step < args.steps:
        if batches is None or due(step, args.epoch_steps):
            del batches  # the last epoch's workers exit here (persistent_workers=False)
            with phase("data", expected_s=args.worker_start_s):
                began = time.monotonic()
                batches = open_epoch(step, args, rank)
                inputs, targets = next(batches)  # waits for the new workers' start
                if rank == 0:
                    print(f"epoch from step {step}: workers ready in {time.monotonic() - began:.1f}s", flush=True)
        else:
            inputs, targets = next(batches)
        began = time.perf_counter()
        if first and args.first_step_s > 0:
            with torch.no_grad():  # a lazy init or a compile stands in
                busy_for(args.first_step_s, lambda: model(inputs))
        first = False
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(inputs), targets)
        forward_s = time.perf_counter() - began
        loss.backward()  # the gradient all-reduce: every rank waits for the slowest (rank 0 while it saves)
        optimizer.step()
        began = time.perf_counter()
        simulate_compute(jittered(args.step_time, args.jitter, step, rank))
        step += 1
        run.step_done(step, compute_s=forward_s + time.perf_counter() - began)
        if run.should_save(step) or step == args.steps:
            run.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        if due(step, args.eval_every):
            with phase("eval", expected_s=args.eval_s):
                began = time.monotonic()
                eval_loss, passes = evaluate(model, rank, args.eval_s)
            if rank == 0:
                print(f"eval at step {step}: loss {eval_loss:.6f}, {passes} passes in "
                      f"{time.monotonic() - began:.1f}s", flush=True)
        if rank == 0 and due(step, args.save_every):
            with phase("save", expected_s=args.save_s):
                began = time.monotonic()
                size = save_synchronously(model, save_path, args.save_s)
            print(f"save at step {step}: {size} bytes to {save_path}, {time.monotonic() - began:.1f}s", flush=True)

    del batches
    save_path.unlink(missing_ok=True)
    digest = tg.state_digest(model)
    run.finish(digest=digest)
    if rank == 0:
        print(f"rank 0 of {world}: finished {args.steps} steps, loss {loss.item():.6f}, digest {digest[:16]}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
