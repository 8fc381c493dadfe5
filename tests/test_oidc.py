"""Single sign-on against a real OpenID Connect provider: oidc-provider-mock, a standards-conforming
provider (Authlib), served over HTTP on a free port for the session.

Each sign-in runs the whole authorization-code flow: the portal sends the browser to the
provider's authorize endpoint; the "person" submits its form there (real HTTP); the provider
sends them back to the portal's callback with a code, which the portal exchanges at the token
endpoint over HTTP, verifying the signed ID token against the provider's published keys.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from portal.accounts import unix_account_name, users_by_unix_name
from portal.env import ImproperlyConfiguredEnv
from portal.identity_env import LEADER, MEMBER, oidc_settings_from_env, parse_group_teams
from portal.models import AuditEntry, ExternalAccount, Membership
from tests.conftest import free_port
from tests.factories import UserFactory
from tests.test_ldap import MAPPING, roles, with_backend

with warnings.catch_warnings():
    # The provider imports authlib modules that authlib itself deprecates: not ours to fix. (authlib
    # turns its own warnings to "always" when imported, so they are ignored once it is.)
    from authlib.deprecate import AuthlibDeprecationWarning

    warnings.simplefilter("ignore", AuthlibDeprecationWarning)
    from oidc_provider_mock import run_server_in_thread

User = get_user_model()


@pytest.fixture(scope="session")
def provider() -> Iterator[str]:
    """The provider's issuer URL."""
    with run_server_in_thread(port=0) as server:
        yield f"http://localhost:{server.server_port}"


@pytest.fixture
def oidc_on(settings, monkeypatch, provider, tmp_path, team) -> Callable[..., None]:
    """The portal configured for the provider from OIDC_* variables, through settings.py's own
    reader; the client secret comes from a file. `team` is Vision Lab."""
    secret = tmp_path / "oidc-client-secret"
    secret.write_text("portal-client-secret\n")

    def configure(**env: str) -> None:
        variables = {
            "OIDC_ISSUER": provider + "/",
            "OIDC_CLIENT_ID": "gpu-portal",
            "OIDC_CLIENT_SECRET_FILE": str(secret),
            "OIDC_UNIX_ACCOUNT_CLAIM": "unix_name",
            "OIDC_LAB_NAME": "Example Lab",
            **env,
        }
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        for name, value in oidc_settings_from_env().items():
            setattr(settings, name, value)
        settings.IDENTITY_GROUP_TEAMS = parse_group_teams(MAPPING)
        settings.IDENTITY_ADMIN_GROUPS = frozenset({"lab-admins"})
        settings.AUTHENTICATION_BACKENDS = with_backend(settings, "portal.oidc.OIDCBackend")

    configure()
    return configure


def sso_sign_in(client, provider: str, sub: str, claims: dict | None = None):
    """Sign in through the provider as `sub`, with these claims; the portal's last answer."""
    if claims is not None:
        httpx.put(f"{provider}/users/{sub}", json=claims).raise_for_status()
    start = client.get(reverse("oidc_authentication_init"))
    assert start.status_code == 302 and start.url.startswith(f"{provider}/oauth2/authorize?")
    form = httpx.get(start.url)
    assert form.status_code == 200 and 'name="sub"' in form.text
    answer = httpx.post(start.url, data={"sub": sub})
    assert answer.status_code == 302, answer.text
    back = urlsplit(answer.headers["location"])
    assert back.path == reverse("oidc_authentication_callback") and "code=" in back.query
    return client.get(f"{back.path}?{back.query}")


def signed_in(client) -> User | None:
    user_id = client.session.get("_auth_user_id")
    return User.objects.get(pk=user_id) if user_id else None


ALICE = {
    "preferred_username": "Alice",
    "email": "alice@lab.example",
    "given_name": "Alice",
    "family_name": "Liddell",
    "groups": ["vision-lab", "nlp-lab-pi", "coffee-club"],
    "unix_name": "aliddell",
}


