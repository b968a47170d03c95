"""Ranks cannot read the node agent's secrets, and what they print of any secret never reaches the history.

- A rank started as the run-as user (`--run-as`) is refused `/proc/<agent>/environ`, which still holds the
  secrets the agent dropped from `os.environ` (the control: a rank of the agent's own uid reads them there).
- A rank that prints the agent's secrets and secret-looking values, then exits, yields an exit event (the
  incident) whose log tail, detail and failure signature hold none of them, through the real watch.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard import settings
from trainguard.protocol import RunLayout
from trainguard.run_as import RunAs

REPO = Path(__file__).resolve().parents[2]
PEER_TOKEN = "peer-0123456789abcdef0123456789abcdef"
S3_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY"
SYSTEM_PYTHON = "/usr/bin/python3"
"""An interpreter any user can run (the venv's may live under a home only its owner can enter)."""

READER = textwrap.dedent("""
    import json, os
    seen = {"uid": os.getuid()}
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as handle:
            seen["environ"] = handle.read().replace(b"\\0", b" ").decode()
    except OSError as error:
        seen["refused"] = type(error).__name__
    seen["inherited"] = sorted(k for k in os.environ if k.startswith(("AWS_", "TRAINGUARD_PEER")))
    seen["home"] = os.environ.get("HOME")
    print("SEEN " + json.dumps(seen), flush=True)
""")

AGENT = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from activities.models import LaunchRanksInput
    from trainguard.protocol import RunLayout
    from trainguard.run_as import run_as_from
    from trainguard.settings import hold_agent_secrets
    from workers.node_agent import node_ranks

    workdir, code_dir, user, python, reader = Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]
    hold_agent_secrets()  # as the agent does once connected
    agent = node_ranks("node-a", workdir, "127.0.0.1", code_dir, allowed=(python,), run_as=run_as_from(user))

    async def main():
        await agent.launch.launch_ranks(LaunchRanksInput(
            workflow_id="wf", chain_id="c1", attempt=1, node="node-a", node_rank=0, num_nodes=1,
            ranks_per_node=1, entrypoint=[python, "-c", reader]))
        rank = agent.book.record("wf").ranks[0]
        for _ in range(600):
            if rank.poll():
                break
            await asyncio.sleep(0.05)
        await agent.book.stop_all(grace_s=0.5)

    asyncio.run(main())
    print(RunLayout.of(workdir, "wf").log_file(1, 0).read_text())
""")


def _agent_run(tmp_path: Path, user: str) -> dict[str, object]:
    """What a rank started by a real agent process (with secrets in its starting environment) saw."""
    code_dir = tmp_path / "code"
    code_dir.mkdir(exist_ok=True)
    env = {**os.environ, "TRAINGUARD_PEER_TOKEN": PEER_TOKEN, "AWS_ACCESS_KEY_ID": "tgdevkey0001",
           "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    done = subprocess.run([sys.executable, "-c", AGENT, str(tmp_path / "agent"), str(code_dir), user,
                           SYSTEM_PYTHON, READER], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    line = next((x for x in done.stdout.splitlines() if x.startswith("SEEN ")), None)
    assert line is not None, done.stdout + done.stderr
    return json.loads(line.removeprefix("SEEN "))  # type: ignore[no-any-return]


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                                reason="starting a rank as another user needs root and a system python")


@needs_root
def test_a_rank_run_as_another_user_cannot_read_the_agents_environ(open_dir: Path) -> None:
    nobody = RunAs.named("nobody")
    assert nobody.unreachable(open_dir, os.R_OK | os.X_OK) is None

    seen = _agent_run(open_dir, "nobody")

    assert seen["uid"] == nobody.uid
    assert seen["refused"] == "PermissionError" and "environ" not in seen
    assert seen["inherited"] == []
    assert seen["home"] == str(RunLayout.of(open_dir / "agent", "wf").tmp_dir)  # its own, writable by it


@needs_root
def test_control_a_rank_of_the_agents_own_uid_reads_the_secrets_the_agent_dropped(tmp_path: Path) -> None:
    """What the test above guards against is real: the agent dropped the secrets from `os.environ` and its
    ranks did not inherit them, yet `/proc/<agent>/environ` still hands them to a rank of the agent's uid."""
    seen = _agent_run(tmp_path, "")

    assert seen["uid"] == os.getuid() and seen["inherited"] == []
    assert PEER_TOKEN in str(seen["environ"]) and S3_SECRET in str(seen["environ"])


