"""A job never holds the worker's privileges (portal/processes.py, `start_job_process`).

A worker with JOB_USER holds CAP_SETUID, CAP_SETGID, CAP_KILL and CAP_CHOWN as ambient
capabilities, under no_new_privs (deploy/gpu-portal-worker.service). setpriv builds such a
worker-like parent as a non-root user; it starts a job as another non-root user through the
runner's own start function, and, as the control, through a plain `Popen(user=...)`. The
parent is a bare Python without Django: it loads portal/processes.py by its path.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpus.booking import reservation_create
from jobs.host.runner import job_run
from jobs.logs.store import log_stream
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal import processes
from portal.processes import PRIVILEGES_EXIT_CODE, start_job_process

PROCESSES = Path(processes.__file__).resolve()
# Numeric ids without passwd entries: the worker's account (uid = gid) and JOB_USER's.
WORKER_ID, JOB_ID = 64101, 64102
WORKER_CAPS = "+setuid,+setgid,+kill,+chown"
CAP_SETUID = 1 << 7
CAP_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapAmb")

# What the job reports from inside.
JOB = """
import ctypes, json, os
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines())
pdeathsig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(pdeathsig))  # PR_GET_PDEATHSIG
try:
    os.setuid(0)
    setuid = "allowed"
except PermissionError:
    setuid = "denied"
keys = ("Uid", "Groups", "CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs")
print(json.dumps({"status": {k: status[k].strip() for k in keys}, "setuid0": setuid,
                  "pdeathsig": pdeathsig.value}))
"""

# The worker-like parent: argv is processes.py, "drop" or "plain", the job's uid and gid.
PARENT = """
import importlib.util, json, subprocess, sys
spec = importlib.util.spec_from_file_location("processes", sys.argv[1])
processes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(processes)
mode, uid, gid, job = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines())
argv = [sys.executable, "-c", job]
if mode == "drop":
    proc = processes.start_job_process(argv, env={}, cwd="/", user=uid, group=gid)
else:
    proc = subprocess.Popen(argv, env={}, cwd="/", user=uid, group=gid, extra_groups=[],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
out = proc.communicate()[0].decode()
print(json.dumps({"parent": {k: status[k].strip() for k in ("Uid", "CapAmb", "CapEff", "NoNewPrivs")},
                  "job": out, "code": proc.returncode}))
"""


def _as_worker(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python args` as the worker's non-root user, with its ambient capabilities."""
    return subprocess.run(
        [
            "setpriv",
            f"--reuid={WORKER_ID}",
            f"--regid={WORKER_ID}",
            "--clear-groups",
            "--no-new-privs",
            f"--inh-caps={WORKER_CAPS}",
            f"--ambient-caps={WORKER_CAPS}",
            python,
            *args,
        ],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )


def _runnable_by_others(path: Path) -> bool:
    """The file behind the links, and every folder on the way to it, are open to any user
    (a venv's python is often a link into root's own home)."""
    real = path.resolve()
    return real.is_file() and all(p.stat().st_mode & 0o001 for p in [real, *real.parents])


@pytest.fixture(scope="module")
def python() -> str:
    """An interpreter other users may run, that can read portal/processes.py."""
    if not sys.platform.startswith("linux"):
        pytest.skip("capabilities are Linux's")
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a worker-like parent with capabilities (CI runs as root)")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    probe = f"import ctypes; open({str(PROCESSES)!r}).read()"
    for candidate in (sys.executable, "/usr/bin/python3"):
        if _runnable_by_others(Path(candidate)) and _as_worker(candidate, "-c", probe).returncode == 0:
            return candidate
    pytest.skip(f"no Python that a non-root user may run and that can read {PROCESSES}")


def _start_from_worker(python: str, mode: str) -> dict:
    done = _as_worker(python, "-c", PARENT, str(PROCESSES), mode, str(JOB_ID), str(JOB_ID), JOB)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    parent = result["parent"]
    # The premise: the parent is a non-root worker that does hold the capabilities.
    assert parent["Uid"].split()[0] == str(WORKER_ID)
    assert int(parent["CapAmb"], 16) & CAP_SETUID and int(parent["CapEff"], 16) & CAP_SETUID
    assert result["code"] == 0, result["job"]
    job = json.loads(result["job"])
    print(mode, {"parent": parent, **job})  # shown with -s: the figures behind the assertions
    assert job["status"]["Uid"].split()[0] == str(JOB_ID) and job["status"]["Groups"] == ""
    return job


def test_it_starts_a_job_with_no_capabilities_and_no_new_privs(python):
    job = _start_from_worker(python, "drop")
    assert {field: int(job["status"][field], 16) for field in CAP_FIELDS} == dict.fromkeys(CAP_FIELDS, 0)
    assert job["status"]["NoNewPrivs"] == "1"
    assert job["setuid0"] == "denied"
    assert job["pdeathsig"] == 9  # and it still dies with its worker (SIGKILL)


def test_a_plain_popen_as_another_user_would_hand_the_job_the_workers_capabilities(python):
    """The control: the same parent without the drop. Without it the job could become root."""
    job = _start_from_worker(python, "plain")
    assert int(job["status"]["CapAmb"], 16) & CAP_SETUID
    assert job["setuid0"] == "allowed"


def _failing_capset(header, data) -> int:
    ctypes.set_errno(1)  # EPERM, as for a capability set the process may not have
    return -1


@pytest.fixture
def capset_fails(monkeypatch) -> None:
    """capset fails in the child (the parent never calls it)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("capabilities are Linux's")
    monkeypatch.setattr(processes, "_capset", _failing_capset)


def test_it_never_runs_a_job_whose_privileges_could_not_be_dropped(capset_fails, tmp_path):
    proc = start_job_process([sys.executable, "-c", "print('the job ran')"], env={}, cwd=tmp_path)
    out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == PRIVILEGES_EXIT_CODE
    assert "[portal] cannot start the job: dropping the capabilities failed (errno 1)" in out
    assert "the job ran" not in out


@pytest.mark.django_db
def test_it_fails_the_job_and_says_why_when_the_drop_fails(capset_fails, alice, box, settings, tmp_path):
    settings.JOB_ROOTS = [tmp_path]
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    upload = ScriptUpload(name="job.py", content=b"print('the job ran')\n")
    job = job_submit(user=alice, reservation=booking, script=upload)
    assert job_run(job.pk) == Job.Status.FAILED
    job.refresh_from_db()
    assert job.exit_code == PRIVILEGES_EXIT_CODE
    assert job.message.startswith("Did not start: its process could not drop the worker's privileges")
    log = b"".join(log_stream(job.pk)).decode()
    assert "cannot start the job: dropping the capabilities failed (errno 1)" in log
    assert "the job ran" not in log
