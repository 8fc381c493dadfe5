"""The hand-off from the portal's origin to the labs' own (jobs/sessions/lab_handoff.py,
jobs/sessions/lab_proxy.py;
docs/sessions.md "Two origins"): tickets, the lab's own cookie, what each origin serves, and when
lab access ends.

portal.asgi runs under a real uvicorn, reached as `make run` is: the portal at
http://localhost:PORT and the labs at http://127.0.0.1:PORT (LAB_ORIGIN), one server, two host
names (tests/lab_fakes.py). The clients are httpx with a cookie jar that keeps cookies per host
name and path as a browser does (tests/lab_client.py), so the hand-off is followed as a browser
follows it; the "Jupyter server" is FakeJupyter, whose record of requests proves what never
reached it.
"""
# ruff: noqa: F811 - the fixtures imported from tests.lab_fakes are the tests' arguments

from __future__ import annotations

import threading
from datetime import timedelta
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from django.test import Client
from django.utils import timezone

from jobs.models import InteractiveSession, LabGrant
from jobs.sessions.lab_handoff import digest, lab_ticket_issue, lab_ticket_redeem
from tests.lab_client import browser, grant_cookie, open_lab, signed_in
from tests.lab_fakes import (  # noqa: F401 - fixtures
    get,
    grant_header,
    handed_over,
    jupyter,
    jupyter_server,
    lab,
    labs,
    make_lab,
    owner,
    portal,
    portal_cookie,
    servers,
    ws_open,
    ws_refused,
)

pytestmark = pytest.mark.django_db(transaction=True)

STATE = "s" * 43  # a state as the labs' origin makes them (43 URL-safe characters)


def ticket_for(user, lab: InteractiveSession, state: str = STATE) -> str:
    """A ticket as the portal issues it at step 3, to `user` signed in, for a browser holding `state`."""
    ticket = lab_ticket_issue(user=user, pk=lab.pk, portal_session_key=signed_in(user), state=state)
    assert ticket is not None
    return ticket


def redeem(labs: str, lab: InteractiveSession, ticket: str, state: str | None = STATE, **query: str):  # type: ignore[no-untyped-def]
    headers = {"Cookie": f"lab_state={state}"} if state else {}
    params = {"ticket": ticket, **query}
    return get(labs, f"/sessions/{lab.pk}/lab-auth/", headers, params=params)


# --- the hand-off ----------------------------------------------------------------------------------


def test_the_hand_off_carries_the_owners_sign_in_to_the_lab_origin(portal, labs, jupyter, lab, alice) -> None:
    http = browser(portal, alice)
    steps = []
    answer = http.get(f"{portal}/sessions/{lab.pk}/lab/tree?x=1")
    while answer.is_redirect:
        steps.append(answer)
        answer = http.send(answer.next_request)

    assert answer.status_code == 200 and answer.json()["raw_path"] == f"/sessions/{lab.pk}/lab/tree"
    assert answer.json()["query"] == "x=1"
    to_labs, to_portal, to_auth, to_lab = (step.headers["location"] for step in steps)
    # 1. the portal sends its signed-in owner to the same path on the labs' origin,
    assert to_labs == f"{labs}/sessions/{lab.pk}/lab/tree?x=1"
    # 2. which, with no grant, asks the portal for a ticket for this browser's state,
    state_cookie = steps[1].headers["set-cookie"]
    state = state_cookie.split(";")[0].removeprefix("lab_state=")
    assert state_cookie == f"lab_state={state}; Path=/sessions/{lab.pk}/; HttpOnly; SameSite=Lax; Max-Age=900"
    assert to_portal.startswith(f"{portal}/sessions/{lab.pk}/lab-ticket/?")
    assert parse_qs(urlsplit(to_portal).query) == {
        "state": [state],
        "next": [f"/sessions/{lab.pk}/lab/tree?x=1"],
    }
    # 3. the portal issues one (only its digest is kept) and sends it to the labs' origin,
    ticket = parse_qs(urlsplit(to_auth).query)["ticket"][0]
    assert to_auth.startswith(f"{labs}/sessions/{lab.pk}/lab-auth/?")
    row = LabGrant.objects.get()
    assert (row.ticket_digest, row.state_digest, row.user_id) == (digest(ticket), digest(state), alice.pk)
    assert row.expires_at - row.created_at == timedelta(seconds=60)  # LAB_TICKET_SECONDS
    # 4. which redeems it for the lab's own cookie and goes on to the page asked for.
    grant = steps[3].headers.get_list("set-cookie")
    secret = grant[0].split(";")[0].removeprefix("lab_grant=")
    assert grant == [
        f"lab_grant={secret}; Path=/sessions/{lab.pk}/lab/; HttpOnly; SameSite=Lax",
        f"lab_state=; Path=/sessions/{lab.pk}/; HttpOnly; SameSite=Lax; Max-Age=0",
    ]
    assert to_lab == f"/sessions/{lab.pk}/lab/tree?x=1"
    row.refresh_from_db()
    assert row.cookie_digest == digest(secret) and row.used_at is not None
    assert ticket not in str(list(LabGrant.objects.values())) and secret not in str(row.__dict__)
    # The portal's cookie went to the portal alone; the lab's cookie to the lab alone.
    for host, path, cookie in http.sent:
        assert ("sessionid" in cookie) == host.startswith("localhost"), (host, path)
        assert "lab_grant" not in cookie or (host.startswith("127.0.0.1") and "/lab/" in path)
    assert "sessionid" not in jupyter.seen[-1]["headers"].get("cookie", "")


