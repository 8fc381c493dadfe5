"""portal.pids: a signal reaches the process that was meant, or nobody."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from portal import pids
from portal.pids import ProcessId, Sent

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
# A session leader whose child leaves the leader's process group for one of its own.
SPLITTER = [
    sys.executable,
    "-c",
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], process_group=0)\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n",
]


@pytest.fixture
def spawn():
    started: list[subprocess.Popen] = []

    def _spawn(argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, **kwargs)
        started.append(proc)
        return proc

    yield _spawn
    for proc in started:
        for member in pids.session_members(pids.identify(proc.pid) or pids.ProcessId(proc.pid, 0.0)):
            if member.pid != os.getpid():
                pids.send(member, signal.SIGKILL)
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("pid", [0, 1, -1])
def test_pid_zero_one_and_negative_are_never_signalled(pid):
    assert pids.send(ProcessId(pid, 0.0), signal.SIGTERM) is Sent.REFUSED


def test_own_pid_and_own_group_are_never_signalled(spawn):
    assert pids.send(pids.identify(os.getpid()), signal.SIGTERM) is Sent.REFUSED
    same_group = spawn(SLEEP)  # no new session or group: this test process's group
    assert pids.send(pids.identify(same_group.pid), signal.SIGTERM) is Sent.REFUSED
    assert same_group.poll() is None


def test_the_process_meant_is_signalled(spawn):
    proc = spawn(SLEEP, start_new_session=True)
    target = pids.identify(proc.pid)
    assert pids.send(target, signal.SIGTERM) is Sent.SENT
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert pids.send(target, signal.SIGTERM) is Sent.GONE  # a zombie reaped: gone


def test_a_reused_pid_is_not_signalled(spawn):
    proc = spawn(SLEEP, start_new_session=True)
    now_there = pids.identify(proc.pid)
    earlier = ProcessId(proc.pid, now_there.started - 3600)  # the pid's earlier owner
    assert pids.send(earlier, signal.SIGTERM) is Sent.GONE
    assert proc.poll() is None


def test_session_members_include_a_child_in_a_group_of_its_own(spawn):
    leader = spawn(SPLITTER, start_new_session=True, stdout=subprocess.PIPE, text=True)
    child_pid = int(leader.stdout.readline())
    assert os.getpgid(child_pid) == child_pid != leader.pid  # it left the leader's group
    identity = pids.identify(leader.pid)
    assert {m.pid for m in pids.session_members(identity)} == {leader.pid, child_pid}
    assert pids.send_session(identity, signal.SIGKILL) == (2, 0)
    leader.wait(timeout=10)
    deadline = time.monotonic() + 10
    while pids.started_at(child_pid) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pids.session_members(identity)


def test_a_later_session_on_the_same_pid_is_not_the_old_one(spawn):
    proc = spawn(SLEEP, start_new_session=True)
    current = pids.identify(proc.pid)
    old = ProcessId(proc.pid, current.started - 3600)  # an earlier session with that id
    assert pids.session_members(old) == []


def test_a_pidfd_that_cannot_be_had_now_falls_back_to_check_then_kill(spawn, monkeypatch):
    import errno

    def no_fds(pid: int) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    proc = spawn(SLEEP, start_new_session=True)
    target = pids.identify(proc.pid)
    monkeypatch.setattr(os, "pidfd_open", no_fds)
    assert pids.send(target, signal.SIGTERM) is Sent.SENT
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_a_held_sessions_members_and_groups_are_found_without_the_leaders_start(spawn):
    leader = spawn(SPLITTER, start_new_session=True, stdout=subprocess.PIPE, text=True)
    child_pid = int(leader.stdout.readline())
    unknown = ProcessId(leader.pid, -1.0)  # its start unreadable (hidepid): held unreaped, it needs none
    assert pids.session_members(unknown) == []
    assert {m.pid for m in pids.session_members(unknown, held=True)} == {leader.pid, child_pid}
    members = pids.session_members(unknown, held=True)
    assert pids.groups_of(members) == pids.session_groups(leader.pid) == {leader.pid, child_pid}


def test_a_group_is_never_this_processs_own(spawn):
    assert pids.send_group(os.getpgrp(), signal.SIGTERM) is Sent.REFUSED
    assert pids.send_group(1, signal.SIGTERM) is Sent.REFUSED
    proc = spawn(SLEEP, start_new_session=True)
    assert pids.send_group(proc.pid, signal.SIGTERM) is Sent.SENT
    assert proc.wait(timeout=10) == -signal.SIGTERM
