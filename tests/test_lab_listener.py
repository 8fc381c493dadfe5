"""A starting lab against another account on its GPU host (jobs.host.lab_listener, jobs/host/jupyter/
lab_launcher.py): the attack of issue 30, item 1, performed against the real code.

The racer is a second process, as another account (nobody, where the tests run as root): it
watches /proc for its victim's lab (its folder, the owner's HOME, on the command line), takes the port from
`--ServerApp.port=N` where the command line says it (what the worker did before) or from the
new listeners in /proc/net/tcp, binds that port on SESSION_BIND_ADDRESS as soon as it can
(retrying while it is taken) and records every request it is sent, with its Authorization header.
Against a worker that published a port for Jupyter to bind later, it wins the race and is sent
the lab's token; against this one it never binds the lab's address. Where a lab itself lets go
of its listener (a stand-in launcher), the racer does get the address, and the worker refuses it
without a token, loudly. The supervisor runs in a thread of this process (lab_run), as a
worker's pool process runs it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from jobs.host import lab, lab_listener
from jobs.host.executors import local
from jobs.models import InteractiveSession, lab_path
from jobs.sessions.services import session_start
from portal.models import AuditEntry, Notification
from portal.pids import ProcessId, groups_of, send_group
from tests.job_helpers import alive, kill_quietly, portal_process, recorded_process
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

NOBODY = 65534

RACER = r"""
import json, os, socket, sys, threading, time

host, marker = sys.argv[1], sys.argv[2].encode()


def say(**event):
    print(json.dumps(event), flush=True)


