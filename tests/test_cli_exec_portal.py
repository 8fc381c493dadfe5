"""`gpu exec` as a real process against the real portal (Django's live server, the test
database): the booking's environment reaches the command, its exit code is gpu's, and the session
row records the command's pid and end; an end asked for on the portal stops it at the next beat.
(tests/test_cli_exec.py tests gpu's side against a scripted stand-in.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from django.utils import timezone

from gpu_cli import config
from gpus.booking import reservation_create
from gpus.services import server_report_ingest
from jobs.models import InteractiveSession
from portal.services import api_token_create
from tests.factories import make_snapshot
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

GPU_BIN = Path(sys.executable).parent / "gpu"


@pytest.fixture
def env(live_server, alice, tmp_path, settings) -> dict[str, str]:
    settings.SESSION_BEAT_SECONDS = 1
    settings.SESSION_LOST_AFTER_SECONDS = 3
    token = api_token_create(user=alice, name="tests", expires_at=None)[1]
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        config.URL_ENV: live_server.url,
        config.TOKEN_ENV: token,
        "GPU_SERVER": "box1",
        "GPU_RETRY_SECONDS": "0",
    }


def test_exec_runs_with_the_bookings_card_and_the_portal_records_it(env, alice, box):
    booking = reservation_create(user=alice, gpus=[box[2].uuid], memory_mb=8192)
    command = 'echo "$CUDA_VISIBLE_DEVICES $XLA_PYTHON_CLIENT_PREALLOCATE $PORTAL_RESERVATION_ID"; exit 3'
    done = subprocess.run(
        [GPU_BIN, "exec", "--", "sh", "-c", command], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == [box[2].uuid, "false", str(booking.pk)]
    session = InteractiveSession.objects.get()
    assert (session.status, session.exit_code, session.kind, session.reservation_id) == (
        "ended",
        3,
        "exec",
        booking.pk,
    )
    assert session.pid and session.pid > 1 and session.command == ["sh", "-c", command]


def test_exec_on_another_host_is_refused_and_runs_nothing(env, alice, box, tmp_path):
    reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    marker = tmp_path / "ran"
    done = subprocess.run(
        [GPU_BIN, "exec", "--", "touch", str(marker)],
        env={**env, "GPU_SERVER": "box9"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "no booking active now on box9" in done.stderr
    assert not marker.exists() and not InteractiveSession.objects.exists()


def test_on_a_simulated_server_the_refusal_says_how_and_that_works(env, alice, tmp_path):
    """`make run`'s inventory: the booking's server has no machine of its own, so "run it there"
    cannot be done; the refusal names GPU_SERVER (issue 38), and following it runs the command."""
    server_report_ingest(snapshot=make_snapshot("sim-rtx-4x24", gpus=4, simulated=True))
    booking = reservation_create(user=alice, gpus=["GPU-sim-rtx-4x24-00"], memory_mb=8192)
    marker = tmp_path / "ran"
    here = {name: value for name, value in env.items() if name != "GPU_SERVER"}  # this hostname
    argv = [GPU_BIN, "exec", "-r", str(booking.pk), "--", "touch", str(marker)]
    done = subprocess.run(argv, env=here, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and not marker.exists()
    assert "sim-rtx-4x24 is simulated" in done.stderr and "GPU_SERVER=sim-rtx-4x24 gpu exec …" in done.stderr
    done = subprocess.run(
        argv, env={**here, "GPU_SERVER": "sim-rtx-4x24"}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert marker.exists()


def test_an_end_asked_for_on_the_portal_stops_the_command(env, alice, box):
    reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    proc = subprocess.Popen(
        [GPU_BIN, "exec", "--", "sleep", "60"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: InteractiveSession.objects.filter(status="running").exists(),
            timeout=30,
            what="the command",
        )
        InteractiveSession.objects.update(end_requested_at=timezone.now())
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    session = InteractiveSession.objects.get()
    assert session.status == "ended" and session.exit_code == 143 and "ended from the portal" in stderr
