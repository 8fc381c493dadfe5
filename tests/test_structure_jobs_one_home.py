"""Rules and helpers written once (issue 20): the wait of the tests and the benchmarks, and a
card's live figures of the ingest and the dashboard."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from gpus import selectors, services
from gpus.models import GPU
from gpus.quotas import Use, gpu_hours
from tests import conftest
from tests.conftest import ROOT
from tests.waiting import WaitTimedOut, wait_for


def test_wait_for_returns_the_first_true_value():
    values = iter([0, "", "here"])
    assert wait_for(lambda: next(values), 5, interval=0.01) == "here"


def test_a_wait_that_times_out_is_a_failed_expectation():
    with pytest.raises(AssertionError, match=r"timed out after 0\.05 s waiting for the moon"):
        wait_for(lambda: False, 0.05, what="the moon", interval=0.01)
    assert issubclass(WaitTimedOut, AssertionError)


def test_the_tests_and_the_bench_wait_with_the_same_helper_and_the_bench_needs_no_pytest():
    assert not hasattr(conftest, "wait_for")
    script = (
        "import sys, bench.common as c, tests.waiting as w; "
        "assert c.wait_for is w.wait_for and not hasattr(c, 'wait_until'); "
        "assert 'pytest' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True)


def test_the_ingest_writes_the_live_figures_the_dashboard_reads():
    assert [*selectors.GPU_LIVE_FIELDS, "processes_digest", "updated_at"] == services._GPU_LIVE_FIELDS


def test_what_a_booking_costs_is_one_rule_and_how_full_it_makes_a_card_another():
    """Charged over the card's total (quotas, reports, fair share); room over its bookable memory."""
    start = datetime(2026, 1, 5, tzinfo=UTC)
    use = Use.of(start, start + timedelta(hours=8), 12 * 1024, 24 * 1024)
    assert use.card_fraction == GPU.charged_share(12 * 1024, 24 * 1024) == 0.5
    assert gpu_hours([use], start, start + timedelta(hours=8)) == 4.0
    assert GPU.charged_share(None, 24 * 1024) == GPU.card_share(None, 20 * 1024) == 1.0
    assert GPU.card_share(12 * 1024, 24 * 1024 - 512) > GPU.charged_share(12 * 1024, 24 * 1024)
