"""The CLI, the client and the examples find the dev stack's store and keys as they find its Temporal (issue 31
item 7): `trainguard run report` on the dev stack reads hang stacks with nothing exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard import settings as settings_mod
from trainguard.devstack import STACK_FILE
from trainguard.settings import Settings, s3_client

ENDPOINT = "http://127.0.0.1:28333"


def make_stack(home: Path, endpoint: str = ENDPOINT) -> None:
    """What `trainguard dev up` leaves under its home: the stack file and the store's keys."""
    home.mkdir(parents=True, exist_ok=True)
    (home / STACK_FILE).write_text(json.dumps({"temporal_address": "127.0.0.1:27233", "ui_url": "http://x",
                                               "s3_endpoint": endpoint}))
    (home / "s3-credentials.json").write_text(json.dumps({"access_key": "tgdevkey", "secret_key": "devsecret"}))


@pytest.mark.parametrize(("extra_env", "endpoint", "keys", "source"), [
    ({}, ENDPOINT, ("tgdevkey", "devsecret"), "written by `trainguard dev up`"),
    # the environment's endpoint wins, and the stack's keys are not offered to another store
    ({"TRAINGUARD_S3_ENDPOINT": "https://s3.example.com"}, "https://s3.example.com", None, "TRAINGUARD_S3_ENDPOINT"),
    ({"AWS_ENDPOINT_URL": "https://minio.local"}, "https://minio.local", None, "AWS_ENDPOINT_URL"),
    # the stack's endpoint named explicitly still gets the stack's keys
    ({"TRAINGUARD_S3_ENDPOINT": ENDPOINT}, ENDPOINT, ("tgdevkey", "devsecret"), "TRAINGUARD_S3_ENDPOINT"),
    # keys in the environment are the user's choice: boto3's chain reads them
    ({"AWS_ACCESS_KEY_ID": "mine", "AWS_SECRET_ACCESS_KEY": "s"}, ENDPOINT, None, "written by `trainguard dev up`"),
])
def test_store_found_like_temporal(tmp_path: Path, extra_env: dict[str, str], endpoint: str,
                                   keys: tuple[str, str] | None, source: str) -> None:
    make_stack(tmp_path / "home")
    found = Settings.from_env({"TRAINGUARD_HOME": str(tmp_path / "home"), **extra_env})

    assert (found.s3_endpoint, found.s3_keys) == (endpoint, keys)
    assert source in found.s3_source


def test_port_base_names_the_store_and_the_home_its_keys(tmp_path: Path) -> None:
    make_stack(tmp_path / "home", endpoint="unused")
    found = Settings.from_env({"TRAINGUARD_PORT_BASE": "20000", "TRAINGUARD_HOME": str(tmp_path / "home")})

    assert found.temporal_address == "127.0.0.1:20000"
    assert found.s3_endpoint is not None and found.s3_endpoint.startswith("http://127.0.0.1:")
    assert found.s3_endpoint != "unused"
    assert found.s3_keys == ("tgdevkey", "devsecret")


def test_no_stack_means_aws_itself_and_its_chain(tmp_path: Path) -> None:
    found = Settings.from_env({"TRAINGUARD_HOME": str(tmp_path / "none")})

    assert (found.s3_endpoint, found.s3_keys) == (None, None)


def test_a_stack_without_keys_leaves_boto3_its_chain(tmp_path: Path) -> None:
    make_stack(tmp_path / "home")
    (tmp_path / "home" / "s3-credentials.json").unlink()

    assert Settings.from_env({"TRAINGUARD_HOME": str(tmp_path / "home")}).s3_keys is None


def test_keys_never_in_repr(tmp_path: Path) -> None:
    make_stack(tmp_path / "home")

    assert "devsecret" not in repr(Settings.from_env({"TRAINGUARD_HOME": str(tmp_path / "home")}))


def test_cli_s3_client_uses_the_stack_with_nothing_exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `run report` calls (`s3_client()` with the process's environment) signs with the stack's keys."""
    make_stack(tmp_path / "home")
    for name in ("TRAINGUARD_S3_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_SESSION_TOKEN", "TRAINGUARD_PORT_BASE", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(settings_mod, "_held", {})

    client = s3_client()

    assert client.meta.endpoint_url == ENDPOINT
    credentials = client._request_signer._credentials  # what boto3 signs with
    assert (credentials.access_key, credentials.secret_key) == ("tgdevkey", "devsecret")
