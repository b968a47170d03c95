"""Run ids: one that would wedge a run or reach into another run's folder is refused where the run starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard import cli
from trainguard.ids import MAX_WORKFLOW_ID_BYTES, validate_workflow_id

REFUSED = [
    pytest.param("", "is empty", id="empty"),
    pytest.param("..", "'..'", id="dotdot"),
    pytest.param("run..1", "'..'", id="dotdot-inside"),
    pytest.param("../other-run", "'/'", id="dotdot-slash"),
    pytest.param(".", "'.'", id="dot"),
    pytest.param("/X", "'/'", id="leading-slash"),
    pytest.param("a/b", "'/'", id="slash-inside"),
    pytest.param("run-1\n", "U+000A", id="trailing-newline"),
    pytest.param("run\x00", "U+0000", id="nul"),
    pytest.param("run\t1", "U+0009", id="tab"),
    pytest.param("run\x1b[31m", "U+001B", id="escape"),
    pytest.param("run\x7f", "U+007F", id="delete"),
    pytest.param("run\u202egnp", "U+202E", id="bidi-override"),
    pytest.param("run\u200b", "U+200B", id="zero-width-space"),
    pytest.param("run\u2028", "U+2028", id="line-separator"),
    pytest.param("run\ud800", "U+D800", id="lone-surrogate"),
    pytest.param("x" * (MAX_WORKFLOW_ID_BYTES + 1), "256 bytes", id="too-long"),
    pytest.param("é" * 128, "256 bytes", id="too-long-in-utf8"),
]


@pytest.mark.parametrize(("workflow_id", "fragment"), REFUSED)
def test_a_run_id_that_cannot_name_a_folder_is_refused(workflow_id: str, fragment: str) -> None:
    with pytest.raises(ValueError) as caught:
        validate_workflow_id(workflow_id)

    message = str(caught.value)
    assert message.startswith("run id ") and fragment in message and "choose an id" in message


@pytest.mark.parametrize("workflow_id", ["run-1", "quickstart-20261201-120000", "a", "my.run_2", "x.y.z",
                                         "x" * MAX_WORKFLOW_ID_BYTES, "é" * 127, "Run 1", "entraînement"])
def test_a_plain_run_id_is_kept_as_given(workflow_id: str) -> None:
    assert validate_workflow_id(workflow_id) == workflow_id


def test_a_long_refused_id_is_shortened_in_the_message() -> None:
    with pytest.raises(ValueError) as caught:
        validate_workflow_id("/" + "x" * 10_000)

    assert len(str(caught.value)) < 400


@pytest.mark.parametrize("workflow_id", ["../victim", "/X", "run..1", "run\n"])
def test_run_start_refuses_a_bad_id_before_connecting(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch, workflow_id: str) -> None:
    from trainguard.client import TrainguardClient

    async def no_server(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("connected to Temporal for a run id that cannot name a run")

    monkeypatch.setattr(TrainguardClient, "connect", no_server)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"entrypoint": ["python", "train.py"], "nodes": ["node-0"]}))

    code = cli.main(["run", "start", str(path), "--id", workflow_id])

    assert code == 2
    assert capsys.readouterr().err.startswith("trainguard run start --id: run id ")


async def test_the_client_refuses_a_bad_id_before_starting_anything() -> None:
    from trainguard.client import TrainguardClient

    class NoTemporal:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"touched Temporal ({name}) for a run id that cannot name a run")

    client = TrainguardClient(NoTemporal())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'/'"):
        await client.start_run({"entrypoint": ["python"], "nodes": ["node-0"]}, workflow_id="/X")
