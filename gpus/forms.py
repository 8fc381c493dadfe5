"""Booking forms (and the violation and drain actions'). They normalise input; every rule lives in
the services (gpus/booking.py, gpus/violations.py, gpus/servers.py)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django import forms
from django.utils import timezone

from gpus.booking import request_problems
from gpus.booking_defaults import cards_at_once, empty_end, form_defaults, limits_in_words
from gpus.models import GPU, Server, format_mb
from gpus.servers import REASON_MAX
from portal.forms import CARDS_ERRORS, SERVER_ERRORS, ServiceErrorsMixin
from portal.models import Membership

_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([GM])(?:I?B)?)?\s*$", re.IGNORECASE)
LOCAL_INPUT = "%Y-%m-%dT%H:%M"


def parse_memory_mb(text: str) -> int | None:
    """'16G', '16 GiB', '16 GB' → 16384; '16384M', '16384 MiB' → 16384; '' → None (whole cards).

    Always binary units (G = GiB = 1024 MiB), as NVML and nvidia-smi count card memory; 'GB' is
    read as GiB too, because that is what people mean when they copy a size from nvidia-smi.
    """
    if not text.strip():
        return None
    match = _MEMORY.match(text)
    if not match:
        raise forms.ValidationError(
            f"{text!r} is not a memory size: write it like 16G, 16 GiB or 16384M, "
            "or leave it empty for whole cards."
        )
    number, unit = float(match[1]), (match[2] or "").upper()
    if not unit:
        raise forms.ValidationError(f"Add a unit: {match[1]}G for GiB or {match[1]}M for MiB.")
    mb = round(number * 1024) if unit == "G" else round(number)
    if mb <= 0:
        raise forms.ValidationError("Memory must be more than 0; leave it empty to book whole cards.")
    return mb


def format_memory_input(mb: int) -> str:
    """A memory per card as the field reads it back (parse_memory_mb): '16G', else '16000M'."""
    return f"{mb // 1024}G" if mb % 1024 == 0 else f"{mb}M"


def local_input(at: datetime) -> str:
    return timezone.localtime(at).strftime(LOCAL_INPUT)


class LocalDateTimeInput(forms.DateTimeInput):
    input_type = "datetime-local"

    def __init__(self) -> None:
        super().__init__(format=LOCAL_INPUT)


def _hours(length: timedelta) -> str:
    return f"{length.total_seconds() / 3600:g} h"


def _gpu_choices(gpus: Iterable[GPU]) -> list[tuple[str, list[tuple[str, str]]]]:
    grouped: dict[str, list[tuple[str, str]]] = {}
    for gpu in gpus:
        label = f"GPU {gpu.index} · {gpu.name} · {format_mb(gpu.memory_bookable_mb)} bookable"
        grouped.setdefault(gpu.server.name, []).append((gpu.uuid, label))
    return list(grouped.items())


class ReservationForm(ServiceErrorsMixin, forms.Form):
    """Either tick cards, or ask for a count (on a server or anywhere) and let the portal pick."""

    gpus = forms.MultipleChoiceField(
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label="Cards",
        help_text="Tick the cards you want (all on one server), or leave them all unticked and give a count.",
    )
    count = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=64,
        error_messages=CARDS_ERRORS,
        help_text="How many cards the portal should pick: the least loaded that fit, kept on one server. "
        "Ignored while cards are ticked and it is left at its default.",
    )
    server = forms.ChoiceField(
        required=False,
        error_messages=SERVER_ERRORS,
        help_text="Where to pick the cards; any online server if empty.",
    )
    memory = forms.CharField(
        required=False,
        max_length=20,
        label="Memory per card",
        help_text="A share of each card, e.g. 16G (GiB) or 16384M (MiB). Empty: whole cards (exclusive).",
    )
    start = forms.DateTimeField(required=False, widget=LocalDateTimeInput(), help_text="Empty: now.")
    end = forms.DateTimeField(required=False, widget=LocalDateTimeInput())
    note = forms.CharField(required=False, max_length=500, widget=forms.Textarea(attrs={"rows": 2}))
    team = forms.ChoiceField(required=False, help_text="The team whose quota this booking counts against.")

    service_fields = {"memory_mb": "memory"}

    def __init__(self, *args: Any, user: Any, server_name: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        gpus = GPU.objects.select_related("server").filter(server__draining=False)
        if server_name:
            gpus = gpus.filter(server__name=server_name)
        self.offered = list(gpus.order_by("server__name", "index"))
        self.fields["gpus"].choices = _gpu_choices(self.offered)
        self.fields["server"].choices = [("", "any online server")] + [
            (name, name) for name in Server.objects.filter(draining=False).values_list("name", flat=True)
        ]
        # Said beside the choices, so nobody wonders where a server went (an admin drained it).
        self.draining = list(Server.objects.filter(draining=True).values_list("name", "drain_reason"))
        teams = list(user.memberships.select_related("team").order_by("team__name"))
        self.fields["team"].choices = [(m.team.slug, m.team.name) for m in teams]
        if len(teams) <= 1:
            self.fields["team"].widget = forms.HiddenInput()
        # Each team's limits in words, shown above the fields before anything is submitted.
        self.limits = [(m.team.name, limits_in_words(m)) for m in teams]
        self._set_defaults(teams)

    def _set_defaults(self, teams: list[Membership]) -> None:
        """Defaults that fit the person's limits in any of their teams (gpus/booking_defaults.py):
        one card (unless they may hold no whole card), ticked cards no more than they may hold at
        once, a share of each card when whole ones would pass their GiB at once, the end within
        their longest booking and the GPU-hours left this week. A count left at its default gives
        way to ticked cards (clean)."""
        most = min((n for n in map(cards_at_once, teams) if n is not None), default=None)
        if most != 0:
            self.fields["count"].initial = 1
        tz = timezone.get_current_timezone_name()
        self.fields["end"].help_text = f"Empty: {_hours(empty_end(teams))} after the start. Times in {tz}."
        if self.is_bound:
            return  # a submit is judged by the service: no use is read for defaults nobody sees
        now = timezone.now().replace(second=0, microsecond=0)
        asked = list(self.initial.get("gpus") or [])  # a card's Reserve button (?gpu=)
        preset = asked if most is None else asked[:most]
        count = len(preset) or (1 if most != 0 else 0)
        cards = [g for g in self.offered if g.uuid in preset] if preset else self.offered
        defaults = form_defaults(teams, cards, count, now)
        self.initial.setdefault("start", local_input(now))
        self.initial.setdefault("end", local_input(now + defaults.length))
        if defaults.memory_mb is not None:
            self.initial.setdefault("memory", format_memory_input(defaults.memory_mb))
        if teams:
            self.initial.setdefault("team", teams[0].team.slug)
        if asked:
            self.initial["gpus"] = preset
            self.initial["count"] = None

    def clean_memory(self) -> int | None:
        return parse_memory_mb(self.cleaned_data["memory"])

    def clean(self) -> dict[str, Any]:
        """The booking service's own checks of what parsed, beside the parsing errors: one submit
        names every problem (a field that did not parse is not judged again)."""
        data = super().clean() or {}
        if data.get("gpus") and "count" not in self.changed_data:
            data["count"] = None  # the count's default, left as it was: the ticked cards say it
        problems = request_problems(
            gpus=data.get("gpus") or None,
            count=data.get("count"),
            memory_mb=data.get("memory"),
            note=data.get("note") or "",
            start=data.get("start"),
            end=data.get("end"),
            unread={"memory_mb" if name == "memory" else name for name in self.errors},
        )
        for field, messages in problems.items():
            name = self.service_fields.get(field, field)
            for message in messages:
                self.add_error(name if name in self.fields else None, message)
        return data

    def service_kwargs(self) -> dict[str, Any]:
        data = self.cleaned_data
        return {
            "gpus": data["gpus"] or None,
            "count": data["count"],
            "server": data["server"] or None,
            "memory_mb": data["memory"],
            "start": data["start"],
            "end": data["end"],
            "note": data["note"],
            "team": data["team"] or None,
        }


class ExtendForm(forms.Form):
    end = forms.DateTimeField(widget=LocalDateTimeInput(), label="New end")


class CancelForm(ServiceErrorsMixin, forms.Form):
    """A cancel's reason; its rule is the service's (gpus.booking.cancel_reason_check)."""

    reason = forms.CharField(
        required=False,
        max_length=500,
        help_text="Required when you cancel someone else's booking: the owner sees it.",
    )


class ViolationStopForm(ServiceErrorsMixin, forms.Form):
    """ "Stop it now" on a violation's page (gpus/violations.py checks who and when)."""

    reason = forms.CharField(
        required=False,
        max_length=500,
        label="Why (optional)",
        help_text="Said to the person behind it, in the job's log and in the audit log.",
    )


class ViolationResolveForm(ServiceErrorsMixin, forms.Form):
    """ "Mark resolved" on a violation's page: the note is the record of what was done."""

    note = forms.CharField(
        max_length=500,
        label="How it was resolved",
        help_text="E.g. “bob's test run, agreed with alice”. An open one is then left running.",
        error_messages={"required": "Say how it was resolved, e.g. “bob's test run, agreed with alice”."},
    )


class ServerDrainForm(ServiceErrorsMixin, forms.Form):
    """Drain a server or put it back (admins; gpus/servers.py has the rules). `draining=on`
    drains, anything else puts it back, as the server page's two buttons send."""

    draining = forms.CharField(required=False)
    reason = forms.CharField(
        required=False,
        max_length=REASON_MAX,
        label="Why",
        error_messages={
            "null_characters_not_allowed": "The reason holds a NUL character; write it without one.",
            "max_length": f"Keep the reason to {REASON_MAX} characters at most.",
        },
    )

    def clean_draining(self) -> bool:
        return self.cleaned_data["draining"] == "on"