def test_single_sign_on_creates_the_person_their_teams_and_unix_account(client, oidc_on, provider, settings):
    settings.OIDC_UNIX_ACCOUNT_TRUSTED = True  # the claim is one only the provider's admins set
    response = sso_sign_in(client, provider, "alice-sub", ALICE)

    assert response.status_code == 302 and response.url == reverse("dashboard")
    alice = signed_in(client)
    assert alice.username == "alice"
    assert (alice.first_name, alice.last_name, alice.email) == ("Alice", "Liddell", "alice@lab.example")
    assert not alice.has_usable_password()
    assert not alice.is_staff
    assert roles(alice) == {"vision-lab": MEMBER, "nlp-lab": LEADER}
    assert alice.profile.unix_account == "aliddell"


def test_an_editable_unix_account_claim_only_awaits_an_admin(client, oidc_on, provider):
    """Most providers let people edit their claims (OIDC_UNIX_ACCOUNT_TRUSTED is off by default):
    mallory claims bob's host account before bob ever signs in, and gets nothing of his."""
    sso_sign_in(client, provider, "mallory-sub", {"preferred_username": "mallory", "unix_name": "bob"})
    mallory = signed_in(client)
    assert unix_account_name(mallory) is None
    assert users_by_unix_name(["bob", "mallory"]) == {}
    assert (mallory.profile.unix_account, mallory.profile.unix_account_claim) == (None, "bob")
    assert AuditEntry.objects.filter(
        message="mallory claims the Unix account bob, awaiting an admin to confirm it (single sign-on)"
    ).exists()


def test_a_username_picked_at_the_provider_is_no_unix_account(client, oidc_on, provider, settings):
    """Without a Unix account claim the username stood in for one: mallory, calling herself bob
    at the provider, would run her jobs as the host's bob."""
    oidc_on(OIDC_UNIX_ACCOUNT_CLAIM="")
    sso_sign_in(client, provider, "mallory-sub", {"preferred_username": "bob"})
    portal_bob = signed_in(client)
    assert portal_bob.username == "bob"
    assert unix_account_name(portal_bob) is None
    assert users_by_unix_name(["bob"]) == {}
    assert portal_bob.profile.unix_account_claim == "bob"

    # Where the provider's usernames are the lab's, assigned by its admins, it stands in again.
    settings.OIDC_UNIX_ACCOUNT_TRUSTED = True
    assert unix_account_name(portal_bob) == "bob"
    assert users_by_unix_name(["bob"]) == {"bob": portal_bob.pk}


def test_later_sign_ins_keep_teams_and_admin_rights_in_step(client, oidc_on, provider):
    sso_sign_in(
        client, provider, "bob-sub", {"preferred_username": "bob", "groups": ["vision-lab", "lab-admins"]}
    )
    bob = signed_in(client)
    assert roles(bob) == {"vision-lab": MEMBER}
    assert bob.is_staff and bob.is_superuser

    client.logout()
    sso_sign_in(client, provider, "bob-sub", {"preferred_username": "bob", "groups": ["vision-lab-pi"]})
    assert signed_in(client) == bob
    bob.refresh_from_db()
    assert roles(bob) == {"vision-lab": LEADER}
    assert not bob.is_staff and not bob.is_superuser

    client.logout()
    sso_sign_in(client, provider, "bob-sub", {"preferred_username": "bob"})  # no groups claim at all
    assert roles(bob) == {}


def test_it_links_an_account_of_that_name_without_a_password(client, oidc_on, provider, team):
    carol = UserFactory(username="carol")
    carol.set_unusable_password()
    carol.save()
    Membership.objects.create(user=carol, team=team)
    sso_sign_in(client, provider, "carol-sub", {"preferred_username": "Carol", "groups": []})
    assert signed_in(client) == carol
    assert roles(carol) == {}
    link = ExternalAccount.objects.get(user=carol)
    assert (link.source, link.issuer, link.subject) == ("oidc", provider, "carol-sub")
    assert AuditEntry.objects.filter(message__startswith=f"carol linked to carol-sub at {provider}").exists()


