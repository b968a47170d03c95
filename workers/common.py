"""What both workers share: logging, signal handling, worker tuning."""

from __future__ import annotations

import asyncio
import logging
import signal
from datetime import timedelta

STICKY_SCHEDULE_TO_START = timedelta(seconds=2)
"""A killed worker's workflow tasks wait this long on its sticky queue before another worker takes them
(the SDK default of 10 s would add 10 s to every controller crash)."""

GRACEFUL_SHUTDOWN = timedelta(seconds=5)


def setup_logging(component: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s",
    )
    logging.getLogger("temporalio").setLevel(logging.WARNING)
    logging.getLogger("botocore").setLevel(logging.WARNING)


def stop_event() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT, so workers drain and clean up instead of dying mid-task."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event
