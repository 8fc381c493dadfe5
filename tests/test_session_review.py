"""A third review of lines stored as they are drawn (jobs/logs/store.py), of what the earlier two
left: `gpu logs` of a job drawing a bar, a real job cancelled inside a bar, and a spool replayed
after the reconciler marked its job lost."""

# ruff: noqa: F811 - the stream's and the runner's fixtures, imported and taken as arguments

from __future__ import annotations

import io
import sys

import pytest

from gpu_cli.api import Portal
from gpu_cli.jobs import copy_log
from jobs.logs.store import LogWriter, log_stream
from jobs.models import Job
from portal.services import api_token_create
from tests.test_log_stream import _setup, job, server  # noqa: F401 - the stream's fixtures
from tests.test_runner_session import job_in  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


class _Tty(io.TextIOWrapper):
    def isatty(self) -> bool:
        return True


def test_gpu_logs_of_a_job_drawing_a_bar_leaves_the_prompt_on_a_line_of_its_own(
    server, job, alice, monkeypatch
):
    # `gpu logs 42` on a running job: the log now ends inside the bar being drawn (no newline of
    # the writer's own since 2619b6a). Printed to a terminal as is, the shell's prompt is glued to
    # the bar ("Epoch 3: 45%|████  $ "). Before, every stored line ended with a newline.
    writer = LogWriter(job.pk)
    writer.feed(b"Epoch 1/3\n\rEpoch 1:  45%|####")
    writer.partial_since -= 1.0
    writer.maybe_flush()
    writer.flush()
    assert not b"".join(log_stream(job.pk)).endswith(b"\n")  # stored open, as designed
    _, key = api_token_create(user=alice, name="cli", expires_at=None)
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", _Tty(raw, encoding="utf-8"))
    copy_log(Portal(server, key, retry_seconds=5), job.pk, follow=False)
    sys.stdout.flush()
    assert raw.getvalue().endswith(b"\n")


BAR_THEN_SIGTERM = """
import signal, sys, time
def answer(signum, frame):
    sys.stdout.write("\\rEpoch 1:  60%|######"); sys.stdout.flush()
    time.sleep(0.3)
    sys.exit(143)
signal.signal(signal.SIGTERM, answer)
print("ready", flush=True)
for step in range(5):
    sys.stdout.write("\\rEpoch 1:  %d%%|%s" % (step * 10, "#" * step)); sys.stdout.flush()
    time.sleep(0.3)
time.sleep(120)
"""


def test_a_real_job_cancelled_inside_a_bar_ends_its_log_with_one_newline_each_line_stamped(job_in, alice):
    import re

    from django.utils import timezone

    from jobs.models import Job
    from tests.job_helpers import job_log
    from tests.test_runner_session import _run_in_thread
    from tests.waiting import wait_for

    job = job_in(BAR_THEN_SIGTERM)
    thread, outcome = _run_in_thread(job.pk)
    wait_for(lambda: "Epoch 1:  30%" in job_log(job.pk), timeout=30, what="the bar")
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
    thread.join(timeout=30)
    assert outcome == [Job.Status.CANCELLED]
    raw = b"".join(log_stream(job.pk))
    assert raw.endswith(b"\n") and not raw.endswith(b"\n\n"), raw
    stamp = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ")
    for line in raw.split(b"\n")[:-1]:
        assert stamp.match(line), (line, raw)
        assert b"[portal]" not in line or (
            stamp.fullmatch(line[:25]) and line[25:].startswith(b"[portal]")
        ), raw
    assert b"Epoch 1:  60%" in raw


def test_a_spool_replayed_after_the_reconciler_marked_the_job_lost_starts_and_ends_its_lines(
    job, monkeypatch
):
    # A worker cut off from the database spools its job's output, then dies (the host reboots);
    # the reconciler marks the job lost (its line ends the stored open bar: log_append); the host
    # comes back and replay_spools stores what waited on disk (no end record: the supervisor died).
    # The spool began inside the stored bar (no timestamp of its own: it went on with it) and ends
    # inside another: after the lost line it is a line without timestamp, and the finished job's
    # log never ends its last line. Before 2619b6a the spool held stamped, ended lines only.
    from django.db import OperationalError

    from jobs.host.replay import _replay_one
    from jobs.host.spool import LogSpool, spool_name
    from jobs.logs.store import log_append
    from tests.test_log_lines_review import Away, _each_line_stamped_once, _waited

    away = Away(monkeypatch)
    name = spool_name(job.pk, job.created_at)
    spool = LogSpool(name, cap_bytes=1 << 20)
    writer = LogWriter(job.pk, spool=spool)
    writer.feed(b"Epoch 1/2\n\r1/9 [==")
    _waited(writer)
    writer.flush()  # stored, open
    away.down = True
    writer.feed(b"\r2/9 [====\nEpoch 2/2\n\r1/9 [=")
    _waited(writer)
    with pytest.raises(OperationalError):
        writer.flush()  # on the spool: it goes on with the stored bar, and ends inside one
    away.down = False
    spool.close()  # the worker died: its spool is left on disk
    Job.objects.filter(pk=job.pk).update(status=Job.Status.LOST)
    log_append(job.pk, "[portal] Lost: its worker stopped answering.")
    assert _replay_one(name, LogSpool(name, cap_bytes=1 << 20)) == 1
    _each_line_stamped_once(b"".join(log_stream(job.pk)))
