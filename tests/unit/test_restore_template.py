"""`run.restore` and the state a DCP checkpoint loads into (issue 31, items 5 and 6).

Building that state (`get_state_dict(model, optimizer)`) initialises the optimizer's state, an AdamW step at
learning rate 0, so a script that builds it on every start trains differently from plain torchrun: the
template is a function, called only when a DCP checkpoint is restored. A script that gives `restore` no
template cannot load its DCP checkpoints: its first DCP save stops the run, naming the script's own lines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard import protocol
from trainguard.rank import EXIT_NO_RETRY, RankRun, state_digest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """A gloo group of this process alone: what DCP's collectives need, with no peer to wait for."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {protocol.ENV_PROGRESS_FILE: str(tmp_path / "progress.json"),
            protocol.ENV_CHECKPOINT_DIR: str(tmp_path / "checkpoints"), protocol.ENV_CHECKPOINT_EVERY: "10",
            "RANK": "0", "WORLD_SIZE": "1", **extra}


def _line_of(marker: str) -> int:
    """The line of this file that holds `marker` (a comment on the call the error must name)."""
    return next(n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                if line.rstrip().endswith(f"# {marker}"))


def _progress_error(tmp_path: Path) -> str:
    return json.loads((tmp_path / "progress.json").read_text()).get("error") or ""


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        inputs = torch.Generator().manual_seed(step)
        model(torch.randn(4, 3, generator=inputs)).square().mean().backward()
        optimizer.step()


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_building_the_template_on_a_fresh_optimizer_changes_training() -> None:
    """Why the template is a function: the bug this guards against, shown on a tiny model."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    plain, plain_opt = _model_and_optimizer()
    _train(plain, plain_opt, 3)
    built, built_opt = _model_and_optimizer()
    get_state_dict(built, built_opt)  # the restore template, built before the first step
    _train(built, built_opt, 3)
    assert state_digest(plain) != state_digest(built)


def test_a_fresh_start_never_builds_the_template(tmp_path: Path) -> None:
    calls: list[int] = []

    def template() -> dict[str, Any]:
        calls.append(1)
        return {}

    assert RankRun(_environ(tmp_path)).restore(template) is None
    assert RankRun({}).restore(template) is None  # plain torchrun: no trainguard environment
    assert calls == []


def test_a_dcp_restore_builds_the_template_once_and_loads_into_it(tmp_path: Path, one_process_group: None) -> None:
    env = _environ(tmp_path)
    saver = RankRun(env, checkpoint_format="dcp")
    saver.save(10, {"model": {"w": torch.arange(4.0)}})
    saver.finish()

    step_dir = tmp_path / "checkpoints" / protocol.step_dir_name(10)
    built: list[dict[str, Any]] = []

    def template() -> dict[str, Any]:
        built.append({"model": {"w": torch.zeros(4)}})
        return built[-1]

    run = RankRun({**env, protocol.ENV_RESTORE_DIR: str(step_dir), protocol.ENV_RESTORE_STEP: "10"})
    restored = run.restore(template)
    assert len(built) == 1 and restored is built[0]
    assert torch.equal(restored["model"]["w"], torch.arange(4.0))


def test_a_dcp_save_after_a_restore_with_no_template_stops_the_run_naming_the_scripts_lines(
        tmp_path: Path, one_process_group: None) -> None:
    run = RankRun(_environ(tmp_path), checkpoint_format="dcp")
    assert run.restore() is None  # restore without a template
    with pytest.raises(SystemExit) as stopped:
        run.save(10, {"model": {"w": torch.arange(4.0)}})  # the first DCP save
    assert stopped.value.code == EXIT_NO_RETRY
    error = _progress_error(tmp_path)
    here = re.escape(__file__)
    assert re.search(f"{here}:{_line_of('the first DCP save')}: run.save", error), error
    assert f"{__file__}:{_line_of('restore without a template')} calls run.restore() with none" in error, error
    assert "rank.py" not in error and "run.restore(state)" in error
    assert not (tmp_path / "checkpoints" / protocol.step_dir_name(10)).exists()


def test_a_restore_with_no_template_still_suits_torch_save_checkpoints(tmp_path: Path) -> None:
    """A DDP script (plain tensors, one `torch.save` per rank) keeps calling `run.restore()` as before."""
    run = RankRun(_environ(tmp_path))
    assert run.restore() is None
    run.save(10, {"model": {"w": torch.arange(4.0)}})
    run.finish()
    step_dir = tmp_path / "checkpoints" / protocol.step_dir_name(10)
    assert (step_dir / protocol.shard_meta_name(0)).exists()
    restored = RankRun({**_environ(tmp_path), protocol.ENV_RESTORE_DIR: str(step_dir)}).restore()
    assert restored is not None and torch.equal(restored["model"]["w"], torch.arange(4.0))


def test_a_dcp_checkpoint_restored_with_no_template_stops_naming_the_scripts_line(
        tmp_path: Path, one_process_group: None) -> None:
    saver = RankRun(_environ(tmp_path), checkpoint_format="dcp")
    saver.save(10, {"model": {"w": torch.arange(4.0)}})
    saver.finish()
    step_dir = tmp_path / "checkpoints" / protocol.step_dir_name(10)
    run = RankRun({**_environ(tmp_path), protocol.ENV_RESTORE_DIR: str(step_dir), protocol.ENV_RESTORE_STEP: "10"})
    with pytest.raises(SystemExit) as stopped:
        run.restore()  # the previous API's call
    assert stopped.value.code == EXIT_NO_RETRY
    error = _progress_error(tmp_path)
    assert error.startswith(f"trainguard: {__file__}:{_line_of('the previous API' + chr(39) + 's call')}:"), error
    assert "run.restore(state)" in error and "rank.py" not in error
