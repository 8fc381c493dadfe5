"""The telemetry loop: a daemon thread inside each GPU host's Celery worker.

Why a thread in the worker rather than beat or a second process: the host reports
exactly while its worker is alive, so "online" on the dashboard means "can run jobs
now"; no beat schedule has to fan out to every host, and a dead worker goes offline
by itself once `last_seen` ages past SERVER_OFFLINE_AFTER_SECONDS.
"""

from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import close_old_connections

from gpus.backends import get_backend
from gpus.inventory import Backend
from gpus.services import server_report_ingest

log = logging.getLogger(__name__)


class TelemetryReporter(threading.Thread):
    def __init__(self, backend: Backend, interval: float | None = None) -> None:
        super().__init__(name="gpu-telemetry", daemon=True)
        self.backend = backend
        self.interval = interval or settings.TELEMETRY_INTERVAL_SECONDS
        self.stopped = threading.Event()

    def report_once(self) -> None:
        close_old_connections()  # a restarted database must not kill the loop
        server_report_ingest(snapshot=self.backend.snapshot())

    def run(self) -> None:
        log.info("Telemetry for %s every %ss", settings.WORKER_SERVER, self.interval)
        while not self.stopped.is_set():
            try:
                self.report_once()
            except Exception:  # noqa: BLE001 - one bad round must not stop the reports
                log.exception("Telemetry round failed; retrying in %ss", self.interval)
            self.stopped.wait(self.interval)
        self.backend.close()

    def stop(self) -> None:
        self.stopped.set()


_reporter: TelemetryReporter | None = None


def start_reporter() -> TelemetryReporter:
    global _reporter
    if _reporter is None or not _reporter.is_alive():
        _reporter = TelemetryReporter(get_backend())
        _reporter.start()
    return _reporter


def stop_reporter() -> None:
    if _reporter is not None:
        _reporter.stop()
        _reporter.join(timeout=10)
