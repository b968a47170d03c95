"""Every `TRAINGUARD_*` environment variable the workers, the CLI, the client, the dev stack, the job scripts
and the harness read, with its default and meaning: the one table docs/reference/environment.md is generated
from (`python -m infra.docgen.env_reference`).

The variables a node agent sets for the ranks it starts are not listed here: they are the agent-to-rank
contract and their owner is `trainguard.protocol` (its `ENV_*` constants and their docstrings). A variable
named anywhere in the code (a string, a docstring, a comment, a job script) and missing from both fails
tests/unit/test_docs.py, so the table cannot drift from the code.

Standard library only, and nothing here reads the environment: each variable is read where it is used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvVar:
    name: str
    """The variable's name, `TRAINGUARD_...`."""
    section: str
    """The heading it is listed under (who sets it): one of `SECTIONS`."""
    default: str
    """What unset means, as a reader would write it (a value in backticks, or a sentence)."""
    meaning: str
    """What it does, and where it is read (markdown, one paragraph)."""


SECTIONS = ("Connecting", "Controller", "Node agent", "Slurm job script", "Dev stack", "Tests and benchmarks")
"""The sections of the reference page, in order; the agent's variables for its ranks come after them."""

FLAG = "A boolean: `1`/`0`, `true`/`false`, `on`/`off`, `yes`/`no`, any case; anything else is refused."

