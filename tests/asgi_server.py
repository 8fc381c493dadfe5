"""portal.asgi under a real uvicorn, in a thread of the test process (so it sees the test
database), for the tests of what only ASGI serves: the live log streams (docs/live.md) and the
labs on their own origin (docs/sessions.md, "Two origins")."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from django.conf import settings
from django.test import override_settings

from portal.asgi import application
from tests.conftest import free_port


@contextmanager
def serve(app: Any) -> Iterator[int]:
    """Any ASGI app under uvicorn in a thread; its port while the block runs."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    web = uvicorn.Server(config)
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not web.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        web.should_exit = True
        thread.join(5)
        if thread.is_alive():
            # A stream whose reader is gone but not yet noticed holds uvicorn's graceful shutdown
            # open; its tab has closed, so nothing is left to serve: close it rather than leave a
            # server running into the next test (which counts the stream servers it finds).
            web.force_exit = True
            thread.join(5)
        assert not thread.is_alive(), f"uvicorn on port {port} did not stop"


@contextmanager
def asgi_server() -> Iterator[str]:
    """The portal's base URL while the block runs: http://localhost:PORT, as `make run` gives it
    (127.0.0.1 is the labs' host name, where the portal answers nothing)."""
    with asgi_servers() as (portal, _labs):
        yield portal


@contextmanager
def asgi_servers() -> Iterator[tuple[str, str]]:
    """The portal's base URL and LAB_ORIGIN while the block runs, one server as `make run` has it:
    http://localhost:PORT and http://127.0.0.1:PORT (PORTAL_URL and LAB_ORIGIN say so meanwhile,
    and so does the pages' Content-Security-Policy wherever it names LAB_ORIGIN)."""
    with serve(application) as port:
        portal, labs = f"http://localhost:{port}", f"http://127.0.0.1:{port}"
        with override_settings(PORTAL_URL=portal, LAB_ORIGIN=labs, **_policy_naming(labs)):
            yield portal, labs


def _policy_naming(labs: str) -> dict[str, Any]:
    """CONTENT_SECURITY_POLICY with `labs` wherever it names the configured LAB_ORIGIN."""
    policy = copy.deepcopy(getattr(settings, "CONTENT_SECURITY_POLICY", None))
    if not policy:
        return {}
    for name, sources in policy.get("DIRECTIVES", {}).items():
        if isinstance(sources, list):
            policy["DIRECTIVES"][name] = [
                labs if source == settings.LAB_ORIGIN else source for source in sources
            ]
    return {"CONTENT_SECURITY_POLICY": policy}
