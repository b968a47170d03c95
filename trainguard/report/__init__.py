"""Where a run's wall time went: a goodput breakdown read from the run's Temporal history.

```
trainguard run report my-run [--png my-run.png]
```

Everything comes from the history (every run of the chain when the workflow continued as new) and the
run's result (or its `status` query while it still runs); nothing is measured twice:

- phases, from activity timestamps: `reserving` (start to the first restore), `restoring`
  (`find_checkpoint`, `download_shards`), `launching` (`launch_ranks`, or `rejoin_ranks` for an in-process
  restart, to the attempt's first training step, which the watch events carry: imports, rendezvous, loading
  the shards or taking a live peer's state), `running` (first step to an
  incident's detection or to the end of training), `recovering` (detection, `stop_ranks`, the policy's
  decision, up to the next restore), `paused` (waiting for an operator), `finishing` (the last step to the
  workflow's close: final commit, retention, releasing the nodes). They tile the wall time.
- time lost per incident: `detection_s + recovery_s + redone steps x mean step time`, where the redone steps
  are the steps trained between the checkpoint the next attempt resumed from and the detection.
- goodput: the result's useful training time (`RunResult.useful_s`: each attempt's kept steps at its own step
  time) over the wall time; for a run without one (older, or not completed), steps x mean step time.

The pure part (`spans_from_events`, `compute_report`) takes history events or simplified spans and is
unit-tested with fabricated histories; `build_report` fetches a real one.

The package: `model` (the dataclasses), `decode` (history -> spans, fetching), `compute` (spans -> report,
pure), `render` (table, PNG, the CLI entry).
"""

from trainguard.report.compute import (
    build_report,
    compute_report,
    report_from_histories,
)
from trainguard.report.decode import (
    decode_events,
    fetch_chain,
    spans_from_events,
)
from trainguard.report.model import (
    PHASE_COLORS,
    PHASES,
    IncidentLoss,
    RunHistory,
    RunReport,
    Segment,
    Span,
    StepPoint,
)
from trainguard.report.render import (
    LOG_LINES_SHOWN,
    MATPLOTLIB_HINT,
    main_report,
    pyplot,
    read_store_texts,
    render_png,
    render_stacks,
    render_table,
)

__all__ = [
    "LOG_LINES_SHOWN", "MATPLOTLIB_HINT", "PHASES", "PHASE_COLORS", "IncidentLoss", "RunHistory", "RunReport",
    "Segment", "Span", "StepPoint", "build_report", "compute_report", "decode_events", "fetch_chain",
    "main_report", "pyplot", "read_store_texts", "render_png", "render_stacks", "render_table",
    "report_from_histories", "spans_from_events",
]
