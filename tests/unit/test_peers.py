"""The peer tier: an agent serves its own finished shards, nothing else, and a fetch keeps only the exact
bytes the manifest names."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from activities.models import ShardInfo
from activities.peers import ShardServer, fetch_from_peer

RUN = "wf-1"
KEY = "runs/wf-1/step-00000050/rank-00001.pt"


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[ShardServer, bytes]]:
    body = bytes(range(256)) * 4096  # 1 MiB
    step = tmp_path / "agent" / "runs" / RUN / "checkpoints" / "step-00000050"
    step.mkdir(parents=True)
    (step / "rank-00001.pt").write_bytes(body)
    (step / "rank-00001.json").write_text(json.dumps({"rank": 1}))
    (step / "rank-00002.pt").write_bytes(b"half-written: no meta file yet")
    (tmp_path / "agent" / "secret.txt").write_text("not a shard")
    server = ShardServer(tmp_path / "agent", "127.0.0.1").start()
    yield server, body
    server.stop()


def _shard(body: bytes, key: str = KEY) -> ShardInfo:
    return ShardInfo(rank=1, key=key, size_bytes=len(body), sha256=hashlib.sha256(body).hexdigest(), node="node-1")


def test_a_finished_shard_is_fetched_and_verified(peer: tuple[ShardServer, bytes], tmp_path: Path) -> None:
    server, body = peer
    target = tmp_path / "restored.pt"
    assert fetch_from_peer(server.url, RUN, _shard(body), target) is None
    assert target.read_bytes() == body


def test_bytes_that_differ_from_the_manifest_are_not_kept(peer: tuple[ShardServer, bytes], tmp_path: Path) -> None:
    server, body = peer
    target = tmp_path / "restored.pt"
    wrong = _shard(body).model_copy(update={"sha256": "0" * 64})
    problem = fetch_from_peer(server.url, RUN, wrong, target)
    assert problem is not None and "manifest says" in problem
    assert not target.exists()


@pytest.mark.parametrize("path", [
    "/runs/wf-1/step-00000050/rank-00002.pt",     # still being written (no meta file)
    "/runs/wf-1/step-00000050/rank-00003.pt",     # not there
    "/runs/../secret.txt",                         # outside the checkpoint folders
    "/runs/wf-1/step-00000050/../../../../secret.txt",
    "/runs/../step-00000050/rank-00001.pt",
    "/secret.txt",
])
def test_nothing_but_finished_shards_is_served(peer: tuple[ShardServer, bytes], path: str) -> None:
    server, _ = peer
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(server.url + path, timeout=5)  # noqa: S310
    assert refused.value.code == 404


def test_an_unreachable_peer_is_a_reason_not_an_error(tmp_path: Path) -> None:
    body = b"x" * 10
    problem = fetch_from_peer("http://127.0.0.1:9", RUN, _shard(body), tmp_path / "restored.pt")
    assert problem is not None and not (tmp_path / "restored.pt").exists()
