"""Servers to take away at will, and the portal's processes on them: for the fault suite
(tests/test_faults.py) and its benchmark (bench/faults.py).

`ThrowawayPostgres` is a cluster of its own (`initdb` in a temporary folder, a free port on
127.0.0.1, fsync off, trust), `ThrowawayRedis` a `redis-server` on a free port with nothing saved.
Neither is ever the shared PostgreSQL or Redis the rest of the suite uses: stopping, killing and
restarting them is the point. `Portal` runs a real web server and real Celery workers against them.
tests/fault_cluster.py keeps one ThrowawayPostgres for a whole test session with a migrated template
database, of which each test gets a copy.

Every process started here is a child of the caller, started with a parent-death signal
(portal.processes.die_with_parent), so that not even a SIGKILLed test run leaves one behind, and
carries FAULTS_RUN=<tag> in its environment, by which `leftovers` finds what is still running (the
workers' pool processes inherit it; a test gives it to its jobs through their `env`).

PostgreSQL refuses to run as root: as root, initdb and the server run as the `postgres` account
(`Popen(user=...)`, which is what `runuser -u postgres --` does, minus PAM), in a folder chowned
to it. `unavailable()` says what this machine lacks, if anything.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import psycopg
import redis
from psycopg import sql

from jobs.models import Job
from portal.names import instance_keys
from portal.processes import die_with_parent
from portal.workers import web_argv, worker_argv
from tests.conftest import OUTPUT, ROOT, free_port
from tests.waiting import wait_for

PG_VERSIONS = Path("/usr/lib/postgresql")  # Debian's and Ubuntu's <version>/bin
PG_ACCOUNT = "postgres"
TAG_VAR = "FAULTS_RUN"
STOP_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}
START_TIMEOUT = 30
FINISHED = {status.value for status in Job.FINISHED}


def postgres_bin() -> Path | None:
    """The newest PostgreSQL server's bin folder (initdb, postgres), or None."""
    found = [p / "bin" for p in PG_VERSIONS.glob("*") if (p / "bin" / "initdb").is_file()]
    found.sort(key=lambda p: [int(part) if part.isdigit() else 0 for part in p.parent.name.split(".")])
    return found[-1] if found else None


def unavailable() -> str | None:
    """What this machine lacks to run the throwaway servers; None when nothing."""
    if shutil.which("redis-server") is None:
        return "no redis-server on PATH (apt install redis-server)"
    return _postgres_unavailable()


def _postgres_unavailable() -> str | None:
    if postgres_bin() is None:
        return f"no PostgreSQL server binaries in {PG_VERSIONS}/<version>/bin (apt install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_ACCOUNT)
        except KeyError:
            return f"running as root, and there is no {PG_ACCOUNT!r} account to run PostgreSQL as"
    return None


def own_logs(logs: Path | None, tag: str) -> Path:
    """The folder for the logs of one test's (or one session's) servers and processes, made: `logs`,
    or one named by the tag. Never a shared file name: tests and xdist workers read theirs back."""
    folder = logs if logs is not None else OUTPUT / f"faults-{tag}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def leftovers(tag: str, *folders: Path) -> list[psutil.Process]:
    """Every live process (zombies count as gone) with FAULTS_RUN=`tag` in its environment or its
    working directory in one of `folders`. PostgreSQL and redis-server write their process titles
    over their environment, so they are found by their folder (a cluster's backends work in its
    data directory), and so are jobs, in their job folders."""
    roots = [str(Path(folder).resolve()) for folder in folders]
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cwd = proc.cwd().removesuffix(" (deleted)")
            if proc.environ().get(TAG_VAR) == tag or any(cwd == r or cwd.startswith(r + "/") for r in roots):
                found.append(proc)
    return found


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float = 20) -> bool:
    """Signal a child and reap it; SIGKILL when it takes longer than `timeout`. Returns whether
    it ended by itself in time."""
    if proc is None:
        return True
    in_time = True
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            in_time = False
    proc.wait()
    return in_time


