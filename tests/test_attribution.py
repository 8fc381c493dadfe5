"""Which job owns a process, without privileges and without trusting the job; hostile reports.

Real processes throughout: a job's environment is the job's to set, so nothing in it may
decide attribution or break the telemetry round that holds every host.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta

import psutil
import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from gpus.inventory import GPUInfo, ProcessInfo, snapshot_from_json, snapshot_to_json
from gpus.models import GPU, GPUProcess, Server, Violation, WatchdogPolicy
from gpus.procinfo import describe_process, session_of
from gpus.sanitize import checked_snapshot
from gpus.services import servers_report_ingest
from gpus.simulated.backend import SimulatedBackend
from gpus.simulated.inventory import load_inventory
from jobs.host.watchdog import HostWatchdog
from jobs.host.worker import kill_orphans
from jobs.models import Job
from tests.factories import make_snapshot
from tests.job_helpers import alive, kill_quietly, session_member
from tests.waiting import wait_for

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def _exec_done(proc: subprocess.Popen, key: str) -> None:
    # Until it has exec'd, the child still has this process's environment.
    wait_for(lambda: key in psutil.Process(proc.pid).environ(), timeout=10, what="exec")


# --- what a backend reads about a process ----------------------------------------------


def test_it_reads_the_session_a_job_runs_in(procs):
    job = subprocess.Popen(SLEEP, start_new_session=True)
    procs.append(job)
    # Until it has exec'd, the child's command line is still this process's.
    wait_for(lambda: "time.sleep" in " ".join(psutil.Process(job.pid).cmdline()), timeout=10, what="exec")
    info = describe_process(job.pid, 100)
    assert info.session_id == job.pid  # the pid the worker records is the job's session
    assert info.username == psutil.Process().username()
    assert "time.sleep" in info.command
    assert info.job_id is None  # resolved at ingest, never read from the process


def test_it_describes_a_process_that_exited_between_listing_and_inspection():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    info = describe_process(gone.pid, 512)
    assert (info.pid, info.username, info.command, info.session_id, info.used_memory_mb) == (
        gone.pid,
        "?",
        "",
        None,
        512,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_it_describes_another_users_process_without_reading_its_environment(procs):
    # /bin/sleep: this interpreter may live where another user cannot execute it.
    other = subprocess.Popen(
        ["sleep", "60"], user=65534, group=65534, extra_groups=[], start_new_session=True
    )
    procs.append(other)
    wait_for(lambda: psutil.Process(other.pid).uids().real == 65534, timeout=10, what="setuid")
    info = describe_process(other.pid, None)
    assert info.session_id == other.pid
    assert info.username in ("nobody", "65534")


# --- a hostile job's environment -----------------------------------------------------------


def _simulated_server() -> tuple[str, str]:
    server = load_inventory()[0]
    backend = SimulatedBackend(server.name, seed=1)
    return server.name, backend.snapshot().gpus[0].uuid


def _job_env(server: str, card: str, **extra: str) -> dict[str, str]:
    """What this portal's worker gives a job on `card` of simulated `server` (jobs.environment)."""
    instance = django_settings.PORTAL_INSTANCE_ID
    return {
        **os.environ,
        "PORTAL_SERVER": server,
        "PORTAL_INSTANCE": instance,
        "CUDA_VISIBLE_DEVICES": card,
        **extra,
    }


@pytest.mark.django_db
@pytest.mark.parametrize("job_id", ["²", "99999999999999999999", "-1", "7; DROP TABLE", "", "\x00"], ids=repr)
def test_a_hostile_portal_job_id_costs_nothing(procs, job_id):
    """`PORTAL_JOB_ID=²` passes str.isdigit() and made int() raise; 20 digits overflowed bigint."""
    server, card = _simulated_server()
    env = _job_env(server, card)
    if "\x00" not in job_id:
        env["PORTAL_JOB_ID"] = job_id
    proc = subprocess.Popen(SLEEP, env=env, start_new_session=True)
    procs.append(proc)
    _exec_done(proc, "PORTAL_SERVER")

    snapshot = SimulatedBackend(server, seed=1).snapshot()
    servers_report_ingest(snapshots=[snapshot, make_snapshot("box9")])

    row = GPUProcess.objects.get(gpu_id=card, pid=proc.pid)
    assert row.job_id is None and row.session_id == proc.pid
    assert set(Server.objects.values_list("name", flat=True)) == {server, "box9"}


