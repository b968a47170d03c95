"""The run spec: what a user submits to start a `TrainingRun`.

The spec travels through Temporal as plain JSON. It never carries secrets: S3 credentials and tokens are read
by the workers from their own environment.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Re-exported for the node agent and older imports; the policy's home is `trainguard.env_policy`.
from trainguard.env_policy import EXEC_ENV_PATTERNS as EXEC_ENV_PATTERNS
from trainguard.numerics import DEFAULT_FINGERPRINT_EVERY_STEPS, DEFAULT_LOSS_SPIKE_RATIO
from trainguard.env_policy import PYTHON_KNOBS as PYTHON_KNOBS
from trainguard.env_policy import exec_env_refused as exec_env_refused
from trainguard.ids import validate_workflow_id
from trainguard.protocol import DEFAULT_CHECKPOINT_EVERY_STEPS

NODE_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
PREFIX_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$"
NAMESPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
r"""Python's `$` also matches before a trailing newline, so `re.match(r"...$")` passed `HF_TOKEN\n` and `RANK\n`:
match names whole (`is_env_name`, `fullmatch`). `\Z` keeps a caller's plain `.match` whole too. The string
patterns above keep `$`: pydantic's engine (Rust regex) reads it as the end of the text, and they are documented
as written; match them from Python with `re.fullmatch` (`is_node_id`)."""
LABEL_KEY_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN = r"^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$"
"""A node label (`gpu=h100`, `topology.example.com/rack=r12`): Kubernetes-like, at most 63 characters each side,
letters, digits and `-_.` (`/` in the key too), alphanumeric at both ends; a value may be empty."""
MAX_NODE_LABELS = 32
ANY_RUN = "*"
"""In `checkpoint.allow_resume`: any run may restore the owner's checkpoints."""
MAX_ALLOW_RESUME = 64
"""Runs a `checkpoint.allow_resume` names: every restore from the namespace reads its owner record, and a run
shared wider than this is better opened to any run (`*`)."""


def _resume_reader(value: str) -> str:
    """An item of `checkpoint.allow_resume`: a workflow id, or `*`."""
    return value if value == ANY_RUN else validate_workflow_id(value)


NODE_LABELS_ENV = "TRAINGUARD_NODE_LABELS"
"""A node agent's labels when it has no `--label` flags: `KEY=VALUE` items separated by `,`."""

# Variables the node agent sets for every rank; a spec may not override them, or ranks would disagree
# about the world they are in.
RESERVED_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
RESERVED_ENV_PREFIX = "TRAINGUARD_"

SECRET_ENV_WORDS: tuple[str, ...] = (
    "SECRET", "SECRETS", "TOKEN", "PASSWORD", "PASSWORDS", "PASSWD", "PASS", "PASSPHRASE", "CREDENTIAL",
    "CREDENTIALS", "API_KEY", "APIKEY", "PRIVATE_KEY", "ACCESS_KEY", "PGPASSWORD", "MYSQL_PWD",
)
"""Words (between `_`, any case) that make an env name look like a secret's, e.g. `HF_TOKEN`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `WANDB_API_KEY`, `DB_PASSWORD`. Whole words only, so
`TOKENIZERS_PARALLELISM` and `MAX_TOKENS` stay allowed. The spec is stored in the workflow history in the
clear (and in every launch's input): secrets belong in the workers' environment (docs/operations/security.md)."""

MAX_ENV_VALUE_BYTES = 32 * 1024
"""Largest env value (UTF-8): a setting, not a file. Well under Linux's 128 KiB limit on one exec string
(MAX_ARG_STRLEN), past which exec fails with E2BIG."""

MAX_EXEC_BYTES = 128 * 1024
"""Largest entrypoint plus env, as exec counts them (each argument and `NAME=value` in UTF-8 plus its NUL).
Linux refuses an exec whose argv and environment pass a quarter of the stack limit (2 MiB with the usual
8 MiB stack, as little as 128 KiB with a small one) with E2BIG; this leaves that room to the agent's own
environment and torchrun's variables, on any node."""

MAX_SPEC_BYTES = 256 * 1024
"""Largest spec, as the JSON that travels: it is the workflow's input, part of every continue-as-new input
and (entrypoint and env) of every launch. Temporal warns at 256 KB a payload and refuses 2 MB; a spec that
fits here leaves the rest of a payload to what travels with it."""


def is_env_name(name: str) -> bool:
    """Whether `name`, all of it, is an environment variable name (`ENV_NAME_PATTERN`)."""
    return ENV_NAME_PATTERN.fullmatch(name) is not None