def test_it_never_takes_over_an_admin_by_username(client, oidc_on, provider, caplog):
    admin = UserFactory(username="admin", is_staff=True, is_superuser=True)
    admin.set_unusable_password()  # an admin who signs in by SSO: still never linked on a name
    admin.save()
    response = sso_sign_in(client, provider, "mallory-sub", {"preferred_username": "ADMIN"})
    assert response.url == reverse("login")
    assert signed_in(client) is None
    assert not ExternalAccount.objects.exists()
    page = client.get(response.url).content.decode()
    assert "An account named admin already exists here; ask an admin to link it." in page
    assert "Sign-in with Example Lab failed" not in page
    assert "would take over the account admin, which is an admin" in caplog.text


def test_it_refuses_a_username_that_only_looks_like_an_accounts(client, oidc_on, provider, caplog):
    UserFactory(username="admin", is_staff=True, is_superuser=True)
    # A dotless ı: PostgreSQL's UPPER() makes "ADMIN" of it; NFKC leaves it, and it is not ASCII.
    response = sso_sign_in(client, provider, "mallory-sub", {"preferred_username": "adm\u0131n"})
    assert signed_in(client) is None
    assert list(User.objects.values_list("username", flat=True)) == ["admin"]
    assert "cannot be used here" in client.get(response.url).content.decode()
    assert "is not a-z, 0-9, '.', '_' and '-' only" in caplog.text


def test_it_links_an_account_with_a_password_only_when_configured(client, settings, oidc_on, provider):
    carol = UserFactory(username="carol")  # password "password"
    sso_sign_in(client, provider, "carol-sub", {"preferred_username": "carol"})
    assert signed_in(client) is None
    carol.refresh_from_db()
    assert carol.check_password("password")

    settings.IDENTITY_LINK_LOCAL_ACCOUNTS = True
    sso_sign_in(client, provider, "carol-sub", {"preferred_username": "carol"})
    assert signed_in(client) == carol
    carol.refresh_from_db()
    assert not carol.has_usable_password()  # the provider is how carol signs in now
    assert AuditEntry.objects.filter(message__contains="its local password no longer works").exists()


def test_linking_local_accounts_never_links_an_admin(client, settings, oidc_on, provider):
    settings.IDENTITY_LINK_LOCAL_ACCOUNTS = True
    UserFactory(username="root", is_staff=True)
    sso_sign_in(client, provider, "mallory-sub", {"preferred_username": "root"})
    assert signed_in(client) is None


def test_it_finds_people_by_subject_when_their_username_changes(client, oidc_on, provider):
    sso_sign_in(client, provider, "frank-sub", {"preferred_username": "frank"})
    frank = signed_in(client)
    client.logout()
    sso_sign_in(client, provider, "frank-sub", {"preferred_username": "frank.new"})
    assert signed_in(client) == frank
    frank.refresh_from_db()
    assert frank.username == "frank"
    assert not User.objects.filter(username="frank.new").exists()
    assert ExternalAccount.objects.get(user=frank).last_login_at is not None

    # Someone else at the provider who now calls themselves frank gets nothing of his.
    client.logout()
    sso_sign_in(client, provider, "other-sub", {"preferred_username": "frank"})
    assert signed_in(client) is None


def test_it_never_takes_over_an_account_by_email_alone(client, oidc_on, provider):
    someone = UserFactory(username="dwright", email="dave@lab.example")
    sso_sign_in(client, provider, "dave-sub", {"preferred_username": "dave", "email": "dave@lab.example"})
    dave = signed_in(client)
    assert dave != someone and dave.username == "dave"


def test_it_refuses_a_sign_in_without_a_username_claim(client, oidc_on, provider):
    response = sso_sign_in(
        client, provider, "nameless-sub", {"email": "x@lab.example", "groups": ["vision-lab"]}
    )
    assert response.status_code == 302 and response.url == reverse("login")
    assert signed_in(client) is None
    assert not User.objects.exists()
    page = client.get(response.url)
    assert "Your single sign-on account gives no username" in page.content.decode()


def test_the_login_page_shows_the_button_only_when_configured(client, settings, oidc_on):
    page = client.get(reverse("login")).content.decode()
    assert "Sign in with Example Lab" in page
    assert reverse("oidc_authentication_init") in page

    settings.OIDC_ISSUER = ""
    page = client.get(reverse("login")).content.decode()
    assert "Sign in with" not in page
    assert client.get(reverse("oidc_authentication_init")).status_code == 404
    assert client.get(reverse("oidc_authentication_callback")).status_code == 404


