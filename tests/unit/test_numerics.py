"""What a rank computes to catch wrong numbers: the fingerprint of its replicated state, the judgement of its loss,
and the chaos that fakes both (`trainguard.numerics`, through `trainguard.rank.RankRun`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from trainguard import evidence
from trainguard import numerics
from trainguard.protocol import read_progress
from trainguard.rank import RankRun


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_replicas_with_the_same_parameters_have_the_same_fingerprint() -> None:
    one, two = _model(), _model()
    assert (numerics.fingerprint(list(one.parameters()), 5, "g").value
            == numerics.fingerprint(list(two.parameters()), 5, "g").value)


def test_a_single_flipped_bit_changes_the_fingerprint() -> None:
    model = _model()
    params = list(model.parameters())
    before = numerics.fingerprint(params, 1, "g")
    flipped = numerics.flip_high_bit(params)
    after = numerics.fingerprint(params, 1, "g")
    assert before.value != after.value
    assert "parameter 0 element 0" in flipped
    # The highest mantissa bit: the element changes by at most half its value, and stays finite.
    changed = params[0].detach().reshape(-1)[0].item()
    assert math.isfinite(changed)
    numerics.flip_high_bit(params)  # the same bit again: back to the original bits
    assert numerics.fingerprint(params, 1, "g").value == before.value


def test_a_low_bit_of_another_tensor_changes_it_too() -> None:
    model = _model()
    params = list(model.parameters())
    before = numerics.fingerprint(params, 1, "g").value
    with torch.no_grad():
        params[3].reshape(-1).view(torch.int32)[0] ^= 1  # the lowest bit of the last bias
    assert numerics.fingerprint(params, 1, "g").value != before


def test_plain_parameters_form_one_group_of_replicas() -> None:
    assert numerics.fingerprint_group(_model().parameters(), rank=3) == numerics.REPLICATED


@pytest.mark.parametrize(("window", "loss", "faulty"), [
    ([], float("nan"), True),
    ([1.0] * 20, float("inf"), True),
    ([1.0] * 20, float("-inf"), True),
    ([1.0, 1.1, 0.9] * 5, 1.2, False),  # the noise of batches
    ([1.0, 1.1, 0.9] * 5, 150.0, True),  # a spike far outside the window
    ([1.0, 1.1, 0.9] * 2, 150.0, False),  # too few steps to call anything a spike
    ([1.0, 1.1, 0.9] * 5, 0.01, False),  # a loss that falls is no fault
    ([0.5] * 20, 49.0, False),  # a flat window: a spike is at least a hundred times its median
    ([0.5] * 20, 51.0, True),
    ([0.03, 0.04, 0.02] * 10, 0.55, False),  # a small model's swing past its fast descent (examples/train.py)
])
def test_judge_loss(window: list[float], loss: float, faulty: bool) -> None:
    assert (numerics.judge_loss(window, loss) is not None) is faulty


def test_a_steady_loss_can_ask_for_a_tighter_bound() -> None:
    assert numerics.judge_loss([2.0, 2.1, 1.9] * 5, 8.0) is None
    assert numerics.judge_loss([2.0, 2.1, 1.9] * 5, 8.0, ratio=3.0) is not None


def test_the_spec_reaches_the_rank(tmp_path: Path) -> None:
    run = RankRun({"TRAINGUARD_PROGRESS_FILE": str(tmp_path / "progress.json"), "TRAINGUARD_LOSS_SPIKE_RATIO": "3.0"})
    for step in range(1, 16):
        run.step_done(step, loss=2.0)
    run.step_done(16, loss=8.0)
    assert run._numerical is not None and run._numerical["step"] == 16


def test_poisoned_forward_makes_the_next_loss_and_gradients_nan_once() -> None:
    model = _model()
    inputs = torch.ones(4, 8)
    numerics.poison_next_forward(model)
    loss = model(inputs).sum()
    loss.backward()
    assert math.isnan(loss.item())
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    assert all(p.grad is not None and torch.isnan(p.grad).all() for p in weights)
    assert math.isfinite(model(inputs).sum().item())  # once


# ------------------------------------------------------------------------------------------------ in the rank
def _run(tmp_path: Path, every: int = 2) -> RankRun:
    base = tmp_path / "evidence" / "rank-00001"
    return RankRun({"TRAINGUARD_PROGRESS_FILE": str(tmp_path / "progress.json"),
                    "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path / "checkpoints"), "TRAINGUARD_CHECKPOINT_EVERY": "0",
                    "TRAINGUARD_FINGERPRINT_EVERY": str(every), "TRAINGUARD_EVIDENCE_BASE": str(base),
                    "RANK": "1", "WORLD_SIZE": "2"})


def test_a_rank_reports_fingerprints_every_interval(tmp_path: Path) -> None:
    run = _run(tmp_path)
    model = run.fingerprint(_model())
    for step in range(1, 6):
        run.step_done(step, loss=1.0)
        run._last_write = 0.0  # the 50 ms bound would skip these writes
    progress = read_progress(tmp_path / "progress.json")
    assert progress is not None and progress.fingerprints is not None
    taken = [numerics.Fingerprint.from_json(item) for item in progress.fingerprints]
    assert [f.step for f in taken] == [2, 4]
    assert taken[-1].value == numerics.fingerprint(list(model.parameters()), 4, "").value


def test_each_fingerprint_carries_the_losses_reported_since_the_one_before_exactly(tmp_path: Path) -> None:
    run = _run(tmp_path)
    run.fingerprint(_model())
    losses = {1: 0.1, 2: torch.tensor(0.2), 3: 1 / 3, 4: 0.4}
    for step, loss in losses.items():
        run.step_done(step, loss=loss)
        run._last_write = 0.0
    progress = read_progress(tmp_path / "progress.json")
    assert progress is not None and progress.fingerprints is not None
    taken = [numerics.Fingerprint.from_json(item) for item in progress.fingerprints]
    exact = {step: float(loss).hex() for step, loss in losses.items()}
    assert [dict(f.losses) for f in taken] == [{1: exact[1], 2: exact[2]}, {3: exact[3], 4: exact[4]}]


def test_without_the_one_line_no_fingerprint_is_taken(tmp_path: Path) -> None:
    run = _run(tmp_path)
    for step in range(1, 5):
        run.step_done(step)
        run._last_write = 0.0
    progress = read_progress(tmp_path / "progress.json")
    assert progress is not None and progress.fingerprints is None


def test_a_nan_loss_is_reported_at_once(tmp_path: Path) -> None:
    run = _run(tmp_path)
    run.fingerprint(_model())
    run.step_done(1, loss=torch.tensor(2.0))
    run.step_done(2, loss=torch.tensor(float("nan")))  # within 50 ms of the last write: written all the same
    progress = read_progress(tmp_path / "progress.json")
    assert progress is not None and progress.numerical is not None
    assert progress.numerical["step"] == 2 and "nan" in progress.numerical["detail"]
    assert progress.numerical["at"] is not None  # when the rank saw it: the earliest of several is the cause


def test_chaos_bitflip_reaches_the_model_after_the_step(tmp_path: Path) -> None:
    run = _run(tmp_path, every=1)
    model = run.fingerprint(_model())
    twin = _model()
    run.step_done(1)
    assert run._fingerprints[-1].value == numerics.fingerprint(list(twin.parameters()), 1, "").value
    assert run._evidence is not None
    evidence.write_atomic(run._evidence.paths.chaos, json.dumps({"mode": "bitflip", "at": 0}))
    run._last_write = 0.0
    run.step_done(2)  # carried out after this step's report: the next fingerprint differs from its twin's
    run.step_done(3)
    assert run._fingerprints[-1].value != numerics.fingerprint(list(twin.parameters()), 3, "").value
    assert not torch.equal(next(model.parameters()), next(twin.parameters()))


def test_chaos_nan_makes_the_next_loss_nan(tmp_path: Path) -> None:
    run = _run(tmp_path)
    model = run.fingerprint(_model())
    assert run._evidence is not None
    evidence.write_atomic(run._evidence.paths.chaos, json.dumps({"mode": "nan", "at": 0}))
    run.step_done(1, loss=1.0)
    assert math.isnan(model(torch.ones(2, 8)).sum().item())


def test_outside_trainguard_everything_is_a_no_op() -> None:
    run = RankRun({})
    model = _model()
    assert run.fingerprint(model) is model
    run.step_done(1, loss=float("nan"))
    assert not run._fingerprints and run._numerical is None