def is_node_id(name: str) -> bool:
    """Whether `name`, all of it, is a node id (`NODE_ID_PATTERN`): `node-0\\n` is not."""
    return re.fullmatch(NODE_ID_PATTERN, name) is not None


def looks_secret(name: str) -> bool:
    """Whether an env name reads like a secret's (`SECRET_ENV_WORDS`)."""
    # Any run of other characters separates words, so `HF_TOKEN\n` or `HF-TOKEN` reads as `HF_TOKEN`.
    padded = f"_{re.sub(r'[^A-Z0-9]+', '_', name.upper())}_"
    return any(f"_{word}_" in padded for word in SECRET_ENV_WORDS)


def exec_string_problem(value: str) -> str | None:
    """Why exec cannot pass `value` as an argument, an env value or a path (None when it can)."""
    if "\x00" in value:
        return "contains a NUL byte, which exec cannot pass"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 text (a lone surrogate)"
    return None


def exec_bytes(entrypoint: list[str], env: dict[str, str]) -> int:
    """What exec counts for these: each argument and each `NAME=value`, in UTF-8, plus its NUL."""
    strings = [*entrypoint, *(f"{k}={v}" for k, v in env.items())]
    return sum(len(s.encode("utf-8", "surrogatepass")) + 1 for s in strings)


def exec_problems(entrypoint: list[str], env: dict[str, str], working_dir: str | None) -> list[str]:
    """What exec would refuse in a launch, each naming its spec field. The node agent checks this again:
    a launch input may not come from a spec this module validated (another client, an older controller)."""
    problems = [f"entrypoint.{i}: {p}" for i, a in enumerate(entrypoint) if (p := exec_string_problem(a))]
    problems += [f"env.{k}: the name {p}" for k in env if (p := exec_string_problem(k))]
    problems += [f"env.{k}: the value {p}" for k, v in env.items() if (p := exec_string_problem(v))]
    problems += [f"env.{k}: the name is not NAME-like" for k in env if not is_env_name(k)]
    if working_dir is not None and (problem := exec_string_problem(working_dir)):
        problems.append(f"working_dir: {problem}")
    if not problems and (size := exec_bytes(entrypoint, env)) > MAX_EXEC_BYTES:
        problems.append(f"entrypoint and env: {size} bytes at exec, more than {MAX_EXEC_BYTES} (MAX_EXEC_BYTES)")
    return problems


def _exec_string(value: str) -> str:
    if (problem := exec_string_problem(value)) is not None:
        raise ValueError(problem)
    return value


def _env_value(value: str) -> str:
    _exec_string(value)
    if len(value.encode("utf-8")) > MAX_ENV_VALUE_BYTES:
        raise ValueError(f"{len(value.encode('utf-8'))} bytes, more than {MAX_ENV_VALUE_BYTES} "
                         f"(MAX_ENV_VALUE_BYTES): pass data in a file, not the environment")
    return value


def _env_name(name: str) -> str:
    if not is_env_name(name):
        raise ValueError(f"{name!r} is not a valid environment variable name")
    if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX):
        raise ValueError(f"{name!r} is set by the node agent and cannot be overridden")
    if looks_secret(name):
        raise ValueError(
            f"{name!r} looks like a secret, and the spec is stored in the workflow history in the clear: "
            f"give it to the workers in their own environment instead (docs/operations/security.md, where "
            f"secrets live), or rename the variable if it holds no secret")
    return name


def _label_key(key: str) -> str:
    if not re.fullmatch(LABEL_KEY_PATTERN, key):
        raise ValueError(f"{key!r} is not a label key (at most 63 of letters, digits, '-', '_', '.', '/'; "
                         f"alphanumeric at both ends)")
    return key


def _label_value(value: str) -> str:
    if not re.fullmatch(LABEL_VALUE_PATTERN, value):
        raise ValueError(f"{value!r} is not a label value (at most 63 of letters, digits, '-', '_', '.'; "
                         f"alphanumeric at both ends)")
    return value


def parse_labels(items: list[str] | str) -> dict[str, str]:
    """`["gpu=h100", "zone=a"]` (or `"gpu=h100,zone=a"`) -> `{"gpu": "h100", "zone": "a"}`; a ValueError
    names the item to fix. The node agent's `--label` flags and `TRAINGUARD_NODE_LABELS` both come through it."""
    if isinstance(items, str):
        items = [i for i in (p.strip() for p in items.split(",")) if i]
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"label {item!r}: write KEY=VALUE")
        labels[_label_key(key.strip())] = _label_value(value.strip())
    if len(labels) > MAX_NODE_LABELS:
        raise ValueError(f"{len(labels)} labels, more than {MAX_NODE_LABELS}")
    return labels


