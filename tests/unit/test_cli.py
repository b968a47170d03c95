"""`trainguard spec check` and `run start` on spec files: every file problem names the file and exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard import cli

GOOD = {"entrypoint": ["python", "train.py"], "nodes": ["node-0"]}


def _check(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["spec", "check", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_good_file_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(GOOD))

    code, out, err = _check(path, capsys)

    assert (code, err) == (0, "")
    assert f"{path}: valid (1 nodes x 1 ranks, world size 1)" in out


def test_a_byte_order_mark_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spec.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode())

    code, out, _ = _check(path, capsys)

    assert code == 0 and "valid" in out


@pytest.mark.parametrize(("content", "fragment"), [
    (None, "cannot read the spec file"),
    (b'{"entrypoint": ["python"], "nodes": ', "not valid JSON: Expecting value at line 1"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    (b"[" * 100_000, "not valid JSON"),
    (json.dumps({**GOOD, "ranks_per_node": True}).encode(), "ranks_per_node"),
    (json.dumps({**GOOD, "env": {"HF_TOKEN": "hf_abc"}}).encode(), "env.HF_TOKEN"),
    (json.dumps(["node-0"]).encode(), "spec must be a JSON object"),
])
def test_a_bad_file_names_itself_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             content: bytes | None, fragment: str) -> None:
    path = tmp_path / "spec.json"
    if content is not None:
        path.write_bytes(content)

    code, out, err = _check(path, capsys)

    assert code == 2 and out == ""
    assert err.startswith(f"{path}: ") and fragment in err


HUGE = "9" * 5001  # past Python's 4,300-digit limit on converting text to int


@pytest.mark.parametrize(("text", "fragment"), [
    ('{"entrypoint": ["python"], "nodes": ["node-0"], "checkpoint": {"every_steps": %s}}' % HUGE,
     "checkpoint.every_steps: a number of 5001 digits"),
    ('{"entrypoint": ["python"], "nodes": ["node-0"], "ranks_per_node": -%s}' % HUGE,
     "ranks_per_node: a number of 5001 digits"),
    ('{"entrypoint": ["python"], "nodes": ["node-0", %s]}' % HUGE, "nodes.1: a number of 5001 digits"),
    ('{"entrypoint": ["python"], "nodes": ["node-0"], "env": {"SEED": %s}}' % HUGE, "env.SEED: a number"),
    (HUGE, "(spec): a number of 5001 digits"),
])
def test_a_huge_number_names_the_file_and_the_field_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                text: str, fragment: str) -> None:
    path = tmp_path / "spec.json"
    path.write_text(text)

    code, out, err = _check(path, capsys)

    assert code == 2 and out == ""
    assert err.startswith(f"{path}: ") and fragment in err and "Exceeds the limit" not in err


def test_a_long_but_convertible_number_is_left_to_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spec.json"
    path.write_text('{"entrypoint": ["python"], "nodes": ["node-0"], "ranks_per_node": %s}' % ("9" * 4000))

    code, _, err = _check(path, capsys)

    assert code == 2 and "ranks_per_node: Input should be less than or equal to 256" in err


def test_env_a_node_agent_refuses_is_valid_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**GOOD, "env": {"LD_PRELOAD": "/x.so", "SEED": "1"}}))

    code, out, err = _check(path, capsys)

    assert code == 0 and "valid" in out
    assert "warning: env.LD_PRELOAD" in err and "--allow-env LD_PRELOAD" in err and "SEED" not in err


def test_run_start_refuses_a_bad_file_before_connecting(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard.client import TrainguardClient

    async def no_server(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("connected to Temporal for a spec that cannot run")

    monkeypatch.setattr(TrainguardClient, "connect", no_server)
    path = tmp_path / "spec.json"
    path.write_text("{")

    code = cli.main(["run", "start", str(path)])

    assert code == 2
    assert capsys.readouterr().err.startswith(f"{path}: not valid JSON")


@pytest.mark.parametrize(("argv", "fragment"), [
    (["chaos", "slow", "--run", "r", "--node", "node-0", "--duty", "5"], "5 is out of range: give 0.05 to 0.95"),
    (["chaos", "slow", "--run", "r", "--node", "node-0", "--duty", "0"], "0 is out of range"),
])
def test_out_of_range_chaos_arguments_are_refused_not_clamped(argv: list[str], fragment: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert fragment in capsys.readouterr().err


def test_chaos_needs_a_node_or_a_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["chaos", "crash", "--run", "r"]) == 2
    assert "name the node (--node) or the rank (--rank)" in capsys.readouterr().err


def test_a_rank_names_its_node() -> None:
    from trainguard.client import node_of_rank
    from trainguard.models import RunStatus

    status = RunStatus(nodes=["node-0", "node-2"], world_size=4)  # node-1 was replaced by node-2
    assert [node_of_rank(status, r) for r in range(4)] == ["node-0", "node-0", "node-2", "node-2"]
    with pytest.raises(ValueError, match="rank 4 is not in the run"):
        node_of_rank(status, 4)


def test_run_start_resume_from_refuses_a_bad_run_id_before_connecting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard.client import TrainguardClient

    async def no_server(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("connected to Temporal with a run id that cannot name a run")

    monkeypatch.setattr(TrainguardClient, "connect", no_server)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(GOOD))

    assert cli.main(["run", "start", str(path), "--resume-from", "../victim"]) == 2
    assert capsys.readouterr().err.startswith("trainguard run start --resume-from: run id '../victim'")


def _started_runs(monkeypatch: pytest.MonkeyPatch, running: dict[str, dict[str, object]],
                  ) -> list[dict[str, object]]:
    """A client whose Temporal records the specs it is asked to start, with the runs named in `running` running
    (each with its memo) and a controller there."""
    from trainguard.client import TrainguardClient

    started: list[dict[str, object]] = []

    class Workflows:
        async def start_workflow(self, _type: str, spec: dict[str, object], **_kwargs: object) -> None:
            started.append(spec)

    class Client(TrainguardClient):
        async def earlier_run(self, workflow_id: str) -> str | None:
            return None

        async def running_memo(self, workflow_id: str) -> dict[str, object] | None:
            return running.get(workflow_id)

        async def controller_running(self, max_idle_s: float = 90.0) -> bool:
            return True

    async def fake_connect(*_args: object, **_kwargs: object) -> TrainguardClient:
        return Client(Workflows())  # type: ignore[arg-type]

    monkeypatch.setattr(TrainguardClient, "connect", fake_connect)
    return started


def test_run_start_resume_from_records_the_run_in_the_spec(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`--resume-from RUN` is recorded as the spec's `checkpoint.resume_from`, the history's record of it."""
    started = _started_runs(monkeypatch, running={})
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(GOOD))

    assert cli.main(["run", "start", str(path), "--id", "new-run", "--resume-from", "old-run"]) == 0

    [spec] = started
    assert spec["checkpoint"]["resume_from"] == "old-run"  # type: ignore[index]
    assert spec["checkpoint"]["namespace"] is None  # type: ignore[index]  # its own: the workflow id
    assert "never prunes that run's checkpoints" in capsys.readouterr().err


