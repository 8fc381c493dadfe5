"""A pre-imported Python that forks the tests' Celery workers (tests/celery_workers.py).

A worker's start-up CPU is mostly imports: Celery, kombu, redis, Django's core, psutil, their
command line's prompt_toolkit (0.8-0.9 s to `ready` on the 2-core machine, 0.3-0.4 s forked from
here), and the suite starts about a hundred workers. Each test still gets workers of its own,
each a new process: this server imports only what reads no setting and no environment (Django's
settings and the portal's modules are read in the child, from the test's environment), and
forks one child per start, which then runs `python -m <module> <args>` exactly as a fresh
interpreter would, in its own environment, folder and log. Nothing a worker does reaches this
server or a later worker.

The server is one per test process, started at its first worker and ended with the session
(`ForkServer.close`, tests/conftest.py). It dies with the test process, and each child with it
(`PR_SET_PDEATHSIG`), as a worker Popen'd by the test dies with the test.

A child's handle (`Forked`) is the part of `subprocess.Popen` the tests use. The child is this
server's, not the test process's, so the handle holds a pidfd, opened by the server before it can
reap the child: signals go through it (never a bare pid), and it becomes readable when the child
ends, whose exit status the server then sends.

Run as `python -m tests.forkserver <fd>`; it imports nothing of the project.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO, NoReturn

# What a worker imports before it reads a setting (measured with -X importtime).
PRELOAD = (
    "celery",
    "celery.bin.celery",
    "celery.apps.worker",
    "celery.worker",
    "celery.worker.consumer",
    "celery.concurrency.solo",
    "celery.concurrency.prefork",
    "billiard",
    "kombu",
    "kombu.transport.redis",
    "redis",
    "django",
    "django.db.models",
    "django.db.backends.sqlite3.base",
    "django.db.backends.postgresql.base",
    "django.http",
    "django.core.handlers.base",
    "django.template",
    "django.forms",
    "django.urls",
    "rest_framework",
    "django_filters",
    "psutil",
    "yaml",
    "pynvml",
    "cryptography",
    "urllib3",
    "httpx",
    "click",
    "prompt_toolkit",
    "pygments",
    "email.mime.text",
    "asyncio",
    "sqlparse",
    "dateutil",
    "packaging.version",
)
MESSAGE_BYTES = 1 << 20
REPLY_SECONDS = 30.0  # the first start waits for the server's imports, on a loaded machine
PR_SET_PDEATHSIG = 1


class ForkServerError(RuntimeError):
    pass


# ---- the test process's side -----------------------------------------------------------------


class ForkServer:
    """`preexec_fn` ties the server's life to the test process's (`die_with_parent`)."""

    def __init__(self, *, cwd: Path, log: Path, preexec_fn: Callable[[], None]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.forkserver", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=preexec_fn,
            )
        theirs.close()
        self.ended: dict[int, int] = {}  # exit statuses the server sent before anyone asked
        self.interpreter = _interpreter_variables(os.environ)
        self.requests = 0
        self.gone = False  # ended, or given up on: its children died with it

    def usable(self) -> bool:
        return not self.gone and self.proc.poll() is None

    def spawn(self, argv: list[str], *, env: dict[str, str], cwd: Path, log: BinaryIO) -> Forked:
        """`argv` is `[python, "-m", module, *args]`; `log` takes its stdout and stderr."""
        if argv[1:2] != ["-m"] or len(argv) < 3:
            raise ForkServerError(f"the fork server runs `python -m module ...`, not {argv}")
        if (asked := _interpreter_variables(env)) != self.interpreter:
            # Read at an interpreter's start, which a forked child does not have: start such a
            # process with subprocess.Popen instead.
            raise ForkServerError(f"other PYTHON* variables than the server's: {asked} != {self.interpreter}")
        self.requests += 1
        number = self.requests
        request = json.dumps({"id": number, "argv": argv, "env": env, "cwd": str(cwd)}).encode()
        try:
            socket.send_fds(self.sock, [request], [log.fileno()])
        except OSError as exc:
            self._give_up()
            raise ForkServerError(f"the fork server does not take requests: {exc}") from None
        reply = self._next(lambda message: message.get("id") == number)
        if reply is None:
            raise ForkServerError(f"the fork server ended (exit status {self.proc.poll()})")
        pidfd = reply["fds"][0]
        os.set_inheritable(pidfd, False)
        return Forked(self, reply["pid"], pidfd, argv)

    def status(self, pid: int) -> int:
        """The exit status of a child that has ended (its pidfd said so). A server that has ended
        sent every status it had first; a child it never reported was killed with it (its
        PR_SET_PDEATHSIG)."""
        if pid not in self.ended and not self.gone:
            self._next(lambda message: message.get("exited") == pid)
        return self.ended.pop(pid, -signal.SIGKILL)

    def _next(self, wanted: Callable[[dict], bool]) -> dict | None:
        """The next message `wanted`; None once the server has ended. A server that does not
        answer in time is given up on (killed, its children with it): a late answer would be
        taken for the next request's."""
        deadline = time.monotonic() + REPLY_SECONDS
        while not self.gone:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                self._give_up()
                raise ForkServerError(f"no answer from the fork server in {REPLY_SECONDS:.0f} s: ended it")
            data, fds, _flags, _addr = socket.recv_fds(self.sock, MESSAGE_BYTES, 1)
            if not data:
                self._give_up()
                return None
            message = json.loads(data)
            message["fds"] = fds
            if "exited" in message:
                self.ended[message["exited"]] = message["code"]
            if wanted(message):
                return message
            for fd in fds:
                os.close(fd)
        return None

    def _give_up(self) -> None:
        self.gone = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """End of session: the server reads end-of-file and exits; its handle reaps it."""
        self.gone = True
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _interpreter_variables(env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name.startswith("PYTHON")}


