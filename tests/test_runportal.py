"""`make run` keeps running: the supervisor's restart logic, and the real `runportal` surviving
a SIGKILLed GPU host worker in the middle of a job."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from portal.embedded_redis import embedded_redis
from portal.supervisor import (
    HEALTHY_AFTER_SECONDS,
    MAX_DELAY_SECONDS,
    Backoff,
    ChildSpec,
    ProcessSupervisor,
    exit_status,
)
from tests.conftest import OUTPUT, ROOT, free_port
from tests.kept_database import sqlite_template
from tests.waiting import wait_for

# A line of the portal's own logging (portal/settings.py LOGGING: "%(asctime)s %(levelname)s %(name)s: ...").
PORTAL_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: ")


# --- the backoff, on an injected clock ----------------------------------------------------


def _delays(backoff: Backoff, uptimes: list[float]) -> list[float]:
    """The delays for deaths after these uptimes, one run after the other."""
    delays, now = [], 1000.0
    for uptime in uptimes:
        delay = backoff.delay(started_at=now, died_at=now + uptime)
        delays.append(delay)
        now += uptime + delay
    return delays


def test_it_doubles_the_delay_from_1_s_up_to_30_s():
    assert MAX_DELAY_SECONDS == 30
    assert _delays(Backoff(), [0.5] * 8) == [1, 2, 4, 8, 16, 30, 30, 30]


def test_it_starts_the_delays_over_after_a_minute_up():
    assert HEALTHY_AFTER_SECONDS == 60
    backoff = Backoff()
    assert _delays(backoff, [1, 1, 1, HEALTHY_AFTER_SECONDS - 0.1]) == [1, 2, 4, 8]
    assert _delays(backoff, [HEALTHY_AFTER_SECONDS, 1, 1]) == [1, 2, 4]


def test_it_keeps_the_cap_after_many_deaths():
    assert _delays(Backoff(), [0] * 200)[-1] == MAX_DELAY_SECONDS


def test_it_names_exit_codes_and_signals():
    assert exit_status(0) == "exit code 0"
    assert exit_status(3) == "exit code 3"
    assert exit_status(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_status(-signal.SIGSEGV) == "killed by SIGSEGV"


# --- the supervisor, with real tiny children and a fake clock --------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def supervise() -> Iterator:
    made: list[ProcessSupervisor] = []

    def make(*specs: ChildSpec, stop_grace: float = 5) -> tuple[ProcessSupervisor, FakeClock, list[str]]:
        clock, lines = FakeClock(), []
        supervisor = ProcessSupervisor(specs, log=lines.append, clock=clock, stop_grace=stop_grace)
        made.append(supervisor)
        supervisor.start()
        return supervisor, clock, lines

    yield make
    for supervisor in made:
        supervisor.stop()


def _poll_until_logged(supervisor: ProcessSupervisor, lines: list[str], count: int) -> str:
    wait_for(lambda: supervisor.poll() or len(lines) >= count, timeout=10, what=f"log line {count}")
    return lines[count - 1]


def test_it_restarts_a_child_after_its_delay(supervise):
    supervisor, clock, lines = supervise(ChildSpec("crasher", ["sh", "-c", "exit 3"]))
    assert _poll_until_logged(supervisor, lines, 1) == "crasher exited (exit code 3); restarting it in 1 s"
    clock.now = 0.9
    supervisor.poll()
    assert len(lines) == 1  # its delay is not over: not started
    clock.now = 1.0
    supervisor.poll()
    assert lines[1].startswith("crasher restarted (pid ")
    assert _poll_until_logged(supervisor, lines, 3) == "crasher exited (exit code 3); restarting it in 2 s"


def test_it_names_the_signal_that_killed_a_child_and_kills_its_leftovers(supervise, tmp_path):
    # The background `sleep` stands for Celery's embedded beat, which outlives a SIGKILLed worker.
    pid_file = tmp_path / "leftover"
    spec = ChildSpec("worker host.box1", ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; exec sleep 300"])
    supervisor, clock, lines = supervise(spec)
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=10, what="the leftover")
    leftover = psutil.Process(int(pid_file.read_text()))
    clock.now = HEALTHY_AFTER_SECONDS  # up a minute: the delay starts over at 1 s
    supervisor.children[0].proc.send_signal(signal.SIGKILL)  # its Popen: never a reaped child's pid
    line = _poll_until_logged(supervisor, lines, 1)
    assert line == "worker host.box1 exited (killed by SIGKILL); restarting it in 1 s"
    wait_for(lambda: _gone(leftover), timeout=5, what="the leftover to be killed with its group")


def test_it_kills_a_child_that_ignores_sigterm_on_stop(supervise, tmp_path):
    ready = tmp_path / "ready"
    script = "import pathlib, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    script += "pathlib.Path(sys.argv[1]).touch()\nwhile True: time.sleep(0.1)\n"
    supervisor, _, lines = supervise(
        ChildSpec("stubborn", [sys.executable, "-c", script, str(ready)]), stop_grace=1
    )
    proc = supervisor.children[0].proc
    wait_for(ready.exists, timeout=10, what="the SIGTERM handler")
    supervisor.stop()
    assert proc.returncode == -signal.SIGKILL
    assert lines == [f"stubborn (pid {proc.pid}) still running 1 s after SIGTERM: killed it (SIGKILL)"]


def test_it_kills_every_group_at_once_when_asked_to_stop_again(supervise, tmp_path):
    # Children that take SIGTERM as a cue to carry on, each with a leftover in its group.
    script = "import pathlib, signal, subprocess, sys, time\n"
    script += "term, leftover = map(pathlib.Path, sys.argv[1:])\n"
    script += "signal.signal(signal.SIGTERM, lambda *_: term.touch())\n"
    script += "leftover.write_text(str(subprocess.Popen(['sleep', '300']).pid))\n"
    script += "while True: time.sleep(0.1)\n"
    terms, pid_files = [tmp_path / f"term{i}" for i in (1, 2)], [tmp_path / f"leftover{i}" for i in (1, 2)]
    specs = [
        ChildSpec(f"stubborn{i}", [sys.executable, "-c", script, str(terms[i]), str(pid_files[i])])
        for i in (0, 1)
    ]
    supervisor, _, lines = supervise(*specs, stop_grace=30)
    procs = [child.proc for child in supervisor.children]
    wait_for(lambda: all(f.exists() and f.read_text() for f in pid_files), timeout=10, what="the leftovers")
    leftovers = [psutil.Process(int(f.read_text())) for f in pid_files]

    def ctrl_c_again() -> None:
        wait_for(lambda: all(t.exists() for t in terms), timeout=10, what="SIGTERM to reach both")
        supervisor.request_stop()

    supervisor.request_stop()  # the first Ctrl-C
    again = threading.Thread(target=ctrl_c_again)
    again.start()
    supervisor.stop()  # returns long before the 30 s grace only if the second request kills
    again.join()
    assert [proc.returncode for proc in procs] == [-signal.SIGKILL, -signal.SIGKILL]
    assert lines == ["asked to stop again: killing every child now"]
    wait_for(
        lambda: all(_gone(p) for p in leftovers), timeout=5, what="the leftovers to go with their groups"
    )


def test_it_never_signals_the_group_of_a_child_reaped_elsewhere(supervise, monkeypatch):
    supervisor, _, lines = supervise(ChildSpec("reaped", ["sh", "-c", "exit 3"]))
    os.waitpid(supervisor.children[0].proc.pid, 0)  # its pid, and group id, are free for reuse now
    signalled: list[int] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: signalled.append(pgid))
    supervisor.poll()
    assert lines[0].startswith("reaped exited (")
    assert signalled == []


# --- the real runportal ----------------------------------------------------------------------

SLEEPER = b"""
import time
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""
INVENTORY = """\
users: [alice]
servers:
  - name: rp1
    cpu_count: 4
    ram_gb: 16
    driver_version: "550.90.07"
    cuda_version: "12.4"
    gpus:
      - {model: NVIDIA RTX A5000, count: 1, memory_gb: 24, power_limit_w: 230}
"""
PASSWORD = "runportal-test"
FINISHED = {"succeeded", "failed", "cancelled", "timed_out", "lost"}


