"""Review of job logs against what real training scripts print (Keras 3 progress bars: `\\b`, `\\r`,
ANSI colours and box-drawing characters; output read from a pipe in arbitrary pieces)."""

from __future__ import annotations

import io
import threading

import pytest

from gpu_cli.api import Portal
from gpu_cli.live import event_bytes, follow_log, iter_events, sse_lines
from jobs.logs.store import LogWriter, log_stream
from jobs.logs.stream import event, exact_json
from jobs.models import Job
from jobs.notices import log_tail
from portal.services import api_token_create
from tests.test_log_stream import _setup, job, server  # noqa: F401 - the stream's fixtures

pytestmark = pytest.mark.django_db(transaction=True)


def keras_bar(steps: int, *, width: int = 20) -> bytes:
    """What Keras 3's Progbar writes for one evaluate() on Linux (`"posix" in sys.modules` turns on
    its dynamic display): each update backspaces over the last, returns to the line's start and
    redraws it in colour; the last is followed by a newline."""
    out, previous = b"", 0
    for step in range(1, steps + 1):
        done = width * step // steps
        text = (
            f"\x1b[1m{step}/{steps}\x1b[0m \x1b[32m{'━' * done}\x1b[0m\x1b[37m{'━' * (width - done)}\x1b[0m"
            f" \x1b[1m0s\x1b[0m 2ms/step - accuracy: 0.9{step:03d}"
        )
        out += b"\b" * previous + b"\r" + text.encode()
        previous = len(text)
    return out + b"\n"


def stored_text(job: Job) -> str:  # noqa: F811
    return b"".join(log_stream(job.pk)).decode("utf-8")  # strict: a cut character raises


def test_a_character_split_by_the_pipe_is_never_cut_when_a_long_partial_line_is_taken(job):  # noqa: F811
    # The worker reads the job's pipe in pieces of its own size: a read may end inside a
    # character. A line that has no newline yet is stored once it reaches the writer's chunk size;
    # the piece must not end inside that character (each half would read as U+FFFD).
    writer = LogWriter(job.pk, cap_bytes=8 * 1024)  # chunk size 1 KiB
    line = ("━" * 1000).encode()
    writer.feed(line[:1501])  # 500⅓ characters: over the chunk size, ends inside the 501st
    writer.feed(line[1501:] + b"\n")
    writer.close()
    assert stored_text(job).count("━") == 1000


def test_a_character_split_by_the_pipe_is_never_cut_when_a_quiet_partial_line_is_taken(job, monkeypatch):  # noqa: F811
    # The same when the partial line is taken because it waited LOG_FLUSH_SECONDS (a progress bar).
    writer = LogWriter(job.pk)
    line = ("━" * 10).encode()
    writer.feed(line[:16])
    writer.partial_since -= 1.0  # it has waited
    writer.maybe_flush()
    writer.feed(line[16:] + b"\n")
    writer.close()
    assert stored_text(job).count("━") == 10


def test_the_notices_log_tail_shows_a_progress_bar_as_a_terminal_does(job):  # noqa: F811
    # The owner's notification quotes "the last lines of its log". A Keras evaluate() bar is one
    # line on a terminal; in the notice it was one line per redraw, with the raw escape codes and
    # backspaces, and crowded out what the script printed before it.
    writer = LogWriter(job.pk)
    for n in range(1, 9):
        writer.feed(f"line {n}\n".encode())
    writer.feed(keras_bar(30))
    writer.feed(b"Test accuracy: 0.98\n")
    writer.close()
    tail = log_tail(job)
    assert "\x1b" not in tail and "\b" not in tail and "\r" not in tail
    lines = tail.split("\n")
    assert lines[0] == "line 1"
    assert lines[-2] == "30/30 ━━━━━━━━━━━━━━━━━━━━ 0s 2ms/step - accuracy: 0.9030"
    assert lines[-1] == "Test accuracy: 0.98"


def test_the_notices_log_tail_ends_a_title_left_unended_with_its_line(job):  # noqa: F811
    writer = LogWriter(job.pk)
    writer.feed(b"step 1 \x1b]0;training\nstep 2\nstep 3\n")
    writer.close()
    assert log_tail(job).split("\n") == ["step 1", "step 2", "step 3"]


