"""Brute-force limits on the login form and POST /api/v1/token/ (django-axes, docs/security.md):
LOGIN_FAILURE_LIMIT failures per account and, separately, per client address lock it for
LOGIN_FAILURE_WINDOW_MINUTES; the right password fails meanwhile; admins can unlock."""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt, AccessFailureLog
from django.core.management import call_command
from django.db.models import F
from django.test import RequestFactory
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from portal.models import ApiToken, AuditEntry
from portal.signin import client_address, signin_lockout_parameters
from portal.tasks import prune_signin_failures

pytestmark = pytest.mark.django_db

LIMIT = 10  # the default LOGIN_FAILURE_LIMIT


def _login(client, username: str, password: str, address: str = "127.0.0.1"):  # type: ignore[no-untyped-def]
    return client.post(reverse("login"), {"username": username, "password": password}, REMOTE_ADDR=address)


def _token(username: str, password: str, address: str = "127.0.0.1"):  # type: ignore[no-untyped-def]
    return APIClient().post(
        reverse("api_token"), {"username": username, "password": password}, format="json", REMOTE_ADDR=address
    )


def _fail(times: int, username: str = "alice", address: str = "127.0.0.1") -> None:
    for _ in range(times):
        response = _token(username, "wrong", address)
        assert response.status_code in (400, 429)


def _signed_in(client) -> bool:  # type: ignore[no-untyped-def]
    return client.get(reverse("dashboard")).status_code == 200


def test_the_defaults_are_ten_failures_in_fifteen_minutes(settings):
    assert settings.LOGIN_FAILURE_LIMIT == settings.AXES_FAILURE_LIMIT == LIMIT
    assert settings.AXES_COOLOFF_TIME.total_seconds() == 15 * 60
    assert settings.PROXY_COUNT == 0


def test_it_locks_the_login_form_and_refuses_even_the_right_password(client, alice):
    for _ in range(LIMIT - 1):
        response = _login(client, "alice", "wrong")
        assert response.status_code == 200
        assert "Please enter a correct username and password" in response.content.decode()
    response = _login(client, "alice", "wrong")
    assert response.status_code == 429
    page = response.content.decode()
    assert "Sign-in locked" in page and "the account “alice”" in page
    assert "15 minutes" in page and "An admin can unlock it" in page
    assert response["Retry-After"] == str(15 * 60)

    response = _login(client, "alice", "password")
    assert response.status_code == 429
    assert not _signed_in(client)
    # Every try is recorded, the one with the right password too.
    assert AccessAttempt.objects.get(username="alice").failures_since_start == LIMIT + 1
    assert AccessFailureLog.objects.filter(username="alice").count() == LIMIT + 1
    assert AccessFailureLog.objects.filter(username="alice", locked_out=True).count() == 2


def test_the_account_lock_holds_from_every_address(client, alice, bob):
    for n in range(LIMIT):
        _fail(1, "alice", f"10.0.0.{n}")
    assert _login(client, "alice", "password", "10.0.1.1").status_code == 429
    # The addresses themselves are not locked: each failed once.
    assert _login(client, "bob", "password", "10.0.0.1").status_code == 302


def test_the_account_lock_ignores_case_and_spaces(alice):
    """Directories match names without case: "Alice" is no fresh account to guess at."""
    _fail(LIMIT, "alice", "192.0.2.1")

    for name, address in (("Alice", "192.0.2.2"), (" ALICE ", "192.0.2.3")):
        assert _token(name, "password", address).status_code == 429


@pytest.mark.parametrize(
    "name",
    [
        "\uff41\uff4c\uff49\uff43\uff45",  # ａｌｉｃｅ, full width
        "\uff21\uff2c\uff29\uff23\uff25",  # ＡＬＩＣＥ
        "al\u0130ce",  # alİce: lower() makes "i" + a combining dot of the İ
        "\u00aalice",  # ªlice: NFKC's "a"
    ],
)
def test_the_account_lock_holds_for_width_and_compatibility_variants(alice, name):
    """LDAP takes each of these for alice (tests/test_ldap.py): none is a fresh account to guess at."""
    _fail(LIMIT, "alice", "192.0.2.1")
    assert _token(name, "password", "192.0.2.2").status_code == 429


def test_failures_under_variants_of_a_name_add_up(alice):
    for n, name in enumerate(
        ["\uff41\uff4c\uff49\uff43\uff45", "AL\u0130CE", "\u00aalice", "Alice", "alice"] * 2
    ):
        _fail(1, name, f"192.0.2.{n}")
    assert _token("alice", "password", "192.0.2.99").status_code == 429
    assert set(AccessAttempt.objects.values_list("username", flat=True)) == {"alice"}


def test_the_address_lock_holds_for_every_account(client, alice):
    for n in range(LIMIT):
        _fail(1, f"guess{n}", "10.0.0.9")
    response = _login(client, "alice", "password", "10.0.0.9")
    assert response.status_code == 429
    assert "your address 10.0.0.9" in response.content.decode()
    assert _login(client, "alice", "password", "10.0.0.8").status_code == 302


def test_the_token_endpoint_answers_429_in_the_api_error_shape(alice):
    _fail(LIMIT - 1)
    response = _token("alice", "wrong")
    assert response.status_code == 429
    body = response.json()
    assert body["code"] == "locked_out"
    assert "the account “alice”" in body["detail"] and "15 minutes" in body["detail"]
    assert "admin can unlock" in body["detail"]
    assert response["Retry-After"] == str(15 * 60)
    response = _token("alice", "password")
    assert response.status_code == 429 and "token" not in response.json()
    assert not ApiToken.objects.exists()


