"""Template slots: a place on a lower app's page that a higher app fills (portal < gpus < jobs).

A page names a slot (`{% load slot_tags %}{% slot "profile_quotas" %}`); an app above fills it in
its AppConfig.ready() with a template and, where it needs more than the page's context, a
function of that context. So portal's profile shows gpus' quotas, and gpus' bookings show jobs'
Run buttons, without a lower app's template naming a higher app's templates or tag libraries.
An empty slot renders nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.template import Context

SlotContext = Callable[[Context], Mapping[str, Any]]

# The slots the pages name, and who fills them.
# templates/portal/profile.html; gpus fills it with the viewer's quotas and use.
PROFILE_QUOTAS = "profile_quotas"
# gpus' booking pages, beside each open booking `r` of its owner (with `next`, the page to come
# back to); jobs fills it with its Run buttons.
RESERVATION_ACTIONS = "reservation_actions"
# gpus' booking page, for whoever sees the booking `r`: jobs fills it with the booking's
# interactive sessions (gpu exec, gpu shell), shown to those who may see them.
RESERVATION_SESSIONS = "reservation_sessions"


@dataclass(frozen=True)
class Filling:
    template: str
    context: SlotContext | None = None


_fillings: dict[str, list[Filling]] = {}


def slot_fill(slot: str, template: str, context: SlotContext | None = None) -> None:
    """Render `template` where pages name `slot`, with the page's context plus what `context`
    returns. Filling a slot with the same template again replaces it (ready() may run twice)."""
    fillings = [f for f in _fillings.get(slot, []) if f.template != template]
    _fillings[slot] = [*fillings, Filling(template, context)]


def slot_fillings(slot: str) -> tuple[Filling, ...]:
    return tuple(_fillings.get(slot, ()))
