"""Connection settings for workers, the CLI and the client, read from the environment.

Secrets (S3 keys) come from the standard AWS chain (`AWS_ACCESS_KEY_ID`, profiles, instance roles) in the
worker's own environment, never from a run spec or a workflow input. A node agent takes its secrets out of
its environment once it has connected (`hold_agent_secrets`): they live in this module's memory, so nothing
the agent starts inherits them and every text it sends to Temporal is redacted of them
(`trainguard.redact`). Dropping them from `os.environ` does not change `/proc/<agent>/environ` (the kernel
keeps the block the process started with): what keeps ranks from reading it is a uid of their own
(`--run-as`), since only the same uid or root may read a process's environ.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from functools import lru_cache
from typing import Any
from collections.abc import Mapping, MutableMapping


DEFAULT_TEMPORAL_ADDRESS = "127.0.0.1:7233"

AGENT_SECRET_ENV = ("TRAINGUARD_PEER_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                    "AWS_SECURITY_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN", "TRAINGUARD_API_KEY",
                    "TRAINGUARD_CODEC_KEY", "TEMPORAL_API_KEY", "TRAINGUARD_MANIFEST_KEY")
"""The variables a node agent holds in memory instead of its environment (`hold_agent_secrets`). The AWS key
id travels with its secret: boto3 takes a pair from one source."""

STILL_READ_FROM_ENVIRON: frozenset[str] = frozenset()
"""Held, and left in `os.environ` too, for code that still reads them there lazily: none now (the peer token is
read through `agent_secret`)."""

_held: dict[str, str] = {}
"""Name -> value of what `hold_agent_secrets` took; process-wide, like the environment it replaces."""


def hold_agent_secrets(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Move the `AGENT_SECRET_ENV` variables set in `environ` (default `os.environ`) into this module's memory
    and out of `environ` (but `STILL_READ_FROM_ENVIRON`). Returns what it holds now. Call it once the agent
    has connected to Temporal (the connection read its API and codec keys)."""
    env = os.environ if environ is None else environ
    for name in AGENT_SECRET_ENV:
        value = env.get(name, "")
        if value.strip():
            _held[name] = value.strip()
        if name not in STILL_READ_FROM_ENVIRON:
            env.pop(name, None)
    return dict(_held)


def agent_secret(name: str) -> str | None:
    """The secret `name` the agent holds, else the environment's (a worker that holds none); None when unset."""
    return _held.get(name) or os.environ.get(name, "").strip() or None


def held_secret_values() -> list[str]:
    """Every secret value this process holds: what `trainguard.redact` blanks out of texts for Temporal."""
    return [value for name, value in _held.items() if name in AGENT_SECRET_ENV]


def forget_agent_secrets() -> None:
    """Tests: hold nothing again."""
    _held.clear()

FLAG_TRUE = frozenset({"1", "true", "on", "yes"})
FLAG_FALSE = frozenset({"0", "false", "off", "no"})
"""The words a boolean environment variable may hold, in any case. Anything else is refused, never read as
one side: `TRAINGUARD_CHAOS=OFF` once left chaos on because only lowercase `off` turned it off."""


def parse_flag(name: str, value: str) -> bool:
    """`value` of the boolean variable `name` (`FLAG_TRUE` / `FLAG_FALSE`, any case, surrounding blanks
    ignored). Raises a ValueError naming the variable for anything else."""
    word = value.strip().lower()
    if word in FLAG_TRUE:
        return True
    if word in FLAG_FALSE:
        return False
    raise ValueError(f"{name}={value!r}: write one of on/off, true/false, yes/no, 1/0 (any case)")


def env_flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """The boolean variable `name` of `environ` (default `os.environ`); `default` when unset or empty.
    Every boolean the workers, the CLI and the tools read from the environment comes through here."""
    value = (os.environ if environ is None else environ).get(name, "")
    return parse_flag(name, value) if value.strip() else default


