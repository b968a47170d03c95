"""Bad input never harms the pool: a few hundred generated bad specs, spec to workflow to agent to exec, on the
real stack. Each is refused naming its field, or its run fails as a user error naming the field, with no node
cordoned, no spare spent, no rank left running and no secret in any history. The peer tier answers only
with the pool's token."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from trainguard import TASK_QUEUE, WORKFLOW_TYPE
from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack, _start_time
from trainguard.protocol import RunLayout
from trainguard.spec import MAX_ENV_VALUE_BYTES, MAX_EXEC_BYTES, SpecError, exec_env_refused, parse_spec

from .conftest import NODES, history_text, make_spec

SEED = 1313
"""Fixed: a failure names a case that the next run generates again."""
NUM_REFUSED = 300
NUM_STRAIGHT_TO_TEMPORAL = 8
NUM_AT_THE_AGENT = 20
MARKER = "tg-fuzz-secret-"
"""Values of the secret-named env the generator writes: none may reach Temporal."""

Mutation = Callable[[random.Random, dict[str, Any]], str]
"""Changes a good spec in place into a bad one; returns a fragment the refusal must name (its field)."""


def _name(rng: random.Random, length: int = 8) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(length))


def _secret_env(rng: random.Random, spec: dict[str, Any]) -> str:
    word = rng.choice(["TOKEN", "SECRET", "PASSWORD", "API_KEY", "ACCESS_KEY", "PRIVATE_KEY", "CREDENTIALS"])
    name = rng.choice([f"{_name(rng, 3)}_{word}", f"{word}_{_name(rng, 2)}", word,
                       "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN"])
    name = name.lower() if rng.random() < 0.2 else name
    spec["env"] = {"SEED": "1", name: MARKER + uuid.uuid4().hex}
    return f"env.{name}"


def _nul(rng: random.Random, spec: dict[str, Any]) -> str:
    where = rng.choice(["env", "entrypoint", "working_dir"])
    text = _name(rng)
    cut = rng.randrange(len(text) + 1)
    bad = text[:cut] + "\x00" + text[cut:]
    if where == "env":
        spec["env"] = {"DATA": bad}
        return "env.DATA"
    if where == "entrypoint":
        spec["entrypoint"] = [*spec["entrypoint"], bad]
        return f"entrypoint.{len(spec['entrypoint']) - 1}"
    spec["working_dir"] = "/tmp/" + bad
    return "working_dir"


def _surrogate(rng: random.Random, spec: dict[str, Any]) -> str:
    spec["env"] = {"TEXT": _name(rng) + chr(rng.randrange(0xD800, 0xE000))}
    return "env.TEXT"


def _huge_value(rng: random.Random, spec: dict[str, Any]) -> str:
    spec["env"] = {"BLOB": "x" * rng.choice([MAX_ENV_VALUE_BYTES + 1, 200_000, 10_000_000])}
    return "env.BLOB"


def _exec_too_big(rng: random.Random, spec: dict[str, Any]) -> str:
    count = MAX_EXEC_BYTES // MAX_ENV_VALUE_BYTES + 1
    spec["env"] = {f"PART_{i}": "y" * (MAX_ENV_VALUE_BYTES - rng.randrange(10)) for i in range(count)}
    return "MAX_EXEC_BYTES"


def _spec_too_big(rng: random.Random, spec: dict[str, Any]) -> str:
    spec["nodes"] = [f"n{i:04d}-{rng.choice('abc') * 57}" for i in range(4096)]
    spec.pop("spare_nodes", None)
    return "MAX_SPEC_BYTES"


def _reserved_env(rng: random.Random, spec: dict[str, Any]) -> str:
    name = rng.choice(["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", f"TRAINGUARD_{_name(rng)}",
                       "TRAINGUARD_PEER_TOKEN"])
    spec["env"] = {name: "0"}
    return f"env.{name}"


def _bad_env_name(rng: random.Random, spec: dict[str, Any]) -> str:
    name = rng.choice(["1ABC", "A-B", "A=B", "", "A B", "Ä", "$X", _name(rng) + "."])
    spec["env"] = {name: "1"}
    return "env"


def _name_with_newline(rng: random.Random, spec: dict[str, Any]) -> str:
    """Issue 27 finding 12: Python's `$` matches before a trailing newline, so `HF_TOKEN\\n` passed the secret
    check (its value reached the history) and `RANK\\n` the reserved one."""
    name = rng.choice(["HF_TOKEN", "RANK", "WORLD_SIZE", "TRAINGUARD_PEER_TOKEN", "LD_PRELOAD", "SEED"])
    name += rng.choice(["\n", "\r", "\r\n"])
    spec["env"] = {"SEED": "1", name: MARKER + uuid.uuid4().hex}
    return f"env.{name}"


INT_FIELDS = [("ranks_per_node",), ("min_nodes",), ("max_history_events",), ("checkpoint", "every_steps"),
              ("checkpoint", "keep_last"), ("restarts", "max_restarts"), ("health", "straggler_windows")]
FLOAT_FIELDS = [("reserve_timeout_s",), ("restarts", "window_s"), ("health", "hang_max_s"),
                ("health", "startup_grace_s"), ("checkpoint", "restore_timeout_s"), ("health", "poll_interval_s")]
BOOL_FIELDS = [("checkpoint", "local_tier"), ("restarts", "in_process")]


def _set(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> str:
    target = spec
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value
    return ".".join(path)


def _bad_int(rng: random.Random, spec: dict[str, Any]) -> str:
    return _set(spec, rng.choice(INT_FIELDS), rng.choice([True, False, "2", "1", 2.0, 1.5, -1, 10**12, [1]]))


def _bad_float(rng: random.Random, spec: dict[str, Any]) -> str:
    return _set(spec, rng.choice(FLOAT_FIELDS),
                rng.choice([float("inf"), float("-inf"), float("nan"), 1e300, "60", True, -5.0, None]))


def _bad_bool(rng: random.Random, spec: dict[str, Any]) -> str:
    return _set(spec, rng.choice(BOOL_FIELDS), rng.choice(["yes", "true", 1, 0, "on", None]))


def _bad_shape(rng: random.Random, spec: dict[str, Any]) -> str:
    case = rng.randrange(6)
    if case == 0:
        spec["entrypoint"] = " ".join(spec["entrypoint"])
        return "entrypoint"
    if case == 1:
        spec["entrypoint"] = rng.choice([[], [" "], [""], [1, 2]])
        return "entrypoint"
    if case == 2:
        spec["nodes"] = rng.choice([[], ["Node-0"], ["node-0", "node-0"], ["node_0"], ["-x"]])
        return "nodes"
    if case == 3:
        spec[rng.choice(["bogus", "Env", "entry_point"])] = 1
        return "not a field of the spec"
    if case == 4:
        spec["working_dir"] = ""
        return "working_dir"
    spec["env"] = rng.choice([["A=1"], "A=1", {"A": 1}, {"A": None}])
    return "env"


MUTATIONS: list[Mutation] = [_secret_env, _nul, _surrogate, _huge_value, _exec_too_big, _spec_too_big,
                             _reserved_env, _bad_env_name, _name_with_newline, _bad_int, _bad_float, _bad_bool,
                             _bad_shape]
SECRET_MUTATIONS = ("_secret_env", "_name_with_newline")
"""Their values are secrets (`MARKER`): only the client may see them, never Temporal."""


def refused_specs(count: int, seed: int = SEED) -> list[tuple[dict[str, Any], str, str]]:
    """(spec, the fragment its refusal names, mutation name): every mutation about as often, in random order."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        mutate = MUTATIONS[index % len(MUTATIONS)] if index < 2 * len(MUTATIONS) else rng.choice(MUTATIONS)
        spec = make_spec("fuzz", nodes=("node-0",), spares=("node-1",))
        cases.append((spec, mutate(rng, spec), mutate.__name__))
    return cases