class Api:
    """The running portal over HTTP, as alice (urllib: nothing beyond the standard library)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.headers: dict[str, str] = {}

    def call(self, method: str, path: str, body: bytes | None = None, content_type: str = "") -> tuple:
        request = urllib.request.Request(self.base + path, data=body, method=method, headers=self.headers)
        if content_type:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def answers(self) -> bool:
        try:
            return self.call("GET", "/login/")[0] == 200
        except OSError:  # not listening yet
            return False

    def get(self, path: str) -> dict:
        status, body = self.call("GET", path)
        assert status == 200, body
        return json.loads(body)

    def post(self, path: str, data: dict, files: dict[str, tuple[str, bytes]] | None = None) -> dict:
        if files is None:
            status, body = self.call("POST", path, json.dumps(data).encode(), "application/json")
        else:
            status, body = self.call("POST", path, *_multipart(data, files))
        assert status in (200, 201), body
        return json.loads(body)

    def login(self, username: str, password: str) -> None:
        form = urllib.parse.urlencode({"username": username, "password": password}).encode()
        status, body = self.call("POST", "/api/v1/token/", form, "application/x-www-form-urlencoded")
        assert status == 200, body
        self.headers["Authorization"] = f"Token {json.loads(body)['token']}"

    def job(self, job_id: int) -> dict:
        return self.get(f"/api/v1/jobs/{job_id}/")

    def log(self, job_id: int) -> str:
        return self.call("GET", f"/api/v1/jobs/{job_id}/log/")[1].decode(errors="replace")


def _multipart(fields: dict, files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    for name, (filename, content) in files.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
        parts.append(f"{head}Content-Type: text/x-python\r\n\r\n".encode() + content + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _jobs_on_cards(api: Api, server: str) -> list[str]:
    cards = api.get(f"/api/v1/gpus/?server={server}")
    cards = cards["results"] if isinstance(cards, dict) else cards
    return [process["job"] for card in cards for process in card["processes"]]


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _child(runportal: subprocess.Popen, *, queue: str = "", web: bool = False) -> psutil.Process:
    """runportal's child consuming `queue` (`-Q queue`), or its web server."""
    for child in psutil.Process(runportal.pid).children():
        try:
            argv = child.cmdline()
        except psutil.NoSuchProcess:  # one that ended between the listing and the look
            continue
        if web and "gunicorn" in argv:
            return child
        if queue and "-Q" in argv and argv[argv.index("-Q") + 1] == queue:
            return child
    raise AssertionError(f"runportal has no child for {queue or 'the web server'}")