class Forked:
    """A forked child's handle: `pid`, `args`, `returncode`, `poll`, `wait`, `send_signal`,
    `terminate`, `kill`, as `subprocess.Popen` has them."""

    def __init__(self, server: ForkServer, pid: int, pidfd: int, args: list[str]) -> None:
        self.pid, self.args, self.returncode = pid, args, None
        self._server, self._pidfd = server, pidfd

    def poll(self) -> int | None:
        if self.returncode is None and self._exited(0):
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._exited(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._ended()
        assert self.returncode is not None
        return self.returncode

    def _exited(self, timeout: float | None) -> bool:
        """The pidfd is readable once the child has ended (poll(2): any fd number, unlike select)."""
        watch = select.poll()
        watch.register(self._pidfd, select.POLLIN)
        return bool(watch.poll(None if timeout is None else max(0.0, timeout) * 1000))

    def _ended(self) -> None:
        self.returncode = self._server.status(self.pid)
        os.close(self._pidfd)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # after that the pidfd is closed, as Popen ignores a reaped pid
            # ProcessLookupError: ended, its status not read yet; Popen ignores that too.
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---- the server --------------------------------------------------------------------------------


_libc: ctypes.CDLL | None = None  # loaded before the first fork, never in a child


def _die_with(parent: int) -> None:
    """PR_SET_PDEATHSIG SIGKILL on `parent`; exit at once if it has already gone. As
    `portal.processes.die_with_parent`, which this server cannot import: importing `portal`
    makes the Celery app, and every child would share it."""
    assert _libc is not None
    _libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(1)


def _preload() -> None:
    # Without DJANGO_SETTINGS_MODULE a module that reads a setting fails here and is left to the
    # child, instead of reading this server's settings into every child.
    settings_module = os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a module left out only costs its import later, in the child
            print(f"[forkserver] not preloaded: {name}: {exc!r}", flush=True)
    if settings_module is not None:
        os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    read = [name for name in ("portal", "portal.settings") if name in sys.modules]
    if read:
        raise SystemExit(f"[forkserver] a preload imported {read}: its children would share them")


def serve(sock: socket.socket) -> None:
    global _libc
    _libc = ctypes.CDLL(None, use_errno=True)
    _preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # Ctrl-C reaches the whole process group: the workers take it as they would (a warm
    # shutdown), and the server ends when the test process closes its socket or dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pipes = (wake_r, wake_w)
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        if wake_r in ready:
            while True:
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    break
        _reap(sock)
        if sock in ready:
            data, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE_BYTES, 1)
            if not data:  # the test process closed its end: the session is over
                return
            _fork(sock, json.loads(data), fds[0], pipes)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _fork(sock: socket.socket, request: dict, log_fd: int, pipes: tuple[int, int]) -> None:
    server = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(request, log_fd, [sock.fileno(), *pipes], server)
    os.close(log_fd)
    pidfd = os.pidfd_open(pid)  # before any reap: the pid is still this child's
    socket.send_fds(sock, [json.dumps({"id": request["id"], "pid": pid}).encode()], [pidfd])
    os.close(pidfd)


def _child(request: dict, log_fd: int, server_fds: list[int], server: int) -> NoReturn:
    code: int = 1
    interrupted = False
    server_cwd = os.getcwd()
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _die_with(server)
        for fd in server_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null)
        os.close(log_fd)
        os.chdir(request["cwd"])
        if sys.path and sys.path[0] == server_cwd:  # `-m` puts the folder it starts in first
            sys.path[0] = os.getcwd()
        os.environ.clear()
        os.environ.update(request["env"])
        python, _m, module, *args = request["argv"]
        sys.argv = [python, *args]  # run_module puts the module's path first, as `-m` does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except KeyboardInterrupt:  # the interpreter prints it, then dies of SIGINT
        traceback.print_exc()
        interrupted = True
    except BaseException:  # printed to the log, as the interpreter would
        traceback.print_exc()
    finally:
        try:  # what an interpreter's exit does: wait for threads, then the atexit functions
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            if interrupted:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
        finally:
            os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
