"""Real `celery -A portal worker` processes kept for the whole test session (one pool per test
process), each handed to one test at a time.

Starting a worker costs seconds (Python, Django, Celery) and so does its warm shutdown; most
worker tests start the same two (the portal's, a simulated host's) with the same settings. A
worker is keyed by its server and the environment a test gives it. After a test:

- a worker that exited (a test killed it, or it refused to start) is reaped and forgotten;
- a worker still running something of the test's (a job or a lab: a child process) gets the
  warm shutdown it always got (SIGTERM, then SIGKILL 15 s later);
- an idle worker is *parked*: stopped with SIGSTOP at a moment it holds no database lock and no
  open transaction (proved, not hoped: SQLite's write lock is free, PostgreSQL shows each of its
  connections `idle`), so the test database can be emptied under it and no thread of it sees
  another test's rows. The next test asking for the same worker gets it back with SIGCONT.

What a parked worker finds when it goes on is what a fresh one would find: the database emptied
(pytest-django), its instance's Redis keys gone (queues, telemetry, wake-ups: every key but
kombu's bindings, which a running worker declared once and needs), the simulated processes file
empty. Only one worker per queue runs at a time: taking a worker ends any other of that queue, so
a parked one never holds a Redis BRPOP that takes another's message.

Every process is ended by its own Popen handle: at the end of the session, before the test
database is dropped (PostgreSQL refuses to drop a database with connections).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from django.conf import settings
from django.db import connection

from portal.env import database_url
from portal.processes import die_with_parent
from portal.workers import worker_argv
from tests.isolation import OUTPUT, ROOT, SIMULATED_PROCESSES_FILE

PARK_TRIES_SECONDS = 10.0
STOP_GRACE_SECONDS = 15.0


@dataclass(eq=False)
class Worker:
    key: tuple
    queue: str
    proc: subprocess.Popen
    log_path: Path
    log_offset: int = 0  # where the current test's lines start in log_path
    parked: bool = False

    def log(self) -> str:
        """What the worker printed since the current test took it."""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")


@dataclass
class WorkerPool:
    """The session's workers; `take` and `give_back` around each test (tests/conftest.py)."""

    workers: list[Worker] = field(default_factory=list)
    started: int = 0

    def take(self, server: str | None, extra_env: dict[str, str] | None) -> Worker:
        queue, node = (f"host.{server}", server) if server else ("portal", "portal")
        key = (queue, tuple(sorted((extra_env or {}).items())))
        for worker in self.workers:
            if worker.queue == queue and worker.key != key and worker.parked:
                self._end(worker)  # one worker per queue: a parked one must not take its messages
        self.workers = [w for w in self.workers if w.proc.poll() is None]
        for worker in self.workers:
            if worker.key == key and worker.parked:
                worker.log_offset = worker.log_path.stat().st_size
                worker.proc.send_signal(signal.SIGCONT)
                worker.parked = False
                return worker
        return self._start(key, queue, node, server, extra_env or {})

    def _start(
        self, key: tuple, queue: str, node: str, server: str | None, extra_env: dict[str, str]
    ) -> Worker:
        env = {
            **os.environ,
            "DATABASE_URL": database_url(connection.settings_dict),
            "GPU_BACKEND": "simulated",
            "WORKER_SERVER": server or "portal-host",
            "TELEMETRY_INTERVAL_SECONDS": "1",
            # This test process's own (tests/isolation.py): emptied between tests.
            "SIMULATED_PROCESSES_FILE": str(SIMULATED_PROCESSES_FILE),
            **extra_env,
        }
        self.started += 1
        log_path = OUTPUT / f"worker-{node}-{self.started}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                worker_argv(queue, f"{node}@test", pool="solo"),
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                # A test process that dies (a crashed xdist worker, a SIGKILL) leaves no worker
                # consuming its queues: its jobs die with it in turn (their own PDEATHSIG).
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        worker = Worker(key, queue, proc, log_path)
        self.workers.append(worker)
        return worker

    def give_back(self, taken: list[Worker]) -> None:
        """After a test: park each idle worker it took, end the others; then empty what a parked
        worker would otherwise find of that test's (Redis keys, declared processes)."""
        for worker in taken:
            if worker.proc.poll() is not None:
                worker.proc.wait()
            elif worker.parked:
                continue
            elif _busy(worker.proc) or not self._park(worker):
                self._end(worker)
        self.workers = [w for w in self.workers if w.proc.poll() is None]
        _redis_forget()
        SIMULATED_PROCESSES_FILE.unlink(missing_ok=True)

    def _park(self, worker: Worker) -> bool:
        """SIGSTOP at a moment the worker holds nothing in the database; False if none came."""
        deadline = time.monotonic() + PARK_TRIES_SECONDS
        while time.monotonic() < deadline:
            worker.proc.send_signal(signal.SIGSTOP)
            _wait_stopped(worker.proc)
            if _holds_nothing(worker.proc):
                worker.parked = True
                return True
            worker.proc.send_signal(signal.SIGCONT)
            time.sleep(0.05)
        return False

    def _end(self, worker: Worker) -> None:
        """The warm shutdown a worker always got: SIGTERM (after SIGCONT if parked), SIGKILL later."""
        if worker.proc.poll() is None:
            worker.proc.terminate()
            if worker.parked:
                worker.proc.send_signal(signal.SIGCONT)
            try:
                worker.proc.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
        worker.parked = False

    def close(self) -> None:
        """End every worker (all asked at once, so their shutdowns overlap)."""
        for worker in self.workers:
            if worker.proc.poll() is None:
                worker.proc.terminate()
                if worker.parked:
                    worker.proc.send_signal(signal.SIGCONT)
        for worker in self.workers:
            self._end(worker)
        self.workers = []