def test_the_form_and_the_api_share_one_count(client, alice):
    _fail(LIMIT // 2)
    for _ in range(LIMIT - LIMIT // 2):
        _login(client, "alice", "wrong")
    assert _token("alice", "password").status_code == 429


def test_the_lock_lifts_after_the_window(client, alice, settings):
    settings.AXES_FAILURE_LIMIT = 3
    _fail(3)
    assert _login(client, "alice", "password").status_code == 429
    # The window passes (moved, not slept): the failures now lie more than 15 minutes back.
    AccessAttempt.objects.update(attempt_time=F("attempt_time") - timedelta(minutes=15, seconds=1))
    assert _login(client, "alice", "password").status_code == 302
    assert _signed_in(client)


def test_a_try_while_locked_starts_the_window_again(client, alice, settings):
    settings.AXES_FAILURE_LIMIT = 3
    _fail(3)
    AccessAttempt.objects.update(attempt_time=F("attempt_time") - timedelta(minutes=10))
    assert _login(client, "alice", "password").status_code == 429
    AccessAttempt.objects.update(attempt_time=F("attempt_time") - timedelta(minutes=10))
    assert _login(client, "alice", "password").status_code == 429


def test_an_admin_unlocks_an_account_from_the_user_admin(client, alice, admin_user):
    _fail(LIMIT, "alice", "10.0.0.1")
    assert _token("alice", "password", "10.0.0.2").status_code == 429
    client.force_login(admin_user)
    changelist = reverse("admin:auth_user_changelist")
    assert "Unlock sign-in" in client.get(changelist).content.decode()
    action = {"action": "unlock_signin", "_selected_action": [alice.pk]}
    response = client.post(changelist, action, follow=True)
    assert "Sign-in unlocked for 1 user(s)" in response.content.decode()
    assert _token("alice", "password", "10.0.0.2").status_code == 200
    entry = AuditEntry.objects.get(action=AuditEntry.Action.SIGNIN_UNLOCK)
    assert entry.actor == admin_user and entry.target == "user alice"
    # The attempts stay visible in the admin, under Axes.
    assert client.get(reverse("admin:axes_accessattempt_changelist")).status_code == 200
    assert client.get(reverse("admin:axes_accessfailurelog_changelist")).status_code == 200


def test_the_management_command_unlocks_too(client, alice):
    _fail(LIMIT)
    call_command("axes_reset_username", "alice")
    assert _login(client, "alice", "password").status_code == 302


def test_the_client_address_trusts_forwarded_for_only_through_proxy_count(settings):
    factory = RequestFactory()
    spoofed = factory.get("/", REMOTE_ADDR="10.1.1.1", HTTP_X_FORWARDED_FOR="6.6.6.6, 192.0.2.7")
    settings.PROXY_COUNT = 0
    assert client_address(spoofed) == "10.1.1.1"
    settings.PROXY_COUNT = 1
    # nginx appends the address it saw: the last entry; the ones before it are the client's own words.
    assert client_address(spoofed) == "192.0.2.7"
    assert client_address(factory.get("/", REMOTE_ADDR="10.1.1.1")) == "10.1.1.1"
    garbage = factory.get("/", REMOTE_ADDR="10.1.1.1", HTTP_X_FORWARDED_FOR="not-an-address")
    assert client_address(garbage) == "10.1.1.1"
    settings.PROXY_COUNT = 2
    assert client_address(spoofed) == "6.6.6.6"
    short = factory.get("/", REMOTE_ADDR="10.1.1.1", HTTP_X_FORWARDED_FOR="192.0.2.7")
    assert client_address(short) == "10.1.1.1"


def test_a_forged_forwarded_for_does_not_escape_the_address_lock(client, alice):
    for n in range(LIMIT):
        APIClient().post(
            reverse("api_token"),
            {"username": f"guess{n}", "password": "wrong"},
            format="json",
            HTTP_X_FORWARDED_FOR=f"203.0.113.{n}",
        )
    response = client.post(
        reverse("login"), {"username": "alice", "password": "password"}, HTTP_X_FORWARDED_FOR="203.0.113.99"
    )
    assert response.status_code == 429


def test_a_sign_in_without_a_username_counts_per_address_only():
    request = RequestFactory().post("/oidc/callback/")
    assert signin_lockout_parameters(request, {"nonce": "x"}) == ["ip_address"]
    assert signin_lockout_parameters(request, {"username": "alice"}) == ["username", "ip_address"]


def test_failure_records_are_pruned_past_their_retention(settings):
    settings.LOGIN_FAILURE_LOG_DAYS = 90
    now = timezone.now()
    for days in (91, 89):
        AccessFailureLog.objects.create(
            username="alice", ip_address="192.0.2.7", user_agent="", path_info="/login/", attempt_time=now
        )
        AccessFailureLog.objects.filter(pk=AccessFailureLog.objects.latest("pk").pk).update(
            attempt_time=now - timedelta(days=days)
        )

    assert prune_signin_failures() == 1
    assert prune_signin_failures() == 0
    assert AccessFailureLog.objects.get().attempt_time == now - timedelta(days=89)
