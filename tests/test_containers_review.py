"""What a review that tried to break jobs in container images found (issue 34), each held here:
the real runner (job_run) and real Podman, in both modes, as tests/test_containers.py. Where the
finding is about a Podman that fails or hangs, CONTAINER_PODMAN is a wrapper that makes one of
its subcommands do so and passes the rest to the real one."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.utils import timezone

from gpus.models import ContainerImage
from jobs.host import containers
from jobs.host.executors import executor_for, podman
from jobs.host.runner import job_run
from jobs.models import Job
from tests.job_helpers import job_log
from tests.test_containers import (  # noqa: F401 - the fixtures
    _containers,
    _in_thread,
    _pause_process_ends,
    account,
    image,
    in_image,
    podman_of,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

TURNS = """
import sys
for i in range(400):
    print(f"line {i}", file=sys.stderr if i % 2 else sys.stdout, flush=True)
"""

# Deaf to SIGTERM: only a SIGKILL ends it before it finishes by itself.
DEAF = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print('ready', flush=True)
time.sleep(25)
print('finished by itself', flush=True)
"""

COUNT_TERMS = """
import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append(time.monotonic()))
print('ready', flush=True)
deadline = time.monotonic() + 30
while time.monotonic() < deadline and not (got and time.monotonic() - got[0] > 0.5):
    time.sleep(0.05)
print('TERMS', len(got), flush=True)
sys.exit(0)
"""


def _podman_that(settings, tmp_path: Path, *, fails: str = "", hangs: str = "", lingers: str = "") -> None:
    """CONTAINER_PODMAN: a wrapper whose `fails` subcommands answer Podman's error, whose `hangs`
    ones never answer, whose `lingers` ones do their work and then do not exit, the rest the real
    Podman's. In VAR_DIR: the rootless account runs it."""
    folder = Path(settings.VAR_DIR) / "podman-wrappers" / tmp_path.name
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    cases = "".join(
        f'  *" {word} "*) echo "Error: database is locked" >&2; exit 125;;\n' for word in fails.split()
    )
    cases += "".join(f'  *" {word} "*) exec sleep 60;;\n' for word in hangs.split())
    real = shutil.which("podman")
    cases += "".join(f'  *" {word} "*) {real} "$@"; sleep 60;;\n' for word in lingers.split())
    wrapper = folder / "podman"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in\n{cases}esac\nexec {shutil.which("podman")} "$@"\n')
    wrapper.chmod(0o755)
    settings.CONTAINER_PODMAN = str(wrapper)


def _run_folders(job: Job, var_dir: str) -> list[Path]:
    """What of the job's run folder (its environment file) is left in VAR_DIR/containers."""
    name = executor_for(job).container  # type: ignore[attr-defined]
    return list((Path(var_dir) / "containers").glob(f"{name}.*"))


def test_stdout_and_stderr_keep_the_order_they_were_printed_in(in_image):  # noqa: F811
    job = in_image(TURNS)
    assert job_run(job.pk) == Job.Status.SUCCEEDED, job_log(job.pk)
    numbers = [int(line.rsplit(" ", 1)[1]) for line in job_log(job.pk).splitlines() if " line " in line]
    assert numbers == list(range(400))  # conmon's two streams made one by the launcher


def test_a_job_in_an_image_never_runs_as_root(in_image, settings):  # noqa: F811
    settings.JOB_USER = ""  # the worker's own account: root, here
    job = in_image("import os; print('UID', os.getuid(), flush=True)")
    assert job_run(job.pk) == Job.Status.FAILED
    job.refresh_from_db()
    assert "never run as root" in job.message and "JOB_USER" in job.message
    assert "UID" not in job_log(job.pk)


def test_a_stop_needs_no_podman_a_failing_inspect_and_a_hanging_kill_change_nothing(  # finding 1
    in_image, settings, tmp_path, alice, podman_of  # noqa: F811
):  # fmt: skip
    _podman_that(settings, tmp_path, fails="inspect", hangs="kill")
    job = in_image(DEAF)
    thread, outcome = _in_thread(job.pk)
    wait_for(lambda: "ready" in job_log(job.pk), timeout=30, what="the job's start")
    cancelled = time.monotonic()
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
    thread.join(30)
    took = time.monotonic() - cancelled
    job.refresh_from_db()
    log = job_log(job.pk)
    assert (outcome, job.exit_code, job.message) == ([Job.Status.CANCELLED], -9, "Cancelled by alice."), log
    assert "finished by itself" not in log and took < 10, (took, log)
    assert "still running after the grace period: SIGKILL" in log and "reached no process" not in log
    assert _containers(job, podman_of) == []


