"""Sign-in against a real OpenLDAP server, and the group mapping LDAP and single sign-on share.

A session's slapd is started from tests/ldap/ (slapd.conf, directory.ldif) on a free port of
127.0.0.1; the portal binds to it over the network as cn=portal, as a lab's portal would. Without
slapd or django-auth-ldap these tests are skipped, except under CI=true, where .ci/run installs
them and a skip would hide a broken sign-in.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from django.contrib.auth import authenticate, get_user_model
from django.urls import reverse
from rest_framework.test import APIClient

from portal.accounts import unix_account_name, users_by_unix_name
from portal.env import ImproperlyConfiguredEnv
from portal.identity import identity_sync
from portal.identity_env import (
    LEADER,
    MEMBER,
    TeamGrant,
    env_group_names,
    ldap_settings_from_env,
    parse_group_teams,
)
from portal.models import AuditEntry, ExternalAccount, Membership, Profile, Team
from tests.conftest import free_port
from tests.factories import MembershipFactory, TeamFactory, UserFactory

HERE = Path(__file__).resolve().parent / "ldap"
ROOT = Path(__file__).resolve().parent.parent
ADMIN_DN, ADMIN_PASSWORD = "cn=admin,dc=lab,dc=example", "admin-pw"
BIND_DN, BIND_PASSWORD = "cn=portal,ou=services,dc=lab,dc=example", "portal-bind-pw"
PEOPLE, GROUPS = "ou=people,dc=lab,dc=example", "ou=groups,dc=lab,dc=example"
MAPPING = "vision-lab=vision-lab:member, vision-lab-pi=vision-lab:leader, nlp-lab-pi=nlp-lab:leader"
User = get_user_model()


def roles(user) -> dict[str, str]:
    return dict(Membership.objects.filter(user=user).values_list("team__slug", "role"))


def with_backend(settings, backend: str) -> list[str]:
    """The configured backends with `backend` just before Django's own, as settings.py puts it."""
    backends = [b for b in settings.AUTHENTICATION_BACKENDS if b != backend]
    at = backends.index("django.contrib.auth.backends.ModelBackend")
    return [*backends[:at], backend, *backends[at:]]


# --- The mapping's format and the start-up checks ---------------------------------------------


def test_it_reads_the_group_mapping():
    mapping = parse_group_teams("vision-lab=vision-lab, Vision-Lab-PI = vision-lab:Leader,PIs=a:leader,PIs=b")
    assert mapping == {
        "vision-lab": (TeamGrant("vision-lab", MEMBER),),
        "vision-lab-pi": (TeamGrant("vision-lab", LEADER),),
        "pis": (TeamGrant("a", LEADER), TeamGrant("b", MEMBER)),
    }
    assert parse_group_teams("  ") == {}
    assert parse_group_teams("Vision Lab PIs=vision-lab:leader") == {
        "vision lab pis": (TeamGrant("vision-lab", LEADER),)
    }


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("vision-lab", "is not group=team-slug:role"),
        ("vision-lab=", "is not group=team-slug:role"),
        ("vision-lab=Vision Lab", "a team slug is letters"),
        ("vision-lab=vision-lab:owner", "use member or leader"),
        ("cn=vision-lab,ou=groups,dc=lab", "reads as part of a DN"),
        ("a=x:member,a=x:leader", "is given team 'x' twice"),
    ],
)
def test_it_refuses_a_mapping_it_cannot_read(value, complaint):
    with pytest.raises(ImproperlyConfiguredEnv, match=complaint) as caught:
        parse_group_teams(value, var="IDENTITY_GROUP_TEAMS")
    assert str(caught.value).startswith("IDENTITY_GROUP_TEAMS: ")


