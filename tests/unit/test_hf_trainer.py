"""The Hugging Face Trainer callback (`trainguard.hf`), in one process: a real Trainer and a real rank helper
writing to a temporary folder, the node agent's part (upload, download) left out: a relaunch restores from the
step folder the first attempt wrote, as the agent would hand it over."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from transformers import Trainer, TrainerCallback, TrainingArguments

from trainguard import hf as tg_hf
from trainguard import protocol
from trainguard.rank import EXIT_NO_RETRY, RankRun, state_digest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from hf_trainer import SyntheticTokens, build_model

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
EVERY = 4
MODEL = argparse.Namespace(vocab=64, hidden=16, layers=1, seq_len=8)


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """The Trainer seeds and a restore sets the global RNGs: leave the process as we found it."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(python_state)


class StopAt(TrainerCallback):
    """Ends training after `step` steps, as a crash would, past a checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def environ(tmp_path: Path, attempt: int = 1, restore_step: int | None = None) -> dict[str, str]:
    env = {protocol.ENV_PROGRESS_FILE: str(tmp_path / f"progress-{attempt}.json"),
           protocol.ENV_CHECKPOINT_DIR: str(tmp_path / f"checkpoints-{attempt}"),
           protocol.ENV_CHECKPOINT_EVERY: str(EVERY), protocol.ENV_ATTEMPT: str(attempt),
           "RANK": "0", "WORLD_SIZE": "1"}
    if restore_step is not None:
        env[protocol.ENV_RESTORE_STEP] = str(restore_step)
        env[protocol.ENV_RESTORE_DIR] = str(tmp_path / "checkpoints-1" / protocol.step_dir_name(restore_step))
    return env


def trainer(output_dir: Path, *callbacks: TrainerCallback) -> Trainer:
    args = TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=2, save_strategy="no",
                             report_to="none", seed=7, use_cpu=True, disable_tqdm=True)
    # 24 samples, 6 steps an epoch: the checkpoint at step 4 is mid-epoch, the run crosses into a second epoch.
    return Trainer(model=build_model(MODEL), args=args, train_dataset=SyntheticTokens(24, MODEL.seq_len, 64),
                   callbacks=list(callbacks))


def progress(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_a_trainer_resumed_by_train_from_trainguards_checkpoint_ends_as_one_that_never_stopped(tmp_path: Path) -> None:
    plain = trainer(tmp_path / "plain")
    plain.train()
    fault_free = state_digest(plain.model)

    first = trainer(tmp_path / "out", tg_hf.TrainguardCallback(RankRun(environ(tmp_path))), StopAt(6))
    tg_hf.train(first)
    step_dir = tmp_path / "checkpoints-1" / protocol.step_dir_name(EVERY)
    assert (step_dir / protocol.shard_meta_name(0)).exists()  # the Trainer saved at trainguard's step
    assert not (tmp_path / "checkpoints-1" / protocol.step_dir_name(6)).exists()

    relaunch = trainer(tmp_path / "out", tg_hf.TrainguardCallback(RankRun(environ(tmp_path, 2, EVERY))))
    tg_hf.train(relaunch)

    assert relaunch.state.global_step == STEPS
    assert state_digest(relaunch.model) == fault_free
    report = progress(tmp_path / "progress-2.json")
    assert report["finished"] and report["step"] == STEPS and report["digest"] == fault_free
    assert not (tmp_path / "out" / tg_hf.RESTORE_FOLDER / "rank-00000").exists()  # removed once trained


def test_a_relaunch_that_calls_trainer_train_itself_stops_instead_of_training_from_fresh_weights(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = trainer(tmp_path / "out", tg_hf.TrainguardCallback(RankRun(environ(tmp_path))), StopAt(EVERY))
    tg_hf.train(first)
    relaunch = trainer(tmp_path / "out", tg_hf.TrainguardCallback(RankRun(environ(tmp_path, 2, EVERY))))

    with pytest.raises(SystemExit) as stopped:
        relaunch.train()

    assert stopped.value.code == EXIT_NO_RETRY
    assert "restored the checkpoint of step 4, but the Trainer starts at step 0" in capsys.readouterr().err
    assert "trainguard.hf.train(trainer)" in progress(tmp_path / "progress-2.json")["error"]


def test_a_trainer_that_sees_fewer_processes_than_the_job_has_ranks_stops_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a machine without GPUs the Trainer runs each process alone unless `use_cpu=True`."""
    run = RankRun({**environ(tmp_path), "WORLD_SIZE": "2"}, replicated=True)

    with pytest.raises(SystemExit) as stopped:
        trainer(tmp_path / "out", tg_hf.TrainguardCallback(run))

    assert stopped.value.code == EXIT_NO_RETRY
    assert "sees 1 process(es) in a job of 2 ranks" in capsys.readouterr().err


def test_outside_trainguard_the_callback_saves_nothing_and_train_is_trainer_train(tmp_path: Path) -> None:
    plain = trainer(tmp_path / "plain")
    plain.train()
    unmanaged = trainer(tmp_path / "out", tg_hf.TrainguardCallback(RankRun({})))

    tg_hf.train(unmanaged)

    assert state_digest(unmanaged.model) == state_digest(plain.model)
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_a_job_of_several_ranks_needs_a_replicated_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replicated=True"):
        tg_hf.TrainguardCallback(RankRun({**environ(tmp_path), "WORLD_SIZE": "2"}))


def test_the_rank_helper_never_loads_transformers_and_the_callback_module_does() -> None:
    """A script that does not use the Trainer pays nothing for the callback: it lives in `trainguard.hf` alone."""
    code = "import sys, trainguard.{}\nprint('transformers' in sys.modules)\n"
    loaded = {module: subprocess.run([sys.executable, "-c", code.format(module)], cwd=REPO, capture_output=True,
                                     text=True, timeout=120, check=True).stdout.strip()
              for module in ("rank", "hf")}

    assert loaded == {"rank": "False", "hf": "True"}
