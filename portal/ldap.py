"""Sign-in against LDAP / Active Directory (django-auth-ldap), configured in settings.py from
LDAP_* variables (portal.identity_env.ldap_settings_from_env; docs/identity.md).

django-auth-ldap binds as the person, creates or updates their Django user; this backend then
hands their groups and Unix account to portal.identity.identity_sync.
"""

from __future__ import annotations

import logging

import ldap
from django.conf import settings
from django_auth_ldap import backend

from portal.identity import identity_sync

logger = logging.getLogger(__name__)


class LDAPBackend(backend.LDAPBackend):
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

    def get_user(self, user_id):  # type: ignore[no-untyped-def]
        # Each request's user: a deactivated one is signed out, as Django's own backend does.
        user = super().get_user(user_id)
        return user if user is not None and user.is_active else None
