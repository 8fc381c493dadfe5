"""axe-core (vendored from npm: tests/vendor/axe-4.10.3.min.js, MPL-2.0) on the main pages in
Chromium (issue 23): no critical or serious violation."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpus.booking import reservation_create
from gpus.services import server_report_ingest
from jobs.submit import ScriptUpload, job_submit
from tests.browser import log_in, page  # noqa: F401 - the fixture
from tests.factories import make_snapshot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

AXE = Path(__file__).parent / "vendor" / "axe-4.10.3.min.js"
PAGES = [
    "/",
    "/reservations/",
    "/reservations/new/",
    "/jobs/",
    "/jobs/new/",
    "/queue/",
    "/violations/",
    "/reports/",
    "/notifications/",
    "/profile/",
]
RUN = """async () => {
  const result = await axe.run(document, {resultTypes: ['violations']});
  return result.violations.filter(v => ['critical', 'serious'].includes(v.impact))
    .map(v => `${v.id} (${v.impact}): ${v.nodes.slice(0, 3).map(n => n.target.join(' ')).join(' | ')}`);
}"""


def test_the_main_pages_have_no_critical_or_serious_accessibility_violation(page, alice, monkeypatch):  # noqa: F811
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: None)
    server_report_ingest(snapshot=make_snapshot("box1", gpus=4, simulated=True))
    booking = reservation_create(user=alice, gpus=["GPU-box1-00"], memory_mb=8192)
    job = job_submit(
        user=alice, reservation=booking, script=ScriptUpload(name="train.py", content=b"print(1)\n")
    )
    log_in(page, "alice")
    found = {}
    for path in [*PAGES, f"/jobs/{job.pk}/", f"/reservations/{booking.pk}/"]:
        page.goto(path)
        page.add_script_tag(path=str(AXE))
        if violations := page.evaluate(RUN):
            found[path] = violations
    assert not found, "\n".join(f"{path}: {v}" for path, vs in found.items() for v in vs)