class _Throwaway:
    """A server process of the test's own, as the test's child, on a free port of 127.0.0.1:
    `start()` starts it (again, on the same port) and returns once it answers. A subclass says
    how it starts (`_argv`, `_popen_kwargs`), how it dies with the test (`death_signal`) and what
    "it answers" means (`_answers`)."""

    what = "the server"
    death_signal = signal.SIGKILL

    def __init__(self, *, tag: str, name: str, logs: Path | None = None) -> None:
        self.tag = tag
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix=f"{name}-faults-"))
        self.log_path = own_logs(logs, tag) / f"{name}.log"
        self.log_path.write_text("")
        self.proc: subprocess.Popen | None = None

    def _argv(self) -> list:
        raise NotImplementedError

    def _popen_kwargs(self) -> dict:
        raise NotImplementedError

    def _answers(self) -> bool:
        raise NotImplementedError

    def _processes(self) -> list[psutil.Process]:
        """The server's process and every process it started (PostgreSQL's backends)."""
        assert self.proc is not None and self.running
        main = psutil.Process(self.proc.pid)
        return [main, *main.children(recursive=True)]

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Every process of the server stopped (SIGSTOP) for the block: it neither answers nor
        closes, and its kernel still acknowledges packets. Always resumed (SIGCONT) after."""
        stopped: list[psutil.Process] = []
        try:
            # The server's own process first, so that it starts no backend meanwhile; then what
            # it started, listed twice (one forked just before it stopped). A backend that ended
            # between the listing and its signal is no longer the server's.
            for _ in range(2):
                for proc in self._processes():
                    if proc not in stopped:
                        with contextlib.suppress(psutil.NoSuchProcess):
                            proc.send_signal(signal.SIGSTOP)
                            stopped.append(proc)
            yield
        finally:
            for proc in stopped:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(signal.SIGCONT)

    def thaw(self) -> None:
        """Every process of the server resumed (SIGCONT), if it runs: whatever froze it."""
        if not self.running:
            return
        with contextlib.suppress(psutil.Error):
            for proc in self._processes():
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(signal.SIGCONT)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> float:
        """Start it; returns how long it took to answer, in seconds."""
        assert not self.running, "already running"
        began = time.monotonic()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [str(a) for a in self._argv()],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(self.death_signal),
                **self._popen_kwargs(),
            )
        wait_for(self._ready, timeout=START_TIMEOUT, interval=0.05, what=f"{self.what} ({self.log_path})")
        return time.monotonic() - began

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.what} exited with {self.proc.returncode}; see {self.log_path}")
        return self._answers()


class ThrowawayPostgres(_Throwaway):
    """A PostgreSQL cluster of its own on a free port of 127.0.0.1, as the server's own child.

    `start()` returns once it accepts connections; `stop(mode)` is pg_ctl's -m (smart, fast,
    immediate: the signal pg_ctl sends, sent straight to the postmaster) and returns once it is
    gone; `close()` stops it and deletes the cluster."""

    what = "PostgreSQL"
    death_signal = signal.SIGQUIT  # an immediate shutdown, in which the postmaster takes its backends along

    def __init__(
        self, *, tag: str, name: str = "postgres", logs: Path | None = None, copy_of: Path | None = None
    ) -> None:
        """A new cluster (initdb), or a copy of the stopped one whose data directory is `copy_of`."""
        if why := _postgres_unavailable():
            raise RuntimeError(f"cannot run a throwaway PostgreSQL: {why}")
        super().__init__(tag=tag, name=name, logs=logs)
        self.bin = postgres_bin()
        self.data = self.folder / "data"
        account = pwd.getpwnam(PG_ACCOUNT) if os.geteuid() == 0 else None
        self.as_user = (
            {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []} if account else {}
        )
        if account:
            os.chown(self.folder, account.pw_uid, account.pw_gid)
        if copy_of is not None:  # -a: its owner (the postgres account, as root) and mode 0700 kept
            subprocess.run(["cp", "-a", str(copy_of), str(self.data)], check=True, capture_output=True)
            return
        initdb = [self.bin / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "--no-sync"]
        self._run([*initdb, "-E", "UTF8", "--no-locale"])

    def _run(self, argv: list) -> None:
        with open(self.log_path, "a") as log:
            subprocess.run(
                [str(a) for a in argv],
                check=True,
                stdout=log,
                stderr=subprocess.STDOUT,
                **self._popen_kwargs(),
            )

    def _popen_kwargs(self) -> dict:
        return {"cwd": self.folder, "env": {**os.environ, TAG_VAR: self.tag}, **self.as_user}

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def _argv(self) -> list:
        argv = [self.bin / "postgres", "-D", self.data, "-p", self.port, "-k", self.folder]
        # fsync and full pages only matter when the machine crashes; never synchronous_commit=off,
        # which loses commits already answered when the server itself is killed.
        argv += ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off"]
        return [*argv, "-c", "max_connections=200"]

    def _answers(self) -> bool:
        try:
            psycopg.connect(self.url(), connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    def stop(self, mode: str = "fast") -> None:
        _stop(self.proc, STOP_SIGNALS[mode], timeout=30)

    def restart(self, mode: str = "fast") -> float:
        self.stop(mode)
        return self.start()

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """A new database (a copy of `template`, which nobody may be connected to); its URL."""
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            query += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        self._execute(query)
        return self.url(name)

    def seal_template(self, name: str) -> None:
        """`name` a template nobody connects to any more (not even autovacuum), so that a copy of it
        never fails with "source database is being accessed by other users"."""
        self._execute(
            sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false").format(
                sql.Identifier(name)
            )
        )

    def drop_database(self, name: str) -> None:
        """Drop `name` if it is there. Without FORCE: a session still connected is a process the
        test left behind, and fails this."""
        self._execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))

    def _execute(self, query: sql.Composable) -> None:
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(query)

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)


class ThrowawayRedis(_Throwaway):
    """A `redis-server` of its own on a free port of 127.0.0.1 that saves nothing: started again after
    `kill()`, it is empty, as after the OOM killer. A `password` goes in its config file (requirepass)."""

    what = "redis-server"

    def __init__(
        self, *, tag: str, name: str = "redis", logs: Path | None = None, password: str = ""
    ) -> None:
        super().__init__(tag=tag, name=name, logs=logs)
        self.password = password
        (self.folder / "redis.conf").write_text(f"requirepass {password}\n" if password else "")

    @property
    def url(self) -> str:
        return f"redis://{f':{self.password}@' if self.password else ''}127.0.0.1:{self.port}/0"

    def _argv(self) -> list:
        argv = ["redis-server", self.folder / "redis.conf", "--port", self.port, "--bind", "127.0.0.1"]
        return [*argv, "--save", "", "--appendonly", "no", "--dir", self.folder]

    def _popen_kwargs(self) -> dict:
        return {"cwd": self.folder, "env": {**os.environ, TAG_VAR: self.tag}}

    def _answers(self) -> bool:
        try:
            with redis.Redis.from_url(self.url, socket_connect_timeout=1) as client:
                return bool(client.ping())
        except redis.exceptions.ConnectionError:
            return False

    def queued(self, queue: str) -> int:
        """Messages waiting in a Celery queue: a Redis list of the queue's name under its portal's
        prefix (global_keyprefix, portal/settings.py), whichever portal's: this Redis is one
        portal's own."""
        pattern = instance_keys("*", "celery", queue)
        with redis.Redis.from_url(self.url) as client:
            return sum(client.llen(key) for key in client.scan_iter(match=pattern, _type="list"))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        _stop(self.proc, sig)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def small_disk(folder: Path, *, size: str = "64k", read_only: bool = False) -> Iterator[Path]:
    """`folder` on a tmpfs of `size` (mode 0700, root's): a disk that really fills (ENOSPC), or
    one mounted read-only (EROFS). Needs root (mount); unmounted, whatever happened, after it."""
    folder.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0700" + (",ro" if read_only else "")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
        check=True,
        capture_output=True,
    )
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True)


