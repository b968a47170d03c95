"""The rank helper a training script calls: progress heartbeats, checkpoint shards, verified restore."""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard import rank as rank_module
from trainguard.rank import COMPUTE_STEPS, EXIT_NO_RETRY, RankRun, state_digest


class FakeClock:
    """Stands in for the `time` module inside `trainguard.rank`: time moves only when a test says so."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(rank_module, "time", fake)
    return fake


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """Restore draws global RNG state; leave the process as we found it."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(python_state)


def _environ(tmp_path: Path, rank: int = 1, every: int = 10, **extra: str) -> dict[str, str]:
    return {
        "TRAINGUARD_PROGRESS_FILE": str(tmp_path / f"progress-{rank}.json"),
        "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "TRAINGUARD_CHECKPOINT_EVERY": str(every),
        "TRAINGUARD_ATTEMPT": "2",
        "RANK": str(rank),
        "WORLD_SIZE": "4",
        **extra,
    }


def _progress(run_env: dict[str, str]) -> dict[str, Any]:
    return json.loads(Path(run_env["TRAINGUARD_PROGRESS_FILE"]).read_text())


# ------------------------------------------------------------------------------------------ progress


def test_init_reports_the_start_step(tmp_path: Path, clock: FakeClock) -> None:
    env = _environ(tmp_path, TRAINGUARD_RESTORE_STEP="40")

    run = RankRun(env)

    assert run.managed and run.start_step == 40
    progress = _progress(env)
    assert (progress["rank"], progress["attempt"], progress["step"]) == (1, 2, 40)
    assert progress["time"] == clock.now
    assert progress["step_time_s"] is None


def test_step_done_writes_the_step_and_its_time(tmp_path: Path, clock: FakeClock) -> None:
    env = _environ(tmp_path)
    run = RankRun(env)

    clock.advance(1.0)
    run.step_done(1)
    first = _progress(env)
    clock.advance(0.5)
    run.step_done(2)
    second = _progress(env)

    assert (first["step"], first["time"], first["step_time_s"]) == (1, clock.now - 0.5, None)
    assert second["step"] == 2
    assert second["time"] == clock.now
    assert second["step_time_s"] == pytest.approx(0.5)
    assert second["timed_steps"] == 1


