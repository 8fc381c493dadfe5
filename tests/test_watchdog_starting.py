"""A run the host's worker has just started is never an intruder (jobs/host/watchdog.py).

Its supervisor records the job's pid right after the start; a watchdog round in between used to
find the job's process on the owner's card with no row naming it, record an intruder and tell
the owner about her own job (a CI run's log had the warning). The worker's rounds now leave out
a session whose leader the worker (or one of its pool processes) started until its row names
it. Here with the real runner, the real simulated driver's view of the job's process, and real
process trees whose parents are what is checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from typing import cast

import psutil
import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.inventory import ProcessInfo, Snapshot
from gpus.models import Violation
from gpus.procinfo import describe_process
from gpus.simulated.local_jobs import local_job_processes
from jobs.host import runner, watchdog_sessions
from jobs.host.runner import job_run
from jobs.host.watchdog import HostWatchdog
from jobs.host.watchdog_sessions import lab_of, run_started
from jobs.host.watchdog_sql import SessionRow
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal.models import Notification
from tests.factories import make_snapshot
from tests.job_helpers import job_log
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db

# A stand-in for a pool process: it starts one session leader (as the runner starts a job),
# prints its pid, and ends it (by its own handle) when its stdin closes.
STARTER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(child.pid, flush=True)
sys.stdin.read()
child.kill()
child.wait()
"""


SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


