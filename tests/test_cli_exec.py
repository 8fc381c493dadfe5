"""`gpu exec` and `gpu shell` (gpu_cli/interactive.py): the command run here, in a booking.

Two layers. The pieces with no portal: the launcher's argv, the environment, the child in a
session of its own (plain, and on a pseudo-terminal whose relay is driven through a pty that
stands in for the user's terminal), and the watch that warns and stops at the booking's end, on
deadlines a fraction of a second away. Then the installed .venv/bin/gpu as a real process against
FakeSessions, an http.server that answers the sessions API as the portal's contract says and
records each request; no database, no worker."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import click
import pytest

from gpu_cli import api, config, interactive
from gpu_cli.errors import Unreachable
from gpu_cli.interactive import (
    Child,
    Notes,
    Session,
    SpawnError,
    Terminal,
    Watch,
    beat_loop,
    child_env,
    clock_time,
    interact,
    launcher_argv,
    spawn_plain,
    spawn_pty,
)
from tests.http_stub import serving
from tests.waiting import wait_for

GPU_BIN = Path(sys.executable).parent / "gpu"
UUID = "GPU-3f1c0000-aaaa-bbbb-cccc-000000000001"
PY = sys.executable


class Recorded(Notes):
    """gpu's notes, kept for the test as well as printed."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def __call__(self, text: str) -> None:
        self.lines.append(text)
        super().__call__(text)


