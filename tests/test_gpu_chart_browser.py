"""The GPU page's chart in Chromium: its time labels are the person's, HH:MM:SS on a 24-hour clock in
the zone every page shows (their profile's), never the browser's locale (en-US: "3:04:05 PM") or
zone, as a laptop in New York showed a Tokyo person's chart (review of issue 41, item 12)."""

from __future__ import annotations

import zoneinfo
from datetime import timedelta

import pytest
from django.utils import timezone

from gpus.models import GPU, TelemetrySample
from gpus.services import server_report_ingest
from portal.models import Profile
from tests.browser import POLL_MS, chromium, log_in  # noqa: F401 - the fixture
from tests.factories import make_snapshot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PERSON = "Asia/Tokyo"


def test_the_charts_times_are_the_persons_24_hour_clock_in_their_zone(chromium, live_server, alice):  # noqa: F811
    server_report_ingest(snapshot=make_snapshot("box1", gpus=1, simulated=True))
    gpu = GPU.objects.get(server__name="box1")
    now = timezone.now().replace(microsecond=0)
    TelemetrySample.objects.bulk_create(
        TelemetrySample(
            gpu=gpu, at=now - timedelta(minutes=m, seconds=7), utilization_pct=40, memory_used_mb=1024
        )
        for m in (50, 20)
    )
    Profile.objects.update_or_create(user=alice, defaults={"time_zone": PERSON})
    points = TelemetrySample.objects.filter(gpu=gpu).order_by("at").values_list("at", flat=True)
    expected = [timezone.localtime(at, zoneinfo.ZoneInfo(PERSON)).strftime("%H:%M:%S") for at in points]

    with chromium.tab(live_server.url, locale="en-US", timezone_id="America/New_York") as tab:
        log_in(tab, "alice")
        tab.goto(f"/gpus/{gpu.uuid}/")
        assert tab.evaluate("navigator.language") == "en-US"
        tab.wait_for_function(
            "() => (Chart.getChart('gpu-chart')?.data.labels || []).length >= 2", polling=POLL_MS
        )
        labels = tab.evaluate("Chart.getChart('gpu-chart').data.labels")
    assert labels == expected, labels  # en-US in New York would say e.g. "1:04:05 AM"
