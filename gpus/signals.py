"""Refuse a GPU host's worker whose simulated server does not exist
(gpus.backends.simulated_server_problem). Start the telemetry threads in the workers that need
them (see gpus/telemetry.py), and the idle-booking checker (gpus/idle.py) in the portal's own
worker, beside the collector: one of each for the whole portal. The usage rollup
(gpus/usage.py) is the collector's: it feeds it, and writes what it holds when the worker's
shutdown stops it.

The worker's shutdown stops them, with every other periodic thread (portal/periodic.py).
"""

from __future__ import annotations

import logging

from celery.signals import worker_init, worker_ready
from django.conf import settings

from gpus import idle, slurm_booking, telemetry
from gpus.backends import simulated_server_problem

log = logging.getLogger(__name__)


@worker_init.connect
def _check_simulated_server(sender, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """Before a GPU host's worker takes anything: the simulated server it would report exists.
    SystemExit, not an exception: Celery logs and swallows what a signal's receiver raises."""
    if f"host.{settings.WORKER_SERVER}" not in sender.app.amqp.queues.consume_from:
        return
    if problem := simulated_server_problem():
        log.critical("The worker of %s does not start: %s", settings.WORKER_SERVER, problem)
        raise SystemExit(f"The worker of {settings.WORKER_SERVER} does not start: {problem}")


@worker_ready.connect
def _start_threads(sender, **kwargs) -> None:  # type: ignore[no-untyped-def]
    queues = {q.name for q in sender.task_consumer.queues}
    own = f"host.{settings.WORKER_SERVER}"
    if own in queues:
        telemetry.start_reporter()
        if settings.GPU_BACKEND == "slurm":  # a Slurm cluster's worker: its bookings' reservations
            slurm_booking.start_reservation_sync(settings.WORKER_SERVER)
    elif any(q.startswith("host.") for q in queues):
        log.error("This worker consumes %s but WORKER_SERVER=%s: no telemetry sent", sorted(queues), own)
    if settings.CELERY_TASK_DEFAULT_QUEUE in queues:
        telemetry.start_collector()
        idle.start_checker()