def test_the_portal_does_not_start_with_a_broken_mapping():
    env = {**os.environ, "IDENTITY_GROUP_TEAMS": "vision-lab=vision-lab:boss"}
    done = subprocess.run(
        [sys.executable, "-c", "import portal.settings"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "IDENTITY_GROUP_TEAMS: 'vision-lab=vision-lab:boss' gives role 'boss'" in done.stderr


def test_its_roles_are_the_memberships_roles():
    assert {MEMBER, LEADER} == set(Membership.Role.values)


def test_it_reads_admin_groups_without_case(monkeypatch):
    monkeypatch.setenv("IDENTITY_ADMIN_GROUPS", "Lab-Admins, root ,,")
    assert env_group_names("IDENTITY_ADMIN_GROUPS") == {"lab-admins", "root"}


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"LDAP_SERVER_URI": "ldap.lab.example"}, "must start with ldap://"),
        ({"LDAP_USER_SEARCH_BASE": ""}, "LDAP_USER_SEARCH_BASE is empty"),
        ({"LDAP_USER_FILTER": "(uid=%s)"}, "must be an LDAP filter holding %\\(user\\)s"),
        ({"LDAP_SERVER_URI": "ldaps://ldap.lab.example", "LDAP_START_TLS": "true"}, "use one of them"),
        (
            {"LDAP_GROUP_SEARCH_BASE": "", "IDENTITY_ADMIN_GROUPS": "admins"},
            "LDAP_GROUP_SEARCH_BASE is empty",
        ),
        ({"LDAP_GROUP_TYPE": "openldap"}, "LDAP_GROUP_TYPE='openldap' must be one of"),
        ({"LDAP_CA_CERT_FILE": "/nonexistent/ca.pem"}, "is not a readable file"),
    ],
)
def test_it_refuses_ldap_settings_that_cannot_work(monkeypatch, env, complaint):
    pytest.importorskip("django_auth_ldap")
    base = {
        "LDAP_SERVER_URI": "ldap://ldap.lab.example",
        "LDAP_USER_SEARCH_BASE": PEOPLE,
        "LDAP_GROUP_SEARCH_BASE": GROUPS,
    }
    for name, value in {**base, **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ImproperlyConfiguredEnv, match=complaint):
        ldap_settings_from_env()


def test_it_has_no_ldap_settings_without_a_server(monkeypatch):
    monkeypatch.delenv("LDAP_SERVER_URI", raising=False)
    assert ldap_settings_from_env() == {}


# --- identity_sync, as both backends call it --------------------------------------------------


@pytest.fixture
def mapped(settings, db):
    settings.IDENTITY_GROUP_TEAMS = parse_group_teams(MAPPING)
    settings.IDENTITY_ADMIN_GROUPS = frozenset({"lab-admins"})


def test_a_leader_group_wins_over_a_member_group_of_the_same_team(mapped, team):
    user = UserFactory(username="erin")
    identity_sync(user=user, groups=["vision-lab", "Vision-Lab-PI"], unix_account=None, source="oidc")
    assert roles(user) == {"vision-lab": LEADER}


def test_it_never_touches_teams_the_mapping_does_not_name(mapped, team):
    user = UserFactory(username="erin")
    MembershipFactory(user=user, team=TeamFactory(slug="reading-group", name="Reading Group"))
    identity_sync(user=user, groups=[], unix_account=None, source="ldap")
    assert roles(user) == {"reading-group": MEMBER}


def test_it_leaves_teams_and_admin_rights_alone_when_the_groups_are_not_read(mapped, team):
    user = UserFactory(username="erin", is_staff=True, is_superuser=True)
    MembershipFactory(user=user, team=team)
    identity_sync(user=user, groups=None, unix_account="erin", source="ldap")
    user.refresh_from_db()
    assert roles(user) == {"vision-lab": MEMBER}
    assert user.is_staff


def test_it_leaves_admin_rights_alone_without_admin_groups(mapped, settings):
    settings.IDENTITY_ADMIN_GROUPS = frozenset()
    user = UserFactory(username="erin", is_staff=True, is_superuser=True)
    identity_sync(user=user, groups=[], unix_account=None, source="oidc")
    user.refresh_from_db()
    assert user.is_staff and user.is_superuser


def test_running_it_again_changes_and_audits_nothing(mapped, team):
    user = UserFactory(username="erin")
    sync = dict(user=user, groups=["vision-lab", "lab-admins"], unix_account="erin", source="ldap")
    identity_sync(**sync)
    entries = AuditEntry.objects.count()
    identity_sync(**sync)
    assert AuditEntry.objects.count() == entries
    assert roles(user) == {"vision-lab": MEMBER}


def test_it_never_takes_a_unix_account_from_whoever_holds_it(mapped, caplog):
    user, other = UserFactory(username="erin"), UserFactory(username="frank")
    Profile.objects.create(user=other, unix_account="erin")
    Profile.objects.create(user=user, unix_account="old-name")
    with caplog.at_level(logging.WARNING, logger="portal.identity"):
        identity_sync(user=user, groups=None, unix_account="erin", source="ldap")
    assert Profile.objects.get(user=user).unix_account == "old-name"
    assert Profile.objects.get(user=other).unix_account == "erin"
    assert "which is frank's: refused, an admin must resolve it" in caplog.text
    entry = AuditEntry.objects.get(action=AuditEntry.Action.IDENTITY_SYNC)
    assert entry.message == (
        "erin was not given the Unix account erin: it is frank's; an admin must resolve it (LDAP)"
    )


