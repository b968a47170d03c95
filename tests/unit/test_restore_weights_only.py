"""A planted shard cannot run code in a rank (issue 27 item 5): restores load weights only, unless the node's
operator allows pickle (`TRAINGUARD_ALLOW_PICKLE`)."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.rank import ENV_ALLOW_PICKLE, EXIT_NO_RETRY, RankRun

PWNED = "pwned"


class Payload:
    """What a hostile shard holds: unpickling it creates a file (it could as well run anything)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, PWNED))


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(python_state)


def _environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"TRAINGUARD_PROGRESS_FILE": str(tmp_path / "progress-0.json"),
            "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path / "checkpoints"), "TRAINGUARD_CHECKPOINT_EVERY": "10",
            "RANK": "0", "WORLD_SIZE": "1", **extra}


def _restore_dir(tmp_path: Path, state: Any) -> Path:
    """A restore folder as the agent leaves it: the shard and its meta, whose sha256 matches (the manifest
    vouched for these bytes, as a manifest planted with its own checksums would)."""
    folder = tmp_path / "restore"
    folder.mkdir(exist_ok=True)
    shard = folder / "rank-00000.pt"
    torch.save(state, shard)
    meta = {"rank": 0, "step": 10, "size_bytes": shard.stat().st_size,
            "sha256": hashlib.sha256(shard.read_bytes()).hexdigest()}
    (folder / "rank-00000.json").write_text(json.dumps(meta))
    return folder


def test_a_planted_pickle_shard_is_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    folder = _restore_dir(tmp_path, {"model": {"w": torch.ones(2)}, "x": Payload(marker)})
    run = RankRun(_environ(tmp_path, TRAINGUARD_RESTORE_DIR=str(folder)))

    with pytest.raises(SystemExit) as stopped:
        run.restore()

    assert stopped.value.code == EXIT_NO_RETRY
    assert not marker.exists()
    error = json.loads((tmp_path / "progress-0.json").read_text())["error"]
    assert "refused to restore" in error and ENV_ALLOW_PICKLE in error
    assert "(Unsupported global: GLOBAL getattr)" in error


def test_the_operators_opt_in_unpickles(tmp_path: Path) -> None:
    """The control: the same shard on a node whose operator allows pickle runs the payload."""
    marker = tmp_path / "marker"
    folder = _restore_dir(tmp_path, {"x": Payload(marker)})
    RankRun(_environ(tmp_path, TRAINGUARD_RESTORE_DIR=str(folder), **{ENV_ALLOW_PICKLE: "1"})).restore()
    assert marker.read_text() == PWNED


def test_a_trainers_state_restores_weights_only(tmp_path: Path) -> None:
    """What the example trainers save (a model's and an Adam optimizer's state dicts, ints, floats, strings)
    and the helper's RNG (numpy's too) restore without any opt-in."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saver = RankRun(_environ(tmp_path))
    saver.save(10, {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 10, "loss": 0.5,
                    "note": "hello"})
    saver.finish()
    restorer = RankRun(_environ(tmp_path, TRAINGUARD_RESTORE_DIR=str(tmp_path / "checkpoints" / "step-00000010")))

    state = restorer.restore()

    assert state is not None and state["step"] == 10 and state["note"] == "hello"
    assert torch.equal(state["model"]["weight"], model.state_dict()["weight"])
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=1e-3)
    fresh.load_state_dict(state["optim"])


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_planted_dcp_metadata_is_not_executed(tmp_path: Path, one_process_group: None) -> None:
    run = RankRun(_environ(tmp_path), checkpoint_format="dcp")
    run.save(10, {"model": {"w": torch.arange(4.0)}})
    run.finish()
    step_dir = tmp_path / "checkpoints" / "step-00000010"
    marker = tmp_path / "marker"
    (step_dir / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    restorer = RankRun(_environ(tmp_path, TRAINGUARD_RESTORE_DIR=str(step_dir)))

    with pytest.raises(SystemExit) as stopped:
        restorer.restore({"model": {"w": torch.zeros(4)}})

    assert stopped.value.code == EXIT_NO_RETRY
    assert not marker.exists()


def test_a_dcp_checkpoint_restores_its_state_and_rng_weights_only(tmp_path: Path, one_process_group: None) -> None:
    torch.manual_seed(3)
    run = RankRun(_environ(tmp_path), checkpoint_format="dcp")
    run.save(10, {"model": {"w": torch.arange(4.0)}, "step": 10})
    expected = torch.rand(2)
    run.finish()
    torch.manual_seed(99)
    restorer = RankRun(_environ(tmp_path, TRAINGUARD_RESTORE_DIR=str(tmp_path / "checkpoints" / "step-00000010")))
    into: dict[str, Any] = {"model": {"w": torch.zeros(4)}, "step": 0}

    restorer.restore(into)

    assert torch.equal(into["model"]["w"], torch.arange(4.0)) and into["step"] == 10
    assert torch.equal(torch.rand(2), expected)