def session(ends_in: float = 3600.0, *, grace: float = 0.3, beat: float = 0.1, **fields: Any) -> Session:
    command = fields.pop("command", ["sleep", "30"])
    ends_at = datetime.now(UTC) + timedelta(seconds=ends_in)
    answer = {
        "id": 5,
        "reservation": 12,
        "env": {"CUDA_VISIBLE_DEVICES": UUID},
        "launcher": False,
        "ends_at": ends_at.isoformat(),
        "warn_at": (ends_at - timedelta(minutes=10)).isoformat(),
        "beat_seconds": beat,
        "grace_seconds": grace,
        **fields,
    }
    return Session.of(answer, command)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Children a test starts: any left running is killed and reaped after it."""
    started: list[Child] = []
    yield started
    for child in started:
        child.signal(signal.SIGKILL)
        child.wait()


# --- what runs ------------------------------------------------------------------------------------


@pytest.fixture
def launcher(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "launcher-bin" / "launcher.py"
    path.parent.mkdir()
    path.write_text("")
    monkeypatch.setattr(interactive, "BUNDLED_LAUNCHER", path)
    return path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python", "train.py", "--lr", "0.1"], ["python", "-u", "{L}", "train.py", "--lr", "0.1"]),
        (["/opt/venv/bin/python3.11", "t.py"], ["/opt/venv/bin/python3.11", "-u", "{L}", "t.py"]),
        (
            ["python3", "-u", "-W", "error", "t.py", "x"],
            ["python3", "-u", "-W", "error", "-u", "{L}", "t.py", "x"],
        ),
        (["python", "-Xdev", "-B", "--", "t.py"], ["python", "-Xdev", "-B", "-u", "{L}", "t.py"]),
        (["./train.py", "--epochs", "3"], [PY, "-u", "{L}", "./train.py", "--epochs", "3"]),
        (["python", "-c", "import t"], None),
        (["python", "-m", "torch.distributed.run", "t.py"], None),
        (["python", "-uc", "print(1)"], None),
        (["python", "-Im", "pip", "t.py"], None),
        (["python"], None),
        (["python", "-"], None),
        (["python", "notes.txt"], None),
        (["pythonista", "t.py"], None),
        (["nvidia-smi", "-L"], None),
        (["sh", "-c", "python t.py"], None),
    ],
)
def test_python_scripts_run_through_the_launcher_and_the_rest_as_they_are(argv, expected, launcher):
    new, note = launcher_argv(argv, {})
    assert note is None
    assert new == ([str(launcher) if word == "{L}" else word for word in expected] if expected else argv)


def test_portal_launcher_names_the_launcher(launcher, tmp_path):
    other = tmp_path / "mine.py"
    other.write_text("")
    assert launcher_argv(["python", "t.py"], {"PORTAL_LAUNCHER": str(other)})[0][2] == str(other)


def test_without_the_launcher_a_script_runs_as_it_is_with_a_note(monkeypatch, tmp_path):
    monkeypatch.setattr(interactive, "BUNDLED_LAUNCHER", tmp_path / "nowhere" / "launcher.py")
    argv, note = launcher_argv(["python", "train.py"], {})
    assert argv == ["python", "train.py"]
    assert note and "train.py runs without the booking's TensorFlow" in note and "caps" in note


def test_the_bookings_environment_goes_on_top_of_this_shells():
    inherited = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/home/alice"}
    booking = {"CUDA_VISIBLE_DEVICES": UUID, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    env = child_env(inherited, booking)
    assert env == {"PATH": "/usr/bin", "HOME": "/home/alice", **booking}
    assert inherited["CUDA_VISIBLE_DEVICES"] == "0,1"  # a copy: gpu's own stays as it was


# --- the child ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "code"),
    [("exit 0", 0), ("exit 7", 7), ("kill -TERM $$", 143), ("kill -KILL $$", 137)],
)
def test_a_plain_child_exits_with_its_code_as_a_shell_reports_it(script, code):
    assert spawn_plain(["sh", "-c", script], dict(os.environ)).wait() == code


def test_a_plain_child_leads_a_session_of_its_own(tmp_path):
    out = tmp_path / "out"
    code = f"import os; open({str(out)!r}, 'w').write(str(os.getsid(0) == os.getpid()))"
    child = spawn_plain([PY, "-c", code], dict(os.environ))
    assert child.wait() == 0 and out.read_text() == "True"
    assert not child.signal(signal.SIGTERM)  # reaped: its pid may be someone else's by now


@pytest.mark.parametrize("spawn", ["plain", "pty"])
def test_a_command_not_found_is_127_and_one_not_executable_126(spawn, tmp_path):
    def start(argv: list[str]) -> object:
        return (
            spawn_plain(argv, dict(os.environ))
            if spawn == "plain"
            else spawn_pty(argv, dict(os.environ), None)
        )

    with pytest.raises(SpawnError) as missing:
        start(["no-such-command-here"])
    assert (
        missing.value.exit_code == 127 and missing.value.message == "no-such-command-here: command not found"
    )
    plain = tmp_path / "plain.txt"
    plain.write_text("not a program\n")
    with pytest.raises(SpawnError) as denied:
        start([str(plain)])
    assert denied.value.exit_code == 126 and "Permission denied" in denied.value.message


@pytest.fixture
def fake_terminal() -> Iterator[tuple[int, int]]:
    """A pty standing in for the user's terminal: gpu gets its slave end as stdin and stdout, the
    test types into and reads from its master end."""
    master, slave = pty.openpty()
    yield master, slave
    os.close(master)
    os.close(slave)


def read_until(fd: int, needle: bytes, timeout: float = 10) -> bytes:
    """What the fd gives until `needle` has come (or the other end closed)."""
    got, deadline = b"", time.monotonic() + timeout
    while needle not in got:
        assert time.monotonic() < deadline, f"no {needle!r} in {got!r}"
        if select.select([fd], [], [], 0.1)[0]:
            try:
                data = os.read(fd, 4096)
            except OSError as exc:  # EIO: no process holds the other end any more
                assert exc.errno == errno.EIO
                break
            got += data
    return got


def set_size(fd: int, rows: int, columns: int) -> None:
    import fcntl

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


# A command waiting for its ^C. Not a blocking sys.stdin.read(): CPython acts on a signal only
# between bytecodes or when a system call returns EINTR, so a SIGINT that lands after print()
# and before read() starts is noted and never acted on, and the command reads for ever (a suite
# run hung on it: the test types ^C as soon as the command has printed). A sleep in a loop acts
# on it at once, or at the next turn.
WAITS_FOR_CTRL_C = "import time\nwhile True:\n    time.sleep(0.05)"

CHILD_ON_A_PTY = """
import os, sys
print("leader", os.getsid(0) == os.getpid(), "tty", os.isatty(0) and os.isatty(1), flush=True)
print("size", *os.get_terminal_size(), flush=True)
line = sys.stdin.readline()
print("got", line.strip(), "size", *os.get_terminal_size(), flush=True)
sys.exit(4)
"""


def test_on_a_terminal_the_command_gets_a_pty_of_its_own_and_its_size(fake_terminal, children):
    typing, terminal_fd = fake_terminal
    set_size(terminal_fd, 33, 101)
    before = termios.tcgetattr(terminal_fd)
    terminal = Terminal(stdin=terminal_fd, stdout=terminal_fd)
    assert terminal.interactive
    child, master = spawn_pty(
        [PY, "-c", CHILD_ON_A_PTY], dict(os.environ), interactive.window_size(terminal_fd)
    )
    children.append(child)

    def user() -> None:  # resizes the window, then types a line
        read_until(typing, b"size 101 33")
        set_size(terminal_fd, 40, 120)
        os.kill(os.getpid(), signal.SIGWINCH)  # as the terminal would on a resize
        os.write(typing, b"hello\r")

    seen = threading.Thread(target=user)
    seen.start()
    code = interact(child, master, terminal, Notes())
    seen.join(5)

    assert code == 4
    out = read_until(typing, b"size 120 40")
    assert b"got hello size 120 40" in out
    assert termios.tcgetattr(terminal_fd) == before  # out of raw mode again


@pytest.mark.parametrize("in_gpu", ["default", "ignored"])
def test_ctrl_c_on_the_terminal_reaches_the_command_on_its_pty(fake_terminal, children, in_gpu):
    """Also where gpu's own process ignores SIGINT (a script's `trap '' INT`): an ignored signal
    stays ignored across exec, and no Ctrl-C could stop the command."""
    typing, terminal_fd = fake_terminal
    terminal = Terminal(stdin=terminal_fd, stdout=terminal_fd)
    code = f"print('ready', flush=True); {WAITS_FOR_CTRL_C}"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if in_gpu == "ignored" else signal.SIG_DFL)
    try:
        child, master = spawn_pty([PY, "-c", code], dict(os.environ), None)
    finally:
        signal.signal(signal.SIGINT, previous)
    children.append(child)
    # Generous waits, and never a hang: a command that never gets the ^C is killed through its
    # handle after 90 s, and what it ignored is said.
    threading.Thread(target=lambda: read_until(typing, b"ready", 60) and os.write(typing, b"\x03")).start()
    seen: list[str] = []

    def rescue() -> None:
        with contextlib.suppress(OSError):
            seen.append(Path(f"/proc/{child.pid}/status").read_text())
        child.signal(signal.SIGKILL)

    timer = threading.Timer(90, rescue)
    timer.start()
    try:
        code = interact(child, master, terminal, Notes())  # the main thread's: it sets signal handlers
    finally:
        timer.cancel()
    ignored = [line for status in seen for line in status.splitlines() if line.startswith("Sig")]
    assert code == 130, f"the command never got the ^C: {ignored}"  # SIGINT: 128 + 2


# --- the watch ------------------------------------------------------------------------------------


IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(30)"
)


def started(argv: list[str], children: list[Child]) -> Child:
    """A plain child that has said it is ready (its own signal handling in place)."""
    read, write = os.pipe()
    popen = subprocess.Popen(argv, stdout=write, start_new_session=True)
    child = Child(popen.pid, popen)
    os.close(write)
    children.append(child)
    with os.fdopen(read, "rb") as pipe:
        assert pipe.readline() == b"ready\n"
    return child


def test_at_the_end_the_command_gets_sigterm_then_sigkill_after_the_grace(children):
    child = started([PY, "-c", IGNORES_SIGTERM], children)
    notes, booking = Recorded(), session(ends_in=0.3, grace=0.3)
    watch = Watch(child, booking, notes)
    begun = time.monotonic()
    threading.Thread(target=watch.run, daemon=True).start()

    assert child.wait() == 137
    assert 0.5 < time.monotonic() - begun < 3
    assert watch.reason == f"the booking #12 ended at {clock_time(booking.ends_at)}"
    assert notes.lines[-2:] == [
        f"stopping sleep 30: {watch.reason}",
        "sleep 30 was still running 0.3 s after SIGTERM: SIGKILL",
    ]
    assert "ends at" in notes.lines[0] and "(in 1 min)" in notes.lines[0]  # the warning came first


def test_it_warns_once_before_the_end_and_follows_an_extension(children):
    child = started(["sh", "-c", "echo ready; exec sleep 30"], children)
    notes, booking = Recorded(), session(ends_in=600.3)
    watch = Watch(child, booking, notes)
    threading.Thread(target=watch.run, daemon=True).start()

    wait_for(lambda: notes.lines, 5, interval=0.05)
    assert notes.lines == [
        f"booking #12 ends at {clock_time(booking.ends_at)} (in 10 min): save your work; "
        "extend the booking on the portal to keep going."
    ]
    # Extended by an hour: no second warning, no stop, until the end comes nearer again.
    later = booking.ends_at + timedelta(hours=1)
    watch.update({"ends_at": later.isoformat(), "warn_at": (later - timedelta(minutes=10)).isoformat()})
    time.sleep(0.3)
    assert len(notes.lines) == 1 and not child.poll()
    # Released now (the end moves to the past): stopped at once.
    now = datetime.now(UTC)
    watch.update({"ends_at": now.isoformat(), "warn_at": (now - timedelta(minutes=10)).isoformat()})
    assert child.wait() == 143
    assert notes.lines[-1] == f"stopping sleep 30: the booking #12 ended at {clock_time(now)}"


class FakeBeats:
    """The portal's part for beat_loop, in-process: PATCH answers; each beat answers `beat()`."""

    def __init__(self, beat: Callable[[], dict[str, Any]]) -> None:
        self.beat, self.calls = beat, []

    def request(self, method: str, path: str, **kwargs: Any) -> None:
        self.calls.append((method, path, kwargs.get("json")))

    def post(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(("POST", path, kwargs.get("json")))
        return self.beat()


def unreachable() -> dict[str, Any]:
    raise Unreachable("Cannot reach the portal at http://portal: [Errno 111] Connection refused.")


def test_beats_that_cannot_reach_the_portal_leave_the_last_end_in_force(children):
    child = started([PY, "-c", IGNORES_SIGTERM.replace("signal.SIG_IGN", "signal.SIG_DFL")], children)
    # Two seconds of beats every 0.05 s: room for the three asserted below on a loaded CI machine
    # (0.5 s once gave a single beat there, with the suite's other workers busy).
    notes, booking = Recorded(), session(ends_in=2.0, beat=0.05)
    watch, portal = Watch(child, booking, notes), FakeBeats(unreachable)
    threading.Thread(target=watch.run, daemon=True).start()
    threading.Thread(target=beat_loop, args=(portal, booking, watch, child), daemon=True).start()

    assert child.wait() == 143
    watch.finish()
    (patch, *beats) = portal.calls
    assert patch[:2] == ("PATCH", "sessions/5/") and patch[2]["pid"] == child.pid
    assert isinstance(patch[2]["pid_started"], float)  # psutil is in this environment
    assert len(beats) >= 3 and {call[1] for call in beats} == {"sessions/5/beat/"}
    (away,) = [line for line in notes.lines if "did not answer" in line]  # said once, not per beat
    assert away.endswith(f"goes on, until {clock_time(booking.ends_at)} at the latest.")


def test_an_end_asked_for_on_the_portal_stops_the_command(children):
    child = started(["sh", "-c", "echo ready; exec sleep 30"], children)
    notes, booking = Recorded(), session(beat=0.05)
    answer = {
        "status": "running",
        "ends_at": booking.ends_at.isoformat(),
        "warn_at": booking.warn_at.isoformat(),
    }
    portal = FakeBeats(lambda: {**answer, "end_requested": True, "message": "ended by alice"})
    watch = Watch(child, booking, notes)
    threading.Thread(target=watch.run, daemon=True).start()
    threading.Thread(target=beat_loop, args=(portal, booking, watch, child), daemon=True).start()

    assert child.wait() == 143
    assert watch.reason == "ended by alice (booking #12)"


# --- the installed command against a stand-in portal ----------------------------------------------


class FakeSessions:
    """The portal's sessions API on 127.0.0.1, as the contract says: POST sessions/ (201, or 400
    with `refusal`), PATCH sessions/<id>/, POST …/beat/ (`beat(n)` for the n-th, else the end as
    given) and POST …/finish/. It records (method, path, JSON body) of each request."""

    def __init__(self, *, ends_in: float = 3600, refusal: str | None = None, **fields: Any) -> None:
        self.ends_in, self.refusal, self.requests = ends_in, refusal, []
        self.ends_at = datetime.now(UTC) + timedelta(seconds=ends_in)  # from the session's opening on
        self.beat: Callable[[int], tuple[int, dict[str, Any]]] = lambda n: (200, self.times())
        self.session = {
            "id": 5, "kind": "exec", "status": "starting", "reservation": 12, "server": "box1",
            "env": {"CUDA_VISIBLE_DEVICES": UUID, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                    "PORTAL_RESERVATION_ID": "12"},
            **self.times(), "beat_seconds": 0.1, "grace_seconds": 0.5, "launcher": False, **fields,
        }  # fmt: skip
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                status, answer = fake.answer(self.command, self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_PATCH = answer

            def log_message(self, *args: object) -> None:
                pass

        self.server, self.url = serving(Handler)

    def times(self) -> dict[str, Any]:
        warn_at = self.ends_at - timedelta(minutes=10)
        return {"ends_at": self.ends_at.isoformat(), "warn_at": warn_at.isoformat(), "end_requested": False}

    def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        self.requests.append((method, path, body))
        if (method, path) == ("POST", "/api/v1/sessions/"):
            self.ends_at = datetime.now(UTC) + timedelta(seconds=self.ends_in)
            if self.refusal:
                return 400, {
                    "detail": self.refusal,
                    "code": "invalid",
                    "errors": {"reservation": [self.refusal]},
                }
            return 201, {**self.session, **self.times(), "command": body["command"]}
        if path.endswith("/beat/"):
            return self.beat(len(self.called("beat")))
        return 200, {"id": 5}

    def called(self, what: str) -> list[Any]:
        """The bodies of the requests of one kind: open, pid, beat, finish."""
        kinds = {"open": ("POST", "sessions/"), "pid": ("PATCH", "sessions/5/")}
        method, tail = kinds.get(what, ("POST", f"sessions/5/{what}/"))
        return [body for m, path, body in self.requests if m == method and path == api.API_ROOT + tail]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake(tmp_path) -> Iterator[Callable[..., FakeSessions]]:
    started: list[FakeSessions] = []

    def start(**kwargs: Any) -> FakeSessions:
        started.append(FakeSessions(**kwargs))
        return started[-1]

    yield start
    for each in started:
        each.close()


def environment(fake: FakeSessions, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        name: value for name, value in os.environ.items() if not name.startswith(("CUDA_", "PORTAL_", "GPU_"))
    }
    return {
        **env, config.URL_ENV: fake.url, config.TOKEN_ENV: "a-token", api.RETRY_ENV: "0",
        "XDG_CONFIG_HOME": str(tmp_path / "config"), interactive.HOST_ENV: "box1", **extra,
    }  # fmt: skip


def gpu(fake: FakeSessions, tmp_path: Path, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    env = environment(fake, tmp_path, **kwargs.pop("env", {}))
    kwargs.setdefault("stdin", None if "input" in kwargs else subprocess.DEVNULL)
    return subprocess.run([GPU_BIN, *args], env=env, capture_output=True, text=True, timeout=30, **kwargs)


def test_exec_runs_the_command_with_the_bookings_environment_and_exits_with_its_code(fake, tmp_path):
    portal = fake()

    script = "echo $CUDA_VISIBLE_DEVICES; echo $$; exit 3"
    done = gpu(portal, tmp_path, "exec", "--", "sh", "-c", script)

    assert done.returncode == 3, done.stderr
    uuid, pid = done.stdout.splitlines()  # the command's output, and nothing of gpu's
    assert uuid == UUID
    assert portal.called("open") == [
        {"reservation": None, "kind": "exec", "host": "box1", "command": ["sh", "-c", script]}
    ]
    (registered,) = portal.called("pid")
    # Told before the finish; when it started, where psutil still found it (it is over in a moment).
    assert registered["pid"] == int(pid) and isinstance(registered["pid_started"], (float, type(None)))
    methods = [(method, path.rsplit("/", 2)[-2]) for method, path, _ in portal.requests]
    assert methods.index(("PATCH", "5")) < methods.index(("POST", "finish"))
    assert portal.called("finish") == [{"exit_code": 3, "message": ""}]
    assert done.stderr == ""


def test_exec_takes_a_reservation_and_leaves_the_commands_options_to_it(fake, tmp_path):
    portal = fake()
    done = gpu(portal, tmp_path, "exec", "-r", "12", "sh", "-c", "echo $0 $1", "-r", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "-r --help\n"
    assert portal.called("open")[0]["reservation"] == 12


def test_the_portals_refusal_exits_1_and_runs_nothing(fake, tmp_path):
    refusal = "You have no booking active now on box1: name one with --reservation."
    portal = fake(refusal=refusal)
    done = gpu(portal, tmp_path, "exec", "--", "sh", "-c", "echo ran")
    assert done.returncode == 1
    assert done.stdout == "" and done.stderr.startswith(f"Error: {refusal}")
    assert [r[:2] for r in portal.requests] == [("POST", "/api/v1/sessions/")]


def test_a_command_not_found_exits_127_and_the_portal_hears_why(fake, tmp_path):
    portal = fake()
    done = gpu(portal, tmp_path, "exec", "--", "no-such-command-here", "x")
    assert done.returncode == 127
    assert done.stderr == "[gpu] no-such-command-here: command not found\n"
    assert portal.called("finish") == [
        {"exit_code": None, "message": "no-such-command-here: command not found"}
    ]


def test_shell_runs_the_users_shell_in_the_booking(fake, tmp_path):
    portal = fake()
    done = gpu(
        portal, tmp_path, "shell", "--reservation", "12", env={"SHELL": "/bin/sh"},
        input="echo $CUDA_DEVICE_ORDER $PORTAL_RESERVATION_ID; exit 5\n",
    )  # fmt: skip
    assert done.returncode == 5, done.stderr
    assert done.stdout == "PCI_BUS_ID 12\n"
    assert portal.called("open")[0] == {
        "reservation": 12,
        "kind": "shell",
        "host": "box1",
        "command": ["/bin/sh"],
    }


def test_the_end_stops_the_command_while_the_portal_does_not_answer(fake, tmp_path):
    portal = fake(ends_in=1.0)
    portal.beat = lambda n: (503, {"detail": "database unavailable", "service": "database"})

    done = gpu(portal, tmp_path, "exec", "--", "sleep", "30")

    assert done.returncode == 143, done.stderr
    ended = f"the booking #12 ended at {clock_time(portal.ends_at)}"
    assert f"[gpu] stopping sleep 30: {ended}\n" in done.stderr
    assert "[gpu] the portal did not answer (The portal is unavailable" in done.stderr
    assert portal.called("finish") == [{"exit_code": 143, "message": ended}]


def test_an_end_asked_for_on_the_portal_stops_the_command_and_says_so(fake, tmp_path):
    portal = fake()
    portal.beat = lambda n: (200, {**portal.times(), "end_requested": n >= 2, "message": ""})

    done = gpu(portal, tmp_path, "exec", "--", "sleep", "30")

    assert done.returncode == 143, done.stderr
    assert "[gpu] stopping sleep 30: the session on booking #12 was ended from the portal\n" in done.stderr
    assert portal.called("finish")[0]["message"] == "the session on booking #12 was ended from the portal"


def test_signals_to_gpu_are_passed_on_to_the_command(fake, tmp_path):
    portal = fake()
    env = environment(portal, tmp_path)
    command = [GPU_BIN, "exec", "--", "sh", "-c", "echo started; sleep 30"]
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout.readline() == "started\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 143
    assert portal.called("finish") == [{"exit_code": 143, "message": ""}]


def test_on_a_terminal_gpu_exec_gives_the_command_a_terminal_and_gives_the_terminal_back(
    fake, tmp_path, fake_terminal
):
    portal = fake()
    typing, terminal_fd = fake_terminal
    set_size(terminal_fd, 24, 80)
    before = termios.tcgetattr(terminal_fd)
    code = CHILD_ON_A_PTY.replace("sys.exit(4)", WAITS_FOR_CTRL_C)
    command = [GPU_BIN, "exec", "--", PY, "-c", code]
    env = environment(portal, tmp_path)
    fds = {"stdin": terminal_fd, "stdout": terminal_fd, "stderr": terminal_fd}
    with subprocess.Popen(command, env=env, start_new_session=True, **fds) as proc:
        try:
            assert b"leader True tty True" in read_until(typing, b"size 80 24")
            os.write(typing, b"typed\r")
            assert b"got typed" in read_until(typing, b"got typed")
            os.write(typing, b"\x03")  # Ctrl-C, to the command's foreground job on its own pty
            assert proc.wait(10) == 130
        finally:
            # After a failure above, Popen's exit would wait on gpu for ever (a run hung 14
            # minutes here): its group is killed through the handle, its unreaped child's pid;
            # the command, in a session of its own on gpu's pty, is hung up with it.
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert termios.tcgetattr(terminal_fd) == before
    assert portal.called("finish") == [{"exit_code": 130, "message": ""}]


def test_the_commands_are_registered():
    from gpu_cli.main import cli

    assert {"exec", "shell"} <= set(cli.commands)
    assert isinstance(cli.commands["exec"], click.Command)


def test_a_python_script_runs_through_the_launcher_when_the_portal_says_so(fake, tmp_path):
    portal = fake(launcher=True)
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        "import os, sys\nprint('launched', sys.argv[1:], os.environ['CUDA_VISIBLE_DEVICES'])\n"
    )
    (tmp_path / "train.py").write_text("")

    done = gpu(
        portal,
        tmp_path,
        "exec",
        PY,
        "train.py",
        "--lr",
        "0.1",
        env={"PORTAL_LAUNCHER": str(launcher)},
        cwd=tmp_path,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout == f"launched ['train.py', '--lr', '0.1'] {UUID}\n"
    assert portal.called("open")[0]["command"] == [PY, "train.py", "--lr", "0.1"]  # as typed
