"""Calendar feeds: each person's bookings, a team's (its leaders) and a server's (admins) as a
secret iCalendar address (RFC 5545) that calendar apps subscribe to (docs/integrations.md,
"Calendars").

A feed is a CalendarFeed row, made on first ask. Its URL holds a random secret and is the only
credential: calendar apps fetch it with no sign-in. So every fetch checks the owner's right again
(an inactive account, a leader who stopped leading, an admin who stopped being one: 404, never
403, so the answer does not confirm the address was ever good), and a new secret replaces the old
on the row, which ends the old address at once.

What an event says: one VEVENT per booking, UID `reservation-<id>@<portal host>` (stable, so an
app updates rather than duplicates), times in UTC. A booking that never held its cards (cancelled
before it began) is STATUS:CANCELLED, so apps drop it; one released or cancelled while it ran
stays CONFIRMED with DTEND moved to when it ended (what the cards really did), and says so.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import Prefetch, QuerySet
from django.urls import reverse
from django.utils import timezone

from gpus.models import Allocation, CalendarFeed, Reservation, Server, format_mb
from portal.access import VIEW, is_admin, leads_team
from portal.errors import Forbidden, Invalid
from portal.models import Team
from portal.timefmt import format_time, valid_time_zone

log = logging.getLogger(__name__)

SECRET_BYTES = 32  # token_urlsafe(32): 43 characters, 256 bits
PRODID = "-//GPU lab portal//Bookings//EN"
HELD_AT_LEAST = timedelta(minutes=1)
REFRESH = timedelta(minutes=15)  # what the feed asks apps to poll at; most poll less often anyway


# --- the feeds and their secrets -------------------------------------------------------------


def _scope(team: Team | None, server: Server | None) -> dict[str, object]:
    if team is not None:
        return {"scope": CalendarFeed.Scope.TEAM, "team": team, "server": None}
    if server is not None:
        return {"scope": CalendarFeed.Scope.SERVER, "team": None, "server": server}
    return {"scope": CalendarFeed.Scope.USER, "team": None, "server": None}


def _check_right(user: AbstractBaseUser, team: Team | None, server: Server | None) -> None:
    if team is not None and not leads_team(user, team):
        raise Forbidden(f"Only leaders of {team} get its calendar.", field="team")
    if server is not None and not is_admin(user):
        raise Forbidden("Only admins get a server's calendar.", field="server")


def calendar_scope_from(
    user: AbstractBaseUser, data: Mapping[str, object]
) -> tuple[Team | None, Server | None]:
    """The team or server named in a request ({"team": slug} or {"server": name}; neither: the
    user's own feed), checked: unknown → Invalid, not theirs to have → Forbidden, each naming the
    field. A team the user cannot see is "unknown", so outsiders do not learn it exists."""
    team_slug, server_name = data.get("team") or "", data.get("server") or ""
    if not isinstance(team_slug, str) or not isinstance(server_name, str):
        field = "team" if not isinstance(team_slug, str) else "server"
        raise Invalid(f"Give the {field} by its name, as text.", field=field)
    if team_slug and server_name:
        raise Invalid("Give a team or a server, not both.", field="server")
    team = server = None
    if team_slug:
        team = Team.objects.restrict(user, VIEW).filter(slug=team_slug).first()
        if team is None:
            raise Invalid(f"You have no team {team_slug!r}; give the slug of a team you lead.", field="team")
    if server_name:
        server = Server.objects.filter(name=server_name).first()
        if server is None:
            raise Invalid(f"No server {server_name!r}; give a name from the dashboard.", field="server")
    _check_right(user, team, server)
    return team, server


def calendar_feed_get(
    *, user: AbstractBaseUser, team: Team | None = None, server: Server | None = None
) -> CalendarFeed:
    """The user's feed of that scope, made on first ask. Forbidden (naming the field) if the user
    may not have it: a team they do not lead, a server when not an admin."""
    _check_right(user, team, server)
    scope = _scope(team, server)
    try:
        feed, _ = CalendarFeed.objects.get_or_create(
            owner=user, **scope, defaults={"secret": secrets.token_urlsafe(SECRET_BYTES)}
        )
    except IntegrityError:  # two first asks at once: the other one made it
        feed = CalendarFeed.objects.get(owner=user, **scope)
    return feed


@transaction.atomic
def calendar_feed_renew(
    *, user: AbstractBaseUser, team: Team | None = None, server: Server | None = None
) -> CalendarFeed:
    """A new secret for the user's feed of that scope: the old address answers 404 from now on."""
    feed = calendar_feed_get(user=user, team=team, server=server)
    feed = CalendarFeed.objects.select_for_update().get(pk=feed.pk)
    feed.secret = secrets.token_urlsafe(SECRET_BYTES)
    feed.created_at = timezone.now()
    feed.last_fetched_at = feed.changed_at = None
    feed.etag = ""
    feed.save(update_fields=["secret", "created_at", "last_fetched_at", "changed_at", "etag"])
    log.info("%s made a new calendar secret for %s", user, feed)  # never the secret itself
    return feed


def server_feeds_for_admin(user: AbstractBaseUser) -> dict[str, CalendarFeed]:
    """An admin's feed of every server, by server name, made where missing: two queries and one
    insert, however many servers."""
    if not is_admin(user):
        raise Forbidden("Only admins get a server's calendar.", field="server")
    mine = CalendarFeed.objects.filter(owner=user, scope=CalendarFeed.Scope.SERVER)
    feeds = {f.server_id: f for f in mine}
    servers = list(Server.objects.order_by("name"))
    missing = [
        CalendarFeed(owner=user, **_scope(None, s), secret=secrets.token_urlsafe(SECRET_BYTES))
        for s in servers
        if s.pk not in feeds
    ]
    if missing:
        CalendarFeed.objects.bulk_create(missing, ignore_conflicts=True)
        feeds = {f.server_id: f for f in mine.all()}
    return {s.name: feeds[s.pk] for s in servers if s.pk in feeds}


def calendar_feed_url(feed: CalendarFeed) -> str:
    """The feed's absolute address: calendar services fetch it from outside, so PORTAL_URL."""
    return settings.PORTAL_URL + reverse("calendar_feed", kwargs={"secret": feed.secret})


def calendar_feed_for_secret(secret: str) -> CalendarFeed | None:
    """The feed at this address if its owner may still have it, else None (the view's 404)."""
    feed = (
        CalendarFeed.objects.select_related("owner", "owner__profile", "team", "server")
        .filter(secret=secret)
        .first()
    )
    if feed is None or not feed.owner.is_active:
        return None
    if feed.scope == CalendarFeed.Scope.TEAM and not leads_team(feed.owner, feed.team_id):
        return None
    if feed.scope == CalendarFeed.Scope.SERVER and not is_admin(feed.owner):
        return None
    return feed


# --- the content -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FeedEvent:
    """One booking as the feed shows it: what the fingerprint hashes and the VEVENT says."""

    uid: str
    start: datetime
    end: datetime
    cancelled: bool
    summary: str
    description: str
    location: str  # the cards, e.g. "box1 GPU 0, 1": where apps show a place
    url: str
    created: datetime


@dataclass(frozen=True)
class ServedFeed:
    name: str
    events: list[FeedEvent]
    etag: str  # a hash of name and events, quoted as an HTTP entity tag
    changed_at: datetime  # when a fetch first saw this content: Last-Modified and DTSTAMP


def calendar_name(feed: CalendarFeed) -> str:
    if feed.scope == CalendarFeed.Scope.TEAM:
        return f"Team {feed.team.name} bookings"
    if feed.scope == CalendarFeed.Scope.SERVER:
        return f"Server {feed.server.name} bookings"
    return f"GPU bookings · {feed.owner.username}"


def feed_bookings(feed: CalendarFeed, now: datetime) -> list[Reservation]:
    """The feed's bookings, oldest first: those that ended within CALENDAR_PAST_DAYS and all
    ahead, at most CALENDAR_MAX_EVENTS (the oldest go first). Two queries, however many."""
    bookings: QuerySet[Reservation] = Reservation.objects.all()
    if feed.scope == CalendarFeed.Scope.TEAM:
        bookings = bookings.filter(team_id=feed.team_id)
    elif feed.scope == CalendarFeed.Scope.SERVER:
        held = Allocation.objects.filter(gpu__server_id=feed.server_id).values("reservation_id")
        bookings = bookings.filter(pk__in=held)
    else:
        bookings = bookings.filter(owner_id=feed.owner_id)
    cards = Prefetch("allocations", queryset=Allocation.objects.select_related("gpu__server"))
    bookings = (
        bookings.filter(end__gte=now - timedelta(days=settings.CALENDAR_PAST_DAYS))
        .select_related("owner", "team", "released_by", "cancelled_by")
        .prefetch_related(cards)
        .order_by("-start", "-id")
    )
    return sorted(bookings[: settings.CALENDAR_MAX_EVENTS], key=lambda r: (r.start, r.pk))


def _cards(allocations: list[Allocation]) -> tuple[str, str]:
    """('2 cards on box1', 'box1 GPU 0, 1 · whole cards') for the summary and the description."""
    if not allocations:
        return "no cards", "no cards"
    server = allocations[0].gpu.server.name
    indices = ", ".join(str(a.gpu.index) for a in allocations)
    memory = allocations[0].memory_mb
    if len(allocations) == 1:
        card = f"{server} GPU {indices}"
        short = card if memory is None else f"{format_mb(memory)} of {card}"
        return short, f"{card} · {'whole card' if memory is None else format_mb(memory)}"
    if memory is None:
        return f"{len(allocations)} cards on {server}", f"{server} GPU {indices} · whole cards"
    each = format_mb(memory)
    return f"{each} on each of {len(allocations)} cards of {server}", f"{server} GPU {indices} · {each} each"


def _location(allocations: list[Allocation]) -> str:
    if not allocations:
        return ""
    return f"{allocations[0].gpu.server.name} GPU {', '.join(str(a.gpu.index) for a in allocations)}"


def _ending(booking: Reservation) -> tuple[bool, str, str]:
    """(never held its cards, the summary's suffix, the description's line) for how it ended.
    Held for less than a minute counts as never: an event needs DTEND after DTSTART."""
    held_briefly = booking.end - booking.start < HELD_AT_LEAST
    if booking.cancelled_at is not None:
        who = f" by {booking.cancelled_by}" if booking.cancelled_by else " by the portal"
        why = f": {booking.cancel_reason}" if booking.cancel_reason else ""
        never_held = booking.cancelled_at <= booking.start or held_briefly
        suffix = "" if never_held else " (cancelled)"
        return never_held, suffix, f"Cancelled{who} at {format_time(booking.cancelled_at)}{why}"
    if booking.released_at is not None:
        who = f" by {booking.released_by}" if booking.released_by else " by the portal"
        why = f": {booking.release_reason}" if booking.release_reason else ""
        line = f"Released early{who} at {format_time(booking.released_at)}{why}"
        return held_briefly, "" if held_briefly else " (released early)", line
    return False, "", ""


def feed_event(booking: Reservation, host: str) -> FeedEvent:
    allocations = sorted(booking.allocations.all(), key=lambda a: a.gpu.index)
    short, cards = _cards(allocations)
    never_held, suffix, ended = _ending(booking)
    url = settings.PORTAL_URL + reverse("reservation_detail", kwargs={"pk": booking.pk})
    lines = [f"Booked by {booking.owner.username} for {booking.team.name}", f"Cards: {cards}"]
    lines += [f"Note: {booking.note}"] if booking.note else []
    lines += [ended] if ended else []
    lines.append(url)
    return FeedEvent(
        uid=f"reservation-{booking.pk}@{host}",
        start=booking.start,
        end=booking.booked_end if never_held else booking.end,  # a cancelled event keeps its length
        cancelled=never_held,
        summary=f"{booking.owner.username} · {short}{suffix}",
        description="\n".join(lines),
        location=_location(allocations),
        url=url,
        created=booking.created_at,
    )


def _zone_of(user: AbstractBaseUser) -> str:
    """The owner's profile zone (select_related with the feed), else the portal's."""
    profile = getattr(user, "profile", None)  # none made yet: RelatedObjectDoesNotExist, an AttributeError
    return valid_time_zone(getattr(profile, "time_zone", "") or "") or settings.TIME_ZONE


def _fingerprint(name: str, events: list[FeedEvent]) -> str:
    return '"' + hashlib.sha256(repr((name, events)).encode()).hexdigest()[:32] + '"'


def calendar_feed_serve(*, feed: CalendarFeed, now: datetime | None = None) -> ServedFeed:
    """The feed's content now, its entity tag and when it last changed; records the fetch (one
    UPDATE). Its queries do not grow with the bookings."""
    now = now or timezone.now()
    host = urlsplit(settings.PORTAL_URL).hostname or "gpu-portal"
    with timezone.override(_zone_of(feed.owner)):  # the times the descriptions name
        events = [feed_event(booking, host) for booking in feed_bookings(feed, now)]
    name = calendar_name(feed)
    etag = _fingerprint(name, events)
    changed_at = feed.changed_at
    if etag != feed.etag or changed_at is None:
        # Whole seconds, as HTTP dates are; later than the last change even within its second, so
        # an If-Modified-Since of that change never hides this one.
        changed_at = now.replace(microsecond=0)
        if feed.changed_at is not None and changed_at <= feed.changed_at:
            changed_at = feed.changed_at + timedelta(seconds=1)
    CalendarFeed.objects.filter(pk=feed.pk).update(last_fetched_at=now, etag=etag, changed_at=changed_at)
    return ServedFeed(name=name, events=events, etag=etag, changed_at=changed_at)


# RFC 5545 3.3.11: TEXT holds no CONTROL character but HTAB; a line break is written `\n`.
_NOT_TEXT = {c: None for c in [*range(0x20), 0x7F] if c not in (0x09, 0x0A)}


def ics_text(text: str) -> str:
    r"""`text` escaped as RFC 5545 TEXT, every character as written: icalendar's own escape reads
    a `\N` in it as a line break (`D:\New` would arrive as `D:`, a new line, `ew`)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").translate(_NOT_TEXT)
    return text.replace("\\", "\\\\").replace(";", "\\;").replace(",", "\\,").replace("\n", "\\n")


def calendar_ics(served: ServedFeed) -> bytes:
    """The VCALENDAR (RFC 5545: CRLF, folded at 75 octets by icalendar)."""
    # Here, not at the top: every process imports this module (the profile's calendar slot), few
    # serve a feed, and icalendar takes 100 ms to import.
    from icalendar import Calendar, Event
    from icalendar.prop import vDuration, vText

    class Text(vText):
        __slots__ = ()

        def to_ical(self) -> bytes:
            return ics_text(self).encode(self.encoding)

    calendar = Calendar()
    calendar.add("prodid", PRODID)
    calendar.add("version", "2.0")
    calendar.add("calscale", "GREGORIAN")
    calendar.add("method", "PUBLISH")
    calendar.add("x-wr-calname", Text(served.name))
    calendar.add("x-wr-caldesc", Text(f"{served.name}, from the GPU lab portal ({settings.PORTAL_URL})"))
    calendar.add("x-published-ttl", vDuration(REFRESH))  # an X- property: icalendar cannot tell its type
    calendar.add("refresh-interval", REFRESH, parameters={"VALUE": "DURATION"})
    for item in served.events:
        event = Event()
        event.add("uid", item.uid)
        # DTSTAMP: when the portal last revised this content (a published feed's meaning).
        event.add("dtstamp", served.changed_at)
        event.add("created", item.created)
        event.add("dtstart", item.start)
        event.add("dtend", item.end)
        event.add("summary", Text(item.summary))
        event.add("description", Text(item.description))
        if item.location:
            event.add("location", Text(item.location))
        event.add("url", item.url, parameters={"VALUE": "URI"})
        event.add("status", "CANCELLED" if item.cancelled else "CONFIRMED")
        event.add("transp", "TRANSPARENT" if item.cancelled else "OPAQUE")
        calendar.add_component(event)
    return calendar.to_ical()
