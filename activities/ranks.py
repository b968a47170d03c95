"""Node-agent activities that touch rank processes: launch, watch, stop, inject faults.

Every activity is idempotent. Launches are fenced by attempt: the node records the newest attempt it has
seen for each run, kills ranks of older attempts before starting new ones, and refuses a late launch of an
older attempt, so ranks of attempt k never run beside attempt k+1.

The parts live by what they touch: processes and records (`activities.rank_records`), launch and stop
(`activities.rank_launch`), the watch (`activities.rank_watch`, its judgements pure in
`activities.progress`), and chaos (`activities.chaos`). `RankActivities` puts them together; the names the
agent, the tests and the benchmarks import from here stay here.
"""

from __future__ import annotations

from activities.chaos import RankChaos
from activities.rank_records import AttemptRecord, Downloader, RankProcess, Uploader, _read_finish, _read_report, \
    describe_exit
from activities.rank_watch import RankWatch

__all__ = ["AttemptRecord", "Downloader", "RankActivities", "RankProcess", "Uploader", "_read_finish",
           "_read_report", "describe_exit"]


class RankActivities(RankWatch, RankChaos):
    """Rank processes on one node. One instance per node agent."""
