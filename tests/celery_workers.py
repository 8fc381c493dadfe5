"""Real `celery -A portal worker` processes for the tests (the `start_worker` fixture).

Each test gets workers of its own, started for it: a worker's memory is part of what a test
relies on (the collector's usage rollup, the scheduler's fair-share memory, the reconciler's
start-up grace, the watchdog's open violations, the simulated backend's invented processes), and
a worker kept from an earlier test carries them, with ids and names of rows that test's flush
deleted. Tried and measured (issue 33): workers parked between tests with SIGSTOP leaked a
telemetry report into the next test's empty database, cancelled its running job with their
shutdown, and took its messages. A new worker is forked from a pre-imported Python
(tests/forkserver.py): 0.3-0.4 s of CPU to `ready`, against 0.8-0.9 s for an interpreter of
its own.

What used to cost more is the end: the warm shutdown (SIGTERM, the worker winds its threads
down, 1.5–6 s). After the test:

- a worker running something of the test's (a job or a lab: a child process) still gets it,
  so its job is stopped and recorded as the worker's shutdown says;
- an idle worker is SIGKILLed through its handle: it has nothing to stop, its database
  transaction (if one was open) dies with its connection, and nothing of it survives the test.

Before the workers start, the test process's Redis keys are emptied (but kombu's bindings): what
earlier tests left there (a notification's mail message, the queue's holds) is not the new
worker's to run.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil
from django.conf import settings
from django.db import connection

from portal.env import database_url
from portal.names import redis_key
from portal.processes import die_with_parent
from portal.workers import worker_argv
from tests.forkserver import Forked, ForkServer
from tests.isolation import OUTPUT, ROOT, SIMULATED_PROCESSES_FILE

STOP_GRACE_SECONDS = 15.0


@dataclass(eq=False)
class Worker:
    queue: str
    proc: Forked
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


# A program no PATH holds: the worker's containers check then finds no Podman, as on such a host.
NO_PODMAN = "podman-not-on-this-test-host"


class StartWorker:
    """`start_worker("name")` is a GPU host's worker for a simulated server (queue host.name);
    `start_worker(None)` is the portal's own worker (queue `portal`), which runs the collector.
    Both return the worker's handle (as much of a Popen as the tests use: tests/forkserver.py);
    `start_worker.log(...)` is what it printed."""

    started = 0  # this test process's workers so far: each its own log file

    def __init__(self) -> None:
        self.workers: list[Worker] = []
        redis_forget()
        SIMULATED_PROCESSES_FILE.unlink(missing_ok=True)

    def __call__(
        self, server: str | None, *, extra_env: dict[str, str] | None = None, containers: bool = False
    ) -> Forked:
        """`containers`: the host's Podman is asked at the start, as on a host that has one (the
        container tier's tests); otherwise the worker is a host without Podman, whose start asks
        nothing (`podman info` and `podman ps` cost 0.5 s of CPU a start, and a worker SIGKILLed
        meanwhile left them running outside the test's handle)."""
        queue, node = (f"host.{server}", server) if server else ("portal", "portal")
        env = {
            **os.environ,
            "DATABASE_URL": database_url(connection.settings_dict),
            "GPU_BACKEND": "simulated",
            "WORKER_SERVER": server or "portal-host",
            "TELEMETRY_INTERVAL_SECONDS": "1",
            # This test process's own (tests/isolation.py), emptied before each worker test.
            "SIMULATED_PROCESSES_FILE": str(SIMULATED_PROCESSES_FILE),
            **({} if containers else {"CONTAINER_PODMAN": NO_PODMAN}),
            **(extra_env or {}),
        }
        StartWorker.started += 1
        log_path = OUTPUT / f"worker-{node}-{StartWorker.started}.log"
        with open(log_path, "wb") as log:
            argv = worker_argv(queue, f"{node}@test", pool="solo")
            proc = fork_server().spawn(argv, env=env, cwd=ROOT, log=log)
        self.workers.append(Worker(queue, proc, log_path))
        return proc

    def log(self, which: Forked | str | None) -> str:
        """A worker's output: by its handle, or its server (None: the portal's); the last started."""
        queue = "portal" if which is None else f"host.{which}" if isinstance(which, str) else None
        return next(w for w in reversed(self.workers) if w.proc is which or w.queue == queue).log()

    def stop(self) -> None:
        """After the test: idle workers SIGKILLed, busy ones their warm shutdown; all reaped."""
        running = [w.proc for w in self.workers if w.proc.poll() is None]
        for proc in running:
            if _busy(proc):
                proc.terminate()
            else:
                proc.kill()
        for proc in running:  # the others were reaped by poll()
            try:
                proc.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _busy(proc: Forked) -> bool:
    """Running a job or a lab: the worker's process has children (a solo pool runs no others).
    The fork server may reap the worker at any moment, so the pid counts only if the handle
    still says it runs after the look: then it was this worker's throughout."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    return bool(children) and proc.poll() is None


_server: ForkServer | None = None


def fork_server() -> ForkServer:
    """This test process's fork server, started at its first worker."""
    global _server
    if _server is not None and not _server.usable():  # ended (a crash, given up on): a new one
        _server.close()
        _server = None
    if _server is None:
        # A test process that dies (a crashed xdist worker, a SIGKILL) leaves no worker consuming
        # its queues: the server dies with it, its workers with the server, and their jobs in turn.
        tied = die_with_parent(signal.SIGKILL)
        _server = ForkServer(cwd=ROOT, log=OUTPUT / "forkserver.log", preexec_fn=tied)
    return _server


def fork_server_close() -> None:
    """The session's end (tests/conftest.py)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


def redis_forget() -> None:
    """This test process's Redis keys gone (its PORTAL_INSTANCE_ID's), but kombu's bindings: the
    test process's own Celery producer declared its queues once and publishes through them."""
    import redis

    with redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5) as client:
        names = [
            name
            for name in client.scan_iter(match=redis_key("*"), count=1000)
            if b"_kombu.binding" not in name
        ]
        for start in range(0, len(names), 500):
            client.delete(*names[start : start + 500])