class Starter:
    """A process that started a session leader of its own; `end()` ends both, each by its handle.
    `leader`: the starter leads a session of its own too (as a job does), else it is in the
    test's (as a pool process is in its worker's)."""

    def __init__(self, *, leader: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STARTER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=leader,
        )
        assert self.proc.stdout is not None
        self.child = int(self.proc.stdout.readline())

    def end(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        assert self.proc.returncode == 0  # it killed and reaped its child


@pytest.fixture
def starters():
    made: list[Starter] = []

    def make(*, leader: bool = False) -> Starter:
        made.append(Starter(leader=leader))
        return made[-1]

    yield make
    for starter in made:
        if starter.proc.poll() is None:
            starter.end()


def test_a_run_is_the_worker_s_child_or_its_pool_process_s(starters, procs):
    pool = starters()
    other = starters()
    assert run_started(pool.child, pool.proc.pid) is not None  # the worker's own child (a solo pool)
    assert run_started(pool.child, os.getpid()) is not None  # a child of one of its pool processes
    assert run_started(other.child, pool.proc.pid) is None  # started by someone else
    assert run_started(pool.proc.pid, pool.child) is None  # its parent is not its child
    stranger = subprocess.Popen(SLEEP, start_new_session=True)
    procs.append(stranger)
    assert run_started(stranger.pid, pool.proc.pid) is None
    for never in (0, 1, os.getpid()):
        assert run_started(never, os.getpid()) is None
    pool.end()
    assert run_started(pool.child, os.getpid()) is None  # gone


def test_a_process_a_solo_worker_s_job_starts_in_a_session_of_its_own_is_no_run(starters):
    """Under a solo pool the job's leader is the worker's child: a process the job starts in a
    session of its own has the worker as its grandparent, as a prefork run has, but its parent
    is in no session of the worker's (the review's case: it went unjudged for the job's life)."""
    job = starters(leader=True)  # the worker's child in a session of its own: a job's leader
    assert run_started(job.proc.pid, os.getpid()) is not None
    assert run_started(job.child, os.getpid()) is None


def on_card(index: int, *processes: ProcessInfo) -> Snapshot:
    snapshot = make_snapshot("box1", gpus=4, processes=0)
    cards = list(snapshot.gpus)
    cards[index] = replace(cards[index], processes=processes)
    return replace(snapshot, gpus=tuple(cards))


def test_a_run_of_the_worker_that_no_row_names_yet_is_left_out_and_a_stranger_beside_it_is_not(
    alice, bob, box, starters
):
    reservation_create(user=alice, gpus=[box[0].uuid])
    pool, stranger = starters(), starters()
    run = replace(describe_process(pool.child, 2048), username="gpujobs")
    intruder = replace(describe_process(stranger.child, 2048), username="bob")
    watchdog = HostWatchdog("box1", simulated=False, worker=pool.proc.pid)

    verdicts = watchdog.round(on_card(0, run, intruder), now=timezone.now())

    assert [(v.process.pid, v.kind.value) for v in verdicts] == [(stranger.child, "intruder")]
    assert list(Violation.objects.values_list("pid", flat=True)) == [stranger.child]
    # The same round outside a worker (a test, a bench) knows of no run: it judges both.
    verdicts = HostWatchdog("box1", simulated=False).round(on_card(0, run, intruder), now=timezone.now())
    assert {v.process.pid for v in verdicts} == {pool.child, stranger.child}


def test_a_run_no_row_names_long_after_its_start_is_judged_as_any(alice, box, starters, monkeypatch):
    """Left out only for RUN_RECORD_SECONDS after its start: a run whose row lost it later (marked
    lost while it lives, say) is watched as any process, never out of sight for good."""
    reservation_create(user=alice, gpus=[box[0].uuid])
    pool = starters()
    run = replace(describe_process(pool.child, 2048), username="gpujobs")
    watchdog = HostWatchdog("box1", simulated=False, worker=pool.proc.pid)
    assert watchdog.round(on_card(0, run), now=timezone.now()) == []
    monkeypatch.setattr(watchdog_sessions, "RUN_RECORD_SECONDS", 0)
    verdicts = watchdog.round(on_card(0, run), now=timezone.now())
    assert [(v.process.pid, v.kind.value) for v in verdicts] == [(pool.child, "intruder")]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("in_worker", [True, False], ids=["worker's-round", "round-outside-the-worker"])
def test_a_round_between_the_job_s_start_and_its_pid_s_record_sees_no_intruder(
    alice, box, sent, settings, monkeypatch, in_worker
):
    """The runner's own moment: the job's process runs and the simulated driver shows it on the
    booked card, and its row has no pid yet. Outside the worker the round cannot tell (the old
    false intruder, kept as the proof that the moment is real); the worker's round leaves it."""
    settings.JOB_DRAIN_SECONDS = 1
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    job = job_submit(
        user=alice,
        reservation=booking,
        script=ScriptUpload("job.py", b"import time\ntime.sleep(2)\nprint('done')\n"),
    )
    watchdog = HostWatchdog("box1", simulated=False, worker=os.getpid() if in_worker else None)
    mark_running = runner.Supervisor._mark_running
    seen: list[list[tuple[int, str]]] = []

    def round_first(supervisor: runner.Supervisor) -> None:
        assert supervisor.session is not None
        leader = supervisor.session.leader.pid
        assert Job.objects.get(pk=job.pk).pid is None  # the row does not name it yet

        def shown() -> tuple[ProcessInfo, ...]:
            found = local_job_processes(settings.WORKER_SERVER, settings.PORTAL_INSTANCE_ID)
            return tuple(p for p in found.get(box[0].uuid, ()) if p.pid == leader)

        on_its_card = wait_for(shown, timeout=30, what="the job's process on its card")
        processes = cast(tuple[ProcessInfo, ...], on_its_card)
        verdicts = watchdog.round(on_card(0, *processes), now=timezone.now())
        seen.append([(v.process.pid, v.kind.value) for v in verdicts])
        mark_running(supervisor)
        # The next round, with the pid recorded: the job's own, on its booking.
        verdicts = watchdog.round(on_card(0, *processes), now=timezone.now())
        seen.append([(v.process.pid, v.kind.value, v.job_id) for v in verdicts])

    monkeypatch.setattr(runner.Supervisor, "_mark_running", round_first)
    assert job_run(job.pk) == Job.Status.SUCCEEDED, job_log(job.pk)

    before, after = seen
    leader = Job.objects.get(pk=job.pk).pid
    if in_worker:
        assert before == []
        assert not Violation.objects.exists()
        assert not Notification.objects.filter(kind="intruder").exists()
    else:
        assert before == [(leader, "intruder")]
    assert (leader, "ok", job.pk) in after


@pytest.mark.django_db(transaction=True)  # the round closes old connections, as in the worker
def test_the_host_worker_s_rounds_know_the_worker(box):
    """The worker's own watchdog is the one that knows its runs: made at its first snapshot, in
    the worker's process (jobs/signals.py)."""
    from jobs.signals import HostWorker

    host = HostWorker("box1")
    host.watch_cards(None, snapshot=make_snapshot("box1", gpus=4, processes=0))
    assert host.watchdog is not None and host.watchdog.sessions.worker == os.getpid()


def test_a_labs_kernel_not_recorded_yet_is_found_by_its_server_proven_by_its_start(starters, monkeypatch):
    """`lab_of`: a session led by a descendant of a running lab's server is the lab's (a kernel the
    lab records within seconds), but only the server the row names: by pid and start."""
    server = starters(leader=True)  # a lab's server leads a session; its kernel leads another
    started = psutil.Process(server.proc.pid).create_time()

    def labs(pid: int, start: float | None) -> dict[int, SessionRow]:
        return {pid: SessionRow(7, pid, 1, 50, start, [], "jupyterlab")}

    row = labs(server.proc.pid, started)
    assert lab_of(server.child, row) == row[server.proc.pid]
    assert lab_of(server.child, labs(server.proc.pid, started + 100)) is None  # the pid is another's now
    other = starters(leader=True)
    assert lab_of(server.child, labs(other.proc.pid, None)) is None  # another lab's server
    assert lab_of(server.child, {}) is None
    monkeypatch.setattr(watchdog_sessions, "LAB_DEPTH", 0)
    assert lab_of(server.child, row) is None  # farther up than LAB_DEPTH
