"""What a review that tried to break jobs in container images found (issue 34), each held here:
the real runner (job_run) and root-run Podman, as tests/test_containers.py."""

from __future__ import annotations

import pytest

from jobs.host.runner import job_run
from jobs.models import Job
from tests.job_helpers import job_log
from tests.test_containers import image, in_image  # noqa: F401 - the fixtures

pytestmark = pytest.mark.django_db(transaction=True)

TURNS = """
import sys
for i in range(400):
    print(f"line {i}", file=sys.stderr if i % 2 else sys.stdout, flush=True)
"""


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
