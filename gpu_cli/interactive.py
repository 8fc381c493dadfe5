"""`gpu exec` and `gpu shell`: a command run here, on a GPU host, in the foreground, inside one of
your bookings (docs/cli.md, "Interactive work on a booking").

The portal opens a session on the booking (POST sessions/) and answers with the booking's
environment and its end. The command runs in a session of its own whose id the portal is told
(PATCH sessions/<id>/), so that the GPU watchdog counts its processes as the booking's. While it
runs, one thread beats (POST sessions/<id>/beat/) to learn of a booking extended or released and
of an end asked for on the portal; another warns before the end and stops the command at it, from
the end last heard of, even while the portal cannot be reached. Then the portal is told how the
command ended (POST sessions/<id>/finish/) and `gpu` exits with the command's exit code.

On a terminal the command gets a pseudo-terminal of its own, so that job control, Ctrl-C and
full-screen programs work in it; otherwise (pipes, scripts) it shares gpu's stdin, stdout and
stderr, and the signals gpu gets are passed on to it.
"""

from __future__ import annotations

import errno
import os
import queue
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import click
import httpx

from gpu_cli import config
from gpu_cli.api import Portal, connect
from gpu_cli.jobs import SIGNAL_EXIT_BASE

try:  # Unix only, as the GPU hosts are; elsewhere (Windows) the rest of `gpu` must still load
    import fcntl
    import pty
    import termios
    import tty
except ImportError:
    fcntl = pty = termios = tty = None  # type: ignore[assignment]

HOST_ENV = "GPU_SERVER"  # the host's name as the portal knows it, where the hostname is not it
LAUNCHER_ENV = "PORTAL_LAUNCHER"
# GPU hosts run `gpu` from the portal's checkout, which has the job launcher beside gpu_cli/.
BUNDLED_LAUNCHER = Path(__file__).resolve().parents[1] / "jobs" / "host" / "launcher-bin" / "launcher.py"
NOT_FOUND_EXIT = 127  # as a shell reports a command it cannot find
NOT_EXECUTABLE_EXIT = 126  # and one it found but cannot run
# A beat must not hold up the watch for long: one try, a short wait, and the next beat tries again.
BEAT_TIMEOUT = httpx.Timeout(10.0, connect=5.0)
LAST_BEAT_SECONDS = 5.0  # how long the finish waits for a request of the beats' in flight
POLL_SECONDS = 0.2  # how often the relay looks whether the command has exited, when all is quiet
LONGEST_WAIT = 30.0  # the watch looks at the wall clock at least this often (it may be set)
CHUNK = 65536
PYTHON = re.compile(r"python[0-9.]*")
# Python's long options that take the next word as their value; of the short ones, -W and -X.
PYTHON_VALUE_OPTIONS = frozenset({"--check-hash-based-pycs"})


class Notes:
    """gpu's own lines on stderr, `[gpu] …`. While the terminal is raw (the command has a
    pseudo-terminal) a newline no longer returns the cursor, and the command's output may have left
    it mid-line: so then each note starts on a fresh line and ends with CR LF."""

    def __init__(self) -> None:
        self.raw = False

    def __call__(self, text: str) -> None:
        line = f"\r\n[gpu] {text}\r\n" if self.raw else f"[gpu] {text}\n"
        sys.stderr.write(line)
        sys.stderr.flush()


@dataclass(frozen=True)
class Session:
    """The portal's answer to POST sessions/, with the command as it was asked for."""

    id: int
    reservation: int
    command: list[str]
    env: dict[str, str]
    launcher: bool
    ends_at: datetime
    warn_at: datetime
    beat_seconds: float
    grace_seconds: float

    @classmethod
    def of(cls, answer: Mapping[str, Any], command: list[str]) -> Session:
        return cls(
            id=answer["id"],
            reservation=answer["reservation"],
            command=command,
            env={str(name): str(value) for name, value in (answer.get("env") or {}).items()},
            launcher=bool(answer.get("launcher")),
            ends_at=parse_time(answer["ends_at"]),
            warn_at=parse_time(answer.get("warn_at") or answer["ends_at"]),
            # Seconds as numbers: the portal sends whole ones, a test may send less.
            beat_seconds=float(answer["beat_seconds"]),
            grace_seconds=float(answer["grace_seconds"]),
        )

    @property
    def name(self) -> str:
        """The command in a note: its words as a shell would take them back, cut short."""
        text = shlex.join(self.command)
        return text if len(text) <= 60 else text[:59] + "…"


