"""The quickstart's model in replica groups under TorchFT: a failed group is replaced, the others never stop.

Each replica group is its own torch.distributed world (its ranks, master and store: trainguard gives it those as
for any run). Inside a group the ranks are data-parallel through torch's DDP; across groups a TorchFT `Manager`
averages the gradients over the groups in the current quorum and heals a group that joins late from a live
peer's state. Run it with a spec whose `replica_groups` is set: trainguard starts TorchFT's lighthouse and gives
every rank `REPLICA_GROUP_ID`, `NUM_REPLICA_GROUPS` and `TORCHFT_LIGHTHOUSE`.

Each step's batch is derived from the step and the rank's data-parallel index across all groups, so every group
ends on the same parameters, and a rank prints `rank R of group G: digest D` at the end. `--model llama` trains a
Hugging Face Llama from a small config instead (random init, nothing downloaded; the `examples` extra): the
FT-DDP recipe for a language model.

Needs the `ft` extra (`pip install 'trainguard[ft]'`).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from train import batch_for, build_model, simulate_compute  # examples/train.py, beside this script
from trainguard import rank as tg


LLAMA_VOCAB = 256


def llama(hidden: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="eager")
    torch.manual_seed(1234)  # every rank of every group starts from the same weights
    return LlamaForCausalLM(config)


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def set_grads(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for param in model.parameters():
        if param.grad is not None:
            count = param.grad.numel()
            param.grad.copy_(flat[offset:offset + count].view_as(param.grad))
            offset += count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="training steps in total (default 300)")
    parser.add_argument("--step-time", type=float, default=0.1,
                        help="simulated compute per step in seconds (default 0.1)")
    parser.add_argument("--model", choices=("mlp", "llama"), default="mlp",
                        help="the quickstart's MLP, or a Hugging Face Llama from a config (default mlp)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width (default 256; llama: 64)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--min-groups", type=int, default=1,
                        help="fewest replica groups that take a step together (TorchFT's min_replica_size)")
    parser.add_argument("--timeout-s", type=float, default=30.0,
                        help="TorchFT's quorum, commit and connect timeouts in seconds (default 30)")
    parser.add_argument("--pg-timeout-s", type=float, default=1.0,
                        help="the cross-group collectives' timeout in seconds (default 1): a step whose peer "
                             "died fails within it, and is taken again by the groups left")
    parser.add_argument("--log-steps", action="store_true",
                        help="print 'step N at T' (unix time) after every step: the healthy groups' step gaps")
    args = parser.parse_args()
    # TorchFT (and with it torch's distributed internals) imported before the standby, so a process the node agent
    # parked for a relaunch has it loaded already; here rather than at the top so `--help` stays quick.
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    if args.model == "llama":
        import transformers  # noqa: F401 - the same: loaded before a parked process is woken

    tg.standby()

    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    dist.init_process_group(backend="gloo")  # the group's own world
    rank, world = dist.get_rank(), dist.get_world_size()
    run = tg.init()
    model = build_model(args.hidden) if args.model == "mlp" else llama(args.hidden if args.hidden != 256 else 64)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def load(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def save() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=args.timeout_s)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)), load_state_dict=load,
                      state_dict=save, min_replica_size=args.min_groups, replica_id=f"group_{group}", rank=rank,
                      world_size=world, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    optimizer = OptimizerWrapper(manager, inner)
    state = run.restore()
    if state is not None:  # the group's newest committed checkpoint; a live peer's state replaces it at the quorum
        load(state)
        manager.load_state_dict({"step": run.start_step, "batches_committed": run.start_step * groups * world})
    run.fingerprint(model)

    loss = torch.zeros(())
    while manager.current_step() < args.steps:
        step = manager.current_step()
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # starts the next quorum
        index = group * world + rank  # this rank's data-parallel index across every group
        if args.model == "mlp":
            inputs, targets = batch_for(step, index, args.batch_size, torch.device("cpu"))
            loss = nn.functional.mse_loss(model(inputs), targets)
        else:
            tokens = torch.randint(0, LLAMA_VOCAB, (args.batch_size // 8, 32),
                                   generator=torch.Generator().manual_seed(1_000_003 * step + index))
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        computed_s = time.perf_counter() - began  # this rank's own work: a straggler shows here, its peers do not
        grads = flat_grads(model)
        manager.allreduce(grads).wait()  # averaged across the groups in the quorum (rank r of each group)
        dist.all_reduce(grads, op=dist.ReduceOp.AVG)  # then across the group's ranks: they stay identical
        set_grads(model, grads)
        optimizer.step()  # only where every group rank agrees the step counts: a failed one is taken again
        began = time.perf_counter()
        simulate_compute(args.step_time)
        computed_s += time.perf_counter() - began
        done = manager.current_step()
        if done == step:
            continue
        run.step_done(done, compute_s=computed_s, loss=loss)
        if args.log_steps:
            print(f"step {done} at {time.time():.3f}", flush=True)
        if run.should_save(done) or done == args.steps:
            run.save(done, save())

    digest = tg.state_digest(model)
    run.finish(digest=digest)
    print(f"rank {rank} of group {group}: finished {args.steps} steps, loss {loss.item():.6f}, digest {digest}",
          flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