def test_a_podman_that_hangs_at_start_fails_the_job_and_leaves_nothing(  # finding 2
    in_image, settings, tmp_path, monkeypatch  # noqa: F811
):  # fmt: skip
    settings.CONTAINER_START_SECONDS = 2
    # Short, but not so short that the real `podman info` of the host check misses it on a
    # loaded machine (it took over a second with the suite's other workers busy).
    monkeypatch.setattr(containers, "COMMAND_SECONDS", 4.0)
    _podman_that(settings, tmp_path, hangs="run rm")
    job = in_image("print('never', flush=True)", env={"WANDB_API_KEY": "s3cr3t"})
    started = time.monotonic()
    assert job_run(job.pk) == Job.Status.FAILED  # never raises: the runner records why
    job.refresh_from_db()
    assert "did not start in CONTAINER_START_SECONDS (2 s)" in job.message, job.message
    assert "may be left until the worker's next start" in job.message  # the hung `podman rm`, said
    assert "cannot start" in job_log(job.pk) and time.monotonic() - started < 20
    assert _run_folders(job, settings.VAR_DIR) == []


def test_a_podman_client_that_outlives_its_container_does_not_hold_the_jobs_end(
    in_image, settings, tmp_path, monkeypatch  # noqa: F811
):  # fmt: skip
    # Short, but not so short that the real `podman info` of the host check misses it on a
    # loaded machine (it took over a second with the suite's other workers busy).
    monkeypatch.setattr(containers, "COMMAND_SECONDS", 4.0)
    _podman_that(settings, tmp_path, lingers="run")
    job = in_image("print('done', flush=True)")
    started = time.monotonic()
    job_run(job.pk)  # the script ended; its client, stuck, is killed a second later
    assert time.monotonic() - started < 20 and "done" in job_log(job.pk)
    assert _run_folders(job, settings.VAR_DIR) == []


def test_a_container_that_ended_before_it_was_seen_does_not_wait_on_its_stuck_client(
    in_image, settings, tmp_path, monkeypatch  # noqa: F811
):  # fmt: skip
    # Under load a short script's container can start and end between two looks for its init.
    monkeypatch.setattr(podman, "_conmon_child", lambda folder: None)
    monkeypatch.setattr(containers, "COMMAND_SECONDS", 4.0)
    _podman_that(settings, tmp_path, lingers="run")
    job = in_image("print('done', flush=True)")
    started = time.monotonic()
    job_run(job.pk)  # its client, stuck, is killed once its conmon is gone and a grace has passed
    assert time.monotonic() - started < 20 and "done" in job_log(job.pk)
    assert _run_folders(job, settings.VAR_DIR) == []


def test_the_run_folder_with_the_jobs_secrets_goes_when_the_start_fails(in_image, settings, tmp_path):  # noqa: F811
    settings.CONTAINER_DEVICE_DIR = str(tmp_path / "no-nodes")  # finding 9: no node for the card
    (tmp_path / "no-nodes").mkdir()
    job = in_image("print(1)", env={"WANDB_API_KEY": "s3cr3t"})
    assert job_run(job.pk) == Job.Status.FAILED
    job.refresh_from_db()
    assert "has no device node" in job.message
    assert _run_folders(job, settings.VAR_DIR) == []


def test_sigterm_reaches_the_script_once_as_on_the_host(in_image, settings, alice):  # noqa: F811 - finding 5
    settings.JOB_KILL_GRACE_SECONDS = 5
    job = in_image(COUNT_TERMS)
    thread, outcome = _in_thread(job.pk)
    wait_for(lambda: "ready" in job_log(job.pk), timeout=30, what="the job's start")
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
    thread.join(30)
    assert outcome == [Job.Status.CANCELLED]
    assert [line.split("TERMS ")[1] for line in job_log(job.pk).splitlines() if "TERMS" in line] == ["1"]


def test_exit_codes_are_the_scripts_unless_the_portal_sent_the_signal(in_image):  # noqa: F811 - finding 7
    chose = in_image("import sys\nsys.exit(137)\n")
    crashed = in_image("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", cards=(1,))
    job_run(chose.pk)
    job_run(crashed.pk)
    chose.refresh_from_db()
    crashed.refresh_from_db()
    assert (chose.exit_code, chose.message) == (137, "Exited with code 137.")
    # Inside a container a SIGSEGV and exit(139) end alike (catatonit's 128+N): the code, explained.
    assert (crashed.exit_code, crashed.message) == (139, "Exited with code 139."), crashed.message
    assert "exit code 139 = 128 + 11 (SIGSEGV)" in job_log(crashed.pk)


def test_a_reference_that_looks_like_an_option_is_never_read_as_one(in_image, image):  # noqa: F811
    ContainerImage.objects.filter(pk=image.pk).update(reference="--help")  # past the model's own check
    job = in_image("print(1)")
    assert job_run(job.pk) == Job.Status.FAILED, job_log(job.pk)[:1500]


def test_two_instances_never_name_one_container(settings):  # finding 11
    names = set()
    for instance in ("a b", "a-b", "a/b"):
        settings.PORTAL_INSTANCE_ID = instance
        names.add(executor_for(SimpleNamespace(image_id=1, pk=7)).container)  # type: ignore[attr-defined]
    assert len(names) == 3 and all(name.startswith("portal-a-b-") for name in names), names