@pytest.fixture
def runportal(tmp_path) -> Iterator[tuple[subprocess.Popen, Api, Path]]:
    """`manage.py runportal` on its own SQLite file, var dir and Redis: no other test's Celery
    messages or telemetry can reach it. Its output goes to test-output/runportal.log."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    # The suite's migrated database, where it has one: runportal's migrate then finds nothing to
    # do (a migrate from nothing is 6 s of CPU; `make gpu-check`'s test still runs one).
    if (template := sqlite_template()).exists():
        shutil.copyfile(template, tmp_path / "portal.sqlite3")
    port = free_port()
    log_path = OUTPUT / "runportal.log"
    # A short folder for the socket: a unix socket path has a ~100-byte limit.
    with (
        tempfile.TemporaryDirectory(prefix="rp-") as sockets,
        embedded_redis(Path(sockets) / "r.sock") as redis,
    ):
        env = {
            **os.environ,
            "DATABASE_URL": f"sqlite:///{tmp_path / 'portal.sqlite3'}",
            "PORTAL_VAR_DIR": str(tmp_path / "var"),
            "REDIS_URL": redis,
            "GPU_BACKEND": "simulated",
            "SIMULATED_INVENTORY": str(inventory),
            "WORKER_CONCURRENCY": "1",
            "PORT": str(port),
            "BIND_ADDRESS": "127.0.0.1",
            "PORTAL_DEMO_PASSWORD": PASSWORD,
            "TELEMETRY_INTERVAL_SECONDS": "1",
            "SERVER_OFFLINE_AFTER_SECONDS": "5",
            "JOB_HEARTBEAT_SECONDS": "1",
            "JOB_LOST_AFTER_SECONDS": "10",
            "JOB_RECONCILE_SECONDS": "1",
            # Alone, it stands in for WATCHDOG_KILL_GRACE_SECONDS (portal/settings.py, this
            # release only): runportal warns about it once, before the URL, and its children not
            # again after it (the last lines test checks).
            "JOB_KILL_GRACE_SECONDS": "2",
            "RUNPORTAL_STOP_GRACE_SECONDS": "10",
            "PYTHONUNBUFFERED": "1",
        }
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "manage.py", "runportal"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                yield proc, Api(f"http://localhost:{port}"), log_path
            finally:
                _stop_everything(proc)


def _stop_everything(proc: subprocess.Popen) -> None:
    """After a failure: nothing of this test may outlive it."""
    if proc.poll() is not None:
        return
    try:
        left = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        left = []
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for child in left:
        if not _gone(child):
            child.kill()


def _job_on_rp1(api: Api, name: str, script: bytes) -> tuple[int, int]:
    """(booking, job): alice's job on a booking of rp1, once rp1 reports and the job has printed
    its "ready" line."""
    api.login("alice", PASSWORD)
    wait_for(
        lambda: (
            api.call("GET", "/api/v1/servers/rp1/")[0] == 200
            and api.get("/api/v1/servers/rp1/")["status"] == "online"
        ),
        timeout=60,
        what="rp1's first telemetry",
    )
    booking = api.post("/api/v1/reservations/", {"count": 1, "server": "rp1"})["id"]
    job_id = api.post("/api/v1/jobs/", {"reservation": booking}, {"script": (name, script)})["id"]
    wait_for(lambda: "ready" in api.log(job_id), timeout=60, what="the job's first line")
    return booking, job_id


def _check_the_greeting(output: str, port: str) -> None:
    """What `make run` leaves on screen once its workers are up (issue 38): the URL and the demo
    logins last; as root (a container, a first try on a lab server), why, said once before them,
    and none of Celery's own warnings, one per worker, after them."""
    # The portal's own log lines (its format: a time, a level, the logger) are the portal in use,
    # not its start: the web server's about the test's own requests (a 404 while rp1 had not
    # reported yet), and the GPU watchdog's. Celery's own warnings have a format of their own.
    lines = [line for line in output.splitlines() if line.strip() and not PORTAL_LOG_LINE.match(line)]
    assert lines[-3].startswith("GPU lab portal: http://localhost:"), lines[-6:]
    assert lines[-2].startswith(f"JupyterLab sessions: http://127.0.0.1:{port}/")
    assert lines[-1].startswith(f"Demo logins: admin, leader, alice, bob / password {PASSWORD!r}")
    assert "superuser privileges" not in output
    renamed = [n for n, line in enumerate(lines) if "JOB_KILL_GRACE_SECONDS is read in place of" in line]
    assert len(renamed) == 1 and renamed[0] < len(lines) - 3, lines  # once, by runportal, before the URL
    notes = [line for line in lines if line.startswith("Running as root")]
    assert len(notes) == (1 if os.geteuid() == 0 else 0), notes
    if notes:
        assert "JOB_USER is not set, so jobs run as root too" in notes[0] and "JOB_USER=@owner" in notes[0]


