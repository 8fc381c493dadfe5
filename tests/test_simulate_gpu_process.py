"""manage.py simulate_gpu_process: real local processes on simulated cards, as NVML shows them.

Real processes throughout: what the backend reports about them (user, command line, session)
is read from the OS, as it is for every process on a real card.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from io import StringIO
from pathlib import Path

import psutil
import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from gpus.backends import get_backend
from gpus.inventory import GPUInfo, ProcessInfo, Snapshot
from gpus.models import GPU, GPUProcess
from gpus.services import servers_report_ingest
from gpus.simulated.backend import SimulatedBackend
from gpus.simulated.declarations import declared_processes, simulated_process_declare
from tests.waiting import wait_for

SERVER = "sim-rtx-4x24"
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def start(procs: list[subprocess.Popen]) -> Callable[..., subprocess.Popen]:
    """Start a sleeping process; every one is killed after the test.

    Each leads its own session, as a job does: a process in the test runner's session may have
    session id 0 where that session's leader sits outside the PID namespace (as on CI).
    """

    def start(**kwargs: object) -> subprocess.Popen:
        proc = subprocess.Popen(SLEEP, **{"start_new_session": True, **kwargs})
        procs.append(proc)
        return proc

    return start


@pytest.fixture
def path(settings, tmp_path: Path) -> Path:
    settings.SIMULATED_PROCESSES_FILE = tmp_path / "simulated-gpu-processes.json"
    return settings.SIMULATED_PROCESSES_FILE


@pytest.fixture
def cards(db) -> list[GPU]:
    """The four cards of simulated server SERVER, as the portal knows them after one report."""
    servers_report_ingest(snapshots=[SimulatedBackend(SERVER, seed=1).snapshot()])
    return list(GPU.objects.filter(server__name=SERVER).order_by("index"))


def simulate(*args: object) -> str:
    out = StringIO()
    call_command("simulate_gpu_process", *[str(a) for a in args], stdout=out)
    return out.getvalue()


def declare(card: GPU, pid: int, memory_mb: int) -> str:
    return simulate("--gpu", card.uuid, "--pid", pid, "--memory-mb", memory_mb)


def snapshot(path: Path) -> Snapshot:
    return SimulatedBackend(SERVER, seed=1, processes_file=path, booked=frozenset).snapshot()


def real(gpu: GPUInfo) -> list[ProcessInfo]:
    """The card's real processes: the invented ones have no session."""
    return [p for p in gpu.processes if p.session_id is not None]


# --- validation ---------------------------------------------------------------------------


def test_it_refuses_a_card_that_is_not_simulated(box, path, start):
    with pytest.raises(CommandError, match="is on box1, which is not simulated: real cards report their own"):
        declare(box[0], start().pid, 1024)
    assert not path.exists()


def test_it_refuses_an_unknown_card(cards, path, start):
    with pytest.raises(CommandError, match="--gpu GPU-nope: no such card in the portal"):
        simulate("--gpu", "GPU-nope", "--pid", start().pid, "--memory-mb", 1024)


@pytest.mark.parametrize("pid", ["exited", 0, -1], ids=str)
def test_it_refuses_a_pid_that_is_no_live_process(cards, path, pid):
    if pid == "exited":
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        pid = gone.pid
    with pytest.raises(CommandError, match=rf"--pid {pid}: no such process on this machine"):
        declare(cards[0], pid, 1024)
    assert not path.exists()


@pytest.mark.parametrize("memory_mb", [0, -5, 24 * 1024 + 1])
def test_it_refuses_memory_that_is_not_on_the_card(cards, path, start, memory_mb):
    with pytest.raises(CommandError, match=rf"--memory-mb {memory_mb}: .* at most the card's 24576 MiB"):
        declare(cards[0], start().pid, memory_mb)


def test_it_says_what_each_action_needs(cards, path):
    with pytest.raises(CommandError, match="needs --gpu, --pid and --memory-mb"):
        simulate("--gpu", cards[0].uuid)
    with pytest.raises(CommandError, match="--remove needs --pid"):
        simulate("--remove")


# --- what the simulated backend shows ------------------------------------------------------


