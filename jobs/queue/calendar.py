"""The queue's calendar: every card's bookings from now on and the shadows the plan adds, with the
"does it fit" checks the plan (jobs/queue/rules.py) asks of it.

Whether a request fits a card is the booking service's own rule (gpus.conflicts.fits_at_once,
fits_on_card), so the plan never starts a job the booking service then refuses. The rest is kept
cheap for a full cluster, where a thousand pending jobs ask, in a few dozen shapes, of every server,
and nearly every answer is no:

- each card's lists are sorted by start, so a check reads only the bookings that begin before
  the window ends;
- what each card holds right now (a whole booking, the MiB of its shares) is kept, so a window
  from now fails on it before reading a list, and so each card knows from when it could take a
  request at the earliest: now, or when the first of what it holds now ends (`_from`). From that
  come how many of a server's cards could take it now (`room_cards`) and a lower bound of its
  earliest start (`free_from`): the servers without enough room are passed over at once, and an
  estimate tries the servers from the soonest they could start it (`soonest`), stopping at the
  first that cannot beat the best found;
- those answers are kept per server and shape until a start changes what a server holds now.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from gpus.conflicts import fits_at_once, fits_on_card


class Card(NamedTuple):
    """A card the plan may use: a plain value, one per card of every online server each pass."""

    uuid: str
    server_id: int
    bookable_mb: int


Busy = tuple[datetime, datetime, int | None]  # a booking on a card: [start, end), MiB (None: whole)


class Calendar:
    """Every card's bookings from now on, and the shadows the plan adds (see the module's text)."""

    def __init__(
        self,
        cards: Iterable[Card],
        busy: dict[str, list[Busy]],
        now: datetime,
        horizon: datetime | None = None,
        *,
        slots: dict[int, int] | None = None,
        silent: dict[int, str] | None = None,
    ) -> None:
        self.now = now
        # Free job slots of the servers whose worker's pool size is known: no more jobs start
        # there now than it can run at once (the rest would wait in Celery on running bookings).
        self.slots = dict(slots or {})
        # Servers whose worker reported its slots once but not lately, with the words that say so:
        # nothing starts there (no slots), and no estimate counts on them until the worker is back.
        self.silent = dict(silent or {})
        for server in self.silent:
            self.slots[server] = 0
        # Bookings are known up to here (the caller read no further): no estimate goes past it.
        self.horizon = horizon
        self.cards = {c.uuid: c for c in cards}
        self.by_server: dict[int, list[Card]] = defaultdict(list)
        for card in sorted(self.cards.values(), key=lambda c: (c.server_id, c.uuid)):
            self.by_server[card.server_id].append(card)
        self.busy = {uuid: sorted(busy.get(uuid, ())) for uuid in self.cards}
        self.shadows: dict[str, list[Busy]] = defaultdict(list)
        self.version: dict[int, int] = defaultdict(int)  # per server: bumped on every change
        self.silent_version = 0  # bumped on every change to a silent server's cards
        # What is held right now on each card: a whole booking, or the MiB of the shares. Any
        # window from now overlaps these, so a check can fail on them before reading a list.
        self.taken_now = {uuid for uuid, held in self.busy.items() if any(_whole_now(b, now) for b in held)}
        self.shared_now = {
            uuid: sum(b[2] or 0 for b in held if b[2] is not None and b[0] <= now < b[1])
            for uuid, held in self.busy.items()
        }
        self._never = datetime.max.replace(tzinfo=now.tzinfo)  # a card too small for the request
        # Kept until a start changes what is held now: per server, its cards no whole-card hold
        # takes now and when the first hold on each of the others ends (`_held_now`); per server
        # and memory asked, how many cards could take it now (`room_cards`) and from when each
        # could (`_card_bounds`); per memory, the servers with room now (`roomy`); per count and
        # memory, the servers by how soon they could (`soonest`). Per server, the times `earliest`
        # tries, as of the server's version.
        self._held_now: dict[int, tuple[list[str], list[datetime]]] = {}
        self._room: dict[int, dict[int | None, int]] = defaultdict(dict)
        self._from: dict[int, dict[int | None, list[datetime]]] = defaultdict(dict)
        self._roomy: dict[tuple[int | None, bool], list[tuple[int, int]]] = {}
        self._soonest: dict[tuple[int, int | None], list[tuple[datetime, int, int]]] = {}
        self._ends: dict[int, tuple[int, datetime, list[datetime]]] = {}

    def add(
        self,
        uuids: Sequence[str],
        start: datetime,
        end: datetime,
        memory_mb: int | None,
        *,
        shadow: bool = False,
    ) -> None:
        for uuid in uuids:
            server = self.cards[uuid].server_id
            insort((self.shadows if shadow else self.busy)[uuid], (start, end, memory_mb))
            self.version[server] += 1
            self.silent_version += server in self.silent
            if not shadow and start <= self.now < end:
                if memory_mb is None:
                    self.taken_now.add(uuid)
                else:
                    self.shared_now[uuid] += memory_mb
                for kept in (self._held_now, self._room, self._from):
                    kept.pop(server, None)
                self._roomy.clear()
                self._soonest.clear()

    def start(self, uuids: Sequence[str], end: datetime, memory_mb: int | None) -> None:
        """A job the plan starts now on these cards (of one server) until `end`: their room, and a
        slot of the server's worker where it said how many it has."""
        self.add(uuids, self.now, end, memory_mb)
        server = self.cards[uuids[0]].server_id
        if server in self.slots:
            self.slots[server] -= 1
        self._roomy.clear()

    def fits(
        self, uuid: str, start: datetime, end: datetime, memory_mb: int | None, *, shadows: bool = True
    ) -> bool:
        """The booking service's rule (gpus.conflicts.fits_on_card) over the bookings, and the
        shadows unless told not to, that overlap [start, end)."""
        if start <= self.now < end and not self.could_fit_now(uuid, memory_mb):
            return False
        overlapping = _overlapping(self.busy[uuid], start, end)
        if shadows and self.shadows:
            overlapping += _overlapping(self.shadows[uuid], start, end)
        return fits_on_card(self.cards[uuid].bookable_mb, memory_mb, overlapping, start, end)

    def free_cards(
        self,
        server: int,
        start: datetime,
        end: datetime,
        memory_mb: int | None,
        *,
        shadows: bool = True,
        need: int | None = None,
    ) -> list[str]:
        """The server's cards free for the request over [start, end), in the server's order.
        `need`: the caller wants that many: the first `need` come back, or fewer (not enough),
        found without checking the cards that can no longer change the answer."""
        cards = self.by_server[server]
        if need is None:
            return [c.uuid for c in cards if self.fits(c.uuid, start, end, memory_mb, shadows=shadows)]
        free: list[str] = []
        for checked, card in enumerate(cards):
            if len(free) >= need or len(free) + len(cards) - checked < need:
                break
            if self.fits(card.uuid, start, end, memory_mb, shadows=shadows):
                free.append(card.uuid)
        return free

    def could_fit_now(self, uuid: str, memory_mb: int | None) -> bool:
        """False when what the card holds right now already rules the request out: the same rule
        (gpus.conflicts.fits_at_once) over the whole-card hold or the sum of the shares now."""
        if uuid in self.taken_now:
            return False  # a whole-card hold leaves no room, whatever is asked (fits_at_once's rule)
        held_now: list[int | None] = []
        if self.shared_now[uuid]:
            held_now.append(self.shared_now[uuid])
        return fits_at_once(self.cards[uuid].bookable_mb, memory_mb, held_now)

    def room_now(self, server: int, memory_mb: int | None) -> int:
        """How many of the server's cards could take the request from now: an upper bound (0 when
        its worker has no free slot)."""
        if self.slots.get(server, 1) <= 0:
            return 0
        return self.room_cards(server, memory_mb)

    def room_cards(self, server: int, memory_mb: int | None) -> int:
        """`room_now` by the cards alone, whatever the worker's slots (a silent worker's server)."""
        known = self._room[server]
        if memory_mb not in known:
            open_now, _ = self._now_on(server)
            known[memory_mb] = sum(1 for uuid in open_now if self.could_fit_now(uuid, memory_mb))
        return known[memory_mb]

    def roomy(self, memory_mb: int | None, *, silent: bool = False) -> list[tuple[int, int]]:
        """(server, `room_now`) of every server with room for the request now, in the servers' order:
        on a full cluster a short list, so a job that fits nowhere is known without asking each.
        `silent`: the silent workers' servers instead, by their cards alone (`room_cards`)."""
        key = (memory_mb, silent)
        if key not in self._roomy:
            if silent:
                servers = [server for server in self.by_server if server in self.silent]
                rooms = ((server, self.room_cards(server, memory_mb)) for server in servers)
            else:
                rooms = ((server, self.room_now(server, memory_mb)) for server in self.by_server)
            self._roomy[key] = [(server, room) for server, room in rooms if room > 0]
        return self._roomy[key]

    def free_from(self, server: int, count: int, memory_mb: int | None) -> datetime | None:
        """A time before which `count` of the server's cards cannot take the request (None: never):
        a lower bound of `earliest` from now. A card that what it holds now rules out stays so
        until one of those holds ends (more holds only leave less room)."""
        if count <= 0:
            return self.now
        bounds = self._card_bounds(server, memory_mb)
        if count > len(bounds) or bounds[count - 1] == self._never:
            return None
        return bounds[count - 1]

    def soonest(self, count: int, memory_mb: int | None) -> list[tuple[datetime, int, int]]:
        """(`free_from`, place in the servers' order, server) of every server that could ever take
        `count` cards of the request, soonest first (in the servers' order among equals). Not a
        silent worker's: when it comes back is anyone's guess, so no estimate counts on it."""
        key = (count, memory_mb)
        if key not in self._soonest:
            servers = [(place, s) for place, s in enumerate(self.by_server) if s not in self.silent]
            bounds = [(self.free_from(s, count, memory_mb), place, s) for place, s in servers]
            self._soonest[key] = sorted((b, place, s) for b, place, s in bounds if b is not None)
        return self._soonest[key]

    def earliest(
        self, server: int, count: int, length: timedelta, memory_mb: int | None, not_before: datetime
    ) -> datetime | None:
        """The first time ≥ not_before at which `count` cards of `server` are free for `length`:
        only the end of a booking or a shadow can free a card, so those are the times worth trying,
        from the first at which what the cards hold now lets enough of them (`free_from`)."""
        if len(self.by_server[server]) < count:
            return None
        if (bound := self.free_from(server, count, memory_mb)) is None:
            return None  # not enough of its cards could ever take it
        times = self._candidates(server, not_before)
        for at in times[bisect_left(times, bound) :]:
            if self.horizon is not None and at + length > self.horizon:
                return None  # later than the calendar reaches
            if len(self.free_cards(server, at, at + length, memory_mb, need=count)) >= count:
                return at
        return None

    def _candidates(self, server: int, not_before: datetime) -> list[datetime]:
        """not_before and every end of a booking or shadow on the server after it, in order."""
        kept = self._ends.get(server)
        if kept is None or kept[:2] != (self.version[server], not_before):
            times = {not_before}
            for card in self.by_server[server]:
                times.update(b[1] for b in self.busy[card.uuid] if b[1] > not_before)
                times.update(b[1] for b in self.shadows[card.uuid] if b[1] > not_before)
            kept = self._ends[server] = (self.version[server], not_before, sorted(times))
        return kept[2]

    def _card_bounds(self, server: int, memory_mb: int | None) -> list[datetime]:
        """From when each of the server's cards could take the request, sorted: now where it
        could right now, else the end of the first of what it holds now; never for a card that
        could not with nothing on it (it asks more than the card has)."""
        known = self._from[server]
        if memory_mb not in known:
            open_now, taken_until = self._now_on(server)
            bounds = [self.now if self.could_fit_now(u, memory_mb) else self._held_until(u) for u in open_now]
            known[memory_mb] = sorted(bounds + taken_until)
        return known[memory_mb]

    def _now_on(self, server: int) -> tuple[list[str], list[datetime]]:
        """The server's cards that no whole-card hold takes right now, and when the first hold on
        each of the others ends, sorted: on a full cluster nearly every card is taken whole, and
        such a card has no room for any request (fits_at_once's rule)."""
        if server not in self._held_now:
            cards = [c.uuid for c in self.by_server[server]]
            taken_until = sorted(self._held_until(u) for u in cards if u in self.taken_now)
            self._held_now[server] = ([u for u in cards if u not in self.taken_now], taken_until)
        return self._held_now[server]

    def _held_until(self, uuid: str) -> datetime:
        ends = (b[1] for b in self.busy[uuid] if b[0] <= self.now < b[1])
        return min(ends, default=self._never)


def _whole_now(booking: Busy, now: datetime) -> bool:
    return booking[2] is None and booking[0] <= now < booking[1]


def _overlapping(held: list[Busy], start: datetime, end: datetime) -> list[Busy]:
    """The bookings of a start-sorted list that overlap [start, end): stop at the first that begins
    after the window."""
    found = []
    for booking in held:
        if booking[0] >= end:
            break
        if booking[1] > start:
            found.append(booking)
    return found