def selector_text(selector: dict[str, str]) -> str:
    """`gpu=h100,zone=a`: a selector as users write it, for messages."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


ExecString = Annotated[str, AfterValidator(_exec_string)]
LabelKey = Annotated[str, AfterValidator(_label_key)]
LabelValue = Annotated[str, AfterValidator(_label_value)]
EnvName = Annotated[str, AfterValidator(_env_name)]
EnvValue = Annotated[str, AfterValidator(_env_value)]


class _Strict(BaseModel):
    # strict: `true` or "2" is not an int, "yes" is not a bool; no infinities or NaN anywhere.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class CheckpointSpec(_Strict):
    """Where and how often checkpoints are committed."""

    bucket: str = Field("trainguard", pattern=BUCKET_PATTERN)
    """S3 bucket the shards and manifests go to. Default `trainguard` (created by `trainguard dev up`)."""

    prefix: str = Field("runs", pattern=PREFIX_PATTERN)
    """Key prefix; a run's checkpoints live under `<prefix>/<namespace>/`. Default `runs`."""

    namespace: str | None = Field(None, pattern=NAMESPACE_PATTERN)
    """The folder under `prefix` the run's checkpoints go to and are restored from. Default: the workflow id,
    so a run restarted under its id resumes. `trainguard run start` (and the client's `start_run`) sets a fresh
    one when the id was used by an earlier run, unless asked to `--resume` it. A namespace belongs to the first
    run that restores there: a run restores and prunes only checkpoints its own workflow id committed, and a
    run naming a namespace another run owns fails at once (`resume_from` starts from another run's)."""

    resume_from: Annotated[str, AfterValidator(validate_workflow_id)] | None = None
    """Another run's workflow id: while this run has no checkpoint of its own, it restores the newest one that
    run committed under `<prefix>/<resume_from>/` (its default namespace). Its checkpoints are never pruned by
    this run, which commits to its own namespace. Recorded in the run's spec (its history): resuming another
    run's checkpoints is an explicit choice, and needs that run's consent (its `allow_resume`). Its own
    workflow id (`trainguard run start --resume` sets it) resumes the earlier run under that id: it takes over
    the namespace, restores the earlier run's newest checkpoint and never prunes the earlier run's.
    `trainguard run start --resume-from RUN`. Default None."""

    allow_resume: list[Annotated[str, AfterValidator(_resume_reader)]] | None = Field(
        None, max_length=MAX_ALLOW_RESUME)
    """Who may restore this run's checkpoints besides this run: the workflow ids of other runs that may name it
    in `resume_from` (`*`: any run). Recorded in the namespace's owner record when the run claims it. Default
    None: a later run under this run's own workflow id only, when it resumes explicitly (`trainguard run
    start --resume`, or a rerun's `resume_from` naming its id); a run under another id is refused. `[]`: no
    run, not even one under this id; a list replaces the default, so name this run's own id in it to keep that.
    A run under this id that does not resume is refused either way: it gets
    a fresh namespace (`trainguard run start` gives one)."""

    every_steps: int = Field(DEFAULT_CHECKPOINT_EVERY_STEPS, ge=1, le=10_000_000)
    """Ranks checkpoint every this many steps (the rank helper asks `should_save(step)`). Default 50."""

    keep_last: int = Field(3, ge=1, le=1000)
    """Committed checkpoints kept; older ones are deleted, manifest first. Default 3."""

    restore_timeout_s: float = Field(180.0, ge=5, le=86_400)
    """How long finding the checkpoint to restore may retry against an unreachable store before the run
    records a `storage_unavailable` incident and pauses for an operator. Default 180."""

    stale_after_s: float | None = Field(None, ge=1, le=7 * 86_400)
    """How long the run may go without committing a checkpoint before it records a `storage_unavailable`
    incident (training goes on; the incident closes when a checkpoint commits again). Default: three checkpoint
    intervals as measured between the last two commits, at least 300 s; 900 s before two commits."""

    local_tier: bool = True
    """Restore from a node's own copy of the shards it wrote (verified against the manifest) before the
    store. Off: every restore reads the store (a node whose disk cannot be trusted). Default on."""

    @field_validator("prefix")
    @classmethod
    def _no_dot_segments(cls, value: str) -> str:
        if any(part in ("", ".", "..") for part in value.split("/")):
            raise ValueError("prefix must not contain empty, '.' or '..' segments")
        return value


