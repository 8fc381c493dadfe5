"""The portal's pages run only the portal's own script files (issue 30, item 2): a strict
Content-Security-Policy on every answer (settings.CONTENT_SECURITY_POLICY), no inline script or
handler in any template, htmx without eval, and a CSRF cookie no script can read. The browser
test reads the main pages in Chromium under the policy and finds nothing refused, and what the
inline bits used to do still works from static/js/portal.js."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.browser import chromium, log_in, main_pages_of  # noqa: F401 - the fixture

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
SCRIPT_TAG = re.compile(r"<script\b([^>]*)>", re.IGNORECASE)
HANDLER = re.compile(r"""\son[a-z]+\s*=\s*["']""", re.IGNORECASE)
EVALUATED = re.compile(r"""hx-on|javascript:|hx-vals\s*=\s*['"]js:|hx-trigger="[^"]*\[""", re.IGNORECASE)


def directives(header: str) -> dict[str, list[str]]:
    parts = (part.strip().split() for part in header.split(";") if part.strip())
    return {name: values for name, *values in parts}


def test_no_template_holds_inline_script_a_handler_or_something_htmx_would_eval():
    found = []
    for path in sorted(TEMPLATES.rglob("*.html")):
        text = path.read_text()
        for match in SCRIPT_TAG.finditer(text):
            attributes = match.group(1)
            if "src=" not in attributes and 'type="application/json"' not in attributes:
                found.append(f"{path.relative_to(TEMPLATES)}: inline <script{attributes}>")
        found += [
            f"{path.relative_to(TEMPLATES)}: handler {m.group().strip()}" for m in HANDLER.finditer(text)
        ]
        found += [f"{path.relative_to(TEMPLATES)}: evaluated {m.group()}" for m in EVALUATED.finditer(text)]
    assert not found, "\n".join(found)


@pytest.mark.django_db
def test_every_answer_carries_the_policy_and_the_csrf_cookie_is_not_for_script(client, alice):
    answers = {"/login/": client.get("/login/")}
    client.force_login(alice)
    for path in (
        "/",
        "/reservations/",
        "/no-such-page/",
        "/api/v1/me/",
        "/api/v1/docs/",
        "/api/v1/docs/?script=",
    ):
        answers[path] = client.get(path)
    for path, response in answers.items():
        policy = directives(response.headers.get("Content-Security-Policy", ""))
        assert policy.get("script-src") == ["'self'"], path
        assert policy.get("default-src") == ["'self'"], path
        assert policy.get("object-src") == ["'none'"], path
        assert policy.get("frame-ancestors") == ["'none'"], path
    assert answers["/api/v1/docs/"].status_code == 200
    # The API's documentation starts Swagger UI from a script file of its own, not inline.
    assert b"<script>" not in answers["/api/v1/docs/"].content
    assert answers["/api/v1/docs/?script="].headers["Content-Type"].startswith("application/javascript")
    cookie = answers["/login/"].cookies["csrftoken"]
    assert cookie["httponly"] is True


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_the_main_pages_run_under_the_policy_with_nothing_refused(live_server, chromium, alice, monkeypatch):  # noqa: F811
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: None)
    paths = [*main_pages_of(alice), "/api/v1/docs/", "/gpus/GPU-box1-00/"]
    with chromium.tab(live_server.url, timezone_id="Asia/Tokyo") as tab:
        refused: list[str] = []
        tab.on(
            "console",
            lambda message: (
                refused.append(f"{tab.url}: {message.text}")
                if "Content Security Policy" in message.text
                else None
            ),
        )
        log_in(tab, "alice")
        for path in paths:
            tab.goto(path)
            tab.wait_for_load_state("load")
        assert not refused, "\n".join(refused)
        # The time zone the inline script used to put in a cookie, from portal.js now.
        cookies = {c["name"]: c["value"] for c in tab.context.cookies()}
        assert cookies.get("browser_tz") == "Asia%2FTokyo"
        assert "csrftoken" in cookies
        assert "csrftoken" not in tab.evaluate("document.cookie")  # HttpOnly: no script reads it
        # The job form's size hint asks for the script typed (portal.js, not htmx's eval).
        tab.goto("/jobs/new/")
        with tab.expect_request(lambda r: "/size-hint/" in r.url and "script=train.py" in r.url):
            tab.fill("#id_script_path", "train.py")
            tab.dispatch_event("#id_script_path", "change")
        # A data-fill button (the hint's "Use 8G") works by delegation from portal.js.
        tab.evaluate(
            """() => {
                const b = document.createElement('button');
                b.type = 'button'; b.id = 'fill'; b.dataset.fill = '#id_memory'; b.dataset.value = '8G';
                document.querySelector('main').append(b);
            }"""
        )
        tab.click("#fill")
        assert tab.input_value("#id_memory") == "8G"
        assert tab.evaluate("document.activeElement.id") == "id_memory"
        assert not refused, "\n".join(refused)
