"""The peer tier: an agent serves its own finished shards, nothing else, only to a request with the pool's
token, and a fetch keeps only the exact bytes the manifest names."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from activities.models import ShardInfo
from activities.peers import PEER_TOKEN_ENV, ShardServer, fetch_from_peer, peer_token

RUN = "wf-1"
KEY = "runs/wf-1/step-00000050/rank-00001.pt"
TOKEN = "pool-token-0123456789abcdef"


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[ShardServer, bytes]]:
    body = bytes(range(256)) * 4096  # 1 MiB
    step = tmp_path / "agent" / "runs" / RUN / "checkpoints" / "step-00000050"
    step.mkdir(parents=True)
    (step / "rank-00001.pt").write_bytes(body)
    (step / "rank-00001.json").write_text(json.dumps({"rank": 1}))
    (step / "rank-00002.pt").write_bytes(b"half-written: no meta file yet")
    (tmp_path / "agent" / "secret.txt").write_text("not a shard")
    server = ShardServer(tmp_path / "agent", "127.0.0.1", TOKEN).start()
    yield server, body
    server.stop()


def _shard(body: bytes, key: str = KEY) -> ShardInfo:
    return ShardInfo(rank=1, key=key, size_bytes=len(body), sha256=hashlib.sha256(body).hexdigest(), node="node-1")


def test_a_finished_shard_is_fetched_and_verified(peer: tuple[ShardServer, bytes], tmp_path: Path) -> None:
    server, body = peer
    target = tmp_path / "restored.pt"
    assert fetch_from_peer(server.url, RUN, _shard(body), target, token=TOKEN) is None
    assert target.read_bytes() == body


def test_the_agents_own_token_is_what_a_fetch_sends(peer: tuple[ShardServer, bytes], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    server, body = peer
    monkeypatch.setenv(PEER_TOKEN_ENV, TOKEN)

    assert fetch_from_peer(server.url, RUN, _shard(body), tmp_path / "restored.pt") is None


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token-0123456789", f"Bearer {TOKEN}x",
                                           f"Basic {TOKEN}", TOKEN, f"bearer {TOKEN[:-1]}"])
def test_a_request_without_the_pools_token_gets_nothing(peer: tuple[ShardServer, bytes],
                                                         authorization: str | None) -> None:
    server, body = peer
    headers = {"Authorization": authorization} if authorization else {}
    request = urllib.request.Request(server.url + "/runs/wf-1/step-00000050/rank-00001.pt", headers=headers)

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)

    assert refused.value.code == 401
    assert body[:64] not in refused.value.read()


def test_a_fetch_with_another_pools_token_is_refused_and_keeps_nothing(peer: tuple[ShardServer, bytes],
                                                                       tmp_path: Path) -> None:
    server, body = peer
    target = tmp_path / "restored.pt"

    problem = fetch_from_peer(server.url, RUN, _shard(body), target, token="another-pool-token-0123")

    assert problem is not None and "401" in problem
    assert not target.exists()


def test_an_agent_without_a_token_asks_no_peer(peer: tuple[ShardServer, bytes], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    server, body = peer
    monkeypatch.delenv(PEER_TOKEN_ENV, raising=False)

    problem = fetch_from_peer(server.url, RUN, _shard(body), tmp_path / "restored.pt")

    assert problem is not None and PEER_TOKEN_ENV in problem


def test_a_server_without_a_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="token"):
        ShardServer(tmp_path, "127.0.0.1", "")


def test_a_short_token_is_refused() -> None:
    assert peer_token({}) is None
    assert peer_token({PEER_TOKEN_ENV: TOKEN}) == TOKEN
    with pytest.raises(ValueError, match="fewer than 16"):
        peer_token({PEER_TOKEN_ENV: "short"})


def test_bytes_that_differ_from_the_manifest_are_not_kept(peer: tuple[ShardServer, bytes], tmp_path: Path) -> None:
    server, body = peer
    target = tmp_path / "restored.pt"
    wrong = _shard(body).model_copy(update={"sha256": "0" * 64})
    problem = fetch_from_peer(server.url, RUN, wrong, target, token=TOKEN)
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
        request = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {TOKEN}"})
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 404


def test_an_unreachable_peer_is_a_reason_not_an_error(tmp_path: Path) -> None:
    body = b"x" * 10
    problem = fetch_from_peer("http://127.0.0.1:9", RUN, _shard(body), tmp_path / "restored.pt", token=TOKEN)
    assert problem is not None and not (tmp_path / "restored.pt").exists()


# ------------------------------------------------------------------- what a connection can hold before its token


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (EOF or reset) within `seconds`, reading whatever it sends first."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset
        return True
    return True


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_idle_connections_are_capped_and_closed_after_the_timeout_and_a_request_is_still_served(
        tmp_path: Path) -> None:
    """The finding: idle sockets without a token held a thread and a descriptor each, forever, until the
    agent ran out of descriptors (EMFILE) and its launches cordoned the node."""
    body = b"shard bytes"
    step = tmp_path / "agent" / "runs" / RUN / "checkpoints" / "step-00000050"
    step.mkdir(parents=True)
    (step / "rank-00001.pt").write_bytes(body)
    (step / "rank-00001.json").write_text("{}")
    threads_before, fds_before = threading.active_count(), _open_fds()
    server = ShardServer(tmp_path / "agent", "127.0.0.1", TOKEN, request_timeout_s=1.0, max_connections=8).start()
    host, port = server.url.removeprefix("http://").split(":")
    try:
        idle = [socket.create_connection((host, int(port))) for _ in range(8)]
        trickle = idle[0]
        _wait_for(lambda: server.open_connections == 8)  # every idle one accepted, holding a slot
        excess = [socket.create_connection((host, int(port))) for _ in range(20)]
        started = time.monotonic()
        assert all(_closed_within(s, 0.5) for s in excess)  # refused at once, not after the timeout
        assert time.monotonic() - started < 0.9
        trickle.sendall(b"GET /runs/")  # bytes now and then do not extend the request's deadline
        time.sleep(0.4)
        trickle.sendall(b"wf-1/")
        assert all(_closed_within(s, 2.0) for s in idle)  # closed by the deadline, not by the client
        assert time.monotonic() - started < 2.5

        target = tmp_path / "restored.pt"
        assert fetch_from_peer(server.url, RUN, _shard(body), target, token=TOKEN) is None
        assert target.read_bytes() == body
        for sock in [*idle, *excess]:
            sock.close()
        _wait_for(lambda: server.open_connections == 0)
        # The server's own thread; no handler left (a closed handler's thread may take a moment to end under load)
        _wait_for(lambda: threading.active_count() <= threads_before + 1)
        assert _open_fds() <= fds_before + 1  # its listening socket
    finally:
        server.stop()


def test_a_request_without_the_token_is_answered_before_the_path_is_looked_at(
        peer: tuple[ShardServer, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    server, _ = peer
    looked: list[str] = []
    monkeypatch.setattr(Path, "is_file", lambda self: looked.append(str(self)) or True)
    request = urllib.request.Request(server.url + "/runs/wf-1/step-00000050/rank-00001.pt")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401 and looked == []