def listening():
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def serve(sock, port):
    # Whatever it is asked, it answers as a Jupyter server would: 200 and JSON.
    body = json.dumps({"version": "2.21.1", "started": "2000-01-01T00:00:00Z", "connections": 0,
                       "kernels": 0, "last_activity": "2000-01-01T00:00:00Z"}).encode()
    while True:
        conn, _ = sock.accept()
        conn.settimeout(5)
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        head = data.split(b"\r\n\r\n")[0].decode(errors="replace").split("\r\n")
        auth = [h.split(":", 1)[1].strip() for h in head[1:] if h.lower().startswith("authorization:")]
        say(event="request", port=port, line=head[0], authorization=auth[0] if auth else None)
        with_body = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
        try:
            conn.sendall(with_body + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        except OSError:
            pass
        conn.close()


def grab(port, refused):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(16)
    except OSError as exc:
        sock.close()
        if port not in refused:
            refused.add(port)
            say(event="refused", port=port, errno=exc.errno)
        return False
    say(event="bound", port=port)
    threading.Thread(target=serve, args=(sock, port), daemon=True).start()
    return True


before, wanted, refused, taken, lab = listening(), set(), set(), set(), None
say(event="ready", uid=os.getuid())
while True:
    if lab is None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                argv = open("/proc/%s/cmdline" % pid, "rb").read().split(b"\0")
            except OSError:
                continue
            if marker in argv:
                lab = int(pid)
                say(event="lab", pid=lab, argv=[arg.decode(errors="replace") for arg in argv])
                wanted |= {int(arg.split(b"=")[1]) for arg in argv if arg.startswith(b"--ServerApp.port=")}
                break
    if lab is not None and not os.path.exists("/proc/%d" % lab):
        say(event="lab gone")  # nothing more to take: its ports go back to whoever wants them
        break
    if lab is not None:
        wanted |= listening() - before - taken
        taken |= {port for port in wanted if grab(port, refused)}
        wanted -= taken
    time.sleep(0.005)
"""


class Racer:
    """RACER in a process of its own, as another account; its events as they come."""

    def __init__(self, host: str, marker: str) -> None:
        python, account = _other_account()
        self.proc = subprocess.Popen(
            [python, "-I", "-c", RACER, host, marker],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd="/",
            **account,
        )
        self.events: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.wait(lambda e: e["event"] == "ready", "the racer to start")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def wait(self, predicate: Callable[[dict], bool], what: str) -> dict:
        first = wait_for(lambda: next((e for e in list(self.events) if predicate(e)), None), 60, what=what)
        assert isinstance(first, dict)
        return first

    def requests(self, port: int) -> list[dict]:
        return [e for e in list(self.events) if e["event"] == "request" and e["port"] == port]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _other_account() -> tuple[str, dict]:
    """The racer's Python and account: nobody, with the system's Python (the standard library is
    all it needs), where the tests run as root; else this account, a separate process all the same."""
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() == 0 and system_python:
        return system_python, {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    return sys.executable, {}


class LabRun:
    """A lab row of alice's, run by the real `lab_run` in a thread once started."""

    def __init__(self, session: InteractiveSession) -> None:
        self.session = session
        self.outcome: list[str | None] = []
        self.thread = threading.Thread(
            target=lambda: self.outcome.append(lab.lab_run(session.pk)), daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def ended(self) -> str | None:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the lab's supervisor did not end"
        self.session.refresh_from_db()
        return self.outcome[0]


@pytest.fixture
def lab_run(alice, box, settings, monkeypatch, tmp_path) -> Iterator[LabRun]:
    """alice's lab on her 8 GiB booking of box1 GPU 0, in a folder of its own; its thread ended
    and its processes gone afterwards."""
    settings.JOB_ROOTS = [tmp_path / "home"]
    settings.JOB_KILL_GRACE_SECONDS = 2
    settings.SESSION_START_SECONDS = 60
    monkeypatch.setattr("jobs.sessions.services._send", lambda pk, queue: None)  # no broker: run here
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    session, _ = session_start(user=alice, reservation=booking.pk, kind="jupyterlab")
    run = LabRun(session)
    yield run
    InteractiveSession.objects.filter(pk=session.pk).update(end_requested_at=timezone.now())
    if run.thread.is_alive():
        run.thread.join(timeout=30)
    session.refresh_from_db()
    if session.pid and session.pid_started:  # its group, read through its leader proved alive
        for group in groups_of([ProcessId(session.pid, session.pid_started)]):
            send_group(group, signal.SIGKILL)


@pytest.fixture
def racer(settings) -> Iterator[Callable[[], Racer]]:
    """Start the racer, after `lab_run`: its victim is the lab whose folder is alice's (her HOME,
    where labs run as their owners' accounts; anyone can read it on the lab's command line)."""
    started: list[Racer] = []

    def start() -> Racer:
        started.append(Racer(settings.SESSION_BIND_ADDRESS, f"--ServerApp.root_dir={settings.JOB_ROOTS[0]}"))
        return started[-1]

    # One racer on the machine at a time. A racer takes every port that starts listening after
    # it, as an attacker would; two at once (this file's tests in two test processes) both bound
    # one lab's port (SO_REUSEPORT, one account), and the worker's poll reached the other racer.
    lock = _machine_lock(Path(tempfile.gettempdir()) / "portal-tests-port-racer.lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield start
        for one in started:
            one.stop()
    finally:
        os.close(lock)


def _machine_lock(path: Path) -> int:
    """A file to flock, shared by every account's test runs: opened for reading (another
    account's file in /tmp cannot be opened for writing, nor with O_CREAT where the kernel
    protects regular files in sticky folders), made only where missing."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        lock = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        os.fchmod(lock, 0o644)  # whatever the umask: readable by every account
        return lock


def _status(session: InteractiveSession) -> str:
    return InteractiveSession.objects.values_list("status", flat=True).get(pk=session.pk)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_a_racing_account_never_gets_the_labs_address_nor_its_token(lab_run, racer):
    session = lab_run.session
    attacker = racer()
    lab_run.start()
    found = attacker.wait(lambda e: e["event"] == "lab", "the racer to find the lab's process")
    wait_for(lambda: _status(session) != "starting", 90, what="the lab to start")
    session.refresh_from_db()
    assert session.address, session.message
    port = _port(session.address)
    attempt = attacker.wait(
        lambda e: e["event"] in ("refused", "bound") and e["port"] == port, "the racer to try the lab's port"
    )
    stolen = [e for e in list(attacker.events) if session.token in str(e.get("authorization"))]
    assert not stolen, f"the racer was sent the lab's token: {stolen}"
    assert attempt["event"] == "refused" and attempt["errno"] == errno.EADDRINUSE
    assert not any(arg.startswith("--ServerApp.port") for arg in found["argv"])  # nothing to read there
    assert session.status == "running", session.message
    # The address the row gives is the real Jupyter's: its own API answers with the token, and the
    # socket listening there is the lab's process's.
    answer = httpx.get(
        f"http://{session.address}{lab_path(session.pk)}api/kernelspecs",
        headers={"Authorization": f"token {session.token}"},
    )
    assert answer.status_code == 200 and "python3" in answer.json()["kernelspecs"]
    held = psutil.Process(session.pid).net_connections(kind="tcp")
    assert any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in held)
    assert not attacker.requests(port)  # nothing ever reached it there


def _stand_in(tmp_path: Path, monkeypatch, code: str) -> None:
    """The lab's launcher replaced by `code`, run as the launcher is (the job's interpreter, the
    lab's argv, its account, the inherited socket named in PORTAL_LAB_LISTEN_FD)."""
    launcher = tmp_path / "stand_in.py"
    launcher.write_text(code)
    monkeypatch.setattr(lab, "LAB_LAUNCHER", launcher)


def _assert_refused_loudly(run: LabRun, owner, why: str) -> None:
    """The lab ended failed saying `why`, its owner told, the audit log written, its process gone."""
    assert run.ended() == "failed"
    session = run.session
    assert session.status == "failed" and session.address == ""
    assert "is not the JupyterLab the worker started" in session.message and why in session.message
    told = Notification.objects.get(user=owner, kind=Notification.Kind.JOB_STOPPED)
    assert "did not start" in told.subject and "is not the JupyterLab the worker started" in told.body
    audit = AuditEntry.objects.get(action=AuditEntry.Action.SESSION_STOP, target=f"session {session.pk}")
    assert "Refused to start" in audit.message and why in audit.message
    stand_in = recorded_process(session.pid, session.pid_started)
    assert session.pid and not alive(stand_in)  # the stand-in was ended


LETS_GO = """
import os, socket, sys, time
from pathlib import Path
sock = socket.socket(fileno=int(os.environ["PORTAL_LAB_LISTEN_FD"]))
Path({port!r}).write_text(str(sock.getsockname()[1]))
while not Path({go!r}).exists():  # until the racer has tried the port while it was the lab's
    time.sleep(0.01)
sock.close()  # the port is anyone's again
time.sleep(600)
"""


def test_a_lab_that_let_go_of_its_listener_is_refused_without_the_token(
    lab_run, racer, alice, tmp_path, monkeypatch
):
    go, port_file = tmp_path / "go", tmp_path / "port"
    _stand_in(tmp_path, monkeypatch, LETS_GO.format(go=str(go), port=str(port_file)))
    attacker = racer()
    lab_run.start()
    port = int(wait_for(lambda: port_file.exists() and port_file.read_text(), 60, what="the lab's port"))
    attacker.wait(lambda e: e["event"] == "refused" and e["port"] == port, "the racer to try the lab's port")
    go.touch()
    attacker.wait(lambda e: e["event"] == "bound" and e["port"] == port, "the racer to take the port let go")
    # The worker did reach the racer (its readiness poll), and sent it no token.
    attacker.wait(lambda e: e["event"] == "request" and e["port"] == port, "the worker's poll")
    _assert_refused_loudly(lab_run, alice, "listens there, not the socket")
    assert lab_run.session.message.startswith(f"The server at 127.0.0.1:{port} is not")
    assert not [e for e in attacker.requests(port) if e["authorization"]]
    assert not [e for e in list(attacker.events) if lab_run.session.token in str(e.get("authorization"))]


HANDS_OFF = """
import os, socket, sys, time
sock = socket.socket(fileno=int(os.environ["PORTAL_LAB_LISTEN_FD"]))
closed, told = os.pipe()
if os.fork() == 0:  # a process of its own, in a session of its own, serves the lab's address
    os.setsid()
    open({pid!r}, "w").write(str(os.getpid()))
    os.read(closed, 1)  # once the lab's own process no longer holds the socket
    with open({log!r}, "a") as log:
        while True:
            conn, _ = sock.accept()
            log.write(repr(conn.recv(65536)) + "\\n")
            log.flush()
            conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nConnection: close\\r\\n\\r\\n{{}}")
            conn.close()
sock.close()
os.write(told, b"x")
time.sleep(600)
"""


def test_a_lab_whose_listener_another_process_holds_is_refused_without_the_token(
    lab_run, alice, tmp_path, monkeypatch
):
    pid_file, log = tmp_path / "pid", tmp_path / "requests"
    _stand_in(tmp_path, monkeypatch, HANDS_OFF.format(pid=str(pid_file), log=str(log)))
    lab_run.start()
    try:
        wait_for(lambda: log.exists() and log.read_text(), 60, what="the worker's poll")
        _assert_refused_loudly(lab_run, alice, "is not held by the lab's process")
        assert lab_run.session.token not in log.read_text() and "Authorization" not in log.read_text()
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError):  # not started, or its pid half written
            pid = int(pid_file.read_text())
            kill_quietly([portal_process(pid, "PORTAL_SESSION_ID", lab_run.session.pk)])


@pytest.fixture
def not_a_listener(request, tmp_path) -> Iterator[tuple[dict[str, str], list[int]]]:
    """What PORTAL_LAB_LISTEN_FD names instead of a listening TCP socket (nothing: the variable
    is unset), and the fds to pass."""
    held: list = []
    if request.param == "file":
        held.append(open(tmp_path / "file", "w"))  # noqa: SIM115 - closed below
    elif request.param == "udp":
        held.append(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    elif request.param == "unlistened":
        held.append(socket.socket())
        held[-1].bind(("127.0.0.1", 0))
    named = {"missing": {}, "closed": {"PORTAL_LAB_LISTEN_FD": "57"}}.get(request.param)
    yield (
        (named if named is not None else {"PORTAL_LAB_LISTEN_FD": str(held[-1].fileno())}),
        [thing.fileno() for thing in held],
    )
    for thing in held:
        thing.close()


@pytest.mark.parametrize(
    ("not_a_listener", "said"),
    [
        ("missing", "does not name the listening socket's fd"),
        ("closed", "is not open"),
        ("file", "is not a socket"),
        ("udp", "is not a TCP socket"),
        ("unlistened", "is a TCP socket that is not listening"),
    ],
    indirect=["not_a_listener"],
)
def test_the_launcher_refuses_to_start_without_a_listening_socket(not_a_listener, said):
    named, fds = not_a_listener
    env = {key: value for key, value in os.environ.items() if key != "PORTAL_LAB_LISTEN_FD"}
    done = subprocess.run(
        [sys.executable, str(lab.LAB_LAUNCHER), "--no-browser", "--ServerApp.ip=127.0.0.1"],
        env={**env, **named},
        pass_fds=fds,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == lab.LISTENER_REFUSED_EXIT_CODE
    assert said in done.stderr and "it never binds a port of its own" in done.stderr
    assert "ServerApp" not in done.stderr  # refused before Jupyter was even loaded


def test_a_launcher_that_got_no_socket_fails_the_lab_loudly(lab_run, alice, monkeypatch):
    real = local.start_job_process
    monkeypatch.setattr(local, "start_job_process", lambda argv, **kw: real(argv, **{**kw, "pass_fds": []}))
    lab_run.start()
    assert lab_run.ended() == "failed"
    session = lab_run.session
    assert session.message.startswith("JupyterLab refused the listening socket the worker passed it: ")
    assert "PORTAL_LAB_LISTEN_FD) is not open" in session.message and session.address == ""
    assert Notification.objects.filter(user=alice, kind=Notification.Kind.JOB_STOPPED).count() == 1
    assert AuditEntry.objects.filter(
        action=AuditEntry.Action.SESSION_STOP, target=f"session {session.pk}", message__contains="refused"
    ).exists()


def test_the_token_goes_only_over_a_connection_to_the_labs_own_socket(lab_run):
    """The supervisor's polls with the token (`LabSupervisor._api`) check, once connected, that
    the socket it made still listens there: a lab gone and its port taken by someone else meanwhile
    gets the connection and nothing on it."""
    supervisor = lab.LabSupervisor(lab_run.session)
    sock, supervisor.listener = lab_listener.listen("127.0.0.1")
    sock.close()  # the lab's socket is gone...
    impostor = socket.socket()
    impostor.bind(("127.0.0.1", supervisor.listener.port))  # ...and another listens at its address
    impostor.listen()
    received: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = impostor.accept()
            except OSError:
                return
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                received.append(conn.recv(65536))
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        assert supervisor._api("kernels") is None
        assert supervisor._api("", token=False) == {}  # it answers: the poll without a token reaches it
        wait_for(lambda: len(received) == 2, 10, what="both connections")
    finally:
        impostor.close()
    assert received[0] == b"" and b"GET /sessions/" in received[1]
    assert not any(b"uthorization" in data or lab_run.session.token.encode() in data for data in received)


def test_a_labs_sockets_are_read_as_its_own_account_where_the_worker_may_not(settings):
    """A worker with JOB_USER has no CAP_SYS_PTRACE, so another account's /proc/<pid>/fd is closed
    to it: a process started as the lab's account reads it (`_fd_links_as`), with no privileges."""
    python, account = _other_account()
    if not account:
        pytest.skip("needs root to start a process as another account")
    settings.JOB_INTERPRETERS = {"default": python}
    code = (
        "import os, socket, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(os.fstat(s.fileno()).st_ino, flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([python, "-c", code], stdout=subprocess.PIPE, cwd="/", **account)
    try:
        assert holder.stdout is not None
        inode = int(holder.stdout.readline())
        links = lab_listener._fd_links_as(holder.pid, uid=NOBODY, gid=NOBODY)
        assert f"socket:[{inode}]" in links
        assert lab_listener._fd_links_as(os.getpid(), uid=NOBODY, gid=NOBODY) == []  # root's: closed to it
    finally:
        holder.kill()
        holder.wait()
