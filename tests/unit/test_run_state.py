"""What a run carries across continue-as-new: one owner (`RunState`), parsed in one place."""

from __future__ import annotations

import json
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue

from activities.fingerprint_models import Tie
from trainguard.models import CheckpointRef, Incident, IncidentKind, Phase, RunStatus
from workflows.goodput import AttemptPace, Goodput
from workflows.run_core import RunCore
from workflows.run_state import (NO_INPUT, Live, OperatorIntents, RunInputError, RunState, continued_input,
                                 decode_run_input, parse_run_input)
from workflows.training_run import TrainingRun

SPEC: dict[str, Any] = {"nodes": ["node-0"], "entrypoint": ["python", "train.py"]}

REBUILT_BY_HISTORY = {"spec"}
"""RunCore attributes each history rebuilds: the spec comes with every history's input."""


def _everything_set() -> RunState:
    """A state whose every field differs from its default: a field added to `RunState` must be added here,
    or the round trip below cannot show it is carried."""
    crash = Incident(kind=IncidentKind.CRASH, node="node-0", rank=0, attempt=2, detail="exit 1")
    return RunState(
        status=RunStatus(phase=Phase.RUNNING, attempt=3, nodes=["node-0"], incidents=[crash], step=40,
                         latest_checkpoint=CheckpointRef(step=40, manifest_key="k", bucket="b")),
        started_at=1.5, spares=["node-9"], parks=True, parked_spares=["node-9"], leased=True, launched=True,
        restart_times=[2.5],
        restarts_without_checkpoint=1, last_committed_step=40, state_since_attempt=3, straggler_streak={1: 2},
        slow_window_end=1010.5,
        lost=["node-3"], replaced=["node-4"], corrupt_steps=[30], restore_before=31,
        tie=Tie(step=40, nodes=["node-0", "node-1"], attempt=2, swapped_out="node-1"), commit_times=[4.0, 5.0], commit_clock_from=5.0,
        restore_tier="store", warm=crash, learned_gaps={100: 12.5, 200: 11.0},
        goodput=Goodput(useful_s=2.5, unpaced_steps=3, from_step=40,
                        current=AttemptPace(attempt=3, from_step=30, first_step_at=6.0, commit_step=40, commit_at=7.0)),
        injected_at={"crash@node-0": 3.5}, publish_search_attributes=True, continued=2,
        intents=OperatorIntents(pause=True, resume=True, abort_reason="no", draining=["node-0"]))


def test_every_field_of_the_state_is_carried_through_continue_as_new() -> None:
    state = _everything_set()
    defaults = RunState()
    unset = [name for name in RunState.model_fields if getattr(state, name) == getattr(defaults, name)]
    assert not unset, f"set these in _everything_set so the round trip covers them: {unset}"
    unset_intents = [name for name in OperatorIntents.model_fields
                     if getattr(state.intents, name) == getattr(OperatorIntents(), name)]
    assert not unset_intents
    parsed = parse_run_input(continued_input(_spec(), state), continued=True, workflow_id="run-1")
    assert parsed.carried == state


def _spec() -> Any:
    from trainguard.spec import parse_spec
    return parse_spec(SPEC)


def test_the_workflow_holds_no_state_outside_what_it_carries_or_rebuilds() -> None:
    """Every attribute of the run and of its parts is the carried `RunState`, the rebuilt `Live`, the spec from
    the input, or a reference to another part: a new field anywhere else fails here."""
    run = TrainingRun()
    parts = {id(value): value for value in vars(run).values()}
    assert all(type(p).__module__.startswith("workflows.") for p in parts.values())
    core = run.core
    assert set(vars(core)) == {"state", "live"} | REBUILT_BY_HISTORY
    assert isinstance(core.state, RunState) and isinstance(core.live, Live)
    for part in parts.values():
        if part is core:
            continue
        stray = {name for name, value in vars(part).items() if id(value) not in parts}
        assert not stray, f"{type(part).__name__} holds state of its own: {stray} (put it in RunState or Live)"


def test_a_core_is_fresh_per_history() -> None:
    assert RunCore(RunState()).live == Live()


@pytest.mark.parametrize(("raw", "continued", "workflow_id", "says"), [
    ({"spec": SPEC, "carried": {}}, False, "run-1", "the run's own continue-as-new state"),
    ({"spec": SPEC, "carried": {"status": {"attempt": "many"}}}, True, "run-1", "invalid carried state"),
    ({"spec": SPEC, "carried": {}, "extra": 1}, True, "run-1", "unexpected keys"),
    ({"spec": SPEC, "carried": "nope"}, True, "run-1", "invalid carried state"),
    ({"nodes": ["node-0"]}, False, "run-1", "entrypoint"),
    (SPEC, False, "a/../b", "workflow id"),
    (SPEC, False, "x\n", "workflow id"),
])
def test_a_bad_input_is_refused_naming_what_to_fix(raw: Any, continued: bool, workflow_id: str, says: str) -> None:
    with pytest.raises(RunInputError) as refused:
        parse_run_input(raw, continued=continued, workflow_id=workflow_id)
    assert says in str(refused.value)


def test_a_spec_alone_starts_a_run() -> None:
    parsed = parse_run_input(SPEC, continued=False, workflow_id="run-1")
    assert parsed.carried is None and parsed.spec.nodes == ["node-0"]


def _payload(data: bytes, encoding: bytes = b"json/plain") -> RawValue:
    return RawValue(Payload(metadata={"encoding": encoding}, data=data))


@pytest.mark.parametrize(("raw", "says"), [
    (_payload(b'{"checkpoint": {"every_steps": ' + b"7" * 5001 + b"}}"),
     "checkpoint.every_steps: a number of 5001 digits, too large for any field"),
    (_payload(b'{"nodes": [1, -' + b"9" * 4301 + b"]}"), "nodes.1: a number of 4301 digits"),
    (_payload(b"{not json"), "not valid JSON"),
    (_payload(b"[" * 100_000), "nested too deeply"),
    (_payload(b"\x8a\x01", encoding=b"binary/protobuf"), "encoded as 'binary/protobuf'"),
    (NO_INPUT, "the run's input is missing"),
])
def test_an_input_that_does_not_decode_is_refused_naming_what_to_fix(raw: RawValue, says: str) -> None:
    """Issue 40 finding 12: the SDK decoding these failed the workflow task, retried forever."""
    with pytest.raises(RunInputError) as refused:
        decode_run_input(raw)
    assert says in str(refused.value)


def test_a_json_spec_decodes_to_what_parse_run_input_takes() -> None:
    assert decode_run_input(_payload(json.dumps(SPEC).encode())) == SPEC
    assert decode_run_input(_payload(b"", encoding=b"binary/null")) is None