class HealthSpec(_Strict):
    """How rank progress is judged. Hangs are seen from per-rank progress, never from collective timeouts."""

    startup_grace_s: float = Field(180.0, gt=0, le=86_400)
    """Silence allowed before a rank's first step (imports, rendezvous, restore). Default 180 s."""

    hang_floor_s: float = Field(2.0, gt=0, le=86_400)
    """A rank without a step for less than this is never looked at, however fast its steps; past its step bound
    it is hung only if it makes no progress of any kind (stopped, or idle outside any collective). Default 2 s."""

    hang_step_multiplier: float = Field(10.0, ge=1, le=10_000)
    """A rank is hung once silent for this many of its own recent step times (above the floor). Default 10."""

    hang_max_s: float = Field(300.0, gt=0, le=86_400)
    """A rank without a step this long is hung even while busy or waiting in a collective (a long phase): what a
    rank that burns CPU forever costs. A phase the script names with a longer `expected_s` may run twice that.
    Default 300 s."""

    checkpoint_grace_s: float = Field(60.0, ge=0, le=86_400)
    """Extra silence allowed while a rank is taking its in-memory checkpoint snapshot. Default 60 s."""

    poll_interval_s: float = Field(0.2, ge=0.05, le=10)
    """How often a node agent reads its ranks' progress. Default 0.2 s."""

    straggler_ratio: float = Field(1.5, gt=1, le=100)
    """A rank whose mean compute time per step exceeds this many times its peers' median, over a window of
    `straggler_window_s`, is a straggler. Default 1.5."""

    straggler_window_s: float = Field(10.0, ge=1, le=3600)
    """The sliding window of training time over which each rank's compute per step is compared with its
    peers', whatever the checkpoint cadence. Runs of thousands of nodes widen it so each node writes its pace
    to the store at most every nodes / 100 s. A rank's figure is the median of its steps in the window, or of
    its newest 10 when the window holds fewer (steps of a second or more). Default 10 s."""

    straggler_windows: int = Field(2, ge=1, le=1000)
    """Consecutive windows a straggler must stay slow before the run takes a checkpoint on demand and replaces
    its node by a spare (it is reported from the first). Default 2."""

    gpu_check_interval_s: float = Field(30.0, ge=1, le=86_400)
    """How often node agents re-check GPU health while ranks run. Default 30 s."""

    fingerprint_every_steps: int = Field(DEFAULT_FINGERPRINT_EVERY_STEPS, ge=0, le=1_000_000)
    """Every this many steps each rank whose script calls `run.fingerprint(model)` reports an exact fingerprint of
    its replicated parameters, and the run compares replicas': one that differs is a silent data corruption, found
    within this many steps (and a second or two). One read of the parameters: under 1% of the steps between. 0: no
    fingerprints (checkpoints still carry theirs). Default 10."""

    loss_spike_ratio: float = Field(DEFAULT_LOSS_SPIKE_RATIO, gt=1, le=1e12)
    """A loss the script reports (`run.step_done(step, loss=...)`) at least this many times the median of its last
    50 (and 20 median absolute deviations above it) is a numerical fault, as a NaN or infinite one always is.
    Generous by default: a small model's loss swings to 18 times its median past its fast descent, and a spike that
    is the data stops the run when it comes back after the rollback. A model whose loss is steady (a language model)
    can set 3 to 5. Default 100."""

    @model_validator(mode="after")
    def _floor_below_max(self) -> HealthSpec:
        if self.hang_floor_s > self.hang_max_s:
            given = "" if "hang_max_s" in self.model_fields_set else " (its default)"
            raise ValueError(f"health.hang_floor_s ({self.hang_floor_s:g}) must not exceed health.hang_max_s "
                             f"({self.hang_max_s:g}{given}): raise hang_max_s too, or lower hang_floor_s")
        return self


