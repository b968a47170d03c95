"""Payload encryption: the codec, the data converter it makes, a real Temporal history, the codec server."""

from __future__ import annotations

import base64
import json
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import pytest_asyncio
from pydantic import BaseModel
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DefaultFailureConverterWithEncodedAttributes
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from trainguard.codec import (
    ENCODING,
    KEY_ID_METADATA,
    CodecKeyError,
    EncryptionCodec,
    PayloadDecryptionError,
    data_converter_from_env,
    generate_key,
    parse_key,
    with_codec,
)
from trainguard.codec_server import CodecServer

KEY = bytes(range(32))
SECRET = "hush-7f3a-only-the-key-holder-reads-this"


def _payload(text: str = SECRET) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps({"note": text}).encode())


# --------------------------------------------------------------------------------------------- codec
async def test_round_trip() -> None:
    codec = EncryptionCodec(KEY, "k1")
    plain = [_payload(), _payload("second"), Payload()]
    encoded = await codec.encode(plain)
    assert len(encoded) == 3
    for payload in encoded:
        assert payload.metadata["encoding"] == ENCODING
        assert payload.metadata[KEY_ID_METADATA] == b"k1"
        assert SECRET.encode() not in payload.SerializeToString()
    assert encoded[0].data != (await codec.encode(plain[:1]))[0].data, "a fresh nonce every time"
    assert await codec.decode(encoded) == plain


async def test_plaintext_payloads_pass_through_decode() -> None:
    plain = [_payload()]
    assert await EncryptionCodec(KEY).decode(plain) == plain


async def test_another_key_id_names_it() -> None:
    encoded = await EncryptionCodec(KEY, "old-key").encode([_payload()])
    with pytest.raises(PayloadDecryptionError, match="key id 'old-key'.*TRAINGUARD_CODEC_KEY_ID=old-key"):
        await EncryptionCodec(KEY, "new-key").decode(encoded)
    rotated = EncryptionCodec(bytes(32), "new-key", previous_keys={"old-key": KEY})
    assert await rotated.decode(encoded) == [_payload()]


async def test_same_key_id_other_key_fails_authentication() -> None:
    encoded = await EncryptionCodec(KEY, "k1").encode([_payload()])
    with pytest.raises(PayloadDecryptionError, match="key id 'k1' failed authentication"):
        await EncryptionCodec(bytes(32), "k1").decode(encoded)


@pytest.mark.parametrize("where", ["nonce", "ciphertext", "tag", "key-id-metadata", "truncated"])
async def test_tampering_is_detected(where: str) -> None:
    codec = EncryptionCodec(KEY, "k1", previous_keys={"k2": KEY})
    [payload] = await codec.encode([_payload()])
    data = bytearray(payload.data)
    if where == "nonce":
        data[0] ^= 1
    elif where == "ciphertext":
        data[20] ^= 1
    elif where == "tag":
        data[-1] ^= 1
    elif where == "key-id-metadata":
        payload.metadata[KEY_ID_METADATA] = b"k2"  # same key, but the key id is authenticated data
    else:
        data = data[:20]
    payload.data = bytes(data)
    with pytest.raises(PayloadDecryptionError, match="k1|k2"):
        await codec.decode([payload])


def test_keys() -> None:
    key = generate_key()
    assert len(base64.b64decode(key)) == 32 and generate_key() != key
    assert parse_key(key) == base64.b64decode(key)
    assert parse_key(KEY.hex()) == KEY
    assert parse_key(base64.urlsafe_b64encode(KEY).decode().rstrip("=")) == KEY
    assert parse_key(f"  {base64.b64encode(KEY).decode()}\n") == KEY
    with pytest.raises(CodecKeyError, match="16 bytes"):
        parse_key(base64.b64encode(bytes(16)).decode())
    with pytest.raises(CodecKeyError, match="neither base64 nor 64 hex") as error:
        parse_key("not a key!")
    assert "not a key" not in str(error.value), "errors do not echo the key"


