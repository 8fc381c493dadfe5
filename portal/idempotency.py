"""`Idempotency-Key` on every change the API makes: a request sent again after its answer was lost
(a dropped connection, a proxy's timeout, the portal away for a minute) is done once, and its first
answer is sent again (the IETF httpapi draft "The Idempotency-Key HTTP Header Field").

A client sends `Idempotency-Key: <up to 255 visible ASCII characters>` with a POST, PUT, PATCH or
DELETE under /api/: a new key for each change it means to make (`gpu` sends a UUID), the same one
with each try of that change. The portal keeps, per credential and key, what the request was (a
SHA-256 of its method, path, query and body) and the answer it got, in the change's own
transaction: a request is either done and remembered, or neither. Again with that key:

- the same request gets the first answer again, with `Idempotent-Replayed: true`;
- another request (another body or path) is refused with 422, naming the header;
- while the first is still being done, the second waits for it (its key's row is locked by the
  first's transaction; SQLite's writers take turns anyway) and then gets its answer.

Answers below 500 are remembered, refusals too (the same request would be refused again). A 5xx is
not: its transaction is rolled back, the key with it, so a try after it is done anew. Keys are
kept IDEMPOTENCY_KEY_HOURS (24), then pruned (portal.tasks.prune_idempotency_keys).

Every answer under /api/, an outage's 503 among them, says `Idempotency-Keys: kept`: a client
that lost an answer sends a change again only to a portal that said so (an older one would do it
twice). A middleware, not a view's decorator, so that no change of the API can miss it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import datetime, timedelta

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from portal.api_errors import api_error_response
from portal.models import IdempotentRequest
from portal.outage import service_unavailable
from portal.unreachable import outage_of

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
KEPT_HEADER = "Idempotency-Keys"
KEY_MAX = 255
CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


class IdempotencyMiddleware:
    """First in MIDDLEWARE: its transaction holds everything the request does."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith("/api/"):
            return self.get_response(request)
        key, owner = request.headers.get(KEY_HEADER), _owner(request)
        if key is None or request.method not in CHANGES or owner is None:
            response = self.get_response(request)  # nobody's (no credentials): nothing to keep
        else:
            try:
                response = _refused(key) or _once(request, key, owner, self.get_response)
            except Exception as exc:
                # The database away while the key was claimed, or at the commit (its outcome then
                # unknown): the outage's 503, answered here so it says that keys are kept, and a
                # try after it finds the change either done and kept or not done.
                service = outage_of(exc)
                if service is None:
                    raise
                response = service_unavailable(request, service, exc)
        response.headers[KEPT_HEADER] = "kept"
        return response


def _refused(key: str) -> HttpResponse | None:
    if 1 <= len(key) <= KEY_MAX and all("!" <= c <= "~" for c in key):
        return None
    message = (
        f"give 1 to {KEY_MAX} visible ASCII characters (no spaces), a new one for each change, e.g. "
        "a UUID; send the same one only with a try of the same request."
    )
    return api_error_response(
        f"{KEY_HEADER}: {message}", code="invalid", status=400, errors={KEY_HEADER: [message]}
    )


def _once(
    request: HttpRequest, key: str, owner: str, get_response: Callable[[HttpRequest], HttpResponse]
) -> HttpResponse:
    """The request done under its key, and its answer kept; or the answer it got before."""
    fingerprint = request_fingerprint(request)
    with transaction.atomic():
        claimed = _claim(request, key, owner, fingerprint, timezone.now())
        if isinstance(claimed, HttpResponse):
            return claimed
        response = get_response(request)
        if response.status_code >= 500:
            # Not kept: its work is rolled back, the key with it, so a try after it is done anew.
            transaction.set_rollback(True)
            return response
        if response.streaming:  # no change of the API streams its answer: none is kept
            IdempotentRequest.objects.filter(pk=claimed.pk).delete()
            return response
        IdempotentRequest.objects.filter(pk=claimed.pk).update(
            answer_status=response.status_code,
            content_type=response.headers.get("Content-Type", "")[:200],
            content=response.content,
        )
    return response


def _claim(
    request: HttpRequest, key: str, owner: str, fingerprint: str, now: datetime
) -> IdempotentRequest | HttpResponse:
    """The key's row, new and locked by this transaction; or, where the key was used, its answer.
    A row past IDEMPOTENCY_KEY_HOURS that the prune has not reached yet counts as gone."""
    stale = now - timedelta(hours=settings.IDEMPOTENCY_KEY_HOURS)
    IdempotentRequest.objects.filter(owner=owner, key=key, created_at__lt=stale).delete()
    try:
        with transaction.atomic():  # a savepoint: the outer transaction goes on after a clash
            return IdempotentRequest.objects.create(
                owner=owner,
                key=key,
                fingerprint=fingerprint,
                method=request.method or "",
                path=request.path[:500],
                created_at=now,
            )
    except IntegrityError:
        # The key's row, committed: on PostgreSQL this insert waited for its transaction.
        return _replay(IdempotentRequest.objects.get(owner=owner, key=key), request, fingerprint)


def _replay(found: IdempotentRequest, request: HttpRequest, fingerprint: str) -> HttpResponse:
    if found.fingerprint != fingerprint:
        message = (
            f"{found.key!r} was sent with another request ({found.method} {found.path} at "
            f"{found.created_at:%Y-%m-%d %H:%M:%S} UTC); send a new key for a new change."
        )
        return api_error_response(
            f"{KEY_HEADER}: {message}",
            code="idempotency_key_reused",
            status=422,
            errors={KEY_HEADER: [message]},
        )
    response = HttpResponse(
        bytes(found.content), status=found.answer_status, content_type=found.content_type or None
    )
    response.headers[REPLAYED_HEADER] = "true"
    return response


def _owner(request: HttpRequest) -> str | None:
    """Whose the request is, before any view knows the user: a SHA-256 of its credentials."""
    credentials = request.headers.get("Authorization") or request.COOKIES.get(settings.SESSION_COOKIE_NAME)
    return hashlib.sha256(credentials.encode()).hexdigest() if credentials else None


def request_fingerprint(request: HttpRequest) -> str:
    """SHA-256 of what the request asks: its method, path, query and body. A form's fields and
    files as parsed (Django's upload handlers keep their caps; DRF reads the parsed form after),
    any other body as sent."""
    digest = hashlib.sha256(
        f"{request.method} {request.path}?{request.META.get('QUERY_STRING', '')}\n".encode()
    )
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


def idempotency_keys_prune(now: datetime | None = None) -> int:
    """Forget the keys older than IDEMPOTENCY_KEY_HOURS; how many went."""
    stale = (now or timezone.now()) - timedelta(hours=settings.IDEMPOTENCY_KEY_HOURS)
    return IdempotentRequest.objects.filter(created_at__lt=stale).delete()[0]
