"""Streamed answers under ASGI: a sync iterator sent piece by piece, and several async streams as one.

Django's StreamingHttpResponse serves a sync iterator under ASGI by reading it whole into a list
first (`sync_to_async(list)`): a 1 GB log download would sit in the web server's memory before
its first byte went out. This one takes the pieces one at a time, each in the request's thread
(the ORM's connection stays in one thread), so memory stays flat under ASGI as under WSGI.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from asgiref.sync import sync_to_async
from django.http import StreamingHttpResponse

_DONE = object()


class SyncStreamingHttpResponse(StreamingHttpResponse):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        pieces = iter(self.streaming_content)
        while (piece := await sync_to_async(next)(pieces, _DONE)) is not _DONE:
            yield piece


async def merged(*streams: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """The chunks of several streams in one, each as it comes; ends when the first of them ends
    (or fails, with its error), and then closes the others. Each chunk must be whole events."""
    queue: asyncio.Queue[tuple[bytes | None, BaseException | None]] = asyncio.Queue(maxsize=1)

    async def pump(stream: AsyncGenerator[bytes, None]) -> None:
        try:
            # Closed here, not left to the garbage collector: a stream cancelled while it waits
            # at its `yield` runs its `finally` (its Redis subscription) at once.
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    await queue.put((chunk, None))  # one at a time: a slow client slows the producers
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put((None, exc))
        else:
            await queue.put((None, None))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        while True:
            chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                return
            yield chunk
    finally:
        for task in tasks:
            task.cancel()  # each stream's own cleanup (its `finally`, its subscription) runs
        await asyncio.gather(*tasks, return_exceptions=True)