def test_a_ticket_works_once(labs, jupyter, lab, alice) -> None:
    ticket = ticket_for(alice, lab)

    first = redeem(labs, lab, ticket)
    again = redeem(labs, lab, ticket)

    assert first.status_code == 302 and "lab_grant=" in first.headers["set-cookie"]
    assert again.status_code == 403 and "set-cookie" not in again.headers
    assert "Open the lab again from the portal: http://localhost:" in again.text
    assert LabGrant.objects.filter(used_at__isnull=False).count() == 1
    assert jupyter.seen == []


def test_a_ticket_is_redeemed_once_by_browsers_racing_with_it(lab, alice) -> None:
    ticket = ticket_for(alice, lab)
    secrets_got: list[str | None] = []

    def one() -> None:
        from django.db import connection

        try:
            secrets_got.append(lab_ticket_redeem(pk=lab.pk, ticket=ticket, state=STATE))
        finally:
            connection.close()

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert len(secrets_got) == 8 and len([got for got in secrets_got if got]) == 1


def test_an_expired_ticket_is_refused_and_writes_nothing(labs, jupyter, lab, alice, settings) -> None:
    settings.LAB_TICKET_SECONDS = 5
    ticket = ticket_for(alice, lab)
    row = LabGrant.objects.get()
    assert row.expires_at - row.created_at == timedelta(seconds=5)
    LabGrant.objects.update(expires_at=timezone.now() - timedelta(seconds=1))  # its time has passed

    answer = redeem(labs, lab, ticket)

    assert answer.status_code == 403 and "set-cookie" not in answer.headers
    assert "within 5 seconds" in answer.text and f"/sessions/{lab.pk}/" in answer.text
    assert LabGrant.objects.get().used_at is None
    assert jupyter.seen == []


def test_a_ticket_opens_only_its_own_lab_in_the_browser_that_asked(
    labs, jupyter, lab, alice, bob, booking, jupyter_server
) -> None:
    bobs = make_lab(bob, booking, jupyter_server[1])

    # bob's ticket at alice's lab; alice's in a browser holding another state, or none.
    assert redeem(labs, lab, ticket_for(bob, bobs)).status_code == 403
    assert redeem(labs, lab, ticket_for(alice, lab), state="t" * 43).status_code == 403
    assert redeem(labs, lab, ticket_for(alice, lab), state=None).status_code == 403
    # bob's ticket pushed into alice's browser (its own state) would open bob's lab there, whose
    # page's script could then reach alice's labs on the same origin: refused.
    assert redeem(labs, bobs, ticket_for(bob, bobs), state="a" * 43).status_code == 403

    assert LabGrant.objects.count() == 0  # each refused ticket is spent, none became a grant
    assert redeem(labs, lab, ticket_for(alice, lab)).status_code == 302  # the right browser's works
    assert jupyter.seen == []