class RestartSpec(_Strict):
    """Bounds on recovery, so a run that cannot make progress stops with a reason instead of looping."""

    max_restarts: int = Field(10, ge=0, le=10_000)
    """Relaunches allowed within `window_s`. Default 10."""

    window_s: float = Field(3600.0, gt=0, le=30 * 86_400)
    """The window `max_restarts` counts over, at most 30 days. Default 3600 s."""

    max_restarts_without_checkpoint: int = Field(3, ge=1, le=10_000)
    """Consecutive relaunches that commit no new checkpoint before the run stops. Default 3."""

    max_same_failure: int = Field(2, ge=0, le=10_000)
    """Consecutive attempts whose crash is the same Python exception raised at the same place (the rank's
    log says so) before the run stops with that traceback as its reason: a script that fails the same way
    every time, which no relaunch fixes. 0: never stop for it. Default 2."""

    in_process: bool = False
    """After a rank crash, keep the ranks that are still alive: they leave the broken process group and
    form a new one with a restarted rank, which takes its state from a live peer instead of every rank
    reloading a checkpoint. The trainer must call `RankRun.rejoin` when a collective fails (see
    examples/train.py). Anything else, or a rejoin that fails, is a full relaunch. Default off."""

    rejoin_timeout_s: float = Field(60.0, ge=5, le=3600)
    """How long live ranks wait for their new process group, and the new attempt may take to its first
    step, before the in-process restart counts as failed and the run falls back to a full relaunch."""

    agent_return_timeout_s: float = Field(120.0, ge=1, le=86_400)
    """How long the run waits for node agents that shut down gracefully (an upgrade, a restart) to register again
    before it takes their nodes for lost. Waiting costs no node, spare or restart. Default 120."""

    heal_poll_s: float = Field(15.0, ge=1, le=3600)
    """A run paused for a lost node (no spare, no smaller world allowed) asks the pool this often, for its first
    40 asks, whether the node's agent registered healthy again, then every 5 minutes; once it has, the run
    resumes by itself (an operator may still `resume` or `abort`). Default 15."""


REPLICA_GROUP_ENV = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE")
"""What trainguard gives every rank of a run with `replica_groups` (TorchFT reads them): a spec sets none."""


class ReplicaGroupsSpec(_Strict):
    """Replica groups under TorchFT: the run's nodes split into `groups` equal groups, each its own
    torch.distributed world (its own ranks, master and store). TorchFT averages across the groups in each
    step's quorum; trainguard runs its lighthouse and keeps each group alive on its own, so a fault in one group
    stops that group only and the others train on at reduced width."""

    groups: int = Field(ge=2, le=1024)
    """How many replica groups; the run's nodes divide evenly among them (`nodes[i * n:(i + 1) * n]` is group
    i, n = len(nodes) / groups). Spares are dealt to the groups in turn, group 0 first."""

    min_groups: int = Field(1, ge=1, le=1024)
    """Fewest groups that take a step together (TorchFT's `min_replica_size`, the lighthouse's
    `min_replicas`). Default 1: one healthy group trains on while the others recover."""

    heartbeat_timeout_s: float = Field(5.0, ge=0.2, le=3600)
    """A group whose manager has not reached the lighthouse for this long is left out of the next quorum.
    Default 5 s (TorchFT's)."""

    join_timeout_s: float = Field(60.0, ge=0.1, le=3600)
    """How long the lighthouse waits for every heartbeating group to join a quorum before it forms one
    without the stragglers (with at least `min_groups`). Default 60 s (TorchFT's)."""

    @model_validator(mode="after")
    def _min_within(self) -> ReplicaGroupsSpec:
        if self.min_groups > self.groups:
            raise ValueError(f"replica_groups.min_groups ({self.min_groups}) exceeds replica_groups.groups "
                             f"({self.groups})")
        return self