@pytest.mark.worker
def test_it_restarts_a_killed_host_worker_and_keeps_serving(runportal):
    proc, api, log_path = runportal
    output = log_path.read_text
    wait_for(api.answers, timeout=120, what=f"the web server (see {log_path})")
    # The same server is the labs' origin on 127.0.0.1 (LAB_ORIGIN), where no portal page answers.
    port = api.base.rsplit(":", 1)[1]
    assert f"JupyterLab sessions: http://127.0.0.1:{port}/" in output()
    status, body = Api(f"http://127.0.0.1:{port}").call("GET", "/login/")
    assert status == 404 and body.startswith(b"Only JupyterLab sessions are served here"), body
    booking, job_id = _job_on_rp1(api, "sleeper.py", SLEEPER)
    _check_the_greeting(output(), port)  # both workers are up: rp1 reported, the collector took it
    # Its card shows it as the job's: the worker gave it this portal's PORTAL_INSTANCE, and the
    # simulated backend shows only processes that carry it (gpus/simulated/local_jobs.py).
    wait_for(lambda: f"job {job_id}" in _jobs_on_cards(api, "rp1"), timeout=30, what="the job on its card")
    # Never its owner's intruder, even at its start, before its pid was recorded (jobs/host/watchdog.py).
    assert "GPU watchdog: intruder" not in output()

    worker, web = _child(proc, queue="host.rp1"), _child(proc, web=True)
    old = worker.children(recursive=True)  # its pool process and, below that, the job
    assert any(p.environ().get("PORTAL_JOB_ID") == str(job_id) for p in old)
    worker.send_signal(signal.SIGKILL)  # the OOM killer, say
    killed_at = time.monotonic()

    wait_for(lambda: "[runportal] worker host.rp1 restarted" in output(), timeout=30, what="the restart")
    assert "[runportal] worker host.rp1 exited (killed by SIGKILL); restarting it in 1 s" in output()
    # Neither the old pool process nor the job kept running beside the new worker.
    wait_for(lambda: all(_gone(p) for p in old), timeout=10, what="the old worker's processes to go")
    within_a_minute = 60 - (time.monotonic() - killed_at)
    wait_for(lambda: api.job(job_id)["status"] in FINISHED, timeout=within_a_minute, what="the job's end")
    job = api.job(job_id)
    assert job["status"] == "lost", job
    # Served all along by the same web server: the old runportal stopped every child when one died.
    assert _child(proc, web=True).pid == web.pid

    # The restarted worker reports telemetry again (its start-up says nothing: make run is quiet,
    # no Celery banner, unless LOG_LEVEL=debug).
    restarted_at = datetime.now(UTC)
    assert " ready." not in output()
    wait_for(
        lambda: datetime.fromisoformat(api.get("/api/v1/servers/rp1/")["last_seen"]) > restarted_at,
        timeout=30,
        what="telemetry from the restarted worker",
    )

    script = b"print('second run', flush=True)\n"
    again = api.post("/api/v1/jobs/", {"reservation": booking}, {"script": ("again.py", script)})["id"]
    wait_for(lambda: api.job(again)["status"] in FINISHED, timeout=60, what="the second job")
    assert api.job(again)["status"] == "succeeded", api.log(again)
    assert "second run" in api.log(again)

    # The portal's worker and the web server come back too, without what they had started:
    # the worker's embedded beat outlives a SIGKILLed worker unless its group goes with it.
    portal_worker, web = _child(proc, queue="portal"), _child(proc, web=True)
    old = portal_worker.children(recursive=True) + web.children(recursive=True)
    assert len(old) >= 4  # the pool process and the beat; two gunicorn workers
    portal_worker.send_signal(signal.SIGKILL)
    web.send_signal(signal.SIGKILL)
    for name in ("worker portal", "web server"):
        wait_for(lambda: f"[runportal] {name} restarted" in output(), timeout=30, what=f"{name}'s restart")  # noqa: B023
        assert f"[runportal] {name} exited (killed by SIGKILL)" in output()
    wait_for(lambda: all(_gone(p) for p in old), timeout=10, what="their processes to go")
    wait_for(api.answers, timeout=60, what="the restarted web server")

    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=40) == 0
    wait_for(lambda: all(_gone(p) for p in children), timeout=10, what="every child to be gone")


