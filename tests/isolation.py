"""Each test process its own portal: loaded with `-p tests.isolation` (pyproject's addopts), so it
runs before pytest-django reads the settings, in the controller and in every xdist worker.

A run (`make test`, its xdist workers included) is named by its controller's pid, inherited by
the workers through PORTAL_TEST_RUN; a worker by xdist's PYTEST_XDIST_WORKER (`main` without
xdist). Each test process then gets:

- its own PORTAL_VAR_DIR, var/test-runs/<run>/<worker>/: its SQLite test database, job folders,
  spool, mail and simulated processes file, so two runs in one checkout never share a file
  (SQLite's "disk I/O error" when one deleted the other's database);
- its own PORTAL_INSTANCE_ID, test-<run>-<worker>: every Redis key, channel and Celery queue
  goes through it (portal.names.redis_key, CELERY_BROKER_TRANSPORT_OPTIONS' global_keyprefix),
  so the workers share one Redis (the embedded one, or CI's) without seeing each other's
  telemetry, wake-ups, live logs or jobs, and the simulated backend shows, and its watchdog
  stops, only this worker's processes;
- its own output folder, test-output/run-<run>/<worker>/ (OUTPUT): worker logs a test reads
  back, screenshots. The controller removes the folders of runs that are over (their pid gone);
- a rootless Podman slot of its own, kept across runs (`_rootless_slot`).

The Celery workers, web servers and jobs a test starts inherit all three from os.environ.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
import shutil
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
RUN = os.environ.setdefault("PORTAL_TEST_RUN", str(os.getpid()))
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")

# The var folder the run was given (the controller's PORTAL_VAR_DIR, or var/): kept for the
# workers, which inherit the controller's already-narrowed PORTAL_VAR_DIR.
_base = Path(
    os.environ.setdefault("PORTAL_TEST_VAR_BASE", os.environ.get("PORTAL_VAR_DIR") or str(ROOT / "var"))
)
_base = _base.resolve()
VAR_BASE = _base  # kept across runs: the container images, the rootless slots, the migrated database
VAR_DIR = _base / "test-runs" / RUN / WORKER
OUTPUT = ROOT / "test-output" / f"run-{RUN}" / WORKER

os.environ["PORTAL_VAR_DIR"] = str(VAR_DIR)
# A developer's checkout, not a deployment (portal/settings_safety.py): the settings make up a
# secret key and allow localhost's defaults. The tests of what a deployment refuses take it away.
os.environ["PORTAL_DEVELOPMENT"] = "1"
os.environ["PORTAL_INSTANCE_ID"] = f"test-{RUN}-{WORKER}"
# Processes a test declares on simulated cards: where this process's workers look (never a
# developer's own file from the environment).
SIMULATED_PROCESSES_FILE = VAR_DIR / "simulated-gpu-processes.json"
os.environ["SIMULATED_PROCESSES_FILE"] = str(SIMULATED_PROCESSES_FILE)
VAR_DIR.mkdir(parents=True, exist_ok=True)
OUTPUT.mkdir(parents=True, exist_ok=True)

_slot_locks: list[object] = []  # held for the process's life


def _rootless_slot() -> None:
    """The rootless container tier's Podman storage and run folder: a numbered slot under the var
    base, kept across runs and held with a lock while this process lives, so no two processes use
    one at once. In the run's own folder, every run imported the test images into each worker's
    storage again (about 10 s), and deleting half a gigabyte of overlay layers (18,000 files)
    when the run ended took 45 s of its wall time. A slot's containers are named by the instance
    that made them (leftovers_remove), so one run never removes another's."""
    slots = _base / "rootless-slots"
    slots.mkdir(parents=True, exist_ok=True)
    for slot in itertools.count():
        lock = open(slots / f"{slot}.lock", "a")  # noqa: SIM115 - held until the process ends
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        _slot_locks.append(lock)
        break
    os.environ["CONTAINER_ROOTLESS_STORAGE_DIR"] = str(slots / f"{slot}-storage")
    # Short (rootless.RUN_ROOT_MAX), and the checkout's own: Podman keeps it beside the storage.
    checkout = hashlib.sha256(str(_base).encode()).hexdigest()[:6]
    os.environ["CONTAINER_ROOTLESS_RUN_DIR"] = f"/run/portal-ctr/t{checkout}-{slot}"


_rootless_slot()


def _run_over(folder: Path, prefix: str = "") -> bool:
    """A run's folder whose controller is gone (a pid reused since only keeps it one run more)."""
    name = folder.name.removeprefix(prefix)
    return name.isdigit() and name != RUN and not psutil.pid_exists(int(name))


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    for folder in (_base / "test-runs").glob("*"):
        if _run_over(folder):
            shutil.rmtree(folder, ignore_errors=True)
    for folder in (ROOT / "test-output").glob("run-*"):
        if _run_over(folder, "run-"):
            shutil.rmtree(folder, ignore_errors=True)


def pytest_unconfigure(config) -> None:  # type: ignore[no-untyped-def]
    """The controller's var folder goes with its run; its output stays until the next run."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(_base / "test-runs" / RUN, ignore_errors=True)
