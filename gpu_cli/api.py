"""The portal's REST API over httpx: every answer is checked here and turned into an exit code.

Error bodies are {"detail", "code", "errors": {field: [...]}} (docs/api.md): 4xx is Refused
(exit 1) with that detail, 404 NotFound (4); no answer, a 5xx or a rejected token is
Unreachable (3).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import click
import httpx

from gpu_cli import config
from gpu_cli.errors import NotFound, Refused, Unreachable

API_ROOT = "/api/v1/"
MAX_PAGE_SIZE = 500  # portal/pagination.py's max_page_size
# A log or a list can take a while to send; a portal that accepts no connection in 10 s is away.
TIMEOUT = httpx.Timeout(60.0, connect=10.0)


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
    def __init__(self, url: str, token: str | None = None) -> None:
        headers = {"Accept": "application/json", "User-Agent": _user_agent()}
        if token:
            headers["Authorization"] = f"Token {token}"
        self.url = url
        self.http = httpx.Client(base_url=url + API_ROOT, headers=headers, timeout=TIMEOUT)

    def __enter__(self) -> Portal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        _check(response)
        return response

    def get(self, path: str, **params: Any) -> Any:
        return _json(self.request("GET", path, params=_present(params)))

    def post(self, path: str, **kwargs: Any) -> Any:
        return _json(self.request("POST", path, **kwargs))

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
            body = self.get(path, **params, page=page)
            rows += body["results"]
        return Page(rows[:limit], body["count"])

    @contextmanager
    def stream(self, path: str, **params: Any) -> Iterator[httpx.Response]:
        """A GET whose body is read as it arrives (a job's log can be a gigabyte)."""
        try:
            with self.http.stream("GET", path, params=_present(params)) as response:
                if not response.is_success:
                    response.read()
                    _check(response)
                yield response
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None

    def _unreachable(self, exc: httpx.TransportError) -> Unreachable:
        return Unreachable(f"Cannot reach the portal at {self.url}: {exc or type(exc).__name__}.")


def connect() -> Portal:
    """The logged-in portal for the running command, closed when the command ends."""
    login = config.current()
    return click.get_current_context().with_resource(Portal(login.url, login.token))


def _present(params: dict[str, Any]) -> dict[str, Any]:
    """httpx would send None as an empty value, which a filter reads as a bad one."""
    return {name: value for name, value in params.items() if value is not None}


def _json(response: httpx.Response) -> Any:
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
    if status >= 500:
        raise Unreachable(f"The portal failed ({where}: HTTP {status}); try again, or tell its admins.")
    errors = body.get("errors") if isinstance(body.get("errors"), dict) else {}
    raise Refused(detail, {field: [str(m) for m in _as_list(messages)] for field, messages in errors.items()})


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]