class RunSpec(_Strict):
    """A training run: what to launch, where, and how to keep it alive."""

    entrypoint: list[ExecString] = Field(min_length=1, max_length=256)
    """The rank command as an argv list (never a shell string), e.g. `["python", "examples/train.py"]`.
    Run once per rank with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...). The program is looked
    up with the node agent's own PATH (never `env.PATH`) and must be one its `--allow` list names."""

    nodes: list[str] = Field(default_factory=list, max_length=4096)
    """Node ids to train on; each must have a node agent polling `trainguard-node-<id>`. A named node that is
    cordoned when the run starts is replaced by one of the run's free spares (the status's
    `replaced_at_start` says which). Give either `nodes` or `num_nodes`."""

    num_nodes: int | None = Field(None, ge=1, le=4096)
    """Instead of `nodes`: how many nodes to lease from the pool, any free and schedulable ones (matching
    `node_selector`), chosen when the run starts. The run waits (`reserve_timeout_s`) while too many are
    leased to other runs, and fails at once when the pool has too few. Default: use `nodes`."""

    spare_nodes: list[str] = Field(default_factory=list, max_length=4096)
    """Nodes held back to replace a failed one. Default none."""

    num_spares: int = Field(0, ge=0, le=4096)
    """Instead of `spare_nodes`: how many spares to hold back, chosen from the pool's free nodes (matching
    `node_selector`) when the run starts; fewer when fewer are free. Default 0."""

    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=MAX_NODE_LABELS)
    """Labels every node chosen by `num_nodes` / `num_spares` must carry, e.g. `{"gpu": "h100"}` (node agents
    register them: `--label gpu=h100`). Default: any node."""

    min_nodes: int | None = Field(None, ge=1, le=4096)
    """Fewest nodes the run may shrink to when no spare is left. Default: never shrink."""

    ranks_per_node: int = Field(1, ge=1, le=256)
    """Rank processes per node (GPUs per node on real hardware). Default 1."""

    working_dir: ExecString | None = Field(None, min_length=1, max_length=4096)
    """Directory the ranks run in on each node. Default: the node agent's code directory."""

    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)
    """Extra environment for every rank. Not for secrets (the spec is stored in workflow history): names that
    look like a secret's are refused (`SECRET_ENV_WORDS`), so are the agent's own (`RESERVED_ENV`,
    `TRAINGUARD_*`); node agents refuse names that change what runs, what it loads or where it writes
    (`trainguard.env_policy`) unless their operator allows them."""

    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpoint settings."""

    health: HealthSpec = Field(default_factory=HealthSpec)
    """Progress and hang detection settings."""

    restarts: RestartSpec = Field(default_factory=RestartSpec)
    """Restart budget."""

    replica_groups: ReplicaGroupsSpec | None = None
    """Split the nodes into TorchFT replica groups that fail and recover one at a time (examples/ft.json).
    Default none: one world, every fault relaunches every rank."""

    reserve_timeout_s: float = Field(600.0, ge=0, le=7 * 86_400)
    """How long the run waits for nodes leased to other runs before it fails. Default 600 s."""

    max_history_events: int = Field(10_000, ge=100, le=40_000)
    """The run continues as new (ranks keep running) once its history has this many events, well before
    Temporal's 10,240-event warning and 51,200-event limit. Default 10,000."""

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_args(cls, value: list[str]) -> list[str]:
        if not value[0].strip():
            raise ValueError("entrypoint[0] must name a program")
        if any(len(arg) > 4096 for arg in value):
            raise ValueError("entrypoint arguments must be under 4096 characters")
        return value

    @field_validator("nodes", "spare_nodes")
    @classmethod
    def _node_ids(cls, value: list[str]) -> list[str]:
        for index, node in enumerate(value):
            if not is_node_id(node):
                raise ValueError(
                    f"item {index} {node!r} is not a node id (lowercase letters, digits and '-', max 63)"
                )
        if len(set(value)) != len(value):
            raise ValueError("node ids must be unique")
        return value

    @model_validator(mode="after")
    def _pools_disjoint(self) -> RunSpec:
        if self.nodes and self.num_nodes is not None:
            raise ValueError("give either nodes (node ids) or num_nodes (a count from the pool), not both")
        if not self.nodes and self.num_nodes is None:
            raise ValueError("nodes: give the node ids to train on, or num_nodes to lease that many from the pool")
        if self.spare_nodes and self.num_spares:
            raise ValueError("give either spare_nodes (node ids) or num_spares (a count from the pool), not both")
        if self.spare_nodes and self.num_nodes is not None:
            raise ValueError("spare_nodes with num_nodes: ask the pool for spares with num_spares instead")
        if self.node_selector and self.num_nodes is None and not self.num_spares:
            raise ValueError("node_selector chooses nodes by label for num_nodes or num_spares: give one of "
                             "them, or drop node_selector")
        overlap = sorted(set(self.nodes) & set(self.spare_nodes))
        if overlap:
            raise ValueError(f"spare_nodes repeats nodes already in nodes: {', '.join(overlap)}")
        if self.min_nodes is not None and self.min_nodes > self.node_count:
            raise ValueError(f"min_nodes ({self.min_nodes}) exceeds the number of nodes ({self.node_count})")
        if self.replica_groups is not None:
            self._check_groups(self.replica_groups)
        if (size := exec_bytes(self.entrypoint, self.env)) > MAX_EXEC_BYTES:
            raise ValueError(f"entrypoint and env come to {size} bytes at exec, more than {MAX_EXEC_BYTES} "
                             f"(MAX_EXEC_BYTES): pass data in a file, not the command line or environment")
        if (size := len(self.model_dump_json().encode("utf-8"))) > MAX_SPEC_BYTES:
            raise ValueError(f"the spec is {size} bytes as JSON, more than {MAX_SPEC_BYTES} (MAX_SPEC_BYTES)")
        return self

    def _check_groups(self, groups: ReplicaGroupsSpec) -> None:
        if self.num_nodes is not None or self.num_spares:
            raise ValueError("replica_groups needs its nodes named: give nodes and spare_nodes, not num_nodes or "
                             "num_spares")
        if len(self.nodes) % groups.groups:
            raise ValueError(f"replica_groups.groups ({groups.groups}) must divide the {len(self.nodes)} nodes "
                             f"evenly: give a multiple of {groups.groups} nodes, or another number of groups")
        if self.min_nodes is not None:
            raise ValueError("min_nodes with replica_groups: a group keeps its size; min_groups says how many "
                             "groups train on")
        if self.restarts.in_process:
            raise ValueError("restarts.in_process with replica_groups: TorchFT heals a relaunched group from "
                             "a live one; turn in_process off")
        if taken := [name for name in REPLICA_GROUP_ENV if name in self.env]:
            raise ValueError(f"env sets {', '.join(taken)}: trainguard gives every rank of a run with "
                             f"replica_groups these; drop them from env")

    def replica_group_specs(self, lighthouse: str) -> list[RunSpec]:
        """The spec of each replica group: its share of the nodes and spares, and TorchFT's environment."""
        groups = self.replica_groups
        assert groups is not None
        size = len(self.nodes) // groups.groups
        return [self.model_copy(update={
            "nodes": self.nodes[index * size:(index + 1) * size],
            "spare_nodes": self.spare_nodes[index::groups.groups],
            "replica_groups": None,
            "env": {**self.env, "REPLICA_GROUP_ID": str(index), "NUM_REPLICA_GROUPS": str(groups.groups),
                    "TORCHFT_LIGHTHOUSE": lighthouse},
        }) for index in range(groups.groups)]

    @property
    def in_replica_group(self) -> bool:
        """Whether this run is one replica group of a run with `replica_groups` (its env is TorchFT's, which only
        trainguard may set): its live peers hold the state it heals from when relaunched."""
        return "REPLICA_GROUP_ID" in self.env

    def exec_env(self) -> list[str]:
        """The env names node agents refuse unless their operator allows them (`trainguard.env_policy`)."""
        return [name for name in self.env if exec_env_refused(name)]

    @property
    def node_count(self) -> int:
        """The nodes the run trains on: `nodes` named, or `num_nodes` from the pool."""
        return self.num_nodes if self.num_nodes is not None else len(self.nodes)

    @property
    def by_count(self) -> bool:
        """Whether the pool chooses any of the run's nodes or spares (`num_nodes`, `num_spares`)."""
        return self.num_nodes is not None or self.num_spares > 0

    def resolved(self, nodes: list[str]) -> RunSpec:
        """The spec as started on `nodes` (what the pool granted, spares in cordoned named nodes' places): it
        names its nodes, and asks the pool for nothing more. A run carries this one across continue-as-new."""
        if nodes == self.nodes and not self.by_count:
            return self
        return self.model_copy(update={"nodes": list(nodes), "num_nodes": None, "num_spares": 0,
                                       "node_selector": {}})

    @property
    def world_size(self) -> int:
        return self.node_count * self.ranks_per_node


