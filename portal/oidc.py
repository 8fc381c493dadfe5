"""Single sign-on through an OpenID Connect provider (mozilla-django-oidc), configured in
settings.py from OIDC_* variables (portal.identity_env.oidc_settings_from_env; docs/identity.md).

The provider's endpoints come from its discovery document, <OIDC_ISSUER>/.well-known/
openid-configuration, read once per process when the first person signs in this way: a provider
that is down at start-up never stops the portal, nor local and LDAP sign-ins.

People are found by the provider's subject (`sub`), which never changes and is never reused
(portal.identity.external_account_link). The username claim (OIDC_USERNAME_CLAIM) only names a
new user, or an existing account it may link on a first sign-in; e-mail is never used, as a
provider may let people set it themselves.
"""

from __future__ import annotations

import logging

import jwt
import requests
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.exceptions import SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import path
from django.views.generic import View
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.utils import import_from_settings
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from portal.identity import (
    ActiveUsersOnly,
    ExternalAccountRefused,
    external_account_link,
    identity_sync,
    signin_refusal_show,
)

logger = logging.getLogger(__name__)

# mozilla-django-oidc's endpoint settings, and where discovery names each.
_ENDPOINTS = {
    "OIDC_OP_AUTHORIZATION_ENDPOINT": "authorization_endpoint",
    "OIDC_OP_TOKEN_ENDPOINT": "token_endpoint",
    "OIDC_OP_USER_ENDPOINT": "userinfo_endpoint",
    "OIDC_OP_JWKS_ENDPOINT": "jwks_uri",
}
_REQUIRED = ("authorization_endpoint", "token_endpoint", "jwks_uri")
# Per process, by design, and safe to keep so: keyed by the issuer (a changed OIDC_ISSUER, or a
# test's own, is a new key, never a stale answer), holding only a document that was read and
# checked (a failure is never kept), written once per key with the same value by whichever thread
# gets there first. What it holds, the provider's endpoint URLs, stays put for the provider's life
# (its signing keys rotate behind the same jwks_uri, which mozilla-django-oidc fetches itself); a
# provider that moves them is a new configuration, read again after a restart.
_discovered: dict[str, dict[str, str | None]] = {}


class OIDCUnavailable(Exception):
    """The provider's discovery document cannot be read or makes no sense."""


def oidc_endpoints(issuer: str) -> dict[str, str | None]:
    """mozilla-django-oidc's endpoint settings for this issuer, discovered once per process.
    A failure is not remembered: the next sign-in tries again."""
    if issuer in _discovered:
        return _discovered[issuer]
    url = f"{issuer}/.well-known/openid-configuration"
    try:
        response = requests.get(url, timeout=settings.OIDC_TIMEOUT)
        response.raise_for_status()
        document = response.json()
    except (requests.RequestException, ValueError) as exc:
        raise OIDCUnavailable(f"cannot read {url}: {exc}") from exc
    if not isinstance(document, dict) or str(document.get("issuer", "")).rstrip("/") != issuer:
        found = document.get("issuer") if isinstance(document, dict) else None
        raise OIDCUnavailable(f"{url} names the issuer {found!r}: set OIDC_ISSUER to it")
    missing = [key for key in _REQUIRED if not document.get(key)]
    if missing:
        raise OIDCUnavailable(f"{url} gives no {', '.join(missing)}")
    _discovered[issuer] = {setting: document.get(key) for setting, key in _ENDPOINTS.items()}
    return _discovered[issuer]


def oidc_setting(attr: str, *default: object) -> object:
    """mozilla-django-oidc's get_settings: the endpoints from discovery, the rest from settings."""
    if attr in _ENDPOINTS:
        return oidc_endpoints(settings.OIDC_ISSUER)[attr]
    return import_from_settings(attr, *default)


def sign_in_options(request: HttpRequest) -> dict[str, str]:
    """Context processor: the login page's "Sign in with <lab>" button, when OIDC is configured."""
    return {"oidc_lab_name": settings.OIDC_LAB_NAME} if settings.OIDC_ISSUER else {}


