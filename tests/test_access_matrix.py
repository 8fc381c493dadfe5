"""The access matrix: every URL in the URL conf, page and API, as anonymous, owner, teammate,
outsider, leader and admin, answers as designed.

MATRIX has one entry per URL name (`namespace:name`; unnamed patterns by their route). A URL
added to the URL conf without an entry fails test_every_url_has_a_decision, and an entry whose
URL is gone fails test_no_decision_names_a_missing_url. An entry is one line:

    "reservation_cancel": url(BOOKING, get="405", post=Do("login ok 403 404 ok ok", REASON, ENDED)),

Outcomes, one per role in ROLES order (a single word stands for all six):
  ok       2xx, or a 3xx that is not a login redirect (a POST's redirect after it worked)
  public   ok for everyone, anonymous included
  login    302 to the login page with ?next= (pages)
  adminlogin  302 to the admin's login page with ?next=
  refused  a 3xx back with an error message; nothing was written (a form-level refusal)
  401 403 404 405 ...  exactly that status (401: the API without credentials)

A case with an `effect` (did the write happen?) checks it happened exactly when the outcome is
`ok`: a refused POST writes nothing. The owner's private things carry markers (PRIVATE_FROM)
that no answer to someone who may not see them may contain. A DRF router route's `.json` variant
must answer as the route itself.

The people, their teams and their signed-in sessions are made once for the file (Cast, rolled
back after each case); the rest of alice's things are made on first use (World), so a case
builds only what it touches (tests/access_world.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.contrib import admin
from django.test import Client
from django.urls import NoReverseMatch, URLPattern, URLResolver, get_resolver, reverse
from rest_framework.test import APIClient

from gpus.calendars import calendar_feed_get
from gpus.forms import local_input
from gpus.models import CalendarFeed
from jobs.models import InteractiveSession, Job
from portal.models import Membership, NotificationChannel, Team
from tests.access_world import PRIVATE_FROM, ROLES, Cast, World, cast_held
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def cast(django_db_setup, django_db_blocker) -> Iterator[Cast]:
    """The people, made once for the file (tests/access_world.py)."""
    with cast_held(django_db_blocker) as made:
        yield made


# --- the table ------------------------------------------------------------------------------

Data = dict[str, Any] | Callable[[World], dict[str, Any]] | None


@dataclass(frozen=True)
class Do:
    """One method on one URL: the outcome per role, the body to send, and what it writes."""

    outcomes: str
    data: Data = None
    effect: Callable[[World], bool] | None = None
    effect_roles: str | None = None  # the roles whose request writes (default: those with `ok`)
    query: str = ""

    def expected(self) -> tuple[str, ...]:
        words = self.outcomes.split()
        if words == ["public"]:
            return ("ok",) * len(ROLES)
        if len(words) == 1:
            return tuple(words) * len(ROLES)
        assert len(words) == len(ROLES), f"{self.outcomes!r}: give one outcome per role {ROLES}"
        return tuple(words)


@dataclass(frozen=True)
class Url:
    kwargs: Callable[[World], dict[str, Any]] | None
    methods: dict[str, Do] = field(default_factory=dict)


def url(kwargs: Callable[[World], dict[str, Any]] | None = None, **methods: Do | str) -> Url:
    return Url(kwargs, {m: Do(d) if isinstance(d, str) else d for m, d in methods.items()})


# kwargs, from the world's objects
def BOOKING(w: World) -> dict:
    return {"pk": w.booking.pk}


def JOB(w: World) -> dict:
    return {"pk": w.job.pk}


def VIOLATION(w: World) -> dict:
    return {"pk": w.violation.pk}


def SESSION(w: World) -> dict:
    return {"pk": w.session.pk}


def OPEN_LAB(w: World) -> dict:
    return {"reservation": w.booking.pk}


def LAB_OPENED(w: World) -> bool:
    return InteractiveSession.objects.filter(kind=InteractiveSession.Kind.JUPYTERLAB).exists()


def SESSION_RUNNING(w: World) -> bool:
    return _fresh(w.session).status == InteractiveSession.Status.RUNNING


def SESSION_FINISHED(w: World) -> bool:
    return _fresh(w.session).status == InteractiveSession.Status.FAILED  # never ran: failed


def SESSION_END_ASKED(w: World) -> bool:
    return _fresh(w.session).end_requested_at is not None


def NOTIFICATION(w: World) -> dict:
    return {"pk": w.notification.pk}


def TOKEN(w: World) -> dict:
    return {"pk": w.token.pk}


def CHANNEL(w: World) -> dict:
    return {"pk": w.channel.pk}


def GPU_(w: World) -> dict:
    return {"uuid": w.box[0].uuid}


def IMAGE(w: World) -> dict:
    return {"name": w.image.name}


def SERVER(w: World) -> dict:
    return {"name": w.box[0].server.name}


def TEAM(w: World) -> dict:
    return {"slug": w.team.slug}


def MEMBER(w: World) -> dict:
    return {"slug": w.team.slug, "username": w.alice.username}


# bodies
REASON = {"reason": "needed for the deadline"}
CANCEL_REASON = {"reason": "needed for the deadline", "confirm": "1"}  # a confirm step with its reason
NEW_CHANNEL = {"url": "json://127.0.0.1:9/hooks/new"}
QUOTA = {"max_cards": 1}


def EXTEND(w: World) -> dict:
    return {"end": local_input(w.booking.end + timedelta(hours=1))}


def EXTEND_API(w: World) -> dict:
    return {"end": (w.booking.end + timedelta(hours=1)).isoformat()}


def EXAMPLE(w: World) -> dict:
    return {"reservation": w.booking.pk}


def LOGIN(w: World) -> dict:
    return {"username": w.alice.username, "password": "password"}


# effects: did the write happen? Each is False before the request (run_case checks).
def _fresh(obj: Any) -> Any:
    return type(obj).objects.get(pk=obj.pk)


def ENDED(w: World) -> bool:
    booking = _fresh(w.booking)
    return booking.cancelled_at is not None or booking.released_at is not None


def RELEASED(w: World) -> bool:
    return _fresh(w.booking).released_at is not None


def EXTENDED(w: World) -> bool:
    return _fresh(w.booking).end > w.booking.end


def JOB_CANCELLED(w: World) -> bool:
    return _fresh(w.job).status == Job.Status.CANCELLED


def READ(w: World) -> bool:
    return _fresh(w.notification).read_at is not None


def REVOKED(w: World) -> bool:
    return _fresh(w.token).revoked_at is not None


def CHANNEL_GONE(w: World) -> bool:
    return not NotificationChannel.objects.filter(pk=w.channel.pk).exists()


def TEAM_CHANNEL_ADDED(w: World) -> bool:
    return NotificationChannel.objects.filter(team=w.team).exists()


def TEAM_QUOTA_SET(w: World) -> bool:
    return _fresh(w.team).max_cards == 1


def MEMBER_QUOTA_SET(w: World) -> bool:
    return Membership.objects.get(team=w.team, user=w.alice).max_cards == 1


def AUTO_RELEASE_ON(w: World) -> bool:
    return _fresh(w.team).auto_release_idle


def DRAINED(w: World) -> bool:
    return _fresh(w.box[0].server).draining


def STOP_ASKED(w: World) -> bool:
    return _fresh(w.violation).stop_requested_at is not None


def RESOLVED(w: World) -> bool:
    return _fresh(w.violation).resolved_at is not None


NEW_TEAM = {"name": "Robotics", "slug": "robotics", "leaders": "", "members": ""}


def TEAM_CREATED(w: World) -> bool:
    return Team.objects.filter(slug="robotics").exists()


def NEW_MEMBER(w: World) -> dict:
    """dave, who has an account and no team yet."""
    return {"username": UserFactory(username="dave").username, "role": "member"}


def MEMBER_ADDED(w: World) -> bool:
    return Membership.objects.filter(team=w.team, user__username="dave").exists()


def MADE_LEADER(w: World) -> bool:
    return Membership.objects.get(team=w.team, user=w.alice).role == Membership.Role.LEADER


def MEMBER_GONE(w: World) -> bool:
    return not Membership.objects.filter(team=w.team, user=w.alice).exists()


def OUTSIDERS_FEED(w: World) -> dict:
    """charlie's calendar: a feed answers whoever holds its secret, anonymous included, so the
    case uses one that holds nothing of alice's (who may have which feed: tests/test_calendar.py)."""
    return {"secret": calendar_feed_get(user=w.outsider).secret}