class SpawnError(Exception):
    """The command could not be started: not found (127) or not executable (126), as a shell says."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code, self.message = exit_code, message

    @classmethod
    def of(cls, number: int, program: str) -> SpawnError:
        if number == errno.ENOENT:
            return cls(NOT_FOUND_EXIT, f"{program}: command not found")
        return cls(NOT_EXECUTABLE_EXIT, f"{program}: {os.strerror(number)}")


def parse_time(text: str) -> datetime:
    when = datetime.fromisoformat(text)
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def utc_now() -> datetime:
    return datetime.now(UTC)


def clock_time(when: datetime) -> str:
    """HH:MM in this machine's time, as the rest of `gpu` shows times."""
    return when.astimezone().strftime("%H:%M")


def server_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


# --- what runs -----------------------------------------------------------------------------------


def child_env(inherited: Mapping[str, str], booking: Mapping[str, str]) -> dict[str, str]:
    """This shell's environment with the booking's on top: its cards and caps win over any the
    user had set (a CUDA_VISIBLE_DEVICES left over from elsewhere would name someone else's card)."""
    return {**inherited, **booking}


def script_position(argv: list[str]) -> int | None:
    """Where the script is in a `python … script.py …` argv; None for `-c`, `-m`, stdin, a REPL or
    a first argument that is no .py file: those run as they are."""
    position = 1
    while position < len(argv):
        word = argv[position]
        if word == "--":
            position += 1
            break
        if not word.startswith("-") or word == "-":
            break
        if word.startswith("--"):
            position += 2 if word in PYTHON_VALUE_OPTIONS else 1
            continue
        # Short flags may be bunched (-uB); -c and -m end the options, -W and -X take a value.
        for index, flag in enumerate(word[1:], start=1):
            if flag in "cm":
                return None
            if flag in "WX":
                position += 1 if index < len(word) - 1 else 2
                break
        else:
            position += 1
    if position < len(argv) and argv[position].endswith(".py"):
        return position
    return None


def launcher_path(env: Mapping[str, str]) -> Path | None:
    path = Path(env[LAUNCHER_ENV]) if env.get(LAUNCHER_ENV) else BUNDLED_LAUNCHER
    return path if path.is_file() else None


def launcher_argv(argv: list[str], env: Mapping[str, str]) -> tuple[list[str], str | None]:
    """Run a Python script through the job launcher, which applies the booking's framework settings
    (TensorFlow's memory growth and cap, PyTorch's cap) as it does for jobs. Returns the argv to
    run, and a note for the user where the launcher is not here and the script runs as it is."""
    program = Path(argv[0]).name
    if PYTHON.fullmatch(program):
        position = script_position(argv)
        if position is None:
            return argv, None
        interpreter, options, rest = argv[0], argv[1:position], argv[position:]
    elif program.endswith(".py"):
        interpreter, options, rest = sys.executable, [], argv
    else:
        return argv, None
    launcher = launcher_path(env)
    if launcher is None:
        missing = env.get(LAUNCHER_ENV) or str(BUNDLED_LAUNCHER)
        return argv, (
            f"the job launcher is not here ({missing}): {rest[0]} runs without the booking's "
            "TensorFlow and PyTorch settings; the memory caps in its environment still apply."
        )
    # The interpreter's own options stay, `--` excepted: the launcher's path must not follow it.
    options = [word for word in options if word != "--"]
    return [interpreter, *options, "-u", str(launcher), *rest], None


# --- the child process ---------------------------------------------------------------------------