class SpecError(ValueError):
    """A spec a user must fix; the message names each offending field."""


SUGGEST_CUTOFF = 0.6
"""How alike a misspelt name and a real one must be to be suggested (`difflib`'s ratio): `hang_flor_s` is 0.96
like `hang_floor_s`, `bogus` like no field at all."""
SUGGEST_MARGIN = 0.1
"""Only names this close to the best match are suggested too: `hang_flor_s` suggests `hang_floor_s`, not also
`hang_max_s` (0.73)."""
SUGGEST_MAX = 3
ECHO_MAX_CHARS = 60
"""A value echoed back in a message is cut to this many characters of its JSON."""


def close_names(name: str, names: Iterable[str]) -> list[str]:
    """The names most like `name` (a misspelling, another case), best first; none when nothing is close. A dotted
    name (`health.hang_floor_s`) is compared by its last part. For "did you mean" in spec and CLI messages."""
    def likeness(candidate: str) -> float:
        return difflib.SequenceMatcher(None, name.lower(), candidate.rsplit(".", 1)[-1].lower()).ratio()

    scored = sorted(((likeness(n), n) for n in names), key=lambda item: -item[0])
    best = scored[0][0] if scored else 0.0
    return [n for score, n in scored if score >= max(SUGGEST_CUTOFF, best - SUGGEST_MARGIN)][:SUGGEST_MAX]


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The spec's model at `loc` (`()`: `RunSpec`, `("health",)`: `HealthSpec`), or None where a value is not one."""
    model: type[BaseModel] = RunSpec
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _unknown_field(loc: tuple[int | str, ...]) -> str:
    """What to say of a field the spec does not have: the fields it may have meant, there or in another section
    (`hang_floor_s` written at the top is `health.hang_floor_s`), else the fields there are."""
    name, parent = str(loc[-1]), _model_at(loc[:-1])
    where = ".".join(map(str, loc[:-1])) or "the spec"
    if parent is None:
        return f"not a field of {where}"
    sections = {section: model for section in RunSpec.model_fields if (model := _model_at((section,))) is not None}
    candidates = [*parent.model_fields, *(f"{section}.{field}" for section, model in sections.items()
                                          if model is not parent for field in model.model_fields)]
    close = close_names(name, candidates)
    if close:
        return f"not a field of {where} (did you mean {' or '.join(close)}?)"
    return f"not a field of {where} (its fields: {', '.join(parent.model_fields)})"


