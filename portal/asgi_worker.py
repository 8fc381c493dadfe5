"""gunicorn's worker class for the portal (`-k portal.asgi_worker.Worker`): uvicorn's, stopping soon.

uvicorn waits for every open connection to close before a worker stops, and a live log stream
(docs/live.md) stays open while its job runs: a stop or restart would wait for gunicorn's whole
graceful timeout (30 s), and under `make run` end in SIGKILL. After STOP_SECONDS what is still
open is cancelled; a browser or `gpu logs -f` reconnects with its Last-Event-ID and misses
nothing. Requests for pages finish well within it.
"""

from __future__ import annotations

from uvicorn_worker import UvicornWorker

from portal.log_filters import redact_request_logs

STOP_SECONDS = 5
# An idle keep-alive connection is closed by the server only after its clients would have dropped
# it: httpx (the `gpu` CLI) and many proxies give up on one after 5 to 60 s, and a server that
# closes first races the next request sent on it ("connection reset by peer", seen under load in
# the fault suite with uvicorn's default of 5 s, the same as httpx's).
KEEP_ALIVE_SECONDS = 65


class Worker(UvicornWorker):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)  # sets up uvicorn's loggers with gunicorn's handlers
        redact_request_logs()  # the access log names no calendar secret (portal/log_filters.py)

    # Django has no lifespan handler; "off" spares each start a log line saying so.
    CONFIG_KWARGS = {
        **UvicornWorker.CONFIG_KWARGS,
        "timeout_graceful_shutdown": STOP_SECONDS,
        "timeout_keep_alive": KEEP_ALIVE_SECONDS,
        "lifespan": "off",
    }
