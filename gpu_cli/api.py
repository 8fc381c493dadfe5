"""The portal's REST API over httpx: every answer is checked here and turned into an exit code.

Error bodies are {"detail", "code", "errors": {field: [...]}} (docs/api.md): 4xx is Refused
(exit 1) with that detail, 404 NotFound (4); no answer, a 5xx or a rejected token is
Unreachable (3).

While the portal is away a request is sent again, with waits that double from 1 s, for up to
GPU_RETRY_SECONDS (60; 0: never), saying so on stderr; but only when sending it again cannot do
twice what was asked:

- any request whose connection was refused or timed out connecting: none of it was sent;
- a GET, HEAD or OPTIONS answered 503 (the database or Redis is away), or whose connection was
  dropped before an answer: reading twice changes nothing;
- a change (POST, DELETE, PUT) likewise, to a portal that keeps Idempotency-Keys (it says so on
  every answer of its API, `Idempotency-Keys: kept`; asked once where no answer came yet): each
  change carries a key of its own, the same in every try, and the portal does it once and sends
  its first answer again (portal/idempotency.py).

A change to an older portal is never sent again once it reached it: a 503 says the work could not
be done, not that none of it was (a connection lost while committing leaves it unknown). It stops
with exit code 3 and says to check before trying again; but a 503 whose code is `unavailable` is a
part of the lab that did not answer (a Slurm cluster) and says nothing was done: its detail is shown.
"""

from __future__ import annotations

import os
import ssl
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from time import monotonic, sleep
from typing import Any

import click
import httpx

from gpu_cli import config
from gpu_cli.errors import Failed, NotFound, Refused, Unreachable

API_ROOT = "/api/v1/"
MAX_PAGE_SIZE = 500  # portal/pagination.py's max_page_size
# A log or a list can take a while to send; a portal that accepts no connection in 10 s is away.
TIMEOUT = httpx.Timeout(60.0, connect=10.0)

RETRY_ENV = "GPU_RETRY_SECONDS"
RETRY_SECONDS = 60.0  # how long to keep trying while the portal is away
FIRST_RETRY_SECONDS = 1.0  # the first wait; each next one is twice as long
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# None of the request left this machine: safe to send again, whatever the method.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# The connection was dropped before any answer: safe to send again only for a safe method.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError)
MAYBE_DONE = "It may or may not be done: check before you try again."
KEY_HEADER = "Idempotency-Key"  # a change's own, the same in each of its tries
KEPT_HEADER = "Idempotency-Keys"  # "kept": the portal does a change sent again with its key once
IN_PROGRESS = "idempotency_key_in_progress"  # the 409 of a try while an earlier one still runs
UNKNOWN = "idempotency_key_unknown"  # the 409 of a try whose earlier one's outcome is unknown


def _user_agent() -> str:
    try:
        return f"gpu-cli/{version('gpu-lab-portal')}"
    except PackageNotFoundError:  # run from a checkout without installing it
        return "gpu-cli"


@dataclass(frozen=True)
class Page:
    """A list's rows (at most the limit asked for) and how many the portal has in all."""

    rows: list[dict[str, Any]]
    total: int


