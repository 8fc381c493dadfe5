"""`Idempotency-Key` on every change the API makes: a request sent again after its answer was lost
(a dropped connection, a proxy's timeout, the portal away for a minute) is done once, and its first
answer is sent again (the IETF httpapi draft "The Idempotency-Key HTTP Header Field").

A client sends `Idempotency-Key: <up to 255 visible ASCII characters>` with a POST, PUT, PATCH or
DELETE under /api/: a new key for each change it means to make (`gpu` sends a UUID), the same one
with each try of that change. For a signed-in user (an active API token, or a session) the portal
keeps, per user and key, what the request was (a SHA-256 of its method, path, query and body)
and the answer it got. Again with that key:

- the same request gets the first answer again, with `Idempotent-Replayed: true`;
- another request (another body or path) is refused with 422, naming the header;
- while the first is still being done, 409 (`idempotency_key_in_progress`) with Retry-After: the
  client tries again a moment later.

How, and why so: the key is claimed (its row written and committed) before the request is done,
and the answer kept after, each in a transaction of its own. The request itself runs exactly as
without a key, in its services' own transactions: a job's submit asks Slurm outside any (holding
none of SQLite's write lock meanwhile), a refused booking still tells its team. Where the portal
cannot know whether a try's change was made, it says so and never does it again: a 5xx after the
request wrote anything (a booking committed and then the database lost while its answer was read)
leaves the key "unknown", and so does a claim left without an answer past
IDEMPOTENCY_IN_PROGRESS_SECONDS (the portal stopped while doing it); a try after either gets
409 `idempotency_key_unknown`: look before doing it again, with a new key. A 5xx before any write
(a Slurm cluster that did not answer, the database away from the start) gives the key up: a try
after it is done anew.

Answers that refuse before the change is looked at (401, 403, 429: a CSRF check, a lockout) are
not kept: the same request, put right, goes through. POST /api/v1/token/ takes no key: its
answer is a secret the portal keeps only hashed, and its body a password. Keys are kept
IDEMPOTENCY_KEY_HOURS (24), then pruned (portal.tasks.prune_idempotency_keys).

Every answer under /api/ that passes here says `Idempotency-Keys: kept`, a 503 included: a client
that lost an answer sends a change again only to a portal that said so (an older one would do it
twice). A middleware, not a view's decorator, so that no change of the API can miss it; after
Django's authentication, so a session's user is known and the security headers wrap its answers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db import IntegrityError, connection, transaction
from django.db.models import BooleanField, ExpressionWrapper, Q, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from portal.api_errors import api_error_response
from portal.models import ApiToken, IdempotentRequest
from portal.outage import service_unavailable
from portal.tokens import api_token_find
from portal.unreachable import outage_of

log = logging.getLogger(__name__)

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
KEPT_HEADER = "Idempotency-Keys"
KEY_MAX = 255
CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")
# Refusals before the change is looked at: the same request, put right, must go through.
NOT_KEPT = frozenset({401, 403, 429})
# Takes no key: its answer is a new token's secret (portal/tokens.py keeps them hashed), its body a password.
UNKEYED = ("/api/v1/token/",)
WRITES = ("INSERT", "UPDATE", "DELETE")
# Writes that are no change of the user's: a token's last use (DRF's authentication), the keys' own.
NOT_CHANGES = ("portal_apitoken", "portal_idempotentrequest")


class IdempotencyMiddleware:
    """After AuthenticationMiddleware (a session's user), before the views."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith("/api/"):
            return self.get_response(request)
        key = request.headers.get(KEY_HEADER)
        try:
            response = self._answer(request, key) if key is not None and request.method in CHANGES else None
        except Exception as exc:
            # The database away while the key was read or claimed: nothing was done yet. The
            # outage's 503, answered here so that it says keys are kept.
            service = outage_of(exc)
            if service is None:
                raise
            response = service_unavailable(request, service, exc)
        if response is None:
            response = self.get_response(request)
        response.headers[KEPT_HEADER] = "kept"
        return response

    def _answer(self, request: HttpRequest, key: str) -> HttpResponse | None:
        """The answer under the key; None: no key to keep (nobody signed in), done as without one."""
        if refused := _malformed(key):
            return refused
        user_id = _user_id(request)
        if user_id is None or request.path.startswith(UNKEYED):
            return None  # DRF answers 401 (or the view takes no key): nothing to keep
        fingerprint = request_fingerprint(request)
        claimed = _claim(request, user_id, key, fingerprint)
        if isinstance(claimed, HttpResponse):
            return claimed
        wrote = WriteSeen()
        with connection.execute_wrapper(wrote):
            response = self.get_response(request)
        try:
            _keep(claimed, response, wrote.seen)
        except Exception as exc:  # the change was made and answered: its answer goes out all the same
            if outage_of(exc) is None:
                raise
            log.warning("Idempotency-Key %r: the answer was not kept (%s)", key, exc)
        return response


def _malformed(key: str) -> HttpResponse | None:
    if 1 <= len(key) <= KEY_MAX and all("!" <= c <= "~" for c in key):
        return None
    message = (
        f"give 1 to {KEY_MAX} visible ASCII characters (no spaces), a new one for each change, e.g. "
        "a UUID; send the same one only with a try of the same request."
    )
    return _refusal(message, "invalid", 400)


def _user_id(request: HttpRequest) -> int | None:
    """The signed-in user's id: an active API token's (the header DRF reads), else the session's."""
    header = request.headers.get("Authorization", "")
    if header:
        words = header.split()  # as DRF's TokenAuthentication reads it
        token = api_token_find(words[1]) if len(words) == 2 and words[0].lower() == "token" else None
        active = token is not None and token.status(timezone.now()) == ApiToken.Status.ACTIVE
        return token.user_id if active and token.user.is_active else None  # type: ignore[union-attr]
    user = getattr(request, "user", None)
    return user.pk if user is not None and user.is_authenticated else None


def _claim(
    request: HttpRequest, user_id: int, key: str, fingerprint: str
) -> IdempotentRequest | HttpResponse:
    """The key's row, written and committed before the change; or, where the key was used, its
    answer. A row past IDEMPOTENCY_KEY_HOURS that the prune has not reached yet counts as gone.
    Its times are the database's (Now()): the web servers that claim and answer a key may be
    several hosts, whose clocks are never compared."""
    for tries in range(3):  # the key given up or forgotten meanwhile: claimed again
        try:
            with transaction.atomic():
                return IdempotentRequest.objects.create(
                    user_id=user_id,
                    key=key,
                    fingerprint=fingerprint,
                    method=request.method or "",
                    path=request.path[:500],
                    created_at=Now(),
                )
        except IntegrityError:
            rows = IdempotentRequest.objects.filter(user_id=user_id, key=key)
            forgotten = rows.filter(created_at__lt=Now() - timedelta(hours=settings.IDEMPOTENCY_KEY_HOURS))
            if not forgotten.delete()[0] and (found := _with_age(rows).first()) is not None:
                return _replay(found, fingerprint)
            # else forgotten (not pruned yet), or given up meanwhile (a 5xx): claimed anew
            if tries == 2:
                raise  # not the key's clash (its user deleted meanwhile): the 500 it is
    raise AssertionError("unreachable")


class WriteSeen:
    """An execute wrapper: whether the request wrote anything of the user's (a change, made or
    rolled back: which, a 5xx cannot tell)."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        write = sql.lstrip()[:6].upper() in WRITES and not any(table in sql for table in NOT_CHANGES)
        # Outside a transaction a write commits as it runs, and its answer may be lost after:
        # seen before it is sent. Inside one, a statement that failed wrote nothing.
        autocommit = not context["connection"].in_atomic_block
        self.seen = self.seen or (write and autocommit)
        result = execute(sql, params, many, context)
        self.seen = self.seen or write
        return result


def _keep(claimed: IdempotentRequest, response: HttpResponse, wrote: bool) -> None:
    """Keep the answer with its key; give the key up where a try after this is to be done anew;
    or leave it unanswered ("unknown" at once) where whether the change was made is not known."""
    rows = IdempotentRequest.objects.filter(pk=claimed.pk)
    status = response.status_code
    if status >= 500 and wrote:
        rows.update(unknown=True)
    elif status >= 500 or status in NOT_KEPT or response.streaming:
        rows.delete()
    else:
        rows.update(
            answer_status=status,
            content_type=response.headers.get("Content-Type", "")[:200],
            content=response.content,
        )


def _with_age(rows: QuerySet[IdempotentRequest]) -> QuerySet[IdempotentRequest]:
    """Each row with `running`: claimed within IDEMPOTENCY_IN_PROGRESS_SECONDS, by the database's clock."""
    since = Now() - timedelta(seconds=settings.IDEMPOTENCY_IN_PROGRESS_SECONDS)
    return rows.annotate(running=ExpressionWrapper(Q(created_at__gt=since), output_field=BooleanField()))


def _replay(found: IdempotentRequest, fingerprint: str) -> HttpResponse:
    when = f"{found.created_at:%Y-%m-%d %H:%M:%S} UTC"
    if found.fingerprint != fingerprint:
        message = (
            f"{found.key!r} was sent with another request ({found.method} {found.path} at {when}); "
            "send a new key for a new change."
        )
        return _refusal(message, "idempotency_key_reused", 422)
    if found.answer_status == 0:
        if found.running and not found.unknown:  # type: ignore[attr-defined]
            message = (
                f"the request sent with {found.key!r} at {when} is still being done; try again in a moment."
            )
            response = _refusal(message, "idempotency_key_in_progress", 409)
            response["Retry-After"] = "1"
            return response
        message = (
            f"the request sent with {found.key!r} at {when} failed or was never answered once it had "
            "begun to write (the portal stopped, or lost its database, while doing it), so whether it "
            "was done is unknown: look before doing it again, with a new key."
        )
        return _refusal(message, "idempotency_key_unknown", 409)
    response = HttpResponse(
        bytes(found.content), status=found.answer_status, content_type=found.content_type or None
    )
    response.headers[REPLAYED_HEADER] = "true"
    return response


def _refusal(message: str, code: str, status: int) -> HttpResponse:
    return api_error_response(
        f"{KEY_HEADER}: {message}", code=code, status=status, errors={KEY_HEADER: [message]}
    )


def request_fingerprint(request: HttpRequest) -> str:
    """SHA-256 of what the request asks: its method, path, query, content type and body. A form's
    fields and files as parsed (Django's upload handlers keep their caps; DRF reads the parsed form
    after), any other body as sent."""
    digest = hashlib.sha256(_json([request.method, request.path, request.META.get("QUERY_STRING", "")]))
    digest.update(_json(request.content_type))
    if request.method == "POST" and request.content_type in FORMS:
        for name, values in sorted(request.POST.lists()):
            digest.update(_json([name, values]) + b"\n")
        for name, files in sorted(request.FILES.lists()):
            for upload in files:
                digest.update(_json([name, upload.name, upload.size]) + _file_digest(upload) + b"\n")
    else:
        digest.update(request.body)
    return digest.hexdigest()


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def _file_digest(upload: UploadedFile) -> bytes:
    digest = hashlib.sha256()
    for chunk in upload.chunks():
        digest.update(chunk)
    upload.seek(0)  # the view reads it next
    return digest.hexdigest().encode()


def idempotency_keys_prune() -> int:
    """Forget the keys older than IDEMPOTENCY_KEY_HOURS, by the database's clock; how many went."""
    stale = Now() - timedelta(hours=settings.IDEMPOTENCY_KEY_HOURS)
    return IdempotentRequest.objects.filter(created_at__lt=stale).delete()[0]
