"""`parse_spec`: good specs load with defaults; bad ones raise `SpecError` naming the field to fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainguard.spec import SpecError, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

MINIMAL: dict[str, Any] = {"entrypoint": ["python", "train.py"], "nodes": ["node-0", "node-1"]}


def test_quickstart_example_loads() -> None:
    spec = parse_spec(json.loads((EXAMPLES / "quickstart.json").read_text()))

    assert spec.nodes == ["node-0", "node-1"]
    assert spec.spare_nodes == ["node-2"]
    assert spec.world_size == 4
    assert spec.restarts.max_restarts == 5


def test_minimal_spec_gets_documented_defaults() -> None:
    spec = parse_spec(MINIMAL)

    assert spec.spare_nodes == []
    assert spec.min_nodes is None
    assert spec.ranks_per_node == 1
    assert spec.world_size == 2
    assert spec.env == {}
    assert (spec.checkpoint.bucket, spec.checkpoint.prefix) == ("trainguard", "runs")
    assert (spec.checkpoint.every_steps, spec.checkpoint.keep_last) == (50, 3)
    assert spec.health.startup_grace_s == 180.0
    assert spec.health.hang_max_s == 300.0
    assert (spec.restarts.max_restarts, spec.restarts.max_restarts_without_checkpoint) == (10, 3)


def test_parsed_spec_passes_through_unchanged() -> None:
    spec = parse_spec(MINIMAL)

    assert parse_spec(spec) is spec


def test_spec_round_trips_through_json() -> None:
    spec = parse_spec({**MINIMAL, "env": {"SEED": "1"}, "checkpoint": {"prefix": "team/a.b"}})

    assert parse_spec(json.loads(spec.model_dump_json())) == spec


def _with(**changes: Any) -> dict[str, Any]:
    return {**MINIMAL, **changes}


BAD_SPECS = [
    pytest.param(_with(entrypoint="python train.py"), ["entrypoint"], id="entrypoint-as-string"),
    pytest.param({"nodes": ["node-0"]}, ["entrypoint", "Field required"], id="missing-entrypoint"),
    pytest.param(_with(entrypoint=[" "]), ["entrypoint", "must name a program"], id="blank-program"),
    pytest.param(_with(nodes=[]), ["nodes"], id="empty-nodes"),
    pytest.param(_with(nodes=["node-0", "Node_1"]), ["nodes", "item 1", "'Node_1'"], id="bad-node-id"),
    pytest.param(_with(nodes=["node-0", "node-0"]), ["nodes", "unique"], id="duplicate-nodes"),
    pytest.param(_with(spare_nodes=["BAD"]), ["spare_nodes", "'BAD'"], id="bad-spare-id"),
    pytest.param(_with(spare_nodes=["node-1"]), ["spare_nodes", "node-1"], id="spare-overlaps-nodes"),
    pytest.param(_with(min_nodes=3), ["min_nodes (3)", "number of nodes (2)"], id="min-nodes-too-many"),
    pytest.param(_with(env={"RANK": "3"}), ["env", "'RANK'", "cannot be overridden"], id="env-RANK"),
    pytest.param(_with(env={"MASTER_PORT": "1"}), ["env", "'MASTER_PORT'"], id="env-MASTER_PORT"),
    pytest.param(_with(env={"TRAINGUARD_X": "1"}), ["env", "'TRAINGUARD_X'", "cannot be overridden"],
                 id="env-TRAINGUARD-prefix"),
    pytest.param(_with(env={"1BAD": "1"}), ["env", "'1BAD'"], id="env-bad-name"),
    pytest.param(_with(checkpoint={"prefix": "runs/../other"}), ["checkpoint.prefix", "'..'"],
                 id="prefix-dotdot"),
    pytest.param(_with(checkpoint={"prefix": "runs//x"}), ["checkpoint.prefix"], id="prefix-empty-segment"),
    pytest.param(_with(checkpoint={"bucket": "Bad_Bucket"}), ["checkpoint.bucket"], id="bad-bucket"),
    pytest.param(_with(checkpoint={"every_steps": 0}), ["checkpoint.every_steps"], id="every-steps-zero"),
    pytest.param(_with(health={"hang_floor_s": 10, "hang_max_s": 5}),
                 ["health", "hang_floor_s must not exceed health.hang_max_s"], id="floor-above-max"),
    pytest.param(_with(health={"straggler_ratio": 1.0}), ["health.straggler_ratio"],
                 id="straggler-ratio-one"),
    pytest.param(_with(restarts={"max_restarts": -1}), ["restarts.max_restarts"], id="negative-restarts"),
    pytest.param(_with(ranks_per_node=0), ["ranks_per_node"], id="zero-ranks-per-node"),
    pytest.param(_with(bogus=1), ["bogus", "Extra inputs are not permitted"], id="unknown-field"),
    pytest.param(_with(checkpoint={"bogus": 1}), ["checkpoint.bogus"], id="unknown-nested-field"),
]


@pytest.mark.parametrize(("raw", "expected_fragments"), BAD_SPECS)
def test_bad_spec_message_names_the_field(raw: dict[str, Any], expected_fragments: list[str]) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)

    message = str(caught.value)
    assert message.startswith("invalid run spec: ")
    for fragment in expected_fragments:
        assert fragment in message


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(_with(entrypoint="x", ranks_per_node=0))

    assert "entrypoint:" in str(caught.value)
    assert "ranks_per_node:" in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "type_name"),
    [(["node-0"], "list"), ('{"nodes": []}', "str"), (None, "NoneType"), (3, "int")],
)
def test_non_object_spec_is_rejected(raw: Any, type_name: str) -> None:
    with pytest.raises(SpecError, match=f"spec must be a JSON object, got {type_name}"):
        parse_spec(raw)

