"""tests/forkserver.py: a forked worker is a fresh `python -m` of its own, and its handle is a Popen's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from portal.processes import die_with_parent
from tests import forkserver
from tests.forkserver import Forked, ForkServer, ForkServerError
from tests.isolation import ROOT
from tests.waiting import wait_for

PROBE = """
import os, sys, time
print("argv", sys.argv[1:])
print("cwd", os.getcwd())
print("asked", os.environ.get("PROBE_ASKED"), "server's", os.environ.get("PROBE_SERVERS"))
print("settings read", "portal.settings" in sys.modules, "main", __name__)
sys.stdout.flush()
if sys.argv[1] == "sleep":
    time.sleep(60)
raise SystemExit(int(sys.argv[2]))
"""


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ForkServer]:
    monkeypatch.setenv("PROBE_SERVERS", "yes")
    forks = ForkServer(cwd=ROOT, log=tmp_path / "server.log", preexec_fn=die_with_parent(signal.SIGKILL))
    yield forks
    ended_by_the_test = forks.gone  # killed, or given up on: the test checked how
    forks.close()
    if not ended_by_the_test:
        assert forks.proc.returncode == 0, (tmp_path / "server.log").read_text()


def spawn(server: ForkServer, tmp_path: Path, *args: str, **env: str) -> tuple[Forked, Path]:
    (tmp_path / "probe.py").write_text(PROBE)
    log = tmp_path / f"probe-{len(list(tmp_path.glob('probe-*')))}.log"
    kept = {name: value for name, value in os.environ.items() if name.startswith(("PATH", "PYTHON"))}
    with open(log, "wb") as out:
        child = server.spawn(
            [sys.executable, "-m", "probe", *args],
            env=kept | env,
            cwd=tmp_path,
            log=out,
        )
    return child, log


def test_a_child_runs_its_module_in_its_own_environment_folder_and_log(server, tmp_path) -> None:
    child, log = spawn(server, tmp_path, "exit", "3", PROBE_ASKED="1")
    assert child.wait(timeout=30) == 3
    assert child.poll() == 3
    out = log.read_text()
    assert "argv ['exit', '3']" in out
    assert f"cwd {tmp_path}" in out
    assert "asked 1 server's None" in out  # the test's environment, not the server's
    assert "settings read False main __main__" in out


def test_its_handle_signals_waits_and_times_out_as_a_popens(server, tmp_path) -> None:
    child, _ = spawn(server, tmp_path, "sleep", "0")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    assert child.poll() is None
    child.terminate()
    assert child.wait(timeout=30) == -signal.SIGTERM
    child.kill()  # after its end: nothing, as Popen
    other, _ = spawn(server, tmp_path, "sleep", "0")
    other.kill()
    assert other.wait(timeout=30) == -signal.SIGKILL


def test_a_child_dies_with_the_server_and_its_handle_says_so(server, tmp_path) -> None:
    child, _ = spawn(server, tmp_path, "sleep", "0")
    server.proc.kill()
    server.proc.wait()
    assert child.wait(timeout=30) == -signal.SIGKILL  # its PR_SET_PDEATHSIG
    assert not server.usable()
    with pytest.raises(ForkServerError):
        spawn(server, tmp_path, "exit", "0")


def test_ctrl_c_reaches_the_children_not_the_server(server, tmp_path) -> None:
    child, log = spawn(server, tmp_path, "sleep", "0")
    wait_for(lambda: "settings read" in log.read_text(), timeout=30, what="the child to start")
    server.proc.send_signal(signal.SIGINT)
    child.send_signal(signal.SIGINT)  # as the terminal sends it to the whole process group
    assert child.wait(timeout=30) == -signal.SIGINT  # as a fresh interpreter ends
    assert "KeyboardInterrupt" in log.read_text()
    again, _ = spawn(server, tmp_path, "exit", "5")
    assert again.wait(timeout=30) == 5 and server.usable()


def test_it_refuses_other_interpreter_variables(server, tmp_path) -> None:
    with pytest.raises(ForkServerError, match="PYTHONWARNINGS"):
        spawn(server, tmp_path, "exit", "0", PYTHONWARNINGS="error")


def test_a_server_that_does_not_answer_is_ended_not_waited_for(server, tmp_path, monkeypatch) -> None:
    # Its late answer would have been taken for the next start's: the next worker the wrong one.
    monkeypatch.setattr(forkserver, "REPLY_SECONDS", 0.5)
    server.proc.send_signal(signal.SIGSTOP)
    with pytest.raises(ForkServerError, match="no answer"):
        spawn(server, tmp_path, "exit", "0")
    assert not server.usable() and server.proc.returncode == -signal.SIGKILL