@dataclass(frozen=True, slots=True)
class Settings:
    temporal_address: str
    """`TRAINGUARD_TEMPORAL_ADDRESS`; unset, the dev stack's that `TRAINGUARD_PORT_BASE` or the stack file of
    `TRAINGUARD_HOME` (default `.trainguard`) names (`trainguard.devstack.stack_address`); else `127.0.0.1:7233`."""
    namespace: str
    """`TRAINGUARD_NAMESPACE`, default `default`."""
    s3_endpoint: str | None
    """`TRAINGUARD_S3_ENDPOINT` (or `AWS_ENDPOINT_URL`); None means AWS S3 itself."""
    s3_region: str
    """`AWS_REGION`, default `us-east-1`."""
    s3_path_style: bool
    """`TRAINGUARD_S3_PATH_STYLE`, default on (SeaweedFS, MinIO and Ceph want it)."""
    tls_cert: str | None = None
    """`TRAINGUARD_TLS_CERT`: client certificate (PEM file) for mTLS to a Temporal cluster or Temporal Cloud."""
    tls_key: str | None = None
    """`TRAINGUARD_TLS_KEY`: its private key (PEM file)."""
    tls_ca: str | None = None
    """`TRAINGUARD_TLS_CA`: CA bundle (PEM file) that signed the server's certificate; default the system's."""
    tls: bool = False
    """`TRAINGUARD_TLS=1`: TLS without a client certificate (implied by the settings above and the API key)."""
    api_key: str | None = None
    """`TRAINGUARD_API_KEY`: a Temporal Cloud API key (from the environment only, never a file in the repo)."""
    metrics_address: str | None = None
    """`TRAINGUARD_METRICS_ADDRESS` (e.g. `0.0.0.0:9464`): serve Prometheus metrics there; default off."""
    build_id: str | None = None
    """`TRAINGUARD_BUILD_ID`: the controller's build, for worker versioning. A run stays on the build that
    started it (pinned) and a new build takes only new runs: a controller upgrade never replays a run's
    history on code that cannot replay it. Default unset: derived from the workflow code
    (`trainguard.versioning.controller_build_id`); `unversioned` turns versioning off."""
    deployment: str = "trainguard-controller"
    """`TRAINGUARD_DEPLOYMENT`: the worker deployment the controller's builds belong to."""
    address_source: str = "TRAINGUARD_TEMPORAL_ADDRESS"
    """Where `temporal_address` came from, for errors that name it."""
    s3_source: str = "TRAINGUARD_S3_ENDPOINT"
    """Where `s3_endpoint` came from, for errors that name it."""
    s3_keys: tuple[str, str] | None = field(default=None, repr=False)
    """The dev stack's store keys (`dev_store`), read from its home when the environment gives none and the
    endpoint is that stack's; None leaves boto3 its own chain (environment, profiles, instance roles)."""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        env = {**_held, **os.environ} if environ is None else dict(environ)
        address, source = env.get("TRAINGUARD_TEMPORAL_ADDRESS", ""), "TRAINGUARD_TEMPORAL_ADDRESS"
        if not address:
            from trainguard.devstack import stack_address

            address, source = stack_address(env) or (DEFAULT_TEMPORAL_ADDRESS, "the default (no stack named)")
        endpoint, s3_source, s3_keys = _store(env)
        return cls(
            temporal_address=address,
            address_source=source,
            s3_source=s3_source,
            s3_keys=s3_keys,
            namespace=env.get("TRAINGUARD_NAMESPACE", "default"),
            s3_endpoint=endpoint,
            s3_region=env.get("AWS_REGION", env.get("AWS_DEFAULT_REGION", "us-east-1")),
            s3_path_style=env_flag("TRAINGUARD_S3_PATH_STYLE", True, env),
            metrics_address=env.get("TRAINGUARD_METRICS_ADDRESS") or None,
            tls_cert=env.get("TRAINGUARD_TLS_CERT") or None,
            tls_key=env.get("TRAINGUARD_TLS_KEY") or None,
            tls_ca=env.get("TRAINGUARD_TLS_CA") or None,
            tls=env_flag("TRAINGUARD_TLS", False, env),
            api_key=env.get("TRAINGUARD_API_KEY") or None,
            build_id=env.get("TRAINGUARD_BUILD_ID") or None,
            deployment=env.get("TRAINGUARD_DEPLOYMENT") or "trainguard-controller",
        )

    def tls_config(self) -> Any:
        """The client's TLS settings: False for plain TCP (the dev stack), else a `TLSConfig`."""
        from temporalio.service import TLSConfig

        if not (self.tls or self.tls_cert or self.tls_ca or self.api_key):
            return False
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("set both TRAINGUARD_TLS_CERT and TRAINGUARD_TLS_KEY for mTLS, or neither")

        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return TLSConfig(server_root_ca_cert=read(self.tls_ca), client_cert=read(self.tls_cert),
                         client_private_key=read(self.tls_key))


