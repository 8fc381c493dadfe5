"""Who may use a JupyterLab, on the portal's origin and on the labs' own (docs/sessions.md, "Two
origins"): the hand-off between them, and the checks the proxy (jobs.sessions.lab_proxy) asks for.

A lab page runs its owner's code and whatever their notebooks print, so labs are served from
LAB_ORIGIN, whose host name never serves the portal and never gets the portal's cookies. Sign-in
carries over as JupyterHub's OAuth hand-off does, in four redirects the browser follows by itself:

1. the portal's `/sessions/<id>/lab/…` (the owner's running lab, checked with the portal's session
   cookie) → the same path on LAB_ORIGIN;
2. there, with no grant cookie: a random *state* in a cookie of the labs' origin (Path:
   `/sessions/<id>/`, so `lab-auth/` gets it), → the portal's `/sessions/<id>/lab-ticket/?state=…&next=…`;
3. the portal (signed in, the owner's running lab) issues a *ticket*: random, single-use, good for
   LAB_TICKET_SECONDS, for this lab, this user, this portal session and this state →
   LAB_ORIGIN `/sessions/<id>/lab-auth/?ticket=…&next=…`;
4. there the proxy redeems it (one conditional UPDATE: it works once, and is spent even when it
   is refused) if the browser holds the state it names, and sets the *grant* cookie: a fresh
   random secret, `Path=/sessions/<id>/lab/`,
   HttpOnly, SameSite=Lax (Secure on https) → `next`, a path inside that lab.

The state ties the ticket to the browser that asked for it (OAuth's `state`): all labs share one
origin, so a ticket someone else pushed into a browser would open *their* lab there, whose script
could then reach the browser's own labs. Only SHA-256 digests of tickets, states and grants are
stored (LabGrant). A grant works while the portal session it came from still exists and names its
user (signing out or a password change ends it), the user is active, and the lab is still that
user's running lab: every request and websocket asks again.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta
from importlib import import_module
from typing import Any
from urllib.parse import unquote, urlsplit

from django.conf import settings
from django.contrib.auth import (
    BACKEND_SESSION_KEY,
    HASH_SESSION_KEY,
    SESSION_KEY,
    get_user_model,
    load_backend,
)
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.crypto import constant_time_compare

from jobs.models import InteractiveSession, LabGrant, lab_path

GRANT_COOKIE = "lab_grant"  # on LAB_ORIGIN, Path=/sessions/<id>/lab/
STATE_COOKIE = "lab_state"  # on LAB_ORIGIN, Path=/sessions/<id>/
STATE_SECONDS = 15 * 60  # long enough to sign in to the portal on the way
SECRET = re.compile(r"^[A-Za-z0-9_-]{43}$")  # secrets.token_urlsafe(32), as every secret here


@dataclass(frozen=True)
class Lab:
    pk: int
    address: str
    token: str


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def lab_auth_path(pk: int) -> str:
    """Where LAB_ORIGIN redeems a ticket: beside the lab, outside Jupyter's base URL."""
    return f"/sessions/{pk}/lab-auth/"


# --- selectors ------------------------------------------------------------------------------------


def lab_for_owner(user_id: int, pk: int) -> Lab | None:
    """The lab a user may reach: their own running JupyterLab session, with its server's address,
    while its supervisor beats (within LAB_RELAY_BEAT_SECONDS, by the database's clock).

    The worker proved the listener at that address when the lab started (jobs.host.lab_listener); the
    relay cannot prove it again from another host. A lab whose supervisor stopped beating (its
    worker was killed: the lab died with it, and its port is free for any local account to bind)
    is therefore not relayed to, rather than until the reconciler marks it lost minutes later."""
    fresh = Now() - timedelta(seconds=settings.LAB_RELAY_BEAT_SECONDS)
    row = (
        InteractiveSession.objects.filter(
            pk=pk,
            owner_id=user_id,
            kind=InteractiveSession.Kind.JUPYTERLAB,
            status=InteractiveSession.Status.RUNNING,
            beat_at__gte=fresh,
        )
        .exclude(address="")
        .exclude(token="")
        .values_list("address", "token")
        .first()
    )
    return Lab(pk=pk, address=row[0], token=row[1]) if row else None


def session_user(session_key: str | None) -> Any | None:
    """The active user the portal's session names, as django.contrib.auth.get_user finds it
    (without a request: none exists here), or None. Read only: the session is never saved, so a
    fallback secret's hash is accepted here and rotated by the next page the portal serves."""
    if not session_key:
        return None
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    try:
        user_id = get_user_model()._meta.pk.to_python(session[SESSION_KEY])
        backend_path = session[BACKEND_SESSION_KEY]
    except (KeyError, ValidationError):
        return None
    if backend_path not in settings.AUTHENTICATION_BACKENDS:
        return None
    user = load_backend(backend_path).get_user(user_id)
    if user is None or not getattr(user, "is_active", False):
        return None
    return user if _hash_verified(session.get(HASH_SESSION_KEY), user) else None


