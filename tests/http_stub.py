"""A scripted HTTP server for the `gpu` CLI's tests: a handler class served on 127.0.0.1 from a
thread of its own, until `server.shutdown()` and `server.server_close()`."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serving(handler: type[BaseHTTPRequestHandler], port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """`handler` served on 127.0.0.1:`port` (0: one the kernel picks); the server and its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"
