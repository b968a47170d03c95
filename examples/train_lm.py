"""Language-model example: a small Hugging Face Llama trained with FSDP2 or DDP, as a trainguard rank.

    python examples/train_lm.py --parallel fsdp --steps 60        # under trainguard, or torchrun

`LlamaForCausalLM` from a small `LlamaConfig` (random init, nothing downloaded), trained on synthetic tokens
derived from the step and the rank, so a run resumed from any committed checkpoint ends bit-identical to one
that never failed (at the same world size).

- `--parallel fsdp`: `fully_shard` per decoder layer and on the whole model (FSDP2, DTensor parameters).
  Its state goes through `torch.distributed.checkpoint.state_dict.get_state_dict`/`set_state_dict`, and
  trainguard saves it with DCP, so a run that shrinks (`min_nodes`) or grows back reshards it on restore.
- `--parallel ddp`: `DistributedDataParallel`; `--replicated` makes rank 0 alone save (every rank holds the
  same state), the others restore from its shard.

`--eval-every N --eval-batches B`: every N steps every rank evaluates, without a `run.step_done` meanwhile:
B forward passes (no_grad) on held-out synthetic batches, then an all-reduce of the loss. Evaluation changes
no state: the digest is the same with or without it.

gloo on CPU, NCCL when GPUs are present. Needs `transformers` (`pip install 'trainguard[examples]'`).
`--digest-log FILE` appends `save|restore STEP WORLD DIGEST` lines (rank 0) for tests that compare the
full state at a checkpoint with the state a resharded restore produced.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainguard import rank as tg

HELD_OUT_FIRST_STEP = 1_000_000
"""Tokens are seeded from the step (`tokens_for`); evaluation reads steps this far out, never trained on."""


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len, attn_implementation="eager")
    torch.manual_seed(1234)  # every rank starts from the same weights
    return LlamaForCausalLM(config)


def tokens_for(step: int, rank: int, args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=generator).to(device)


def evaluate(model: torch.nn.Module, rank: int, args: argparse.Namespace, device: torch.device) -> float:
    """`--eval-batches` forward passes on held-out batches, no_grad, then the mean loss over every rank's (an
    all-reduce). Every rank calls it at the same step: FSDP's forward gathers parameters collectively."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, batches
    model.eval()
    with torch.no_grad():
        for index in range(args.eval_batches):
            tokens = tokens_for(HELD_OUT_FIRST_STEP + index, rank, args, device)
            totals[0] += model(input_ids=tokens, labels=tokens).loss.double()
            totals[1] += 1
    model.train()
    dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


def log_digest(path: Path | None, kind: str, step: int, model: torch.nn.Module) -> None:
    """Every rank computes it (gathering FSDP shards is a collective); rank 0 writes it."""
    if path is None:
        return
    digest = tg.state_digest(model)
    if dist.get_rank() == 0:
        with path.open("a") as handle:
            handle.write(f"{kind} {step} {dist.get_world_size()} {digest}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra simulated compute per step, seconds")
    parser.add_argument("--replicated", action="store_true", help="ddp: rank 0 alone saves the shared state")
    parser.add_argument("--checkpoint-format", choices=("auto", "torch", "dcp"), default="auto",
                        help="tg.init's checkpoint_format (auto: DCP for FSDP's DTensors). torch with fsdp saves "
                             "shards that cannot be resharded: a run with min_nodes then pauses for an operator")
    parser.add_argument("--digest-log", type=Path, default=None)
    parser.add_argument("--eval-every", type=int, default=0, help="steps between evaluations; 0: none (default)")
    parser.add_argument("--eval-batches", type=int, default=20,
                        help="held-out batches an evaluation reads (default 20)")
    args = parser.parse_args()
    if args.steps < 1 or (args.replicated and args.parallel != "ddp") or args.eval_every < 0 \
            or args.eval_batches < 1:
        print("--steps and --eval-batches must be at least 1, --eval-every not negative; --replicated is for "
              "--parallel ddp", flush=True)
        raise SystemExit(tg.EXIT_NO_RETRY)

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    run = tg.init(replicated=args.replicated, checkpoint_format=args.checkpoint_format)
    model = build_model(args).to(device)
    if args.parallel == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        trained: torch.nn.Module = model
    else:
        trained = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None,
                                          find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run.fingerprint(model)  # replicas' parameters (their shards, under FSDP2) compared: a flipped bit names its rank

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    # FSDP2 state is DTensors, which trainguard saves with DCP: the load goes in place into this world's
    # sharded state dict (it reshards). DDP state is plain tensors, one torch.save per rank (or rank 0's).
    # `state`, not `state()`: building it initialises the optimizer's state (an AdamW step at learning rate 0),
    # so it is built only when a DCP checkpoint is restored, and a fresh start trains as under plain torchrun.
    restored = run.restore(state)
    if restored is not None:
        set_state_dict(model, optimizer, model_state_dict=restored["model"], optim_state_dict=restored["optim"])
    if restored is not None:
        log_digest(args.digest_log, "restore", run.start_step, model)

    loss = torch.zeros(())
    for step in range(run.start_step, args.steps):
        began = time.perf_counter()
        tokens = tokens_for(step, rank, args, device)
        optimizer.zero_grad(set_to_none=True)
        loss = trained(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        if args.step_time > 0:
            time.sleep(args.step_time)
        run.step_done(step + 1, compute_s=time.perf_counter() - began, loss=loss)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            began = time.monotonic()
            eval_loss = evaluate(model, rank, args, device)
            if rank == 0:
                print(f"eval at step {step + 1}: loss {eval_loss:.4f}, {args.eval_batches} batches in "
                      f"{time.monotonic() - began:.1f}s", flush=True)
        if run.should_save(step + 1) or step + 1 == args.steps:
            if args.parallel == "ddp" and args.replicated and rank != 0:
                continue  # rank 0's shard is every rank's (a rank-0-only save, as many torchrun scripts do)
            run.save(step + 1, state())
            log_digest(args.digest_log, "save", step + 1, model)

    digest = tg.state_digest(model)
    run.finish(digest=digest)
    if rank == 0:
        print(f"rank 0 of {dist.get_world_size()}: {args.parallel}, {args.steps} steps, loss {loss.item():.4f}, "
              f"digest {digest[:16]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
