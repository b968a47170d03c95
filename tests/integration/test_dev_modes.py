"""One `TRAINGUARD_HOME`, the dev stack brought up in each mode in turn (loopback, hosts, TLS): every time its
store accepts a checkpoint-sized multipart upload and still holds what the modes before it wrote.

Hosts mode is skipped, with the reason, where network namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import io
import shutil
import uuid
import boto3
import pytest
from boto3.s3.transfer import TransferConfig

from infra.harness import PrivateStack
from trainguard.devstack import DevStack
from trainguard.hosts import unavailable_reason

from .conftest import REPO

pytestmark = pytest.mark.integration

PART_BYTES = 5 << 20
CHECKPOINT_BYTES = 3 * PART_BYTES
"""A shard of a few parts: the upload goes through the store's volume server, not the filer's inline store."""


def _upload(dev: DevStack, key: str) -> list[str]:
    creds = dev.credentials()
    s3 = boto3.client("s3", endpoint_url=dev.config.s3_endpoint, region_name="us-east-1",
                      aws_access_key_id=creds["access_key"], aws_secret_access_key=creds["secret_key"])
    s3.upload_fileobj(io.BytesIO(b"x" * CHECKPOINT_BYTES), "trainguard", key,
                      Config=TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES))
    listed = s3.list_objects_v2(Bucket="trainguard", Prefix="modes/").get("Contents", [])
    return sorted(o["Key"] for o in listed if o["Size"] == CHECKPOINT_BYTES)


@pytest.mark.slow  # ~45 s: four stack restarts
def test_the_store_accepts_uploads_after_every_change_of_mode_on_one_home() -> None:
    """`weed mini` kept the address of the mode before in its saved options: after `dev up --hosts` on a home
    first used in loopback mode, every upload failed with InternalError and no checkpoint ever committed."""
    home = REPO / ".pytest-stack" / f"modes-{uuid.uuid4().hex[:8]}"
    modes = [("loopback", {}), ("hosts", {"hosts": True}), ("tls", {"tls": True}), ("loopback again", {})]
    if unavailable_reason() is not None:
        modes = [m for m in modes if m[0] != "hosts"]
    written: list[str] = []
    try:
        for name, flags in modes:
            private = PrivateStack(home, ("node-0",), 27700, keep_home=True, **flags)
            with private as dev:
                key = f"modes/{name.replace(' ', '-')}.bin"
                written.append(key)
                assert _upload(dev, key) == sorted(written), f"after bringing the stack up in {name} mode"
            assert not private.leftovers, f"processes survived dev down in {name} mode: {private.leftovers}"
    finally:
        shutil.rmtree(home, ignore_errors=True)
