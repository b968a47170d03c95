"""The peer tier: node agents serve their own verified checkpoint shards to each other over HTTP.

A rank that moves to another node (a spare replacing a node with a bad GPU or a slow one, a drained node, a
run that shrinks or grows) restores a shard its new node never wrote. The node that wrote it usually still
has it on disk (the local tier keeps the newest committed step), so the new node fetches it from that peer
before it asks the store, and checks every byte against the manifest's sha256 either way.

The server answers only `GET /runs/<run>/step-<8 digits>/rank-<5 digits>.pt` for a shard whose meta file
is there (completely written), from the agent's checkpoint folders and nowhere else, and only to a request
that carries the pool's peer token (`Authorization: Bearer <token>`): every agent of a pool has the same
`TRAINGUARD_PEER_TOKEN` in its environment (never in a spec; ranks do not inherit it). A request without it,
or with another, gets 401 and no byte of a shard. An agent without a token serves nothing and fetches
nothing: its restores read the store. The token authenticates; it does not encrypt (plain HTTP): keep the
port on the cluster network (the agent's `--host`), or switch the tier off (`--peer-port -1`).

The port is reachable before authentication, so what an unauthenticated connection can hold is bounded: at most
`MAX_CONNECTIONS` at once (one more is closed as soon as it is accepted, holding nothing), each has
`REQUEST_TIMEOUT_S` to send its whole request (a connection that sends nothing, or trickles bytes, is closed),
and the token is checked before the path is even looked at. Idle sockets once held an agent thread and a
descriptor each, forever: out of descriptors, the node's launches failed with EMFILE and cordoned it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import shutil
import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from activities.models import ShardInfo
from trainguard.settings import agent_secret
from trainguard.pool import peer_url_of

log = logging.getLogger(__name__)

SHARD_PATH = re.compile(r"^/runs/([A-Za-z0-9._-]{1,200})/(step-\d{8})/(rank-\d{5})\.pt$")
FETCH_TIMEOUT_S = 5.0
"""Connect and read timeout of one peer fetch: a peer that does not answer soon is skipped for the store."""
CHUNK = 1 << 20
REQUEST_TIMEOUT_S = 10.0
"""A connection has this long to send its request line and headers (all of them, not per byte), and then each
write of the answer may block this long: a peer's fetch sends its request at once (`FETCH_TIMEOUT_S` is its own
bound), so only an idle or trickling connection is cut."""
MAX_CONNECTIONS = 64
"""Connections served at once; one more is closed when accepted. A restore asks each peer for a few shards
(one connection each), and an agent keeps far more descriptors than this for its ranks' launches."""

PEER_TOKEN_ENV = "TRAINGUARD_PEER_TOKEN"
"""The pool's shared peer secret, in every agent's environment."""
MIN_PEER_TOKEN_CHARS = 16
"""Shorter tokens are refused at start: a guessable secret is no authentication."""


def peer_token(environ: dict[str, str] | None = None) -> str | None:
    """This agent's peer token (`TRAINGUARD_PEER_TOKEN`), or None when the pool has none configured."""
    token = (agent_secret(PEER_TOKEN_ENV) or "") if environ is None else environ.get(PEER_TOKEN_ENV, "").strip()
    if token and len(token) < MIN_PEER_TOKEN_CHARS:
        raise ValueError(f"{PEER_TOKEN_ENV} has {len(token)} characters, fewer than {MIN_PEER_TOKEN_CHARS}: "
                         f"use a long random one (python -c 'import secrets; print(secrets.token_hex(32))')")
    return token or None


def shard_path(run_dir_name: str, key: str) -> str:
    """The URL path of a shard on the node that wrote it: its run folder and the key's step and file name."""
    step, name = key.rsplit("/", 2)[-2:]
    return f"/runs/{run_dir_name}/{step}/{name}"