def test_it_never_gives_a_unix_account_named_after_someone_without_one(mapped, settings):
    settings.OIDC_UNIX_ACCOUNT_TRUSTED = True
    user, frank = UserFactory(username="erin"), UserFactory(username="frank")
    identity_sync(user=user, groups=None, unix_account="frank", source="oidc")
    assert not Profile.objects.filter(user=user, unix_account="frank").exists()

    # With a Unix account of his own, the OS user "frank" is not the portal's frank.
    Profile.objects.create(user=frank, unix_account="fbloggs")
    identity_sync(user=user, groups=None, unix_account="frank", source="oidc")
    assert Profile.objects.get(user=user).unix_account == "frank"


@pytest.mark.parametrize("name", ["Erin Example", "-erin", "1234", "erin;rm", "e" * 33, "ériñ"])
def test_it_ignores_a_unix_account_that_is_not_a_posix_user_name(mapped, caplog, name):
    user = UserFactory(username="erin")
    Profile.objects.create(user=user, unix_account="erin")
    with caplog.at_level(logging.WARNING, logger="portal.identity"):
        identity_sync(user=user, groups=None, unix_account=name, source="oidc")
    assert Profile.objects.get(user=user).unix_account == "erin"
    assert "not a POSIX user name" in caplog.text


# --- A real slapd -----------------------------------------------------------------------------


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


def _missing() -> str | None:
    try:
        import django_auth_ldap  # noqa: F401
        import ldap  # noqa: F401
    except ImportError as exc:
        return f"LDAP sign-in is not installed ({exc}): pip install -r requirements-ldap.txt"
    absent = [name for name in ("slapd", "slapadd", "ldapmodify") if not _tool(name)]
    if absent:
        return f"{', '.join(absent)} not found: apt install slapd ldap-utils"
    return None


@dataclass
class Directory:
    uri: str

    def modify(self, ldif: str) -> None:
        """Change the directory over the network, as its admins would: ldapmodify."""
        done = subprocess.run(
            [_tool("ldapmodify"), "-x", "-H", self.uri, "-D", ADMIN_DN, "-w", ADMIN_PASSWORD],
            input=ldif,
            text=True,
            capture_output=True,
        )
        assert done.returncode == 0, f"ldapmodify failed: {done.stderr}"

    def move(self, who: str, *, out_of: tuple[str, ...] = (), into: tuple[str, ...] = ()) -> None:
        member = f"member: uid={who},{PEOPLE}"
        changes = [f"dn: cn={g},{GROUPS}\nchangetype: modify\ndelete: member\n{member}\n" for g in out_of]
        changes += [f"dn: cn={g},{GROUPS}\nchangetype: modify\nadd: member\n{member}\n" for g in into]
        self.modify("\n".join(changes))


def _listens(proc: subprocess.Popen, port: int) -> bool:
    """The unreaped child `proc` (so its pid is still ours) listens on 127.0.0.1:`port`."""
    try:
        found = psutil.Process(proc.pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in found)