class Portal:
    def __init__(self, url: str, token: str | None = None, *, retry_seconds: float | None = None) -> None:
        headers = {"Accept": "application/json", "User-Agent": _user_agent()}
        if token:
            headers["Authorization"] = f"Token {token}"
        self.url = url
        self.retry_seconds = retry_budget() if retry_seconds is None else retry_seconds
        self.http = httpx.Client(base_url=url + API_ROOT, headers=headers, timeout=TIMEOUT)
        self.signed_in = bool(token)
        self.keys_kept = False  # the portal said it keeps Idempotency-Keys (portal/idempotency.py)
        self.keys_asked = False

    def __enter__(self) -> Portal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self._send(method, path, stream=False, **kwargs)

    def get(self, path: str, **params: Any) -> Any:
        return answer_json(self.request("GET", path, params=_present(params)))

    def post(self, path: str, **kwargs: Any) -> Any:
        return answer_json(self.request("POST", path, **kwargs))

    def rows(self, path: str, *, limit: int, **params: Any) -> Page:
        """A list's rows, following its pages up to `limit` rows. Plain lists (servers, GPUs)
        come whole; paginated ones are {"count", "next", "previous", "results"}."""
        params["page_size"] = min(limit, MAX_PAGE_SIZE)
        body = self.get(path, **params)
        if isinstance(body, list):
            return Page(body, len(body))
        rows, page = list(body["results"]), 1
        # Page numbers rather than the `next` link: behind a proxy it may name the wrong host.
        while body["next"] and len(rows) < limit:
            page += 1
            try:
                body = self.get(path, **params, page=page)
            except Refused as exc:
                if "page" not in exc.errors:
                    raise
                break  # the list shrank under the paging (jobs started, ended): what was read stands
            rows += body["results"]
        return Page(rows[:limit], body["count"])

    @contextmanager
    def stream(self, path: str, **params: Any) -> Iterator[httpx.Response]:
        """A GET whose body is read as it arrives (a job's log can be a gigabyte). Only getting
        the answer is retried: a connection lost in the middle of the body is exit code 3."""
        response = self._send("GET", path, stream=True, params=_present(params))
        try:
            yield response
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        finally:
            response.close()

    def _send(self, method: str, path: str, *, stream: bool, **kwargs: Any) -> httpx.Response:
        """One request, sent again while the portal is away where that is safe (module docstring).
        A change carries an Idempotency-Key of its own, the same in each of its tries."""
        retry = Retry(self.retry_seconds)
        safe = method in SAFE_METHODS
        # A key belongs to a token (portal/idempotency.py): `login`, which has none yet, sends none.
        keyed = not safe and self.signed_in and self.retry_seconds > 0  # never sent again: no key
        if keyed:
            kwargs["headers"] = {**(kwargs.get("headers") or {}), KEY_HEADER: uuid.uuid4().hex}
        while True:
            try:
                response = self.http.send(self.http.build_request(method, path, **kwargs), stream=stream)
                if not response.is_success:
                    response.read()  # an error's body is small; this also closes a stream
            except httpx.TransportError as exc:
                sent = not isinstance(exc, NOT_SENT)
                # A TLS handshake that failed (https to a plain port, an untrusted certificate)
                # fails the same way a minute later: say so at once.
                dropped = isinstance(exc, DROPPED) and (safe or (keyed and self._keeps_keys(retry)))
                resend = not _tls_failure(exc) and (not sent or dropped)
                if resend and retry.wait(f"cannot reach the portal at {self.url} ({_reason(exc)})"):
                    continue
                raise self._unreachable(exc, maybe_done=sent and not safe) from None
            self.keys_kept = self.keys_kept or response.headers.get(KEPT_HEADER) == "kept"
            code = _code(response)
            if keyed and code == IN_PROGRESS and retry.wait("the portal is still doing this request"):
                continue  # an earlier try of it, whose answer was lost, is still running
            # A 503 whose code is `unavailable` is a part of the lab that did not answer (a Slurm
            # cluster): said at once, never waited on.
            away = response.status_code == 503 and code != "unavailable"
            again = away and (safe or (keyed and self.keys_kept))
            if again and retry.wait(f"the portal answered 503 ({_unavailable(response)})"):
                continue
            if keyed and code in (IN_PROGRESS, UNKNOWN):
                # Its first try may have been done (or still be running): exit 3, never "refused",
                # which a person would put right and send as a new change.
                detail = str(response.json().get("detail") or "")
                raise Unreachable(f"{detail} {MAYBE_DONE}")
            _check(response)
            return response

    def _keeps_keys(self, retry: Retry) -> bool:
        """Whether the portal keeps Idempotency-Keys, so a change whose answer was lost may be sent
        again: said on each of its API's answers, asked (once) where none came yet. An older
        portal would do the change twice."""
        while not self.keys_kept and not self.keys_asked:
            try:
                answer = self.http.get("")
            except httpx.TransportError as exc:
                why = _reason(exc)
            else:
                self.keys_kept = answer.headers.get(KEPT_HEADER) == "kept"
                # Only the portal's own answer (its API answers JSON) tells; a proxy's error page
                # while the portal restarts does not, and is asked past.
                self.keys_asked = self.keys_kept or "json" in answer.headers.get("Content-Type", "")
                why = f"HTTP {answer.status_code}"
            if not self.keys_asked and not retry.wait(f"cannot reach the portal at {self.url} ({why})"):
                return False
        return self.keys_kept

    def _unreachable(self, exc: httpx.TransportError, *, maybe_done: bool = False) -> Unreachable:
        check = f" {MAYBE_DONE}" if maybe_done else ""
        return Unreachable(f"Cannot reach the portal at {self.url}: {_reason(exc)}.{check}")


