"""`gpu logs -f` over the portal's event stream (GET /api/v1/jobs/<id>/log/stream/, docs/live.md).

Each event carries whole log lines and, as its id, the byte offset just after them. A dropped
connection is taken up again from the last id, so nothing is printed twice or left out; the
portal reads what was missed from its database. The stream is asked for `?encoding=json`: each
event's bytes exactly, so a progress bar's carriage returns reach the terminal as the job printed
them (the text form ends a line at each), and what `gpu logs -f` writes is what `gpu logs` does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from time import monotonic, sleep
from typing import BinaryIO

import httpx

from gpu_cli.api import DROPPED, Portal, retry_budget
from gpu_cli.errors import Unreachable

RECONNECT_SECONDS = 1.0  # after a stream that ended without its end, or broke without news


@dataclass
class Event:
    data: list[str] = field(default_factory=list)
    id: str | None = None
    event: str = "message"


_SSE_LINE_END = re.compile("\r\n|\r|\n")


def sse_lines(chunks: Iterable[str]) -> Iterator[str]:
    """The body's lines as SSE has them: ended by CR, LF or CRLF only. httpx's `iter_lines` also
    ends a line at a form feed, U+0085, U+2028 and the like (str.splitlines), which a log line
    may hold: its text would be cut and the rest read as a field of its own, and lost."""
    held = ""
    for chunk in chunks:
        held += chunk
        cr = held.endswith("\r")  # perhaps half a CRLF: the next chunk says
        *lines, held = _SSE_LINE_END.split(held[:-1] if cr else held)
        held += "\r" if cr else ""
        yield from lines
    if held:
        yield held.removesuffix("\r")


def iter_events(lines: Iterable[str]) -> Iterator[Event]:
    """Server-sent events from the body's lines (the WHATWG rules the portal's stream uses:
    `field: value`, comments start with `:`, a blank line ends an event)."""
    current = Event()
    for line in lines:
        if not line:
            if current.data or current.id is not None or current.event != "message":
                yield current
            current = Event()
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            current.data.append(value)
        elif name == "id":
            current.id = value
        elif name == "event":
            current.event = value


def event_bytes(event: Event, before: int, *, exact: bool = False) -> bytes:
    """The log's bytes an event stands for. `exact` (the stream said X-Log-Encoding: json): its
    data is one JSON string of them. Otherwise (an older portal) its lines, each with the newline
    SSE takes off, the last one only when the offsets say the text had it; a carriage return
    arrives as a line's end."""
    if exact:
        return json.loads("\n".join(event.data)).encode("utf-8", "surrogateescape")
    text = "\n".join(event.data).encode()
    if event.id is not None and int(event.id) - before == len(text):
        return text
    return text + b"\n"


def follow_log(portal: Portal, job_id: int, out: BinaryIO) -> None:
    """Copy the job's log to `out` until the job has ended and its last byte is out."""
    offset = 0
    budget = retry_budget()
    # When the stream last moved on or said it was alive (a keep-alive comment, every 15 s on a
    # live stream): a quiet job's stream closed by a portal's restart is taken up again, however
    # long ago the job last printed. Not the `retry:` each stream opens with, which one that
    # breaks at once also sends.
    heard = monotonic()

    def alive(lines: Iterable[str]) -> Iterator[str]:
        nonlocal heard
        for line in lines:
            if line.startswith(":"):
                heard = monotonic()
            yield line

    while True:
        before = offset
        with portal.stream(f"jobs/{job_id}/log/stream/", offset=offset, encoding="json") as response:
            exact = response.headers.get("X-Log-Encoding") == "json"
            try:
                for event in iter_events(alive(sse_lines(response.iter_text()))):
                    if event.event == "end":
                        return
                    if event.id is None or not event.id.isdigit():
                        continue
                    out.write(event_bytes(event, offset, exact=exact))
                    out.flush()
                    offset, heard = int(event.id), monotonic()
            except (*DROPPED, httpx.ReadTimeout):
                pass  # taken up again from `offset`, the last id
        if monotonic() - heard > budget:
            raise Unreachable(
                f"The log stream of job {job_id} at {portal.url} keeps breaking off:"
                f" nothing new for {budget:.0f} s."
            )
        if offset == before:
            sleep(RECONNECT_SECONDS)  # no news on that connection: not at once again