def exit_code_of(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + N when killed by signal N."""
    code = os.waitstatus_to_exitcode(status)
    return SIGNAL_EXIT_BASE - code if code < 0 else code


class Child:
    """The command's process: the leader of a session and process group of its own, which `gpu`
    started and alone reaps. Its group is signalled only while it is unreaped: once reaped, its
    pid (and so the group's id) may be given to someone else's process."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        if pid <= 1:
            raise ValueError(f"not a child's pid: {pid}")
        self.pid, self.popen = pid, popen
        self.lock = threading.Lock()  # held from the check that it is unreaped to the signal
        self.reaped = threading.Event()
        self.exit_code: int | None = None

    def signal(self, signum: int) -> bool:
        """Send `signum` to the command's process group; False once it has been reaped."""
        with self.lock:
            if self.reaped.is_set():
                return False
            try:
                os.killpg(self.pid, signum)
            except ProcessLookupError:  # the group is empty: the leader is a zombie, nothing else left
                return False
            except PermissionError:  # a member of the group took another user's id (setuid)
                return False
            return True

    def poll(self) -> bool:
        """Reap the command if it has exited; True once it has."""
        with self.lock:
            if self.reaped.is_set():
                return True
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == 0:
                return False
            self.exit_code = exit_code_of(status)
            if self.popen is not None:
                self.popen.returncode = self.exit_code  # reaped here; Popen must not wait for it
            self.reaped.set()
            return True

    def wait(self) -> int:
        """Wait for the command to exit and reap it. Where waitid is there (Linux), wait without
        reaping first, so that the lock is taken only to reap a process that is done."""
        if hasattr(os, "waitid") and not self.reaped.is_set():
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        while not self.poll():
            time.sleep(POLL_SECONDS / 4)
        assert self.exit_code is not None
        return self.exit_code


def spawn_plain(argv: list[str], env: Mapping[str, str]) -> Child:
    """The command with gpu's stdin, stdout and stderr, in a session of its own."""
    try:
        popen = subprocess.Popen(argv, env=env, start_new_session=True)
    except OSError as exc:
        raise SpawnError.of(exc.errno or errno.ENOEXEC, argv[0]) from None
    return Child(popen.pid, popen)


# What the command gets back as the default, whatever gpu's own process ignored: the keys its pty
# turns into signals (Ctrl-C, Ctrl-\, Ctrl-Z), and SIGPIPE and SIGXFSZ, which Python ignores for
# itself (subprocess restores them too). A gpu started with SIGINT ignored (a script's
# `trap '' INT`) otherwise gave a command that no Ctrl-C could stop.
KEYS_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGPIPE, signal.SIGXFSZ)


def spawn_pty(argv: list[str], env: Mapping[str, str], size: bytes | None) -> tuple[Child, int]:
    """The command on a new pseudo-terminal: pty.fork() makes it a session leader with the pty as
    its controlling terminal. Returns it and the pty's master end. The window size is set in the
    child before exec, so the command never sees the pty's default 0x0. A failed exec is reported
    through a pipe that the exec closes (close-on-exec), as subprocess does."""
    failed_read, failed_write = os.pipe()  # both close-on-exec
    pid, master = pty.fork()
    if pid == 0:
        try:
            if size:
                fcntl.ioctl(0, termios.TIOCSWINSZ, size)
            for signum in KEYS_SIGNALS:  # an ignored signal stays ignored across exec
                signal.signal(signum, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            os.write(failed_write, str(exc.errno or errno.ENOEXEC).encode())
        finally:
            os._exit(NOT_FOUND_EXIT)  # never back into gpu's Python in the child
    os.close(failed_write)
    with os.fdopen(failed_read, "rb") as pipe:
        failed = pipe.read()
    if failed:
        os.waitpid(pid, 0)
        os.close(master)
        raise SpawnError.of(int(failed), argv[0])
    return Child(pid), master


class Forwarding:
    """Ctrl-C on a terminal that is not raw, a hangup or a kill of gpu: passed on to the command's
    group, which is in a session of its own and would get none of them otherwise. Installed before
    the command starts, so that none is lost; sent on once it has a pid, by a thread of its own:
    a handler runs in the main thread, which may hold the child's lock just then."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
    DONE = 0  # no signal's number: the thread's cue to end

    def __init__(self) -> None:
        self.signals: queue.SimpleQueue[int] = queue.SimpleQueue()  # put() is safe in a handler

    def __call__(self, signum: int, frame: object) -> None:
        self.signals.put(signum)

    def attach(self, child: Child) -> None:
        threading.Thread(target=self._forward, args=(child,), name="gpu-signals", daemon=True).start()

    def _forward(self, child: Child) -> None:
        while (signum := self.signals.get()) != self.DONE:
            child.signal(signum)

    @contextmanager
    def installed(self) -> Iterator[Forwarding]:
        signals = [getattr(signal, name) for name in self.SIGNALS]
        previous = {signum: signal.signal(signum, self) for signum in signals}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            self.signals.put(self.DONE)


# --- the terminal --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Terminal:
    """gpu's own stdin and stdout, as file descriptors (a test gives it a pty of its own)."""

    stdin: int = 0
    stdout: int = 1

    @property
    def interactive(self) -> bool:
        return os.isatty(self.stdin) and os.isatty(self.stdout)


def window_size(fd: int) -> bytes | None:
    try:
        return fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8)
    except OSError:
        return None


def copy_window_size(terminal: int, master: int) -> None:
    """The terminal's size onto the pty; the kernel then sends SIGWINCH to the command."""
    if (size := window_size(terminal)) is not None:
        fcntl.ioctl(master, termios.TIOCSWINSZ, size)


@contextmanager
def raw_mode(fd: int, notes: Notes) -> Iterator[None]:
    """Keys go to the command as they are typed, Ctrl-C and Ctrl-Z included: its pty's line
    discipline turns them into signals for its foreground job, not this terminal's for gpu."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSADRAIN)
        notes.raw = True
        yield
    finally:
        notes.raw = False
        with suppress(termios.error):  # the terminal is gone: nothing to give back
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextmanager
def resizing(terminal: int, master: int) -> Iterator[None]:
    previous = signal.signal(signal.SIGWINCH, lambda signum, frame: copy_window_size(terminal, master))
    try:
        yield
    finally:
        signal.signal(signal.SIGWINCH, previous if previous is not None else signal.SIG_DFL)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def relay(master: int, terminal: Terminal, child: Child) -> None:
    """Copy bytes both ways until the command's output ends: EIO on the master once no process
    holds the pty, or the command has exited and nothing more came (a background process of its
    may keep the pty open; closing the master hangs it up). A terminal that is gone (the ssh
    connection dropped) ends it too: closing the master then hangs up the command, as sshd would."""
    inputs = [master, terminal.stdin]
    while True:
        ready, _, _ = select.select(inputs, [], [], POLL_SECONDS)
        if master in ready:
            try:
                data = os.read(master, CHUNK)
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                data = b""
            if not data:
                return
            try:
                write_all(terminal.stdout, data)
            except OSError:
                return
        if terminal.stdin in ready:
            try:
                data = os.read(terminal.stdin, CHUNK)
            except OSError:
                return
            if data:
                write_all(master, data)
            else:  # stdin closed: nothing more to type
                inputs.remove(terminal.stdin)
        if not ready and child.poll():
            return


def interact(child: Child, master: int, terminal: Terminal, notes: Notes) -> int:
    """The command on its pty, until it has exited; the terminal is restored whatever happens."""
    try:
        with raw_mode(terminal.stdin, notes), resizing(terminal.stdin, master):
            copy_window_size(terminal.stdin, master)  # in case it changed since the spawn
            relay(master, terminal, child)
    finally:
        os.close(master)
    return child.wait()


# --- the watch: the booking's end ----------------------------------------------------------------


class Watch:
    """Warns once before the booking's end (again if the end moves), and stops the command at the
    end last heard of, or when it is ended on the portal: SIGTERM to its group, SIGKILL after the
    grace period. The beats move the end (`update`); the wall clock is read afresh each time."""

    def __init__(
        self, child: Child, session: Session, notes: Notes, now: Callable[[], datetime] = utc_now
    ) -> None:
        self.child, self.session, self.notes, self.now = child, session, notes, now
        self.changed = threading.Condition()
        self.ends_at, self.warn_at = session.ends_at, session.warn_at
        self.end_requested, self.message = False, ""
        self.warned_for: datetime | None = None  # the end the warning was about
        self.done = False
        self.reason = ""  # why gpu stopped the command, for the portal; "" where it ended by itself

    def update(self, answer: Mapping[str, Any]) -> None:
        with self.changed:
            self.ends_at = parse_time(answer.get("ends_at") or self.ends_at.isoformat())
            self.warn_at = parse_time(answer.get("warn_at") or self.warn_at.isoformat())
            self.end_requested = self.end_requested or bool(answer.get("end_requested"))
            self.message = str(answer.get("message") or "")
            self.changed.notify_all()

    def finish(self) -> None:
        with self.changed:
            self.done = True
            self.changed.notify_all()

    def run(self) -> None:
        with self.changed:
            while not (self.done or (reason := self._due())):
                self.changed.wait(self._seconds_to_next())
            if self.done:
                return
            self.reason = reason
        self.stop(reason)

    def _due(self) -> str:
        """Why the command must stop now, or ""; warns on the way when the warning is due."""
        now, booking = self.now(), f"booking #{self.session.reservation}"
        if self.end_requested:  # the portal's words where it has some ("ended by alice")
            return (
                f"{self.message} ({booking})"
                if self.message
                else f"the session on {booking} was ended from the portal"
            )
        if now >= self.ends_at:
            return f"the {booking} ended at {clock_time(self.ends_at)}"
        if now >= self.warn_at and self.warned_for != self.ends_at:
            self.warned_for = self.ends_at
            minutes = max(1, round((self.ends_at - now).total_seconds() / 60))
            self.notes(
                f"{booking} ends at {clock_time(self.ends_at)} (in {minutes} min): save your work; "
                "extend the booking on the portal to keep going."
            )
        return ""

    def _seconds_to_next(self) -> float:
        next_at = self.ends_at if self.warned_for == self.ends_at else min(self.warn_at, self.ends_at)
        return min(max((next_at - self.now()).total_seconds(), 0.0), LONGEST_WAIT)

    def stop(self, reason: str) -> None:
        self.notes(f"stopping {self.session.name}: {reason}")
        if not self.child.signal(signal.SIGTERM):
            return
        if not self.child.reaped.wait(self.session.grace_seconds) and self.child.signal(signal.SIGKILL):
            grace = self.session.grace_seconds
            self.notes(f"{self.session.name} was still running {grace:g} s after SIGTERM: SIGKILL")


# --- the portal ----------------------------------------------------------------------------------


class PortalLike(Protocol):
    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response: ...

    def post(self, path: str, **kwargs: Any) -> Any: ...


def process_started(pid: int) -> float | None:
    """When the process started, as psutil says (the portal's own measure, to tell a reused pid);
    None where psutil is not installed or the process is already gone."""
    try:
        import psutil  # on GPU hosts, in the portal's environment; not a dependency of the CLI
    except ImportError:
        return None
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def beat_loop(portal: PortalLike, session: Session, watch: Watch, child: Child) -> None:
    """Tell the portal the command's session id, then beat every beat_seconds until the command has
    ended. A beat that fails leaves the end as last heard of (the watch keeps to it), and the next
    one tries again; so does telling the pid, which the watchdog needs to count the command's
    processes as the booking's."""
    registered, away = False, False
    while True:
        try:
            if not registered:
                body = {"pid": child.pid, "pid_started": process_started(child.pid)}
                portal.request("PATCH", f"sessions/{session.id}/", json=body, timeout=BEAT_TIMEOUT)
                registered = True
            elif not watch.done:
                watch.update(portal.post(f"sessions/{session.id}/beat/", timeout=BEAT_TIMEOUT))
            away = False
        except click.ClickException as exc:
            if not (away or watch.done):
                watch.notes(
                    f"the portal did not answer ({exc.format_message()}); {session.name} goes on, "
                    f"until {clock_time(watch.ends_at)} at the latest."
                )
            away = True
        with watch.changed:
            if not watch.done:
                watch.changed.wait(session.beat_seconds)
            if watch.done:
                return


def open_session(portal: PortalLike, kind: str, reservation: int | None, command: list[str]) -> Session:
    answer = portal.post(
        "sessions/",
        json={"reservation": reservation, "kind": kind, "host": server_name(), "command": command},
    )
    return Session.of(answer, command)


def finish_session(portal: PortalLike, session: Session, exit_code: int | None, message: str) -> None:
    try:
        portal.post(f"sessions/{session.id}/finish/", json={"exit_code": exit_code, "message": message})
    except click.ClickException as exc:
        Notes()(f"the portal was not told that {session.name} ended: {exc.format_message()}")


# --- the whole run -------------------------------------------------------------------------------


def supervise(
    session: Session, argv: list[str], env: Mapping[str, str], terminal: Terminal, beats: PortalLike
) -> tuple[int, str]:
    """Run the command until it has exited, with the beats and the watch beside it. Returns its
    exit code and why gpu stopped it ("" where it ended by itself). Raises SpawnError."""
    notes = Notes()
    sys.stdout.flush()
    sys.stderr.flush()
    with Forwarding().installed() as forwarding:
        if terminal.interactive:
            child, master = spawn_pty(argv, env, window_size(terminal.stdin))
        else:
            child, master = spawn_plain(argv, env), None
        forwarding.attach(child)
        watch = Watch(child, session, notes)
        threading.Thread(target=watch.run, name="gpu-watch", daemon=True).start()
        beat = threading.Thread(target=beat_loop, args=(beats, session, watch, child), daemon=True)
        beat.start()
        try:
            code = child.wait() if master is None else interact(child, master, terminal, notes)
        finally:
            watch.finish()
    # The pid goes to the portal before the finish does, even for a command done in a moment;
    # a request that hangs is not waited for long.
    beat.join(LAST_BEAT_SECONDS)
    return code, watch.reason


def run_session(kind: str, reservation: int | None, command: list[str], terminal: Terminal) -> int:
    """Open the session, run the command, tell the portal how it ended; the exit code to exit with."""
    if pty is None:
        raise click.UsageError("gpu exec and gpu shell run on a GPU host (Linux), not here.")
    portal = connect()
    session = open_session(portal, kind, reservation, command)
    env = child_env(os.environ, session.env)
    argv, note = launcher_argv(command, env) if session.launcher else (command, None)
    if note:
        Notes()(note)
    login = config.current()
    # Beats go on a client of their own that never retries: the watch must not wait on them.
    beats = click.get_current_context().with_resource(Portal(login.url, login.token, retry_seconds=0))
    try:
        code, reason = supervise(session, argv, env, terminal, beats)
    except SpawnError as exc:
        Notes()(exc.message)
        finish_session(portal, session, None, exc.message)
        return exc.exit_code
    finish_session(portal, session, code, reason)
    return code


RESERVATION = click.option(
    "--reservation",
    "-r",
    type=int,
    metavar="ID",
    help="The booking to run in [your one booking active now on this host].",
)


@click.command(
    "exec",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@RESERVATION
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(reservation: int | None, command: tuple[str, ...]) -> None:
    """Run COMMAND here, on a GPU host, in your booking: with its cards and caps in the environment,
    counted as the booking's by the GPU watchdog, stopped when the booking ends. Exits with the
    command's exit code (128 + N when killed by signal N). Everything after COMMAND is its own.

    \b
      gpu exec -- nvidia-smi
      gpu exec -r 12 python train.py --epochs 3
    """
    raise click.exceptions.Exit(run_session("exec", reservation, list(command), Terminal()))


@click.command()
@RESERVATION
def shell(reservation: int | None) -> None:
    """Your $SHELL (else /bin/sh) here, on a GPU host, in your booking: as `gpu exec`.

    \b
      gpu shell
      gpu shell -r 12
    """
    program = os.environ.get("SHELL") or "/bin/sh"
    raise click.exceptions.Exit(run_session("shell", reservation, [program], Terminal()))
