"""portal.asgi under a real uvicorn, in a thread of the test process (so it sees the test
database), for the tests of what only ASGI serves: the live log streams (docs/live.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

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
        thread.join(10)


@contextmanager
def asgi_server() -> Iterator[str]:
    """The portal's base URL while the block runs."""
    with serve(application) as port:
        yield f"http://127.0.0.1:{port}"