def _busy(proc: subprocess.Popen) -> bool:
    """Running a job or a lab: the worker's process has children (a solo pool runs no others)."""
    try:
        return bool(psutil.Process(proc.pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return False


def _wait_stopped(proc: subprocess.Popen) -> None:
    """SIGSTOP is asynchronous: wait until the kernel shows every thread stopped."""
    deadline = time.monotonic() + 2
    with suppress(psutil.NoSuchProcess):
        handle = psutil.Process(proc.pid)
        while handle.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.005)


def _holds_nothing(proc: subprocess.Popen) -> bool:
    if connection.vendor == "sqlite":
        return _sqlite_write_lock_free(connection.settings_dict["NAME"])
    return _postgres_connections_idle(proc)


def _sqlite_write_lock_free(path: str) -> bool:
    """Its write lock free: no transaction of any process open on it (Django's SQLite
    transactions take it at BEGIN: transaction_mode IMMEDIATE), so none is the stopped worker's."""
    probe = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        probe.close()


def _postgres_connections_idle(proc: subprocess.Popen) -> bool:
    """Each of the process's connections to the server is `idle`: no statement running, no
    transaction open (which would hold the locks the next flush's TRUNCATE waits for)."""
    port = int(connection.settings_dict["PORT"] or 5432)
    try:
        ports = [
            c.laddr.port
            for c in psutil.Process(proc.pid).net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port
        ]
    except psutil.NoSuchProcess:
        return True
    if not ports:
        return True
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE client_port = ANY(%s) AND state <> 'idle'",
            [ports],
        )
        return cursor.fetchone()[0] == 0


def _redis_forget() -> None:
    """This test process's Redis keys gone, but kombu's queue bindings (declared once by a
    running worker, needed by every publish to its queue)."""
    import redis

    with redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5) as client:
        names = [
            name
            for name in client.scan_iter(match=f"portal:{settings.PORTAL_INSTANCE_ID}:*", count=1000)
            if b"_kombu.binding." not in name
        ]
        for start in range(0, len(names), 500):
            client.delete(*names[start : start + 500])