def small_disk_unavailable() -> str | None:
    """Why `small_disk` cannot run here; None when it can."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "mounting a small tmpfs needs root and mount(8)"
    return None


def lines_script(count: int, *, every: float) -> bytes:
    """A job printing `count` numbered lines ("line 01", ...), one every `every` seconds."""
    return (
        f"import time\nfor n in range(1, {count + 1}):\n"
        f'    print(f"line {{n:02d}}", flush=True)\n    time.sleep({every})\n'
    ).encode()


# Holds its worker's one slot until the file named by its first argument exists.
HOLD = b"""\
import pathlib, sys, time
print("started", flush=True)
flag = pathlib.Path(sys.argv[1]) if sys.argv[1:] else None
while flag is not None and not flag.exists():
    time.sleep(0.1)
print("done", flush=True)
"""
QUICK = b'print("done", flush=True)\n'

SERVER = "fault1"
INVENTORY = f"""\
users: [alice]
servers:
  - name: {SERVER}
    cpu_count: 8
    ram_gb: 32
    driver_version: "550.90.07"
    cuda_version: "12.4"
    gpus:
      - {{model: NVIDIA RTX A5000, count: 4, memory_gb: 24, power_limit_w: 230}}
"""
PASSWORD = "faults-demo"  # the seeded users' (manage.py seed_demo): admin, leader, alice, bob
# Short intervals, so that what happens after an outage happens within the tests' minute.
INTERVALS = {
    "TELEMETRY_INTERVAL_SECONDS": "1",
    "SERVER_OFFLINE_AFTER_SECONDS": "10",
    "JOB_HEARTBEAT_SECONDS": "1",
    # Above the longest outage here (10 s) with room to spare: a job out of touch that long is
    # not lost, and its end must be recorded once, by its own worker.
    "JOB_LOST_AFTER_SECONDS": "20",
    "JOB_RECONCILE_SECONDS": "1",
    "QUEUE_SCHEDULE_SECONDS": "1",
    "JOB_KILL_GRACE_SECONDS": "2",
    "OUTAGE_RETRY_AFTER_SECONDS": "1",
    "JOB_DRAIN_SECONDS": "1",
}


class Portal:
    """The portal's real processes on a throwaway database and Redis: a web server (gunicorn, as
    `runportal` starts it), the portal's worker (collector, scheduler, reconciler) and a GPU host
    worker for the simulated server SERVER. `stop()` ends and reaps them all.

    A portal of its own (PORTAL_INSTANCE_ID faults-<tag>), as its database is: its jobs are no
    other portal's on this machine, and its logs are in `logs` (by default, named by the tag)."""

    def __init__(
        self, *, database_url: str, redis_url: str, scratch: Path, tag: str, logs: Path | None = None
    ) -> None:
        self.scratch = scratch
        self.tag = tag
        self.logs = own_logs(logs, tag)
        (scratch / "inventory.yaml").write_text(INVENTORY)
        self.env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "GPU_BACKEND": "simulated",
            "SIMULATED_INVENTORY": str(scratch / "inventory.yaml"),
            "SIMULATED_PROCESSES_FILE": str(scratch / "simulated-gpu-processes.json"),
            "JOB_ROOTS": str(scratch / "jobs"),
            "JOB_FOLDERS": str(scratch / "job-folders"),
            "JOB_SPOOL_DIR": str(scratch / "spool"),
            "EMAIL_DELIVERY": "file",
            "EMAIL_FILE_PATH": str(scratch / "mail"),
            "PORTAL_DEMO_PASSWORD": PASSWORD,
            "PYTHONUNBUFFERED": "1",
            "PORTAL_INSTANCE_ID": f"faults-{tag}",
            **INTERVALS,
            TAG_VAR: tag,
        }
        # Set with the port (start_web), as `make run` has them: never the developer's own.
        for origin in ("PORTAL_URL", "LAB_ORIGIN"):
            self.env.pop(origin, None)
        self.procs: dict[str, subprocess.Popen] = {}
        self.base = ""

    @staticmethod
    def prepare(database_url: str, scratch: Path) -> None:
        """Migrate the database and seed the demo users (one Django start-up for both)."""
        code = (
            "from django.core.management import call_command as c; c('migrate', verbosity=0); c('seed_demo')"
        )
        env = {**os.environ, "DATABASE_URL": database_url, "PORTAL_DEMO_PASSWORD": PASSWORD}
        subprocess.run(
            [sys.executable, "manage.py", "shell", "-c", code],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )

    def log_path(self, role: str) -> Path:
        return self.logs / f"{role}.log"

    def _start(self, role: str, argv: list[str], **env: str) -> subprocess.Popen:
        with open(self.log_path(role), "w") as log:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env={**self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        self.procs[role] = proc
        return proc

    def start_web(self, *, workers: int = 2) -> str:
        """The web server as `make run` and the systemd unit run it (ASGI, uvicorn's worker)."""
        port = free_port()
        # The portal's origin as a browser on this machine has it; 127.0.0.1 is the labs' own,
        # where the ASGI app serves labs and nothing else.
        self.base = f"http://localhost:{port}"
        self.env |= {"PORTAL_URL": self.base, "LAB_ORIGIN": f"http://127.0.0.1:{port}"}
        self._start("web", web_argv(f"127.0.0.1:{port}", workers=workers))
        return self.base

    def start_workers(self, *, host_pool: str = "prefork", host_concurrency: int = 2) -> None:
        """The portal's worker, and SERVER's host worker (`solo`: one job at a time, in the
        worker's own process, as WORKER_CONCURRENCY=1 at most)."""
        self._start("worker-portal", worker_argv("portal", f"portal@{self.tag}"), WORKER_SERVER="portal")
        argv = worker_argv(
            f"host.{SERVER}", f"{SERVER}@{self.tag}", pool=host_pool, concurrency=host_concurrency
        )
        self._start("worker-host", argv, WORKER_SERVER=SERVER)

    def output(self, role: str) -> str:
        return self.log_path(role).read_text(errors="replace")

    def stacks(self, role: str) -> str:
        """Every thread's stack in a Celery worker's main process, as it logs them on SIGUSR1
        (Celery's own handler, `install_cry_handler`): what a hung thread waits on. Signalled by
        its own handle, never its pool's children (they die of SIGUSR1)."""
        proc = self.procs.get(role)
        if proc is None or proc.poll() is not None:
            return f"{role}: not running"
        before = self.log_path(role).stat().st_size

        def dumped() -> list[str]:
            with open(self.log_path(role), errors="replace") as log:
                log.seek(before)
                return log.read().splitlines()

        proc.send_signal(signal.SIGUSR1)
        # The main thread's stack is in the dump (its threads in any order): wait for its last frame.
        with contextlib.suppress(AssertionError):
            wait_for(lambda: any("MainThread" in line for line in dumped()), timeout=5, what="the stacks")
        dump = dumped()
        kept, in_locals = [], False  # each thread's name and frames; not its local variables
        for line in dump:
            if line == "LOCAL VARIABLES":
                in_locals = True
            elif in_locals and line and line[0] not in " {'=":
                in_locals = False  # the next thread's name
            if not in_locals and not line.startswith("====="):
                kept.append(f"{role}: {line}")
        return "\n".join(kept[-250:])

    def check_alive(self) -> None:
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(
                    f"the {role} process exited with {proc.returncode}; see {self.log_path(role)}"
                )

    def wait_ready(self, timeout: float = 90) -> None:
        """Both workers are ready and the web server answers."""

        def ready() -> bool:
            self.check_alive()
            return all(" ready." in self.output(role) for role in ("worker-portal", "worker-host"))

        wait_for(ready, timeout=timeout, what="the Celery workers")
        wait_for(self._answers, timeout=timeout, what=f"the web server ({self.log_path('web')})")

    def start(self, *, host_pool: str = "prefork", web_workers: int = 2) -> Api:
        """Everything, up and ready, SERVER's cards reported; the API as alice. Web workers as
        runportal's, 2 by default; 1 where many requests at once are not what is tested (each
        imports the whole portal: about 1.1 s of CPU from its start to its stop)."""
        self.start_web(workers=web_workers)
        self.start_workers(host_pool=host_pool)
        self.wait_ready()
        api = Api(self.base, "alice")
        wait_for(api.server_online, timeout=60, what=f"{SERVER}'s first telemetry")
        return api

    def _answers(self) -> bool:
        self.check_alive()
        try:
            return httpx.get(self.base + "/login/", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> list[str]:
        """SIGTERM to all, as systemd or Ctrl-C would (a worker's warm shutdown stops its jobs),
        then reap each; returns the roles that were still running 30 s later (then SIGKILLed)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 30
        return [
            role
            for role, proc in self.procs.items()
            if not _stop(proc, timeout=max(0.1, deadline - time.monotonic()))
        ]


class Api:
    """The portal's API over HTTP as a seeded user (or another, by `password`; through a proxy: `via`,
    an httpx transport), with a token of theirs. Every answer is kept in `answers` for the no-500 checks."""

    def __init__(
        self, base: str, username: str, *, password: str = PASSWORD, via: httpx.BaseTransport | None = None
    ) -> None:
        self.client = httpx.Client(base_url=base, timeout=15, transport=via)
        self.answers: list[tuple[str, str, int, str | None]] = []
        token = self.call("POST", "/api/v1/token/", data={"username": username, "password": password})
        assert token.status_code == 200, token.text
        self.client.headers["Authorization"] = f"Token {token.json()['token']}"

    def call(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        response = self.client.request(method, path, **kwargs)
        self.answers.append((method, path, response.status_code, response.headers.get("Retry-After")))
        return response

    def get(self, path: str) -> dict:
        response = self.call("GET", path)
        assert response.status_code == 200, f"GET {path}: {response.status_code} {response.text[:500]}"
        return response.json()

    def book(self, **fields: object) -> httpx.Response:
        return self.call("POST", "/api/v1/reservations/", json=fields)

    def submit(
        self, script: bytes, *, name: str = "job.py", env: dict[str, str], **fields: object
    ) -> httpx.Response:
        """A job with an uploaded script; `env` becomes its NAME=value lines."""
        data = {key: str(value) for key, value in fields.items()}
        data["env"] = "\n".join(f"{key}={value}" for key, value in env.items())
        return self.call(
            "POST", "/api/v1/jobs/", data=data, files={"script": (name, script, "text/x-python")}
        )

    def book_now(self) -> int:
        """One whole card of SERVER from now: the booking's id."""
        response = self.book(count=1, server=SERVER)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def run(self, script: bytes, *, tag: str, **fields: object) -> int:
        """Submit a job carrying FAULTS_RUN=`tag` (so that a job left running is found): its id."""
        response = self.submit(script, env={TAG_VAR: tag}, **fields)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def job(self, job_id: int) -> dict:
        return self.get(f"/api/v1/jobs/{job_id}/")

    def log(self, job_id: int) -> str:
        response = self.call("GET", f"/api/v1/jobs/{job_id}/log/")
        assert response.status_code == 200, response.text[:500]
        return response.text

    def status(self, job_id: int) -> str | None:
        """The job's status; None while the portal cannot say (a 503 in an outage)."""
        response = self.call("GET", f"/api/v1/jobs/{job_id}/")
        return response.json()["status"] if response.status_code == 200 else None

    def finished(self, job_id: int) -> bool:
        return self.status(job_id) in FINISHED

    def server_online(self) -> bool:
        response = self.call("GET", f"/api/v1/servers/{SERVER}/")
        return response.status_code == 200 and response.json()["status"] == "online"

    def close(self) -> None:
        self.client.close()