@pytest.mark.parametrize("who", ["bob", "leader", "charlie", "admin_user"])
def test_the_portal_issues_no_one_else_a_ticket(portal, lab, who, request) -> None:
    http = browser(portal, request.getfixturevalue(who))

    answer = http.get(f"{portal}/sessions/{lab.pk}/lab-ticket/", params={"state": STATE, "next": "/"})

    assert answer.status_code == 404
    assert not LabGrant.objects.exists()


def test_a_ticket_needs_the_portal_session_it_came_from(portal, labs, jupyter, lab, alice) -> None:
    browser_ = Client()
    browser_.force_login(alice)
    key = browser_.cookies["sessionid"].value
    ticket = lab_ticket_issue(user=alice, pk=lab.pk, portal_session_key=key, state=STATE)
    browser_.logout()

    assert redeem(labs, lab, ticket).status_code == 403
    assert jupyter.seen == []


@pytest.mark.parametrize(
    "wanted",
    [
        "https://evil.example/",
        "//evil.example/x",
        "/\\evil.example",
        "/login/",
        "/sessions/{other}/lab/",
        "/sessions/{pk}/lab/../../{other}/lab/",
        "/sessions/{pk}/lab/%2e%2e/%2e%2e/{other}/lab/",
        "/sessions/{pk}/lab//evil.example",
        "/sessions/{pk}/lab/x\r\nSet-Cookie: a=b",
        "/sessions/{pk}/lab-auth/",
        "/sessions/{pk}/lab",
    ],
)
def test_next_never_leaves_the_lab(portal, labs, lab, alice, booking, jupyter_server, wanted) -> None:
    other = make_lab(alice, booking, jupyter_server[1], status="ended")
    wanted = wanted.format(pk=lab.pk, other=other.pk)
    http = browser(portal, alice)
    issued = http.get(f"{portal}/sessions/{lab.pk}/lab-ticket/", params={"state": STATE, "next": wanted})
    ticket = parse_qs(urlsplit(issued.headers["location"]).query)["ticket"][0]
    assert parse_qs(urlsplit(issued.headers["location"]).query)["next"] == [f"/sessions/{lab.pk}/lab/"]

    redeemed = redeem(labs, lab, ticket, next=wanted)

    assert redeemed.status_code == 302 and redeemed.headers["location"] == f"/sessions/{lab.pk}/lab/"


def test_next_keeps_a_path_and_query_inside_the_lab(labs, lab, alice) -> None:
    wanted = f"/sessions/{lab.pk}/lab/tree/my%20notes/a.ipynb?reset&x=1"

    redeemed = redeem(labs, lab, ticket_for(alice, lab), next=wanted)

    assert redeemed.headers["location"] == wanted


def test_the_portal_path_without_a_state_starts_the_hand_off_again(portal, lab, alice) -> None:
    answer = browser(portal, alice).get(f"{portal}/sessions/{lab.pk}/lab-ticket/")

    assert answer.status_code == 302 and answer.headers["location"] == f"/sessions/{lab.pk}/lab/"
    assert not LabGrant.objects.exists()


# --- the labs' origin serves labs alone --------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        *("/", "/login/", "/api/v1/me/", "/api/v1/sessions/", "/admin/", "/static/js/htmx.min.js"),
        *("/metrics", "/sessions/new/", "/sessions/{pk}/", f"/sessions/{{pk}}/lab-ticket/?state={STATE}"),
        "/events/",
    ],
)
def test_the_lab_origin_serves_no_portal_path(labs, jupyter, lab, alice, path) -> None:
    answer = get(labs, path.format(pk=lab.pk), portal_cookie(alice))

    assert answer.status_code == 404
    assert answer.text.startswith("Only JupyterLab sessions are served here")
    assert "alice" not in answer.text and "set-cookie" not in answer.headers
    assert not LabGrant.objects.exists()
    assert jupyter.seen == []


def test_the_lab_origin_never_reads_the_portals_session(labs, jupyter, lab, alice) -> None:
    page = get(labs, f"/sessions/{lab.pk}/lab/tree", {**portal_cookie(alice), "Accept": "text/html"})
    api = get(labs, f"/sessions/{lab.pk}/lab/api/echo", portal_cookie(alice))

    assert page.status_code == 302 and "/lab-ticket/?state=" in page.headers["location"]  # no lab
    assert api.status_code == 401 and "Open this lab from the portal" in api.text
    path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"
    assert ws_refused(labs, path, portal_cookie(alice), origin=labs) == 403
    assert jupyter.seen == []