@pytest.mark.django_db
def test_a_job_process_is_attributed_by_session_on_the_simulated_host(procs, alice, sent):
    """The same path as NVML: the session the worker recorded names the job, whatever the
    process's environment claims."""
    from gpus.booking import reservation_create
    from jobs.submit import ScriptUpload, job_submit

    server, card = _simulated_server()
    servers_report_ingest(snapshots=[SimulatedBackend(server, seed=1).snapshot()])
    booking = reservation_create(user=alice, gpus=[card])
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="t.py", content=b"pass\n"))
    proc = subprocess.Popen(SLEEP, env=_job_env(server, card, PORTAL_JOB_ID="999"), start_new_session=True)
    procs.append(proc)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=proc.pid)
    _exec_done(proc, "PORTAL_SERVER")

    servers_report_ingest(snapshots=[SimulatedBackend(server, seed=1).snapshot()])

    assert GPUProcess.objects.get(gpu_id=card, pid=proc.pid).job_id == job.pk


@pytest.mark.django_db
def test_another_portals_jobs_on_this_machine_are_neither_shown_nor_stopped(procs):
    """Another checkout on this machine runs jobs on the same simulated server names. They carry
    its PORTAL_INSTANCE (or none, from before there was one): not this portal's to show, nor its
    watchdog's to stop, even under a policy that stops every process on an unbooked card."""
    server, card = _simulated_server()
    started = {
        name: subprocess.Popen(SLEEP, env=env, start_new_session=True)
        for name, env in {
            "ours": _job_env(server, card),
            "theirs": _job_env(server, card, PORTAL_INSTANCE="another-checkout"),
            "older": {
                key: value for key, value in _job_env(server, card).items() if key != "PORTAL_INSTANCE"
            },
        }.items()
    }
    procs.extend(started.values())
    for proc in started.values():
        _exec_done(proc, "PORTAL_SERVER")
    pids = {proc.pid: name for name, proc in started.items()}

    snapshot = SimulatedBackend(server, seed=1).snapshot()
    shown = [pids[p.pid] for gpu in snapshot.gpus for p in gpu.processes or () if p.pid in pids]
    assert shown == ["ours"]

    servers_report_ingest(snapshots=[snapshot])
    WatchdogPolicy.objects.create(kind="unbooked", action="stop", grace_seconds=0)
    HostWatchdog(server, simulated=True).round(snapshot, now=timezone.now())
    wait_for(lambda: started["ours"].poll() is not None, timeout=10, what="the stop of this portal's job")
    assert started["theirs"].poll() is None and started["older"].poll() is None
    assert {v.pid for v in Violation.objects.filter(gpu_id=card)} & set(pids) == {started["ours"].pid}


CHILD_IN_ITS_OWN_SESSION = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; sleep = [sys.executable, '-c', 'import time; time.sleep(60)']; "
    "child = subprocess.Popen(sleep, start_new_session=True); print(child.pid, flush=True); time.sleep(60)",
]


def _job_and_setsid_child(env: dict[str, str], procs: list) -> tuple[subprocess.Popen, int]:  # type: ignore[type-arg]
    """A job's leader (a session of its own, as the worker starts it) and the child it started with
    setsid (`start_new_session`, as TensorBoard, Ray or a data loader's server may): its pid."""
    job = subprocess.Popen(CHILD_IN_ITS_OWN_SESSION, env=env, start_new_session=True, stdout=subprocess.PIPE)
    procs.append(job)
    child = int(job.stdout.readline())  # type: ignore[union-attr]
    wait_for(lambda: "time.sleep" in " ".join(psutil.Process(child).cmdline()), timeout=10, what="exec")
    return job, child


def test_a_child_that_called_setsid_names_the_session_it_left(procs):
    job, child = _job_and_setsid_child(dict(os.environ), procs)
    info = describe_process(child, 100)
    assert (info.session_id, info.parent_session_id) == (child, job.pid)
    # The starter's session (no run); None where its leader is outside this PID namespace, as on
    # CI, whose session getsid() answers 0 for, which attributes to no one (session_of).
    assert describe_process(job.pid, 100).parent_session_id == (os.getsid(0) or None)
    job.kill(), job.wait()  # its parent gone: the line is broken, the job's session never named again
    wait_for(lambda: psutil.Process(child).ppid() != job.pid, timeout=10, what="the child's adoption")
    assert describe_process(child, 100).parent_session_id != job.pid
    os.kill(child, 9)


