"""Replica groups (`replica_groups` in the spec): what a spec may ask, how its nodes, spares and checkpoints split
into the groups' runs, and the lighthouse a node agent serves for them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.failure.v1 import Failure
from temporalio.converter import DataConverter
from temporalio.exceptions import ChildWorkflowError
from temporalio.testing import ActivityEnvironment

from activities.lighthouse import Lighthouses
from activities.lighthouse_models import LighthouseInput
from trainguard import procs
from trainguard.env_policy import exec_env_refused
from trainguard.error_types import ErrorType
from trainguard.models import Incident, IncidentKind
from trainguard.safe_files import read_json
from trainguard.spec import REPLICA_GROUP_ENV, SpecError, parse_spec
from workflows.replica_groups import failed_incidents, group_id, group_spec, lighthouse_node
from workflows.run_core import RunCore
from workflows.run_state import RunState

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GROUPED: dict[str, Any] = {"entrypoint": ["python", "examples/train_ft.py"], "ranks_per_node": 2,
                           "nodes": ["node-0", "node-1", "node-2", "node-3"], "spare_nodes": ["node-4", "node-5"],
                           "replica_groups": {"groups": 2}}


def grouped(**changes: Any) -> dict[str, Any]:
    return {**GROUPED, **changes}


def test_the_example_splits_into_three_groups_of_one_node_and_deals_its_spare_to_the_first() -> None:
    spec = parse_spec(json.loads((EXAMPLES / "ft.json").read_text()))
    groups = spec.replica_group_specs("http://10.0.0.5:29510")
    assert [g.nodes for g in groups] == [["node-0"], ["node-1"], ["node-2"]]
    assert [g.spare_nodes for g in groups] == [["node-3"], [], []]
    assert [g.env["REPLICA_GROUP_ID"] for g in groups] == ["0", "1", "2"]
    assert all(g.env["NUM_REPLICA_GROUPS"] == "3" and g.env["TORCHFT_LIGHTHOUSE"] == "http://10.0.0.5:29510"
               and g.replica_groups is None and g.world_size == 2 for g in groups)
    assert lighthouse_node(spec) == "node-3"  # a spare: a training node's crash never takes it down


def test_groups_take_consecutive_nodes_and_spares_in_turn_and_keep_the_rest_of_the_spec() -> None:
    spec = parse_spec(grouped(env={"SEED": "7"}))
    groups = spec.replica_group_specs("http://lh:1")
    assert [g.nodes for g in groups] == [["node-0", "node-1"], ["node-2", "node-3"]]
    assert [g.spare_nodes for g in groups] == [["node-4"], ["node-5"]]
    assert all(g.env["SEED"] == "7" and g.entrypoint == spec.entrypoint for g in groups)
    assert lighthouse_node(parse_spec(grouped(spare_nodes=[]))) == "node-0"


def test_each_group_checkpoints_apart_and_resumes_its_own_group_of_an_earlier_run() -> None:
    spec = parse_spec(grouped(checkpoint={"namespace": "ft.ab12cd34", "resume_from": "ft-old"}))
    groups = [group_spec(spec, i, g) for i, g in enumerate(spec.replica_group_specs("http://lh:1"))]
    assert [g.checkpoint.namespace for g in groups] == ["ft.ab12cd34.group-0", "ft.ab12cd34.group-1"]
    assert [g.checkpoint.resume_from for g in groups] == ["ft-old-group-0", "ft-old-group-1"]
    plain = parse_spec(GROUPED)
    assert group_spec(plain, 1, plain.replica_group_specs("x")[1]).checkpoint == plain.checkpoint
    assert group_id("run-1", 2) == "run-1-group-2"


@pytest.mark.parametrize(("raw", "fragments"), [
    pytest.param(grouped(nodes=["node-0", "node-1", "node-2"]), ["replica_groups.groups (2) must divide the 3 nodes"],
                 id="uneven"),
    pytest.param(grouped(replica_groups={"groups": 2, "min_groups": 3}), ["min_groups (3) exceeds"], id="min-above"),
    pytest.param(grouped(replica_groups={"groups": 1}), ["replica_groups.groups"], id="one-group"),
    pytest.param({**{k: v for k, v in GROUPED.items() if k not in ("nodes", "spare_nodes")}, "num_nodes": 4},
                 ["replica_groups needs its nodes named"], id="by-count"),
    pytest.param(grouped(min_nodes=2), ["min_nodes with replica_groups"], id="shrink"),
    pytest.param(grouped(restarts={"in_process": True}), ["restarts.in_process with replica_groups"], id="in-process"),
    pytest.param(grouped(env={"TORCHFT_LIGHTHOUSE": "http://elsewhere:1"}), ["env sets TORCHFT_LIGHTHOUSE"],
                 id="own-lighthouse"),
    pytest.param(grouped(replica_groups={"groups": 2, "heartbeat_timeout_s": 0}), ["heartbeat_timeout_s"],
                 id="no-heartbeat"),
])
def test_a_spec_that_cannot_be_split_into_groups_is_refused_naming_what_to_fix(raw: dict[str, Any],
                                                                               fragments: list[str]) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)
    assert all(fragment in str(caught.value) for fragment in fragments), str(caught.value)


def test_node_agents_let_the_groups_environment_through() -> None:
    assert not any(exec_env_refused(name) for name in REPLICA_GROUP_ENV)
    assert exec_env_refused("TORCHFT_SOMETHING_ELSE")  # the rest of the family stays the operator's to allow


async def _serving(address: str) -> bool:
    def get() -> bool:
        try:
            with urllib.request.urlopen(address, timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False
    return await asyncio.to_thread(get)


async def test_the_lighthouse_is_started_once_kept_on_its_port_and_stopped(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    lighthouses = Lighthouses("node-0", tmp_path, "127.0.0.1")
    request = LighthouseInput(workflow_id="run/../1", heartbeat_timeout_ms=1000)  # a hostile id stays in its folder
    env = ActivityEnvironment()
    try:
        await _start_keep_stop(lighthouses, request, env)
    finally:  # whatever failed above, no lighthouse outlives the test
        await ActivityEnvironment().run(lighthouses.stop_lighthouse, request)
        leaked = _lighthouses_under(tmp_path)
        for pid in leaked:
            os.killpg(pid, signal.SIGKILL)
    assert [p.parent.parent for p in tmp_path.glob("**/state.json")] == [tmp_path / "lighthouses"]
    assert leaked == []


def _lighthouses_under(folder: Path) -> list[int]:
    """The lighthouses whose ready file is under `folder`: found by the test's own directory, never by name."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"trainguard.lighthouse" in argv and any(str(folder).encode() in arg for arg in argv):
            found.append(int(entry.name))
    return found