# Starts a process of its own that ignores SIGTERM and outlives the job's launcher (no parent-death
# signal): what a worker killed for not stopping would leave behind outside every group.
STRAY = b"""
import signal, subprocess, sys, time
stray = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", stray])
print(f"ready {child.pid}", flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.worker
def test_ctrl_c_with_a_stuck_host_worker_leaves_nothing_running(runportal):
    """A host worker that never finishes its shutdown (stopped: SIGSTOP) is SIGKILLed after the
    grace and named; what its job left outside every group is killed too; nothing is left."""
    proc, api, log_path = runportal
    output = log_path.read_text
    wait_for(api.answers, timeout=120, what=f"the web server (see {log_path})")
    _, job_id = _job_on_rp1(api, "stray.py", STRAY)
    stray_pid = int(api.log(job_id).split("ready ", 1)[1].split()[0])
    stray = psutil.Process(stray_pid)

    worker = _child(proc, queue="host.rp1")
    everything = [*psutil.Process(proc.pid).children(recursive=True), stray]
    for stuck in [worker, *worker.children()]:  # the worker and its pool process, not the job
        stuck.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(timeout=60) == 0
    left = [p for p in everything if not _gone(p)]
    assert not left, f"left running: {[(p.pid, p.name()) for p in left]}"
    said = output()
    killed = f"[runportal] worker host.rp1 (pid {worker.pid}) still running 10 s after SIGTERM: killed it"
    assert killed in said, said[-2000:]
    assert f"[runportal] killed pid {stray_pid} (" in said, said[-2000:]
