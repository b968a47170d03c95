"""The Hugging Face `Trainer` as a trainguard rank: progress, checkpoints through trainguard, exact resume.

```python
from trainguard import hf as tg_hf

trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[tg_hf.TrainguardCallback()])
tg_hf.train(trainer)                     # instead of trainer.train(): resumes from trainguard's checkpoint
```

The callback reports every optimizer step (`run.step_done(global_step)`), asks the Trainer to save at the steps
trainguard wants a checkpoint (`checkpoint.every_steps`, an operator's `checkpoint_now`), and hands every
checkpoint folder the Trainer writes (model, optimizer, LR scheduler, gradient scaler, every rank's RNG,
`trainer_state.json` with the global step) to the rank helper, which stores it as one shard that the node
agent uploads and the run commits like any other. Evaluations and saves between steps are named phases, so
they are never taken for a hang before `health.hang_max_s`. The model takes part in the run's comparison of
replicas (`run.fingerprint`), so a replica that computes wrong is found and rolled back. At the end of training
it reports the rank finished with the digest of the model's state (`TrainguardCallback(digest=False)` skips it).

Resume goes through the Trainer's own `resume_from_checkpoint`, which restores all of the above and skips the
batches already trained on (the data position): `train(trainer)` writes the checkpoint trainguard restored
into a folder of this rank's own and passes it. A script that keeps `trainer.train()` passes
`resume_from_checkpoint=callback.restored_checkpoint(args.output_dir)` itself; one that passes nothing on a
relaunch is stopped at its first step with exit 78 (`EXIT_NO_RETRY`), saying so, instead of training on from
fresh weights.

Every rank holds the same state under data parallelism (DDP, one process): rank 0 writes the one shard, the
RNG files of the other ranks gathered into it, and every rank restores it (`tg.init(replicated=True)`). Sharded
Trainer state (`fsdp`, DeepSpeed) is refused at start: its files are written by every rank.

Outside trainguard (plain `torchrun` or `python`) the callback does nothing and `train` is `trainer.train()`.
The Trainer loads the restored files with `weights_only=True`, as it does for a resume of its own.
Needs `transformers` and `accelerate`: `pip install 'trainguard[hf]'`. Import it as `trainguard.hf`;
`import trainguard.rank` never loads transformers.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

from trainguard import rank as tg

FILES_KEY = "hf_checkpoint"
"""The shard's one entry: the Trainer's checkpoint folder, relative path -> the file's bytes (uint8 tensor)."""
RESTORE_FOLDER = ".trainguard-restore"
"""Under the Trainer's `output_dir`: where each rank writes the checkpoint trainguard restored, one folder per rank
(ranks of one node may share `output_dir`)."""
PER_RANK_FILE = re.compile(r"rng_state_(\d+)\.pth")
"""The Trainer's files that each rank writes for itself (its RNG); every other file rank 0 writes for all."""