class ShardServer:
    """Serves this node's checkpoint shards (`<workdir>/runs/<run>/checkpoints/step-*/rank-*.pt`)."""

    def __init__(self, workdir: Path, host: str, token: str, port: int = 0,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> None:
        if not token:
            raise ValueError("the peer tier needs the pool's token: serving shards without one serves anyone")
        root = workdir.resolve() / "runs"
        expected = f"Bearer {token}".encode()

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s  # each read and write of the connection; `_deadline` bounds the request

            def setup(self) -> None:
                super().setup()
                # A per-read timeout alone lets a client trickle one byte per timeout forever: the whole request
                # gets one deadline, after which the socket is shut down under the blocked read.
                self._deadline = threading.Timer(request_timeout_s, _shut, (self.connection,))
                self._deadline.daemon = True
                self._deadline.start()

            def finish(self) -> None:
                self._deadline.cancel()
                super().finish()

            def do_GET(self) -> None:  # the http.server API
                self._deadline.cancel()  # the request is read: only the answer's writes are left (each bounded)
                offered = (self.headers.get("Authorization") or "").encode("utf-8", "replace")
                if not hmac.compare_digest(offered, expected):  # the same time whatever part of it is wrong
                    self.send_error(401, "the pool's peer token is required")
                    return
                match = SHARD_PATH.fullmatch(self.path)
                if match is None or match.group(1) in (".", ".."):
                    self.send_error(404, "not a shard path")
                    return
                run, step, name = match.groups()
                shard = root / run / "checkpoints" / step / f"{name}.pt"
                if not (shard.parent / f"{name}.json").is_file() or not shard.is_file():
                    self.send_error(404, "no such shard here")
                    return
                try:
                    handle = shard.open("rb")
                except OSError:
                    self.send_error(404, "no such shard here")
                    return
                with handle:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(shard.stat().st_size))
                    self.end_headers()
                    shutil.copyfileobj(handle, self.wfile, CHUNK)

            def log_message(self, format: str, *args: Any) -> None:  # the http.server API
                log.debug("peer tier: " + format, *args)

        self._server = _BoundedServer((host, port), Handler, max_connections)
        self.url = peer_url_of(host, self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="shard-server", daemon=True)

    @property
    def open_connections(self) -> int:
        """Connections being served now (at most `max_connections`)."""
        return self._server.open

    def start(self) -> ShardServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _shut(connection: socket.socket) -> None:
    """End a connection whose request is overdue: its handler's blocked read returns, and the handler ends."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class _BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most `max_connections` at once and closes the rest at accept."""

    daemon_threads = True
    request_queue_size = 128
    """The kernel's backlog of connections not accepted yet (socketserver's default of 5 made a burst of peers
    wait a second for a SYN retry): each is accepted, and refused, at once."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int) -> None:
        self.max_connections, self.refused, self.open = max_connections, 0, 0
        self._slots = threading.BoundedSemaphore(max_connections)
        self._count = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            if self.refused % 1000 == 1:  # a flood logs a line per thousand, not one per connection
                log.warning("peer tier: %d connections open, refused %d so far (latest from %s)",
                            self.max_connections, self.refused, client_address[0])
            self.shutdown_request(request)
            return
        self._opened(1)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._opened(-1)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._opened(-1)

    def _opened(self, change: int) -> None:
        with self._count:
            self.open += change
        if change < 0:
            self._slots.release()


def fetch_from_peer(base_url: str, run_dir_name: str, shard: ShardInfo, target: Path,
                    token: str | None = None) -> str | None:
    """Copy `shard` from the peer that wrote it into `target`, checking its size and sha256 on the way, with
    the pool's peer token (`token`, default this agent's `TRAINGUARD_PEER_TOKEN`). Returns None when `target`
    holds exactly the manifest's bytes, else why not (and `target` is removed)."""
    url = base_url.rstrip("/") + shard_path(run_dir_name, shard.key)
    token = token or peer_token()
    if token is None:
        return f"{url}: no {PEER_TOKEN_ENV} on this agent to ask a peer with"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    digest = hashlib.sha256()
    size = 0
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response, \
                target.open("wb") as out:
            while chunk := response.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
    except OSError as error:  # refused, timed out, 404 (HTTPError is an OSError)
        target.unlink(missing_ok=True)
        return f"{url}: {error}"
    if size != shard.size_bytes or digest.hexdigest() != shard.sha256:
        target.unlink(missing_ok=True)
        return f"{url}: {size} bytes with sha256 {digest.hexdigest()[:12]}..., manifest says {shard.size_bytes} " \
               f"bytes, {shard.sha256[:12]}..."
    return None