def test_the_lab_cookie_means_nothing_on_the_portal(portal, jupyter, lab, owner) -> None:
    grant = grant_header(owner, lab.pk)

    assert get(portal, "/api/v1/me/", grant).status_code in (401, 403)
    assert get(portal, "/", {**grant, "Accept": "text/html"}).headers["location"].startswith("/login/")
    assert get(portal, f"/sessions/{lab.pk}/lab/api/echo", grant).status_code == 401
    assert jupyter.seen == []


def test_the_portal_path_sends_only_the_owner_on(portal, labs, jupyter, lab, alice, bob) -> None:
    path = f"/sessions/{lab.pk}/lab/tree?x=1"

    owner = get(portal, path, portal_cookie(alice))
    anonymous_page = get(portal, path, {"Accept": "text/html,application/xhtml+xml"})

    assert owner.status_code == 302 and owner.headers["location"] == f"{labs}{path}"
    assert get(portal, path, portal_cookie(bob)).status_code == 404
    assert anonymous_page.headers["location"] == f"/login/?next=/sessions/{lab.pk}/lab/tree%3Fx%3D1"
    assert get(portal, path, {"Accept": "application/json"}).status_code == 401
    assert httpx.post(f"{portal}{path}", headers=portal_cookie(alice)).status_code == 405
    # The portal's origin proxies nothing any more, not even the owner's websocket.
    ws_path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"
    assert ws_refused(portal, ws_path, portal_cookie(alice), origin=portal) == 403
    assert jupyter.seen == []


# --- when the grant ends, and everyone else ----------------------------------------------------------


def test_signing_out_of_the_portal_ends_lab_access(portal, labs, jupyter, lab, alice) -> None:
    http = browser(portal, alice)
    assert open_lab(http, portal, lab.pk).status_code == 200
    grant = grant_header(http, lab.pk)
    path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"
    assert get(labs, f"/sessions/{lab.pk}/lab/api/echo", grant).status_code == 200

    signed_out = http.post(
        f"{portal}/logout/", headers={"Origin": portal, "X-CSRFToken": csrf_token(http, portal)}
    )
    jupyter.seen.clear()

    assert signed_out.status_code == 302
    assert get(labs, f"/sessions/{lab.pk}/lab/api/echo", grant).status_code == 401
    assert ws_refused(labs, path, grant, origin=labs) == 403
    page = get(labs, f"/sessions/{lab.pk}/lab/", {**grant, "Accept": "text/html"})
    assert "/lab-ticket/" in page.headers["location"]  # a page view asks the portal again
    assert jupyter.seen == []


def csrf_token(http: httpx.Client, portal: str) -> str:
    """The portal's CSRF token, as a page the browser loaded carries it."""
    page = http.get(f"{portal}/profile/").text
    return page.split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]


def test_a_password_change_ends_lab_access(labs, jupyter, lab, alice, owner) -> None:
    grant = grant_header(owner, lab.pk)
    alice.set_password("a new one")
    alice.save()

    assert get(labs, f"/sessions/{lab.pk}/lab/api/echo", grant).status_code == 401
    assert ws_refused(labs, f"/sessions/{lab.pk}/lab/api/kernels/k1/channels", grant, origin=labs) == 403
    assert jupyter.seen == []


def test_a_deactivated_owner_loses_the_lab(labs, jupyter, lab, alice, owner) -> None:
    grant = grant_header(owner, lab.pk)
    alice.is_active = False
    alice.save()

    assert get(labs, f"/sessions/{lab.pk}/lab/api/echo", grant).status_code == 401
    assert ws_refused(labs, f"/sessions/{lab.pk}/lab/api/kernels/k1/channels", grant, origin=labs) == 403
    assert jupyter.seen == []


@pytest.mark.parametrize("status", ["ended", "failed"])
def test_a_grant_ends_with_its_lab(labs, jupyter, lab, owner, status) -> None:
    grant = grant_header(owner, lab.pk)
    InteractiveSession.objects.filter(pk=lab.pk).update(status=status)

    assert get(labs, f"/sessions/{lab.pk}/lab/api/echo", grant).status_code == 404
    assert ws_refused(labs, f"/sessions/{lab.pk}/lab/api/kernels/k1/channels", grant, origin=labs) == 403
    assert jupyter.seen == []


