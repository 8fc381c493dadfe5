"""Containers: submit → first line for a job in a warm image against a bare job (issue 34).

What is measured
    A real `celery -A portal worker` for a simulated GPU host (bench_jobs.start_worker: prefork,
    --concurrency 1) runs jobs as JOB_USER=nobody with root-run Podman (CONTAINER_MODE=root), the
    booked card a fake node (mknod c 195 0, CONTAINER_DEVICE_DIR). The image is a root filesystem
    built from the host's python3 (tests/container_image.py, cached in the var folder); bare jobs run
    that same python3 on the host (JOB_INTERPRETERS). Jobs
    alternate, bare then in the image, one warm-up pair and then RUNS pairs; each job's time is
    submit → "FIRST <t>" printed by the script (bench_jobs.run_first_job). The image is set in the
    job's submit transaction, before its dispatch.
    Goal: median(image) − median(bare) ≤ 0.5 s.

Skipped (said, exit code 0) where root-run Podman cannot run here: not root, or no runtime.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench.bench_jobs import run_first_job, start_worker
from bench.common import database_url_for_subprocess, report, setup_django_test_db, stop

RUNS = 5


def main() -> int:
    if os.geteuid() != 0:
        print("Containers: skipped (root-run Podman and fake device nodes need root)")
        return 0
    teardown = setup_django_test_db()
    scratch = Path(tempfile.mkdtemp(prefix="bench-containers-"))
    scratch.chmod(0o755)  # JOB_USER=nobody reaches its job folder through it
    worker = None
    try:
        from django.conf import settings
        from django.contrib.auth import get_user_model

        from gpus.booking import reservation_create
        from gpus.models import ContainerImage
        from gpus.services import server_report_ingest
        from gpus.simulated.inventory import server_names
        from jobs.host.containers import runtime_status
        from portal.models import Membership, Team
        from tests.container_image import fake_gpu_nodes, host_python, rootfs
        from tests.factories import make_snapshot

        ok, detail = runtime_status()
        if not ok:
            print(f"Containers: skipped ({detail})")
            return 0
        print(f"Containers ({detail})")
        image = ContainerImage.objects.create(name="bench-py", reference=str(rootfs()))
        server = server_names()[0]
        server_report_ingest(snapshot=make_snapshot(server, gpus=4, simulated=True))
        user = get_user_model().objects.create_user("bench", password="bench-password")
        team = Team.objects.create(name="Bench Lab", slug="bench-lab")
        Membership.objects.create(team=team, user=user, role=Membership.Role.MEMBER)
        booking = reservation_create(user=user, gpus=[f"GPU-{server}-00"])
        os.environ.update(
            PORTAL_INSTANCE_ID=settings.PORTAL_INSTANCE_ID,  # the worker's queue keys are the bench's
            JOB_INTERPRETERS=f"default={host_python()}",  # the image's python3, on the host: nobody runs it
            JOB_USER="nobody",
            CONTAINER_MODE="root",
            CONTAINER_DEVICE_DIR=str(fake_gpu_nodes(scratch / "dev", 4)),
        )
        worker, worker_log = start_worker(server, database_url_for_subprocess(), scratch)
        pairs = [
            (run_first_job(user, booking, worker_log)[0], run_first_job(user, booking, worker_log, image)[0])
            for _ in range(1 + RUNS)
        ][1:]
    finally:
        stop(worker)
        teardown()
        shutil.rmtree(scratch, ignore_errors=True)
    bare, boxed = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    print(f"Submit → first line ({RUNS} pairs after a warm-up pair, median)")
    report("bare job", bare, "s", "(none)", True)
    report("job in a warm image (root-run Podman)", boxed, "s", "(none)", True)
    report("container overhead (image − bare)", boxed - bare, "s", "<= 0.5 s", boxed - bare <= 0.5)
    each = ", ".join(f"{b:.2f}/{i:.2f}" for b, i in pairs)
    print(f"    each pair, bare/image: {each} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