def _given(problem: Any) -> str:
    """` (given 0)`: the value a problem is about, as JSON, when the message does not show it already. Never
    for `env` (a value there may be a secret under a harmless name) nor for an unknown field (a misplaced
    `token`), and not for a whole object (a check across fields)."""
    value = problem.get("input")
    if problem["loc"][:1] == ("env",) or problem["type"] == "extra_forbidden" or not isinstance(
            value, (str, int, float, bool, type(None))):
        return ""
    text = json.dumps(value)
    if len(text) > ECHO_MAX_CHARS:
        text = text[:ECHO_MAX_CHARS - 3] + "..."
    return "" if repr(value) in problem["msg"] or text in problem["msg"] else f" (given {text})"


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, each starting with the field's dotted path, e.g. `nodes.1: ...`, with the value
    given (`_given`) and, for a field the spec does not have, the fields it may have meant."""
    lines = []
    for problem in error.errors():
        # A dict key's own problem comes with a trailing "[key]": the key is the field (`env.HF_TOKEN`).
        loc = tuple(part for part in problem["loc"] if part != "[key]")
        path = ".".join(map(str, loc)) or "(spec)"
        if problem["type"] == "extra_forbidden":
            lines.append(f"{path}: {_unknown_field(loc)}")
        else:
            lines.append(f"{path}: {problem['msg']}{_given(problem)}")
    return "; ".join(lines)


@dataclass(frozen=True, slots=True)
class _HugeNumber:
    """An integer in a spec's JSON with more digits than Python converts (`sys.get_int_max_str_digits()`, 4,300
    by default): kept as its size, so the error names its field instead of the conversion's bare
    `Exceeds the limit (4300 digits)`."""

    digits: int


def _json_int(text: str) -> int | _HugeNumber:
    try:
        return int(text)
    except ValueError:  # json hands over only well-formed integers: the only failure is their length
        return _HugeNumber(len(text.lstrip("-")))


def _find_huge_number(value: Any, path: str = "") -> tuple[str, int] | None:
    """The dotted path (`checkpoint.every_steps`, `nodes.3`) and size of the first `_HugeNumber` in `value`."""
    if isinstance(value, _HugeNumber):
        return path or "(spec)", value.digits
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := _find_huge_number(item, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


def loads_spec_json(text: str | bytes) -> Any:
    """A spec's JSON text (a file, or the payload `temporal workflow start` sent) as plain values, for
    `parse_spec`. Raises `SpecError` saying what to fix for text that is not JSON, not UTF-8, nested too deeply,
    or holds a number too long for Python to convert (naming its field): never a bare ValueError, which the
    workflow could not tell from a bug."""
    try:
        raw = json.loads(text, parse_int=_json_int)
    except json.JSONDecodeError as error:
        raise SpecError(f"not valid JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    except UnicodeDecodeError as error:
        raise SpecError(f"not UTF-8 text (byte {error.start}): save the spec as UTF-8 JSON") from None
    except RecursionError:
        raise SpecError("not valid JSON: nested too deeply") from None
    if (huge := _find_huge_number(raw)) is not None:
        path, digits = huge
        raise SpecError(f"{path}: a number of {digits} digits, too large for any field")
    return raw


def parse_spec(raw: Any) -> RunSpec:
    """Validate user input into a `RunSpec`, raising `SpecError` that names the fields to fix."""
    if isinstance(raw, RunSpec):
        return raw
    if not isinstance(raw, dict):
        raise SpecError(f"spec must be a JSON object, got {type(raw).__name__}")
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as error:
        raise SpecError(f"invalid run spec: {describe_validation_error(error)}") from None
