"""Every question portal asks an app above it (portal < gpus < jobs), in one place: who asks, who
answers, and the answer when no app does. The apps above register in their AppConfig.ready().

- Template slots: a place on a lower app's page that a higher app fills with a template and,
  where it needs more than the page's context, a function of that context. A page names a slot
  (`{% load slot_tags %}{% slot "profile_quotas" %}`); `slot_fill` fills it. So portal's profile
  shows gpus' quotas, and gpus' bookings show jobs' Run buttons, without a lower app's template
  naming a higher app's templates or tag libraries. No filling: the slot renders nothing.
  - PROFILE_QUOTAS: templates/portal/profile.html; gpus fills it with the viewer's quotas and
    use (gpus.slots.slots_fill).
  - PROFILE_CALENDAR: the profile too; gpus fills it with the viewer's own booking feed
    (gpus.calendar_views.profile_calendar).
  - RESERVATION_ACTIONS: gpus' booking pages, beside each open booking `r` of its owner (with
    `next`, the page to come back to); jobs fills it with its Run buttons (jobs/_run_buttons.html).
  - RESERVATION_SESSIONS: gpus' booking page, for whoever sees the booking `r`; jobs fills it
    with the booking's interactive sessions (jobs.sessions.services.booking_sessions_context).
  - REPORTS_LENDING: gpus' Reports page, for its period (`report`); jobs fills it with the
    GPU-hours lent to the queue and used by borrowers (jobs.lending_report.reports_context).
- `worker_hosts()`: which GPU hosts this machine runs a host worker for, and whether they are
  simulated. Asked by `make run` (runportal); gpus answers (gpus.hosts.worker_servers,
  `host_discovery_register`); no answer: none.

gpus' own questions to jobs are declared the same way in gpus/hooks.py. The wake-up channels
(portal.wakeups) are names, not answers: whoever frees cards pushes, the scheduler waits.

What is registered lives on portal's AppConfig, not in a module global: the app registry is the
one object per process Django builds once; a test swaps it with `registry_swap`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.apps import apps
from django.template import Context

SlotContext = Callable[[Context], Mapping[str, Any]]
# (server names, whether they are simulated)
HostDiscovery = Callable[[], tuple[list[str], bool]]

PROFILE_QUOTAS = "profile_quotas"
PROFILE_CALENDAR = "profile_calendar"
RESERVATION_ACTIONS = "reservation_actions"
RESERVATION_SESSIONS = "reservation_sessions"
REPORTS_LENDING = "reports_lending"


class HostDiscoveryError(Exception):
    """This machine's GPUs cannot be found as configured (e.g. GPU_BACKEND=nvml without NVML)."""


@dataclass(frozen=True)
class Filling:
    template: str
    context: SlotContext | None = None


@dataclass
class Registry:
    """What the apps above portal registered: the slots' fillings and the one host discovery."""

    fillings: dict[str, list[Filling]] = field(default_factory=dict)
    host_discovery: HostDiscovery | None = None


def registry() -> Registry:
    config = apps.get_app_config("portal")
    if not hasattr(config, "registry"):
        config.registry = Registry()  # type: ignore[attr-defined]
    return config.registry  # type: ignore[attr-defined]


def registry_swap(replacement: Registry) -> Registry:
    """Put `replacement` in place; returns the one it replaced (a test puts it back)."""
    before = registry()
    apps.get_app_config("portal").registry = replacement  # type: ignore[attr-defined]
    return before


def slot_fill(slot: str, template: str, context: SlotContext | None = None) -> None:
    """Render `template` where pages name `slot`, with the page's context plus what `context`
    returns. Filling a slot with the same template again replaces it (ready() may run twice)."""
    fillings = registry().fillings
    kept = [f for f in fillings.get(slot, []) if f.template != template]
    fillings[slot] = [*kept, Filling(template, context)]


def slot_fillings(slot: str) -> tuple[Filling, ...]:
    return tuple(registry().fillings.get(slot, ()))


def host_discovery_register(discovery: HostDiscovery) -> None:
    """Set the one answer (gpus' AppConfig.ready()); registering again replaces it."""
    registry().host_discovery = discovery


def worker_hosts() -> tuple[list[str], bool]:
    """The servers this machine runs a host worker for, and whether they are simulated; none when
    no app registered an answer."""
    discovery = registry().host_discovery
    if discovery is None:
        return [], False
    return discovery()
