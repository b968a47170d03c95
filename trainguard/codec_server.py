"""A codec server, so the Temporal Web UI (and `temporal` CLI) can show payloads that `trainguard.codec`
encrypted, to those who hold the key.

Run it where the key is, next to the browser that opens the Web UI (it binds 127.0.0.1 unless told
otherwise), with the same `TRAINGUARD_CODEC_KEY` / `TRAINGUARD_CODEC_KEY_ID` as the workers:

    TRAINGUARD_CODEC_KEY=... python -m trainguard.codec_server --port 8888 --origin http://127.0.0.1:8233

then point the UI at it, either for everyone using that UI:

    temporal server start-dev --ui-codec-endpoint http://127.0.0.1:8888
    # a deployed UI: TEMPORAL_CODEC_ENDPOINT=http://127.0.0.1:8888 (codec.endpoint in its config)

or per user, in the Web UI itself: the "Codec Server" setting (the data-encoder icon at the top right),
endpoint `http://127.0.0.1:8888`, saved in that browser only. The browser calls the server directly, so
the key never goes to the UI or the Temporal server. The `temporal` CLI takes `--codec-endpoint` too.

The protocol is Temporal's: `POST /encode` and `POST /decode`, each with a JSON body
`{"payloads": [{"metadata": {"encoding": "<base64>", ...}, "data": "<base64>"}, ...]}` (the protobuf JSON
form of `temporal.api.common.v1.Payloads`), answered in the same shape. `X-Namespace` names the
namespace; with `--namespace` given, requests for other namespaces are refused. Cross-origin requests
are answered for the `--origin`s only (the Web UI's origin, as the browser sends it; repeatable),
preflights included, with credentials allowed so the UI may pass its access token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
from collections.abc import Iterable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads
from temporalio.converter import PayloadCodec

from trainguard.codec import CodecKeyError, EncryptionCodec

logger = logging.getLogger("trainguard.codec_server")

DEFAULT_ORIGIN = "http://127.0.0.1:8233"
MAX_BODY_BYTES = 64 * 1024 * 1024
"""Far above what the UI sends (Temporal caps a payload at 2 MiB by default)."""
ALLOW_HEADERS = "content-type, x-namespace, authorization"


class CodecServer(ThreadingHTTPServer):
    """An HTTP server answering Temporal's codec server protocol with `codec`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], codec: PayloadCodec, origins: Iterable[str] = (DEFAULT_ORIGIN,),
                 namespaces: Iterable[str] | None = None) -> None:
        super().__init__(address, _Handler)
        self.codec = codec
        self.origins = frozenset(o.rstrip("/") for o in origins)
        self.namespaces = frozenset(namespaces) if namespaces else None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"  # type: ignore[str-bytes-safe]  # an AF_INET address: host is a str

    def start_in_thread(self) -> threading.Thread:
        """Serve from a daemon thread; `shutdown()` stops it."""
        thread = threading.Thread(target=self.serve_forever, name="codec-server", daemon=True)
        thread.start()
        return thread


class _Handler(BaseHTTPRequestHandler):
    server: CodecServer
    protocol_version = "HTTP/1.1"
    server_version = "trainguard-codec"

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), format % args)

    # ---------------------------------------------------------------------------------------------- CORS
    def _origin(self) -> tuple[str | None, bool]:
        """The request's Origin and whether it may be answered (no Origin: not a browser, allowed)."""
        origin = self.headers.get("Origin")
        if origin is None:
            return None, True
        return origin, origin.rstrip("/") in self.server.origins

    def _cors_headers(self, origin: str | None) -> None:
        self.send_header("Vary", "Origin")
        if origin is not None:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Allow-Credentials", "true")

    def _reply(self, status: HTTPStatus, body: dict[str, Any], origin: str | None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self._cors_headers(origin)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str, origin: str | None) -> None:
        self._reply(status, {"error": message}, origin)

    def do_OPTIONS(self) -> None:
        origin, allowed = self._origin()
        if not allowed:
            self._error(HTTPStatus.FORBIDDEN, f"origin {origin} is not allowed", None)
            return
        self.send_response(HTTPStatus.NO_CONTENT)
        self._cors_headers(origin)
        self.send_header("Access-Control-Allow-Methods", "POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", ALLOW_HEADERS)
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        origin, allowed = self._origin()
        self._error(HTTPStatus.NOT_FOUND, "POST /encode or /decode", origin if allowed else None)

    def do_POST(self) -> None:
        origin, allowed = self._origin()
        if not allowed:
            self._error(HTTPStatus.FORBIDDEN, f"origin {origin} is not allowed", None)
            return
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in ("/encode", "/decode"):
            self._error(HTTPStatus.NOT_FOUND, "POST /encode or /decode", origin)
            return
        namespace = self.headers.get("X-Namespace")
        if self.server.namespaces is not None and namespace not in self.server.namespaces:
            self._error(HTTPStatus.FORBIDDEN, f"namespace {namespace!r} is not served here", origin)
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length required", origin)
            return
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes", origin)
            return
        try:
            payloads = json_format.Parse(self.rfile.read(length), Payloads(), ignore_unknown_fields=True)
        except (json_format.ParseError, UnicodeDecodeError, ValueError) as error:
            self._error(HTTPStatus.BAD_REQUEST, f"body is not a Payloads JSON: {error}", origin)
            return
        codec = self.server.codec
        try:
            if path == "/encode":
                result = asyncio.run(codec.encode(payloads.payloads))
            else:
                result = asyncio.run(codec.decode(payloads.payloads))
        except ValueError as error:
            logger.warning("%s for namespace %r failed: %s", path, namespace, error)
            self._error(HTTPStatus.BAD_REQUEST, str(error), origin)
            return
        self._reply(HTTPStatus.OK, json_format.MessageToDict(Payloads(payloads=result)), origin)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainguard.codec_server",
        description="Serve Temporal's codec protocol with TRAINGUARD_CODEC_KEY, for the Web UI and CLI.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8888, help="port (default 8888)")
    parser.add_argument("--origin", action="append", dest="origins", metavar="ORIGIN",
                        help=f"the Web UI's origin, repeatable (default {DEFAULT_ORIGIN})")
    parser.add_argument("--namespace", action="append", dest="namespaces", metavar="NAMESPACE",
                        help="serve only these namespaces (X-Namespace), repeatable (default all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        codec = EncryptionCodec.from_env()
    except CodecKeyError as error:
        print(error, file=sys.stderr)
        return 2
    if codec is None:
        print("TRAINGUARD_CODEC_KEY is not set: there is nothing to decode with", file=sys.stderr)
        return 2
    server = CodecServer((args.host, args.port), codec, args.origins or [DEFAULT_ORIGIN], args.namespaces)
    logger.info("codec server for key id %r at %s, for origins %s", codec.key_id, server.url,
                ", ".join(sorted(server.origins)))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
