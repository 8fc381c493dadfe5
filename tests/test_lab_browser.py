"""JupyterLab through the portal in Chromium (docs/sessions.md): *Open JupyterLab* on a booking,
the lab served by the portal's proxy with the portal's sign-in alone, and a cell run in a kernel
that sees the booked card and the booking's memory caps. The lab's supervisor (jobs.lab) runs
in a thread of this process, as a worker's pool process runs it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from gpus.booking import reservation_create
from jobs import lab
from jobs.models import InteractiveSession
from tests.browser import asgi_page, log_in  # noqa: F401 - the fixture
from tests.waiting import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CELL = (
    "import os\n"
    "print('CARDS', os.environ['CUDA_VISIBLE_DEVICES'], 'JAX', os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'],"
    " 'PREALLOCATE', os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"
)


@pytest.fixture
def labs(settings, monkeypatch, tmp_path):
    """The lab's message runs its supervisor here instead of on a worker; its files in a folder
    of its own."""
    settings.PORTAL_INSTANCE_ID = f"test-{os.getpid()}-{time.monotonic_ns()}"
    settings.JOB_ROOTS = [tmp_path]
    settings.JOB_KILL_GRACE_SECONDS = 2
    threads: list[threading.Thread] = []

    def run_here(pk: int, queue: str) -> None:
        thread = threading.Thread(target=lab.lab_run, args=(pk,), daemon=True)
        thread.start()
        threads.append(thread)

    monkeypatch.setattr("jobs.interactive._send", run_here)
    yield threads
    InteractiveSession.objects.filter(status__in=InteractiveSession.ACTIVE).update(
        end_requested_at="2000-01-01T00:00Z"
    )
    for thread in threads:
        thread.join(timeout=30)


def test_a_cell_in_a_lab_opened_through_the_portal_sees_the_booked_card(asgi_page, alice, box, labs):  # noqa: F811
    from playwright.sync_api import expect

    tab = asgi_page
    booking = reservation_create(user=alice, gpus=[box[1].uuid], memory_mb=8192)
    log_in(tab, "alice")
    tab.goto(f"/reservations/{booking.pk}/")
    tab.click("form.open-lab button")
    tab.wait_for_url("**/sessions/*/lab/**", timeout=90_000)  # the session page follows once it runs
    session = InteractiveSession.objects.get()
    assert session.token not in tab.content()
    tab.goto(f"/sessions/{session.pk}/lab/lab?reset")  # a fresh workspace: no tabs from another run
    tab.locator('.jp-LauncherCard[data-category="Notebook"]').first.click(timeout=60_000)
    editor = tab.locator(".jp-Notebook .jp-Cell .cm-content").first
    expect(editor).to_be_visible(timeout=30_000)
    wait_for(lambda: session_kernels(session), 30, what="the notebook's kernel")
    # Typed once the cell's editor has focus, and seen there, before it runs: a lab that is still
    # settling (its first kernel, a notification) may swallow keys sent too early.
    for _ in range(3):
        editor.click()
        editor.fill(CELL)
        if "CARDS" in editor.inner_text():
            break
        tab.wait_for_timeout(500)
    expect(editor).to_contain_text("CARDS")
    editor.press("Shift+Enter")
    output = tab.locator(".jp-OutputArea-output").filter(has_text="CARDS").first
    expect(output).to_contain_text(f"CARDS {box[1].uuid} JAX", timeout=60_000)
    expect(output).to_contain_text("PREALLOCATE false")
    for request_url in tab.evaluate("performance.getEntriesByType('resource').map(e => e.name)"):
        assert session.token not in request_url


def session_kernels(session: InteractiveSession) -> list:
    session.refresh_from_db()
    return session.kernels