@pytest.fixture(scope="session")
def directory(tmp_path_factory) -> Iterator[Directory]:
    """slapd with tests/ldap/directory.ldif, loaded offline with slapadd, for the whole session."""
    reason = _missing()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI (.ci/run) installs it, so this is a broken set-up, not a skip")
        pytest.skip(reason)
    import ldap

    root = tmp_path_factory.mktemp("slapd")
    (root / "data").mkdir()
    config = root / "slapd.conf"
    config.write_text((HERE / "slapd.conf").read_text().replace("{dir}", str(root)))
    subprocess.run(
        [_tool("slapadd"), "-f", config, "-l", HERE / "directory.ldif"], check=True, capture_output=True
    )
    port = free_port()
    uri = f"ldap://127.0.0.1:{port}"
    log = root / "slapd.log"
    with log.open("w") as out:
        proc = subprocess.Popen([_tool("slapd"), "-f", config, "-h", f"{uri}/", "-d", "0"], stderr=out)
    try:
        deadline = time.monotonic() + 10
        # Ours, listening: another test process's slapd may have taken the port free_port() gave
        # up (same directory, same password: its answer alone proves nothing).
        while not _listens(proc, port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"slapd did not start on port {port}: {log.read_text()}")
            time.sleep(0.02)
        connection = ldap.initialize(uri)
        connection.simple_bind_s(BIND_DN, BIND_PASSWORD)
        connection.unbind_s()
        yield Directory(uri)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def ldap_on(settings, monkeypatch, directory, tmp_path, team) -> Callable[..., None]:
    """The portal configured for the directory from LDAP_* variables, through settings.py's own
    reader; the bind password comes from a file. Call it again to change variables.
    `team` is Vision Lab, which exists; NLP Lab does not yet."""
    secret = tmp_path / "ldap-bind-password"
    secret.write_text(BIND_PASSWORD + "\n")

    def configure(**env: str) -> None:
        variables = {
            "LDAP_SERVER_URI": directory.uri,
            "LDAP_BIND_DN": BIND_DN,
            "LDAP_BIND_PASSWORD_FILE": str(secret),
            "LDAP_USER_SEARCH_BASE": PEOPLE,
            "LDAP_GROUP_SEARCH_BASE": GROUPS,
            "IDENTITY_GROUP_TEAMS": MAPPING,
            "IDENTITY_ADMIN_GROUPS": "lab-admins",
            **env,
        }
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        for name, value in ldap_settings_from_env().items():
            setattr(settings, name, value)
        settings.IDENTITY_GROUP_TEAMS = parse_group_teams(variables["IDENTITY_GROUP_TEAMS"])
        settings.IDENTITY_ADMIN_GROUPS = env_group_names("IDENTITY_ADMIN_GROUPS")
        settings.AUTHENTICATION_BACKENDS = with_backend(settings, "portal.ldap.LDAPBackend")

    configure()
    return configure


@pytest.fixture
def sign_in(rf) -> Callable[[str, str], object]:
    """django.contrib.auth.authenticate, as the login form and the token endpoint call it."""

    def sign_in(username: str, password: str):
        return authenticate(rf.post("/login/"), username=username, password=password)

    return sign_in


def test_first_sign_in_through_the_form_creates_the_person_their_teams_and_unix_account(
    client, ldap_on, team
):
    response = client.post(reverse("login"), {"username": "alice", "password": "alice-pw"})

    assert response.status_code == 302 and response.url == reverse("dashboard")
    alice = User.objects.get(username="alice")
    assert int(client.session["_auth_user_id"]) == alice.pk
    assert (alice.first_name, alice.last_name, alice.email) == ("Alice", "Liddell", "alice@lab.example")
    assert not alice.has_usable_password()
    assert not alice.is_staff
    # vision-lab → member of the existing Vision Lab; nlp-lab-pi → leader of NLP Lab, created now;
    # coffee-club is mapped to nothing.
    assert roles(alice) == {"vision-lab": MEMBER, "nlp-lab": LEADER}
    assert Team.objects.get(slug="nlp-lab").name == "Nlp Lab"
    assert Team.objects.count() == 2
    assert alice.profile.unix_account == "alice"
    joined = AuditEntry.objects.filter(action=AuditEntry.Action.IDENTITY_SYNC, team=team).get()
    assert joined.message == "alice joined Vision Lab as member: group vision-lab (LDAP)"
    assert joined.actor is None and joined.data["by"] == "portal"


def test_later_sign_ins_keep_memberships_in_step_with_the_directory(ldap_on, directory, sign_in, team):
    dave = sign_in("dave", "dave-pw")
    assert roles(dave) == {"vision-lab": MEMBER, "nlp-lab": LEADER}
    reading = TeamFactory(slug="reading-group", name="Reading Group")
    MembershipFactory(user=dave, team=reading)
    Membership.objects.filter(user=dave, team=team).update(max_cards=2)

    directory.move("dave", out_of=("vision-lab", "nlp-lab-pi"), into=("vision-lab-pi",))
    try:
        assert sign_in("dave", "dave-pw") == dave
        # Leader of Vision Lab now, with the limits his leader set; out of NLP Lab; the team the
        # mapping does not name is his still.
        assert roles(dave) == {"vision-lab": LEADER, "reading-group": MEMBER}
        assert Membership.objects.get(user=dave, team=team).max_cards == 2
        messages = set(AuditEntry.objects.filter(team__isnull=False).values_list("message", flat=True))
        assert "dave is now leader of Vision Lab, was member: group vision-lab-pi (LDAP)" in messages
        assert "dave left Nlp Lab: in no group for it now (LDAP)" in messages
    finally:
        directory.move("dave", out_of=("vision-lab-pi",), into=("vision-lab", "nlp-lab-pi"))


