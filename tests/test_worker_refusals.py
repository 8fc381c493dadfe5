"""A GPU host's worker that would run jobs as root unasked, or report a simulated server that does
not exist, refuses to start and says why (issue 42 items 4 and 10).

Both are shown on real `celery -A portal worker` processes outside PORTAL_DEVELOPMENT (the
suite's own workers run with it: tests/isolation.py), and the rules on the functions themselves.
"""

from __future__ import annotations

import logging
import os
import re
import secrets

import pytest
from django.urls import reverse

from gpus import backends
from gpus.backends import simulated_server_problem
from gpus.models import Server
from gpus.services import server_report_ingest
from gpus.simulated.inventory import server_names
from jobs.host.worker import JobsAsRootRefused, jobs_account_check, jobs_as_root_record
from tests.factories import UserFactory, make_snapshot
from tests.waiting import wait_for

# A deployment's settings (portal/settings_safety.py), so that only the worker's own check refuses.
PRODUCTION = {
    "PORTAL_DEVELOPMENT": "0",
    "SECRET_KEY": secrets.token_urlsafe(50),
    "ALLOWED_HOSTS": "portal.example.org",
    "PORTAL_URL": "https://portal.example.org",
}
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs a worker run as root")


@pytest.fixture
def root_worker(settings, monkeypatch):
    """This process as a root GPU host worker of a deployment, with no JOB_USER."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    settings.PORTAL_DEVELOPMENT = False
    settings.JOB_USER, settings.JOB_USER_ROOT = "", False
    settings.GPU_BACKEND = "simulated"
    return settings


# --- item 4: jobs as root -------------------------------------------------------------------------------


def test_a_root_worker_without_job_user_is_refused_naming_the_fixes(root_worker):
    with pytest.raises(JobsAsRootRefused) as refused:
        jobs_account_check()

    said = str(refused.value)
    assert "it runs as root and JOB_USER is empty, so every job would run as root too" in said
    for fix in ("JOB_USER=gpujob", "JOB_USER=@owner", "JOB_USER=root"):
        assert fix in said


def test_job_user_root_starts_saying_so_loudly(root_worker, caplog):
    root_worker.JOB_USER_ROOT = True

    with caplog.at_level(logging.WARNING, logger="jobs.host.worker"):
        jobs_account_check()

    assert "JOB_USER=root: EVERY JOB ON" in caplog.text


@pytest.mark.parametrize(
    "setting",
    [
        {"JOB_USER": "gpujob"},
        {"JOB_USER": "@owner"},
        {"PORTAL_DEVELOPMENT": True},  # make run (which says so once itself) and the tests
        {"GPU_BACKEND": "slurm"},  # Slurm runs each job as its owner
    ],
)
def test_a_root_worker_starts_where_jobs_do_not_run_as_root_unasked(root_worker, setting):
    for name, value in setting.items():
        setattr(root_worker, name, value)

    jobs_account_check()


def test_a_worker_that_is_not_root_is_never_refused(root_worker, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)

    jobs_account_check()


@pytest.mark.django_db
def test_whether_jobs_run_as_root_is_recorded_once_the_server_has_a_row(root_worker):
    assert jobs_as_root_record("box1") is False  # no report yet: asked again with the next snapshot
    server_report_ingest(snapshot=make_snapshot("box1"))

    assert jobs_as_root_record("box1") is True
    assert Server.objects.get(name="box1").jobs_as_root is True
    root_worker.JOB_USER = "gpujob"
    jobs_as_root_record("box1")
    assert Server.objects.get(name="box1").jobs_as_root is False


@pytest.mark.django_db
def test_only_admins_see_where_jobs_run_as_root_on_the_dashboard(client, box, alice):
    Server.objects.filter(name="box1").update(jobs_as_root=True)
    admin = UserFactory(username="root-admin", is_staff=True)

    client.force_login(alice)
    assert "jobs run as root" not in client.get(reverse("dashboard")).content.decode()
    client.force_login(admin)
    assert "jobs run as root" in client.get(reverse("dashboard")).content.decode()


@pytest.mark.worker
@as_root
def test_a_real_root_worker_without_job_user_refuses_to_start(start_worker):
    name = server_names()[0]

    proc = start_worker(name, extra_env={**PRODUCTION, "JOB_USER": ""})

    wait_for(lambda: proc.poll() is not None, timeout=60, what="the worker to refuse")
    said = start_worker.log(proc)
    assert proc.returncode != 0
    assert f"The worker of {name} does not start: it runs as root and JOB_USER is empty" in said
    assert " ready." not in said  # Celery's line once it takes messages: it never did


@pytest.mark.worker
@as_root
def test_a_real_root_worker_with_job_user_root_starts_and_says_so(start_worker, client):
    name = server_names()[0]
    server_report_ingest(snapshot=make_snapshot(name, simulated=True))

    proc = start_worker(name, extra_env={**PRODUCTION, "JOB_USER": "root"})

    wait_for(lambda: Server.objects.get(name=name).jobs_as_root, timeout=60, what="the worker's word")
    said = start_worker.log(proc)
    assert proc.poll() is None
    assert f"JOB_USER=root: EVERY JOB ON {name}" in said
    client.force_login(UserFactory(username="root-admin", is_staff=True))
    assert "jobs run as root" in client.get(reverse("dashboard")).content.decode()


# --- item 10: a simulated server that does not exist -----------------------------------------------------


def test_an_unknown_simulated_server_is_a_problem_naming_the_known_ones(settings):
    settings.GPU_BACKEND, settings.WORKER_SERVER = "simulated", "gpu-a"

    problem = simulated_server_problem()

    assert problem.startswith("WORKER_SERVER='gpu-a' is no server of the simulated inventory")
    assert ", ".join(server_names()) in problem
    assert "SIMULATED_INVENTORY to a file of your own that names this server" in problem


def test_auto_asks_only_where_it_would_simulate(settings, monkeypatch):
    settings.GPU_BACKEND, settings.WORKER_SERVER = "auto", "gpu-a"
    monkeypatch.setattr(backends, "nvml_library_found", lambda: True)
    assert simulated_server_problem() == ""  # real cards: NVML names the host
    monkeypatch.setattr(backends, "nvml_library_found", lambda: False)
    assert "is no server of the simulated inventory" in simulated_server_problem()
    settings.WORKER_SERVER = server_names()[0]
    assert simulated_server_problem() == ""


def test_a_malformed_inventory_is_a_problem_too(settings, tmp_path):
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("servers: []\n")
    settings.GPU_BACKEND, settings.SIMULATED_INVENTORY = "simulated", str(inventory)

    assert simulated_server_problem().startswith(f"SIMULATED_INVENTORY: {inventory}: users: missing")


def test_the_documented_inventory_of_ones_own_servers_works(settings, tmp_path):
    """docs/deploy.md, "Trying it on servers without GPUs": its file, as written there."""
    text = (settings.BASE_DIR / "docs" / "deploy.md").read_text()
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(re.search(r"```yaml\n(# /etc/gpu-portal/inventory.yaml\n.*?)```", text, re.S)[1])
    settings.GPU_BACKEND, settings.SIMULATED_INVENTORY = "simulated", str(inventory)

    settings.WORKER_SERVER = "gpu01"
    assert simulated_server_problem() == ""
    settings.WORKER_SERVER = "gpu03"
    assert f"inventory {inventory}, which knows gpu01, gpu02. Set WORKER_SERVER" in simulated_server_problem()


@pytest.mark.worker
def test_a_real_worker_for_an_unknown_simulated_server_refuses_to_start(start_worker):
    proc = start_worker("no-such-box")

    wait_for(lambda: proc.poll() is not None, timeout=60, what="the worker to refuse")
    said = start_worker.log(proc)
    assert proc.returncode != 0
    assert "The worker of no-such-box does not start: WORKER_SERVER='no-such-box' is no server" in said
    assert all(known in said for known in server_names())
    assert " ready." not in said
    assert "Traceback" not in said
