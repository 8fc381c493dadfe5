"""Start the telemetry loop in a worker that serves this host's queue."""

from __future__ import annotations

import logging

from celery.signals import worker_ready, worker_shutdown
from django.conf import settings

log = logging.getLogger(__name__)


@worker_ready.connect
def _start_telemetry(sender, **kwargs) -> None:  # type: ignore[no-untyped-def]
    queues = {q.name for q in sender.task_consumer.queues}
    own = f"host.{settings.WORKER_SERVER}"
    if own not in queues:
        if any(q.startswith("host.") for q in queues):
            log.error("This worker consumes %s but WORKER_SERVER=%s: no telemetry sent", sorted(queues), own)
        return
    from gpus.telemetry import start_reporter

    start_reporter()


@worker_shutdown.connect
def _stop_telemetry(**kwargs) -> None:  # type: ignore[no-untyped-def]
    from gpus.telemetry import stop_reporter

    stop_reporter()
