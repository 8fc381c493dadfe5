"""Periodic threads inside a Celery worker: the telemetry reporter and collector, the job reconciler.

Why threads rather than beat tasks: they run exactly while their worker does, cost no broker
message and no log lines every few seconds. The worker's shutdown stops every one that runs in its
process (`stop_all`, connected to Celery's `worker_shutdown` below): the interpreter's list of
live threads is the record, so no list of ours can keep a finished thread or miss a started one.
"""

from __future__ import annotations

import logging
import threading

from celery.signals import worker_shutdown
from django.db import connection

from portal.unreachable import WHAT, outage_of

log = logging.getLogger(__name__)


class PeriodicThread(threading.Thread):
    """Run `step` every `interval` seconds until stopped; a failed step is logged, not fatal."""

    def __init__(self, name: str, interval: float) -> None:
        super().__init__(name=name, daemon=True)
        self.interval = interval
        self.stopped = threading.Event()

    def step(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        away: str | None = None  # the service found away in the last step, said once per outage
        while not self.stopped.is_set():
            try:
                self.step()
                if away:
                    log.warning("%s: %s answers again", self.name, WHAT[away])
                away = None
            except Exception as exc:
                if (service := outage_of(exc)) is None:
                    log.exception("%s failed; retrying in %ss", self.name, self.interval)
                elif service != away:  # an outage is one line, not a traceback every interval
                    log.warning(
                        "%s: %s is away (%s); retrying every %ss",
                        self.name,
                        WHAT[service],
                        exc,
                        self.interval,
                    )
                away = service or away
            self.pause()
        self.finish()
        connection.close()  # this thread's own connection; the process may live on

    def pause(self) -> None:
        """Between steps; a thread that can be woken early waits its own way."""
        self.stopped.wait(self.interval)

    def finish(self) -> None:
        """Called once in the thread after the last step (close a backend, ...)."""

    def stop(self) -> None:
        self.stopped.set()


def start_thread(thread: PeriodicThread) -> None:
    thread.start()


def stop_all(timeout: float = 10) -> None:
    """Stop every periodic thread of this process and wait for each (its `finish` included):
    all asked first, so they wind down together."""
    running = [t for t in threading.enumerate() if isinstance(t, PeriodicThread)]
    for thread in running:
        thread.stop()
    for thread in running:
        thread.join(timeout=timeout)


@worker_shutdown.connect
def _stop_on_worker_shutdown(**kwargs: object) -> None:
    stop_all()
