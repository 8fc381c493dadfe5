"""Small helpers the job tests share: a job's whole log, a handle on a process a job or lab
started, whether it still runs, what a test's jobs left behind, the job's page open."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

import psutil
from django.conf import settings

from gpus.process_env import INSTANCE_VAR
from jobs.logs.store import LogWriter, log_stream
from portal.pids import same_start
from tests.browser import log_in
from tests.waiting import wait_for


def job_log(job_id: int) -> str:
    """The job's whole stored log, as text."""
    return b"".join(log_stream(job_id)).decode()


# A test signals only through a psutil.Process handle (or its own Popen), never a bare pid: psutil
# keeps the start time it read when the handle was made and checks it again before each signal,
# so a handle never reaches a later process given the same pid. A handle is made only once the
# pid is proved to be the test's: another xdist worker's processes run beside it on this machine.


def portal_process(pid: int, var: str, value: int) -> psutil.Process | None:
    """A handle on `pid` if this portal started it for `var`=`value` (PORTAL_JOB_ID=7: a process of
    job 7, PORTAL_SESSION_ID=3: of lab 3), as its environment says; None when it is gone.

    The proof for a pid read from a file or a log: another worker's job 7 carries another
    PORTAL_INSTANCE, and a later process given the pid carries neither."""
    try:
        proc = psutil.Process(pid)
        env = proc.environ()
    except (psutil.Error, ValueError):  # gone, a zombie (nothing to signal), or no pid at all
        return None
    ours = env.get(INSTANCE_VAR) == settings.PORTAL_INSTANCE_ID and env.get(var) == str(value)
    return proc if ours and proc.is_running() else None


def job_process(pid: int, job_id: int) -> psutil.Process | None:
    """A handle on `pid` if it is a process job `job_id` started (`portal_process`); None once gone."""
    return portal_process(pid, "PORTAL_JOB_ID", job_id)


def recorded_process(pid: int | None, started: float | None) -> psutil.Process | None:
    """A handle on the process a row recorded as (`pid`, `started`), if it still runs; None once
    gone, even when its pid has come round to another process."""
    if not pid or started is None:
        return None
    try:
        proc = psutil.Process(pid)
        return proc if same_start(proc.create_time(), started) else None
    except (psutil.Error, ValueError):
        return None


def session_member(leader: subprocess.Popen, pid: int) -> psutil.Process:
    """A handle on `pid`, which `leader`, the test's child leading a session of its own, said it
    started there. Proved while `leader` is not reaped: till then its pid, the session's id, can be
    no one else's."""
    assert leader.returncode is None, "the leader is reaped: its session id may be another's now"
    member = psutil.Process(pid)
    assert os.getsid(pid) == leader.pid, f"pid {pid} is not in the session of {leader.pid}"
    return member


def alive(proc: psutil.Process | None) -> bool:
    """The process still runs (a zombie, exited and not reaped, does not)."""
    try:
        return proc is not None and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_quietly(procs: Iterable[psutil.Process | None]) -> None:
    """SIGKILL to each process still running, by its handle (None: gone already), a test's
    clean-up after a failure."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc is not None:
                proc.kill()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


class Leftovers:
    """The processes a test's jobs started that the test saw: killed after it, whatever happened."""

    def __init__(self) -> None:
        self.seen: list[psutil.Process] = []

    def child(self, pidfile: Path, job_id: int) -> psutil.Process | None:
        """The process whose pid the job wrote to `pidfile`; None if it is gone already."""
        text = wait_for(lambda: pidfile.exists() and pidfile.read_text(), timeout=30, what="the child's pid")
        pid = int(str(text))
        # The job writes the pid once its Popen returns, which is when the child's exec closed its
        # error pipe: a moment before the kernel has set up the new program's environment, which
        # reads empty till then (a CI run under load found it "gone"). Asked again till it is the
        # job's, or gone (a zombie too: nothing left to signal).
        found = wait_for(
            lambda: job_process(pid, job_id) or ("gone" if _gone(pid) else None),
            timeout=10,
            what="the child seen as the job's",
        )
        proc = None if found == "gone" else found
        if proc is not None:
            self.seen.append(proc)
        return proc

    def kill(self) -> None:
        kill_quietly(self.seen)


def job_page_open(tab, job_id: int, username: str = "alice") -> LogWriter:  # type: ignore[no-untyped-def]
    """The job's page in a signed-in browser tab, its log holding "epoch 0"; the writer, to print more."""
    from playwright.sync_api import expect

    writer = LogWriter(job_id)
    writer.feed(b"epoch 0\n")
    writer.flush()
    log_in(tab, username)
    tab.goto(f"/jobs/{job_id}/")
    expect(tab.locator("#job-log")).to_contain_text("epoch 0", timeout=15_000)  # a fresh server
    return writer