class OIDCBackend(ActiveUsersOnly, OIDCAuthenticationBackend):
    get_settings = staticmethod(oidc_setting)

    def __init__(self, *args: object, **kwargs: object) -> None:
        # mozilla-django-oidc reads every endpoint here, and Django builds each backend for every
        # password sign-in too: discovery waits until someone actually signs in this way.
        self.UserModel = get_user_model()

    def authenticate(self, request, **kwargs):  # type: ignore[no-untyped-def]
        # Only the callback view passes a nonce: a password sign-in never reaches the provider.
        if request is None or "nonce" not in kwargs:
            return None
        try:
            super().__init__()
            return super().authenticate(request, **kwargs)
        except (OIDCUnavailable, requests.RequestException) as exc:
            logger.error("single sign-on failed: %s", exc)
            return None

    def retrieve_matching_jwk(self, token):  # type: ignore[no-untyped-def]
        """The key that signed the ID token. A provider with one signing key may leave "kid" out
        of its tokens (RFC 7515 allows it), where mozilla-django-oidc fails: take that one key."""
        header = jwt.get_unverified_header(token)
        if "kid" in header:
            return super().retrieve_matching_jwk(token)
        response = requests.get(self.OIDC_OP_JWKS_ENDPOINT, timeout=settings.OIDC_TIMEOUT)
        response.raise_for_status()
        keys = [
            key
            for key in response.json().get("keys", [])
            if key.get("use", "sig") == "sig" and key.get("alg", header.get("alg")) == header.get("alg")
        ]
        if len(keys) != 1:
            raise SuspiciousOperation("the ID token names no key (kid) and the provider has several")
        return jwt.PyJWK(keys[0])

    def get_userinfo(self, access_token, id_token, payload):  # type: ignore[no-untyped-def]
        """The ID token's claims, with the userinfo endpoint's over them: some providers put
        the groups only in the one, some only in the other. mozilla-django-oidc checks the
        token's signature and nonce; its issuer and audience are checked here."""
        audience = payload.get("aud")
        audience = audience if isinstance(audience, list) else [audience]
        if str(payload.get("iss", "")).rstrip("/") != settings.OIDC_ISSUER:
            raise SuspiciousOperation(f"the ID token's issuer is {payload.get('iss')!r}, not OIDC_ISSUER")
        if settings.OIDC_RP_CLIENT_ID not in audience:
            raise SuspiciousOperation(f"the ID token is for {audience!r}, not OIDC_CLIENT_ID")
        if not self.OIDC_OP_USER_ENDPOINT:
            return dict(payload)
        userinfo = super().get_userinfo(access_token, id_token, payload)
        if userinfo.get("sub") != payload.get("sub"):
            raise SuspiciousOperation("the userinfo endpoint answered for another subject")
        return {**payload, **userinfo}

    def get_or_create_user(self, access_token, id_token, payload):  # type: ignore[no-untyped-def]
        """The user linked to the ID token's subject, else linked or created by the username
        claim (portal.identity.external_account_link), then updated from the claims. In place of
        mozilla-django-oidc's match by e-mail, or by a username its provider's users may pick."""
        claims = self.get_userinfo(access_token, id_token, payload)
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject:
            raise SuspiciousOperation("the ID token names no subject (sub)")
        try:
            user = external_account_link(
                source="oidc",
                issuer=settings.OIDC_ISSUER,
                subject=subject,
                username=claims.get(settings.OIDC_USERNAME_CLAIM),
            )
        except ExternalAccountRefused as exc:
            signin_refusal_show(self.request, str(exc))
            return None
        return self.update_user(user, claims)

    def update_user(self, user, claims):  # type: ignore[no-untyped-def]
        changed = []
        fields = {"first_name": "given_name", "last_name": "family_name"}
        if claims.get("email_verified") is not False:
            fields["email"] = "email"
        for field, claim in fields.items():
            value = claims.get(claim)
            if isinstance(value, str) and value and getattr(user, field) != value:
                setattr(user, field, value)
                changed.append(field)
        if changed:
            user.save(update_fields=changed)
        unix_claim = settings.OIDC_UNIX_ACCOUNT_CLAIM
        unix_account = claims.get(unix_claim) if unix_claim else None
        identity_sync(
            user=user,
            groups=self._groups(claims),
            unix_account=unix_account if isinstance(unix_account, str) else None,
            source="oidc",
        )
        return user

    def _groups(self, claims: dict) -> list[str]:
        """The groups claim's values. A missing claim means no groups, so that someone removed
        from every group loses their teams even where the provider then leaves the claim out."""
        value = claims.get(settings.OIDC_GROUPS_CLAIM)
        if isinstance(value, str):
            return [value]
        if isinstance(value, list):
            return [group for group in value if isinstance(group, str)]
        if settings.IDENTITY_GROUP_TEAMS or settings.IDENTITY_ADMIN_GROUPS:
            logger.warning(
                "single sign-on: no groups claim %r (OIDC_GROUPS_CLAIM) for %r: in no group",
                settings.OIDC_GROUPS_CLAIM,
                claims.get("sub"),
            )
        return []


class OIDCAuthenticateView(OIDCAuthenticationRequestView):
    """Sends the browser to the provider (404 without OIDC)."""

    get_settings = staticmethod(oidc_setting)

    def __init__(self, **kwargs: object) -> None:
        View.__init__(self, **kwargs)  # the parent reads the endpoints here: they wait for get()

    def get(self, request: HttpRequest) -> HttpResponse:
        if not settings.OIDC_ISSUER:
            raise Http404("single sign-on is not configured")
        try:
            self.OIDC_OP_AUTH_ENDPOINT = self.get_settings("OIDC_OP_AUTHORIZATION_ENDPOINT")
        except OIDCUnavailable as exc:
            logger.error("single sign-on unavailable: %s", exc)
            messages.error(
                request, f"Sign-in with {settings.OIDC_LAB_NAME} is unavailable right now; try again later."
            )
            return redirect(settings.LOGIN_URL)
        self.OIDC_RP_CLIENT_ID = self.get_settings("OIDC_RP_CLIENT_ID")
        return super().get(request)


class OIDCCallbackView(OIDCAuthenticationCallbackView):
    """Where the provider sends the browser back with a code; signs the person in."""

    get_settings = staticmethod(oidc_setting)

    def get(self, request: HttpRequest) -> HttpResponse:
        if not settings.OIDC_ISSUER:
            raise Http404("single sign-on is not configured")
        return super().get(request)

    def login_failure(self) -> HttpResponse:
        if not getattr(self.request, "signin_refused", False):  # else the backend said why
            messages.error(
                self.request,
                f"Sign-in with {settings.OIDC_LAB_NAME} failed. Try again, or ask an admin if it keeps "
                "failing.",
            )
        return redirect(settings.LOGIN_URL)


# Included at oidc/ by portal.urls; the names are mozilla-django-oidc's own.
urlpatterns = [
    path("authenticate/", OIDCAuthenticateView.as_view(), name="oidc_authentication_init"),
    path("callback/", OIDCCallbackView.as_view(), name="oidc_authentication_callback"),
]
