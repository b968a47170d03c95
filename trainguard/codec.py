"""Optional payload encryption: an AES-256-GCM `PayloadCodec` for Temporal, keyed from the environment.

With `TRAINGUARD_CODEC_KEY` set (32 random bytes, base64 or hex; `trainguard.codec.generate_key()` or
`python -m trainguard.codec` makes one), every payload trainguard sends through Temporal (workflow and
activity inputs and results, signals, queries, updates, memos, and failure messages and stack traces) is
encrypted before it leaves the process, so the Temporal server, its database and anyone reading the
history see only ciphertext. Workers, the CLI and the client must all hold the same key; the Web UI shows
the payloads to those who run `python -m trainguard.codec_server` with it (see that module).

What stays in plaintext: workflow ids and types, activity types, task queues, search attributes, timer
and retry settings: the server needs them.

An encrypted payload carries `encoding: binary/encrypted` and `encryption-key-id` in its (unencrypted)
metadata; its data is a 12-byte random nonce followed by the AES-GCM ciphertext of the whole original
payload (metadata and data), with the key id as associated data. A payload written under another key id
fails with an error naming that id; a payload whose ciphertext was altered fails authentication.
Payloads without the `binary/encrypted` encoding (histories from before encryption was turned on) pass
through decode unchanged.

`TRAINGUARD_CODEC_KEY_ID` (default `default`) names the key. To rotate: pick a new key and a new id; the
histories of runs started under the old key then need the old key to read (`EncryptionCodec` takes
`previous_keys` for that).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import string
from collections.abc import Mapping, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes, PayloadCodec

ENCODING = b"binary/encrypted"
"""The `encoding` metadata of an encrypted payload."""
KEY_ID_METADATA = "encryption-key-id"
"""The metadata entry naming the key a payload was encrypted with."""
KEY_ENV = "TRAINGUARD_CODEC_KEY"
KEY_ID_ENV = "TRAINGUARD_CODEC_KEY_ID"
DEFAULT_KEY_ID = "default"
KEY_BYTES = 32
NONCE_BYTES = 12


class CodecKeyError(ValueError):
    """A codec key that is missing, malformed or not 32 bytes."""


class PayloadDecryptionError(ValueError):
    """A payload this codec cannot decrypt: another key id, a wrong key, or altered ciphertext."""


def generate_key() -> str:
    """A new random AES-256 key, base64-encoded, for `TRAINGUARD_CODEC_KEY`."""
    return base64.b64encode(os.urandom(KEY_BYTES)).decode("ascii")


def parse_key(text: str) -> bytes:
    """The 32 key bytes of `text`: 64 hex digits, or base64 (standard or URL-safe, padding optional).

    Errors never echo the key."""
    text = text.strip()
    if len(text) == 2 * KEY_BYTES and all(c in string.hexdigits for c in text):
        return bytes.fromhex(text)
    try:
        padded = text + "=" * (-len(text) % 4)
        altchars = b"-_" if ("-" in text or "_" in text) else None
        key = base64.b64decode(padded, altchars=altchars, validate=True)
    except (binascii.Error, ValueError):
        raise CodecKeyError(
            f"{KEY_ENV} is neither base64 nor 64 hex digits; make one with "
            "`python -m trainguard.codec`") from None
    if len(key) != KEY_BYTES:
        raise CodecKeyError(
            f"{KEY_ENV} decodes to {len(key)} bytes; AES-256 needs {KEY_BYTES} "
            "(make one with `python -m trainguard.codec`)")
    return key


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM over whole payloads; see the module docstring for the format."""

    def __init__(self, key: bytes, key_id: str = DEFAULT_KEY_ID,
                 previous_keys: Mapping[str, bytes] | None = None) -> None:
        """`key` (32 bytes) encrypts and decrypts under `key_id`; `previous_keys` (key id -> key) only
        decrypt, for histories written before a rotation."""
        if not key_id:
            raise CodecKeyError("the codec key id must not be empty")
        keys = {**(previous_keys or {}), key_id: key}
        for kid, k in keys.items():
            if len(k) != KEY_BYTES:
                raise CodecKeyError(f"codec key {kid!r} is {len(k)} bytes; AES-256 needs {KEY_BYTES}")
        self.key_id = key_id
        self._ciphers = {kid: AESGCM(k) for kid, k in keys.items()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EncryptionCodec | None:
        """The codec `TRAINGUARD_CODEC_KEY` / `TRAINGUARD_CODEC_KEY_ID` describe; None when no key is set."""
        env = os.environ if environ is None else environ
        text = env.get(KEY_ENV, "").strip()
        if not text:
            return None
        return cls(parse_key(text), env.get(KEY_ID_ENV, "").strip() or DEFAULT_KEY_ID)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decrypt(p) for p in payloads]

    def encrypt(self, payload: Payload) -> Payload:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._ciphers[self.key_id].encrypt(
            nonce, payload.SerializeToString(deterministic=True), self.key_id.encode())
        return Payload(metadata={"encoding": ENCODING, KEY_ID_METADATA: self.key_id.encode()},
                       data=nonce + sealed)

    def decrypt(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            return payload
        raw_id = payload.metadata.get(KEY_ID_METADATA)
        if raw_id is None:
            raise PayloadDecryptionError(f"encrypted payload has no {KEY_ID_METADATA!r} metadata")
        key_id = raw_id.decode("utf-8", "replace")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise PayloadDecryptionError(
                f"payload was encrypted with key id {key_id!r}, but this codec holds "
                f"{sorted(self._ciphers)!r}; set {KEY_ENV} and {KEY_ID_ENV}={key_id} to that key")
        if len(payload.data) < NONCE_BYTES + 16:
            raise PayloadDecryptionError(f"encrypted payload (key id {key_id!r}) is truncated")
        try:
            plain = cipher.decrypt(payload.data[:NONCE_BYTES], payload.data[NONCE_BYTES:], raw_id)
        except InvalidTag:
            raise PayloadDecryptionError(
                f"payload encrypted with key id {key_id!r} failed authentication: the key under that "
                "id differs from the one it was written with, or the ciphertext was altered") from None
        decoded = Payload()
        decoded.ParseFromString(plain)
        return decoded


def with_codec(converter: DataConverter, codec: PayloadCodec) -> DataConverter:
    """`converter` with `codec` attached, and failure messages and stack traces moved into encoded
    attributes so the codec covers them too."""
    return dataclasses.replace(converter, payload_codec=codec,
                               failure_converter_class=DefaultFailureConverterWithEncodedAttributes)


def data_converter_from_env(environ: Mapping[str, str] | None = None) -> DataConverter:
    """`pydantic_data_converter`, encrypting with `EncryptionCodec` when `TRAINGUARD_CODEC_KEY` is set.

    Raises `CodecKeyError` on a malformed key, so a worker fails at start rather than at its first
    payload."""
    codec = EncryptionCodec.from_env(environ)
    return pydantic_data_converter if codec is None else with_codec(pydantic_data_converter, codec)


if __name__ == "__main__":
    print(generate_key())
