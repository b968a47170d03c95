"""A Hugging Face `Trainer` script as a trainguard rank: the callback and `tg_hf.train` are its only changes.

    python examples/hf_trainer.py --steps 40          # under trainguard, torchrun or alone

A `LlamaForCausalLM` from a small `LlamaConfig` (random init, nothing downloaded) fine-tuned by a plain
`transformers.Trainer` on a synthetic dataset of token sequences, each derived from its index, shuffled by the
Trainer's sampler, with a cosine learning-rate schedule after a warm-up. Under trainguard, a run resumed from any
committed checkpoint ends with the same state digest as one that never failed: the Trainer restores the
model, AdamW, the scheduler, every rank's RNG and its global step, and skips the batches already trained on.

gloo on CPU (`use_cpu`: without it and without an accelerator, the Trainer runs each process alone), NCCL
where GPUs are. Needs `pip install 'trainguard[hf]'`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from trainguard import hf as tg_hf
from trainguard import rank as tg


class SyntheticTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """`size` sequences of `seq_len` tokens, sequence i drawn from a generator seeded with i."""

    def __init__(self, size: int, seq_len: int, vocab: int) -> None:
        self.size, self.seq_len, self.vocab = size, seq_len, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1_000_003 * index + 17)
        tokens = torch.randint(0, self.vocab, (self.seq_len,), generator=generator)
        return {"input_ids": tokens, "labels": tokens.clone()}


class SimulatedCompute(TrainerCallback):
    """`--step-time`: a bigger model's step, so that a test can inject a fault between two steps."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len, attn_implementation="eager")
    torch.manual_seed(1234)  # every rank starts from the same weights
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (max_steps)")
    parser.add_argument("--output-dir", default=str(Path(tempfile.gettempdir()) / "hf-trainer-out"),
                        help="the Trainer's output_dir (default: under TMPDIR, which trainguard sets per run and "
                             "node; the checkpoints that count are trainguard's)")
    parser.add_argument("--samples", type=int, default=64, help="dataset size: fewer than the steps need makes "
                                                                   "the run cross epochs")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4, help="per device")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra simulated compute per step, seconds")
    args = parser.parse_args()

    # --8<-- [start:trainer]
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10),
        save_strategy="no",  # trainguard asks for its checkpoints (checkpoint.every_steps)
        logging_steps=10, report_to="none", seed=42, dataloader_num_workers=0,
        # Without an accelerator the Trainer runs each process alone unless told it is on CPU: gloo DDP then.
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=build_model(args), args=training,
                      train_dataset=SyntheticTokens(args.samples, args.seq_len, args.vocab),
                      callbacks=[tg_hf.TrainguardCallback(), SimulatedCompute(args.step_time)])
    tg_hf.train(trainer)  # trainer.train(), resumed from the checkpoint trainguard restored
    # --8<-- [end:trainer]

    digest = tg.state_digest(trainer.model)
    if training.process_index == 0:
        print(f"rank 0 of {training.world_size}: {trainer.state.global_step} steps, digest {digest[:16]}",
              flush=True)


if __name__ == "__main__":
    main()