def test_a_declared_process_shows_with_its_real_user_session_and_memory(cards, path, start):
    proc = start()
    baseline = SimulatedBackend(SERVER, seed=1).snapshot()  # the same walk, nothing declared

    out = declare(cards[2], proc.pid, 4096)
    shown = snapshot(path)

    assert f"Declared pid {proc.pid} ({psutil.Process().username()}: " in out
    assert f"on {SERVER} card 2 ({cards[2].uuid}): 4096 MiB" in out
    (info,) = real(shown.gpus[2])
    assert (info.pid, info.username, info.session_id, info.used_memory_mb) == (
        proc.pid,
        psutil.Process().username(),
        os.getsid(proc.pid),
        4096,
    )
    assert "time.sleep(60)" in info.command
    assert shown.gpus[2].memory_used_mb == baseline.gpus[2].memory_used_mb + 4096
    assert [real(g) for i, g in enumerate(shown.gpus) if i != 2] == [[], [], []]
    assert [g.memory_used_mb for i, g in enumerate(shown.gpus) if i != 2] == [
        g.memory_used_mb for i, g in enumerate(baseline.gpus) if i != 2
    ]


def test_the_card_memory_is_capped_at_its_total(cards, path, start):
    declare(cards[0], start().pid, 24 * 1024)
    declare(cards[0], start().pid, 24 * 1024)

    gpu = snapshot(path).gpus[0]

    assert gpu.memory_used_mb == gpu.memory_total_mb == 24 * 1024
    assert len(real(gpu)) == 2


def test_it_updates_a_process_declared_again_on_the_same_card(cards, path, start):
    proc = start()
    backend = SimulatedBackend(SERVER, seed=1, processes_file=path)
    declare(cards[1], proc.pid, 4096)
    assert [p.used_memory_mb for p in real(backend.snapshot().gpus[1])] == [4096]

    out = declare(cards[1], proc.pid, 2048)

    assert out.strip() == f"Updated pid {proc.pid} on {SERVER} card 1 ({cards[1].uuid}): 4096 → 2048 MiB."
    assert [p.used_memory_mb for p in real(backend.snapshot().gpus[1])] == [2048]
    assert len(declared_processes(path)) == 1


def test_it_declares_a_process_on_several_cards_and_removes_it_from_one_or_all(cards, path, start):
    proc, other = start(), start()
    for card in cards[:3]:
        declare(card, proc.pid, 1000)
    declare(cards[0], other.pid, 500)

    listing = simulate("--list")
    out = simulate("--remove", "--pid", proc.pid, "--gpu", cards[1].uuid)

    assert len(listing.splitlines()) == 4
    assert f"pid {other.pid} on {SERVER} card 0 ({cards[0].uuid}): 500 MiB (" in listing
    assert out.strip() == f"Removed pid {proc.pid} from {SERVER} card 1 ({cards[1].uuid})."
    shown = snapshot(path).gpus
    assert [sorted(p.pid for p in real(g)) for g in shown] == [
        sorted([proc.pid, other.pid]),
        [],
        [proc.pid],
        [],
    ]

    out = simulate("--remove", "--pid", proc.pid)

    assert out.splitlines() == [
        f"Removed pid {proc.pid} from {SERVER} card 0 ({cards[0].uuid}).",
        f"Removed pid {proc.pid} from {SERVER} card 2 ({cards[2].uuid}).",
    ]
    assert [[p.pid for p in real(g)] for g in snapshot(path).gpus] == [[other.pid], [], [], []]
    assert "Nothing to remove" in simulate("--remove", "--pid", proc.pid)


def test_a_declared_process_that_exits_disappears(cards, path, start):
    proc = start()
    backend = SimulatedBackend(SERVER, seed=1, processes_file=path)
    declare(cards[0], proc.pid, 4096)
    assert real(backend.snapshot().gpus[0])

    proc.kill()
    proc.wait()

    assert real(backend.snapshot().gpus[0]) == []
    assert "No simulated GPU processes declared" in simulate("--list")
    declare(cards[1], start().pid, 100)  # a write prunes the exited process from the file
    assert [d.gpu for d in declared_processes(path)] == [cards[1].uuid]


def test_a_reused_pid_is_not_the_declared_process(path, start):
    """After a reboot the pid may belong to another process, which nobody declared."""
    proc = start()
    card = snapshot(path).gpus[0].uuid
    entry = {"gpu": card, "pid": proc.pid, "started": psutil.Process(proc.pid).create_time() - 60}
    path.write_text(json.dumps({"processes": [{**entry, "memory_mb": 4096}]}))

    assert real(snapshot(path).gpus[0]) == []


def test_pid_1_declared_in_the_file_is_never_shown(path):
    """pid <= 1 is no GPU process: to kill(2) and getsid(2) it is init or the caller's own group."""
    card = snapshot(path).gpus[0].uuid
    entry = {"gpu": card, "pid": 1, "started": psutil.Process(1).create_time(), "memory_mb": 4096}
    path.write_text(json.dumps({"processes": [entry]}))

    assert [p.pid for p in snapshot(path).gpus[0].processes if p.pid <= 1] == []


