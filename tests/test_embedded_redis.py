"""`python -m portal.embedded_redis`, as `make run` and `make test` start it: a redis-server that
exits on its own comes back on the same socket while the command goes on, and every way of
stopping it leaves nothing running. Real processes throughout; no database."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis

from tests.conftest import ROOT
from tests.waiting import wait_for

# The command: says it is up, and, asked to stop, uses its Redis once more before it ends.
COMMAND = """
import os, pathlib, signal, sys, time
import redis

out = pathlib.Path(sys.argv[1])

def stop(*_):
    answered = redis.Redis.from_url(os.environ["REDIS_URL"], socket_timeout=5).ping()
    (out / "stopping").write_text(str(answered))
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
(out / "ready").write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


@dataclass
class Run:
    parent: subprocess.Popen
    socket: Path
    out: Path
    log: Path

    def answers(self) -> bool:
        try:
            return bool(redis.Redis.from_url(f"unix://{self.socket}", socket_timeout=1).ping())
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def redis_server(self) -> psutil.Process | None:
        for child in psutil.Process(self.parent.pid).children():
            try:
                if "redis-server" in child.name() and child.status() != psutil.STATUS_ZOMBIE:
                    return child
            except psutil.NoSuchProcess:  # the killed one, reaped between the listing and the look
                continue
        return None

    def command(self) -> psutil.Process:
        return psutil.Process(int((self.out / "ready").read_text()))


@pytest.fixture
def run(tmp_path) -> Iterator[Run]:
    """The module running COMMAND, in a session of its own as a terminal's job would be."""
    env = {name: value for name, value in os.environ.items() if name != "REDIS_URL"}
    log = tmp_path / "embedded_redis.log"
    # A short folder for the socket: a unix socket path has a ~100-byte limit.
    with tempfile.TemporaryDirectory(prefix="er-") as sockets, open(log, "wb") as output:
        socket = Path(sockets) / "r.sock"
        argv = [sys.executable, "-m", "portal.embedded_redis", "--socket", str(socket), "--"]
        parent = subprocess.Popen(
            [*argv, sys.executable, "-c", COMMAND, str(tmp_path)],
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield Run(parent, socket, tmp_path, log)
        finally:
            _kill_everything(parent)


def _kill_everything(parent: subprocess.Popen) -> None:
    """After a failure: nothing of this test may outlive it."""
    if parent.poll() is None:
        left = psutil.Process(parent.pid).children(recursive=True)
        parent.kill()
        for proc in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
    parent.wait()


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ctrl_c(parent: subprocess.Popen) -> None:
    """SIGINT to the group `parent` leads (start_new_session): only while it is not reaped, when
    its pid, the group's id, can be no one else's."""
    assert parent.poll() is None, "the parent ended before its Ctrl-C"
    os.killpg(parent.pid, signal.SIGINT)


STOPS = {
    "sigterm": lambda parent: parent.send_signal(signal.SIGTERM),
    # The terminal's Ctrl-C: SIGINT to the whole foreground process group.
    "ctrl-c": _ctrl_c,
    # The parent itself dies: its children get their parent-death signal.
    "sigkill": lambda parent: parent.send_signal(signal.SIGKILL),
}


@pytest.mark.parametrize("stop", STOPS)
def test_a_killed_redis_comes_back_and_every_stop_leaves_nothing(run, stop):
    wait_for(lambda: (run.out / "ready").exists() and run.answers(), timeout=30, what="Redis and the command")
    command, killed = run.command(), run.redis_server()
    assert killed is not None

    killed.send_signal(signal.SIGKILL)  # the OOM killer, say
    wait_for(lambda: _gone(killed), timeout=5, what="redis-server's end")
    back = wait_for(run.redis_server, timeout=10, what=f"a new redis-server (see {run.log})")
    wait_for(run.answers, timeout=10, what="PING on the same socket")
    lines = run.log.read_text()
    assert "[embedded_redis] redis-server exited (killed by SIGKILL); restarting it in 1 s" in lines
    assert f"[embedded_redis] redis-server restarted (pid {back.pid})" in lines
    assert command.is_running() and run.command().pid == command.pid  # the command went on

    everything = psutil.Process(run.parent.pid).children(recursive=True)
    assert {command.pid, back.pid} <= {p.pid for p in everything}
    STOPS[stop](run.parent)
    run.parent.wait(timeout=30)
    wait_for(lambda: all(_gone(p) for p in everything), timeout=15, what="every child to be gone")
    if stop != "sigkill":
        # Stopped in order: the command still had its Redis while it shut down.
        assert (run.out / "stopping").read_text() == "True"
        assert run.parent.returncode == 0
        assert not run.socket.exists()
