"""The node agent's launch holds its allow-list: the program it checked is the program it runs (found with its
own PATH, never the spec's), env names that change what runs need its operator's say-so, and whatever of a
spec exec cannot take fails as a non-retryable `BadSpec` naming the field, with no rank left behind."""

from __future__ import annotations

import asyncio
import errno
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from activities import rank_launch
from activities.models import LaunchRanksInput
from trainguard.procs import start_time
from trainguard.protocol import RunLayout
from workers.node_agent import NodeRanks, node_ranks

VENV_BIN = str(Path(sys.executable).parent)
WHO = "import os, sys; print('exe', sys.executable); print('token', os.environ.get('TRAINGUARD_PEER_TOKEN'))"
AgentFactory = Callable[..., NodeRanks]


@pytest.fixture
async def make_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AgentFactory]:
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # as the dev stack's agents
    made: list[NodeRanks] = []

    def make(allowed: tuple[str, ...] = (VENV_BIN,), allowed_env: frozenset[str] = frozenset()) -> NodeRanks:
        agent = node_ranks("node-a", tmp_path / "agent", "127.0.0.1", tmp_path, allowed=allowed,
                               allowed_env=allowed_env)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        await agent.book.stop_all(grace_s=0.5)


def _launch(entrypoint: list[str], **changes: object) -> LaunchRanksInput:
    fields: dict[str, object] = dict(workflow_id="wf", chain_id="c1", attempt=1, node="node-a", node_rank=0,
                                     num_nodes=1, ranks_per_node=2, entrypoint=entrypoint)
    fields.update(changes)
    return LaunchRanksInput(**fields)  # type: ignore[arg-type]


async def _refused(agent: NodeRanks, request: LaunchRanksInput) -> ApplicationError:
    with pytest.raises(ApplicationError) as refused:
        await agent.launch.launch_ranks(request)
    assert refused.value.non_retryable
    return refused.value


async def _log(agent: NodeRanks, rank: int = 0) -> str:
    path = RunLayout.of(agent.book.workdir, "wf").log_file(1, rank)
    for _ in range(500):
        if path.exists() and "token" in path.read_text():
            return path.read_text()
        await asyncio.sleep(0.02)
    raise AssertionError(f"rank {rank} wrote nothing to {path}")


@pytest.fixture
def impostor(tmp_path: Path) -> Path:
    """A folder with a `python` of its own, the program a spec's PATH would smuggle in."""
    folder = tmp_path / "impostor"
    folder.mkdir()
    fake = folder / "python"
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path / 'pwned'}\n")
    fake.chmod(0o755)
    return folder


async def test_a_spec_path_is_refused_naming_the_field(make_agent: AgentFactory, impostor: Path,
                                                       tmp_path: Path) -> None:
    refused = await _refused(make_agent(), _launch(["python", "-c", WHO], env={"PATH": str(impostor)}))

    assert refused.type == "BadSpec"
    assert "env.PATH" in refused.message and "--allow-env PATH" in refused.message
    assert not (tmp_path / "pwned").exists()


async def test_an_allowed_spec_path_still_never_picks_the_program(make_agent: AgentFactory, impostor: Path,
                                                                   tmp_path: Path) -> None:
    agent = make_agent(allowed_env=frozenset({"PATH"}))

    await agent.launch.launch_ranks(_launch(["python", "-c", WHO], env={"PATH": f"{impostor}:{VENV_BIN}"}))

    log = await _log(agent)
    assert f"exe {shutil_which_python()}" in log  # the agent's python, by the absolute path it checked
    assert not (tmp_path / "pwned").exists()


def shutil_which_python() -> str:
    import shutil

    found = shutil.which("python", path=os.environ.get("PATH"))
    assert found is not None
    return str(Path(os.path.realpath(Path(found).parent)) / Path(found).name)


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONSTARTUP", "BASH_ENV",
                                  "NCCL_NET_PLUGIN"])
async def test_env_that_changes_what_runs_needs_the_operator(make_agent: AgentFactory, tmp_path: Path,
                                                             name: str) -> None:
    request = _launch(["python", "-c", WHO], env={name: str(tmp_path / "evil"), "SEED": "1"})

    refused = await _refused(make_agent(), request)
    assert refused.type == "BadSpec" and f"env.{name}" in refused.message and "SEED" not in refused.message

    allowed = make_agent(allowed_env=frozenset({name}))
    assert len((await allowed.launch.launch_ranks(request)).pids) == 2


