"""Sign-in against LDAP / Active Directory (django-auth-ldap), configured in settings.py from
LDAP_* variables (portal.identity_env.ldap_settings_from_env; docs/identity.md).

django-auth-ldap binds as the person; their portal user is the one linked to their entry's DN
(portal.identity.external_account_link), found or linked here in place of django-auth-ldap's
case-insensitive match on the typed name. django-auth-ldap then updates the user from the entry;
this backend hands their groups and Unix account to portal.identity.identity_sync.
"""

from __future__ import annotations

import logging

import ldap
from django.conf import settings
from django_auth_ldap import backend

from portal.identity import (
    ActiveUsersOnly,
    ExternalAccountRefused,
    external_account_link,
    identity_sync,
    signin_refusal_show,
)

logger = logging.getLogger(__name__)


class LDAPBackend(ActiveUsersOnly, backend.LDAPBackend):
    _request = None

    def authenticate(self, request, username=None, password=None, **kwargs):  # type: ignore[no-untyped-def]
        # Django builds a backend for each authenticate(): the request is this sign-in's, kept
        # for the login page's message when get_or_build_user refuses the link.
        self._request = request
        return super().authenticate(request, username=username, password=password, **kwargs)

    def ldap_to_django_username(self, username):  # type: ignore[no-untyped-def]
        # Only django-auth-ldap's log lines use it: get_or_build_user names users by their entry.
        return username.lower()

    def get_or_build_user(self, username, ldap_user):  # type: ignore[no-untyped-def]
        """The user linked to the entry's DN, else linked or created by the entry's username
        attribute (LDAP_USERNAME_ATTR), not the typed name: "Alice" and "alice" are one person."""
        values = [str(v) for v in (ldap_user.attrs or {}).get(settings.LDAP_USERNAME_ATTR) or []]
        # A multi-valued uid: the value they typed, else the first.
        typed = [v for v in values if v.lower() == username.lower()]
        try:
            user = external_account_link(
                source="ldap",
                issuer=self.settings.SERVER_URI,
                subject=ldap_user.dn,
                username=(typed or values or [None])[0],
            )
        except ExternalAccountRefused as exc:
            signin_refusal_show(self._request, str(exc))
            raise ldap_user.AuthenticationFailed(str(exc)) from exc
        # Never "built": external_account_link saved it, with no usable password.
        return user, False

    def authenticate_ldap_user(self, ldap_user, password):  # type: ignore[no-untyped-def]
        user = super().authenticate_ldap_user(ldap_user, password)
        if user is None or not user.is_active:  # django-auth-ldap lets deactivated users in
            return None
        try:
            # Without a group search the directory's groups are not read: teams are left alone.
            groups = ldap_user.group_names if self.settings.GROUP_SEARCH else None
        except ldap.LDAPError as exc:
            # Signed in with stale teams, someone who left a group would keep its team.
            logger.error("LDAP: cannot read the groups of %s, sign-in refused: %s", user, exc)
            return None
        values = (ldap_user.attrs or {}).get(settings.LDAP_UNIX_ACCOUNT_ATTR) or []
        identity_sync(user=user, groups=groups, unix_account=values[0] if values else None, source="ldap")
        return user
