"""API tokens (portal.tokens, docs/security.md): only a hash in the database, an optional expiry,
revocation from the profile page, POST /api/v1/token/, and the migration that hashed DRF's
plaintext keys."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from portal.models import ApiToken, AuditEntry
from portal.services import api_token_create, api_token_revoke
from tests.migrating import fresh_database, leaves, migrate, models_at

pytestmark = pytest.mark.django_db


def _api(key: str) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return api


def _create(client, **data):  # type: ignore[no-untyped-def]
    return client.post(reverse("token_create"), {"expires_in_days": "", **data}, follow=True)


def _database_dump(*apps: str) -> str:
    out = io.StringIO()
    call_command("dumpdata", *apps, stdout=out)
    return out.getvalue()


def test_only_a_hash_of_the_key_is_in_the_database(client, alice):
    _, service_key = api_token_create(user=alice, name="scripts", expires_at=None)
    client.force_login(alice)
    page = _create(client, name="laptop").content.decode()
    credentials = {"username": "alice", "password": "password"}
    response = APIClient().post(reverse("api_token"), credentials, format="json")
    keys = [service_key, response.json()["token"]]
    dump = _database_dump()
    for key in keys:
        assert key not in dump
        assert ApiToken.objects.filter(key_hash=ApiToken.hash_key(key), prefix=key[:8]).exists()
    assert ApiToken.objects.count() == 3 and "API token “laptop” (" in page


def test_the_profile_shows_a_new_key_once_and_lists_the_tokens(client, alice):
    client.force_login(alice)
    response = _create(client, name="laptop", expires_in_days="30")
    token = ApiToken.objects.get(user=alice)
    page = response.content.decode()
    key = page.split('<code class="api-token-key">')[1].split("</code>")[0]
    assert key.startswith(token.prefix) and ApiToken.hash_key(key) == token.key_hash
    assert "Copy it now: it is not shown again" in page
    assert token.expires_at == pytest.approx(timezone.now() + timedelta(days=30), abs=timedelta(minutes=1))
    assert _api(key).get("/api/v1/gpus/").status_code == 200

    page = client.get(reverse("profile")).content.decode()
    assert key not in page
    assert f"<code>{token.prefix}…</code>" in page and "laptop" in page and "Active" in page
    entry = AuditEntry.objects.get(action=AuditEntry.Action.API_TOKEN_CREATE)
    assert entry.actor == alice and entry.data["prefix"] == token.prefix


def test_bad_input_is_refused_beside_the_field_it_names(client, alice, settings):
    client.force_login(alice)
    page = _create(client, name="  ").content.decode()
    assert "The token was not created" in page and "Name: give the token a name" in page
    page = _create(client, name="laptop", expires_in_days="0").content.decode()
    assert "Expires in (days): at least 1 day." in page
    page = _create(client, name="laptop", expires_in_days="soon").content.decode()
    assert "Expires in (days): enter a whole number of days" in page
    settings.API_TOKEN_MAX_DAYS = 90
    settings.API_TOKEN_DEFAULT_DAYS = 30
    page = _create(client, name="laptop", expires_in_days="91").content.decode()
    assert "Expires in (days): at most 90 days on this portal." in page
    assert not ApiToken.objects.exists()
    _create(client, name="laptop")
    expires = ApiToken.objects.get().expires_at
    assert expires == pytest.approx(timezone.now() + timedelta(days=30), abs=timedelta(minutes=1))


def test_a_token_revoked_on_the_profile_page_stops_working(client, alice, bob):
    token, key = api_token_create(user=alice, name="laptop", expires_at=None)
    assert _api(key).get("/api/v1/gpus/").status_code == 200
    client.force_login(bob)
    assert client.post(reverse("token_revoke", args=[token.pk])).status_code == 404
    client.force_login(alice)
    assert client.get(reverse("token_revoke", args=[token.pk])).status_code == 405
    page = client.post(reverse("token_revoke", args=[token.pk]), follow=True).content.decode()
    assert "revoked: it no longer works" in page and "Revoked" in page
    response = _api(key).get("/api/v1/gpus/")
    assert response.status_code == 401
    assert "was revoked on" in response.json()["detail"] and "gpu login" in response.json()["detail"]
    entry = AuditEntry.objects.get(action=AuditEntry.Action.API_TOKEN_REVOKE)
    assert entry.actor == alice and entry.target == f"api token {token.pk}"
    # A second revoke changes nothing and logs nothing.
    assert api_token_revoke(token=token, by=alice) is False
    assert AuditEntry.objects.filter(action=AuditEntry.Action.API_TOKEN_REVOKE).count() == 1


def test_an_expired_token_is_refused_with_its_date(alice):
    token, key = api_token_create(user=alice, name="ci", expires_at=timezone.now() + timedelta(days=1))
    assert _api(key).get("/api/v1/gpus/").status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = _api(key).get("/api/v1/gpus/")
    assert response.status_code == 401
    assert "expired on" in response.json()["detail"]
    assert response["WWW-Authenticate"] == "Token"


def test_a_maximum_age_ends_tokens_made_before_it_too(alice, settings):
    """API_TOKEN_MAX_DAYS also ends a token with no expiry of its own (one hashed by 0008)."""
    token, key = api_token_create(user=alice, name="old", expires_at=None)
    ApiToken.objects.filter(pk=token.pk).update(created_at=timezone.now() - timedelta(days=31))
    assert _api(key).get("/api/v1/gpus/").status_code == 200

    settings.API_TOKEN_DEFAULT_DAYS = settings.API_TOKEN_MAX_DAYS = 30

    response = _api(key).get("/api/v1/gpus/")
    assert response.status_code == 401
    assert "expired on" in response.json()["detail"]


def test_unknown_keys_and_inactive_users_are_refused(alice):
    assert _api("0" * 40).get("/api/v1/gpus/").status_code == 401
    _, key = api_token_create(user=alice, name="ci", expires_at=None)
    assert _api(key[:-1] + ("0" if key[-1] != "0" else "1")).get("/api/v1/gpus/").status_code == 401
    alice.is_active = False
    alice.save()
    assert _api(key).get("/api/v1/gpus/").status_code == 401


def test_the_token_endpoint_makes_a_named_token_with_an_expiry(alice, settings):
    api = APIClient()
    response = api.post(
        reverse("api_token"),
        {"username": "alice", "password": "password", "name": "cluster", "expires_in_days": 7},
        format="json",
    )
    assert response.status_code == 200
    body = response.json()
    token = ApiToken.objects.get(user=alice)
    assert body["name"] == "cluster" and body["prefix"] == token.prefix == body["token"][:8]
    assert token.expires_at == pytest.approx(timezone.now() + timedelta(days=7), abs=timedelta(minutes=1))
    assert _api(body["token"]).get("/api/v1/gpus/").status_code == 200

    # Form-encoded, no name, no expiry: as old clients call it.
    response = api.post(reverse("api_token"), {"username": "alice", "password": "password"})
    assert response.status_code == 200 and response.json()["name"].startswith("API sign-in ")
    assert response.json()["expires_at"] is None

    bad = api.post(reverse("api_token"), {"username": "alice", "password": "x"}, format="json")
    assert bad.status_code == 400 and bad.json()["detail"] == "Unable to log in with provided credentials."
    settings.API_TOKEN_MAX_DAYS = 90
    settings.API_TOKEN_DEFAULT_DAYS = 30
    long = {"username": "alice", "password": "password", "expires_in_days": 365}
    response = api.post(reverse("api_token"), long, format="json")
    assert response.status_code == 400 and "expires_in_days" in response.json()["errors"]
    assert ApiToken.objects.count() == 2


def test_last_used_is_written_at_most_once_a_minute(alice):
    token, key = api_token_create(user=alice, name="ci", expires_at=None)
    api = _api(key)

    def token_updates() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert api.get("/api/v1/teams/").status_code == 200
        return sum(1 for q in queries if q["sql"].startswith("UPDATE") and "apitoken" in q["sql"])

    assert token_updates() == 1
    token.refresh_from_db()
    first = token.last_used_at
    assert first is not None
    assert token_updates() == 0
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=first - timedelta(seconds=61))
    assert token_updates() == 1
    token.refresh_from_db()
    assert token.last_used_at > first


def test_an_admin_revokes_tokens_in_the_admin(client, alice, admin_user):
    token, key = api_token_create(user=alice, name="laptop", expires_at=None)
    client.force_login(admin_user)
    changelist = reverse("admin:portal_apitoken_changelist")
    assert "laptop" in client.get(changelist).content.decode()
    client.post(changelist, {"action": "revoke", "_selected_action": [token.pk]})
    assert _api(key).get("/api/v1/gpus/").status_code == 401
    assert AuditEntry.objects.get(action=AuditEntry.Action.API_TOKEN_REVOKE).actor == admin_user


@pytest.mark.django_db(transaction=True)
def test_the_migration_hashes_existing_plaintext_tokens():
    key = "0123456789abcdef0123456789abcdef01234567"
    before = [("portal", "0007_queue"), ("authtoken", "0004_alter_tokenproxy_options")]
    with fresh_database():  # tests/migrating.py: forwards from nothing, not the test database back
        migrate(before)
        old = models_at(before)
        user = old.get_model("auth", "User").objects.create(username="dana", password="!")
        old.get_model("authtoken", "Token").objects.create(key=key, user_id=user.pk)

        migrate([("portal", "0008_api_tokens")])
        new = models_at([("portal", "0008_api_tokens")])
        assert not new.get_model("authtoken", "Token").objects.exists()
        migrated = new.get_model("portal", "ApiToken").objects.get()
        assert migrated.prefix == key[:8] and migrated.key_hash == ApiToken.hash_key(key)

        # Today's portal (its token check) and what it needs: the other apps' 60 migrations, 4 s
        # of CPU, write no token, and their tables, empty here, are left out of the dump.
        migrate(leaves("portal", "authtoken"))
        response = _api(key).get("/api/v1/teams/")
        assert response.status_code == 200
        assert key not in _database_dump("auth", "authtoken", "portal")


def test_a_token_revokes_itself_and_only_a_token_can(client, alice):
    _, key = api_token_create(user=alice, name="cli", expires_at=None)
    url = reverse("api_token_current")

    assert _api(key).delete(url).status_code == 204
    assert _api(key).get("/api/v1/gpus/").status_code == 401
    assert AuditEntry.objects.filter(action=AuditEntry.Action.API_TOKEN_REVOKE).count() == 1

    session = APIClient()
    session.force_login(alice)
    response = session.delete(url)
    assert response.status_code == 400
    assert "not signed with an API token" in response.json()["detail"]