def test_data_converter_from_env() -> None:
    assert data_converter_from_env({}) is pydantic_data_converter
    assert data_converter_from_env({"TRAINGUARD_CODEC_KEY": " "}) is pydantic_data_converter
    converter = data_converter_from_env({"TRAINGUARD_CODEC_KEY": KEY.hex(), "TRAINGUARD_CODEC_KEY_ID": "prod-1"})
    assert isinstance(converter.payload_codec, EncryptionCodec) and converter.payload_codec.key_id == "prod-1"
    assert converter.payload_converter_class is pydantic_data_converter.payload_converter_class
    assert isinstance(converter.failure_converter, DefaultFailureConverterWithEncodedAttributes)
    default_id = data_converter_from_env({"TRAINGUARD_CODEC_KEY": KEY.hex()}).payload_codec
    assert isinstance(default_id, EncryptionCodec) and default_id.key_id == "default"
    with pytest.raises(CodecKeyError):
        data_converter_from_env({"TRAINGUARD_CODEC_KEY": "abc"})


# ------------------------------------------------------------------------------------------ Temporal
class Note(BaseModel):
    text: str
    count: int


@workflow.defn(sandboxed=False)
class EchoWorkflow:
    @workflow.run
    async def run(self, note: Note) -> Note:
        return Note(text=note.text.upper(), count=note.count + 1)


@workflow.defn(sandboxed=False)
class FailingWorkflow:
    @workflow.run
    async def run(self, note: Note) -> None:
        raise ApplicationError(f"failed on {note.text}", non_retryable=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def encrypted_env() -> AsyncIterator[WorkflowEnvironment]:
    environment = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(Path(sys.executable).parent / "temporal-test-server"),
        data_converter=with_codec(pydantic_data_converter, EncryptionCodec(KEY, "test-key")),
    )
    yield environment
    await environment.shutdown()


async def _history_bytes(client: Client, workflow_id: str) -> tuple[bytes, str]:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return b"".join(e.SerializeToString() for e in history.events), history.to_json()


async def _run(client: Client, workflow_cls: Any, note: Note) -> tuple[str, Any]:
    queue = f"codec-{uuid4().hex[:8]}"
    workflow_id = f"wf-{uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[workflow_cls]):
        handle = await client.start_workflow(workflow_cls.run, note, id=workflow_id, task_queue=queue,
                                             execution_timeout=timedelta(seconds=30))
        try:
            return workflow_id, await handle.result()
        except Exception as error:  # noqa: BLE001 (the failing workflow's result is its error)
            return workflow_id, error


@pytest.mark.asyncio(loop_scope="session")
async def test_history_holds_only_ciphertext(encrypted_env: WorkflowEnvironment) -> None:
    workflow_id, result = await _run(encrypted_env.client, EchoWorkflow, Note(text=SECRET, count=1))
    assert result == Note(text=SECRET.upper(), count=2)

    raw, as_json = await _history_bytes(encrypted_env.client, workflow_id)
    for secret in (SECRET, SECRET.upper()):
        assert secret.encode() not in raw and secret not in as_json
    assert base64.b64encode(ENCODING).decode() in as_json

    # The control: the same workflow without the codec writes the secret in the clear.
    plain_client = Client(**{**encrypted_env.client.config(), "data_converter": pydantic_data_converter})
    plain_id, _ = await _run(plain_client, EchoWorkflow, Note(text=SECRET, count=1))
    assert SECRET.encode() in (await _history_bytes(plain_client, plain_id))[0]

    # Without the key, the encrypted history's input cannot be read.
    history = await encrypted_env.client.get_workflow_handle(workflow_id).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    with pytest.raises(PayloadDecryptionError, match="test-key"):
        await EncryptionCodec(KEY, "other").decode(started.input.payloads)