DEV_CREDENTIALS_FILE = "s3-credentials.json"
"""The dev stack's store keys under its home (`DevStack.credentials` writes it, 0600): `access_key`,
`secret_key`."""


def dev_store(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(S3 endpoint, where it came from) of the dev stack the environment names, found as its Temporal is
    (`trainguard.devstack.stack_address`): `TRAINGUARD_PORT_BASE`, else the stack file `dev up` left under
    `TRAINGUARD_HOME` (default `.trainguard`); None when neither does."""
    from trainguard.devstack import STACK_FILE, StackConfig

    if environ.get("TRAINGUARD_PORT_BASE"):
        return (StackConfig.from_env(dict(environ)).s3_endpoint,
                f"TRAINGUARD_PORT_BASE={environ['TRAINGUARD_PORT_BASE']}")
    path = Path(environ.get("TRAINGUARD_HOME", ".trainguard")) / STACK_FILE
    try:
        return str(json.loads(path.read_text())["s3_endpoint"]), f"{path} (written by `trainguard dev up`)"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def dev_store_keys(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The key pair the dev stack under `TRAINGUARD_HOME` (default `.trainguard`) made for its store, or None."""
    path = Path(environ.get("TRAINGUARD_HOME", ".trainguard")) / DEV_CREDENTIALS_FILE
    try:
        creds = json.loads(path.read_text())
        return str(creds["access_key"]), str(creds["secret_key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store(env: Mapping[str, str]) -> tuple[str | None, str, tuple[str, str] | None]:
    """The store's endpoint, where it came from, and the dev stack's keys where they apply. The environment
    wins (`TRAINGUARD_S3_ENDPOINT`, `AWS_ENDPOINT_URL`); unset, the dev stack's endpoint, as for Temporal.
    Keys come from the stack only for the stack's own endpoint and only when the environment holds no AWS
    key: the CLI's `run report` on the dev stack reads hang stacks with nothing exported."""
    endpoint = env.get("TRAINGUARD_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL") or None
    source = "TRAINGUARD_S3_ENDPOINT" if env.get("TRAINGUARD_S3_ENDPOINT") else "AWS_ENDPOINT_URL"
    stack = dev_store(env)
    if endpoint is None:
        if stack is None:
            return None, "AWS S3 (no endpoint set, no stack named)", None
        endpoint, source = stack
    ours = stack is not None and endpoint == stack[0]
    keys = dev_store_keys(env) if ours and not env.get("AWS_ACCESS_KEY_ID") else None
    return endpoint, source, keys


# Fail fast on a dead store (the activity's retry policy, not botocore, decides how long to keep trying)
# while allowing slow multi-GB part uploads.
_S3_CONNECT_TIMEOUT_S = 5
_S3_READ_TIMEOUT_S = 120
_S3_CLIENT_ATTEMPTS = 3


@lru_cache(maxsize=4)
def _client(endpoint: str | None, region: str, path_style: bool,
            keys: tuple[str, str, str | None] | None = None) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(
        region_name=region,
        connect_timeout=_S3_CONNECT_TIMEOUT_S,
        read_timeout=_S3_READ_TIMEOUT_S,
        retries={"mode": "standard", "max_attempts": _S3_CLIENT_ATTEMPTS},
        s3={"addressing_style": "path" if path_style else "auto"},
        max_pool_connections=32,
    )
    session = (boto3.session.Session() if keys is None else
               boto3.session.Session(aws_access_key_id=keys[0], aws_secret_access_key=keys[1],
                                     aws_session_token=keys[2]))
    return session.client("s3", endpoint_url=endpoint, config=config)


def _held_keys() -> tuple[str, str, str | None] | None:
    """The S3 key pair a node agent holds (`hold_agent_secrets`), for boto3, which would look for it in the
    environment; None leaves boto3 its own chain (profiles, instance roles, web identity)."""
    key_id, secret = _held.get("AWS_ACCESS_KEY_ID"), _held.get("AWS_SECRET_ACCESS_KEY")
    if not (key_id and secret):
        return None
    return key_id, secret, _held.get("AWS_SESSION_TOKEN") or _held.get("AWS_SECURITY_TOKEN")


def s3_client(settings: Settings | None = None) -> Any:
    """A thread-safe boto3 S3 client for the configured store."""
    settings = settings or Settings.from_env()
    keys = _held_keys() or ((*settings.s3_keys, None) if settings.s3_keys else None)
    return _client(settings.s3_endpoint, settings.s3_region, settings.s3_path_style, keys)