@pytest.fixture
def held_secrets() -> object:
    environ = {"TRAINGUARD_PEER_TOKEN": PEER_TOKEN, "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_ACCESS_KEY_ID": "k"}
    settings.hold_agent_secrets(environ)
    yield environ
    settings.forget_agent_secrets()


def test_holding_the_secrets_takes_them_out_of_the_environment(held_secrets: dict[str, str]) -> None:
    assert "AWS_SECRET_ACCESS_KEY" not in held_secrets and "AWS_ACCESS_KEY_ID" not in held_secrets
    assert settings.agent_secret("AWS_SECRET_ACCESS_KEY") == S3_SECRET
    assert settings._held_keys() == ("k", S3_SECRET, None)  # the S3 client is built from memory
    # The peer tier reads the pool's token from what the agent holds, not from its environment.
    assert "TRAINGUARD_PEER_TOKEN" not in held_secrets
    from activities.peers import peer_token
    assert peer_token() == PEER_TOKEN


def test_ranks_inherit_no_variable_that_holds_a_secret(held_secrets: dict[str, str]) -> None:
    from activities.rank_launch import inherited_env

    inherited = inherited_env({"PATH": "/bin", "AWS_REGION": "x", "TEMPORAL_API_KEY": "t" * 20,
                               "COPY_OF_TOKEN": PEER_TOKEN, "TRAINGUARD_PEER_TOKEN": PEER_TOKEN})

    assert inherited == {"PATH": "/bin"}


PRINTER = textwrap.dedent(f"""
    import os
    print("step 3 loss 0.25 (a line nobody redacts)")
    print("the pool token is {PEER_TOKEN}")
    print("AWS_SECRET_ACCESS_KEY={S3_SECRET}")
    print("HF_TOKEN=hf_notheldbytheagentbutsecret")
    print("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig")
    raise RuntimeError("could not authenticate with {PEER_TOKEN}")
""")


async def test_a_rank_printing_secrets_then_exiting_yields_an_incident_without_them(
        held_secrets: dict[str, str], tmp_path: Path) -> None:
    from temporalio.testing import ActivityEnvironment

    from activities.models import LaunchRanksInput, WatchEventKind, WatchRanksInput
    from trainguard.spec import HealthSpec
    from workers.node_agent import node_ranks

    agent = node_ranks("node-a", tmp_path / "agent", "127.0.0.1", tmp_path, allowed=("*",))
    try:
        await agent.launch.launch_ranks(LaunchRanksInput(
            workflow_id="wf", chain_id="c1", attempt=1, node="node-a", node_rank=0, num_nodes=1, ranks_per_node=1,
            entrypoint=[sys.executable, "-c", PRINTER]))
        request = WatchRanksInput(workflow_id="wf", attempt=1, node="node-a",
                                  health=HealthSpec(poll_interval_s=0.05))
        event = await asyncio.wait_for(ActivityEnvironment().run(agent.watch.watch_ranks, request), 60)
    finally:
        await agent.book.stop_all(grace_s=0.5)

    assert (event.kind, event.exit_code) == (WatchEventKind.RANK_EXITED, 1)
    sent = event.model_dump_json()
    for secret in (PEER_TOKEN, S3_SECRET, "hf_notheldbytheagentbutsecret", "payload.sig"):
        assert secret not in sent
    assert "step 3 loss 0.25 (a line nobody redacts)" in event.log_tail  # the tail did come through
    assert "RuntimeError: could not authenticate with [redacted]" in event.detail
    assert event.failure_signature is not None and "[redacted]" in event.failure_signature


@needs_root
def test_the_agent_refuses_to_start_when_the_run_as_user_cannot_reach_its_folders(open_dir: Path) -> None:
    from workers.node_agent import run_as_problem

    nobody = RunAs.named("nobody")
    closed = open_dir / "closed"
    (closed / "work").mkdir(parents=True)
    closed.chmod(0o700)

    problem = run_as_problem(nobody, closed / "work", open_dir, (SYSTEM_PYTHON,))

    assert problem is not None and f"--workdir {closed / 'work'}" in problem and f"{closed} is" in problem
    assert run_as_problem(nobody, open_dir, open_dir, (SYSTEM_PYTHON, "*")) is None
    assert "--allow /root/x" in (run_as_problem(nobody, open_dir, open_dir, ("/root/x",)) or "")
