"""DDP recipe: a script that trains under trainguard and under plain torchrun alike, and resumes exactly.

    torchrun --nproc-per-node 2 examples/recipes/ddp.py      # or the entrypoint of a trainguard run

It saves, and restores, everything its future depends on: the model, the optimizer, the LR scheduler and
the data position (the sampler's epoch and the batches of it done). trainguard adds the torch, Python and
NumPy RNG states to every checkpoint. A run crashed and resumed from a committed checkpoint ends with the same
`tg.state_digest` as the same script under plain torchrun (`tests/integration/test_recipes.py`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard import rank as tg


def synthetic_dataset(size: int = 2048) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(size, 32, generator=generator)
    return TensorDataset(inputs, inputs[:, :4].sum(dim=1, keepdim=True).sin())


def batches_from(position: dict[str, int], epochs: int, sampler: DistributedSampler,
                 loader: DataLoader) -> Iterator[tuple[dict[str, int], Any]]:
    """The batches from the data position `position` on, each with the position after it: an epoch's order is
    its sampler's shuffle, the same on every attempt, and a resume skips the batches of it already done."""
    for epoch in range(position["epoch"], epochs):
        sampler.set_epoch(epoch)
        done = position["batch"] if epoch == position["epoch"] else 0
        for batch, data in enumerate(itertools.islice(loader, done, None), start=done + 1):
            yield {"epoch": epoch, "batch": batch}, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds of stand-in compute per step")
    args = parser.parse_args()

    tg.standby()  # after the imports: the node agent can relaunch the run from processes it started warm
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    torch.manual_seed(1234)  # every rank starts from the same weights
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    sampler = DistributedSampler(synthetic_dataset(), shuffle=True, seed=0)
    # A generator of its own: each epoch's iterator draws a seed from it, not from the global RNG that a
    # restore sets back, so a resume mid-epoch leaves the model's own random numbers (dropout) as they were.
    loader = DataLoader(sampler.dataset, batch_size=32, sampler=sampler, generator=torch.Generator())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    # find_unused_parameters=True keeps DDP's gradient buckets as first built: by default DDP rebuilds them
    # after its first step, so a resumed run would sum gradients in another order than an unbroken one.
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None,
                                  find_unused_parameters=True)

    # --8<-- [start:rank]
    run = tg.init(replicated=True)  # every rank holds the same state: rank 0 alone writes it, all restore it
    run.hook_ddp(ddp)  # hang evidence (inside the all-reduce or not), chaos skip-collective
    data_from = {"epoch": 0, "batch": 0}  # the data position: the sampler's epoch, and its batches done
    state = run.restore()  # None on a fresh start (and always under plain torchrun)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        scheduler.load_state_dict(state["sched"])
        data_from = state["data"]
    step = run.start_step
    for position, (inputs, targets) in batches_from(data_from, args.epochs, sampler, loader):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(inputs.to(device)), targets.to(device)).backward()
        optimizer.step()
        scheduler.step()
        time.sleep(args.step_time)  # stand-in for a bigger model's compute (none by default)
        step += 1
        run.step_done(step)  # the progress heartbeat that hangs are judged by
        if run.should_save(step):
            run.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict(),
                            "sched": scheduler.state_dict(), "data": position})
    digest = tg.state_digest(model)
    run.finish(digest=digest)
    # --8<-- [end:rank]
    if dist.get_rank() == 0:
        print(f"{step} steps, digest {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
