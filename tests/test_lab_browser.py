"""JupyterLab through the portal in Chromium (docs/sessions.md): *Open JupyterLab* on a booking, the
hand-off to the labs' own origin, and the lab served there by the portal's proxy; a cell run in a
kernel that sees the booked card and the booking's memory caps; and script in the lab page, which
can neither read nor change anything of the portal's as its user.

The portal is http://localhost:PORT and the labs http://127.0.0.1:PORT, one server, as `make run`
has them (tests/asgi_server.py). The lab's supervisor (jobs.host.lab) runs in a thread of this process,
as a worker's pool process runs it: a real Jupyter server, a real kernel."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator

import pytest

from gpus.booking import reservation_create
from jobs.host import lab
from jobs.models import InteractiveSession
from tests.asgi_server import asgi_servers
from tests.browser import chromium, log_in  # noqa: F401 - the fixture
from tests.waiting import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CELL = (
    "import os\n"
    "print('CARDS', os.environ['CUDA_VISIBLE_DEVICES'], 'JAX', os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'],"
    " 'PREALLOCATE', os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"
)
# What script in a lab page would try against its user's portal session: read who they are
# (relative: the lab's own origin; absolute: the portal's, with credentials, readable or opaque),
# end their lab with a cross-site POST, and read the portal's cookies.
ATTACK = """async ([portal, endPath]) => {
  const read = async (url, init) => {
    try {
      const answer = await fetch(url, init);
      return {status: answer.status, type: answer.type, body: await answer.text()};
    } catch (error) {
      return {error: String(error)};
    }
  };
  return {
    relative: await read("/api/v1/me/", {credentials: "include"}),
    absolute: await read(portal + "/api/v1/me/", {credentials: "include"}),
    opaque: await read(portal + "/api/v1/me/", {credentials: "include", mode: "no-cors"}),
    end: await read(portal + endPath, {method: "POST", credentials: "include", mode: "no-cors"}),
    cookies: document.cookie,
    origin: location.origin,
  };
}"""

ME = "fetch('/api/v1/me/', {headers: {Accept: 'application/json'}}).then(a => a.json()).then(m => m.username)"


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

    monkeypatch.setattr("jobs.sessions.services._send", run_here)
    yield threads
    InteractiveSession.objects.filter(status__in=InteractiveSession.ACTIVE).update(
        end_requested_at="2000-01-01T00:00Z"
    )
    for thread in threads:
        thread.join(timeout=30)


@pytest.fixture
def portal_tab(chromium) -> Iterator[tuple[object, str, str]]:  # noqa: F811
    """A Chromium tab on the portal, and the portal's and the labs' origins."""
    with asgi_servers() as (portal, lab_origin), chromium.tab(portal) as tab:
        yield tab, portal, lab_origin


def open_lab_from_booking(tab, booking, lab_origin: str, wait_s: int = 90) -> InteractiveSession:  # type: ignore[no-untyped-def]
    """*Open JupyterLab* on the booking's page, followed to the lab on its own origin (within
    `wait_s`: a lab that starts takes seconds)."""
    tab.goto(f"/reservations/{booking.pk}/")
    tab.click("form.open-lab button")
    # The session page follows once it runs: the portal's lab path, the hand-off, the lab.
    tab.wait_for_url(f"{lab_origin}/sessions/*/lab/**", timeout=wait_s * 1000)
    return InteractiveSession.objects.get(reservation=booking)


def run_cell(editor, prompt) -> None:  # type: ignore[no-untyped-def]
    """Shift+Enter in the cell until its prompt says it is queued or ran ([*] or [1]): on a loaded
    machine a lab still settling (its first kernel's start) swallowed the keys once, and the cell
    never ran. Pressed again only while the prompt still says it never did."""
    from playwright.sync_api import expect

    for _ in range(3):
        editor.press("Shift+Enter")
        try:
            expect(prompt).to_have_text(re.compile(r"\[[*0-9]+\]"), timeout=15_000)
            return
        except AssertionError:
            continue
    expect(prompt).to_have_text(re.compile(r"\[[*0-9]+\]"))


def test_a_cell_in_a_lab_opened_through_the_portal_sees_the_booked_card(portal_tab, alice, box, labs) -> None:
    from playwright.sync_api import expect

    tab, _portal, lab_origin = portal_tab
    booking = reservation_create(user=alice, gpus=[box[1].uuid], memory_mb=8192)
    log_in(tab, "alice")
    session = open_lab_from_booking(tab, booking, lab_origin)
    assert session.token not in tab.content()
    tab.goto(f"/sessions/{session.pk}/lab/lab?reset")  # the portal's address; a fresh workspace
    assert tab.url == f"{lab_origin}/sessions/{session.pk}/lab/lab?reset"  # its cookie: no hand-off
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
    run_cell(editor, tab.locator(".jp-Notebook .jp-Cell .jp-InputArea-prompt").first)
    output = tab.locator(".jp-OutputArea-output").filter(has_text="CARDS").first
    expect(output).to_contain_text(f"CARDS {box[1].uuid} JAX", timeout=60_000)
    expect(output).to_contain_text("PREALLOCATE false")
    for request_url in tab.evaluate("performance.getEntriesByType('resource').map(e => e.name)"):
        assert session.token not in request_url


def test_script_in_a_lab_page_cannot_act_as_its_user_on_the_portal(portal_tab, alice, box, labs) -> None:
    tab, portal, lab_origin = portal_tab
    booking = reservation_create(user=alice, gpus=[box[1].uuid], memory_mb=8192)
    log_in(tab, "alice")
    started = time.monotonic()
    session = open_lab_from_booking(tab, booking, lab_origin)
    tab.wait_for_selector("#jp-main-dock-panel", timeout=60_000)
    print(f"\nbooking page → lab page usable: {time.monotonic() - started:.1f} s (lab start included)")

    got = tab.evaluate(ATTACK, [portal, f"/sessions/{session.pk}/end/"])

    assert got["origin"] == lab_origin
    assert got["relative"]["status"] == 404  # the labs' origin serves no portal path
    assert "error" in got["absolute"]  # a cross-origin answer the page may not read
    assert (got["opaque"]["type"], got["opaque"]["body"]) == ("opaque", "")
    assert "alice" not in json.dumps(got)
    assert "sessionid" not in got["cookies"] and "csrftoken" not in got["cookies"]
    session.refresh_from_db()
    assert session.end_requested_at is None and session.status == InteractiveSession.Status.RUNNING
    # Not for want of a session: the same fetch from a portal page reads alice.
    tab.goto(f"{portal}/profile/")
    assert tab.evaluate(ME) == "alice"


def test_a_form_whose_answer_leads_to_the_lab_lands_in_it(portal_tab, alice, box, labs) -> None:
    """Chromium holds a form's POST to the page's form-action (CSP) through every redirect that
    follows it, so the portal's pages must allow LAB_ORIGIN there."""
    tab, portal, lab_origin = portal_tab
    booking = reservation_create(user=alice, gpus=[box[1].uuid], memory_mb=8192)
    log_in(tab, "alice")
    session = open_lab_from_booking(tab, booking, lab_origin)
    # The booking's *Open JupyterLab* on a running lab: the POST's answer leads to it at once.
    again = time.monotonic()
    assert open_lab_from_booking(tab, booking, lab_origin, wait_s=15) == session
    tab.wait_for_selector("#jp-main-dock-panel", timeout=60_000)
    print(f"\nopen a running lab again (its cookie held): {time.monotonic() - again:.1f} s")
    # A browser with no cookie at all: the lab's portal address asks for a sign-in, and the
    # sign-in's POST goes on through the hand-off into the lab.
    tab.context.clear_cookies()
    tab.goto(f"{portal}/sessions/{session.pk}/lab/")
    assert tab.url.startswith(f"{portal}/login/?next=")
    tab.fill("input[name=username]", "alice")
    tab.fill("input[name=password]", "password")
    tab.click("button[type=submit]")
    tab.wait_for_url(f"{lab_origin}/sessions/{session.pk}/lab/**", timeout=30_000)


def session_kernels(session: InteractiveSession) -> list:
    session.refresh_from_db()
    return session.kernels