def OWN_FEED(w: World) -> bool:
    return CalendarFeed.objects.filter(owner=w.alice, scope=CalendarFeed.Scope.USER).exists()


def EXAMPLE_RAN(w: World) -> bool:
    w.booking  # noqa: B018 - the booking exists before the request
    return Job.objects.filter(name="keras_example.py").exists()


ALL = "login ok ok ok ok ok"  # a page for everyone who is logged in
API_ALL = "401 ok ok ok ok ok"  # an API list for everyone who is logged in
MANAGERS = "login 403 403 404 ok ok"  # the team's leaders and admins; members 403, outsiders 404
API_MANAGERS = "401 403 403 404 ok ok"
ADMINS = "login 403 403 404 403 ok"  # a team's admin pages: members 403, outsiders 404
NO = "405"  # the method is not allowed (before any login check)
API_NO = "401 405 405 405 405 405"  # DRF authenticates before it looks at the method

MATRIX: dict[str, Url] = {
    # --- pages: gpus -----------------------------------------------------------------------
    "dashboard": url(get=ALL, post=NO),
    "dashboard_servers": url(get=ALL),
    "gpu_detail": url(GPU_, get=ALL),
    "gpu_history": url(GPU_, get=ALL),
    "server_timeline": url(SERVER, get=ALL),
    "my_reservations": url(get=ALL, post=NO),
    "reservation_new": url(get=ALL),
    "reservation_detail": url(BOOKING, get="login ok ok 404 ok ok"),
    "reservation_cancel": url(BOOKING, get=NO, post=Do("login ok 403 404 ok ok", REASON, ENDED)),
    "reservation_release": url(BOOKING, get=NO, post=Do("login ok 403 404 403 403", None, RELEASED)),
    "reservation_extend": url(BOOKING, get=NO, post=Do("login ok 403 404 403 403", EXTEND, EXTENDED)),
    "violations": url(get=ALL),
    "violation_detail": url(VIOLATION, get="login ok 404 404 ok ok"),
    # who may see it may stop it; resolving is the booking owner's, leaders' and admins' (here alice
    # both caused it and owns the booking: tests/test_violation_actions.py has the offender alone)
    "violation_stop": url(
        VIOLATION, get=NO, post=Do("login ok 404 404 ok ok", {"reason": "late"}, STOP_ASKED)
    ),
    "violation_resolve": url(
        VIOLATION, get=NO, post=Do("login ok 404 404 ok ok", {"note": "agreed"}, RESOLVED)
    ),
    "server_drain": url(SERVER, get=NO, post=Do("login 403 403 403 403 ok", {"draining": "on"}, DRAINED)),
    "reports": url(get=ALL),
    "reports_csv": url(get=ALL),
    "team_detail": url(TEAM, get=MANAGERS, post=Do(MANAGERS, {"auto_release_idle": "on"}, AUTO_RELEASE_ON)),
    "team_quota": url(TEAM, get=NO, post=Do("login 403 403 404 403 ok", QUOTA, TEAM_QUOTA_SET)),
    "member_quota": url(MEMBER, get=NO, post=Do("login 403 403 404 ok ok", QUOTA, MEMBER_QUOTA_SET)),
    # A calendar feed: no sign-in, its secret is the key; a new link renews one's own (by default).
    "calendar_feed": url(OUTSIDERS_FEED, get="public", post=NO),
    "calendar_renew": url(get=NO, post=Do(ALL, None, OWN_FEED, effect_roles="owner")),
    # --- pages: jobs -----------------------------------------------------------------------
    "my_jobs": url(get=ALL),
    "job_new": url(get=ALL),
    "job_example": url(get=NO, post=Do("login ok refused refused refused refused", EXAMPLE, EXAMPLE_RAN)),
    "job_history": url(get=ALL),
    "job_size_hint": url(get=ALL),
    "team_rightsizing": url(TEAM, get=MANAGERS),
    "queue": url(get=ALL),
    "job_detail": url(JOB, get="login ok 404 404 ok ok"),
    "job_log_tail": url(JOB, get="login ok 404 404 ok ok"),
    # ASGI only (this client is WSGI): who may open it under ASGI is tests/test_job_page_push.py's
    "job_events": url(JOB, get="login 404 404 404 404 404"),
    "job_log_download": url(JOB, get="login ok 404 404 ok ok"),
    "job_metrics_csv": url(JOB, get="login ok 404 404 ok ok"),
    "job_usage_json": url(JOB, get="login ok 404 404 ok ok"),
    "booking_take_back": url(BOOKING, get=NO, post=Do("login ok 403 404 ok ok", None, None)),
    # Someone else's job: confirmed, with the reason its owner is told (the owner's own needs none)
    "job_cancel": url(JOB, get=NO, post=Do("login ok 404 404 ok ok", CANCEL_REASON, JOB_CANCELLED)),
    "session_new": url(get=NO, post=Do("login ok refused refused refused refused", OPEN_LAB, LAB_OPENED)),
    "session_detail": url(SESSION, get="login ok 404 404 ok ok"),
    "session_end": url(SESSION, get=NO, post=Do("login ok 404 404 ok ok", None, SESSION_END_ASKED)),
    # A ticket into the owner's running lab alone (this session is no lab); the owner's is in
    # tests/test_lab_proxy.py (the hand-off, and 404 for teammate, outsider, leader and admin).
    "lab_ticket": url(SESSION, get="login 404 404 404 404 404"),
    # 404 while METRICS_TOKEN is unset, as here; a bearer token, never a session, opens it
    # (tests/test_prometheus_metrics.py: 401 without it, 200 with it, 405 for other methods).
    "prometheus_metrics": url(get="404", post="404"),
    # --- pages: portal ---------------------------------------------------------------------
    "login": url(get="public"),
    "oidc_authentication_init": url(get="404"),  # 404 unless OIDC_ISSUER is set, as in tests
    "oidc_authentication_callback": url(get="404"),
    "logout": url(get=NO, post="public"),
    "profile": url(get=ALL),
    "token_create": url(get=NO, post=Do(ALL, {"name": "laptop"})),
    "profile_time_zone": url(get=NO, post=Do(ALL, {"time_zone": "Asia/Tokyo"})),  # one's own
    "profile_job_notify": url(get=NO, post=Do(ALL, {"events": ["fail"]})),  # one's own
    "token_revoke": url(TOKEN, get=NO, post=Do("login ok 404 404 404 404", None, REVOKED)),
    "teams": url(get=ALL, post=Do("login 403 403 403 403 ok", NEW_TEAM, TEAM_CREATED)),  # admins create
    # a team's members and leaders: admins only; outsiders never learn the team exists
    "team_members": url(TEAM, get=ADMINS, post=Do(ADMINS, NEW_MEMBER, MEMBER_ADDED)),
    "team_member_role": url(MEMBER, get=NO, post=Do(ADMINS, {"role": "leader"}, MADE_LEADER)),
    "team_member_remove": url(MEMBER, get=NO, post=Do(ADMINS, None, MEMBER_GONE)),
    # chat and webhook channels: one's own (admins: all); a team's, its leaders' and admins'
    "profile_channels": url(get=ALL, post=Do(ALL, NEW_CHANNEL)),
    "channel_test": url(CHANNEL, get=NO, post="login ok 404 404 404 ok"),
    "channel_delete": url(CHANNEL, get=NO, post=Do("login ok 404 404 404 ok", None, CHANNEL_GONE)),
    "team_channels": url(TEAM, get=MANAGERS, post=Do(MANAGERS, NEW_CHANNEL, TEAM_CHANNEL_ADDED)),
    "notifications": url(get=ALL),
    "notification_bell": url(get="286 ok ok ok ok ok"),  # htmx stops polling on 286
    # ASGI only: under WSGI (this test client) a signed-in caller gets 404 and pages poll; what
    # it relays over ASGI (only the viewer's own notifications) is tests/test_changes.py's.
    "events": url(get="login 404 404 404 404 404"),
    "notifications_read_all": url(get=NO, post=Do(ALL, None, READ, effect_roles="owner")),
    "notification_read": url(NOTIFICATION, get=NO, post=Do("login ok 404 404 404 404", None, READ)),
    # --- the Django admin: one rule for all of it (test_admin_access samples it), and its login --
    "admin:*": url(get="adminlogin adminlogin adminlogin adminlogin adminlogin ok"),
    "admin:login": url(get="public"),
    # --- API: authentication and the schema ------------------------------------------------
    "api_token": url(get="405", post=Do("public", LOGIN)),
    "api_token_current": url(get=API_NO, delete="401 400 400 400 400 400"),  # a token revokes itself
    "api_schema": url(get=API_ALL),
    "api_docs": url(get=API_ALL),
    "api-root": url(get=API_ALL),
    # --- API: inventory --------------------------------------------------------------------
    "server-list": url(get=API_ALL, post=API_NO),
    "server-detail": url(SERVER, get=API_ALL, delete=API_NO),
    "gpu-list": url(get=API_ALL, post=API_NO),
    "gpu-detail": url(GPU_, get=API_ALL, delete=API_NO),
    "image-list": url(get=API_ALL, post=API_NO),
    "image-detail": url(IMAGE, get=API_ALL, delete=API_NO),
    # --- API: bookings ---------------------------------------------------------------------
    "reservation-list": url(get=API_ALL, post="401 400 400 400 400 400"),  # allowed; {} is no booking
    "reservation-detail": url(
        BOOKING,
        get="401 ok ok 404 ok ok",
        patch=API_NO,
        delete=Do("401 ok 403 404 ok ok", None, ENDED, query="?reason=needed"),
    ),
    "reservation-cancel": url(BOOKING, get=API_NO, post=Do("401 ok 403 404 ok ok", REASON, ENDED)),
    "reservation-release": url(BOOKING, post=Do("401 ok 403 404 403 403", None, RELEASED)),
    "reservation-extend": url(BOOKING, post=Do("401 ok 403 404 403 403", EXTEND_API, EXTENDED)),
    # ASGI only: under WSGI (this test client) every caller gets 404 naming /log/?offset=; its
    # access rules over ASGI (owner, leaders, admins; 404 for the rest) are tests/test_log_stream.py's.
    "job_log_stream": url(JOB, get="401 404 404 404 404 404"),
    "violation-list": url(get=API_ALL),
    "violation-detail": url(VIOLATION, get="401 ok 404 404 ok ok", delete=API_NO),
    "usage-list": url(get=API_ALL),
    # --- API: jobs -------------------------------------------------------------------------
    "job-list": url(get=API_ALL, post="401 400 400 400 400 400"),  # allowed; {} is no job
    "job-size-hint": url(get=API_ALL),
    "job-detail": url(JOB, get="401 ok 404 404 ok ok", delete=API_NO),
    "job-cancel": url(JOB, post=Do("401 ok 404 404 ok ok", REASON, JOB_CANCELLED)),
    "job-log": url(JOB, get="401 ok 404 404 ok ok"),
    "job-metrics": url(JOB, get="401 ok 404 404 ok ok"),
    "queue-list": url(get=API_ALL),
    # --- API: interactive sessions (driven by their owner; seen and ended as jobs are) ------
    "session-list": url(get=API_ALL, post="401 400 400 400 400 400"),  # allowed; {} is no session
    "session-detail": url(
        SESSION,
        get="401 ok 404 404 ok ok",
        patch=Do("401 ok 404 404 403 403", {"pid": 4242}, SESSION_RUNNING),
        delete=Do("401 ok 404 404 ok ok", None, SESSION_END_ASKED),
    ),
    "session-beat": url(SESSION, get=API_NO, post="401 ok 404 404 403 403"),
    "session-finish": url(SESSION, post=Do("401 ok 404 404 403 403", {"exit_code": None}, SESSION_FINISHED)),
    # --- API: notifications (your own only, admins included) -------------------------------
    "notification-list": url(get=API_ALL),
    "notification-detail": url(NOTIFICATION, get="401 ok 404 404 404 404", delete=API_NO),
    "notification-read": url(NOTIFICATION, post=Do("401 ok 404 404 404 404", None, READ)),
    "notification-read-all": url(post=Do(API_ALL, None, READ, effect_roles="owner")),
    "notification-channel-list": url(get=API_ALL, post=Do(API_ALL, NEW_CHANNEL)),
    "notification-channel-detail": url(
        CHANNEL,
        get="401 ok 404 404 404 ok",
        patch=Do("401 ok 404 404 404 ok", {"label": "renamed"}),
        delete=Do("401 ok 404 404 404 ok", None, CHANNEL_GONE),
    ),
    "notification-channel-test": url(CHANNEL, get=API_NO, post="401 ok 404 404 404 ok"),
    # --- API: teams ------------------------------------------------------------------------
    "api_teams": url(get=API_ALL),
    "api_team": url(
        TEAM, get="401 ok ok 404 ok ok", patch=Do("401 403 403 404 403 ok", QUOTA, TEAM_QUOTA_SET)
    ),
    "api_team_members": url(TEAM, get=API_MANAGERS),
    "api_team_member": url(
        MEMBER, get="401 ok 403 404 ok ok", patch=Do(API_MANAGERS, QUOTA, MEMBER_QUOTA_SET)
    ),
    "api_team_audit": url(TEAM, get=API_MANAGERS),
    # --- API: who is asking, and their calendar feeds (each person's own) --------------------
    "api_me": url(get=API_ALL, post=API_NO),
    "api_me_calendar": url(get=API_NO, post=Do(API_ALL, None, OWN_FEED, effect_roles="owner")),
}
PREFIX_RULES = [key[:-1] for key in MATRIX if key.endswith(":*")]


