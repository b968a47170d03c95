"""A rank that goes looking for the node agent's secrets, prints them and exits puts none of them into the
run's history (issue 27 item 4), on the real stack: through the agent's watch, the incident, the run's
failure and `trainguard run logs`.

The rank reads `/proc/<agent>/environ`: refused where the stack runs ranks as another user (`--run-as`, a
stack started as root whose ranks user can reach the interpreter), read where it cannot (then the agent's
secrets are in the rank's hands, and only redaction keeps them out of the history). It also prints the
secrets from a file the test hands it, so the redaction is tested either way.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import tempfile
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError

from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import IncidentKind

from .conftest import RUN_TIMEOUT_S, history_text, make_spec

SNOOP = """
import os, sys
print("uid", os.getuid())
try:
    with open(f"/proc/{os.getppid()}/environ", "rb") as handle:
        environ = handle.read().decode(errors="replace").split("\\0")
    print("agent environ read:", *environ, sep="\\n")
except OSError as error:
    print("agent environ refused:", type(error).__name__)
with open(sys.argv[1]) as handle:
    token, key_id, secret = handle.read().split()
print(f"AWS_SECRET_ACCESS_KEY={secret} AWS_ACCESS_KEY_ID={key_id}")
print("the pool's peer token:", token)
print("marker: the rank got this far", flush=True)
raise RuntimeError(f"cannot reach the store with {secret} as {key_id}")
"""


async def test_a_rank_printing_the_agents_secrets_leaves_none_in_the_history(
        client: TrainguardClient, stack: DevStack, prefix: str) -> None:
    credentials = stack.credentials()
    secrets = {"peer token": stack.peer_token(), "S3 secret key": credentials["secret_key"],
               "S3 key id": credentials["access_key"]}
    handle, path = tempfile.mkstemp(prefix="tg-secrets-")
    try:
        os.write(handle, " ".join(secrets.values()).encode())
        os.close(handle)
        os.chmod(path, 0o644)  # for a rank of another user
        spec = make_spec(prefix, nodes=("node-0",))
        spec["entrypoint"] = ["python", "-c", SNOOP, path]
        run_id = await client.start_run(spec, workflow_id=f"it-secrets-{uuid.uuid4().hex[:6]}")
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
        log = await client.rank_log(run_id, rank=0, tail_bytes=16_384)
    finally:
        Path(path).unlink(missing_ok=True)

    status = (await client.status(run_id)).status
    crash = next(i for i in status.incidents if i.kind is IncidentKind.CRASH)
    assert "marker: the rank got this far" in crash.log_tail  # the tail did reach the history
    assert "RuntimeError: cannot reach the store with [redacted] as [redacted]" in crash.detail
    runs_as = stack.ranks_user()[0]
    wanted = os.environ.get("TRAINGUARD_RUN_AS")
    if wanted:  # CI (.ci/run) runs every rank as a user of its own: the boundary is crossed, not skipped
        assert runs_as == wanted, stack.ranks_user()
        assert f"uid {pwd.getpwnam(wanted).pw_uid}\n" in log.text
    if runs_as is not None:
        assert "agent environ refused: PermissionError" in log.text
    else:  # this stack's ranks run as its agents: they read the secrets, and only redaction stands between
        assert "agent environ read:" in log.text
    history = history_text(await client.handle(run_id).fetch_history())
    assert "marker: the rank got this far" in history and "[redacted]" in history
    leaked = [name for name, value in secrets.items() if value in history]
    assert not leaked, leaked
    assert not [name for name, value in secrets.items() if value in log.text]  # `run logs` too
