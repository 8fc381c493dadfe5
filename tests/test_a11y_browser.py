"""axe-core (vendored from npm: tests/vendor/axe-4.10.3.min.js, MPL-2.0) on the main pages in
Chromium (issue 23): no critical or serious violation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser import chromium, log_in, main_pages_of  # noqa: F401 - the fixture

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

AXE = Path(__file__).parent / "vendor" / "axe-4.10.3.min.js"
RUN = """async () => {
  const result = await axe.run(document, {resultTypes: ['violations']});
  return result.violations.filter(v => ['critical', 'serious'].includes(v.impact))
    .map(v => `${v.id} (${v.impact}): ${v.nodes.slice(0, 3).map(n => n.target.join(' ')).join(' | ')}`);
}"""


def test_the_main_pages_have_no_critical_or_serious_accessibility_violation(
    live_server,
    chromium,  # noqa: F811
    alice,
    monkeypatch,
):
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: None)
    paths = main_pages_of(alice)
    found = {}
    # axe is added to each page as an inline script, which the pages' policy refuses (as it
    # should): this tab alone bypasses it. tests/test_csp.py reads the same pages under it.
    with chromium.tab(live_server.url, bypass_csp=True) as page:
        log_in(page, "alice")
        for path in paths:
            page.goto(path)
            page.add_script_tag(path=str(AXE))
            if violations := page.evaluate(RUN):
                found[path] = violations
    assert not found, "\n".join(f"{path}: {v}" for path, vs in found.items() for v in vs)