@pytest.mark.django_db
def test_a_jobs_child_that_called_setsid_is_still_its_jobs_not_an_intruder(procs, alice, sent):
    """Under a shared account (JOB_USER=gpujob: no person's name), a job's child in a session of its
    own was judged an intruder on its own booking's card, which a `stop` policy kills, and on a lent
    card it was taken for the owner coming back. It is found by the session it left now."""
    from gpus.booking import reservation_create
    from jobs.submit import ScriptUpload, job_submit

    server, card = _simulated_server()
    servers_report_ingest(snapshots=[SimulatedBackend(server, seed=1).snapshot()])
    booking = reservation_create(user=alice, gpus=[card])
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="t.py", content=b"pass\n"))
    leader, child = _job_and_setsid_child(_job_env(server, card), procs)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=leader.pid, started_at=timezone.now())

    snapshot = SimulatedBackend(server, seed=1).snapshot()
    assert child in {p.pid for gpu in snapshot.gpus for p in gpu.processes or ()}
    servers_report_ingest(snapshots=[snapshot])
    row = GPUProcess.objects.get(gpu_id=card, pid=child)
    assert (row.job_id, row.session_id, row.parent_session_id) == (job.pk, child, leader.pid)

    WatchdogPolicy.objects.create(kind="intruder", action="stop", grace_seconds=0)
    HostWatchdog(server, simulated=True).round(snapshot, now=timezone.now())
    assert not Violation.objects.filter(pid=child).exists()
    assert psutil.Process(child).is_running()
    os.kill(child, 9)


# --- hostile reports ------------------------------------------------------------------------


def _hostile_card(card: GPUInfo) -> GPUInfo:
    return replace(
        card,
        memory_used_mb=10**20,
        utilization_pct=500,
        temperature_c=-(10**6),
        power_w=math.nan,
        power_limit_w=math.inf,
        memory_reserved_mb=card.memory_total_mb + 1,
        name="evil\x00card",
        state="melted",
        processes=(
            ProcessInfo(pid=-5, username="x", command="negative pid"),
            ProcessInfo(pid=10**12, username="x", command="huge pid"),
            ProcessInfo(
                pid=77,
                username="eve\x00" * 40,
                command="python\x00-c\x1b[31m" + "x" * 1000,
                used_memory_mb=2**40,
                session_id=10**15,
                job_id=10**25,
                parent_session_id=-(10**15),
            ),
        ),
    )


@pytest.mark.django_db
def test_it_range_checks_every_number_it_stores():
    good = make_snapshot("box1", gpus=2)
    hostile = replace(good, gpus=(_hostile_card(good.gpus[0]), good.gpus[1]))

    servers_report_ingest(snapshots=[hostile, make_snapshot("box2")])

    card = GPU.objects.get(uuid=good.gpus[0].uuid)
    assert (card.memory_used_mb, card.utilization_pct, card.temperature_c) == (None, None, None)
    assert (card.power_w, card.power_limit_w, card.state) == (None, None, "ok")
    assert card.memory_reserved_mb == 0 and card.name == "evil card"
    (process,) = GPUProcess.objects.filter(gpu=card)
    assert (process.pid, process.used_memory_mb, process.session_id, process.job_id) == (77, None, None, None)
    assert process.parent_session_id is None
    assert "\x00" not in process.username + process.command and len(process.command) == 300
    assert Server.objects.filter(name="box2").exists()  # the other host's telemetry stands


@pytest.mark.django_db
def test_it_drops_what_cannot_be_keyed_and_keeps_the_rest():
    good = make_snapshot("box1", gpus=3)
    cards = (replace(good.gpus[0], uuid="G" * 65), replace(good.gpus[1], index=-1), good.gpus[2])
    nameless = replace(make_snapshot("box2"), host=replace(good.host, name="no such/name"))

    servers_report_ingest(snapshots=[replace(good, gpus=cards), nameless])

    assert list(GPU.objects.values_list("uuid", flat=True)) == [good.gpus[2].uuid]
    assert list(Server.objects.values_list("name", flat=True)) == ["box1"]


def test_a_report_survives_its_json_round_trip_with_unknown_processes():
    snapshot = make_snapshot("box1", gpus=1)
    unknown = replace(snapshot, gpus=(replace(snapshot.gpus[0], processes=None, state="lost"),))
    again = snapshot_from_json(snapshot_to_json(unknown))
    assert again == unknown
    assert checked_snapshot(again).gpus[0].processes is None


