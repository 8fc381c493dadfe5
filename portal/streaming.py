"""A streamed answer from a sync iterator that an ASGI server also sends piece by piece.

Django's StreamingHttpResponse serves a sync iterator under ASGI by reading it whole into a list
first (`sync_to_async(list)`): a 1 GB log download would sit in the web server's memory before
its first byte went out. This one takes the pieces one at a time, each in the request's thread
(the ORM's connection stays in one thread), so memory stays flat under ASGI as under WSGI.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from asgiref.sync import sync_to_async
from django.http import StreamingHttpResponse

_DONE = object()


class SyncStreamingHttpResponse(StreamingHttpResponse):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        pieces = iter(self.streaming_content)
        while (piece := await sync_to_async(next)(pieces, _DONE)) is not _DONE:
            yield piece
