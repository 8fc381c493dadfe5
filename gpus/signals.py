"""Start the telemetry threads in the workers that need them (see gpus/telemetry.py), and the
idle-booking checker (gpus/idle.py) in the portal's own worker, beside the collector: one of
each for the whole portal. The usage rollup (gpus/usage.py) lives in the collector's process too,
and writes what it holds when that worker shuts down.

The worker's shutdown stops them, with every other periodic thread (portal/periodic.py).
"""

from __future__ import annotations

import logging

from celery.signals import worker_ready, worker_shutdown
from django.conf import settings
from django.db import connection

from gpus import idle, telemetry, usage

log = logging.getLogger(__name__)


@worker_ready.connect
def _start_threads(sender, **kwargs) -> None:  # type: ignore[no-untyped-def]
    queues = {q.name for q in sender.task_consumer.queues}
    own = f"host.{settings.WORKER_SERVER}"
    if own in queues:
        telemetry.start_reporter()
    elif any(q.startswith("host.") for q in queues):
        log.error("This worker consumes %s but WORKER_SERVER=%s: no telemetry sent", sorted(queues), own)
    if settings.CELERY_TASK_DEFAULT_QUEUE in queues:
        usage.start_rollup()  # before the collector's first round
        telemetry.start_collector()
        idle.start_checker()


@worker_shutdown.connect
def _flush_usage(**kwargs) -> None:  # type: ignore[no-untyped-def]
    """Only where a rollup runs (the collector's worker): the last minute's figures, not lost.
    On a fresh connection: the one this thread had may have died with a database restart."""
    connection.close()
    try:
        usage.usage_flush()
    except Exception:
        log.exception("Usage rollup: the last flush failed; up to a minute of figures is lost")