def _hash_verified(session_hash: str | None, user: Any) -> bool:
    if not hasattr(user, "get_session_auth_hash"):
        return True  # as get_user: a user model without it has nothing to verify
    if not session_hash:
        return False
    if constant_time_compare(session_hash, user.get_session_auth_hash()):
        return True
    return any(constant_time_compare(session_hash, old) for old in user.get_session_auth_fallback_hash())


def lab_grant_check(secret: str | None, pk: int) -> tuple[bool, Lab | None]:
    """(whether the grant cookie still stands, the lab it opens). A grant stands while its portal
    session names its user, active; it opens the lab while that is the user's running lab."""
    if not secret or not SECRET.match(secret):
        return False, None
    row = (
        LabGrant.objects.filter(cookie_digest=digest(secret), session_id=pk)
        .values_list("user_id", "portal_session_key")
        .first()
    )
    if row is None:
        return False, None
    user = session_user(row[1])
    if user is None or user.pk != row[0]:
        return False, None
    return True, lab_for_owner(user.pk, pk)


def lab_next(pk: int, value: str | None) -> str:
    """`value` if it is a path inside lab `pk` (with its query), else the lab's own root: where a
    hand-off may send the browser, never anywhere else (no open redirect, no other lab)."""
    root = lab_path(pk)
    if not value or len(value) > 4000 or not value.startswith(root) or not value.isascii():
        return root
    if any(ord(char) < 0x21 or char in '\\"<>`' for char in value):
        return root
    parts = urlsplit(value)
    decoded = unquote(parts.path)
    if parts.scheme or parts.netloc or parts.fragment or "//" in decoded or "\\" in decoded:
        return root
    if any(segment in (".", "..") for segment in decoded.split("/")) or not decoded.startswith(root):
        return root
    return value


# --- services -------------------------------------------------------------------------------------


@transaction.atomic
def lab_ticket_issue(*, user: Any, pk: int, portal_session_key: str, state: str) -> str | None:
    """A ticket into lab `pk` for `user`, signed in with that portal session, in the browser that
    holds `state`; None (nothing written) unless it is the user's running lab.

    Also prunes what can no longer be used: tickets past their time, grants of labs not running.
    A GET on the portal mints it (step 3): someone who makes a browser fetch that gains nothing,
    as the ticket goes to that browser alone, in a redirect no other page can read."""
    if not portal_session_key or not SECRET.match(state) or lab_for_owner(user.pk, pk) is None:
        return None
    now = timezone.now()
    LabGrant.objects.filter(used_at=None, expires_at__lt=now).delete()
    LabGrant.objects.exclude(session__status=InteractiveSession.Status.RUNNING).delete()
    ticket = secrets.token_urlsafe(32)
    LabGrant.objects.create(
        session_id=pk,
        user=user,
        portal_session_key=portal_session_key,
        ticket_digest=digest(ticket),
        state_digest=digest(state),
        expires_at=now + timedelta(seconds=settings.LAB_TICKET_SECONDS),
        created_at=now,
    )
    return ticket


@transaction.atomic
def lab_ticket_redeem(*, pk: int, ticket: str, state: str | None) -> str | None:
    """The grant cookie's secret for a ticket into lab `pk` presented with the browser's `state`,
    or None: a ticket used, expired, for another lab or another browser, whose portal session has
    ended or whose lab no longer runs.

    A ticket is spent by being shown, whether it is then honoured (one conditional UPDATE: of two
    browsers racing with it one wins) or not (deleted). Script in a lab page
    can have the portal mint a ticket for a state of its own choosing (a window it opens on
    `lab-ticket/?state=…`) and read it from the refusal's address, on the labs' origin; were a
    refused ticket left standing, it would open the lab from the script's owner's browser."""
    if not SECRET.match(ticket):
        return None
    now = timezone.now()
    shown = LabGrant.objects.filter(ticket_digest=digest(ticket), used_at=None, expires_at__gt=now)
    row = shown.values_list("pk", "session_id", "user_id", "portal_session_key", "state_digest").first()
    if row is None:
        return None
    grant_pk, lab_pk, user_id, portal_session_key, state_digest = row
    user = session_user(portal_session_key)
    honoured = (
        lab_pk == pk
        and bool(state)
        and SECRET.match(state or "") is not None
        and constant_time_compare(digest(state or ""), state_digest)
        and user is not None
        and user.pk == user_id
        and lab_for_owner(user.pk, pk) is not None
    )
    unused = LabGrant.objects.filter(pk=grant_pk, used_at=None)
    if not honoured:
        unused.delete()  # spent: no second showing finds it
        return None
    secret = secrets.token_urlsafe(32)
    return secret if unused.update(used_at=now, cookie_digest=digest(secret)) else None
