"""Sign-in settings: IDENTITY_*, LDAP_* and OIDC_* read from the environment (docs/identity.md).

settings.py calls these readers before Django's app registry exists, so this module imports no
models; keeping people in step with the directory is portal.identity's.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from portal.env import ImproperlyConfiguredEnv, env_bool, env_choice, env_int, env_str

# Membership.Role's values (a test holds them equal): importable before the models are.
MEMBER, LEADER = "member", "leader"
ROLE_RANK = {MEMBER: 0, LEADER: 1}
_EXAMPLE = "e.g. vision-lab=vision-lab:member,vision-lab-pi=vision-lab:leader"
# A group "named" cn or dc is a DN split at its commas: `cn=vision-lab,ou=groups,...`.
_DN_ATTRIBUTES = {"cn", "ou", "dc", "o", "uid", "c", "l", "st"}
_SLUG = re.compile(r"[-a-zA-Z0-9_]{1,100}")
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}
# What mozilla-django-oidc verifies an ID token with: RS* and ES* against the provider's keys
# (JWKS), HS256 against the client secret. It takes every other algorithm (PS256 too) for an
# HMAC and verifies with the client secret, so every sign-in would fail.
_OIDC_ALGORITHMS = ("RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "HS256")

logger = logging.getLogger(__name__)


class LdapNotInstalled(ImproperlyConfiguredEnv):
    """LDAP_SERVER_URI is set where python-ldap or django-auth-ldap is not installed."""


@dataclass(frozen=True)
class TeamGrant:
    """What one directory group gives: a role in the team with this slug."""

    slug: str
    role: str


# {group name, casefolded: what it gives}. Group names compare without case, as LDAP's cn and
# Active Directory's names do.
GroupTeams = dict[str, tuple[TeamGrant, ...]]


# --- Reading the configuration (called by settings.py) --------------------------------------


def parse_group_teams(value: str, *, var: str = "IDENTITY_GROUP_TEAMS") -> GroupTeams:
    """`group=team-slug:role,...` → GroupTeams. The role is `member` (also when left out) or
    `leader`; a group may give roles in several teams; a group name may hold spaces."""
    grants: dict[str, list[TeamGrant]] = {}
    for raw_item in value.split(","):
        item = raw_item.strip()
        if not item:
            continue
        if item.count("=") != 1:
            raise ImproperlyConfiguredEnv(
                f"{var}: {item!r} is not group=team-slug:role ({_EXAMPLE}); name a group by its "
                "name (an LDAP group's cn), never by its DN"
            )
        group, _, grant = (part.strip() for part in item.partition("="))
        slug, _, role = (part.strip() for part in grant.partition(":"))
        role = (role or MEMBER).lower()
        if not group or not _SLUG.fullmatch(slug):
            raise ImproperlyConfiguredEnv(
                f"{var}: {item!r} is not group=team-slug:role ({_EXAMPLE}); a team slug is letters, "
                "digits, '-' and '_'"
            )
        if group.casefold() in _DN_ATTRIBUTES:
            raise ImproperlyConfiguredEnv(
                f"{var}: {item!r} reads as part of a DN; name a group by its name, its cn, e.g. "
                "vision-lab=vision-lab:member for cn=vision-lab,ou=groups,dc=lab,dc=example"
            )
        if role not in ROLE_RANK:
            raise ImproperlyConfiguredEnv(f"{var}: {item!r} gives role {role!r}; use member or leader")
        given = grants.setdefault(group.casefold(), [])
        if any(g.slug == slug for g in given):
            raise ImproperlyConfiguredEnv(
                f"{var}: group {group!r} is given team {slug!r} twice; keep one entry (leader wins)"
            )
        given.append(TeamGrant(slug=slug, role=role))
    return {group: tuple(given) for group, given in grants.items()}


def env_group_teams(name: str = "IDENTITY_GROUP_TEAMS") -> GroupTeams:
    return parse_group_teams(env_str(name, ""), var=name)


def env_group_names(name: str) -> frozenset[str]:
    """A comma-separated list of group names, casefolded."""
    return frozenset(item.strip().casefold() for item in env_str(name, "").split(",") if item.strip())


_LDAP_GROUP_FILTERS = {
    "groupofnames": "(objectClass=groupOfNames)",
    "nestedgroupofnames": "(objectClass=groupOfNames)",
    "groupofuniquenames": "(objectClass=groupOfUniqueNames)",
    "posixgroup": "(objectClass=posixGroup)",
    "activedirectory": "(objectClass=group)",
    "nestedactivedirectory": "(objectClass=group)",
}


def ldap_settings_from_env() -> dict[str, object]:
    """The AUTH_LDAP_* settings django-auth-ldap reads, and LDAP_UNIX_ACCOUNT_ATTR; nothing
    without LDAP_SERVER_URI. settings.py and the LDAP tests both build them here.

    Each step reads and checks its variables, in this order, so a wrong setup is told its first
    mistake; whether LDAP is installed comes after them (deploy/env.example is generated on
    machines without it, from what these steps read: portal/env_example.py)."""
    uri = _ldap_uri()
    if not uri:
        return {}
    user_base, user_filter = _ldap_user_search()
    start_tls = _ldap_start_tls(uri)
    ca_file = env_str("LDAP_CA_CERT_FILE", "").strip()
    if ca_file and not Path(ca_file).is_file():
        raise ImproperlyConfiguredEnv(f"LDAP_CA_CERT_FILE={ca_file!r} is not a readable file")
    timeout = env_int("LDAP_TIMEOUT_SECONDS", 10, min_value=1, max_value=120)
    username_attr = _ldap_username_attr()
    group_type, group_base, group_filter = _ldap_group_search()
    bind_dn, bind_password = env_str("LDAP_BIND_DN", "").strip(), env_str("LDAP_BIND_PASSWORD", "")
    unix_account_attr = env_str("LDAP_UNIX_ACCOUNT_ATTR", "uid").strip()
    ldap, config = _ldap_modules()

    found = {
        "AUTH_LDAP_SERVER_URI": uri,
        "AUTH_LDAP_BIND_DN": bind_dn,
        "AUTH_LDAP_BIND_PASSWORD": bind_password,
        "AUTH_LDAP_START_TLS": start_tls,
        "AUTH_LDAP_USER_SEARCH": config.LDAPSearch(user_base, ldap.SCOPE_SUBTREE, user_filter),
        # The same attributes in OpenLDAP's inetOrgPerson and in Active Directory.
        "AUTH_LDAP_USER_ATTR_MAP": {"first_name": "givenName", "last_name": "sn", "email": "mail"},
        "AUTH_LDAP_ALWAYS_UPDATE_USER": True,
        # Never cache group names: each sign-in must see the directory as it is now.
        "AUTH_LDAP_CACHE_TIMEOUT": 0,
        # Active Directory answers with referrals python-ldap cannot follow anonymously; a dead
        # server must fail a sign-in in seconds, not hang a web worker.
        "AUTH_LDAP_CONNECTION_OPTIONS": {
            ldap.OPT_REFERRALS: 0,
            ldap.OPT_NETWORK_TIMEOUT: timeout,
            ldap.OPT_TIMEOUT: timeout,
        },
        "AUTH_LDAP_GLOBAL_OPTIONS": {ldap.OPT_X_TLS_CACERTFILE: ca_file} if ca_file else {},
        "LDAP_UNIX_ACCOUNT_ATTR": unix_account_attr,
        # The portal username is this attribute of the person's entry, lower-cased, not what
        # they typed: "Alice", "alice" and alice@lab.example are one account.
        "LDAP_USERNAME_ATTR": username_attr,
    }
    if group_base:
        found.update(_ldap_group_settings(ldap, config, group_type, group_base, group_filter))
    return found


def _ldap_uri() -> str:
    """LDAP_SERVER_URI, checked; empty: no LDAP."""
    uri = env_str("LDAP_SERVER_URI", "").strip()
    if uri and not uri.startswith(("ldap://", "ldaps://", "ldapi://")):
        raise ImproperlyConfiguredEnv(
            f"LDAP_SERVER_URI={uri!r} must start with ldap://, ldaps:// or ldapi:// "
            "(e.g. ldaps://ldap.lab.example.org)"
        )
    return uri


def _ldap_modules() -> tuple[Any, Any]:
    """python-ldap and django_auth_ldap.config."""
    # python-ldap is optional (it builds against system headers): imported only when configured.
    try:
        import ldap
        from django_auth_ldap import config
    except ImportError as exc:
        raise LdapNotInstalled(
            f"LDAP_SERVER_URI is set but LDAP sign-in is not installed ({exc}): run "
            "`apt install libldap2-dev libsasl2-dev`, then `.venv/bin/pip install -r requirements-ldap.txt`"
        ) from exc
    return ldap, config


def _ldap_user_search() -> tuple[str, str]:
    """LDAP_USER_SEARCH_BASE and LDAP_USER_FILTER, checked."""
    user_base = env_str("LDAP_USER_SEARCH_BASE", "").strip()
    if not user_base:
        raise ImproperlyConfiguredEnv(
            "LDAP_SERVER_URI is set but LDAP_USER_SEARCH_BASE is empty: set it to the DN people are "
            "under, e.g. ou=people,dc=lab,dc=example"
        )
    user_filter = env_str("LDAP_USER_FILTER", "(uid=%(user)s)").strip()
    if "%(user)s" not in user_filter or not (user_filter.startswith("(") and user_filter.endswith(")")):
        raise ImproperlyConfiguredEnv(
            f"LDAP_USER_FILTER={user_filter!r} must be an LDAP filter holding %(user)s, e.g. "
            "(uid=%(user)s), or (sAMAccountName=%(user)s) for Active Directory"
        )
    return user_base, user_filter


def _ldap_start_tls(uri: str) -> bool:
    """LDAP_START_TLS, checked against the URI; a warning for passwords sent in clear."""
    start_tls = env_bool("LDAP_START_TLS", False)
    if start_tls and uri.startswith("ldaps://"):
        raise ImproperlyConfiguredEnv(
            "LDAP_START_TLS is on but LDAP_SERVER_URI is ldaps://, already TLS: use one of them"
        )
    if uri.startswith("ldap://") and not start_tls and not _ldap_on_loopback(uri):
        # Not refused: the server may be reached over a network the lab trusts.
        logger.warning(
            "LDAP_SERVER_URI=%s without LDAP_START_TLS: every LDAP sign-in sends its password in "
            "clear; use ldaps:// or LDAP_START_TLS=true",
            uri,
        )
    return start_tls


def _ldap_username_attr() -> str:
    username_attr = env_str("LDAP_USERNAME_ATTR", "uid").strip()
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", username_attr):
        raise ImproperlyConfiguredEnv(
            f"LDAP_USERNAME_ATTR={username_attr!r} must be an attribute name, e.g. uid, or "
            "sAMAccountName for Active Directory"
        )
    return username_attr


def _ldap_group_search() -> tuple[str, str, str]:
    """LDAP_GROUP_TYPE, LDAP_GROUP_SEARCH_BASE (empty: groups are never read) and
    LDAP_GROUP_FILTER, checked against what the IDENTITY_* group settings need."""
    group_type = env_choice("LDAP_GROUP_TYPE", "groupOfNames", tuple(_LDAP_GROUP_FILTERS))
    group_base = env_str("LDAP_GROUP_SEARCH_BASE", "").strip()
    group_filter = env_str("LDAP_GROUP_FILTER", _LDAP_GROUP_FILTERS[group_type]).strip()
    if not group_base and (
        env_str("IDENTITY_GROUP_TEAMS").strip() or env_str("IDENTITY_ADMIN_GROUPS").strip()
    ):
        raise ImproperlyConfiguredEnv(
            "IDENTITY_GROUP_TEAMS or IDENTITY_ADMIN_GROUPS is set but LDAP_GROUP_SEARCH_BASE is empty, "
            "so LDAP sign-ins would never read a group: set it, e.g. ou=groups,dc=lab,dc=example"
        )
    return group_type, group_base, group_filter


def oidc_settings_from_env() -> dict[str, object]:
    """The OIDC_* settings mozilla-django-oidc and portal.oidc read; nothing without OIDC_ISSUER.
    The provider's endpoints are not here: portal.oidc discovers them from the issuer."""
    issuer = env_str("OIDC_ISSUER", "").strip().rstrip("/")
    if not issuer:
        return {}
    if not issuer.startswith(("https://", "http://")):
        raise ImproperlyConfiguredEnv(
            f"OIDC_ISSUER={issuer!r} must be the provider's https:// address, e.g. "
            "https://sso.lab.example.org/realms/lab"
        )
    if issuer.startswith("http://") and urlsplit(issuer).hostname not in _LOOPBACK:
        raise ImproperlyConfiguredEnv(
            f"OIDC_ISSUER={issuer!r} must be https://: over http:// anyone on the way could change "
            "the provider's keys and endpoints and sign in as anyone (http:// is for a provider "
            "on localhost only)"
        )
    client_id = env_str("OIDC_CLIENT_ID", "").strip()
    client_secret = env_str("OIDC_CLIENT_SECRET", "").strip()
    if not client_id or not client_secret:
        raise ImproperlyConfiguredEnv(
            "OIDC_ISSUER is set: set OIDC_CLIENT_ID and OIDC_CLIENT_SECRET (or OIDC_CLIENT_SECRET_FILE), "
            "the client registered for the portal at the provider"
        )
    scopes = env_str("OIDC_SCOPES", "openid email profile").replace(",", " ").split()
    if "openid" not in scopes:
        raise ImproperlyConfiguredEnv(f"OIDC_SCOPES={' '.join(scopes)!r} must include openid")
    algorithm = env_str("OIDC_SIGN_ALGO", "RS256").strip().upper()
    if algorithm not in _OIDC_ALGORITHMS:
        raise ImproperlyConfiguredEnv(
            f"OIDC_SIGN_ALGO={algorithm.lower()!r} must be one of: {', '.join(_OIDC_ALGORITHMS)} "
            "(mozilla-django-oidc checks RS* and ES* with the provider's published keys and HS256 "
            "with the client secret; with any other, PS256 too, every sign-in would fail). Ask the "
            "provider to sign the portal's ID tokens with RS256."
        )
    return {
        "OIDC_ISSUER": issuer,
        "OIDC_RP_CLIENT_ID": client_id,
        "OIDC_RP_CLIENT_SECRET": client_secret,
        "OIDC_RP_SCOPES": " ".join(scopes),
        "OIDC_RP_SIGN_ALGO": algorithm,
        "OIDC_USE_PKCE": True,
        "OIDC_TIMEOUT": env_int("OIDC_TIMEOUT_SECONDS", 10, min_value=1, max_value=120),
        "OIDC_USERNAME_CLAIM": env_str("OIDC_USERNAME_CLAIM", "preferred_username").strip(),
        "OIDC_GROUPS_CLAIM": env_str("OIDC_GROUPS_CLAIM", "groups").strip(),
        "OIDC_UNIX_ACCOUNT_CLAIM": env_str("OIDC_UNIX_ACCOUNT_CLAIM", "").strip(),
        "OIDC_LAB_NAME": env_str("OIDC_LAB_NAME", "single sign-on").strip(),
    }


def _ldap_group_settings(
    ldap: Any, config: Any, group_type: str, group_base: str, group_filter: str
) -> dict[str, object]:
    group_types = {
        "groupofnames": config.GroupOfNamesType,
        "nestedgroupofnames": config.NestedGroupOfNamesType,
        "groupofuniquenames": config.GroupOfUniqueNamesType,
        "posixgroup": config.PosixGroupType,
        "activedirectory": config.ActiveDirectoryGroupType,
        "nestedactivedirectory": config.NestedActiveDirectoryGroupType,
    }
    return {
        "AUTH_LDAP_GROUP_SEARCH": config.LDAPSearch(group_base, ldap.SCOPE_SUBTREE, group_filter),
        "AUTH_LDAP_GROUP_TYPE": group_types[group_type](name_attr="cn"),
    }


def _ldap_on_loopback(uri: str) -> bool:
    """Every server of an ldap:// URI (it may list several) is this machine."""
    hosts = [urlsplit(part).hostname for part in uri.split()]
    return all(host in _LOOPBACK for host in hosts)