def test_the_admin_group_makes_admins_and_leaving_it_unmakes_them(ldap_on, directory, sign_in):
    bob = sign_in("bob", "bob-pw")
    assert bob.is_staff and bob.is_superuser
    directory.move("bob", out_of=("lab-admins",))
    try:
        bob = sign_in("bob", "bob-pw")
        bob.refresh_from_db()
        assert not bob.is_staff and not bob.is_superuser
        assert roles(bob) == {"vision-lab": MEMBER}
    finally:
        directory.move("bob", into=("lab-admins",))


def test_a_wrong_password_is_refused_and_creates_nobody(client, ldap_on):
    response = client.post(reverse("login"), {"username": "alice", "password": "not-alice-pw"})
    assert response.status_code == 200
    assert "Please enter a correct username and password" in response.content.decode()
    assert not User.objects.filter(username="alice").exists()


def test_local_accounts_still_sign_in_beside_ldap(client, ldap_on):
    UserFactory(username="localadmin")  # password "password", unknown to the directory
    response = client.post(reverse("login"), {"username": "localadmin", "password": "password"})
    assert response.status_code == 302 and response.url == reverse("dashboard")


def test_an_unmapped_group_gives_nothing(ldap_on, sign_in):
    carol = sign_in("cwong", "carol-pw")
    assert roles(carol) == {}
    assert not carol.is_staff
    assert list(Team.objects.values_list("slug", flat=True)) == ["vision-lab"]
    assert carol.profile.unix_account == "cwong"


def test_people_can_sign_in_by_mail_with_their_unix_account_from_uid(ldap_on, sign_in):
    ldap_on(LDAP_USER_FILTER="(mail=%(user)s)")
    carol = sign_in("Carol@lab.example", "carol-pw")
    assert carol.username == "cwong"  # her entry's uid, not what she typed
    assert carol.profile.unix_account == "cwong"


def test_a_unix_account_attribute_that_is_no_posix_name_is_ignored(ldap_on, sign_in, caplog):
    ldap_on(LDAP_UNIX_ACCOUNT_ATTR="cn")  # "Carol Wong"
    Profile.objects.create(user=sign_in("cwong", "carol-pw"), unix_account="carolw")
    with caplog.at_level(logging.WARNING, logger="portal.identity"):
        carol = sign_in("cwong", "carol-pw")
    assert Profile.objects.get(user=carol).unix_account == "carolw"
    assert "the Unix account 'Carol Wong', which is not a POSIX user name" in caplog.text


def test_a_unix_account_attribute_not_trusted_only_awaits_an_admin(ldap_on, sign_in, settings):
    settings.LDAP_UNIX_ACCOUNT_TRUSTED = False  # people may edit it in this directory
    alice = sign_in("alice", "alice-pw")
    assert unix_account_name(alice) is None
    assert users_by_unix_name(["alice"]) == {}
    profile = Profile.objects.get(user=alice)
    assert (profile.unix_account, profile.unix_account_claim) == (None, "alice")
    assert AuditEntry.objects.filter(
        message="alice claims the Unix account alice, awaiting an admin to confirm it (LDAP)"
    ).exists()


def test_the_directorys_username_stands_in_for_a_missing_unix_account(ldap_on, sign_in):
    ldap_on(LDAP_UNIX_ACCOUNT_ATTR="employeeNumber")  # in no entry
    alice = sign_in("alice", "alice-pw")
    assert not Profile.objects.filter(user=alice).exists()
    assert unix_account_name(alice) == "alice"
    assert users_by_unix_name(["alice"]) == {"alice": alice.pk}


def test_posix_groups_map_to_teams_too(ldap_on, sign_in):
    ldap_on(LDAP_GROUP_TYPE="posixGroup", LDAP_GROUP_SEARCH_BASE="ou=posixgroups,dc=lab,dc=example")
    assert roles(sign_in("alice", "alice-pw")) == {"vision-lab": MEMBER}


def test_a_deactivated_account_is_signed_out_and_cannot_sign_in_again(client, ldap_on, sign_in):
    client.post(reverse("login"), {"username": "alice", "password": "alice-pw"})
    assert client.get(reverse("profile")).status_code == 200
    User.objects.filter(username="alice").update(is_active=False)

    assert client.get(reverse("profile")).status_code == 302
    assert sign_in("alice", "alice-pw") is None