def follow(server: str, job: Job, alice) -> bytes:  # noqa: F811
    _, key = api_token_create(user=alice, name="cli", expires_at=None)
    out = io.BytesIO()
    follower = threading.Thread(target=follow_log, args=(Portal(server, key, retry_seconds=5), job.pk, out))
    follower.start()
    follower.join(10)
    assert not follower.is_alive()
    return out.getvalue()


def test_gpu_logs_follow_writes_a_progress_bar_as_the_job_printed_it(server, job, alice):  # noqa: F811
    # `gpu logs` writes the log's bytes; `gpu logs -f` turned every `\r` into a newline: on the
    # terminal, one line per redraw of the bar (thousands an epoch) instead of one bar. It asks
    # for the stream's exact form now (?encoding=json).
    writer = LogWriter(job.pk)
    writer.feed(b"Epoch 1/1\n" + keras_bar(5))
    writer.close()
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED)
    assert follow(server, job, alice) == b"".join(log_stream(job.pk))


def test_gpu_logs_follow_keeps_lines_apart_with_crlf_and_a_stray_byte(server, job, alice):  # noqa: F811
    # A CRLF line and a Latin-1 byte in one event: the decoded text is as long as the bytes, so the
    # client took the event for one without its final newline, and glued the next line onto it.
    # The exact form needs no guess: the bytes are the log's, the Latin-1 one included.
    writer = LogWriter(job.pk)
    writer.feed(b"read data.csv\r\n" + "caf\u00e9".encode("latin-1") + b"\n")
    writer.flush()
    writer.feed(b"Epoch 1/1\n")
    writer.close()
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED)
    out = follow(server, job, alice)
    assert out.count(b"\n") == b"".join(log_stream(job.pk)).count(b"\n")
    assert out == b"".join(log_stream(job.pk))


def test_gpu_logs_follow_still_reads_an_older_portals_text_stream(server, job, alice, monkeypatch):  # noqa: F811
    # A portal from before ?encoding= sends plain lines (and no X-Log-Encoding): the client reads
    # them as it did, a carriage return arriving as a line's end.
    from jobs.logs import stream

    monkeypatch.setattr(stream, "exact_asked", lambda raw: False)
    monkeypatch.setattr(stream, "log_event_response", _without_the_header(stream.log_event_response))
    writer = LogWriter(job.pk)
    writer.feed(b"epoch 1\nloss 0.5\n")
    writer.close()
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED)
    assert follow(server, job, alice) == b"".join(log_stream(job.pk))


def _without_the_header(respond):  # type: ignore[no-untyped-def]
    def older(*args, **kwargs):  # type: ignore[no-untyped-def]
        response = respond(*args, **kwargs)
        del response["X-Log-Encoding"]
        return response

    return older


NASTY = [
    b"a\r\nb\rc\n",
    bytes(range(256)),  # every byte, most of them no UTF-8
    "x\u2028y\u2029z\x85\x0c\x1c\ufeff\U0001f600\n".encode(),  # what str.splitlines ends a line at
    "━".encode()[:2],  # a character cut off
    b'q"\\\n',
]


@pytest.mark.parametrize("text", NASTY)
def test_the_exact_form_gives_back_every_byte_however_the_body_is_cut(text):
    # One `data:` line whatever the bytes, even for a client that ends lines where
    # str.splitlines does (httpx's iter_lines); gpu's own reader ends them where SSE does, also
    # when a read ends between a CR and its LF.
    body = event(text, len(text), exact=True).decode()
    sent = exact_json(text).decode()  # valid UTF-8 whatever the bytes
    assert not set(sent) & set("\n\r\x85\u2028\u2029")
    for size in (1, 2, 3, 7, len(body)):
        pieces = [body[at : at + size] for at in range(0, len(body), size)]
        (received,) = iter_events(sse_lines(pieces))
        assert event_bytes(received, 0, exact=True) == text
    (received,) = iter_events(body.splitlines())
    assert event_bytes(received, 0, exact=True) == text


