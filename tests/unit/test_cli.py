"""`trainguard spec check` and `run start` on spec files: every file problem names the file and exits 2."""

from __future__ import annotations

import json
import os
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


def test_only_a_bitflip_recurs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["chaos", "crash", "--run", "r", "--node", "node-0", "--recurring"]) == 2
    assert "--recurring is for bitflip only, not crash" in capsys.readouterr().err


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


# ------------------------------------------------------------------------------------- dev modes, demo
def _pretend_up(home: Path, names: list[str], flags: list[str] | None) -> None:
    """Pidfiles naming this test's own process, which is alive: the stack at `home` looks up with `names`
    running, brought up with `flags` (None: by a build that recorded no mode). Nothing here may call `down`."""
    from trainguard.devstack import MODE_FILE
    from trainguard.procs import start_time

    (home / "run").mkdir(parents=True)
    for name in names:
        (home / "run" / f"{name}.json").write_text(json.dumps({"pid": os.getpid(),
                                                               "start_time": start_time(os.getpid())}))
    if flags is not None:
        (home / MODE_FILE).write_text(json.dumps({"flags": flags}))


MODES = {"plain": ([], ["temporal", "s3", "controller", "agent-node-0"]),
         "--slurm": (["--slurm"], ["temporal", "s3", "munged", "slurmctld", "slurmd-node-0", "controller"]),
         "--hosts": (["--hosts"], ["temporal", "s3", "controller", "agent-node-0"]),
         "--tls": (["--tls"], ["temporal", "temporal-tls", "s3", "controller", "agent-node-0"])}


@pytest.mark.parametrize(("running", "asked"), [(r, a) for r in MODES for a in MODES if r != a])
def test_dev_up_in_another_mode_than_the_running_stack_is_refused_saying_what_to_run(
        running: str, asked: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`up` used to start the mode asked for beside the one running: agents beside a Slurm cluster, or a TLS
    front before workers speaking plain gRPC, and runs failed later with no word of why."""
    home = tmp_path / "home"
    monkeypatch.setenv("TRAINGUARD_HOME", str(home))
    for name in ("TRAINGUARD_DEV_SLURM", "TRAINGUARD_DEV_HOSTS", "TRAINGUARD_DEV_TLS"):
        monkeypatch.delenv(name, raising=False)
    flags, names = MODES[running]
    _pretend_up(home, names, flags)
    texts = {"plain": "plain mode", "--slurm": "Slurm mode", "--hosts": "hosts mode", "--tls": "TLS mode"}

    code = cli.main(["dev", "up", *([] if asked == "plain" else [asked])])

    err = capsys.readouterr().err
    again = "trainguard dev up" + ("" if asked == "plain" else f" {asked}")
    assert code == 2
    assert (f"trainguard dev up: the stack at {home} is up in {texts[running]}, not {texts[asked]}: run "
            f"`trainguard dev down` first, then `{again}`") in err
    assert sorted(p.stem for p in (home / "run").glob("*.json")) == sorted(names)  # nothing more started


@pytest.mark.parametrize("running", MODES)
def test_dev_up_in_the_running_stacks_own_mode_goes_ahead(running: str, tmp_path: Path) -> None:
    from trainguard.devstack import DevStack, StackConfig

    flags, names = MODES[running]
    _pretend_up(tmp_path, names, flags)
    config = StackConfig.from_env({"TRAINGUARD_HOME": str(tmp_path), **{f"TRAINGUARD_DEV_{f[2:].upper()}": "1"
                                                                        for f in flags}})

    DevStack(config).check_mode()  # raises when refused


@pytest.mark.parametrize("running", MODES)
def test_every_other_dev_command_finds_the_stack_in_the_mode_it_runs_in(
        running: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dev status`, `down`, `env` and `demo` without flags: the mode it runs in, whatever the home was in before
    (a slurm.conf left by an earlier `dev up --slurm` does not make a plain stack a Slurm one)."""
    import argparse

    monkeypatch.setenv("TRAINGUARD_HOME", str(tmp_path))
    monkeypatch.setenv("TRAINGUARD_DEV_TLS", "1" if running == "plain" else "0")  # the running stack wins
    flags, names = MODES[running]
    _pretend_up(tmp_path, names, flags)
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "slurm.conf").write_text("# left by an earlier `dev up --slurm`\n")

    for action in ("status", "down", "env", None):
        assert cli.dev_stack(argparse.Namespace(action=action)).config.mode == tuple(flags), action


@pytest.mark.parametrize(("names", "mode"), [(["temporal", "slurmctld"], ("--slurm",)),
                                             (["temporal", "temporal-tls"], ("--tls",)),
                                             (["temporal", "agent-node-0"], ())])
def test_a_stack_brought_up_before_modes_were_recorded_is_known_by_what_runs(
        names: list[str], mode: tuple[str, ...], tmp_path: Path) -> None:
    from trainguard.devstack import DevStack, StackConfig

    _pretend_up(tmp_path, names, None)

    assert DevStack(StackConfig.from_env({"TRAINGUARD_HOME": str(tmp_path)})).running_mode() == mode


def _fake_demo(monkeypatch: pytest.MonkeyPatch, home: Path) -> list[str]:
    """The demo's stack and run stood in for: returns the calls made to the stack."""
    from trainguard.devstack import DevStack
    from trainguard.models import RunResult

    calls: list[str] = []
    monkeypatch.setenv("TRAINGUARD_HOME", str(home))
    monkeypatch.delenv("TRAINGUARD_DEV_SLURM", raising=False)
    monkeypatch.setattr(DevStack, "up", lambda self, echo=print: calls.append("up"))
    monkeypatch.setattr(DevStack, "down", lambda self, echo=print: calls.append("down"))

    async def run_demo(*_args: object) -> RunResult:
        return RunResult(workflow_id="quickstart-1", steps_completed=300, incidents=[], goodput=0.7)

    monkeypatch.setattr(cli, "run_demo", run_demo)
    return calls


def test_the_demo_says_it_stopped_the_stack_and_how_to_keep_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo prints Web UI links, then stopped the stack they lead to, saying only "dev stack stopped"."""
    calls = _fake_demo(monkeypatch, tmp_path)

    assert cli.main(["demo"]) == 0

    out = capsys.readouterr().out
    assert calls == ["up", "down"]
    assert "stopped the dev stack the demo started: the Web UI links above no longer answer" in out
    assert "make demo DEMO_ARGS=--keep" in out


def test_the_demo_keeps_the_stack_when_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls = _fake_demo(monkeypatch, tmp_path)

    assert cli.main(["demo", "--keep"]) == 0

    assert calls == ["up"] and "dev stack left running (--keep), Web UI at http://" in capsys.readouterr().out


def test_the_demo_leaves_a_stack_that_was_up_before_it_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls = _fake_demo(monkeypatch, tmp_path)
    _pretend_up(tmp_path, MODES["plain"][1], [])

    assert cli.main(["demo"]) == 0

    assert calls == ["up"] and "was up before the demo and is left running" in capsys.readouterr().out


def test_the_demo_refuses_a_stack_in_slurm_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Its nodes have no agent until a Slurm job starts one: the quickstart run would fail at once."""
    calls = _fake_demo(monkeypatch, tmp_path)
    _pretend_up(tmp_path, MODES["--slurm"][1], ["--slurm"])

    assert cli.main(["demo"]) == 2

    err = capsys.readouterr().err
    assert calls == []
    assert f"the stack at {tmp_path} is up in Slurm mode, where node agents come from Slurm jobs only" in err
    assert "run `trainguard dev down` first, then `trainguard demo`" in err