@pytest.mark.parametrize("who", ["bob", "leader", "charlie", "admin_user"])
def test_it_gives_no_one_else_the_lab(portal, labs, jupyter, lab, who, request) -> None:
    user = request.getfixturevalue(who)
    http = browser(portal, user)

    answer = open_lab(http, portal, lab.pk)

    assert answer.status_code == 404 and answer.url.host == "localhost"
    assert not LabGrant.objects.exists()
    assert jupyter.seen == []


def test_a_grant_for_one_lab_opens_no_other(portal, labs, jupyter, lab, bob, booking, jupyter_server) -> None:
    bobs = make_lab(bob, booking, jupyter_server[1])
    bob_browser = handed_over(portal, bob, bobs, jupyter)
    bobs_grant = grant_cookie(bob_browser, bobs.pk)

    answer = get(labs, f"/sessions/{lab.pk}/lab/api/echo", {"Cookie": f"lab_grant={bobs_grant}"})

    assert answer.status_code == 401
    assert jupyter.seen == []


# --- found by the review that attacked the hand-off (docs/security.md) -----------------------------


def test_a_ticket_read_from_a_refusal_opens_nothing_elsewhere(portal, labs, jupyter, lab, alice) -> None:
    """Script in alice's lab page opens a window on `lab-ticket/?state=<its own>`: the portal mints
    a ticket for that state and alice's browser, lacking it, is refused at `lab-auth` — on the
    labs' origin, where the script reads the window's address. The ticket was spent by being
    shown: another browser holding the script's state gets nothing with it."""
    chosen = "a" * 43
    victim = browser(portal, alice)
    window = victim.get(
        f"{portal}/sessions/{lab.pk}/lab-ticket/", params={"state": chosen}, follow_redirects=True
    )
    assert window.status_code == 403 and str(window.url).startswith(labs)
    ticket = parse_qs(urlsplit(str(window.url)).query)["ticket"][0]

    stolen = redeem(labs, lab, ticket, state=chosen)

    assert stolen.status_code == 403 and "lab_grant=" not in stolen.headers.get("set-cookie", "")
    assert not LabGrant.objects.filter(ticket_digest=digest(ticket)).exists()
    assert not LabGrant.objects.exclude(cookie_digest=None).exists()
    assert jupyter.seen == []


def test_a_ticket_shown_at_another_lab_is_spent(labs, lab, alice, booking, jupyter_server) -> None:
    other = make_lab(alice, booking, jupyter_server[1])
    ticket = ticket_for(alice, lab)

    assert redeem(labs, other, ticket).status_code == 403
    assert redeem(labs, lab, ticket).status_code == 403  # spent by the first showing


def test_a_lab_whose_supervisor_stopped_beating_is_not_relayed_to(
    labs, jupyter, lab, owner, settings
) -> None:
    """Its worker was killed: the lab died with it and its freed port could be any local account's
    by now, so the owner's open tab is not relayed there (with the token) until it is marked lost."""
    settings.LAB_RELAY_BEAT_SECONDS = 10
    grant = grant_header(owner, lab.pk)
    assert get(labs, f"/sessions/{lab.pk}/lab/api/echo", grant).status_code == 200
    InteractiveSession.objects.filter(pk=lab.pk).update(beat_at=timezone.now() - timedelta(seconds=11))
    jupyter.seen.clear()

    assert get(labs, f"/sessions/{lab.pk}/lab/api/echo", grant).status_code == 404
    assert jupyter.seen == []


def test_an_open_websocket_ends_when_its_sign_in_does(portal, labs, jupyter, lab, owner, settings) -> None:
    """A terminal or kernel websocket opened before a sign-out is closed within LAB_RECHECK_SECONDS."""
    from websockets.exceptions import ConnectionClosed

    settings.LAB_RECHECK_SECONDS = 1
    path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"
    with ws_open(labs, path, grant_header(owner, lab.pk), labs) as ws:
        ws.recv(timeout=10)  # the fake's handshake report
        ws.send("before")
        assert ws.recv(timeout=10) == "before"
        owner.post(f"{portal}/logout/", headers={"Origin": portal, "X-CSRFToken": csrf_token(owner, portal)})
        with pytest.raises(ConnectionClosed) as closed:
            for _ in range(20):
                ws.recv(timeout=5)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert "open it again from the portal" in closed.value.rcvd.reason
