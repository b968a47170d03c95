"""HSDP recipe: the FSDP2 recipe with a replicate dimension, under trainguard or plain torchrun, resuming exactly.

    torchrun --nproc-per-node 4 examples/recipes/hsdp.py     # or 2 nodes x 2 ranks under trainguard

A 2-D device mesh, `--replicas` x (world size / replicas): each replica group shards the model over its ranks
(FSDP2), and the replicas all-reduce their gradients, as DDP would. Run it with the ranks of a node in one
replica (torchrun and trainguard number a node's ranks consecutively): sharding stays inside a node, and only
the replicas' all-reduce crosses nodes. Otherwise it is `fsdp2.py`.

The model comes from a small `LlamaConfig` (random weights, nothing downloaded; `pip install
'trainguard[examples]'`). Its state is DTensors, which trainguard saves with torch.distributed.checkpoint
(DCP): every rank saves its shards, and a restore reshards onto the world size of the attempt. It saves, and
restores, the model, the optimizer, the LR scheduler and the data position (the sampler's epoch and the
batches of it done); trainguard adds the RNG states. A run crashed and resumed from a committed checkpoint ends
with the same `tg.state_digest` as the same script under plain torchrun (`tests/integration/test_recipes.py`).
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from trainguard import rank as tg


def synthetic_tokens(size: int = 512, seq_len: int = 32, vocab: int = 256) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, vocab, (size, seq_len), generator=generator))


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
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2, help="replica groups; the world size must divide by it")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds of stand-in compute per step")
    args = parser.parse_args()

    tg.standby()  # after the imports: the node agent can relaunch the run from processes it started warm
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    run = tg.init()  # every rank saves its own shards, at the same steps

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(1234)  # every rank starts from the same weights
    model = LlamaForCausalLM(config).to(device)
    # --8<-- [start:mesh]
    if dist.get_world_size() % args.replicas:
        print(f"--replicas {args.replicas} does not divide the world size {dist.get_world_size()}", flush=True)
        raise SystemExit(tg.EXIT_NO_RETRY)  # a restart cannot fix it: stop the run instead of spending restarts
    mesh = init_device_mesh(device.type, (args.replicas, dist.get_world_size() // args.replicas),
                            mesh_dim_names=("replicate", "shard"))  # rows: replicas; a row's ranks: shards
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)  # a 2-D mesh makes fully_shard shard on "shard", replicate on "replicate"
    fully_shard(model, mesh=mesh)
    # --8<-- [end:mesh]
    run.fingerprint(model)  # replicas of each shard compared: a flipped bit is found and rolled back
    sampler = DistributedSampler(synthetic_tokens(), shuffle=True, seed=0)
    # A generator of its own: each epoch's iterator draws a seed from it, not from the global RNG that a
    # restore sets back, so a resume mid-epoch leaves the model's own random numbers (dropout) as they were.
    loader = DataLoader(sampler.dataset, batch_size=4, sampler=sampler, generator=torch.Generator())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))

    def state(position: dict[str, int] | None = None) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)  # sharded, the optimizer's keyed by name
        return {"model": model_state, "optim": optim_state, "sched": scheduler.state_dict(),
                "data": position or {"epoch": 0, "batch": 0}}  # the data position: the sampler's epoch, batches done

    # `state`, not `state()`: restore calls it only when there is a checkpoint to load into. Building it
    # initialises AdamW's state, so built on a fresh start it would make the run differ from plain torchrun.
    restored = run.restore(state)
    data_from = {"epoch": 0, "batch": 0}
    if restored is not None:
        set_state_dict(model, optimizer, model_state_dict=restored["model"], optim_state_dict=restored["optim"])
        scheduler.load_state_dict(restored["sched"])
        data_from = restored["data"]

    step = run.start_step
    for position, (tokens,) in batches_from(data_from, args.epochs, sampler, loader):
        tokens = tokens.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        time.sleep(args.step_time)  # stand-in for a bigger model's compute (none by default)
        step += 1
        # The progress heartbeat; the loss is judged (NaN, spikes) and tells two replicas apart after a flip.
        run.step_done(step, loss=loss.detach())
        if run.should_save(step):
            run.save(step, state(position))  # every rank, at the same step: DCP plans collectively

    digest = tg.state_digest(model)  # every rank: it gathers the full model
    run.finish(digest=digest)
    if dist.get_rank() == 0:
        print(f"{step} steps, digest {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
