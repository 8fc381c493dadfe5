"""portal/periodic.py: the worker threads' loop (telemetry, the job reconciler), without a worker."""

from __future__ import annotations

import threading

from celery.signals import worker_shutdown

from portal.periodic import PeriodicThread, start_thread, stop_all


class Counting(PeriodicThread):
    """Fails its first step, then counts; sets `third` on the third step."""

    def __init__(self) -> None:
        super().__init__("counting", interval=0.01)
        self.steps = 0
        self.third = threading.Event()
        self.finished = threading.Event()

    def step(self) -> None:
        self.steps += 1
        if self.steps == 1:
            raise RuntimeError("the database is restarting")
        if self.steps == 3:
            self.third.set()

    def finish(self) -> None:
        self.finished.set()


def test_it_keeps_stepping_after_a_failed_step_and_logs_it(caplog):
    thread = Counting()
    start_thread(thread)
    try:
        assert thread.third.wait(timeout=10)
    finally:
        stop_all()
    assert "counting failed; retrying in 0.01s" in caplog.text
    assert "the database is restarting" in caplog.text  # with its traceback


def test_it_stops_every_thread_and_lets_each_finish():
    threads = [Counting(), Counting()]
    for thread in threads:
        start_thread(thread)
    for thread in threads:
        assert thread.third.wait(timeout=10)
    stop_all()
    assert all(t.finished.is_set() and not t.is_alive() for t in threads)


def test_it_stops_its_threads_when_the_worker_shuts_down():
    thread = Counting()
    start_thread(thread)
    assert thread.third.wait(timeout=10)
    worker_shutdown.send(sender=None)
    assert thread.finished.is_set() and not thread.is_alive()