def test_gpus_reader_ends_lines_where_sse_does():
    assert list(sse_lines(["a\r", "\nb\r", "c\n", "d\x0ce\u2028f\n"])) == ["a", "b", "c", "d\x0ce\u2028f"]
    assert list(sse_lines(["data: x\r", "\r", "\n"])) == ["data: x", ""]


# --- a line still being drawn: stored as it comes, and gone on with -----------------------------


STAMPED = rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "


def stored(job: Job) -> bytes:  # noqa: F811
    return b"".join(log_stream(job.pk))


def _waited(writer: LogWriter) -> None:
    writer.partial_since -= 1.0  # the line has waited LOG_FLUSH_SECONDS: taken as far as it came
    writer.maybe_flush()


def test_a_bar_drawn_over_many_flushes_is_stored_as_one_line_with_one_timestamp(job):  # noqa: F811
    """A long epoch's bar was stored as a line every half second, each with its own timestamp and a
    newline the job never printed: a page, `gpu logs` and the download showed a bar per flush."""
    import re

    writer = LogWriter(job.pk)
    bar = keras_bar(6)
    cuts = [next(at for at in range(want, len(bar)) if bar[at] & 0xC0 != 0x80) for want in (40, 90)]
    pieces = [bar[: cuts[0]], bar[cuts[0] : cuts[1]], bar[cuts[1] :]]  # between characters
    for piece in pieces[:-1]:
        writer.feed(piece)
        _waited(writer)
        writer.flush()  # each piece stored, and readable, at once
        assert stored(job).endswith(piece) and not stored(job).endswith(b"\n")
    writer.feed(pieces[-1] + b"after\n")
    writer.close()
    assert re.fullmatch(STAMPED + re.escape(bar) + STAMPED + b"after\n", stored(job))


def test_a_portal_line_while_a_bar_is_drawn_is_a_line_of_its_own(job):  # noqa: F811
    import re

    writer = LogWriter(job.pk)
    writer.feed(b"\r1/9 [==")
    _waited(writer)
    writer.write_line("[portal] Time limit in 5 minutes.")
    writer.feed(b"\r2/9 [====\n")
    writer.close()
    expected = STAMPED + rb"\r1/9 \[==\n" + STAMPED + rb"\[portal\] Time limit in 5 minutes\.\n"
    assert re.fullmatch(expected + STAMPED + rb"\r2/9 \[====\n", stored(job))


def test_a_log_left_inside_a_line_is_gone_on_with_on_a_new_line(job):  # noqa: F811
    """Its worker stopped while a bar was drawn (killed, its host lost): the reconciler's line, and
    a writer that takes the job up again (its next run after a preemption), start lines of their own."""
    import re

    from jobs.logs.store import log_append

    writer = LogWriter(job.pk)
    writer.feed(b"\r3/9 [======")
    _waited(writer)
    writer.flush()  # and no close: the worker is gone
    log_append(job.pk, "[portal] Lost: its worker stopped answering.")
    again = LogWriter(job.pk)
    again.feed(b"resumed\n")
    again.close()
    lines = stored(job).split(b"\n")
    assert [bool(re.match(STAMPED, line)) for line in lines] == [True, True, True, False]  # then ""
    assert lines[0].endswith(b"[======") and lines[2].endswith(b"resumed")


def test_the_exact_stream_sends_a_line_being_drawn_at_once_and_the_text_form_its_whole_lines():
    from jobs.logs.stream import Cursor

    exact, text = Cursor(0, exact=True), Cursor(0)
    bar = "\r1/9 ━━".encode()
    # Not the first two of the last ━'s three bytes: they wait for the third.
    assert exact.take(bar[:-1], 0, len(bar) - 1) == event(bar[:-3], len(bar) - 3, exact=True)
    assert exact.take(bar[-1:], len(bar) - 1, len(bar)) == event(bar[-3:], len(bar), exact=True)
    assert text.take(bar, 0, len(bar)) == b""  # the text form cannot go on with a line it sent
    assert text.take(b"\n", len(bar), len(bar) + 1) == event(bar + b"\n", len(bar) + 1)
