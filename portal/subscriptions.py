"""One Redis subscription per web-server process, shared by every stream it serves (docs/live.md).

A stream (a job's live log, a page's change feed) used to open a Redis connection of its own: 500
watchers of one job were 500 connections to Redis, each with its buffers in the web server, and
Redis wrote each message 500 times. Here one connection per event loop subscribes to the union of
the channels its streams want, and one reader task hands each message to every stream that wants
its channel, through a queue of the stream's own.

- `listen(channels)` returns once Redis has confirmed every channel, so a stream that reads the
  database after it misses nothing published since (the log stream relies on that).
- A stream that does not keep up (QUEUE_MAX messages waiting), and every stream when the
  connection fails, gets `Lost` from its next `get`: it ends, and its client reconnects and
  reads what it missed from the database, as after any dropped connection. Redis is never
  reconnected behind the streams' backs: redis-py's own retry would resubscribe silently, and
  what was published meanwhile would be missing with nobody knowing. The next `listen` connects.
- A channel nobody listens to any more is unsubscribed LINGER_SECONDS later: a page that reloads
  finds it still there.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import NamedTuple

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

QUEUE_MAX = 10_000  # messages waiting for one stream: beyond, it is told it lost some
LINGER_SECONDS = 30.0
CONFIRM_SECONDS = 5.0  # for Redis to confirm a subscription
READ_SECONDS = 15.0  # the reader wakes at least this often, and redis-py then checks the connection
CLIENT_NAME = "portal-streams"  # CLIENT LIST shows portal-streams-<pid>-<n>: one per web-server process


class Lost(Exception):
    """Messages for this subscription may have been lost: read the record again."""


class Message(NamedTuple):
    channel: bytes
    data: bytes
    at: float  # the loop's time when the hub took it: the same for every stream that gets it


class Subscription:
    """What one stream receives: Messages, in the order Redis sent them. `since` is the loop's
    time from which it receives every message of its channels."""

    def __init__(self, hub: Hub, channels: Iterable[str]) -> None:
        self.hub = hub
        self.channels = frozenset(c.encode() for c in channels)
        self.since = 0.0
        self._queue: asyncio.Queue[Message | None] = asyncio.Queue()
        self._lost = ""

    def deliver(self, message: Message) -> None:
        if self._lost:
            return
        if self._queue.qsize() >= QUEUE_MAX:
            self.lose(f"more than {QUEUE_MAX} messages waited for this stream")
            return
        self._queue.put_nowait(message)

    def lose(self, why: str) -> None:
        if not self._lost:
            self._lost = why
            self._queue.put_nowait(None)

    async def get(self, timeout: float) -> Message | None:
        """The next message; None when `timeout` seconds pass without one. Raises Lost once the
        messages before the loss have been taken."""
        if self._queue.empty():
            try:
                async with asyncio.timeout(max(0.0, timeout)):
                    item = await self._queue.get()
            except TimeoutError:
                return None
        else:
            item = self._queue.get_nowait()
        if item is None:
            self._queue.put_nowait(None)  # and again at every later get
            raise Lost(self._lost)
        return item

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.hub.leave(self)


_serial = itertools.count(1)


class Hub:
    """The process's (the event loop's) one Redis subscription; see the module docstring."""

    def __init__(self) -> None:
        self.name = f"{CLIENT_NAME}-{os.getpid()}-{next(_serial)}"  # its connection's, in CLIENT LIST
        self._client: aioredis.Redis | None = None
        self._url = ""
        self._pubsub: aioredis.client.PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._subs: dict[bytes, set[Subscription]] = {}
        self._pending: dict[bytes, asyncio.Future[None]] = {}  # SUBSCRIBE sent, not yet confirmed
        self._confirmed: set[bytes] = set()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()  # lingering unsubscribes: held, not collected

    @property
    def channels(self) -> int:
        """Channels subscribed now (confirmed), for the bench and tests."""
        return len(self._confirmed)

    async def listen(self, channels: Iterable[str]) -> Subscription:
        """A subscription to `channels`, confirmed by Redis; raises redis.RedisError without Redis."""
        sub = Subscription(self, channels)
        loop = asyncio.get_running_loop()
        new: list[bytes] = []
        async with self._lock:
            try:
                pubsub = await self._connect()
                for name in sub.channels:
                    self._subs.setdefault(name, set()).add(sub)
                sub.since = loop.time()
                new = [c for c in sub.channels if c not in self._confirmed and c not in self._pending]
                for name in new:
                    self._pending[name] = loop.create_future()
                if new:
                    await pubsub.subscribe(*new)
            except (redis.RedisError, OSError) as exc:
                self.leave(sub)
                self._break(f"Redis refused a subscription: {exc}")
                raise redis.ConnectionError(str(exc)) from exc
            except BaseException:  # cancelled (the client went) while it subscribed
                self.leave(sub)
                for name in new:  # the next listen subscribes again; a late confirmation is harmless
                    if (wait := self._pending.pop(name, None)) is not None:
                        wait.cancel()
                raise
            waits = [self._pending[c] for c in sub.channels if c in self._pending]
            if waits and self._reader is not None and self._reader.done():  # nobody would confirm
                self.leave(sub)
                self._break("the reader had stopped")
                raise redis.ConnectionError("the live streams' Redis reader had stopped; try again")
        try:
            async with asyncio.timeout(CONFIRM_SECONDS):
                for wait in waits:
                    await asyncio.shield(wait)  # one stream giving up cancels no other's wait
        except TimeoutError:
            self.leave(sub)
            self._break(f"Redis did not confirm a subscription in {CONFIRM_SECONDS:g} s")  # suspect
            raise redis.TimeoutError(f"Redis did not confirm in {CONFIRM_SECONDS:g} s") from None
        except BaseException:
            self.leave(sub)
            raise
        return sub

    def leave(self, sub: Subscription) -> None:
        loop = asyncio.get_running_loop()
        for name in sub.channels:
            subs = self._subs.get(name)
            if subs is None:
                continue
            subs.discard(sub)
            if not subs:
                del self._subs[name]
                loop.call_later(LINGER_SECONDS, self._linger_over, name)

    def _linger_over(self, name: bytes) -> None:
        if name in self._subs or name not in self._confirmed:
            return
        task = asyncio.get_running_loop().create_task(self._unsubscribe(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unsubscribe(self, name: bytes) -> None:
        async with self._lock:
            if name in self._subs or name not in self._confirmed or self._pubsub is None:
                return  # wanted again meanwhile, or the connection is gone
            self._confirmed.discard(name)
            try:
                await self._pubsub.unsubscribe(name)
            except (redis.RedisError, OSError) as exc:
                self._break(f"Redis lost while unsubscribing: {exc}")

    async def _connect(self) -> aioredis.client.PubSub:
        if self._pubsub is not None and self._url != settings.REDIS_URL:
            self._break("REDIS_URL changed")  # settings overridden (tests): the streams follow it
        if self._pubsub is not None:
            return self._pubsub
        self._url = settings.REDIS_URL
        self._client = aioredis.Redis.from_url(
            self._url,
            client_name=self.name,
            retry=Retry(NoBackoff(), 0),  # a failure reaches the reader, which tells the streams
            health_check_interval=READ_SECONDS,
            # A frozen Redis (stopped, its kernel still acknowledging) fails a connect or a command
            # in seconds; the reader's own waits for messages keep their READ_SECONDS timeout.
            socket_connect_timeout=settings.REDIS_SOCKET_TIMEOUT_SECONDS,
            socket_timeout=settings.REDIS_SOCKET_TIMEOUT_SECONDS,
        )
        self._pubsub = self._client.pubsub()
        self._reader = asyncio.get_running_loop().create_task(self._read(self._pubsub))
        return self._pubsub

    async def _read(self, pubsub: aioredis.client.PubSub) -> None:
        try:
            while True:
                if pubsub.connection is None:  # nothing subscribed yet: the first SUBSCRIBE connects
                    await asyncio.sleep(0.01)
                    continue
                message = await pubsub.get_message(timeout=READ_SECONDS)
                if message is None:
                    continue
                kind, name = message["type"], message["channel"]
                if kind == "message":
                    delivered = Message(name, message["data"], asyncio.get_running_loop().time())
                    for sub in tuple(self._subs.get(name, ())):
                        sub.deliver(delivered)
                elif kind == "subscribe":
                    self._confirmed.add(name)
                    wait = self._pending.pop(name, None)
                    if wait is not None and not wait.done():
                        wait.set_result(None)
                    if name not in self._subs:  # its listener went while it subscribed
                        asyncio.get_running_loop().call_later(LINGER_SECONDS, self._linger_over, name)
        except (redis.RedisError, OSError) as exc:
            if self._pubsub is pubsub:
                self._break(f"Redis connection lost: {exc}")
        except Exception as exc:  # a reader that died silently would leave every stream waiting
            log.exception("The live streams' Redis reader failed")
            if self._pubsub is pubsub:
                self._break(f"the reader failed: {type(exc).__name__}: {exc}")

    def _break(self, why: str) -> None:
        """Every stream is told it lost messages, and the next `listen` connects anew."""
        if self._pubsub is None:
            return
        log.warning("Live streams lost their Redis subscription (%s): their clients reconnect", why)
        pubsub, client, reader = self._pubsub, self._client, self._reader
        self._pubsub = self._client = self._reader = None
        for subs in self._subs.values():
            for sub in subs:
                sub.lose(why)
        self._subs.clear()
        for wait in self._pending.values():
            if not wait.done():
                wait.set_exception(redis.ConnectionError(why))
                wait.exception()  # retrieved: nobody may be waiting on it any more
        self._pending.clear()
        self._confirmed.clear()
        task = asyncio.get_running_loop().create_task(_close(pubsub, client, reader))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _close(
    pubsub: aioredis.client.PubSub | None, client: aioredis.Redis | None, reader: asyncio.Task[None] | None
) -> None:
    if reader is not None and reader is not asyncio.current_task():
        reader.cancel()
    try:
        if pubsub is not None:
            await pubsub.aclose()
        if client is not None:
            await client.aclose()
    except (redis.RedisError, OSError):
        pass


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Hub] = weakref.WeakKeyDictionary()


def hub() -> Hub:
    """This event loop's hub: a web-server process has one loop; tests may run several."""
    loop = asyncio.get_running_loop()
    found = _hubs.get(loop)
    if found is None:
        found = _hubs[loop] = Hub()
    return found
