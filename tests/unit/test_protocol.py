"""The agent-to-rank contract (`trainguard.protocol`): both sides read what the other writes, the JSON stays
what older agents and rank helpers wrote, and no module outside the protocol retypes one of its names."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from activities.rank_records import AttemptRecord, RankProcess, read_finish, read_report
from trainguard import protocol
from trainguard.rank import RankRun

REPO = Path(__file__).resolve().parents[2]


def _rank_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    layout = protocol.RunLayout.of(tmp_path, "run-1")
    layout.progress_dir(2).mkdir(parents=True)
    return {"RANK": "1", "WORLD_SIZE": "2", protocol.ENV_ATTEMPT: "2",
            protocol.ENV_PROGRESS_FILE: str(layout.progress_file(2, 1)),
            protocol.ENV_CHECKPOINT_DIR: str(layout.checkpoint_dir), **extra}


def test_the_agent_reads_the_progress_and_finish_the_rank_helper_writes(tmp_path: Path) -> None:
    env = _rank_env(tmp_path, **{protocol.ENV_RESTORE_STEP: "7"})
    run = RankRun(env)  # its first report, at once: the step it resumes from
    path = Path(env[protocol.ENV_PROGRESS_FILE])
    report = read_report(path)
    assert report is not None and (report.rank, report.step, report.finished) == (1, 7, False)
    assert read_finish(path) == protocol.Finish()
    run.step_done(8, compute_s=0.25)
    run.finish(digest="abc")  # always written, however soon after the step
    report = read_report(path)
    assert report is not None and (report.step, report.compute_s, report.finished) == (8, 0.25, True)
    assert read_finish(path).digest == "abc"


def test_progress_json_keeps_the_keys_older_agents_read(tmp_path: Path) -> None:
    env = _rank_env(tmp_path)
    RankRun(env).finish(digest=None)
    written = json.loads(Path(env[protocol.ENV_PROGRESS_FILE]).read_text())
    assert set(written) == {"rank", "pid", "attempt", "step", "time", "step_time_s", "compute_s", "timed_steps",
                            "finished", "digest", "mean_step_s"}
    assert protocol.Progress.from_json(written).to_json() == written


@pytest.mark.parametrize("text", ["", "{", "[]", '{"rank": 1}', '{"rank": "x", "step": 1, "time": 0}'])
def test_a_progress_file_half_written_or_foreign_reads_as_none(tmp_path: Path, text: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    assert protocol.read_progress(path) is None
    assert protocol.read_progress(tmp_path / "missing.json") is None


def test_ranks_json_round_trips_between_the_agent_and_the_protocol(tmp_path: Path) -> None:
    record = AttemptRecord(workflow_id="run-1", attempt=3, master_addr="127.0.0.1", master_port=29500,
                           start_step=40, launched_at=1.5, chain_id="c1", survivors={1},
                           restore_tiers=["peer"])
    record.ranks = {0: RankProcess(0, 100, "55"), 1: RankProcess(1, 101, None)}
    record.standby = RankProcess(-1, 102, "57")
    data = json.loads(json.dumps(record.to_json(parked=[protocol.ProcessEntry(103, "58")])))
    assert data == {"workflow_id": "run-1", "attempt": 3, "master_addr": "127.0.0.1", "master_port": 29500,
                    "start_step": 40, "launched_at": 1.5, "chain_id": "c1",
                    "ranks": [{"rank": 0, "pid": 100, "start_time": "55"}, {"rank": 1, "pid": 101, "start_time": None}],
                    "survivors": [1], "restore_tiers": ["peer"], "standby": {"pid": 102, "start_time": "57"},
                    "parked": [{"pid": 103, "start_time": "58"}]}
    parsed = protocol.AttemptFile.from_json(data)
    assert [p.pid for p in parsed.processes()] == [100, 101, 102, 103]  # what `dev down` kills, parked too
    assert protocol.AttemptFile.from_json({k: v for k, v in data.items() if k != "parked"}).parked == []
    again = AttemptRecord.from_json(parsed.to_json())
    assert (sorted(again.ranks), again.survivors, again.standby.pid) == ([0, 1], {1}, 102)  # type: ignore[union-attr]

    layout = protocol.RunLayout.of(tmp_path / "nodes" / "node-1", "run-1")
    layout.root.mkdir(parents=True)
    parsed.write(layout.ranks_file)
    (tmp_path / "nodes" / "node-2" / "runs" / "bad").mkdir(parents=True)
    (tmp_path / "nodes" / "node-2" / "runs" / "bad" / protocol.RANKS_FILE).write_text("{")
    assert [(node, r.attempt) for node, r in protocol.node_attempt_files(tmp_path / "nodes")] == [("node-1", 3)]


def test_a_live_rank_reads_the_rejoin_the_agent_writes(tmp_path: Path) -> None:
    rejoin = protocol.Rejoin(attempt=4, master_addr="10.0.0.1", master_port=1234, world_size=4,
                             progress_file="/p", checkpoint_request_file="/c")
    rejoin.write(tmp_path / "r.json")
    assert protocol.Rejoin.read(tmp_path / "r.json") == rejoin
    (tmp_path / "half.json").write_text('{"attempt": 4')
    assert protocol.Rejoin.read(tmp_path / "half.json") is None


@pytest.mark.parametrize("beat", [
    protocol.WatchHeartbeat(node="node-1", attempt=2, steps={0: 5, 1: None}),
    protocol.WatchHeartbeat(node="node-1", attempt=2, downloading=True),
    protocol.WatchHeartbeat(node="node-1", attempt=2, uploading=3),
])
def test_the_client_decodes_every_watch_heartbeat(beat: protocol.WatchHeartbeat) -> None:
    wire = json.loads(json.dumps(beat.to_json()))  # what the data converter hands the client
    assert protocol.WatchHeartbeat.from_json(wire) == beat
    assert protocol.WatchHeartbeat.from_json({"uploaded_rank": 1}) is None


# ---------------------------------------------------------------------------------- one owner per name
OWNED = {value for name, value in vars(protocol).items() if name.startswith("ENV_") and isinstance(value, str)}
OWNED |= {protocol.RANKS_FILE, protocol.CHECKPOINT_REQUEST_FILE, protocol.STANDBY_FILE}
SOURCES = ("trainguard", "activities", "workflows", "workers", "infra", "examples")


def _retyped(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(root)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in OWNED]


def test_no_module_outside_the_protocol_retypes_a_contract_name() -> None:
    found = [hit for folder in SOURCES for path in sorted((REPO / folder).rglob("*.py"))
             if path != REPO / "trainguard" / "protocol.py" for hit in _retyped(path)]
    assert found == [], "use the trainguard.protocol constant instead:\n" + "\n".join(found)


def test_the_retyped_name_check_sees_a_retyped_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('import os\nmanaged = "TRAINGUARD_PROGRESS_FILE" in os.environ\n')
    assert _retyped(bad, tmp_path) == ["bad.py:2: 'TRAINGUARD_PROGRESS_FILE'"]


def test_a_runs_tmpdir_is_short_enough_for_a_data_loaders_socket_whatever_its_run_id() -> None:
    # Python's multiprocessing binds <TMPDIR>/pymp-XXXXXXXX/listener-XXXXXXXX (107 bytes at most): a DataLoader's
    # workers failed to start under `<workdir>/runs/<a long run id>/tmp`, and the rank waited forever.
    from trainguard.protocol import RunLayout

    workdir = Path("/tmp/fresh-clone/.pytest-stack/abcdef12/nodes/node-0")
    long_id = "bench-attr-clean-" + "x" * 180
    tmp = RunLayout.of(workdir, long_id).tmp_dir

    assert len(str(tmp)) + len("/pymp-xxxxxxxx/listener-xxxxxxxx") < 107
    assert tmp != RunLayout.of(workdir, long_id + "y").tmp_dir  # one a run