class Retry:
    """The waits between tries: 1, 2, 4 … seconds, all within the budget from the first failure."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.delay = FIRST_RETRY_SECONDS
        self.deadline: float | None = None

    def wait(self, why: str) -> bool:
        """Say why and wait before the next try; False when the budget is spent."""
        now = monotonic()
        if self.deadline is None:
            self.deadline = now + self.budget
        delay = min(self.delay, self.deadline - now)
        if delay <= 0:
            return False
        click.echo(f"gpu: {why}; retrying in {_seconds(delay)}…", err=True)
        sleep(delay)
        self.delay *= 2
        return True


def retry_budget() -> float:
    """GPU_RETRY_SECONDS, else 60; 0 never retries (a script that would rather fail at once)."""
    text = os.environ.get(RETRY_ENV, "").strip()
    if not text:
        return RETRY_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 3600:
        raise click.UsageError(f"{RETRY_ENV}={text!r}: give the seconds to keep retrying, 0 to 3600")
    return seconds


def connect() -> Portal:
    """The logged-in portal for the running command, closed when the command ends."""
    login = config.current()
    return click.get_current_context().with_resource(Portal(login.url, login.token))


def _present(params: dict[str, Any]) -> dict[str, Any]:
    """httpx would send None as an empty value, which a filter reads as a bad one."""
    return {name: value for name, value in params.items() if value is not None}


def answer_json(response: httpx.Response) -> Any:
    """The answer's JSON; an answer that is none (a proxy's login page) is exit code 3, said so."""
    try:
        return response.json()
    except ValueError:
        raise Unreachable(
            f"{response.request.url} did not answer with the portal's JSON: is "
            f"{response.request.url.copy_with(path='/', query=None)} the portal's address?"
        ) from None


def _check(response: httpx.Response) -> None:
    if response.is_success:
        return
    status, where = response.status_code, f"{response.request.method} {response.request.url.path}"
    if response.is_redirect:
        raise Unreachable(
            f"{where} was redirected to {response.headers.get('location')}: log in with that address."
        )
    try:
        body = response.json()
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    detail = str(body.get("detail") or f"HTTP {status} {response.reason_phrase}")
    if status == 401:
        raise Unreachable(f"The portal refused the token ({detail}): run `gpu login URL` again.")
    if status == 404:
        raise NotFound(f"{detail} ({where})")
    if status == 503 and body.get("code") == "unavailable":  # a service's own: nothing was done
        raise Unreachable(f"{detail} ({where})")
    if status == 503:
        # Only a safe method's 503 is retried; another's work may or may not have been done.
        check = "" if response.request.method in SAFE_METHODS else f" {MAYBE_DONE}"
        raise Unreachable(f"The portal is unavailable ({where}: {_unavailable(response)}).{check}")
    if status >= 500:
        raise Failed(f"The portal failed ({where}: HTTP {status}); try again, or tell its admins.")
    errors = body.get("errors") if isinstance(body.get("errors"), dict) else {}
    raise Refused(detail, {field: [str(m) for m in _as_list(messages)] for field, messages in errors.items()})


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _unavailable(response: httpx.Response) -> str:
    """What the portal says is away, from its 503 body (portal/outage.py): 'database unavailable'."""
    try:
        body = response.json()
    except ValueError:
        body = None
    service = body.get("service") if isinstance(body, dict) else None
    return f"{service} unavailable" if isinstance(service, str) and service else "service unavailable"


def _code(response: httpx.Response) -> str | None:
    """The error body's `code` (docs/api.md), if any."""
    if response.is_success or "json" not in response.headers.get("Content-Type", ""):
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("code") if isinstance(body, dict) else None


def _tls_failure(exc: BaseException) -> bool:
    """Whether the connection failed in its TLS handshake: httpx wraps httpcore's error, which
    wraps the ssl module's. Not a connection closed before TLS answered (SSLEOFError): a proxy
    that passes TLS through closes it so while the portal behind it restarts."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return not isinstance(seen, ssl.SSLEOFError)
        seen = seen.__cause__ or seen.__context__
    return False


def _reason(exc: httpx.TransportError) -> str:
    return str(exc) or type(exc).__name__


def _seconds(delay: float) -> str:
    return f"{delay:.0f} s" if delay >= 1 else f"{delay:.2g} s"