def test_a_declared_process_carries_its_start_time(cards, path, start):
    proc = start()
    declare(cards[0], proc.pid, 100)
    (info,) = real(snapshot(path).gpus[0])
    assert info.started == psutil.Process(proc.pid).create_time()


def test_a_job_process_declared_on_its_card_is_listed_once_with_the_declared_memory(cards, path, start):
    env = {**os.environ, "PORTAL_SERVER": SERVER, "CUDA_VISIBLE_DEVICES": cards[3].uuid}
    env["PORTAL_INSTANCE"] = settings.PORTAL_INSTANCE_ID
    job = start(env=env, start_new_session=True)
    # Until it has exec'd, the child still has this process's environment.
    wait_for(lambda: "PORTAL_SERVER" in psutil.Process(job.pid).environ(), timeout=10, what="exec")
    assert [p.pid for p in real(snapshot(path).gpus[3])] == [job.pid]

    declare(cards[3], job.pid, 20_000)

    (info,) = real(snapshot(path).gpus[3])
    assert (info.pid, info.session_id, info.used_memory_mb) == (job.pid, job.pid, 20_000)


@pytest.mark.parametrize(
    "text",
    ["{not json", '["a list"]', '{"processes": [{"gpu": "GPU-x", "pid": "12"}]}', '{"processes": 3}'],
)
def test_a_malformed_file_does_not_break_snapshots(cards, path, start, caplog, text):
    path.write_text(text)
    backend = SimulatedBackend(SERVER, seed=1, processes_file=path)

    with caplog.at_level(logging.WARNING, logger="gpus.simulated.declarations"):
        first, second = backend.snapshot(), backend.snapshot()

    assert len(first.gpus) == len(second.gpus) == 4
    assert all(real(g) == [] for g in first.gpus + second.gpus)
    # once, not every round
    (record,) = [r for r in caplog.records if r.name == "gpus.simulated.declarations"]
    assert str(path) in record.getMessage()
    with pytest.raises(CommandError, match=f"{path}: .*Fix the file, or delete it to start afresh"):
        declare(cards[0], start().pid, 1024)

    path.unlink()
    proc = start()
    declare(cards[0], proc.pid, 1024)

    assert [p.pid for p in real(backend.snapshot().gpus[0])] == [proc.pid]


def test_concurrent_declarations_all_survive(path, start):
    """Each declaration is a read-modify-write of one file; the lock keeps every one."""
    procs = [start() for _ in range(4)]
    cards = [f"GPU-{i}" for i in range(25)]
    barrier = threading.Barrier(len(procs))
    errors: list[BaseException] = []

    def declare_all(pid: int) -> None:
        try:
            barrier.wait()
            for card in cards:
                simulated_process_declare(path=path, gpu=card, pid=pid, memory_mb=100)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=declare_all, args=(p.pid,)) for p in procs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    declared = {(d.gpu, d.pid) for d in declared_processes(path)}
    assert declared == {(card, p.pid) for card in cards for p in procs}


def test_the_configured_backend_reads_the_configured_file(cards, path, start):
    proc = start()
    declare(cards[0], proc.pid, 512)

    backend = get_backend("simulated", SERVER)

    assert [p.pid for p in real(backend.snapshot().gpus[0])] == [proc.pid]


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_running_host_worker_reports_a_declared_process(start_worker, tmp_path, settings, start):
    """What `make run` does: the command and the worker meet in the file, within one round."""
    path = settings.SIMULATED_PROCESSES_FILE = tmp_path / "simulated-gpu-processes.json"
    start_worker(None)
    start_worker(SERVER, extra_env={"SIMULATED_PROCESSES_FILE": str(path)})
    wait_for(lambda: GPU.objects.filter(server__name=SERVER).count() == 4, timeout=60, what="a report")
    card = GPU.objects.get(server__name=SERVER, index=1)
    proc = start()

    declare(card, proc.pid, 4096)

    row = wait_for(
        lambda: GPUProcess.objects.filter(gpu=card, pid=proc.pid).first(), timeout=15, what="the process"
    )
    assert (row.username, row.session_id, row.used_memory_mb) == (
        psutil.Process().username(),
        os.getsid(proc.pid),
        4096,
    )
    simulate("--remove", "--pid", proc.pid)
    wait_for(
        lambda: not GPUProcess.objects.filter(pid=proc.pid).exists(), timeout=15, what="the process to go"
    )
