"""The local process executor on its own (jobs/host/executors/local.py): real `sh -c` subprocesses,
no database, no supervisor."""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from jobs.host.executors import LocalProcess, Run, RunEnd, RunSpec, executor_for, local
from portal.pids import ProcessId
from portal.processes import PRIVILEGES_EXIT_CODE, WORKDIR_EXIT_CODE
from tests.waiting import wait_for

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


@pytest.fixture
def executor() -> LocalProcess:
    return LocalProcess(tick=0.05)


def spec(script: str, cwd: Path) -> RunSpec:
    return RunSpec(["sh", "-c", script], ENV, cwd, "Job 0")


def lines_of(run: Run, seconds: float = 10.0) -> list[str]:
    """Every line the run printed, until its output ends."""
    data, give_up = b"", time.monotonic() + seconds
    while time.monotonic() < give_up:
        try:
            chunk = run.output.get(timeout=0.1)
        except queue.Empty:
            continue
        if chunk is None:
            break
        data += chunk
    return data.decode().splitlines()


def test_it_streams_the_runs_output_lines_as_printed(executor, tmp_path):
    run = executor.start(spec("echo one; echo two >&2; sleep 0.2; echo three", tmp_path))
    assert lines_of(run) == ["one", "two", "three"]
    assert executor.collect(run) == RunEnd(code=0)


def test_the_exit_code_passes_through_and_poll_leaves_it_uncollected(executor, tmp_path):
    run = executor.start(spec("exit 7", tmp_path))
    end = executor.wait(run)
    assert end == RunEnd(code=7) and executor.poll(run) == end
    assert psutil.Process(run.pid).status() == psutil.STATUS_ZOMBIE  # its pid is still the run's
    assert executor.collect(run).returncode == 7
    assert not psutil.pid_exists(run.pid) or psutil.Process(run.pid).create_time() != run.started


def test_a_signal_ends_it_as_128_plus_n(executor, tmp_path):
    run = executor.start(spec("echo ready; sleep 30", tmp_path))
    assert run.output.get(timeout=10) == b"ready\n"
    assert executor.poll(run) is None
    assert executor.signal(run, signal.SIGTERM).sent >= 1
    end = executor.wait(run)
    assert end == RunEnd(signal=signal.SIGTERM)
    assert (end.signal, end.returncode) == (signal.SIGTERM, -signal.SIGTERM)
    assert end.describe() == f"Killed by signal {int(signal.SIGTERM)}."
    executor.sweep(run)
    executor.collect(run)


# The shell ignores SIGTERM; its python child too, and forks a grandchild that detaches (a group
# of its own, its parent gone: adopted elsewhere) and ignores SIGTERM as well. setsid alone
# leaves the run's session, and then it is no longer the run's to prove (jobs/host/executors/local.py).
DEAF_TREE = """
trap '' TERM
{python} -c 'import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setpgid(0, 0)
    open("{pidfile}", "w").write(str(os.getpid()))
    time.sleep(60)
os._exit(0)'
echo started
sleep 60
"""


def test_stop_ends_a_sigterm_ignoring_tree_with_a_detached_grandchild(executor, tmp_path):
    pidfile = tmp_path / "grandchild"
    run = executor.start(spec(DEAF_TREE.format(python=sys.executable, pidfile=pidfile), tmp_path))
    assert run.output.get(timeout=10) == b"started\n"
    wait_for(lambda: pidfile.exists() and pidfile.read_text(), timeout=10)
    grandchild = int(pidfile.read_text())
    assert _sid(grandchild) == run.sid and os.getpgid(grandchild) != run.pid
    members = [p.pid for p in psutil.process_iter() if _sid(p.pid) == run.sid]
    began = time.monotonic()
    end = executor.stop(run, grace=0.5)
    assert time.monotonic() - began >= 0.5  # SIGTERM was ignored: the grace was waited out
    assert end.signal == signal.SIGKILL and end.returncode == -signal.SIGKILL
    assert not [pid for pid in members if _alive(pid)], "a process of the run's session survived stop()"


def test_a_process_that_fails_its_proof_is_not_signalled(executor, tmp_path, monkeypatch):
    """A member listed, then its pid reused before the signal (its start time is not the one
    listed): the signal is refused. Once collected, nothing goes out in the run's name."""
    run = executor.start(spec("sleep 30", tmp_path))
    forged = [ProcessId(run.pid, run.started - 1000.0)]
    monkeypatch.setattr(local, "session_members", lambda leader, **kw: forged)
    done = executor.signal(run, signal.SIGTERM)
    assert done.sent == 0 and executor.poll(run) is None, "a process that failed its proof was signalled"
    assert done.lines == ["[portal] SIGTERM reached no process of the job: it was not signalled."]
    monkeypatch.undo()
    executor.stop(run, grace=1.0)
    assert executor.signal(run, signal.SIGKILL).sent == 0  # collected: its pid is free


def test_what_the_worker_may_not_signal_is_said(executor, tmp_path, monkeypatch):
    run = executor.start(spec("sleep 30", tmp_path))
    monkeypatch.setattr(local.pids, "send", lambda target, sig: local.Sent.DENIED)
    assert executor.signal(run, signal.SIGTERM).denied
    monkeypatch.undo()
    executor.stop(run, grace=1.0)


def test_a_command_that_never_ran_is_told_from_its_exit_code(executor):
    assert "could not drop the worker's privileges" in executor.did_not_start(
        RunEnd(code=PRIVILEGES_EXIT_CODE)
    )
    assert "may not enter its working directory" in executor.did_not_start(RunEnd(code=WORKDIR_EXIT_CODE))
    assert executor.did_not_start(RunEnd(code=1)) == ""


def test_a_start_that_cannot_exec_is_an_oserror(executor, tmp_path):
    with pytest.raises(OSError):
        executor.start(RunSpec([str(tmp_path / "missing")], ENV, tmp_path, "Job 0"))


def test_every_kind_of_work_runs_locally_today():
    assert isinstance(executor_for(object()), LocalProcess)


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