# --- the URL conf ---------------------------------------------------------------------------


def _walk(patterns: list, namespaces: tuple[str, ...] = (), prefix: str = "") -> Iterator[tuple[str, str]]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            inner = (*namespaces, pattern.namespace) if pattern.namespace else namespaces
            yield from _walk(pattern.url_patterns, inner, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            route = prefix + str(pattern.pattern)
            yield ":".join((*namespaces, pattern.name or route)), route


def url_keys() -> set[str]:
    """Every pattern by `namespace:name`, unnamed ones by route. DRF's format-suffix variants
    (`…\\.(?P<format>…)`) share their route's name, so they share its decision."""
    return {key for key, _route in _walk(get_resolver().url_patterns)}


def decision_for(key: str) -> str | None:
    if key in MATRIX:
        return key
    return next((f"{prefix}*" for prefix in PREFIX_RULES if key.startswith(prefix)), None)


def test_every_url_has_a_decision():
    missing = sorted(key for key in url_keys() if decision_for(key) is None)
    assert not missing, f"URLs with no entry in MATRIX (add one line each): {missing}"


def test_no_decision_names_a_missing_url():
    keys = url_keys()
    stale = [k for k in MATRIX if not k.endswith(":*") and k not in keys]
    stale += [f"{p}*" for p in PREFIX_RULES if not any(k.startswith(p) for k in keys)]
    assert not stale, f"MATRIX entries for URLs that no longer exist: {stale}"


# --- running a case -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _channels_to_loopback(settings) -> None:
    """The channels' webhook is 127.0.0.1:9 (nothing listens: a test send fails at once), inside
    the portal's network; and a route's .json twin tests the same channel right after it."""
    settings.CHANNEL_ALLOWED_HOSTS = ["127.0.0.1"]
    settings.CHANNEL_TEST_EVERY_SECONDS = 0


@pytest.fixture(autouse=True)
def _no_broker(sent) -> None:
    """A submitted job is never sent to a worker here."""


def _is_api(path: str) -> bool:
    return path.startswith("/api/")


# One client of each kind for the whole file: a new one loads the middleware again, and
# WhiteNoise's scan of the static files would be most of the run.
_PAGE_CLIENT = Client()
_API_CLIENT = APIClient()


def _client(world: World, role: str, api: bool) -> Client | APIClient:
    client = _API_CLIENT if api else _PAGE_CLIENT
    client.cookies.clear()
    if api:
        client.force_authenticate(world.user(role))
    elif role != "anonymous":  # the session cookie the person's browser holds (the Cast's)
        client.cookies[settings.SESSION_COOKIE_NAME] = world.cast.sessions[role]
    return client


def _request(client: Client | APIClient, method: str, path: str, data: dict | None, api: bool) -> Any:
    if api:
        return getattr(client, method)(path, data, format="json")
    if method in ("get", "post"):
        return getattr(client, method)(path, data or {})
    return getattr(client, method)(path)


def _login_redirect(response: Any, login_url: str) -> bool:
    location = response.headers.get("Location", "")
    return response.status_code == 302 and location.startswith(login_url + "?") and "next=" in location


def check(response: Any, expected: str) -> None:
    status = response.status_code
    where = f"{status} {response.headers.get('Location', '')}".strip()
    login, admin_login = reverse(settings.LOGIN_URL), reverse("admin:login")
    if expected == "ok":
        assert 200 <= status < 400, f"expected ok, got {where}"
        assert not _login_redirect(response, login) and not _login_redirect(response, admin_login), where
    elif expected == "login":
        assert _login_redirect(response, login), f"expected a login redirect, got {where}"
    elif expected == "adminlogin":
        assert _login_redirect(response, admin_login), f"expected the admin's login, got {where}"
    elif expected == "refused":
        assert 300 <= status < 400 and not _login_redirect(response, login), f"expected refused, got {where}"
        errors = [m for m in response.wsgi_request._messages if m.level_tag == "error"]
        assert errors, "a refusal says why in an error message"
    else:
        assert status == int(expected), f"expected {expected}, got {where}"


def _body(response: Any) -> str:
    if getattr(response, "streaming", False):
        return b"".join(response.streaming_content).decode(errors="replace")
    return response.content.decode(errors="replace")


def assert_no_leak(response: Any, world: World, role: str) -> None:
    """Nothing of alice's that `role` may not see is in the answer."""
    body = _body(response)
    leaked = [m for m, hidden in PRIVATE_FROM.items() if role in hidden and m in body]
    assert not leaked, f"the answer to {role} shows {leaked}"


def run_case(world: World, key: str, entry: Url, method: str, role: str, path: str | None = None) -> None:
    do = entry.methods[method]
    expected = do.expected()[ROLES.index(role)]
    if method == "get" and expected == "ok" and role in ("anonymous", "teammate", "outsider"):
        world.populate()  # so that lists and shared pages have something to leak
    if path is None:
        path = reverse(key, kwargs=entry.kwargs(world) if entry.kwargs else None)
    api = _is_api(path)
    data = do.data(world) if callable(do.data) else do.data
    if do.effect is not None:
        assert not do.effect(world), "the effect is there before the request"
    response = _request(_client(world, role, api), method, path + do.query, data, api)
    check(response, expected)
    assert_no_leak(response, world, role)
    wrote = False
    if do.effect is not None:
        wrote = role in do.effect_roles.split() if do.effect_roles else expected == "ok"
        assert do.effect(world) == wrote, "nothing was written" if wrote else "the write happened"
    if api and not wrote:
        _check_format_suffix(world, key, entry, method, role, response.status_code)


def _check_format_suffix(world: World, key: str, entry: Url, method: str, role: str, status: int) -> None:
    """A router route's `.json` variant answers as the route itself (tried where nothing was
    written, so that the second request meets the same state)."""
    do = entry.methods[method]
    kwargs = {**(entry.kwargs(world) if entry.kwargs else {}), "format": "json"}
    try:
        path = reverse(key, kwargs=kwargs)
    except NoReverseMatch:
        return  # not a router route: it has no suffix variant
    data = do.data(world) if callable(do.data) else do.data
    # A handler that takes no `format` raises TypeError here: a 500 in production.
    response = _request(_client(world, role, True), method, path + do.query, data, True)
    assert response.status_code == status, f"{path}: {response.status_code}, not {status} as without .json"


CASES = [
    pytest.param(key, method, role, id=f"{key}-{method.upper()}-{role}")
    for key, entry in MATRIX.items()
    if not key.endswith(":*")
    for method in entry.methods
    for role in ROLES
]


@pytest.mark.parametrize(("key", "method", "role"), CASES)
def test_access(key, method, role, cast):
    run_case(World(cast), key, MATRIX[key], method, role)


# --- the admin: its rule, on each model's list and each app's page -------------------------


def admin_sample() -> list[str]:
    names = ["admin:index", "admin:password_change", "admin:jsi18n"]
    names += sorted({f"admin:app_list:{model._meta.app_label}" for model in admin.site._registry})
    names += sorted(
        f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist" for model in admin.site._registry
    )
    return names


def _admin_path(name: str) -> str:
    if name.startswith("admin:app_list:"):
        return reverse("admin:app_list", kwargs={"app_label": name.rsplit(":", 1)[1]})
    return reverse(name)


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", admin_sample())
def test_admin_access(name, role, cast):
    run_case(World(cast), "admin:*", MATRIX["admin:*"], "get", role, path=_admin_path(name))
