"""Children that do not outlive their parent (portal/processes.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from portal.processes import ORPHANED_EXIT_CODE, die_with_parent
from tests.conftest import ROOT
from tests.waiting import wait_for

# The parent in between: it starts `sleep` as the supervisor or the job runner would, says the
# sleeper's pid, and waits to be killed.
PARENT = """
import signal, subprocess, sys, time
from portal.processes import die_with_parent
child = subprocess.Popen(["sleep", "300"], preexec_fn=die_with_parent(signal.SIGTERM))
print(child.pid, flush=True)
time.sleep(300)
"""


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_it_signals_the_child_when_its_parent_dies():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.ppid() == parent.pid and not _gone(child)  # the parent alive: it runs on
        parent.kill()
        parent.wait()
        wait_for(lambda: _gone(child), timeout=10, what="SIGTERM to end the orphaned sleep")
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        if child is not None and not _gone(child):
            child.kill()


def test_it_exits_at_once_when_the_parent_died_before_it_could_ask():
    # Told to expect another parent than the one it has: as if its own had died before prctl
    # and it had been handed to init.
    not_its_parent = os.getppid()
    proc = subprocess.Popen(
        ["sleep", "300"], preexec_fn=die_with_parent(signal.SIGTERM, parent=not_its_parent)
    )
    try:
        assert proc.wait(timeout=10) == ORPHANED_EXIT_CODE
    finally:
        proc.kill()
        proc.wait()


def test_it_leaves_the_child_alone_while_the_parent_lives():
    proc = subprocess.Popen(["sh", "-c", "exit 7"], preexec_fn=die_with_parent(signal.SIGKILL))
    assert proc.wait(timeout=10) == 7  # it ran its own program to its own end