def test_a_provider_that_is_down_stops_neither_local_sign_ins_nor_the_login_page(client, oidc_on):
    oidc_on(OIDC_ISSUER=f"http://127.0.0.1:{free_port()}")
    UserFactory(username="localadmin")
    response = client.post(reverse("login"), {"username": "localadmin", "password": "password"})
    assert response.status_code == 302 and response.url == reverse("dashboard")

    client.logout()
    response = client.get(reverse("oidc_authentication_init"), follow=True)
    assert "Sign-in with Example Lab is unavailable right now" in response.content.decode()


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"OIDC_ISSUER": "sso.lab.example"}, "must be the provider's https:// address"),
        ({"OIDC_CLIENT_ID": ""}, "set OIDC_CLIENT_ID and OIDC_CLIENT_SECRET"),
        ({"OIDC_SCOPES": "email profile"}, "must include openid"),
        ({"OIDC_SIGN_ALGO": "none"}, "OIDC_SIGN_ALGO='none' must be one of"),
        ({"OIDC_SIGN_ALGO": "PS256"}, "OIDC_SIGN_ALGO='ps256' must be one of.*every sign-in would fail"),
        ({"OIDC_SIGN_ALGO": "HS512"}, "OIDC_SIGN_ALGO='hs512' must be one of"),
        ({"OIDC_ISSUER": "http://sso.lab.example"}, "must be https://: over http:// anyone"),
    ],
)
def test_it_refuses_oidc_settings_that_cannot_work(monkeypatch, env, complaint):
    for name, value in {
        "OIDC_ISSUER": "https://sso.lab.example",
        "OIDC_CLIENT_ID": "gpu-portal",
        "OIDC_CLIENT_SECRET": "s3cret",
        **env,
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ImproperlyConfiguredEnv, match=complaint):
        oidc_settings_from_env()


def test_it_reads_oidc_settings_with_their_defaults(monkeypatch):
    monkeypatch.setenv("OIDC_ISSUER", "https://sso.lab.example/realms/lab/")
    monkeypatch.setenv("OIDC_CLIENT_ID", "gpu-portal")
    monkeypatch.setenv("OIDC_CLIENT_SECRET", "s3cret")
    found = oidc_settings_from_env()
    assert found["OIDC_ISSUER"] == "https://sso.lab.example/realms/lab"
    assert found["OIDC_RP_SCOPES"] == "openid email profile"
    assert found["OIDC_RP_SIGN_ALGO"] == "RS256"
    assert (found["OIDC_USERNAME_CLAIM"], found["OIDC_GROUPS_CLAIM"]) == ("preferred_username", "groups")
    assert found["OIDC_UNIX_ACCOUNT_CLAIM"] == ""


@pytest.mark.parametrize("algorithm", ["RS512", "es256", "HS256"])
def test_it_takes_the_algorithms_it_can_verify(monkeypatch, algorithm):
    monkeypatch.setenv("OIDC_ISSUER", "http://127.0.0.1:8080")  # http:// on this machine: tests
    monkeypatch.setenv("OIDC_CLIENT_ID", "gpu-portal")
    monkeypatch.setenv("OIDC_CLIENT_SECRET", "s3cret")
    monkeypatch.setenv("OIDC_SIGN_ALGO", algorithm)
    assert oidc_settings_from_env()["OIDC_RP_SIGN_ALGO"] == algorithm.upper()


def test_a_deactivated_account_is_signed_out_and_cannot_sign_in_again(client, oidc_on, provider):
    sso_sign_in(client, provider, "erin-sub", {"preferred_username": "erin"})
    assert client.get(reverse("profile")).status_code == 200
    User.objects.filter(username="erin").update(is_active=False)

    assert client.get(reverse("profile")).status_code == 302
    response = sso_sign_in(client, provider, "erin-sub")
    assert response.url == reverse("login")
    assert client.get(reverse("profile")).status_code == 302