def test_run_start_under_a_running_runs_id_attaches_to_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A requeued Slurm job starts its run again under the same id: it finds the run, and starts no second one."""
    from trainguard.client import load_spec
    from trainguard.run_attach import start_memo

    asked = load_spec({**GOOD, "nodes": ["a-0", "a-1"]})  # what the job's first start recorded
    started = _started_runs(monkeypatch, running={"slurm-42": start_memo(asked)})
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(GOOD))

    assert cli.main(["run", "start", str(path), "--id", "slurm-42", "--nodes", "a-0,a-1"]) == 0
    out = capsys.readouterr()
    assert started == [] and out.out.strip() == "slurm-42" and "attached to it" in out.err


def test_a_plain_dev_up_on_a_home_once_in_slurm_mode_is_a_plain_stack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dev up --slurm`, `dev down`, then `dev up`: the home's slurm.conf outlives `down`, and a plain `up` took
    the stack to Slurm mode again, with no node agents (every quickstart run then failed at once)."""
    import argparse

    monkeypatch.setenv("TRAINGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRAINGUARD_DEV_SLURM", raising=False)
    conf = cli.dev_stack(argparse.Namespace(action="status", slurm=True)).slurm.conf
    conf.parent.mkdir(parents=True)
    conf.write_text("# left by an earlier `dev up --slurm`\n")

    assert not cli.dev_stack(argparse.Namespace(action="up", slurm=False)).config.slurm
    assert cli.dev_stack(argparse.Namespace(action="up", slurm=True)).config.slurm
    assert cli.dev_stack(argparse.Namespace(action="down", slurm=False)).config.slurm  # still found to stop it


@pytest.mark.parametrize(("argv", "expected"), [
    (["rnu"], "invalid choice: 'rnu' (choose from 'dev', "),
    (["rnu"], "; did you mean run?"),
    (["dev", "upp"], "did you mean up?"),
    (["chaos", "hnag", "--run", "r"], "did you mean hang?"),
    (["dev", "up", "--slrum"], "unrecognized arguments: --slrum (--slrum: did you mean --slurm?)"),
    (["run", "start", "spec.json", "--nodse", "a"], "--nodse: did you mean --nodes?"),
    (["run", "start", "spec.json", "--resume_from=a"], "--resume_from: did you mean --resume-from?"),
    (["run", "status", "r", "--follow"], "--follow is a flag of trainguard run logs"),
    (["run", "status", "r", "--wiat"], "--wiat: did you mean --wait (trainguard run start)?"),
])
def test_a_misspelt_command_or_flag_says_what_was_meant(
        argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)

    assert exited.value.code == 2 and expected in capsys.readouterr().err


def test_a_flag_like_none_is_refused_without_a_guess(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["nodes", "list", "--xyzzy"])

    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.endswith("trainguard nodes: error: unrecognized arguments: --xyzzy\n")
