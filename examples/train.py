"""Example trainer: a small deterministic DDP model on synthetic data, using the trainguard rank helper.

Runs under trainguard (node agents set the environment) or plain torchrun. gloo on CPU, NCCL when GPUs
are present. Each step's batch is derived from the step number and the rank, so a run resumed from any
committed checkpoint ends bit-identical to one that never failed.

Under plain torchrun (no trainguard environment) `--local-checkpoint-dir` keeps a local checkpoint, so
`torchrun --max-restarts` can resume from it, `--pg-timeout-s` bounds the process-group timeout and
`--progress-file` logs progress; trainguard ignores all three.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainguard import rank as tg
from trainguard.protocol import ENV_PROGRESS_FILE


def build_model(hidden: int) -> nn.Module:
    torch.manual_seed(1234)  # every rank starts from the same weights
    return nn.Sequential(nn.Linear(32, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def simulate_compute(seconds: float, slice_s: float = 0.005) -> None:
    """Stand in for GPU work by sleeping, in short slices: a process that is stopped part of the time (a
    throttled GPU, trainguard's `slow` chaos) then falls behind in proportion, as real compute would, instead
    of finding one long sleep already over when it is continued."""
    slices = max(1, round(seconds / slice_s))
    for _ in range(slices if seconds > 0 else 0):
        time.sleep(seconds / slices)


def batch_for(step: int, rank: int, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    inputs = torch.randn(batch_size, 32, generator=generator)
    targets = inputs[:, :4].sum(dim=1, keepdim=True).sin()
    return inputs.to(device), targets.to(device)


def save_local_checkpoint(directory: Path, step: int, model: nn.Module,
                          optimizer: torch.optim.Optimizer) -> None:
    """{model, optim, step} to DIRECTORY/ckpt.pt, atomically (written beside it, then renamed)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".ckpt.pt.{os.getpid()}.tmp"
    with tmp.open("wb") as handle:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / "ckpt.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="training steps in total (default 300)")
    parser.add_argument("--step-time", type=float, default=0.1,
                        help="simulated compute per step in seconds, on top of the real step (default 0.1)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width (default 256)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--raise-at-step", type=int, default=None,
                        help="raise ValueError when training reaches this step: a bug in the script, which "
                             "fails the same way on every attempt")
    parser.add_argument("--no-rejoin", action="store_true",
                        help="exit when a peer dies, even with in-process restarts on (a trainer without rejoin)")
    parser.add_argument("--no-standby", action="store_true",
                        help="never call tg.standby() (a trainer written without it): every relaunch starts it cold")
    plain = parser.add_argument_group("plain torchrun only (ignored under trainguard)")
    plain.add_argument("--local-checkpoint-dir", type=Path, default=None,
                       help="save {model, optim, step} to DIR/ckpt.pt and resume from it at start if present")
    plain.add_argument("--local-checkpoint-every", type=int, default=50,
                       help="local checkpoint cadence in steps (default 50)")
    plain.add_argument("--pg-timeout-s", type=float, default=None,
                       help="timeout of init_process_group in seconds (default: torch's)")
    plain.add_argument("--progress-file", type=Path, default=None,
                       help="rank 0 appends a 'step unix-time restart-count' line per completed step")
    plain.add_argument("--ft-heartbeat", action="store_true",
                       help="under NVIDIA's ft_launcher (nvidia-resiliency-ext): send its rank heartbeat every step")
    args = parser.parse_args()
    # The node agent may start this process ahead of need (parked for the run's next relaunch, or a standby
    # of an in-process restart): it waits here, torch already imported, until it is given a rank's place.
    if not args.no_standby:
        tg.standby()
    if args.steps < 1:
        print("--steps must be at least 1", flush=True)
        raise SystemExit(tg.EXIT_NO_RETRY)

    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    # What trainguard.rank.RankRun.managed reads; the rank helper is created after the process group.
    managed = ENV_PROGRESS_FILE in os.environ
    if args.pg_timeout_s and not managed:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=args.pg_timeout_s))
    else:
        dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    run = tg.init()
    model = build_model(args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = run.restore()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    start_step = run.start_step
    local_dir = args.local_checkpoint_dir if not run.managed else None
    progress_file = args.progress_file if not run.managed and rank == 0 else None
    restart_count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if local_dir is not None and (local_dir / "ckpt.pt").exists():
        local = torch.load(local_dir / "ckpt.pt", map_location=device, weights_only=False)
        model.load_state_dict(local["model"])
        optimizer.load_state_dict(local["optim"])
        start_step = int(local["step"])
    # find_unused_parameters=True keeps DDP's gradient buckets in their initial layout. By default DDP
    # rebuilds them after its first iteration, so the first step after a resume would all-reduce with a
    # different layout (a different float summation order) than the same step in an unbroken run, and the
    # resumed run would not end bit-identical.
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None,
                                  find_unused_parameters=True)
    run.hook_ddp(ddp)  # the all-reduce goes through trainguard's hook (torch's own): chaos can skip it
    run.fingerprint(model)  # replicas' parameters compared: a flipped bit names its rank

    heartbeat = None
    if args.ft_heartbeat and not run.managed:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        heartbeat = RankMonitorClient()
        heartbeat.init_workload_monitoring()

    loss = torch.zeros(())
    step = start_step
    while step < args.steps:
        if args.raise_at_step is not None and step == args.raise_at_step:
            raise ValueError(f"deliberate failure at step {step} (--raise-at-step)")
        began = time.perf_counter()
        inputs, targets = batch_for(step, rank, args.batch_size, device)
        optimizer.zero_grad(set_to_none=True)
        try:
            loss = nn.functional.mse_loss(ddp(inputs), targets)
            forward_s = time.perf_counter() - began
            loss.backward()  # the gradient all-reduce happens in here: every rank waits for the slowest
        except RuntimeError as error:  # a peer died mid all-reduce (gloo: "Connection reset by peer")
            if args.no_rejoin:
                raise
            # In-process restart (restarts.in_process): keep this rank's state, join the new process group
            # with the restarted peer(s), hand them the state. Re-raises (the rank exits) when it cannot.
            step = run.rejoin(error, {"model": model.state_dict(), "optim": optimizer.state_dict()}, step)
            ddp = run.hook_ddp(DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None,
                                                       find_unused_parameters=True))
            continue
        optimizer.step()
        began = time.perf_counter()
        simulate_compute(args.step_time)
        step += 1
        run.step_done(step, compute_s=forward_s + time.perf_counter() - began, loss=loss)
        if run.should_save(step) or step == args.steps:
            run.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        if local_dir is not None and local_rank == 0 and args.local_checkpoint_every > 0 \
                and step % args.local_checkpoint_every == 0:
            save_local_checkpoint(local_dir, step, model, optimizer)
        if progress_file is not None:
            with progress_file.open("a") as handle:
                handle.write(f"{step} {time.time():.6f} {restart_count}\n")
        if heartbeat is not None:
            heartbeat.send_heartbeat()

    if heartbeat is not None:
        heartbeat.shutdown_workload_monitoring()
    digest = tg.state_digest(model)
    run.finish(digest=digest)
    if rank == 0:
        print(f"rank 0 of {world}: finished {args.steps} steps, loss {loss.item():.6f}, digest {digest[:16]}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