class TrainguardCallback(TrainerCallback):
    """Makes a `transformers.Trainer` a trainguard rank. Pass it in `callbacks=[...]`, then call `train(trainer)`.

    `run`: the rank helper's handle (default `tg.init(replicated=True)`); one given for a job of several ranks
    must be `replicated`. `digest`: report the model's state digest when training ends (default True)."""

    def __init__(self, run: tg.RankRun | None = None, *, digest: bool = True) -> None:
        self.run = run if run is not None else tg.init(replicated=True)
        if self.run.world_size > 1 and not self.run.replicated:
            raise ValueError("TrainguardCallback(run=...): a job of several ranks needs tg.init(replicated=True): "
                             "rank 0 saves the Trainer's checkpoint for every rank, and every rank restores it")
        self.digest = digest
        self._restored: Path | None = None
        self._step_began: float | None = None
        self._phase: contextlib.ExitStack | None = None

    # ----------------------------------------------------------------------------------------- restore
    def restored_checkpoint(self, output_dir: str | Path) -> str | None:
        """The checkpoint trainguard restored, written out as a Trainer checkpoint folder for
        `trainer.train(resume_from_checkpoint=...)`; None on a fresh start. The folder lies under
        `output_dir/.trainguard-restore/rank-N/` (`train` removes it once training returns)."""
        state = self.run.restore()
        if state is None:
            return None
        files = state.get(FILES_KEY)
        if not isinstance(files, dict):
            self.run._stop(f"trainguard: the restored checkpoint (step {self.run.start_step}) holds no Trainer "
                           f"checkpoint ({FILES_KEY!r}): it was written by another script than this Trainer's")
        folder = Path(output_dir) / RESTORE_FOLDER / f"rank-{self.run.rank:05d}"
        shutil.rmtree(folder, ignore_errors=True)
        checkpoint = folder / f"{PREFIX_CHECKPOINT_DIR}-{self.run.start_step}"
        for name, data in files.items():
            path = checkpoint / name
            if checkpoint.resolve() not in path.resolve().parents:
                self.run._stop(f"trainguard: the restored checkpoint names a file outside its folder: {name!r}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data.numpy().tobytes())
        self._restored = checkpoint
        return str(checkpoint)

    def remove_restored(self) -> None:
        """Remove the folder `restored_checkpoint` wrote (the Trainer has loaded it once training runs)."""
        if self._restored is not None:
            shutil.rmtree(self._restored.parent, ignore_errors=True)
            self._restored = None

    # --------------------------------------------------------------------------------------- callbacks
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.run.managed and args.world_size != self.run.world_size:
            self.run._stop(f"trainguard: the Trainer sees {args.world_size} process(es) in a job of "
                           f"{self.run.world_size} ranks: each rank would train alone. Without GPUs, pass "
                           f"TrainingArguments(use_cpu=True) (or set ACCELERATE_USE_CPU=1) for gloo DDP.")
        if self.run.managed and (args.fsdp or args.deepspeed):
            self.run._stop("trainguard: TrainguardCallback saves the Trainer's checkpoint from rank 0 for every "
                           "rank; sharded Trainer state (fsdp, deepspeed) is written by every rank and is not "
                           "supported. Train with DDP, or use the rank helper in a loop of your own (FSDP2 recipe).")

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if kwargs.get("model") is not None:  # replicas compared: a flipped bit is found and rolled back
            self.run.fingerprint(kwargs["model"])
        if self.run.start_step > 0 and state.global_step != self.run.start_step:
            self.run._stop(
                f"trainguard: this attempt restored the checkpoint of step {self.run.start_step}, but the Trainer "
                f"starts at step {state.global_step}: it would train on from fresh weights. Call "
                f"trainguard.hf.train(trainer) instead of trainer.train(), or pass resume_from_checkpoint="
                f"callback.restored_checkpoint(args.output_dir).")

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._close_phase()
        self._step_began = time.perf_counter()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        began, self._step_began = self._step_began, None
        self.run.step_done(state.global_step, compute_s=time.perf_counter() - began if began else None)
        if self.run.should_save(state.global_step):
            control.should_save = True
        self._open_phase(control)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._close_phase()

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._open_phase(control)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """The Trainer has written `checkpoint-<global_step>`: every rank calls this, so the other ranks' RNG
        files are gathered to rank 0 here (a collective), which saves the folder as the run's checkpoint."""
        if not self.run.managed:
            return
        folder = _output_dir(args) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        own = _own_files(folder, self.run.rank)
        gathered = _gather(own, self.run.world_size)
        if self.run.rank == 0:
            files = _shared_files(folder)
            for part in gathered:
                files.update(part)
            self.run.save(state.global_step, {FILES_KEY: files})
        else:
            self.run.save(state.global_step, {})  # rank 0's shard is this rank's (a replica)
        self._close_phase()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._close_phase()
        model = kwargs.get("model")
        digest = tg.state_digest(model) if self.digest and model is not None else None
        self.run.finish(digest=digest)

    # ------------------------------------------------------------------------------------------ phases
    def _open_phase(self, control: TrainerControl) -> None:
        """An evaluation or a save is due before the next step: name it, so its time is neither step time nor
        taken for a hang before `hang_max_s`. Closed at the save, or when the next step or epoch begins."""
        due = [name for name, flag in (("eval", control.should_evaluate), ("save", control.should_save)) if flag]
        if due and self._phase is None:
            self._phase = contextlib.ExitStack()
            self._phase.enter_context(self.run.phase("+".join(due)))

    def _close_phase(self) -> None:
        if self._phase is not None:
            phase, self._phase = self._phase, None
            phase.close()


def train(trainer: Trainer, **kwargs: Any) -> TrainOutput:
    """`trainer.train(**kwargs)`, resumed from the checkpoint trainguard restored, if any. Adds a
    `TrainguardCallback` when the trainer has none. Outside trainguard it is `trainer.train(**kwargs)`."""
    if "resume_from_checkpoint" in kwargs:
        raise ValueError("trainguard.hf.train(trainer): trainguard chooses the checkpoint to resume from; "
                         "call trainer.train(resume_from_checkpoint=...) yourself to choose one")
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, TrainguardCallback)), None)
    if callback is None:
        callback = TrainguardCallback()
        trainer.add_callback(callback)
    checkpoint = callback.restored_checkpoint(_output_dir(trainer.args))
    try:
        return trainer.train(resume_from_checkpoint=checkpoint, **kwargs)
    finally:
        callback.remove_restored()


def _output_dir(args: TrainingArguments) -> Path:
    assert args.output_dir is not None  # TrainingArguments sets its default ("trainer_output")
    return Path(args.output_dir)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _files(folder: Path) -> dict[str, Path]:
    return {path.relative_to(folder).as_posix(): path for path in sorted(folder.rglob("*")) if path.is_file()}


def _own_files(folder: Path, rank: int) -> dict[str, bytes]:
    """The files of the checkpoint folder this rank wrote for itself (its RNG state)."""
    return {name: path.read_bytes() for name, path in _files(folder).items()
            if (match := PER_RANK_FILE.fullmatch(name)) and int(match.group(1)) == rank}


def _shared_files(folder: Path) -> dict[str, torch.Tensor]:
    """What rank 0 wrote for every rank: the folder but the other ranks' own files (on a file system the ranks
    share, those may be half written now; they come from `_gather`)."""
    return {name: _as_tensor(path.read_bytes()) for name, path in _files(folder).items()
            if not PER_RANK_FILE.fullmatch(name)}


def _gather(own: dict[str, bytes], world_size: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's own files, on rank 0 (a collective of every rank); just this rank's in a job of one."""
    import torch.distributed as dist

    if world_size < 2 or not dist.is_available() or not dist.is_initialized():
        return [{name: _as_tensor(data) for name, data in own.items()}]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, own)
    return [{name: _as_tensor(data) for name, data in part.items()} for part in parts]