VARIABLES: tuple[EnvVar, ...] = (
    # -------------------------------------------------------------------------------- connecting
    EnvVar(name="TRAINGUARD_TEMPORAL_ADDRESS", section="Connecting",
           default="the dev stack's (see `TRAINGUARD_PORT_BASE`, `TRAINGUARD_HOME`), else `127.0.0.1:7233`",
           meaning="The Temporal frontend (`host:port`) the CLI, the client, the controller and the node agents "
                   "connect to (`trainguard.settings.Settings`)."),
    EnvVar(name="TRAINGUARD_NAMESPACE", section="Connecting", default="`default`",
           meaning="The Temporal namespace runs live in."),
    EnvVar(name="TRAINGUARD_TLS", section="Connecting", default="off",
           meaning="TLS to Temporal without a client certificate (implied by `TRAINGUARD_TLS_CERT`, "
                   "`TRAINGUARD_TLS_CA` and `TRAINGUARD_API_KEY`). " + FLAG),
    EnvVar(name="TRAINGUARD_TLS_CERT", section="Connecting", default="none",
           meaning="Client certificate (PEM file) for mutual TLS to a Temporal cluster or Temporal Cloud; set "
                   "with `TRAINGUARD_TLS_KEY`."),
    EnvVar(name="TRAINGUARD_TLS_KEY", section="Connecting", default="none",
           meaning="The client certificate's private key (PEM file). Never passed on to ranks."),
    EnvVar(name="TRAINGUARD_TLS_CA", section="Connecting", default="the system's CA bundle",
           meaning="CA bundle (PEM file) that signed the Temporal server's certificate."),
    EnvVar(name="TRAINGUARD_API_KEY", section="Connecting", default="none",
           meaning="A Temporal Cloud API key, from the environment only (never a file in the repo). A node agent "
                   "holds it in memory once connected; ranks never see it."),
    EnvVar(name="TRAINGUARD_S3_ENDPOINT", section="Connecting",
           default="`AWS_ENDPOINT_URL`, else the dev stack's, else AWS S3 itself",
           meaning="The S3-compatible store's endpoint URL. Keys come from the standard AWS chain "
                   "(`AWS_ACCESS_KEY_ID`, profiles, instance roles), or the dev stack's own for its store."),
    EnvVar(name="TRAINGUARD_S3_PATH_STYLE", section="Connecting", default="on",
           meaning="Path-style S3 addressing (SeaweedFS, MinIO and Ceph want it); off lets boto3 choose. " + FLAG),
    EnvVar(name="TRAINGUARD_CODEC_KEY", section="Connecting", default="none: payloads in plaintext",
           meaning="AES-256 key (base64 or 64 hex digits; `python -m trainguard.codec` makes one) that "
                   "encrypts every payload sent through Temporal (`trainguard.codec`). Workers, the CLI and the "
                   "client must hold the same key; `python -m trainguard.codec_server` shows payloads in the Web "
                   "UI."),
    EnvVar(name="TRAINGUARD_CODEC_KEY_ID", section="Connecting", default="`default`",
           meaning="The name of `TRAINGUARD_CODEC_KEY`, recorded with each payload; a new id with a new key "
                   "rotates it."),
    EnvVar(name="TRAINGUARD_TRACING", section="Connecting",
           default="off (on when `OTEL_EXPORTER_OTLP_ENDPOINT` is set)",
           meaning="OpenTelemetry spans over OTLP/HTTP from the workers, the CLI and the client, one trace per "
                   "run (`trainguard.tracing`; needs the `otel` extra). " + FLAG),
    EnvVar(name="TRAINGUARD_METRICS_ADDRESS", section="Connecting", default="none: no metrics served",
           meaning="`host:port` (e.g. `0.0.0.0:9464`) where the process serves the Temporal SDK's Prometheus "
                   "metrics."),
    EnvVar(name="TRAINGUARD_HOME", section="Connecting", default="`.trainguard`",
           meaning="The dev stack's data folder: `trainguard dev up` keeps its data, logs and a stack file there, "
                   "from which every command finds the stack's Temporal, store and keys."),
    EnvVar(name="TRAINGUARD_PORT_BASE", section="Connecting", default="none: the standard ports (Temporal 7233, "
                                                                      "UI 8233, S3 8333, ...)",
           meaning="Moves every port of the dev stack to base + offset, so two stacks coexist; every command "
                   "given it finds that stack."),
    # -------------------------------------------------------------------------------- controller
    EnvVar(name="TRAINGUARD_BUILD_ID", section="Controller",
           default="derived from the workflow code (`trainguard.versioning`)",
           meaning="The controller's build for worker versioning: a run stays on the build that started it. "
                   "`unversioned` turns versioning off (a server without worker deployments). `trainguard "
                   "controller promote` makes a build current."),
    EnvVar(name="TRAINGUARD_DEPLOYMENT", section="Controller", default="`trainguard-controller`",
           meaning="The worker deployment the controller's builds belong to."),
    EnvVar(name="TRAINGUARD_MANIFEST_KEY", section="Controller", default="none: manifests untagged, any trusted",
           meaning="The controller's secret (at least 32 characters) that tags every manifest it commits and "
                   "checks every one it restores. Only the controller holds it."),
    EnvVar(name="TRAINGUARD_PEER_TOKEN", section="Controller",
           default="none: registrations and node records unsigned, no peer tier",
           meaning="The node pool's shared secret (at least 16 characters), in the controller's and every node "
                   "agent's environment: it signs registrations, node records and relaunch decisions, and "
                   "guards the agents' peer shard servers. An agent holds it in memory; ranks never see it."),
    EnvVar(name="TRAINGUARD_SCHEDULER", section="Controller", default="`none`",
           meaning="`slurm` or `kubernetes`: a cordon also drains the node in Slurm, or cordons and taints it "
                   "in Kubernetes, and lifting it resumes or uncordons it; with `slurm` an operator's drain "
                   "moves runs off the node. An unknown value stops the controller at start."),
    EnvVar(name="TRAINGUARD_SCHEDULER_COMMAND", section="Controller",
           default="`scontrol` or `kubectl` from `PATH`",
           meaning="The program the scheduler hook runs."),
    # -------------------------------------------------------------------------------- node agent
    EnvVar(name="TRAINGUARD_ALLOWED_ENTRYPOINTS", section="Node agent", default="none: nothing may run",
           meaning="Programs, or folders of programs, ranks may be started with, separated by `:` (adds to "
                   "`--allow`; `*` allows anything)."),
    EnvVar(name="TRAINGUARD_ALLOWED_ENV", section="Node agent", default="none",
           meaning="Env names, separated by `,`, that a run spec may set although they change what ranks run "
                   "or load (adds to `--allow-env`; see [Security](../operations/security.md))."),
    EnvVar(name="TRAINGUARD_NODE_LABELS", section="Node agent", default="none",
           meaning="`KEY=VALUE` labels, separated by `,`, the agent registers its node with (instead of "
                   "`--label`); runs choose nodes by them (`node_selector`)."),
    EnvVar(name="TRAINGUARD_PEER_PORT", section="Node agent", default="`0`: a free port",
           meaning="The port the agent serves its checkpoint shards to other nodes on (the peer tier; "
                   "`--peer-port`); `-1` serves none."),
    EnvVar(name="TRAINGUARD_RUN_AS", section="Node agent", default="none: ranks run as the agent's user",
           meaning="The unprivileged user (name or uid) ranks run as (`--run-as`; the agent must be root), so "
                   "they cannot read the agent's environment or secrets. A dev stack started as root picks one "
                   "itself."),
    EnvVar(name="TRAINGUARD_CHAOS", section="Node agent", default="on",
           meaning="Off refuses fault injection (`trainguard chaos`, `inject_fault`) on this node, as "
                   "`--no-chaos` does: production. " + FLAG),
    EnvVar(name="TRAINGUARD_CGROUPS", section="Node agent", default="on where cgroup v2 is writable",
           meaning="`off` fences a run's processes by process group and tree only, without a cgroup per run "
                   "(a host whose cgroups another manager owns)."),
    EnvVar(name="TRAINGUARD_HEARTBEAT_INTERVAL_S", section="Node agent", default="`1.0`",
           meaning="Seconds between a rank watch's progress reports to Temporal (the live steps of `trainguard "
                   "run status`); runs of more than 200 nodes ask for fewer whatever this says."),
    EnvVar(name="TRAINGUARD_ALLOW_PICKLE", section="Node agent", default="off: restores load tensors and plain "
                                                                         "data only",
           meaning="Set by the node's operator in the agent's environment, which its ranks inherit: restores on "
                   "that node may unpickle arbitrary objects (`torch.load(weights_only=False)`). A spec cannot "
                   "set it. " + FLAG),
    # -------------------------------------------------------------------------------- slurm job script
    EnvVar(name="TRAINGUARD_WORKDIR", section="Slurm job script", default="`/tmp/trainguard-<job id>`",
           meaning="The folder the job scripts give each node's agent its `--workdir` in: one folder per node "
                   "under it (`examples/slurm/cluster.sbatch`: per node and run of the job, "
                   "`NODE-JOB.RESTARTS`). A folder of the job's own: the agent refuses one another user made."),
    EnvVar(name="TRAINGUARD_LOGS", section="Slurm job script",
           default="the submit directory (`cluster.sbatch`: its `logs/`)",
           meaning="Where the job scripts write each node agent's log."),
    EnvVar(name="TRAINGUARD_SPEC", section="Slurm job script", default="`examples/quickstart.json`",
           meaning="The run spec the job script starts on its allocation."),
    EnvVar(name="TRAINGUARD_SPARES", section="Slurm job script", default="1",
           meaning="How many of the allocation's nodes (the last ones) `train.sbatch` holds as the run's spares; "
                   "the others train (`TRAINGUARD_SPEC=examples/ft.json sbatch --nodes=4 ...`: 3 groups and a "
                   "spare)."),
    # -------------------------------------------------------------------------------- dev stack
    EnvVar(name="TRAINGUARD_DEV_NODES", section="Dev stack",
           default="`node-0,node-1,node-2` (`--slurm`: the emulated Slurm nodes)",
           meaning="The nodes `trainguard dev up` starts agents for, separated by `,`."),
    EnvVar(name="TRAINGUARD_DEV_LABELS", section="Dev stack", default="none",
           meaning="Labels of the dev stack's nodes, e.g. `node-0:zone=a,gpu=h100;node-1:zone=b`."),
    EnvVar(name="TRAINGUARD_DEV_TLS", section="Dev stack", default="off",
           meaning="`dev up --tls`: Temporal over mutual TLS through a front with the stack's own CA. " + FLAG),
    EnvVar(name="TRAINGUARD_DEV_HOSTS", section="Dev stack", default="off",
           meaning="`dev up --hosts`: each node in a network namespace of its own (needs root). " + FLAG),
    EnvVar(name="TRAINGUARD_DEV_SLURM", section="Dev stack", default="off",
           meaning="`dev up --slurm`: a single-host Slurm cluster of emulated nodes beside the stack, whose jobs "
                   "start the node agents (needs root and Slurm). " + FLAG),
    EnvVar(name="TRAINGUARD_DEV_SLURMD_TIMEOUT_S", section="Dev stack", default="`30`",
           meaning="The emulated Slurm cluster's `SlurmdTimeout`, in seconds."),
    # -------------------------------------------------------------------------------- tests and benchmarks
    EnvVar(name="TRAINGUARD_PORT_SEARCH_OFFSET", section="Tests and benchmarks", default="`0`",
           meaning="Shifts where private stacks (tests, benchmarks, the soak) start looking for free ports, so "
                   "suites from two checkouts do not race for the same ports."),
    EnvVar(name="TRAINGUARD_TEST_LOGS", section="Tests and benchmarks", default="none: logs removed",
           meaning="A folder where the test stacks keep their logs (controller, agents, Temporal, SeaweedFS)."),
    EnvVar(name="TRAINGUARD_RECORD_HISTORIES", section="Tests and benchmarks", default="off",
           meaning="`1` makes the integration tests re-record the histories the replay test runs (at a "
                   "release, on its build)."),
    EnvVar(name="TRAINGUARD_NVML_STANDIN_GPUS", section="Tests and benchmarks", default="`1`",
           meaning="The GPU count of the benchmarks' stand-in NVML (`infra/bench/nvml_standin`)."),
)
"""Every variable but the agent's for its ranks (`trainguard.protocol`), by section."""