@pytest.mark.asyncio(loop_scope="session")
async def test_failure_messages_are_encrypted(encrypted_env: WorkflowEnvironment) -> None:
    workflow_id, error = await _run(encrypted_env.client, FailingWorkflow, Note(text=SECRET, count=0))
    assert f"failed on {SECRET}" in str(error.cause)
    raw, _ = await _history_bytes(encrypted_env.client, workflow_id)
    assert SECRET.encode() not in raw


# -------------------------------------------------------------------------------------- codec server
ORIGIN = "http://127.0.0.1:8233"


@pytest.fixture(scope="module")
def codec_server() -> Iterator[CodecServer]:
    server = CodecServer(("127.0.0.1", 0), EncryptionCodec(KEY, "k1"), [ORIGIN], namespaces=["default"])
    server.start_in_thread()
    yield server
    server.shutdown()
    server.server_close()


def _request(server: CodecServer, path: str, body: Any = None, method: str = "POST",
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        server.url + path, data=data, method=method,
        headers={"Content-Type": "application/json", "X-Namespace": "default", "Origin": ORIGIN,
                 **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            status, header_map, raw = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        status, header_map, raw = error.code, dict(error.headers), error.read()
    return status, header_map, json.loads(raw) if raw else None


def _wire(payload: Payload) -> dict[str, Any]:
    return {"metadata": {k: base64.b64encode(v).decode() for k, v in payload.metadata.items()},
            "data": base64.b64encode(payload.data).decode()}


def test_codec_server_encode_then_decode(codec_server: CodecServer) -> None:
    original = {"payloads": [_wire(_payload()), _wire(_payload("two"))]}
    status, headers, encoded = _request(codec_server, "/encode", original)
    assert status == 200, encoded
    assert headers["Access-Control-Allow-Origin"] == ORIGIN
    assert headers["Access-Control-Allow-Credentials"] == "true"
    assert len(encoded["payloads"]) == 2
    assert encoded["payloads"][0]["metadata"]["encoding"] == base64.b64encode(ENCODING).decode()
    assert SECRET not in json.dumps(encoded)

    status, _, decoded = _request(codec_server, "/decode", encoded)
    assert status == 200, decoded
    assert decoded == original

    # What a worker's codec wrote, the server reads, and the other way around.
    from_worker = EncryptionCodec(KEY, "k1").encrypt(_payload())
    assert _request(codec_server, "/decode", {"payloads": [_wire(from_worker)]})[2] == {
        "payloads": [_wire(_payload())]}


def test_codec_server_errors(codec_server: CodecServer) -> None:
    other = EncryptionCodec(KEY, "elsewhere").encrypt(_payload())
    status, headers, body = _request(codec_server, "/decode", {"payloads": [_wire(other)]})
    assert status == 400 and "'elsewhere'" in body["error"]
    assert headers["Access-Control-Allow-Origin"] == ORIGIN, "the UI can read the error"

    assert _request(codec_server, "/decode", {"payloads": []}, headers={"X-Namespace": "prod"})[0] == 403
    assert _request(codec_server, "/nope", {"payloads": []})[0] == 404
    assert _request(codec_server, "/decode", {"payloads": "x"})[0] == 400
    status, headers, _ = _request(codec_server, "/decode", {"payloads": []},
                                  headers={"Origin": "https://evil.example"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers


def test_codec_server_cors_preflight(codec_server: CodecServer) -> None:
    status, headers, _ = _request(codec_server, "/decode", method="OPTIONS", headers={
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,x-namespace,authorization"})
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == ORIGIN
    assert headers["Access-Control-Allow-Credentials"] == "true"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    allowed = {h.strip() for h in headers["Access-Control-Allow-Headers"].lower().split(",")}
    assert {"content-type", "x-namespace", "authorization"} <= allowed

    status, headers, _ = _request(codec_server, "/decode", method="OPTIONS",
                                  headers={"Origin": "https://evil.example"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
