"""`parse_spec`: good specs load with defaults; bad ones raise `SpecError` naming the field to fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainguard.spec import (
    ENV_NAME_PATTERN,
    MAX_ENV_VALUE_BYTES,
    MAX_EXEC_BYTES,
    MAX_SPEC_BYTES,
    SpecError,
    exec_env_refused,
    exec_problems,
    is_env_name,
    is_node_id,
    looks_secret,
    parse_labels,
    parse_spec,
)

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
                 ["health", "hang_floor_s (10) must not exceed health.hang_max_s (5)"], id="floor-above-max"),
    pytest.param(_with(health={"hang_floor_s": 600}),
                 ["health", "hang_floor_s (600) must not exceed health.hang_max_s (300 (its default))"],
                 id="floor-above-the-default-max"),
    pytest.param(_with(health={"straggler_ratio": 1.0}), ["health.straggler_ratio"],
                 id="straggler-ratio-one"),
    pytest.param(_with(restarts={"max_restarts": -1}), ["restarts.max_restarts"], id="negative-restarts"),
    pytest.param(_with(ranks_per_node=0), ["ranks_per_node"], id="zero-ranks-per-node"),
    pytest.param(_with(bogus=1), ["bogus: not a field of the spec (its fields: entrypoint, nodes,"],
                 id="unknown-field"),
    pytest.param(_with(health={"hang_flor_s": 600}), ["health.hang_flor_s: not a field of health (did you mean "
                                                      "hang_floor_s?)"], id="misspelt-nested-field"),
    pytest.param(_with(entry_point=["python"]), ["entry_point: not a field of the spec (did you mean entrypoint?)"],
                 id="misspelt-field"),
    pytest.param(_with(hang_floor_s=5), ["hang_floor_s: not a field of the spec (did you mean health.hang_floor_s?)"],
                 id="field-in-the-wrong-section"),
    pytest.param(_with(ranks_per_node=0), ["ranks_per_node: Input should be greater than or equal to 1 (given 0)"],
                 id="value-echoed"),
    pytest.param(_with(checkpoint={"every_steps": "50"}), ['checkpoint.every_steps', '(given "50")'],
                 id="string-value-echoed-as-json"),
    # Secrets never enter the spec: it is stored in the history in the clear.
    pytest.param(_with(env={"HF_TOKEN": "hf_x"}), ["env.HF_TOKEN", "looks like a secret", "docs/operations/security.md"],
                 id="env-HF_TOKEN"),
    pytest.param(_with(env={"AWS_SECRET_ACCESS_KEY": "x"}), ["env.AWS_SECRET_ACCESS_KEY", "worker"],
                 id="env-aws-secret"),
    pytest.param(_with(env={"AWS_SESSION_TOKEN": "x"}), ["env.AWS_SESSION_TOKEN"], id="env-aws-session-token"),
    pytest.param(_with(env={"wandb_api_key": "x"}), ["env.wandb_api_key", "secret"], id="env-api-key-lowercase"),
    pytest.param(_with(env={"DB_PASSWORD": "x"}), ["env.DB_PASSWORD"], id="env-password"),
    # What exec cannot pass is refused here, not at the node.
    pytest.param(_with(env={"SEED": "1\x002"}), ["env.SEED", "NUL byte"], id="env-value-nul"),
    pytest.param(_with(entrypoint=["python", "a\x00b"]), ["entrypoint.1", "NUL byte"], id="entrypoint-nul"),
    pytest.param(_with(working_dir="/tmp/\x00"), ["working_dir", "NUL byte"], id="working-dir-nul"),
    pytest.param(_with(working_dir=""), ["working_dir"], id="working-dir-empty"),
    pytest.param(_with(env={"SEED": "\ud800"}), ["env.SEED", "UTF-8"], id="env-value-lone-surrogate"),
    pytest.param(_with(env={"BLOB": "x" * (MAX_ENV_VALUE_BYTES + 1)}), ["env.BLOB", "MAX_ENV_VALUE_BYTES"],
                 id="env-value-too-large"),
    pytest.param(_with(env={f"V{i}": "x" * 30_000 for i in range(5)}), ["entrypoint and env", "MAX_EXEC_BYTES"],
                 id="exec-too-large"),
    pytest.param(_with(nodes=[f"n{i:04d}-" + "x" * 57 for i in range(4096)]), ["MAX_SPEC_BYTES"],
                 id="spec-too-large"),
    # Strict types: `true` is not 1 rank, "2" is not 2, "yes" is not true.
    pytest.param(_with(ranks_per_node=True), ["ranks_per_node", "valid integer"], id="bool-as-int"),
    pytest.param(_with(ranks_per_node="2"), ["ranks_per_node", "valid integer"], id="numeric-string-as-int"),
    pytest.param(_with(checkpoint={"every_steps": 10.0}), ["checkpoint.every_steps"], id="float-as-int"),
    pytest.param(_with(min_nodes=False), ["min_nodes"], id="bool-as-min-nodes"),
    pytest.param(_with(checkpoint={"local_tier": "yes"}), ["checkpoint.local_tier", "boolean"], id="string-as-bool"),
    pytest.param(_with(health={"hang_max_s": "300"}), ["health.hang_max_s"], id="numeric-string-as-float"),
    # Finite, bounded floats.
    pytest.param(_with(restarts={"window_s": float("inf")}), ["restarts.window_s", "finite"], id="window-infinite"),
    pytest.param(_with(restarts={"window_s": 1e12}), ["restarts.window_s"], id="window-unbounded"),
    pytest.param(_with(health={"hang_max_s": float("nan")}), ["health.hang_max_s", "finite"], id="nan"),
    pytest.param(_with(reserve_timeout_s=float("-inf")), ["reserve_timeout_s"], id="negative-infinity"),
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



def test_integers_as_json_numbers_still_load_into_float_fields() -> None:
    spec = parse_spec(json.loads('{"entrypoint": ["python"], "nodes": ["node-0"], "health": {"hang_floor_s": 5}}'))

    assert spec.health.hang_floor_s == 5.0


def test_infinity_written_in_json_is_refused() -> None:
    raw = json.loads('{"entrypoint": ["python"], "nodes": ["node-0"], "restarts": {"window_s": Infinity}}')

    with pytest.raises(SpecError, match="restarts.window_s"):
        parse_spec(raw)


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "MAX_TOKENS", "PASSES", "PWD", "KEY_FRAMES",
                                  "OMP_NUM_THREADS", "SEED"])
def test_names_that_only_resemble_secrets_are_allowed(name: str) -> None:
    assert not looks_secret(name)
    assert parse_spec(_with(env={name: "1"})).env == {name: "1"}


@pytest.mark.parametrize("name", ["PATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONHOME",
                                  "PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONWARNINGS", "HOME", "BASH_ENV", "ENV",
                                  "GCONV_PATH", "NODE_OPTIONS", "PERL5OPT", "CUDA_INJECTION64_PATH",
                                  "NCCL_NET_PLUGIN", "OPENSSL_CONF", "DYLD_INSERT_LIBRARIES"])
def test_names_that_change_what_runs_are_left_to_the_node_agent(name: str) -> None:
    spec = parse_spec(_with(env={name: "/somewhere"}))  # the spec cannot know what the node's operator allows

    assert spec.exec_env() == [name]
    assert exec_env_refused(name)
    assert not exec_env_refused(name, allowed={name})


@pytest.mark.parametrize("name", ["PYTHONUNBUFFERED", "PYTHONHASHSEED", "OMP_NUM_THREADS", "MALLOC_ARENA_MAX",
                                  "NCCL_DEBUG", "CUDA_VISIBLE_DEVICES", "path", "XLD_PRELOAD"])
def test_tuning_knobs_are_not_exec_env(name: str) -> None:
    assert not exec_env_refused(name)


def test_exec_problems_name_each_field() -> None:
    problems = exec_problems(["python", "a\x00"], {"SEED": "1\x00", "BAD=NAME": "1"}, "/tmp/\x00")

    assert [p.split(":")[0] for p in problems] == ["entrypoint.1", "env.SEED", "env.BAD=NAME", "working_dir"]
    assert exec_problems(["python"], {"BLOB": "x" * MAX_EXEC_BYTES}, None)[0].startswith("entrypoint and env:")
    assert exec_problems(["python", "train.py"], {"SEED": "1"}, "/tmp") == []


def test_a_large_but_bounded_spec_loads() -> None:
    spec = parse_spec(_with(nodes=[f"node-{i}" for i in range(4096)], env={"A": "x" * MAX_ENV_VALUE_BYTES}))

    assert len(spec.model_dump_json()) < MAX_SPEC_BYTES


def test_a_checkpoint_namespace_is_one_key_safe_folder() -> None:
    base = {"entrypoint": ["python", "train.py"], "nodes": ["node-0"]}
    assert parse_spec(base).checkpoint.namespace is None  # default: the workflow id
    assert parse_spec({**base, "checkpoint": {"namespace": "my-run.3fa2c1d0"}}).checkpoint.namespace == "my-run.3fa2c1d0"
    with pytest.raises(SpecError, match="checkpoint.namespace"):
        parse_spec({**base, "checkpoint": {"namespace": "a/b"}})


def test_allow_resume_names_runs_or_any_and_defaults_to_the_runs_own_id() -> None:
    """Issue 40 finding 5: who may restore a run's checkpoints is its owner's choice, recorded in its spec."""
    base = {"entrypoint": ["python", "train.py"], "nodes": ["node-0"]}
    assert parse_spec(base).checkpoint.allow_resume is None  # a later run under its own id, no other
    allowed = parse_spec({**base, "checkpoint": {"allow_resume": ["run-b", "*"]}}).checkpoint.allow_resume
    assert allowed == ["run-b", "*"]
    assert parse_spec({**base, "checkpoint": {"allow_resume": []}}).checkpoint.allow_resume == []
    for bad in (["a/b"], ["run\n"], "run-b", [f"r{i}" for i in range(1000)]):
        with pytest.raises(SpecError, match="checkpoint.allow_resume"):
            parse_spec({**base, "checkpoint": {"allow_resume": bad}})


def test_a_fresh_namespace_for_a_used_id_is_valid_and_new_each_time() -> None:
    from trainguard.client import fresh_namespace

    spaces = {fresh_namespace(w) for w in ("my-run", "my-run", "a/b c", ".hidden")}
    assert len(spaces) == 4
    for space in spaces:
        parse_spec({"entrypoint": ["python", "train.py"], "nodes": ["node-0"], "checkpoint": {"namespace": space}})


# Python's `$` matches before a trailing newline: `re.match(r"...$")` once passed `HF_TOKEN\n` (its value reached
# the history) and `RANK\n`. Every name is matched whole.
WHOLE_NAMES = [
    pytest.param(_with(env={"HF_TOKEN\n": "hf_x"}), ["env.HF_TOKEN\n"], id="env-secret-newline"),
    pytest.param(_with(env={"RANK\n": "3"}), ["env.RANK\n"], id="env-reserved-newline"),
    pytest.param(_with(env={"SEED\n": "1"}), ["env.SEED\n", "not a valid environment variable name"],
                 id="env-newline"),
    pytest.param(_with(env={"SEED\r\n": "1"}), ["env.SEED\r\n"], id="env-crlf"),
    pytest.param(_with(nodes=["node-0\n"]), ["nodes", "item 0"], id="node-newline"),
    pytest.param(_with(spare_nodes=["node-9\n"]), ["spare_nodes", "item 0"], id="spare-newline"),
    pytest.param(_with(checkpoint={"bucket": "bucket\n"}), ["checkpoint.bucket"], id="bucket-newline"),
    pytest.param(_with(checkpoint={"prefix": "runs\n"}), ["checkpoint.prefix"], id="prefix-newline"),
    pytest.param(_with(checkpoint={"namespace": "ns\n"}), ["checkpoint.namespace"], id="namespace-newline"),
    pytest.param(_with(num_nodes=1, nodes=[], node_selector={"gpu\n": "h100"}), ["node_selector"],
                 id="label-key-newline"),
    pytest.param(_with(num_nodes=1, nodes=[], node_selector={"gpu": "h100\n"}), ["node_selector.gpu"],
                 id="label-value-newline"),
]


@pytest.mark.parametrize(("raw", "expected_fragments"), WHOLE_NAMES)
def test_a_name_with_a_trailing_newline_is_refused(raw: dict[str, Any], expected_fragments: list[str]) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)

    for fragment in expected_fragments:
        assert fragment in str(caught.value)


@pytest.mark.parametrize(("name", "env", "node"), [
    ("SEED", True, False), ("node-0", False, True), ("SEED\n", False, False), ("node-0\n", False, False),
    ("\nSEED", False, False), ("SE\nED", False, False), ("", False, False), ("_", True, False), ("n", True, True), ("Node-0", False, False),
])
def test_names_are_matched_whole(name: str, env: bool, node: bool) -> None:
    assert is_env_name(name) is env
    assert (ENV_NAME_PATTERN.match(name) is not None) is env  # a caller's plain `.match` is whole too
    assert is_node_id(name) is node


@pytest.mark.parametrize("name", ["HF_TOKEN\n", "HF_TOKEN\r", "HF-TOKEN", "hf.token", "DB_PASSWORD "])
def test_a_secret_name_with_a_stray_character_still_looks_secret(name: str) -> None:
    assert looks_secret(name)


@pytest.mark.parametrize("label", ["g\npu=h100", "gpu=h1\n00", "gpu=h100\nzone=a"])
def test_a_node_label_with_a_newline_inside_is_refused(label: str) -> None:
    with pytest.raises(ValueError):
        parse_labels([label])


def test_a_node_label_loses_the_blanks_around_it_newlines_included() -> None:
    assert parse_labels([" gpu\n=h100\n"]) == {"gpu": "h100"}  # what is kept is whole: no newline survives


def test_a_misspelling_suggests_only_the_closest_field() -> None:
    """`hang_flor_s` is `hang_floor_s`: `hang_max_s`, also somewhat alike, would only mislead."""
    with pytest.raises(SpecError) as caught:
        parse_spec(_with(health={"hang_flor_s": 600}))

    assert "hang_max_s" not in str(caught.value)


@pytest.mark.parametrize("raw", [
    _with(env={"SEED": 12345678}),  # a value under a harmless name may still be a secret
    _with(hf_tokn="hf-12345678"),  # so may an unknown field's
])
def test_values_that_may_be_secrets_are_never_echoed(raw: dict[str, Any]) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)

    assert "12345678" not in str(caught.value)


def test_a_long_value_is_echoed_cut_short() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(_with(entrypoint="python " + "x" * 10_000))

    message = str(caught.value)
    assert '(given "python xxx' in message and len(message) < 200
