"""Incident details and cordon reasons say the cause in one short line; the whole error stays in the
incident's log tail (issue 31, messages)."""

from __future__ import annotations

from pathlib import Path

import pytest

from activities.rank_watch import _log_fields
from trainguard.models import CAUSE_MAX_CHARS, short_cause

GLOO_TRACEBACK = """Traceback (most recent call last):
  File "/work/train.py", line 40, in <module>
    loss.backward()
RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500. Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:672 (most recent call first): """ + "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 " * 8


@pytest.mark.parametrize(("error", "expected"), [
    pytest.param(GLOO_TRACEBACK.splitlines()[-1], "RuntimeError: Connection closed by peer [127.0.0.1]:29500.",
                 id="gloo-first-sentence-no-source-location"),
    pytest.param("ValueError: loss is nan", "ValueError: loss is nan", id="short-kept"),
    pytest.param("\n  OSError: disk full\nmore lines", "OSError: disk full", id="first-non-empty-line"),
    pytest.param("trainguard: rank 1 passed checkpoint step 10 without run.save(10, ...): it can never commit. "
                 "Call run.save on every rank.",
                 "trainguard: rank 1 passed checkpoint step 10 without run.save(10, ...): it can never commit. "
                 "Call run.save on every rank.", id="trainguards-own-words-say-the-fix"),
])
def test_short_cause(error: str, expected: str) -> None:
    assert short_cause(error) == expected


def test_a_cause_with_no_sentence_end_is_cut_where_an_ellipsis_says() -> None:
    cut = short_cause("KeyError: " + "x" * 400)
    assert len(cut) == CAUSE_MAX_CHARS and cut.endswith("…")


def test_a_rank_exit_detail_is_one_short_line_and_its_tail_keeps_the_whole_error(tmp_path: Path) -> None:
    log = tmp_path / "rank-00001.log"
    log.write_text(GLOO_TRACEBACK + "\n")
    fields = _log_fields(log, 1, 1)
    assert fields["detail"] == "rank 1 exited with code 1: RuntimeError: Connection closed by peer [127.0.0.1]:29500."
    assert "frame #0" in str(fields["log_tail"]) and "pair.cc:534" in str(fields["log_tail"])
    reported = _log_fields(log, 1, 1, reported=GLOO_TRACEBACK.splitlines()[-1])  # the rank helper's excepthook
    assert reported["detail"] == fields["detail"]