def test_step_done_reports_compute_time_as_a_median_of_recent_steps(tmp_path: Path, clock: FakeClock) -> None:
    env = _environ(tmp_path)
    run = RankRun(env)
    clock.advance(1.0)
    run.step_done(1)
    assert _progress(env)["compute_s"] is None

    # A first step that compiles (2 s), then steady 0.1 s steps: one long step never shows as slowness.
    for step, compute_s in enumerate([2.0, 0.1, 0.1, 0.12], start=2):
        clock.advance(1.0)
        run.step_done(step, compute_s=compute_s)
    assert _progress(env)["compute_s"] == pytest.approx(0.11)

    # A rank that turns slow (a throttled GPU) shows it within half the window.
    for step in range(6, 6 + COMPUTE_STEPS // 2 + 1):
        clock.advance(1.0)
        run.step_done(step, compute_s=0.5)
    assert _progress(env)["compute_s"] == pytest.approx(0.5)


def test_step_done_throttles_progress_writes(tmp_path: Path, clock: FakeClock) -> None:
    env = _environ(tmp_path)
    run = RankRun(env)
    clock.advance(1.0)
    run.step_done(1)

    clock.advance(0.01)
    run.step_done(2)
    throttled = _progress(env)["step"]
    clock.advance(0.1)
    run.step_done(3)

    assert throttled == 1
    assert _progress(env)["step"] == 3


@pytest.mark.parametrize(
    ("every", "step", "expected"),
    [(10, 10, True), (10, 20, True), (10, 5, False), (10, 0, False), (1, 1, True), (0, 10, False)],
)
def test_should_save(tmp_path: Path, every: int, step: int, expected: bool) -> None:
    assert RankRun(_environ(tmp_path, every=every)).should_save(step) is expected


# --------------------------------------------------------------------------------------- checkpoints


def _step_dir(tmp_path: Path, step: int) -> Path:
    return tmp_path / "checkpoints" / f"step-{step:08d}"


def test_save_writes_the_shard_then_its_meta(tmp_path: Path) -> None:
    env = _environ(tmp_path, rank=3)
    run = RankRun(env)

    stall_s = run.save(20, {"model": {"w": torch.arange(6.0)}, "step": 20})
    run.finish(digest="abc")

    shard = _step_dir(tmp_path, 20) / "rank-00003.pt"
    meta = json.loads((_step_dir(tmp_path, 20) / "rank-00003.json").read_text())
    assert stall_s >= 0.0
    assert meta == {
        "rank": 3,
        "step": 20,
        "size_bytes": shard.stat().st_size,
        "sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
    }
    assert sorted(p.name for p in _step_dir(tmp_path, 20).iterdir()) == ["rank-00003.json", "rank-00003.pt"]
    progress = _progress(env)
    assert progress["finished"] is True
    assert progress["digest"] == "abc"


def test_save_is_not_affected_by_training_after_it(tmp_path: Path) -> None:
    weights = torch.zeros(4)
    run = RankRun(_environ(tmp_path))

    run.save(10, {"w": weights})
    weights.add_(1.0)  # the next optimizer step, while the shard may still be being written
    run.finish()

    restored = RankRun(_environ(tmp_path, TRAINGUARD_RESTORE_DIR=str(_step_dir(tmp_path, 10)))).restore()
    assert restored is not None
    assert torch.equal(restored["w"], torch.zeros(4))


def test_restore_returns_the_state_and_resumes_the_random_streams(tmp_path: Path) -> None:
    torch.manual_seed(7)
    random.seed(7)
    torch.rand(5)
    saver = RankRun(_environ(tmp_path))
    saver.save(10, {"model": {"w": torch.tensor([1.0, 2.0])}, "note": "hello"})
    expected_torch, expected_python = torch.rand(3), random.random()
    saver.finish()

    torch.manual_seed(12345)
    random.seed(12345)
    restorer = RankRun(_environ(tmp_path, TRAINGUARD_RESTORE_DIR=str(_step_dir(tmp_path, 10)),
                                TRAINGUARD_RESTORE_STEP="10"))
    state = restorer.restore()

    assert state is not None
    assert torch.equal(state["model"]["w"], torch.tensor([1.0, 2.0]))
    assert state["note"] == "hello"
    assert "_trainguard" not in state
    assert restorer.start_step == 10
    assert torch.equal(torch.rand(3), expected_torch)
    assert random.random() == expected_python


def test_restore_refuses_a_shard_that_fails_its_checksum(tmp_path: Path) -> None:
    run = RankRun(_environ(tmp_path))
    run.save(10, {"w": torch.ones(64)})
    run.finish()
    shard = _step_dir(tmp_path, 10) / "rank-00001.pt"
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0x01
    shard.write_bytes(bytes(data))

    restorer = RankRun(_environ(tmp_path, TRAINGUARD_RESTORE_DIR=str(_step_dir(tmp_path, 10))))

    with pytest.raises(RuntimeError, match="does not match its checksum"):
        restorer.restore()


def test_a_failed_shard_write_surfaces_at_finish(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").write_text("a file where the checkpoint directory should be")
    run = RankRun(_environ(tmp_path))

    run.save(10, {"w": torch.ones(2)})

    with pytest.raises(RuntimeError, match="writing a checkpoint shard failed"):
        run.finish()


def test_restore_without_a_restore_dir_is_a_fresh_start(tmp_path: Path) -> None:
    assert RankRun(_environ(tmp_path)).restore() is None


# ------------------------------------------------------------------------------ in-process restart


class SleepingClock(FakeClock):
    def sleep(self, seconds: float) -> None:
        self.advance(seconds)


def test_rejoin_without_in_process_restarts_re_raises_at_once(tmp_path: Path) -> None:
    run = RankRun(_environ(tmp_path, TRAINGUARD_REJOIN_FILE=str(tmp_path / "rejoin.json")))
    assert not run.can_rejoin
    error = RuntimeError("Connection reset by peer")
    with pytest.raises(RuntimeError) as raised:
        run.rejoin(error, {}, 7)
    assert raised.value is error


def test_rejoin_gives_up_when_no_newer_group_is_named_in_time(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SleepingClock()
    monkeypatch.setattr(rank_module, "time", clock)
    rejoin = tmp_path / "rejoin.json"
    # A group named for this same attempt is an old instruction, not the next one.
    rejoin.write_text(json.dumps({"attempt": 2, "master_addr": "h", "master_port": 1, "world_size": 4,
                                  "progress_file": "p", "checkpoint_request_file": "c"}))
    run = RankRun(_environ(tmp_path, TRAINGUARD_REJOIN_FILE=str(rejoin), TRAINGUARD_REJOIN_TIMEOUT_S="30"))
    assert run.can_rejoin
    started = clock.now
    error = RuntimeError("Connection reset by peer")
    with pytest.raises(RuntimeError) as raised:
        run.rejoin(error, {}, 7)
    assert raised.value is error
    assert 30 <= clock.now - started < 31
    assert run.attempt == 2  # nothing about the run changed


def test_a_standby_waits_for_its_role_and_returns_as_that_rank(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    role = tmp_path / "standby.json"
    monkeypatch.setenv("TRAINGUARD_STANDBY_FILE", str(role))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TRAINGUARD_JOIN", raising=False)
    timer = threading.Timer(0.2, lambda: role.write_text(json.dumps({"env": {"RANK": "3", "TRAINGUARD_JOIN": "1"}})))
    timer.start()
    started = time.monotonic()
    rank_module.standby(poll_s=0.01)
    assert time.monotonic() - started >= 0.15  # it waited for the role
    assert os.environ["RANK"] == "3" and os.environ["TRAINGUARD_JOIN"] == "1"
    assert "TRAINGUARD_STANDBY_FILE" not in os.environ
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("TRAINGUARD_JOIN")


def test_standby_is_a_no_op_for_a_rank_started_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINGUARD_STANDBY_FILE", raising=False)
    rank_module.standby()  # returns at once


def test_a_joining_rank_reports_no_progress_until_it_knows_its_step(tmp_path: Path) -> None:
    env = _environ(tmp_path, TRAINGUARD_JOIN="1", TRAINGUARD_RESTORE_STEP="0")
    run = RankRun(env)
    assert run.joining
    assert not Path(env["TRAINGUARD_PROGRESS_FILE"]).exists()


# ---------------------------------------------------------------------------------- outside trainguard


def test_outside_trainguard_every_call_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = RankRun({})

    run.step_done(1)
    stall_s = run.save(10, {"w": torch.ones(2)})
    run.finish(digest="x")

    assert run.managed is False
    assert (run.rank, run.world_size, run.start_step) == (0, 1, 0)
    assert run.should_save(10) is False
    assert stall_s == 0.0
    assert run.restore() is None
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------------------------- state_digest


def test_state_digest_equal_for_equal_tensors() -> None:
    first = {"b": torch.tensor([1.0, 2.0]), "a": torch.zeros(3, dtype=torch.int64)}
    second = {"a": torch.zeros(3, dtype=torch.int64), "b": torch.tensor([1.0, 2.0])}

    assert state_digest(first) == state_digest(second)


def test_state_digest_changes_with_a_single_bit() -> None:
    weights = torch.tensor([1.0, 2.0, 3.0])
    flipped = weights.clone()
    flipped.view(torch.int32)[1] ^= 1  # the lowest mantissa bit of 2.0

    assert not torch.equal(weights, flipped)
    assert state_digest({"w": weights}) != state_digest({"w": flipped})


def test_state_digest_depends_on_parameter_names() -> None:
    assert state_digest({"w": torch.ones(2)}) != state_digest({"v": torch.ones(2)})


def test_state_digest_of_a_module_matches_its_state_dict() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)

    assert state_digest(model) == state_digest(model.state_dict())


def test_no_retry_exit_code_is_ex_config() -> None:
    assert EXIT_NO_RETRY == 78


# ------------------------------------------------------------------------ DCP, replicas, digests


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """A gloo group of this process alone: what DCP's collectives need, with no peer to wait for."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_dcp_save_hashes_every_file_and_restores_in_place(tmp_path: Path, one_process_group: None) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    env = {**_environ(tmp_path, rank=0), "WORLD_SIZE": "1"}
    run = RankRun(env, checkpoint_format="dcp")
    weights = torch.arange(6.0)
    run.save(10, {"model": {"w": weights}})
    weights.add_(100.0)  # training goes on: the checkpoint holds the value at the save
    run.finish()

    step_dir = _step_dir(tmp_path, 10)
    meta = json.loads((step_dir / "rank-00000.json").read_text())
    assert meta["format"] == "dcp"
    assert sorted(f["name"] for f in meta["files"]) == ["dcp/.metadata", "dcp/__0_0.distcp"]
    for entry in meta["files"]:
        assert entry["sha256"] == hashlib.sha256((step_dir / entry["name"]).read_bytes()).hexdigest()
    assert meta["sha256"] == rank_module.files_digest(meta["files"])

    restored = RankRun({**env, "TRAINGUARD_RESTORE_DIR": str(step_dir), "TRAINGUARD_RESTORE_STEP": "10"})
    into = {"model": {"w": torch.zeros(6)}}
    assert restored.restore(into) is into
    assert torch.equal(into["model"]["w"], torch.arange(6.0))
    with pytest.raises(SystemExit) as stopped:  # no template to load into: a restart would fail the same way
        restored.restore()
    assert stopped.value.code == rank_module.EXIT_NO_RETRY
    dcp_to_torch_save(step_dir / "dcp", tmp_path / "plain.pt")  # plain PyTorch reads it, no trainguard
    assert torch.equal(torch.load(tmp_path / "plain.pt")["model"]["w"], torch.arange(6.0))


def test_the_rank_helper_imports_nothing_but_the_standard_library() -> None:
    """A user's training environment gets trainguard's rank helper, not its controller's dependencies (torch
    itself is imported only where a call needs it)."""
    import subprocess
    import sys

    def loaded(code: str) -> set[str]:
        probe = f"import sys; {code}; print(' '.join({{m.split('.')[0] for m in sys.modules}}))"
        return set(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                  env={**os.environ, "PYTHONPATH": str(Path(rank_module.__file__).parents[1])},
                                  ).stdout.split())

    bare = loaded("pass")  # the interpreter's own start-up (site, the editable install's finder)
    added = loaded("import trainguard.rank as tg; tg.RankRun({})") - bare - set(sys.stdlib_module_names)
    assert added == {"trainguard"}, added


def test_a_torch_whose_async_save_takes_no_stager_still_saves_and_restores_dcp(
        tmp_path: Path, one_process_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The package asks for a torch floor, not this machine's torch: DCP's kept stager is newer than that."""
    import torch.distributed.checkpoint as dcp

    newer = dcp.async_save
    calls: list[dict[str, Any]] = []

    def older_async_save(state_dict: dict[str, Any], *, checkpoint_id: Any = None, storage_writer: Any = None,
                         planner: Any = None, process_group: Any = None) -> Any:
        calls.append({"storage_writer": storage_writer})
        return newer(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                     process_group=process_group)

    monkeypatch.setattr(dcp, "async_save", older_async_save)
    env = {**_environ(tmp_path, rank=0), "WORLD_SIZE": "1"}
    run = RankRun(env, checkpoint_format="dcp")
    weights = torch.arange(6.0)
    run.save(10, {"model": {"w": weights}})
    weights.add_(100.0)
    run.finish()

    assert len(calls) == 1 and run._dcp_stager is None
    restored = RankRun({**env, "TRAINGUARD_RESTORE_DIR": str(_step_dir(tmp_path, 10))})
    into = {"model": {"w": torch.zeros(6)}}
    restored.restore(into)
    assert torch.equal(into["model"]["w"], torch.arange(6.0))


def test_a_torch_save_of_dtensors_is_marked_sharded(tmp_path: Path, one_process_group: None) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    run = RankRun({**_environ(tmp_path, rank=0), "WORLD_SIZE": "1"}, checkpoint_format="torch")
    run.save(10, {"model": {"w": distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])}})
    run.save(20, {"model": {"w": torch.arange(6.0)}})
    run.finish()

    # It loads only onto the world size that wrote it: the agent carries the mark into the manifest.
    assert json.loads((_step_dir(tmp_path, 10) / "rank-00000.json").read_text())["sharded"] is True
    assert "sharded" not in json.loads((_step_dir(tmp_path, 20) / "rank-00000.json").read_text())