def test_a_reported_process_keeps_its_start_and_pids_0_and_1_are_dropped():
    snapshot = make_snapshot("box1", gpus=1)
    seen = (
        ProcessInfo(pid=0, username="root", command="?"),
        ProcessInfo(pid=1, username="root", command="init"),
        ProcessInfo(pid=4242, username="alice", command="python train.py", session_id=4242, started=1.8e9),
    )
    report = replace(snapshot, gpus=(replace(snapshot.gpus[0], processes=seen),))
    kept = checked_snapshot(snapshot_from_json(snapshot_to_json(report))).gpus[0].processes
    assert [(p.pid, p.started) for p in kept] == [(4242, 1.8e9)]


# --- orphans, by session ----------------------------------------------------------------------

LEADER_STARTED: dict[int, float] = {}  # pid → start of each session leader _orphaned_session made


def _orphaned_session() -> tuple[int, psutil.Process]:
    """A job's session whose leader died (as the launcher dies with a killed worker), leaving a
    child in it: (the session id, the child's pid). The leader's start is in LEADER_STARTED, as
    the worker records it (Job.pid_started)."""
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen(sys.argv[1:]).pid)", *SLEEP],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    LEADER_STARTED[leader.pid] = psutil.Process(leader.pid).create_time()  # before it can end
    child = session_member(leader, int(leader.stdout.readline()))
    leader.wait()
    leader.stdout.close()
    return leader.pid, child


@pytest.fixture
def lost_job(alice, box, sent):
    """mark(pid, started_ago=, lost_ago=): the job this host's previous worker was running."""
    from gpus.booking import reservation_create
    from jobs.submit import ScriptUpload, job_submit

    booking = reservation_create(user=alice, gpus=[box[0].uuid])
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="t.py", content=b"pass\n"))

    def mark(pid: int, *, started_ago=timedelta(seconds=30), lost_ago=timedelta(0)) -> None:
        now = timezone.now()
        Job.objects.filter(pk=job.pk).update(
            status=Job.Status.LOST,
            pid=pid,
            # The job's own leader started with the job: a live process with its pid and a later
            # start is another session's (a recycled pid).
            pid_started=LEADER_STARTED.get(pid, (now - started_ago).timestamp()),
            started_at=now - started_ago,
            # Its supervisor held the session until it was lost, and beat after the test made the
            # session's processes: a second later than now, the margin the sweep may take between
            # reading this host's clock and the database's (it never proves a process too many).
            heartbeat_at=now - lost_ago + timedelta(seconds=1),
            finished_at=now - lost_ago,
            worker=socket.gethostname(),
        )

    return mark


def test_it_kills_what_a_previous_worker_left_in_a_jobs_session(procs, lost_job):
    sid, child = _orphaned_session()
    bystander = subprocess.Popen(SLEEP, env={**os.environ, "PORTAL_SERVER": "box1", "PORTAL_JOB_ID": "1"})
    procs.append(bystander)
    _exec_done(bystander, "PORTAL_SERVER")
    lost_job(sid)
    try:
        assert session_of(child.pid) == sid
        assert kill_orphans("box1") == 1
        wait_for(lambda: not alive(child), timeout=10, what="the orphan's end")
        assert bystander.poll() is None  # claiming a job in its environment makes nobody an orphan
    finally:
        kill_quietly([child])


def test_it_leaves_a_session_whose_leader_began_after_the_job(procs, lost_job):
    """A recycled pid: a live session leader younger than the job is someone else's."""
    leader = subprocess.Popen(SLEEP, start_new_session=True)
    procs.append(leader)
    lost_job(leader.pid, started_ago=timedelta(hours=2))
    assert kill_orphans("box1") == 0
    assert leader.poll() is None


def test_it_forgets_jobs_lost_long_ago(lost_job):
    sid, child = _orphaned_session()
    lost_job(sid, lost_ago=timedelta(days=2))
    try:
        assert kill_orphans("box1") == 0
        assert alive(child)
    finally:
        kill_quietly([child])


def test_an_unexpected_proc_error_on_a_parent_costs_only_the_parent_session(procs, monkeypatch):
    """Every other detail describe_process reads is best effort (`_started` takes OSError too, which
    psutil lets through for an errno it does not map): the parent line's read must be as well, or
    one odd /proc entry fails the host's whole round."""
    _job, child = _job_and_setsid_child(dict(os.environ), procs)

    def broken(self):  # type: ignore[no-untyped-def]
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(psutil.Process, "ppid", broken)
    info = describe_process(child, 100)
    assert (info.session_id, info.parent_session_id) == (child, None)
    os.kill(child, 9)