def test_the_username_is_the_entrys_lower_cased(ldap_on, directory, sign_in):
    alice = sign_in("Alice", "alice-pw")
    assert alice.username == "alice"
    assert sign_in(" alice", "alice-pw") == alice
    link = ExternalAccount.objects.get(user=alice)
    assert (link.source, link.issuer, link.subject) == ("ldap", directory.uri, f"uid=alice,{PEOPLE}")
    assert User.objects.count() == 1


def test_it_never_takes_over_a_local_admin_or_password_account(client, ldap_on, sign_in, settings):
    bob = UserFactory(username="bob", is_staff=True, is_superuser=True)
    alice = UserFactory(username="alice")  # a local account with a password
    settings.IDENTITY_LINK_LOCAL_ACCOUNTS = False
    assert sign_in("bob", "bob-pw") is None
    response = client.post(reverse("login"), {"username": "alice", "password": "alice-pw"})
    assert response.status_code == 200
    assert "An account named alice already exists here; ask an admin to link it." in response.content.decode()
    assert not ExternalAccount.objects.exists()

    settings.IDENTITY_LINK_LOCAL_ACCOUNTS = True
    assert sign_in("bob", "bob-pw") is None  # an admin: never linked on a name
    assert sign_in("alice", "alice-pw") == alice
    alice.refresh_from_db()
    assert not alice.has_usable_password()
    assert list(ExternalAccount.objects.values_list("user", flat=True)) == [alice.pk]
    assert bob.has_usable_password()


def test_an_admin_links_an_account_by_hand(ldap_on, directory, sign_in):
    bob = UserFactory(username="bob", is_staff=True, is_superuser=True)
    ExternalAccount.objects.create(user=bob, source="ldap", issuer=directory.uri, subject=f"uid=bob,{PEOPLE}")
    assert sign_in("bob", "bob-pw") == bob


# Names OpenLDAP's own matching (caseIgnoreMatch) takes for uid=alice.
VARIANTS = [
    "\uff41\uff4c\uff49\uff43\uff45",  # ａｌｉｃｅ, full width
    "\uff21\uff2c\uff29\uff23\uff25",  # ＡＬＩＣＥ
    "al\u0130ce",  # alİce: a capital I with a dot, which lower() makes "i" + a combining dot
    "\u00aalice",  # ªlice: the feminine ordinal, NFKC's "a"
    "\u24d0lice",  # ⓐlice: a circled a
]


@pytest.mark.parametrize("name", VARIANTS)
def test_the_directory_takes_width_and_compatibility_variants_of_a_name(ldap_on, sign_in, name):
    assert sign_in(name, "alice-pw").username == "alice"


def test_the_sign_in_lock_counts_every_variant_the_directory_matches_as_one(ldap_on, settings):
    """Ten tries at alice's password in all: spread over names the directory takes for hers,
    they still lock her account, from every address and under every one of those names."""

    def token(name: str, password: str, n: int) -> int:
        address = f"192.0.2.{n}"
        body = {"username": name, "password": password}
        return APIClient().post(reverse("api_token"), body, format="json", REMOTE_ADDR=address).status_code

    for n in range(settings.AXES_FAILURE_LIMIT):
        assert token(VARIANTS[n % len(VARIANTS)], "wrong", n) in (400, 429)
    assert token("alice", "alice-pw", 100) == 429
    assert token(VARIANTS[0], "alice-pw", 101) == 429


@pytest.mark.parametrize(
    ("uri", "warned"),
    [
        ("ldap://ldap.lab.example", True),
        ("ldap://127.0.0.1:3389", False),
        ("ldaps://ldap.lab.example", False),
    ],
)
def test_it_warns_of_passwords_sent_in_clear(monkeypatch, caplog, uri, warned):
    pytest.importorskip("django_auth_ldap")
    monkeypatch.setenv("LDAP_SERVER_URI", uri)
    monkeypatch.setenv("LDAP_USER_SEARCH_BASE", PEOPLE)
    monkeypatch.setenv("LDAP_GROUP_SEARCH_BASE", GROUPS)
    with caplog.at_level(logging.WARNING, logger="portal.identity_env"):
        ldap_settings_from_env()
    assert ("sends its password in clear" in caplog.text) is warned