def test_a_save_held_up_by_a_write_whose_peer_died_is_judged_by_the_plain_hang_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DCP write whose peer died or hung while it was being planned can block in its own group for up to
    `DCP_GROUP_TIMEOUT_S`. The next save waits for it before it says it is saving: meanwhile the agent holds
    the rank to its plain bound, without the checkpoint grace, and stops it as hung well before that."""
    import threading

    from activities.progress import silence_bound_s
    from activities.rank_records import read_report
    from trainguard.spec import HealthSpec

    peer_gone = threading.Event()
    write = RankRun._write_shard

    def stuck_write(self: RankRun, *args: Any) -> None:
        peer_gone.wait(30)
        write(self, *args)

    monkeypatch.setattr(RankRun, "_write_shard", stuck_write)
    env = _environ(tmp_path, rank=0)
    run = RankRun(env)
    for step in range(1, 11):
        run.step_done(step)
    run.save(10, {"w": torch.zeros(4)})  # returns at once; its write is the one stuck
    for step in range(11, 21):
        run.step_done(step)
    next_save = threading.Thread(target=run.save, args=(20, {"w": torch.ones(4)}), daemon=True)
    next_save.start()
    next_save.join(0.3)
    try:
        assert next_save.is_alive(), "the next save waits for the write before it"
        report = read_report(Path(env["TRAINGUARD_PROGRESS_FILE"]))
        assert report is not None and report.step > 0 and not report.saving
        health = HealthSpec(checkpoint_grace_s=60.0)
        assert silence_bound_s(report, 0, health) == silence_bound_s(report, 0, health.model_copy(
            update={"checkpoint_grace_s": 0.0}))
    finally:
        peer_gone.set()
        next_save.join(10)
    run.finish()


def test_a_replica_records_rank_0s_shard_at_each_checkpoint_step_and_writes_none(tmp_path: Path) -> None:
    run = RankRun(_environ(tmp_path, rank=2, every=10), replicated=True)
    for step in range(1, 21):
        run.step_done(step)  # a script that saves on rank 0 only: this rank never calls save
    for step in (10, 20):
        meta = json.loads((_step_dir(tmp_path, step) / "rank-00002.json").read_text())
        assert meta == {"rank": 2, "step": step, "size_bytes": 0, "sha256": "", "replica_of": 0}
        assert sorted(p.name for p in _step_dir(tmp_path, step).iterdir()) == ["rank-00002.json"]


def test_a_rank_that_skips_a_checkpoint_step_stops_the_run_naming_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    env = _environ(tmp_path, rank=1, every=10)
    run = RankRun(env)
    for step in range(1, 11):
        run.step_done(step)
    with pytest.raises(SystemExit) as stopped:
        run.step_done(11)
    assert stopped.value.code == EXIT_NO_RETRY
    assert "rank 1 passed checkpoint step 10" in capsys.readouterr().err
    assert "replicated=True" in _progress(env)["error"]


def test_a_rank_healed_past_a_checkpoint_step_by_a_live_group_did_not_skip_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    env = _environ(tmp_path, rank=1, every=10)
    run = RankRun(env)
    for step in range(1, 10):
        run.step_done(step)
    run.step_done(21)  # TorchFT healed the group at step 9 from a live group at step 20: 10 and 20 were not its
    run.step_done(22)  # and it goes on, saving from its next checkpoint step
    assert "error" not in _progress(env)


def test_a_rank_without_peers_may_skip_checkpoints(tmp_path: Path) -> None:
    run = RankRun(_environ(tmp_path, rank=1, every=10))  # no process group: a stand-in, a single process
    for step in range(1, 31):
        run.step_done(step)


def test_state_digest_reports_a_failure_instead_of_raising() -> None:
    class Broken:
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError(".numpy() is not supported for tensor subclasses")

    assert state_digest(Broken()).startswith("unavailable: RuntimeError: .numpy() is not supported")


def test_state_digest_ignores_a_ddp_wrappers_prefix() -> None:
    weights = {"layer.weight": torch.arange(4.0)}
    assert state_digest({f"module.{k}": v for k, v in weights.items()}) == state_digest(weights)


def test_an_unknown_checkpoint_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint_format 'zip'"):
        RankRun(_environ(tmp_path), checkpoint_format="zip")


def test_an_uncaught_exception_is_in_the_progress_file_before_the_process_exits(tmp_path: Path) -> None:
    """The script raises; before the interpreter tears down (which can take seconds with torch loaded), the
    progress file says why the rank stops, so the agent waits for its exit instead of judging it hung."""
    import subprocess
    import sys

    from trainguard import protocol

    progress = tmp_path / "rank-00000.json"
    script = ("import json, sys, trainguard.rank as tg\n"
              "run = tg.init()\n"
              "run.step_done(1)\n"
              "import atexit\n"
              # What the agent would read while the process is still tearing down.
              f"atexit.register(lambda: print('SEEN', open({str(progress)!r}).read()))\n"
              "raise ValueError('deliberate failure at step 1')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(rank_module.__file__).parents[1]),
                               protocol.ENV_PROGRESS_FILE: str(progress), "RANK": "0", "WORLD_SIZE": "1"})
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "deliberate failure at step 1" in done.stderr, "the traceback is kept"
    seen = json.loads(done.stdout.split("SEEN", 1)[1])
    assert seen["error"] == "ValueError: deliberate failure at step 1"