async def _start_keep_stop(lighthouses: Lighthouses, request: LighthouseInput, env: ActivityEnvironment) -> None:
    # a start and its retry racing (the first attempt's timeout passed while it waited): one lighthouse, not two
    first, twin = await asyncio.gather(env.run(lighthouses.start_lighthouse, request),
                                       env.run(lighthouses.start_lighthouse, request))
    assert twin == first and len(_lighthouses_under(lighthouses.workdir)) == 1
    again = await env.run(lighthouses.start_lighthouse, request)  # a retried start finds it serving
    assert again == first and first.address.startswith("http://127.0.0.1:") and await _serving(first.address)

    keeper = asyncio.ensure_future(env.run(lighthouses.keep_lighthouse, request))
    os.killpg(first.pid, signal.SIGKILL)  # it dies: the keeper starts it again on the same port
    state_file = next(lighthouses.workdir.glob("lighthouses/*/state.json"))
    for _ in range(200):  # read, never start: a start of our own would race the keeper's and hide it
        state = read_json(state_file)
        if state["pid"] != first.pid and procs.start_time(state["pid"]) == state["start_time"]:
            break
        await asyncio.sleep(0.1)
    now = await env.run(lighthouses.start_lighthouse, request)  # a start now finds the keeper's
    assert now.pid == state["pid"] != first.pid and now.address == first.address and await _serving(now.address)

    env.cancel()  # the run ended: the keeper stops it
    with pytest.raises(BaseException):  # noqa: B017 - the cancellation, as the activity re-raises it
        await keeper
    assert procs.start_time(now.pid) is None
    await ActivityEnvironment().run(lighthouses.stop_lighthouse, request)  # a stop of a stopped one: a no-op


def test_a_failed_groups_incidents_reach_the_parent_through_its_failure() -> None:
    core = RunCore(RunState())
    crash = Incident(kind=IncidentKind.CRASH, node="node-1", detected_at=12.5, cause="exit code -9")
    core.status.incidents = [crash]
    error = core.fail("restart budget spent", ErrorType.RUN_STOPPED)
    # the way a child's failure reaches its parent: through Temporal's failure proto and back
    converter = DataConverter.default
    failure = Failure()
    converter.failure_converter.to_failure(error, converter.payload_converter, failure)
    decoded = converter.failure_converter.from_failure(failure, converter.payload_converter)
    child = ChildWorkflowError("child failed", namespace="default", workflow_id="r-group-1", run_id="x",
                               workflow_type="TrainingRun", initiated_event_id=1, started_event_id=2,
                               retry_state=None)
    child.__cause__ = decoded
    assert failed_incidents(child) == [crash]
    assert failed_incidents(ChildWorkflowError("timed out", namespace="default", workflow_id="r-group-1",
                                               run_id="x", workflow_type="TrainingRun", initiated_event_id=1,
                                               started_event_id=2, retry_state=None)) == []
