"""An in-memory S3 for the checkpoint unit tests: the calls the committer, the publisher and the node agent make,
over a dict. ETags are the bodies' quoted MD5s, as a single PUT gets from S3; an object keeps the metadata it was
written with (the agent's sha256), and an object put into `objects` by hand has none."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from botocore.exceptions import ClientError

from activities import checkpoint_store, checkpoint_transfers


class MemoryStore:
    """Conditional writes (`IfNoneMatch="*"` on PUT, an ETag on GET) answer as S3 does; listings page once."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.metadata: dict[str, dict[str, str]] = {}
        self.gets: list[str] = []
        """Keys of every GET that returned a body, in order."""

    def etag(self, key: str) -> str:
        return f'"{hashlib.md5(self.objects[key]).hexdigest()}"'

    def put_object(self, Bucket: str, Key: str, Body: bytes, IfNoneMatch: str | None = None,
                   Metadata: dict[str, str] | None = None, **_: Any) -> dict[str, Any]:
        if IfNoneMatch == "*" and Key in self.objects:
            raise ClientError({"Error": {"Code": "PreconditionFailed"}}, "PutObject")
        self.objects[Key] = bytes(Body)
        self.metadata[Key] = dict(Metadata or {})
        return {"ETag": self.etag(Key)}

    def upload_fileobj(self, Fileobj: Any, Bucket: str, Key: str, ExtraArgs: dict[str, Any] | None = None,
                       Config: Any = None) -> None:
        self.put_object(Bucket, Key, Fileobj.read(), Metadata=(ExtraArgs or {}).get("Metadata"))

    def get_object(self, Bucket: str, Key: str, IfNoneMatch: str | None = None) -> dict[str, Any]:
        if Key not in self.objects:
            raise ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")
        if IfNoneMatch is not None and IfNoneMatch == self.etag(Key):
            raise ClientError({"Error": {"Code": "304"}}, "GetObject")
        self.gets.append(Key)
        body = self.objects[Key]

        class Body:
            @staticmethod
            def read() -> bytes:
                return body

        return {"Body": Body(), "ETag": self.etag(Key)}

    def head_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        if Key not in self.objects:
            raise ClientError({"Error": {"Code": "404"}}, "HeadObject")
        return {"ContentLength": len(self.objects[Key]), "Metadata": dict(self.metadata.get(Key, {})),
                "ETag": self.etag(Key)}

    def delete_object(self, Bucket: str, Key: str) -> None:
        self.objects.pop(Key, None)
        self.metadata.pop(Key, None)

    def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> None:
        for obj in Delete["Objects"]:
            self.delete_object(Bucket, obj["Key"])

    def get_paginator(self, name: str) -> Any:
        store = self

        class Paginator:
            @staticmethod
            def paginate(Bucket: str, Prefix: str, Delimiter: str | None = None) -> list[dict[str, Any]]:
                if name == "list_multipart_uploads":
                    return [{"Uploads": []}]
                keys = sorted(k for k in store.objects if k.startswith(Prefix))
                if Delimiter:
                    folders = sorted({Prefix + k[len(Prefix):].split(Delimiter, 1)[0] + Delimiter
                                      for k in keys if Delimiter in k[len(Prefix):]})
                    return [{"CommonPrefixes": [{"Prefix": f} for f in folders]}]
                return [{"Contents": [{"Key": k, "ETag": store.etag(k), "Size": len(store.objects[k])}
                                      for k in keys]}]

        return Paginator()


def memory_store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    """A fresh store, which the controller's and the agent's activities now reach instead of S3."""
    memory = MemoryStore()
    monkeypatch.setattr(checkpoint_store, "s3_client", lambda: memory)
    monkeypatch.setattr(checkpoint_transfers, "s3_client", lambda: memory)
    return memory