async def test_ranks_never_inherit_the_pools_peer_token(make_agent: AgentFactory,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_PEER_TOKEN", "pool-secret-0123456789abcdef")
    agent = make_agent()

    await agent.launch.launch_ranks(_launch(["python", "-c", WHO]))

    assert "token None" in await _log(agent)


@pytest.mark.parametrize(("changes", "field"), [
    ({"env": {"SEED": "1\x002"}}, "env.SEED"),
    ({"entrypoint": ["python", "-c", "pass\x00"]}, "entrypoint.2"),
    ({"env": {"BLOB": "x" * 200_000}}, "entrypoint and env"),  # E2BIG at exec
    ({"env": {"BAD=NAME": "1"}}, "env.BAD=NAME"),
    ({"working_dir": "/no/such/dir"}, "working_dir"),
    ({"working_dir": "/tmp/\x00"}, "working_dir"),
    ({"entrypoint": ["no-such-program-here"]}, "entrypoint.0"),
    ({"entrypoint": ["./not-executable"]}, "entrypoint.0"),
    ({"entrypoint": ["./not-a-program"]}, "entrypoint.0"),  # ENOEXEC at exec
])
async def test_what_exec_cannot_take_is_a_bad_spec_naming_the_field(make_agent: AgentFactory, changes: dict,
                                                                    field: str, tmp_path: Path) -> None:
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    (tmp_path / "not-a-program").write_bytes(b"\x00\x01garbage")
    (tmp_path / "not-a-program").chmod(0o755)
    # Straight to the agent, as a launch built by another client or an older controller would come.
    agent = make_agent(allowed=("*",))
    request = _launch(["python", "-c", "import time; time.sleep(30)"]).model_copy(update=changes)

    refused = await _refused(agent, request)

    assert refused.type == "BadSpec" and field in refused.message
    record = agent.book.record("wf")
    assert record is None or not [p for p in record.ranks.values() if start_time(p.pid) is not None]


@pytest.mark.parametrize("program", [
    f"{VENV_BIN}/../../../../../../bin/sh",  # the folder's name, then out of it
    "/bin/sh",
])
async def test_a_path_out_of_the_allowed_folder_is_refused(make_agent: AgentFactory, program: str) -> None:
    refused = await _refused(make_agent(), _launch([program, "-c", "true"]))

    assert refused.type == "EntrypointNotAllowed" and "is not allowed on node node-a" in refused.message


async def test_a_relative_program_is_found_in_the_working_dir_it_runs_in(make_agent: AgentFactory,
                                                                         tmp_path: Path) -> None:
    work = tmp_path / "job"
    (work / "bin").mkdir(parents=True)
    script = work / "bin" / "train"
    script.write_text("#!/bin/sh\necho token ok\n")
    script.chmod(0o755)
    (tmp_path / "bin").mkdir()  # the same relative name from the agent's own directory is not what runs
    agent = make_agent(allowed=(str(work / "bin"),))

    await agent.launch.launch_ranks(_launch(["bin/train"], working_dir=str(work)))

    assert "token ok" in await _log(agent)


@pytest.mark.parametrize(("error", "bad_spec"), [
    (OSError(errno.E2BIG, "Argument list too long"), True),
    (PermissionError(errno.EACCES, "Permission denied"), True),
    (ValueError("embedded null byte"), True),
    (OSError(errno.EMFILE, "Too many open files"), False),  # the node's trouble: retried, then the node's
])
async def test_an_exec_failure_is_the_runs_only_when_the_spec_caused_it(
        make_agent: AgentFactory, monkeypatch: pytest.MonkeyPatch, error: Exception, bad_spec: bool) -> None:
    def popen(*_args: object, **_kwargs: object) -> None:
        raise error

    monkeypatch.setattr(rank_launch.subprocess, "Popen", popen)

    with pytest.raises(Exception) as caught:
        await make_agent().launch.launch_ranks(_launch(["python", "-c", "pass"]))

    if bad_spec:
        assert isinstance(caught.value, ApplicationError) and caught.value.type == "BadSpec"
        assert caught.value.non_retryable and caught.value.message.startswith(("entrypoint", "env"))
    else:
        assert caught.value is error


async def test_a_working_dir_the_os_cannot_look_up_is_the_specs_fault_not_the_nodes(
        make_agent: AgentFactory, tmp_path: Path) -> None:
    refused = await _refused(make_agent(), _launch(["python", "-c", "pass"], working_dir=str(tmp_path / ("x" * 300))))

    assert refused.type == "BadSpec" and refused.message.startswith("working_dir ")
    assert "File name too long" in refused.message


async def test_a_ranks_own_step_latest_link_does_not_fail_the_next_launch(make_agent: AgentFactory,
                                                                         tmp_path: Path) -> None:
    agent = make_agent()
    layout = RunLayout.of(agent.book.workdir, "wf")
    for step in (10, 20):
        layout.local_step_dir(step).mkdir(parents=True)
    (layout.checkpoint_dir / "step-latest").symlink_to(layout.local_step_dir(20))

    launched = await agent.launch.launch_ranks(_launch(["python", "-c", WHO], restore_step=10))

    assert len(launched.pids) == 2
    assert sorted(p.name for p in layout.checkpoint_dir.iterdir()) == ["step-00000010", "step-latest"]


async def test_a_run_started_again_under_its_id_never_reads_the_last_executions_attempt_files(
        make_agent: AgentFactory) -> None:
    """A requeued Slurm job resumes its run with `run start --resume`: the same id, a new chain, attempts from 1
    again. The last execution's attempt-1 progress would read as the new attempt 1's (a false hang)."""
    agent = make_agent()
    await agent.launch.launch_ranks(_launch(["python", "-c", "print('first')"], ranks_per_node=1))
    layout = RunLayout.of(agent.book.workdir, "wf")
    stale = layout.progress_file(1, 0)
    stale.write_text('{"step": 999}')
    await agent.book.stop_all(grace_s=0.5)
    again = make_agent()  # a new agent process: the ranks file is all it knows of the last execution
    await again.launch.launch_ranks(_launch(["python", "-c", "print('second')"], ranks_per_node=1, chain_id="c1"))
    assert stale.exists(), "a relaunch of the same chain keeps its attempts' files"
    await again.book.stop_all(grace_s=0.5)
    await make_agent().launch.launch_ranks(_launch(["python", "-c", "print('third')"], ranks_per_node=1,
                                                   chain_id="c2"))
    assert not stale.exists()
    assert layout.chain_file.read_text() == "c2"
