"""Unix accounts from before LDAP_UNIX_ACCOUNT_TRUSTED and OIDC_UNIX_ACCOUNT_TRUSTED (0011): what a
source not trusted for them gave is held for an admin to confirm, as a sign-in now would hold it
(portal.identity; docs/identity.md, "Upgrading").

1. A Unix account such a source set (the audit entry "…'s Unix account is now X" of an
   identity.sync from it) moves to Profile.unix_account_claim. A later sign-in giving the same
   value changes nothing, so without this it would stay trusted for good.
2. A user such a sign-in created before 0010 has no ExternalAccount until their next sign-in, so
   their username stood in for a Unix account: it is held as their claim, which stops that
   (portal.accounts.users_by_unix_name).

Which sources are trusted is read from the settings at migration time. Backwards it changes
nothing: an admin confirms a claim in the admin.
"""

import re

from django.conf import settings
from django.db import migrations

MIGRATION = "0013_hold_untrusted_unix_accounts"
SOURCES = {"ldap": "LDAP_UNIX_ACCOUNT_TRUSTED", "oidc": "OIDC_UNIX_ACCOUNT_TRUSTED"}
LABELS = {"ldap": "LDAP", "oidc": "single sign-on"}
IDENTITY_SYNC = "identity.sync"
# portal.identity.unix_account_valid as it is now: a migration keeps its own copy.
_UNIX_ACCOUNT = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,31}")


def _valid(name: str) -> bool:
    return bool(_UNIX_ACCOUNT.fullmatch(name)) and not name.isdigit()


def _history(AuditEntry, db: str) -> tuple[dict[str, list[tuple[str | None, str]]], dict[str, set[str]]]:
    """From the identity.sync audit entries, oldest first: {username: [(source, Unix account)]},
    each time a sign-in set a Unix account (source) or an admin confirmed a claim (None); and
    {username: the sources that wrote anything about them}. portal.identity's entries name the
    person as "user <username>"; the "set" ones carry the new account and what it "was", and no
    "refused" or "claim" (those left it as it was)."""
    sets: dict[str, list[tuple[str | None, str]]] = {}
    sources: dict[str, set[str]] = {}
    entries = (
        AuditEntry.objects.using(db)
        .filter(action=IDENTITY_SYNC, target__startswith="user ")
        .order_by("at", "pk")
        .values_list("target", "data")
    )
    for target, data in entries.iterator():
        if not isinstance(data, dict):
            continue
        username = target.removeprefix("user ")
        source = data.get("source")
        if source in SOURCES:
            sources.setdefault(username, set()).add(source)
        account = data.get("unix_account")
        if not account or not isinstance(account, str):
            continue
        if data.get("confirmed") is True:
            sets.setdefault(username, []).append((None, account))
        elif source in SOURCES and "was" in data and "refused" not in data and "claim" not in data:
            sets.setdefault(username, []).append((source, account))
    return sets, sources


def hold_untrusted_unix_accounts(apps, schema_editor) -> None:
    untrusted = {source for source, setting in SOURCES.items() if not getattr(settings, setting)}
    if not untrusted:
        return
    db = schema_editor.connection.alias
    User = apps.get_model(settings.AUTH_USER_MODEL)
    Profile = apps.get_model("portal", "Profile")
    AuditEntry = apps.get_model("portal", "AuditEntry")
    ExternalAccount = apps.get_model("portal", "ExternalAccount")
    sets, sources = _history(AuditEntry, db)

    def audit(username: str, source: str, message: str, **data: object) -> None:
        label = LABELS[source]
        AuditEntry.objects.using(db).create(
            actor=None,
            action=IDENTITY_SYNC,
            target=f"user {username}",
            message=f"{message} ({label})",
            data={"by": "portal", "source": source, "migration": MIGRATION, **data},
        )

    # 1. Set by an untrusted source: the last word on the account they have now is its.
    bound_to_trusted = ExternalAccount.objects.using(db).exclude(source__in=untrusted).values("user_id")
    profiles = (
        Profile.objects.using(db)
        .select_related("user")
        .filter(unix_account__isnull=False)
        .exclude(unix_account="")
        .exclude(user_id__in=bound_to_trusted)
    )
    for profile in list(profiles):
        username, account = profile.user.username, profile.unix_account
        history = sets.get(username, [])
        last = next((source for source, name in reversed(history) if name == account), None)
        if last not in untrusted:
            continue  # never set by a sign-in, set by a trusted one, or confirmed by an admin
        # A claim held since 0011 is the directory's latest word: it stays.
        old_claim = profile.unix_account_claim
        profile.unix_account, profile.unix_account_claim = None, old_claim or account
        profile.save(update_fields=["unix_account", "unix_account_claim"])
        audit(
            username,
            last,
            f"{username}'s Unix account {account}, set by {LABELS[last]}, which is not trusted for"
            f" it now ({SOURCES[last]}), is only claimed, awaiting an admin to confirm it",
            unix_account=None,
            claim=profile.unix_account_claim,
            was_claim=old_claim,
            held=account,
        )

    # 2. Made by an untrusted sign-in before 0010 and never bound since: the username it gave.
    users = (
        User.objects.using(db)
        .filter(password__startswith="!", is_staff=False, is_superuser=False)
        .exclude(pk__in=ExternalAccount.objects.using(db).values("user_id"))
        .exclude(profile__unix_account__isnull=False)
        .exclude(profile__unix_account_claim__isnull=False)
    )
    for user in list(users):
        source = min(sources.get(user.username, set()) & untrusted, default=None)
        if source is None or not _valid(user.username):
            continue
        Profile.objects.using(db).update_or_create(
            user_id=user.pk, defaults={"unix_account_claim": user.username}
        )
        audit(
            user.username,
            source,
            f"{user.username} claims the Unix account {user.username} by their username, awaiting"
            f" an admin to confirm it: a {LABELS[source]} sign-in made the account before"
            f" {SOURCES[source]} (off)",
            unix_account=None,
            claim=user.username,
            was_claim=None,
        )


class Migration(migrations.Migration):
    dependencies = [
        ("portal", "0012_audit_job_cancel"),
    ]

    operations = [
        migrations.RunPython(hold_untrusted_unix_accounts, migrations.RunPython.noop),
    ]