def agent_specs(count: int, seed: int = SEED) -> list[tuple[dict[str, Any], str]]:
    """Specs validation must let through (it cannot know a node), each of which the node agent refuses:
    (spec, the fragment the run's failure names). Every one runs on node-0 with node-1 as its spare."""
    rng = random.Random(seed)
    exec_names = ["PATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
                  "PYTHONINSPECT", "PYTHONWARNINGS", "BASH_ENV", "NODE_OPTIONS", "PERL5OPT", "GCONV_PATH",
                  "NCCL_NET_PLUGIN", "CUDA_INJECTION64_PATH", "HOME", "DYLD_INSERT_LIBRARIES"]
    cases: list[tuple[dict[str, Any], str]] = []
    kinds = ["env", "env", "working_dir", "not_allowed", "missing"]
    for index in range(count):
        spec = make_spec(f"fuzz-{uuid.uuid4().hex[:8]}", nodes=("node-0",), spares=("node-1",))
        kind = kinds[index % len(kinds)]
        if kind == "env":
            name = rng.choice(exec_names)
            spec["env"] = {name: rng.choice(["/tmp/evil", f"/tmp/{_name(rng)}:/usr/bin", "/tmp/x.so", "-r /tmp/x"]),
                           "SEED": str(rng.randrange(100))}
            cases.append((spec, f"env.{name}"))
        elif kind == "working_dir":
            # Every other one a folder name too long for the OS even to look up (issue 27 finding 1: its
            # ENAMETOOLONG was taken for the node's fault, which cordoned node-0 and spent the spare).
            long_name = (index // len(kinds)) % 2 == 1
            spec["working_dir"] = "/tmp/" + "w" * 300 if long_name else f"/nonexistent/{uuid.uuid4().hex}"
            cases.append((spec, "working_dir"))
        elif kind == "not_allowed":
            program = rng.choice(["/bin/sh", "sh", "/usr/bin/env", ".venv/bin/../../../../../../bin/sh"])
            spec["entrypoint"] = [program, "-c", "touch /tmp/tg-fuzz-pwned"]
            cases.append((spec, "is not allowed on node node-0"))
        else:
            spec["entrypoint"] = [f"no-such-program-{_name(rng).lower()}", "train.py"]
            cases.append((spec, "entrypoint.0"))
    return cases


def test_the_generators_make_what_they_say() -> None:
    refused = refused_specs(NUM_REFUSED)
    assert len({name for _, _, name in refused}) == len(MUTATIONS)  # every mutation is exercised
    for spec, fragment in agent_specs(NUM_AT_THE_AGENT):
        parse_spec(spec)  # each passes validation: only the agent can refuse it
        if fragment.startswith("env."):
            assert exec_env_refused(fragment.removeprefix("env.")), fragment


async def test_generated_bad_specs_are_refused_naming_the_field(client: TrainguardClient) -> None:
    started = time.monotonic()
    cases = refused_specs(NUM_REFUSED)
    for spec, fragment, mutation in cases:
        with pytest.raises(SpecError) as refused:
            parse_spec(spec)
        assert fragment in str(refused.value), (mutation, fragment, str(refused.value)[:300])
    # Through the client as `trainguard run start` goes: refused before anything reaches Temporal.
    secret_cases = [case for name in SECRET_MUTATIONS for case in [(s, f) for s, f, m in cases if m == name][:5]]
    for spec, fragment in secret_cases:
        workflow_id = f"it-fuzz-secret-{uuid.uuid4().hex[:6]}"
        with pytest.raises(SpecError, match=re.escape(fragment)):
            await client.start_run(spec, workflow_id=workflow_id)
        assert not [w async for w in client.client.list_workflows(f"WorkflowId = '{workflow_id}'")]
    print(f"{len(cases)} generated bad specs refused in {time.monotonic() - started:.2f}s")


async def test_bad_specs_sent_straight_to_temporal_fail_at_once_naming_the_field(client: TrainguardClient) -> None:
    # As `temporal workflow start` would send them: the workflow's own validation is all there is. No secret
    # cases here: whoever skips the client puts what they send into the history.
    cases = [(s, f) for s, f, m in refused_specs(NUM_REFUSED, seed=SEED + 1)
             if m not in (*SECRET_MUTATIONS, "_spec_too_big", "_huge_value", "_exec_too_big", "_surrogate")]
    sample = random.Random(SEED).sample(cases, NUM_STRAIGHT_TO_TEMPORAL)

    async def one(spec: dict[str, Any], fragment: str) -> None:
        handle = await client.client.start_workflow(WORKFLOW_TYPE, spec, id=f"it-fuzz-raw-{uuid.uuid4().hex[:6]}",
                                                    task_queue=TASK_QUEUE)
        with pytest.raises(WorkflowFailureError) as failure:
            await asyncio.wait_for(handle.result(), 30)
        cause = failure.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "InvalidSpec"
        assert fragment in cause.message, (fragment, cause.message)

    await asyncio.gather(*(one(spec, fragment) for spec, fragment in sample))


async def _pool_state(client: TrainguardClient) -> dict[str, tuple[str | None, str | None]]:
    return {n.node: (n.cordoned, n.leased_to) for n in await client.nodes()}


async def test_specs_only_the_agent_can_refuse_fail_their_run_and_leave_the_pool_clean(
        client: TrainguardClient, stack: DevStack) -> None:
    deadline = time.monotonic() + 60  # a test before may have just repaired a node: wait for the pool to have it
    before = await _pool_state(client)
    while before["node-0"] != (None, None) or before["node-1"] != (None, None):
        assert time.monotonic() < deadline, before
        await asyncio.sleep(0.5)
        before = await _pool_state(client)
    started = time.monotonic()
    run_ids = []
    for spec, fragment in agent_specs(NUM_AT_THE_AGENT):
        run_id = await client.start_run(spec, workflow_id=f"it-fuzz-agent-{uuid.uuid4().hex[:6]}")
        run_ids.append(run_id)
        with pytest.raises(WorkflowFailureError) as failure:
            await asyncio.wait_for(client.result(run_id), 60)
        cause = failure.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "InvalidSpec", cause
        assert fragment in cause.message, (fragment, cause.message)
        status = (await client.status(run_id)).status
        # A user error: one attempt, no incident charged to the node, no spare moved in.
        assert (status.attempt, status.incidents, status.cordoned) == (1, [], [])
        assert status.nodes == ["node-0"], status.nodes
    elapsed = time.monotonic() - started

    after = await _pool_state(client)
    assert {n: cordoned for n, (cordoned, _) in after.items()} == {n: c for n, (c, _) in before.items()}, after
    assert not [n for n, (_, leased_to) in after.items() if leased_to in run_ids], after  # every lease returned
    for run_id in run_ids:
        for node in NODES:
            ranks_file = RunLayout.of(stack.home / "nodes" / node, run_id).ranks_file
            if ranks_file.exists():
                record = json.loads(ranks_file.read_text())
                assert not [r for r in record["ranks"] if _start_time(r["pid"]) == r["start_time"]], run_id
    secrets = [stack.credentials()["secret_key"], stack.credentials()["access_key"], stack.peer_token()]
    for run_id in run_ids:
        history = history_text(await client.handle(run_id).fetch_history())
        assert "launch_ranks" in history  # each got as far as the node: the scan covers the agent's answer
        assert not [s for s in [*secrets, MARKER] if s in history], run_id
    assert not Path("/tmp/tg-fuzz-pwned").exists()  # what the refused programs would have done
    print(f"{len(run_ids)} runs refused by the agent in {elapsed:.1f}s ({elapsed / len(run_ids):.2f}s each)")


async def test_the_peer_tier_answers_only_with_the_pools_token(client: TrainguardClient, stack: DevStack) -> None:
    urls = [n.peer_url for n in await client.nodes() if n.peer_url]
    assert len(urls) == len(NODES)  # the dev stack's agents serve the peer tier: they have the token
    path = "/runs/no-run/step-00000001/rank-00000.pt"

    def status_of(url: str, authorization: str | None) -> int:
        headers = {"Authorization": authorization} if authorization else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=5):
                return 200
        except urllib.error.HTTPError as error:
            return error.code

    for url in urls:
        assert status_of(url, None) == 401
        assert status_of(url, "Bearer not-the-pools-token-at-all") == 401
        assert status_of(url, f"Bearer {stack.peer_token()}") == 404  # let in; no such shard there
